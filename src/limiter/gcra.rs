//! GCRA (the generic cell rate algorithm), as pure arithmetic over one limit's theoretical
//! arrival time (TAT): a token bucket kept as one number.
//!
//! The emission interval is T = window / requests (rounded up to the microsecond, so it never
//! admits faster than the limit), the tolerance τ = T·(burst − 1). A request of cost n at `now`
//! moves the TAT to `max(TAT, now) + n·T` and is admitted iff that is at most τ + T ahead of
//! `now`. A rejection's wait is exact: the time until it would be. `scripts/gcra.lua` is the
//! same arithmetic inside Redis.
//!
//! Times are microseconds on the store's own clock.
//!
//! The deny cache: the TAT only grows (by admissions) and room returns only as time passes
//! it; a rejection's wait is `new TAT − (τ + T) − now`, exact.

use std::time::Duration;

use super::{LimitState, Room, Spec};

/// The emission interval T.
pub fn interval(spec: &Spec) -> u64 {
    spec.window_us().div_ceil(u64::from(spec.requests.max(1)))
}

/// `(remaining, reset)` for a TAT `ahead` microseconds past now.
fn state(ahead: u64, t: u64, burst: u32) -> LimitState {
    if ahead == 0 {
        return LimitState {
            remaining: burst,
            reset: Duration::ZERO,
            overridden: None,
        };
    }
    let capacity = u64::from(burst) * t;
    let remaining = capacity.saturating_sub(ahead) / t;
    // Time until one more fits: until the TAT is (burst − remaining − 1)·T ahead.
    let reset = ahead.saturating_sub((u64::from(burst) - remaining - 1) * t);
    LimitState {
        remaining: u32::try_from(remaining).unwrap_or(0),
        reset: Duration::from_micros(reset),
        overridden: None,
    }
}

/// Whether the request fits, given the stored TAT (`None` = nothing stored).
pub fn check(tat: Option<u64>, spec: &Spec, now: u64) -> Room {
    let t = interval(spec);
    let tat = tat.unwrap_or(now).max(now);
    let new = tat + u64::from(spec.cost) * t;
    let limit = now + u64::from(spec.burst) * t;
    Room {
        admits: new <= limit,
        wait: new.saturating_sub(limit),
        state: state(tat - now, t, spec.burst),
    }
}

/// Records an admitted request at `at` (`now`, or later for a delayed request): returns the
/// new TAT and the limit's state at `now`. A request delayed by this limit has
/// `at = now + wait = TAT + cost·T − burst·T ≤ TAT`, so it moves the TAT as if admitted now;
/// one delayed further (by another limit) moves it to `at + cost·T`, which conforms at
/// `at` since the TAT had room for it at `now`.
pub fn record(tat: Option<u64>, spec: &Spec, now: u64, at: u64) -> (u64, LimitState) {
    let t = interval(spec);
    let new = tat.unwrap_or(now).max(at) + u64::from(spec.cost) * t;
    (new, state(new - now, t, spec.burst))
}

/// Gives back a request: the TAT moves back by `cost·T`, never below `now` (`None`: nothing
/// stored, the bucket is full). Exact when nothing else moved the TAT since the request, or
/// when everything admitted since was spaced by the schedule (the TAT stayed ahead of the
/// clock). Otherwise it can give back more than the request's exact share, at most its
/// `cost·T` (so at most `cost` more admissions, once); and a request recorded later than the
/// TAT (delayed by another limit) left the TAT at its own time, which stays: less is
/// given back than was taken.
pub fn release(tat: Option<u64>, spec: &Spec, now: u64) -> Option<u64> {
    let back = u64::from(spec.cost) * interval(spec);
    tat.map(|tat| tat.saturating_sub(back))
        .filter(|&tat| tat > now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    const SECOND: u64 = 1_000_000;

    fn spec(requests: u32, burst: u32, cost: u32) -> Spec {
        Spec {
            algorithm: Algorithm::Gcra,
            requests,
            window: Duration::from_micros(10 * SECOND),
            burst,
            cost,
            ..Spec::default()
        }
    }

    #[test]
    fn burst_one_admits_one_and_the_next_waits_exactly_t() {
        let p = spec(10, 1, 1);
        assert!(check(None, &p, 0).admits);
        let (tat, st) = record(None, &p, 0, 0);
        assert_eq!(st.remaining, 0);
        assert_eq!(st.reset, Duration::from_secs(1));
        let v = check(Some(tat), &p, 0);
        assert!(!v.admits);
        assert_eq!(v.wait, SECOND);
        assert!(check(Some(tat), &p, SECOND).admits);
    }

    #[test]
    fn a_burst_drains_then_refills_one_per_interval() {
        let p = spec(10, 5, 1);
        let mut tat = None;
        for expected in [4, 3, 2, 1, 0] {
            assert!(check(tat, &p, 0).admits);
            let (new, st) = record(tat, &p, 0, 0);
            assert_eq!(st.remaining, expected);
            tat = Some(new);
        }
        let v = check(tat, &p, 0);
        assert!(!v.admits);
        assert_eq!(v.wait, SECOND);
        assert_eq!(v.state.reset, Duration::from_secs(1));
        assert_eq!(check(tat, &p, 2 * SECOND).state.remaining, 2);
    }

    #[test]
    fn a_release_leaves_the_tat_as_if_never_admitted() {
        let p = spec(10, 5, 2);
        let (tat, _) = record(None, &p, 0, 0);
        let never = check(Some(tat), &p, SECOND / 2);
        let (after, _) = record(Some(tat), &p, SECOND / 2, SECOND / 2);
        assert_ne!(check(Some(after), &p, SECOND / 2), never);
        let back = release(Some(after), &p, SECOND / 2);
        assert_eq!(back, Some(tat));
        assert_eq!(check(back, &p, SECOND / 2), never);
        // The only request, given back: nothing stored, as before it.
        let (only, _) = record(None, &p, 0, 0);
        assert_eq!(release(Some(only), &p, SECOND / 2), None);
        assert_eq!(
            check(None, &p, SECOND / 2),
            check(release(Some(only), &p, SECOND / 2), &p, SECOND / 2)
        );
    }

    #[test]
    fn a_delayed_request_moves_the_tat_as_if_admitted_now() {
        let p = spec(10, 2, 1);
        let (tat, _) = record(None, &p, 0, 0);
        let (tat, _) = record(Some(tat), &p, 0, 0);
        let v = check(Some(tat), &p, 0);
        assert!(!v.admits);
        assert_eq!(v.wait, SECOND);
        let (delayed, st) = record(Some(tat), &p, 0, v.wait);
        assert_eq!(delayed, 3 * SECOND);
        assert_eq!(st.remaining, 0);
        // Delayed further by another limit, to 5 s: the TAT follows it.
        let (later, _) = record(Some(tat), &p, 0, 5 * SECOND);
        assert_eq!(later, 6 * SECOND);
        assert!(
            check(Some(later), &p, 5 * SECOND).admits,
            "room at its own time"
        );
    }

    #[test]
    fn a_cost_waits_for_that_many_intervals() {
        let p = spec(10, 5, 3);
        let (tat, _) = record(None, &p, 0, 0);
        let v = check(Some(tat), &p, 0);
        assert!(!v.admits);
        assert_eq!(v.wait, SECOND);
    }
}
