//! The Lua the Redis store runs (one file per algorithm under `../scripts/`, and a driver
//! per call), reading the decide script's reply, and telling a failed call's kind.

use std::time::Duration;

use redis::RedisError;

use super::super::{Admission, Decision, LimitState, StoreError};

/// The script Redis runs: the shared locals (`prelude.lua`), each algorithm's functions, then
/// the driver that calls them. One
/// script for all algorithms, so a request with limits of several algorithms is still decided
/// in one atomic call.
pub(super) const DECIDE: &str = concat!(
    include_str!("../scripts/prelude.lua"),
    include_str!("../scripts/sliding_log.lua"),
    include_str!("../scripts/weighted_log.lua"),
    include_str!("../scripts/sliding_window.lua"),
    include_str!("../scripts/fixed_window.lua"),
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/calendar.lua"),
    include_str!("../scripts/decide.lua"),
);

/// The admin API's read-only script: the prelude, each algorithm's functions, then
/// `peek.lua`, which calls one check function and records nothing.
pub(super) const PEEK: &str = concat!(
    include_str!("../scripts/prelude.lua"),
    include_str!("../scripts/sliding_log.lua"),
    include_str!("../scripts/weighted_log.lua"),
    include_str!("../scripts/sliding_window.lua"),
    include_str!("../scripts/fixed_window.lua"),
    include_str!("../scripts/gcra.lua"),
    include_str!("../scripts/calendar.lua"),
    include_str!("../scripts/peek.lua"),
);

/// Gives back what an admitted request recorded (`Store::release`): a script of its own.
pub(super) const RELEASE: &str = include_str!("../scripts/release.lua");

/// Reads the script's reply: `{admitted, retry_after_us, now_us, at_us, (remaining, reset_us,
/// rejecting) per check}`; `member` is the request's member prefix, kept for a release.
pub(super) fn decision_from_reply(
    reply: &[i64],
    checks: usize,
    member: String,
) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Script(format!("unexpected script reply {reply:?}"));
    let [admitted, retry_after, now, at, per_limit @ ..] = reply else {
        return Err(malformed());
    };
    if per_limit.len() != 3 * checks {
        return Err(malformed());
    }
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = per_limit
        .chunks_exact(3)
        .map(|triple| {
            Some(LimitState {
                remaining: u32::try_from(triple[0]).unwrap_or(0),
                reset: micros(triple[1]),
            })
        })
        .collect();
    let rejecting = per_limit.chunks_exact(3).map(|t| t[2] == 1).collect();
    let admitted = *admitted == 1;
    let time = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(Decision {
        admitted,
        retry_after: micros(*retry_after),
        limits,
        rejecting,
        admission: admitted.then(|| Admission {
            member,
            decided_us: time(*now),
            // Never before the decision, whatever the reply says.
            at_us: time(*at).max(time(*now)),
            local: false,
        }),
    })
}

/// A failover shows as a connection that drops or is refused, or as a demoted master
/// refusing writes (READONLY, also when it comes wrapped in a script error): all of them
/// are the store being unreachable, not a wrong script.
pub(super) fn script_error(err: RedisError) -> StoreError {
    if err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_io_error()
        || err.code() == Some("READONLY")
        // A cluster that is failing over or resharding beyond the retries.
        || err.is_cluster_error()
        // Older servers wrap it in the script's own error.
        || err.to_string().contains("READONLY")
    {
        StoreError::Connection(err.to_string())
    } else {
        StoreError::Script(err.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_reply() {
        let d = decision_from_reply(
            &[0, 1_500_000, 9, 9, 0, 1_500_000, 1, 7, 200, 0],
            2,
            String::new(),
        )
        .unwrap();
        assert!(!d.admitted);
        assert_eq!(d.retry_after, Duration::from_millis(1500));
        assert_eq!(d.limits[1].unwrap().remaining, 7);
        assert_eq!(d.limits[1].unwrap().reset, Duration::from_micros(200));
        assert_eq!(d.rejecting, [true, false]);
        assert_eq!(d.admission, None);
        let d = decision_from_reply(&[1, 0, 100, 350, 0, 0, 1], 1, "m".to_owned()).unwrap();
        assert_eq!(d.delay(), Duration::from_micros(250));
        assert_eq!(d.admission.unwrap().member, "m");
    }

    #[test]
    fn refuses_a_short_reply() {
        assert!(decision_from_reply(&[1, 0, 0, 0, 3], 1, String::new()).is_err());
        assert!(decision_from_reply(&[], 0, String::new()).is_err());
    }
}
