//! The weighted log, as pure arithmetic over one limit's entries: a log of admission times
//! with one entry per request, weighted by its cost, for limits whose unit is not the
//! request (token budgets, where one request reserves thousands of units).
//!
//! A limit of `requests` units per `window` admits a request of cost c at `now` only if the
//! entries in `(now - window, now]` weigh at most `requests - c`: exact in the same sense as
//! a log of one entry per unit (no window of that length, wherever it starts, ever holds more than
//! `requests` units), with memory and time by requests instead of by units. An entry can be
//! settled to a smaller weight (a reservation to what the request used); it keeps its time.
//! `scripts/weighted_log.lua` is the same arithmetic inside Redis.
//!
//! Times are microseconds on the store's own clock.

use std::collections::VecDeque;

use super::{LimitState, Room, Spec};
use std::time::Duration;

/// One admitted request: when it was recorded and the units it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at: u64,
    weight: u32,
}

/// The entries of one limit, oldest first, and their total weight.
#[derive(Debug, Default)]
pub struct Log {
    entries: VecDeque<Entry>,
    total: u64,
}

impl Log {
    /// Units held by the entries (of the window, once pruned).
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops the entries that have left the window ending at `now`.
    pub fn prune(&mut self, window_us: u64, now: u64) {
        let horizon = now.saturating_sub(window_us);
        while let Some(entry) = self.entries.front().filter(|entry| entry.at <= horizon) {
            self.total -= u64::from(entry.weight);
            self.entries.pop_front();
        }
    }

    /// The time until `units` of the oldest entries have left the window; the window itself
    /// when the entries do not hold that many.
    fn until_freed(&self, units: u64, window_us: u64, now: u64) -> u64 {
        let mut freed = 0;
        for entry in &self.entries {
            freed += u64::from(entry.weight);
            if freed >= units {
                return (entry.at + window_us).saturating_sub(now);
            }
        }
        window_us
    }

    fn state(&self, spec: &Spec, now: u64) -> LimitState {
        let requests = u64::from(spec.requests);
        let reset = if self.total == 0 {
            0
        } else {
            // One unit more than now: for a full log, the first unit of room.
            let units = self.total.saturating_sub(requests) + 1;
            self.until_freed(units, spec.window_us(), now)
        };
        LimitState {
            remaining: u32::try_from(requests.saturating_sub(self.total)).unwrap_or(u32::MAX),
            reset: Duration::from_micros(reset),
            overridden: None,
        }
    }

    /// Whether the request fits: the log must be pruned. A rejection waits until enough units
    /// have left for its cost; a cost above the limit never fits (it waits a whole window).
    pub fn check(&self, spec: &Spec, now: u64) -> Room {
        let needed = (self.total + u64::from(spec.cost)).saturating_sub(u64::from(spec.requests));
        let wait = match needed {
            0 => 0,
            _ if spec.cost > spec.requests => spec.window_us(),
            n => self.until_freed(n, spec.window_us(), now),
        };
        Room {
            admits: needed == 0,
            wait,
            state: self.state(spec, now),
        }
    }

    /// Records an admitted request at `at` (`now`, or later for a delayed request), keeping
    /// the entries sorted; the argument that recording in the future keeps a log of one
    /// entry per unit exact (at the table's first algorithm's `record`) holds here unit for
    /// unit, an entry of weight c standing for c entries at one time. Returns the state at
    /// `now`.
    pub fn record(&mut self, spec: &Spec, now: u64, at: u64) -> LimitState {
        let index = self.entries.partition_point(|entry| entry.at <= at);
        self.entries.insert(
            index,
            Entry {
                at,
                weight: spec.cost,
            },
        );
        self.total += u64::from(spec.cost);
        self.state(spec, now)
    }

    /// Charges `units` more to a request recorded at `at` that used more than it reserved
    /// (an overrun): an entry of that time, if one is still there, grows by them (entries of
    /// the same time leave together, so which one does not matter).
    pub fn charge(&mut self, units: u32, at: u64) {
        let index = self.entries.partition_point(|entry| entry.at < at);
        if let Some(entry) = self.entries.get_mut(index).filter(|entry| entry.at == at) {
            let added = units.min(u32::MAX - entry.weight);
            entry.weight += added;
            self.total += u64::from(added);
        }
    }

