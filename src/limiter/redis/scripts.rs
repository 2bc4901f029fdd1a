//! The Lua the Redis store runs (one file per algorithm under `../scripts/`, dispatchers
//! generated from the algorithm table, and a driver per call), reading the decide script's
//! reply, and telling a failed call's kind.

use std::fmt::Write as _;
use std::sync::LazyLock;
use std::time::Duration;

use redis::RedisError;

use super::super::algorithm::{PeekCount, Traits, ALGORITHMS};
use super::super::{Admission, Decision, LimitState, StoreError};

/// The script Redis runs: the shared locals (`prelude.lua`), each algorithm's functions, the
/// dispatchers generated from the algorithm table, then the driver that calls them. One
/// script for all algorithms, so a request with limits of several algorithms is still decided
/// in one atomic call.
pub(super) static DECIDE: LazyLock<String> = LazyLock::new(|| {
    script(
        &[
            dispatcher("check", CHECK_ARGS),
            dispatcher("record", RECORD_ARGS),
        ],
        include_str!("../scripts/decide.lua"),
    )
});

/// The admin API's read-only script: `peek.lua`, which calls one check function and records
/// nothing, after the same parts as `DECIDE` and the table's `peek_count`.
pub(super) static PEEK: LazyLock<String> = LazyLock::new(|| {
    script(
        &[dispatcher("check", CHECK_ARGS), peek_count()],
        include_str!("../scripts/peek.lua"),
    )
});

/// Gives back what an admitted request recorded (`Store::release`), ends a lease.
pub(super) static RELEASE: LazyLock<String> = LazyLock::new(|| {
    script(
        &[dispatcher("release", RELEASE_ARGS), charge_dispatcher()],
        include_str!("../scripts/release.lua"),
    )
});

/// An instance's renewal (and restoration) of its concurrency leases.
pub(super) static LEASES: LazyLock<String> = LazyLock::new(|| {
    concat!(
        include_str!("../scripts/prelude.lua"),
        include_str!("../scripts/concurrency.lua"),
        include_str!("../scripts/leases.lua"),
    )
    .to_owned()
});

/// The arguments each dispatcher takes after the algorithm, and passes on. Lua ignores
/// arguments a function does not name, so every algorithm gets the same list.
const CHECK_ARGS: &str = "key, now, requests, window, burst, cost";
const RECORD_ARGS: &str =
    "key, now, requests, window, burst, cost, a, b, member, at, delays, cost_arg, lateness";
const RELEASE_ARGS: &str = "key, now, requests, window, back, keep, member, at, decided";
const CHARGE_ARGS: &str = "key, requests, extra, cost, member";

/// `prelude.lua`, every algorithm's file in the table's order, `dispatchers`, then `driver`.
fn script(dispatchers: &[String], driver: &str) -> String {
    let mut lua = String::from(include_str!("../scripts/prelude.lua"));
    for traits in &ALGORITHMS {
        lua.push_str(traits.lua);
    }
    for dispatcher in dispatchers {
        lua.push_str(dispatcher);
    }
    lua.push_str(driver);
    lua
}

/// `local function {name}(algorithm, {args})`, calling `{label}_{name}` for each algorithm of
/// the table; nil for an unknown one.
fn dispatcher(name: &str, args: &str) -> String {
    branches(name, args, |_| true)
}

/// The same for `charge`, which only the algorithms that settle exactly have; the others
/// charge nothing (false).
fn charge_dispatcher() -> String {
    branches("charge", CHARGE_ARGS, |t| t.settles_exactly)
}

fn branches(name: &str, args: &str, has: impl Fn(&Traits) -> bool) -> String {
    let mut lua = format!(
        "\n-- Generated from the algorithm table.\nlocal function {name}(algorithm, {args})\n"
    );
    for (i, traits) in ALGORITHMS.iter().enumerate() {
        let keyword = if i == 0 { "if" } else { "elseif" };
        let label = traits.label;
        let call = if has(traits) {
            format!("return {label}_{name}({args})")
        } else {
            "return false".to_owned()
        };
        let _ = writeln!(lua, "  {keyword} algorithm == '{label}' then\n    {call}");
    }
    lua.push_str("  end\n  return nil\nend\n");
    lua
}

/// `peek_count(algorithm, counted, remaining, requests, burst)`: the count `peek.lua` reports,
/// from the check's first value of state or the room used, as the table says.
fn peek_count() -> String {
    let mut lua = String::from(
        "\n-- Generated from the algorithm table.\n\
         local function peek_count(algorithm, counted, remaining, requests, burst)\n",
    );
    for traits in &ALGORITHMS {
        let count = match traits.peek_count {
            PeekCount::FirstState => "counted",
            PeekCount::BurstLessRemaining => "math.max(burst - remaining, 0)",
            PeekCount::RequestsLessRemaining => "math.max(requests - remaining, 0)",
        };
        let _ = writeln!(
            lua,
            "  if algorithm == '{}' then\n    return {count}\n  end",
            traits.label
        );
    }
    lua.push_str("  return 0\nend\n");
    lua
}

/// Reads the script's reply: `{admitted, retry_after_us, now_us, at_us, (remaining, reset_us,
/// rejecting + 2 crossed + 64 override) per check}`; `member` is the request's member prefix, kept for a release.
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
                // 64 times the override in force, above the crossed thresholds' bits.
                overridden: u32::try_from(triple[2] >> 6).ok().filter(|&n| n > 0),
            })
        })
        .collect();
    let rejecting = per_limit.chunks_exact(3).map(|t| t[2] & 1 == 1).collect();
    // Bits 1 to 5: the thresholds this admission crossed; nothing kept when none did.
    let crossed = if per_limit.chunks_exact(3).any(|t| t[2] & 0b11_1110 != 0) {
        per_limit
            .chunks_exact(3)
            .map(|t| ((t[2] >> 1) & 0b1_1111) as u8)
            .collect()
    } else {
        Vec::new()
    };
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
        crossed,
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
        assert!(d.crossed.is_empty());
        // Rejecting 0, thresholds 0 and 2 crossed, override 40.
        let d = decision_from_reply(&[1, 0, 1, 1, 3, 0, 0b101 << 1 | 40 << 6], 1, String::new())
            .unwrap();
        assert_eq!(d.crossed, [0b101]);
        assert_eq!(d.limits[0].unwrap().overridden, Some(40));
        assert_eq!(d.rejecting, [false]);
    }

    /// Every algorithm of the table is reachable from every entry point: decide (check and
    /// record), peek, release (release, and charge for those that settle exactly).
    #[test]
    fn every_script_dispatches_every_algorithm() {
        for traits in &ALGORITHMS {
            let label = traits.label;
            let branch = format!("algorithm == '{label}' then");
            for (script, calls) in [
                (&*DECIDE, vec!["check", "record"]),
                (&*PEEK, vec!["check"]),
                (&*RELEASE, vec!["release"]),
            ] {
                assert!(script.contains(&branch), "{label}");
                for call in calls {
                    assert!(
                        script.contains(&format!("return {label}_{call}(")),
                        "{label} {call}"
                    );
                }
            }
            assert_eq!(
                RELEASE.contains(&format!("return {label}_charge(")),
                traits.settles_exactly,
                "{label}"
            );
            assert!(PEEK.contains(&format!("if algorithm == '{label}' then\n    return")));
        }
    }

    #[test]
    fn refuses_a_short_reply() {
        assert!(decision_from_reply(&[1, 0, 0, 0, 3], 1, String::new()).is_err());
        assert!(decision_from_reply(&[], 0, String::new()).is_err());
    }
}
