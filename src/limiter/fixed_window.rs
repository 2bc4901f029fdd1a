//! The fixed window, as pure arithmetic over one limit's counter.
//!
//! A counter starts with the first hit and expires one window later; while it lives it
//! admits up to `requests`. O(1) memory, but not exact: a full window ending and a new one
//! starting at once let up to twice `requests` through within one window's length.
//! `scripts/fixed_window.lua` is the same arithmetic inside Redis.
//!
//! Times are microseconds on the store's own clock.
//!
//! The deny cache: the count only grows until the key expires, and a rejection's wait is the
//! key's remaining time to live, so the rejection holds exactly that long.

use std::time::Duration;

use super::{LimitState, Room, Spec};

/// One window's count, and when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counter {
    pub count: u64,
    pub expires: u64,
}

impl Counter {
    /// The counter as it stands at `now`: an expired window counts nothing.
    pub fn at(self, now: u64) -> Counter {
        if self.expires <= now {
            Counter::default()
        } else {
            self
        }
    }

    fn state(self, spec: &Spec, now: u64) -> LimitState {
        LimitState {
            remaining: remaining(spec.requests, self.count),
            reset: Duration::from_micros(self.expires.saturating_sub(now)),
            overridden: None,
        }
    }
}

fn remaining(requests: u32, count: u64) -> u32 {
    u32::try_from(u64::from(requests).saturating_sub(count)).unwrap_or(0)
}

/// Whether the request fits in `counter` (already taken `at(now)`); a rejection waits for the
/// window to end, since nothing leaves before.
pub fn check(counter: Counter, spec: &Spec, now: u64) -> Room {
    let admits = counter.count + u64::from(spec.cost) <= u64::from(spec.requests);
    Room {
        admits,
        wait: if admits {
            0
        } else {
            counter.expires.saturating_sub(now)
        },
        state: counter.state(spec, now),
    }
}

/// Counts an admitted request; the first hit starts the window.
pub fn record(counter: &mut Counter, spec: &Spec, now: u64) -> LimitState {
    if counter.count == 0 {
        // Redis keeps expiries in milliseconds: round the same way as the script.
        counter.expires = now + spec.window_us().div_ceil(1000) * 1000;
    }
    counter.count += u64::from(spec.cost);
    counter.state(spec, now)
}

/// Gives back a request: the count of the window in force drops by `cost`, never below zero
/// (an empty counter is no window: the next hit starts one). If the window the request was
/// counted in ended in between, nothing of it is left to give back, and the give-back lands
/// in the new window: at most `cost` more admissions there, within the algorithm's
/// documented two windows' worth across a boundary.
pub fn release(counter: Counter, spec: &Spec, now: u64) -> Counter {
    let mut counter = counter.at(now);
    counter.count = counter.count.saturating_sub(u64::from(spec.cost));
    if counter.count == 0 {
        Counter::default()
    } else {
        counter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    const SECOND: u64 = 1_000_000;

    fn spec(requests: u32, cost: u32) -> Spec {
        Spec {
            algorithm: Algorithm::FixedWindow,
            requests,
            window: Duration::from_micros(10 * SECOND),
            burst: requests,
            cost,
            ..Spec::default()
        }
    }

    #[test]
    fn a_release_leaves_the_counter_as_if_never_admitted() {
        let p = spec(3, 2);
        let mut c = Counter::default();
        record(&mut c, &p, SECOND);
        let before = c;
        let never = check(c, &spec(3, 1), 2 * SECOND);
        record(&mut c, &spec(3, 1), 2 * SECOND);
        assert!(!check(c, &p, 2 * SECOND).admits);
        let c = release(c, &spec(3, 1), 2 * SECOND);
        assert_eq!(c, before);
        assert_eq!(check(c.at(2 * SECOND), &spec(3, 1), 2 * SECOND), never);
        assert_eq!(
            release(c, &p, 3 * SECOND),
            Counter::default(),
            "emptied: no window"
        );
        assert_eq!(
            release(Counter::default(), &p, 3 * SECOND),
            Counter::default()
        );
    }

    #[test]
    fn admits_the_limit_then_waits_for_the_window_to_end() {
        let p = spec(3, 1);
        let mut c = Counter::default();
        for _ in 0..3 {
            assert!(check(c.at(SECOND), &p, SECOND).admits);
            record(&mut c, &p, SECOND);
        }
        let v = check(c.at(4 * SECOND), &p, 4 * SECOND);
        assert!(!v.admits);
        assert_eq!(v.wait, 7 * SECOND);
        assert!(check(c.at(11 * SECOND), &p, 11 * SECOND).admits);
    }

    #[test]
    fn a_cost_counts_as_that_many_requests() {
        let p = spec(5, 2);
        let mut c = Counter::default();
        record(&mut c, &p, 0);
        assert_eq!(record(&mut c, &p, 0).remaining, 1);
        assert!(!check(c.at(0), &p, 0).admits);
    }

    #[test]
    fn twice_the_limit_passes_across_a_boundary() {
        let p = spec(3, 1);
        let mut c = Counter::default();
        let mut admitted = 0;
        for now in [
            9 * SECOND,
            10 * SECOND - 1,
            10 * SECOND - 1,
            10 * SECOND - 1,
        ] {
            c = c.at(now);
            if check(c, &p, now).admits {
                record(&mut c, &p, now);
                admitted += 1;
            }
        }
        for now in [19 * SECOND, 19 * SECOND, 19 * SECOND, 19 * SECOND] {
            c = c.at(now);
            if check(c, &p, now).admits {
                record(&mut c, &p, now);
                admitted += 1;
            }
        }
        assert_eq!(admitted, 6, "six within ten seconds and one microsecond");
    }
}
