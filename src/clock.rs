//! sluice's wall clock, the one calendar quotas read their period from (every other algorithm
//! keeps time on Redis TIME or the in-process store's monotonic clock).
//!
//! For tests only, `SLUICE_TEST_CLOCK_START` (an RFC 3339 instant, e.g.
//! `2026-01-31T23:59:58Z`) starts this clock at that instant when the process starts; time
//! flows from there at the real rate. It exists so a test can watch a month end through the
//! real binary; `run` logs a warning when it is set.

use std::sync::OnceLock;

use jiff::{SignedDuration, Timestamp};

/// The environment variable that starts the wall clock at a given instant (testing only).
pub const START_ENV: &str = "SLUICE_TEST_CLOCK_START";

#[derive(Debug, thiserror::Error)]
#[error("{START_ENV}={value:?} is not an RFC 3339 instant (e.g. 2026-01-31T23:59:58Z): {reason}")]
pub struct ClockError {
    value: String,
    reason: String,
}

/// How far this process's wall clock is from the system's: zero unless the variable is set.
static OFFSET: OnceLock<Result<SignedDuration, String>> = OnceLock::new();

fn offset() -> &'static Result<SignedDuration, String> {
    OFFSET.get_or_init(|| {
        let Some(value) = std::env::var_os(START_ENV) else {
            return Ok(SignedDuration::ZERO);
        };
        let value = value.to_string_lossy().into_owned();
        let start: Timestamp = value
            .parse()
            .map_err(|err: jiff::Error| format!("{value}\u{0}{err}"))?;
        Ok(start.duration_since(Timestamp::now()))
    })
}

/// Reads `SLUICE_TEST_CLOCK_START` once: the instant the clock was started at when it is set,
/// or why it cannot be used. Called at start, so a bad value stops sluice instead of being
/// ignored on the request path.
pub fn init() -> Result<Option<Timestamp>, ClockError> {
    match offset() {
        Ok(offset) if offset.is_zero() && std::env::var_os(START_ENV).is_none() => Ok(None),
        Ok(_) => Ok(Some(now())),
        Err(message) => {
            let (value, reason) = message.split_once('\u{0}').unwrap_or((message, ""));
            Err(ClockError {
                value: value.to_owned(),
                reason: reason.to_owned(),
            })
        }
    }
}

/// The current instant on sluice's wall clock.
pub fn now() -> Timestamp {
    let now = Timestamp::now();
    match offset() {
        Ok(offset) => now.checked_add(*offset).unwrap_or(now),
        // `init` refused to start with it; a library caller that skipped `init` gets the
        // system's clock.
        Err(_) => now,
    }
}
