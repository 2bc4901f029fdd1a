//! The sliding-window log, as pure arithmetic over one limit's admission times.
//!
//! A limit of `requests` per `window` admits a request at `now` only if fewer than `requests`
//! admissions happened in `(now - window, now]`. This is exact: no window of that length,
//! wherever it starts, ever holds more than `requests` admissions. The in-process store runs
//! these functions; `scripts/sliding_log.lua` is the same arithmetic inside Redis, and both
//! are checked by the same integration tests.
//!
//! Times are microseconds on the store's own clock.
//!
//! The deny cache: admissions only add entries and entries leave only with time, so a
//! rejection holds until the blocking entry leaves the window, which is the wait returned.

use std::collections::VecDeque;
use std::time::Duration;

use super::{LimitState, Room, Spec};

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
pub fn check(times: &VecDeque<u64>, spec: &Spec, now: u64) -> Room {
    let needed = (times.len() + spec.cost as usize).saturating_sub(spec.requests as usize);
    let wait = match needed {
        0 => 0,
        n => times.get(n - 1).map_or(spec.window_us(), |&t| {
            (t + spec.window_us()).saturating_sub(now)
        }),
    };
    Room {
        admits: needed == 0,
        wait,
        state: state(times, spec.requests, spec.window_us(), now),
    }
}

/// Records an admitted request at `at` (`now`, or later for a delayed request): one entry per
/// unit of cost, keeping `times` sorted (a delayed request's entries can land before other
/// future ones). Returns the state at `now`.
///
/// Why recording in the future keeps the log exact (no window `(s − window, s]`, wherever
/// it starts, holds more than `requests` entries). Let the pruned log be t_1 ≤ … ≤ t_n (some
/// may be in the future: `check` counts them, since it only drops entries that are old),
/// and let the request of cost c be admitted with n + c ≤ requests, or delayed to
/// a = t_k + window with k = n + c − requests ≥ 1 (the check's wait), or recorded at any
/// later `at` (another limit of the request delayed it further). Any window holding `at`
/// lies in (at − window, at + window), so its other entries are all later than
/// at − window ≥ t_k (≥ now − window when k < 1). At most n − k = requests − c entries are
/// later than t_k (ties with t_k included in the n − k only if they come after it; entries
/// equal to t_k are not in the window, which is open on that side), so the window holds at
/// most requests − c + c = requests. Windows without `at` are unchanged.
pub fn record(times: &mut VecDeque<u64>, spec: &Spec, now: u64, at: u64) -> LimitState {
    let index = times.partition_point(|&t| t <= at);
    for _ in 0..spec.cost {
        times.insert(index, at);
    }
    state(times, spec.requests, spec.window_us(), now)
}

/// Gives back a request recorded at `at`: removes `cost` entries at that time (entries at the
/// same time are interchangeable, so it does not matter whose). Exact: the log is what it
/// would be had the request never been admitted.
pub fn release(times: &mut VecDeque<u64>, cost: u32, at: u64) {
    let start = times.partition_point(|&t| t < at);
    let end = times.partition_point(|&t| t <= at);
    let remove = (end - start).min(cost as usize);
    times.drain(start..start + remove);
}

/// Charges `extra` units more to a request recorded at `at` with `spec.cost` (an overrun),
/// if its entries are still there: `min(extra, requests)` entries more at `at`. A window
/// already full of the request's entries admits nothing until they leave, so entries past
/// the limit would change no decision (`release.lua` does the same).
pub fn charge(times: &mut VecDeque<u64>, spec: &Spec, extra: u32, at: u64) {
    let start = times.partition_point(|&t| t < at);
    let end = times.partition_point(|&t| t <= at);
    if end == start {
        return;
    }
    let more = extra.min(spec.requests) as usize;
    // Inserted after the entries of the same time, which leave the window together.
    let later = times.split_off(end);
    times.extend(std::iter::repeat_n(at, more));
    times.extend(later);
}