    /// Gives back `units` of a request recorded at `at`: its entry keeps its time with the
    /// rest of its weight, and goes at zero. Entries of the same time leave the window
    /// together, so which of them gives the units back does not matter.
    pub fn release(&mut self, units: u32, at: u64) {
        let mut left = units;
        let start = self.entries.partition_point(|entry| entry.at < at);
        let mut index = start;
        while left > 0 && self.entries.get(index).is_some_and(|entry| entry.at == at) {
            let entry = &mut self.entries[index];
            let taken = entry.weight.min(left);
            entry.weight -= taken;
            left -= taken;
            self.total -= u64::from(taken);
            index += 1;
        }
        // Drop the entries emptied, all in the run just walked.
        let mut index = start;
        while self.entries.get(index).is_some_and(|entry| entry.at == at) {
            if self.entries[index].weight == 0 {
                self.entries.remove(index);
            } else {
                index += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;
    use proptest::prelude::*;

    const SECOND: u64 = 1_000_000;

    fn spec(requests: u32, cost: u32) -> Spec {
        Spec {
            algorithm: Algorithm::WeightedLog,
            requests,
            window: Duration::from_secs(60),
            cost,
            ..Spec::default()
        }
    }

    #[test]
    fn a_request_fits_while_its_units_fit_and_waits_for_the_oldest_that_make_room() {
        let mut log = Log::default();
        log.record(&spec(100, 60), SECOND, SECOND);
        log.record(&spec(100, 30), 2 * SECOND, 2 * SECOND);
        let room = log.check(&spec(100, 10), 3 * SECOND);
        assert!(room.admits);
        assert_eq!(room.state.remaining, 10);
        // 20 more do not fit until the first entry (60 units) leaves, at 61 s.
        let room = log.check(&spec(100, 20), 3 * SECOND);
        assert!(!room.admits);
        assert_eq!(room.wait, 58 * SECOND);
        // More than the oldest frees: both entries must leave.
        let room = log.check(&spec(100, 80), 3 * SECOND);
        assert_eq!(room.wait, 59 * SECOND);
        // Never fits.
        assert_eq!(log.check(&spec(100, 101), 3 * SECOND).wait, 60 * SECOND);
    }

    #[test]
    fn a_settled_entry_keeps_its_time_with_the_rest_of_its_weight() {
        let mut log = Log::default();
        log.record(&spec(100, 60), SECOND, SECOND);
        log.release(45, SECOND);
        assert_eq!(log.total(), 15);
        assert_eq!(log.check(&spec(100, 85), 2 * SECOND).state.remaining, 85);
        log.prune(60 * SECOND, 61 * SECOND);
        assert!(log.is_empty());
        assert_eq!(log.total(), 0);
    }

    #[test]
    fn an_overrun_grows_its_entry_at_its_time() {
        let mut log = Log::default();
        log.record(&spec(100, 20), SECOND, SECOND);
        log.record(&spec(100, 10), 2 * SECOND, 2 * SECOND);
        log.charge(70, SECOND);
        assert_eq!(log.total(), 100);
        // Full until the first entry (now 90) leaves, at 61 s.
        let room = log.check(&spec(100, 5), 3 * SECOND);
        assert!(!room.admits);
        assert_eq!(room.wait, 58 * SECOND);
        // Past the limit is recorded too; an entry no longer there is not charged.
        log.charge(50, 2 * SECOND);
        assert_eq!(log.total(), 150);
        log.charge(50, 5 * SECOND);
        assert_eq!(log.total(), 150);
    }

    proptest! {
        /// Whatever the requests, their costs and settlements, no window of the limit's length
        /// ever holds more than the limit's units, counting each request at its settled
        /// weight from its admission (the reservation held until the settlement only makes
        /// earlier states heavier).
        #[test]
        fn no_window_ever_holds_more_than_the_limit(
            steps in proptest::collection::vec((0u64..3_000_000, 1u32..50, 0u32..60), 1..120),
        ) {
            let spec_of = |cost| spec(100, cost);
            let window = spec_of(1).window_us();
            let mut log = Log::default();
            let mut now = 0;
            let mut admitted: Vec<(u64, u32)> = Vec::new();
            for (gap, cost, used) in steps {
                now += gap;
                log.prune(window, now);
                let room = log.check(&spec_of(cost), now);
                prop_assert_eq!(
                    room.admits,
                    log.total() + u64::from(cost) <= 100,
                    "the check counts the units of the window"
                );
                if room.admits {
                    log.record(&spec_of(cost), now, now);
                    let kept = used.min(cost);
                    log.release(cost - kept, now);
                    admitted.push((now, kept));
                }
            }
            for &(start, _) in &admitted {
                let inside: u64 = admitted
                    .iter()
                    .filter(|&&(at, _)| at >= start && at < start + window)
                    .map(|&(_, kept)| u64::from(kept))
                    .sum();
                prop_assert!(inside <= 100, "{} units in the window from {}", inside, start);
            }
        }
    }
}
