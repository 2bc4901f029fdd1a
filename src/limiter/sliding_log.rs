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

use super::LimitState;

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

/// Whether the limit has room for one more request now.
pub fn has_room(times: &VecDeque<u64>, requests: u32) -> bool {
    times.len() < requests as usize
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
        assert!(!has_room(&times, 3));
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
    fn an_empty_log_has_nothing_to_wait_for() {
        let times = VecDeque::new();
        assert!(has_room(&times, 1));
        assert_eq!(state(&times, 5, SECOND, 0).remaining, 5);
        assert_eq!(state(&times, 5, SECOND, 0).reset, Duration::ZERO);
    }
}