/// Where the limit stands, as reported in the `RateLimit` field.
pub fn state(times: &VecDeque<u64>, requests: u32, window_us: u64, now: u64) -> LimitState {
    let count = u32::try_from(times.len()).unwrap_or(u32::MAX);
    LimitState {
        remaining: requests.saturating_sub(count),
        reset: Duration::from_micros(until_more_room(times, requests, window_us, now)),
        overridden: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000;

    #[test]
    fn an_overrun_adds_entries_at_its_time_up_to_the_limit() {
        let spec = Spec {
            requests: 10,
            window: Duration::from_secs(60),
            cost: 2,
            ..Spec::default()
        };
        let mut times = VecDeque::from([SECOND, 2 * SECOND, 2 * SECOND, 3 * SECOND]);
        charge(&mut times, &spec, 3, 2 * SECOND);
        assert_eq!(
            times,
            [
                SECOND,
                2 * SECOND,
                2 * SECOND,
                2 * SECOND,
                2 * SECOND,
                2 * SECOND,
                3 * SECOND
            ]
        );
        // More than the limit adds the limit's worth; a time no longer there, nothing.
        charge(&mut times, &spec, 1000, SECOND);
        assert_eq!(times.len(), 17);
        charge(&mut times, &spec, 5, 9 * SECOND);
        assert_eq!(times.len(), 17);
    }

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
                reset: Duration::from_secs(7),
                overridden: None,
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
        let spec = Spec {
            algorithm: crate::limiter::Algorithm::SlidingLog,
            requests: 4,
            window: Duration::from_micros(10 * SECOND),
            burst: 4,
            cost: 3,
            ..Spec::default()
        };
        let room = check(&times, &spec, 4 * SECOND);
        assert!(!room.admits);
        assert_eq!(room.wait, 8 * SECOND, "two must leave: the second at 12 s");
    }

    fn spec(requests: u32, cost: u32) -> Spec {
        Spec {
            algorithm: crate::limiter::Algorithm::SlidingLog,
            requests,
            window: Duration::from_micros(10 * SECOND),
            burst: requests,
            cost,
            ..Spec::default()
        }
    }

    #[test]
    fn a_release_leaves_the_log_as_if_never_admitted() {
        let p = spec(3, 2);
        let mut times = VecDeque::from([SECOND, 2 * SECOND]);
        let before = times.clone();
        let never = check(&times, &spec(3, 1), 3 * SECOND);
        record(&mut times, &p, 3 * SECOND, 3 * SECOND);
        assert_eq!(times.len(), 4);
        assert!(!check(&times, &spec(3, 1), 3 * SECOND).admits);
        release(&mut times, p.cost, 3 * SECOND);
        assert_eq!(times, before);
        assert_eq!(check(&times, &spec(3, 1), 3 * SECOND), never);
    }

    #[test]
    fn a_release_takes_only_its_own_time_and_cost() {
        let mut times = VecDeque::from([SECOND, 5 * SECOND, 5 * SECOND, 5 * SECOND, 7 * SECOND]);
        release(&mut times, 2, 5 * SECOND);
        assert_eq!(times, [SECOND, 5 * SECOND, 7 * SECOND]);
        release(&mut times, 3, 6 * SECOND);
        assert_eq!(times.len(), 3, "nothing recorded then: nothing given back");
    }

    #[test]
    fn a_delayed_entry_lands_in_order_and_counts_at_once() {
        let p = spec(2, 1);
        let mut times = VecDeque::from([SECOND, 2 * SECOND]);
        let v = check(&times, &p, 3 * SECOND);
        assert!(!v.admits);
        assert_eq!(
            v.wait,
            8 * SECOND,
            "room when the entry at 1 s leaves, at 11 s"
        );
        let st = record(&mut times, &p, 3 * SECOND, 3 * SECOND + v.wait);
        assert_eq!(st.remaining, 0);
        assert_eq!(times, [SECOND, 2 * SECOND, 11 * SECOND]);
        // A later request delayed by another limit to 9 s lands before the entry at 11 s.
        record(&mut times, &p, 3 * SECOND, 9 * SECOND);
        assert_eq!(times, [SECOND, 2 * SECOND, 9 * SECOND, 11 * SECOND]);
        // The future entries count now, and wait for the entries they follow.
        prune(&mut times, p.window_us(), 12 * SECOND);
        let v = check(&times, &p, 12 * SECOND);
        assert!(!v.admits);
        assert_eq!(v.wait, 7 * SECOND, "the entry at 9 s leaves at 19 s");
    }

    /// Every window of the log's length, starting at any entry, holds at most `requests`:
    /// requests arriving in a flood, each delayed to the time the check says.
    #[test]
    fn delayed_admissions_never_crowd_a_window() {
        let p = spec(5, 1);
        let mut times = VecDeque::new();
        let mut all = Vec::new();
        // Not at zero: the pruning horizon saturates there.
        let mut now = SECOND;
        for n in 0..200u64 {
            now += (n * 7919) % (SECOND / 2);
            prune(&mut times, p.window_us(), now);
            let v = check(&times, &p, now);
            let at = now + v.wait;
            record(&mut times, &p, now, at);
            all.push(at);
        }
        all.sort_unstable();
        for (i, &start) in all.iter().enumerate() {
            let within = all[i..]
                .iter()
                .take_while(|&&t| t < start + p.window_us())
                .count();
            assert!(within <= 5, "{within} entries in the window from {start}");
        }
    }

    #[test]
    fn an_empty_log_has_nothing_to_wait_for() {
        let times = VecDeque::new();
        assert_eq!(state(&times, 5, SECOND, 0).remaining, 5);
        assert_eq!(state(&times, 5, SECOND, 0).reset, Duration::ZERO);
    }
}
