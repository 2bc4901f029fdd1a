//! The Redis store: every limit of a request, of any mix of algorithms, decided by one call of
//! one script: `scripts/decide.lua`, after each algorithm's check and record functions.
//!
//! Decisions travel over a few long-lived multiplexed connections: concurrent requests share
//! them, and their commands leave in pipelined writes instead of one round trip per pooled
//! connection. A connection that breaks is re-established in the background by the `redis`
//! crate's `ConnectionManager`; no command is spent checking a connection before use.
//!
//! The script is loaded at start-up and run with EVALSHA only; when Redis has lost it (restart,
//! failover, `SCRIPT FLUSH`) the `redis` crate's `Script` loads it again and retries once, so
//! callers never see NOSCRIPT. Each call, including a wait for a reconnection, is bounded by
//! the configured timeout.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};

use super::{Check, Decision, LimitState, StoreError};

/// The script Redis runs: each algorithm's functions, then the driver that calls them. One
/// script for all algorithms, so a request with limits of several algorithms is still decided
/// in one atomic call.
const DECIDE: &str = concat!(
    include_str!("scripts/sliding_log.lua"),
    include_str!("scripts/sliding_window.lua"),
    include_str!("scripts/fixed_window.lua"),
    include_str!("scripts/gcra.lua"),
    include_str!("scripts/decide.lua"),
);

pub struct RedisStore {
    connections: Vec<ConnectionManager>,
    next: AtomicUsize,
    script: Script,
    timeout: Duration,
    /// Random per process, so members written by different instances never collide.
    instance: u64,
    sequence: AtomicU64,
}

impl RedisStore {
    /// Sets up `connections` multiplexed connections; none is opened until `load_script` or
    /// the first request. Must be called on a Tokio runtime.
    pub fn new(url: &str, connections: usize, timeout: Duration) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Connection(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            // The call's own timeout bounds every wait. A broken connection is reconnected
            // once, at once, and a refused reconnection fails the calls waiting on it at once
            // rather than holding them for their timeout; the next call tries again.
            .set_response_timeout(None)
            .set_number_of_retries(0);
        let connections = (0..connections.max(1))
            .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        Ok(RedisStore {
            connections,
            next: AtomicUsize::new(0),
            script: Script::new(DECIDE),
            timeout,
            instance: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            sequence: AtomicU64::new(0),
        })
    }

    /// Loads the script into Redis's script cache, so the first requests need no reload.
    pub async fn load_script(&self) -> Result<(), StoreError> {
        let mut conn = self.connection();
        self.bounded(async {
            self.script
                .load_async(&mut conn)
                .await
                .map_err(script_error)?;
            Ok(())
        })
        .await
    }

    pub async fn decide(&self, checks: &[Check]) -> Result<Decision, StoreError> {
        let member = format!(
            "{:016x}-{}",
            self.instance,
            self.sequence.fetch_add(1, Ordering::Relaxed)
        );
        let mut invocation = self.script.prepare_invoke();
        for check in checks {
            invocation.key(&check.key);
        }
        invocation.arg(member);
        for check in checks {
            let params = check.params();
            invocation
                .arg(params.algorithm.label())
                .arg(params.requests)
                .arg(params.window_us)
                .arg(params.burst)
                .arg(params.cost)
                .arg(u8::from(params.shadow));
        }
        let mut conn = self.connection();
        let reply: Vec<i64> = self
            .bounded(async {
                invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(script_error)
            })
            .await?;
        decision_from_reply(&reply, checks.len())
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection();
        self.bounded(async {
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(script_error)?;
            Ok(())
        })
        .await
    }

    /// The next connection, round robin. A clone is a handle to the same connection.
    fn connection(&self) -> ConnectionManager {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[index].clone()
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.timeout)))
    }
}

fn script_error(err: RedisError) -> StoreError {
    if err.is_connection_dropped() || err.is_connection_refusal() || err.is_io_error() {
        StoreError::Connection(err.to_string())
    } else {
        StoreError::Script(err.to_string())
    }
}

/// Reads the script's reply: `{admitted, retry_after_us, (remaining, reset_us, rejecting) per
/// check}`.
fn decision_from_reply(reply: &[i64], checks: usize) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Script(format!("unexpected script reply {reply:?}"));
    let [admitted, retry_after, per_limit @ ..] = reply else {
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
    Ok(Decision {
        admitted: *admitted == 1,
        retry_after: micros(*retry_after),
        limits,
        rejecting,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_reply() {
        let d = decision_from_reply(&[0, 1_500_000, 0, 1_500_000, 1, 7, 200, 0], 2).unwrap();
        assert!(!d.admitted);
        assert_eq!(d.retry_after, Duration::from_millis(1500));
        assert_eq!(d.limits[1].unwrap().remaining, 7);
        assert_eq!(d.limits[1].unwrap().reset, Duration::from_micros(200));
        assert_eq!(d.rejecting, [true, false]);
    }

    #[test]
    fn refuses_a_short_reply() {
        assert!(decision_from_reply(&[1, 0, 3], 1).is_err());
        assert!(decision_from_reply(&[], 0).is_err());
    }
}
