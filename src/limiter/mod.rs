//! The limiter: given the (key, limit) pairs of one request, decide in one atomic step whether
//! the request is admitted, and say how much room is left.
//!
//! It knows nothing of HTTP. The sliding-window log is the algorithm: a request is admitted
//! only if every limit has fewer than `requests` entries in the last `window`; if admitted, it
//! is recorded in every limit, and if rejected, in none. `Store` runs that decision either in
//! Redis (shared by every sluice instance, with an exact cache of its rejections in front) or
//! in process memory (one instance).

mod deny_cache;
mod local;
mod redis;
mod sentinel;
mod sliding_log;

use std::time::{Duration, Instant};

use prometheus::{Histogram, IntCounter};

use self::deny_cache::DenyCache;
use self::local::{LocalMetrics, LocalStore};
pub use self::redis::RedisStore;
pub use self::sentinel::SentinelSettings;
use crate::metrics::Metrics;

/// One limit to check for a request: the full store key (prefix, route, limit, identity) and
/// the limit's size.
#[derive(Debug, Clone)]
pub struct Check {
    pub key: String,
    pub requests: u32,
    pub window: Duration,
}

/// Where one limit stands after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// Requests this limit would still admit now.
    pub remaining: u32,
    /// Time until this limit admits one more request than it does now (for a full limit, the
    /// time until it admits again); zero when nothing is recorded.
    pub reset: Duration,
}

/// The answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub admitted: bool,
    /// For a rejected request, the exact time until every exhausted limit admits again.
    pub retry_after: Duration,
    /// One state per check, in the order the checks were given; `None` for a limit the
    /// store was not asked about (a rejection answered from the deny cache).
    pub limits: Vec<Option<LimitState>>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot reach the store: {0}")]
    Connection(String),
    #[error("the store answered with an error: {0}")]
    Script(String),
}

/// `sluice_store_errors_total` of one store, one counter per kind.
struct ErrorCounters {
    timeout: IntCounter,
    connection: IntCounter,
    script: IntCounter,
}

impl ErrorCounters {
    fn new(metrics: &Metrics, store: &str) -> ErrorCounters {
        let counter = |kind| metrics.store_errors.with_label_values(&[store, kind]);
        ErrorCounters {
            timeout: counter("timeout"),
            connection: counter("connection"),
            script: counter("script"),
        }
    }

    fn of(&self, err: &StoreError) -> &IntCounter {
        match err {
            StoreError::Timeout(_) => &self.timeout,
            StoreError::Connection(_) => &self.connection,
            StoreError::Script(_) => &self.script,
        }
    }
}

enum Backend {
    Local(LocalStore),
    /// Shared by every instance, with the rejections it decided remembered locally.
    Redis {
        store: RedisStore,
        denials: DenyCache,
        /// `sluice_deny_cache_answers_total`.
        cache_answers: IntCounter,
    },
}

/// The store every limit decision goes through, with its metrics.
pub struct Store {
    backend: Backend,
    call_duration: Histogram,
    name: &'static str,
    errors: ErrorCounters,
}

impl Store {
    /// The in-process store, holding at most about `max_keys` keys.
    pub fn local(max_keys: usize, metrics: &Metrics) -> Store {
        let local = LocalStore::new(
            max_keys,
            LocalMetrics {
                keys: metrics.local_keys.clone(),
                evictions: metrics.local_evictions.clone(),
            },
        );
        Store::with_backend(Backend::Local(local), "local", metrics)
    }

    pub fn redis(store: RedisStore, metrics: &Metrics) -> Store {
        let backend = Backend::Redis {
            store,
            denials: DenyCache::new(),
            cache_answers: metrics.deny_cache_answers.clone(),
        };
        Store::with_backend(backend, "redis", metrics)
    }

    fn with_backend(backend: Backend, name: &'static str, metrics: &Metrics) -> Store {
        Store {
            backend,
            call_duration: metrics.store_call_duration.with_label_values(&[name]),
            name,
            errors: ErrorCounters::new(metrics, name),
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Decides all checks of one request atomically.
    pub async fn decide(&self, checks: &[Check]) -> Result<Decision, StoreError> {
        let started = Instant::now();
        let result = match &self.backend {
            Backend::Local(store) => Ok(store.decide(checks)),
            Backend::Redis {
                store,
                denials,
                cache_answers,
            } => {
                if let Some(decision) = denials.answer(checks, started) {
                    cache_answers.inc();
                    return Ok(decision);
                }
                let result = store.decide(checks).await;
                if let Ok(decision) = &result {
                    denials.remember(checks, decision, started);
                }
                result
            }
        };
        self.call_duration.observe(started.elapsed().as_secs_f64());
        if let Err(err) = &result {
            self.errors.of(err).inc();
        }
        result
    }

    /// Whether the store answers now (for readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Local(_) => Ok(()),
            Backend::Redis { store, .. } => store.ping().await,
        }
    }
}
