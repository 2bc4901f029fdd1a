//! The sliding-window log, as pure arithmetic over one limit's admission times.
//!
//! A limit of `requests` per `window` admits a request at `now` only if fewer than `requests`
//! admissions happened in `(now - window, now]`. This is exact: no window of that length,
//! wherever it starts, ever holds more than `requests` admissions. The in-process store runs
//! these functions; `scripts/sliding_log.lua` is the same arithmetic inside Redis, and both
//! are checked by the same integration tests.
//!
//! Times are microseconds on the store's own clock.

use std::collections::VecDeque;
use std::time::Duration;

use super::{LimitState, Params, Verdict};

/// Drops the admissions that have left the window ending at `now`.
pub fn prune(times: &mut VecDeque<u64>, window_us: u64, now: u64) {
    let horizon = now.saturating_sub(window_us);
    while times.front().is_some_and(|&t| t <= horizon) {
        times.pop_front();
    }
}

/// Time until this limit admits one more request than it does now: when it is full, the time
/// until it admits at all. `times` must be pruned and sorted.
pub fn until_more_room(times: &VecDeque<u64>, requests: u32, window_us: u64, now: u64) -> u64 {
    let count = times.len();
    // When the log is full (or over-full after a limit was lowered), the entry that must leave
    // before there is room is the (count - requests)-th; otherwise the oldest.
    let index = count.saturating_sub(requests as usize);
    times
        .get(index)
        .map_or(0, |&oldest| (oldest + window_us).saturating_sub(now))
}

/// Whether the request fits: `times` must be pruned. A rejection waits until enough entries
/// have left for its cost: the (count + cost − requests)-th oldest.
pub fn check(times: &VecDeque<u64>, params: &Params, now: u64) -> Verdict {
    let needed = (times.len() + params.cost as usize).saturating_sub(params.requests as usize);
    let wait = match needed {
        0 => 0,
        n => times.get(n - 1).map_or(params.window_us, |&t| {
            (t + params.window_us).saturating_sub(now)
        }),
    };
    Verdict {
        admits: needed == 0,
        wait,
        state: state(times, params.requests, params.window_us, now),
    }
}

/// Records an admitted request: one entry per unit of cost.
pub fn record(times: &mut VecDeque<u64>, params: &Params, now: u64) -> LimitState {
    times.extend(std::iter::repeat_n(now, params.cost as usize));
    state(times, params.requests, params.window_us, now)
}

/// Where the limit stands, as reported in the `RateLimit` field.
pub fn state(times: &VecDeque<u64>, requests: u32, window_us: u64, now: u64) -> LimitState {
    let count = u32::try_from(times.len()).unwrap_or(u32::MAX);
    LimitState {
        remaining: requests.saturating_sub(count),
        reset: Duration::from_micros(until_more_room(times, requests, window_us, now)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000;

    #[test]
    fn an_entry_leaves_exactly_one_window_later() {
        let mut times = VecDeque::from([10 * SECOND]);
        prune(&mut times, 60 * SECOND, 70 * SECOND - 1);
        assert_eq!(times.len(), 1);
        prune(&mut times, 60 * SECOND, 70 * SECOND);
        assert!(times.is_empty());
    }

    #[test]
    fn a_full_log_waits_for_its_oldest_entry() {
        let times = VecDeque::from([SECOND, 2 * SECOND, 3 * SECOND]);
        assert_eq!(
            until_more_room(&times, 3, 10 * SECOND, 4 * SECOND),
            7 * SECOND
        );
        assert_eq!(
            state(&times, 3, 10 * SECOND, 4 * SECOND),
            LimitState {
                remaining: 0,
                reset: Duration::from_secs(7)
            }
        );
    }

    #[test]
    fn an_overfull_log_waits_for_enough_entries_to_leave() {
        // Five recorded, limit lowered to two: four must leave (the one at index 3 last) before
        // fewer than two remain.
        let times = VecDeque::from([SECOND, 2 * SECOND, 3 * SECOND, 4 * SECOND, 5 * SECOND]);
        assert_eq!(
            until_more_room(&times, 2, 10 * SECOND, 6 * SECOND),
            8 * SECOND
        );
    }

    #[test]
    fn a_cost_waits_for_as_many_entries_to_leave() {
        let times = VecDeque::from([SECOND, 2 * SECOND, 3 * SECOND]);
        let params = Params {
            algorithm: crate::limiter::Algorithm::SlidingLog,
            requests: 4,
            window_us: 10 * SECOND,
            burst: 4,
            cost: 3,
            shadow: false,
        };
        let verdict = check(&times, &params, 4 * SECOND);
        assert!(!verdict.admits);
        assert_eq!(
            verdict.wait,
            8 * SECOND,
            "two must leave: the second at 12 s"
        );
    }

    #[test]
    fn an_empty_log_has_nothing_to_wait_for() {
        let times = VecDeque::new();
        assert_eq!(state(&times, 5, SECOND, 0).remaining, 5);
        assert_eq!(state(&times, 5, SECOND, 0).reset, Duration::ZERO);
    }
}
