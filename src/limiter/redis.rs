//! The Redis store: every limit of a request decided by one call of `scripts/sliding_log.lua`.
//!
//! The script is loaded at start-up and run with EVALSHA; when Redis has lost it (restart,
//! failover, `SCRIPT FLUSH`) the `redis` crate's `Script` loads it again and retries once, so
//! callers never see NOSCRIPT. Each call, including the wait for a pooled connection, is bounded
//! by the configured timeout.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_redis::{Config as PoolSettings, Pool, PoolConfig, Runtime};
use redis::{RedisError, Script};

use super::{Check, Decision, LimitState, StoreError};

const SLIDING_LOG: &str = include_str!("scripts/sliding_log.lua");

pub struct RedisStore {
    pool: Pool,
    script: Script,
    timeout: Duration,
    /// Random per process, so members written by different instances never collide.
    instance: u64,
    sequence: AtomicU64,
}

impl RedisStore {
    /// Builds the pool; no connection is opened until `load_script` or the first request.
    pub fn new(url: &str, pool_size: usize, timeout: Duration) -> Result<RedisStore, StoreError> {
        let mut settings = PoolSettings::from_url(url);
        settings.pool = Some(PoolConfig::new(pool_size));
        let pool = settings
            .create_pool(Some(Runtime::Tokio1))
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        Ok(RedisStore {
            pool,
            script: Script::new(SLIDING_LOG),
            timeout,
            instance: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            sequence: AtomicU64::new(0),
        })
    }

    /// Loads the script into Redis's script cache, so the first requests need no reload.
    pub async fn load_script(&self) -> Result<(), StoreError> {
        self.bounded(async {
            let mut conn = self.connection().await?;
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
            let window_us = u64::try_from(check.window.as_micros()).unwrap_or(u64::MAX);
            invocation.arg(check.requests).arg(window_us);
        }
        let reply: Vec<i64> = self
            .bounded(async {
                let mut conn = self.connection().await?;
                invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(script_error)
            })
            .await?;
        decision_from_reply(&reply, checks.len())
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(async {
            let mut conn = self.connection().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(script_error)?;
            Ok(())
        })
        .await
    }

    async fn connection(&self) -> Result<deadpool_redis::Connection, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| StoreError::Connection(e.to_string()))
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

/// Reads the script's reply: `{admitted, retry_after_us, (remaining, reset_us) per check}`.
fn decision_from_reply(reply: &[i64], checks: usize) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Script(format!("unexpected script reply {reply:?}"));
    let [admitted, retry_after, per_limit @ ..] = reply else {
        return Err(malformed());
    };
    if per_limit.len() != 2 * checks {
        return Err(malformed());
    }
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = per_limit
        .chunks_exact(2)
        .map(|pair| LimitState {
            remaining: u32::try_from(pair[0]).unwrap_or(0),
            reset: micros(pair[1]),
        })
        .collect();
    Ok(Decision {
        admitted: *admitted == 1,
        retry_after: micros(*retry_after),
        limits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_reply() {
        let d = decision_from_reply(&[0, 1_500_000, 0, 1_500_000, 7, 200], 2).unwrap();
        assert!(!d.admitted);
        assert_eq!(d.retry_after, Duration::from_millis(1500));
        assert_eq!(d.limits[1].remaining, 7);
        assert_eq!(d.limits[1].reset, Duration::from_micros(200));
    }

    #[test]
    fn refuses_a_short_reply() {
        assert!(decision_from_reply(&[1, 0, 3], 1).is_err());
        assert!(decision_from_reply(&[], 0).is_err());
    }
}
