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

#[derive(Debug, Clone, thiserror::Error)]
#[error("{START_ENV}={value:?} is not an RFC 3339 instant (e.g. 2026-01-31T23:59:58Z): {reason}")]
pub struct ClockError {
    value: String,
    reason: String,
}

/// When the variable is set: the instant it starts the clock at, and how far that is from the
/// system's clock when it was read.
#[derive(Debug, Clone, Copy)]
struct Start {
    at: Timestamp,
    offset: SignedDuration,
}

/// Read once, on first use; `None` without the variable.
static START: OnceLock<Result<Option<Start>, ClockError>> = OnceLock::new();

fn start() -> &'static Result<Option<Start>, ClockError> {
    START.get_or_init(|| {
        let Some(value) = std::env::var_os(START_ENV) else {
            return Ok(None);
        };
        let value = value.to_string_lossy().into_owned();
        match value.parse::<Timestamp>() {
            Ok(at) => Ok(Some(Start {
                at,
                offset: at.duration_since(Timestamp::now()),
            })),
            Err(err) => Err(ClockError {
                value,
                reason: err.to_string(),
            }),
        }
    })
}

/// Reads `SLUICE_TEST_CLOCK_START` once: the instant the clock was started at when it is set,
/// or why it cannot be used. Called at start, so a bad value stops sluice instead of being
/// ignored on the request path.
pub fn init() -> Result<Option<Timestamp>, ClockError> {
    start()
        .as_ref()
        .map(|start| start.map(|start| start.at))
        .map_err(Clone::clone)
}

/// The current instant on sluice's wall clock.
pub fn now() -> Timestamp {
    let now = Timestamp::now();
    match start() {
        Ok(Some(start)) => now.checked_add(start.offset).unwrap_or(now),
        // Without the variable, the system's clock; with a bad one, `init` refused to start,
        // and a library caller that skipped `init` gets the system's clock too.
        Ok(None) | Err(_) => now,
    }
}
