//! Concurrency limits (`concurrent:`), as pure logic over one key's leases: how many requests
//! of the key are in flight. Each admission takes a lease named by the request's member (its
//! lease id) and holds it until the request is over; a release removes that lease only, so a
//! release repeated, or of a lease already reclaimed, frees nothing. `scripts/concurrency.lua`
//! is the same inside Redis, where leases also carry their instance and are reclaimed when it
//! stops renewing them (`leases`); in process there is no other instance, so a lease lives
//! exactly as long as its request's guard.
//!
//! A full key's wait is a hint: the average time a lease was held, divided by the leases
//! held (the expected time until the first of them ends when holds are alike); one second
//! before any lease has ended.

use std::collections::HashMap;
use std::time::Duration;

use super::{LimitState, Room, Spec};

/// The hint before any lease of the key has ended.
const FIRST_HINT_US: u64 = 1_000_000;
/// The shortest hint.
const MIN_HINT_US: u64 = 1_000;

/// One key's leases: lease id → when it was taken, and the average hold.
#[derive(Debug, Default)]
pub struct Leases {
    held: HashMap<String, u64>,
    /// Moving average (1/8 per release) of how long a lease was held, in microseconds.
    hold_us: Option<u64>,
}

impl Leases {
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The leases held: id and when it was taken.
    pub fn held(&self) -> impl Iterator<Item = (&str, u64)> {
        self.held.iter().map(|(id, &taken)| (id.as_str(), taken))
    }

    /// Whether one more request of `spec.cost` fits.
    pub fn check(&self, spec: &Spec) -> Room {
        let n = self.held.len() as u64;
        let remaining = u64::from(spec.requests).saturating_sub(n);
        let admits = n + u64::from(spec.cost) <= u64::from(spec.requests);
        Room {
            admits,
            wait: if admits { 0 } else { self.hint(n) },
            state: LimitState {
                remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                reset: Duration::ZERO,
                overridden: None,
            },
        }
    }

    fn hint(&self, held: u64) -> u64 {
        (self.hold_us.unwrap_or(FIRST_HINT_US) / held.max(1)).max(MIN_HINT_US)
    }

    /// Takes the lease `id` at `now`.
    pub fn record(&mut self, spec: &Spec, id: &str, now: u64) -> LimitState {
        self.held.insert(id.to_owned(), now);
        let remaining = u64::from(spec.requests).saturating_sub(self.held.len() as u64);
        LimitState {
            remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
            reset: Duration::ZERO,
            overridden: None,
        }
    }

    /// Ends the lease `id`; whether it was held.
    pub fn release(&mut self, id: &str, now: u64) -> bool {
        let Some(taken) = self.held.remove(id) else {
            return false;
        };
        let held = now.saturating_sub(taken);
        self.hold_us = Some(match self.hold_us {
            None => held,
            Some(avg) => (avg as i64 + (held as i64 - avg as i64) / 8).max(0) as u64,
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn spec(at_once: u32) -> Spec {
        Spec {
            algorithm: Algorithm::Concurrency,
            requests: at_once,
            window: Duration::from_secs(10),
            cost: 1,
            ..Spec::default()
        }
    }

    #[test]
    fn admits_up_to_the_limit_at_once_and_again_after_a_release() {
        let spec = spec(2);
        let mut leases = Leases::default();
        assert!(leases.check(&spec).admits);
        assert_eq!(leases.record(&spec, "a", 0).remaining, 1);
        assert_eq!(leases.record(&spec, "b", 0).remaining, 0);
        let full = leases.check(&spec);
        assert!(!full.admits);
        // No lease has ended yet: one second, over the two held.
        assert_eq!(full.wait, 500_000);
        assert!(leases.release("a", 400_000));
        assert!(leases.check(&spec).admits);
    }

    #[test]
    fn a_release_frees_only_its_own_lease_and_only_once() {
        let spec = spec(1);
        let mut leases = Leases::default();
        leases.record(&spec, "a", 0);
        assert!(!leases.release("b", 10));
        assert!(!leases.check(&spec).admits);
        assert!(leases.release("a", 10));
        assert!(!leases.release("a", 20));
        assert!(leases.is_empty());
    }

    #[test]
    fn the_hint_follows_the_average_hold() {
        let spec = spec(1);
        let mut leases = Leases::default();
        leases.record(&spec, "a", 0);
        leases.release("a", 80_000);
        leases.record(&spec, "b", 100_000);
        assert_eq!(leases.check(&spec).wait, 80_000);
        leases.release("b", 260_000);
        // 80 ms + (160 ms − 80 ms) / 8.
        leases.record(&spec, "c", 300_000);
        assert_eq!(leases.check(&spec).wait, 90_000);
    }
}
