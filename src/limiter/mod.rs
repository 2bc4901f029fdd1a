//! The limiter: given the (key, limit) pairs of one request, decide in one atomic step whether
//! the request is admitted, and say how much room is left.
//!
//! It knows nothing of HTTP. Each limit names its algorithm (`Algorithm`: the exact
//! sliding-window log by default, the sliding-window counter, the fixed window, GCRA): a
//! request is admitted only if every limit has room for its cost; if admitted, it is recorded
//! in every limit, and if rejected, in none. `Store` runs that decision either in
//! Redis (shared by every sluice instance, with an exact cache of its rejections in front) or
//! in process memory (one instance).

mod breaker;
mod deny_cache;
mod fixed_window;
mod gcra;
mod local;
mod redis;
mod sentinel;
mod sliding_log;
mod sliding_window;

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, IntCounter};

use self::breaker::{Breaker, BreakerMetrics};
use self::deny_cache::DenyCache;
use self::local::{LocalMetrics, LocalStore};
pub use self::redis::RedisStore;
pub use self::sentinel::SentinelSettings;
use crate::metrics::Metrics;

/// How a limit counts. Every algorithm runs in both stores with the same results: one Lua file
/// each under `scripts/`, one pure Rust module each for the in-process store.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Exact: every admission's time is kept for one window.
    #[default]
    SlidingLog,
    /// Two fixed-window counters, the previous one weighted: O(1), approximate.
    SlidingWindow,
    /// One counter per window that starts at the first hit: O(1), up to twice the limit
    /// across a boundary.
    FixedWindow,
    /// A token bucket kept as one timestamp: O(1), exact, with bursts of `burst`.
    Gcra,
}

impl Algorithm {
    /// The name used in the config, the Lua driver and store keys.
    pub fn label(self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::Gcra => "gcra",
        }
    }
}

/// One limit to check for a request: the full store key (prefix, route, limit, identity) and
/// every parameter of the limit that changes a decision.
#[derive(Debug, Clone)]
pub struct Check {
    pub key: String,
    pub algorithm: Algorithm,
    pub requests: u32,
    pub window: Duration,
    /// GCRA only: how many requests may arrive at once (the other algorithms ignore it).
    pub burst: u32,
    /// How many requests this one counts as.
    pub cost: u32,
    /// Evaluated and counted, but never rejects the request (a shadow limit without room
    /// records nothing in itself).
    pub shadow: bool,
}

impl Check {
    /// The limit's parameters in the stores' units.
    pub fn params(&self) -> Params {
        Params {
            algorithm: self.algorithm,
            requests: self.requests,
            window_us: u64::try_from(self.window.as_micros()).unwrap_or(u64::MAX),
            burst: self.burst,
            cost: self.cost,
            shadow: self.shadow,
        }
    }
}

/// A limit's parameters as the algorithms take them: the window in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub algorithm: Algorithm,
    pub requests: u32,
    pub window_us: u64,
    pub burst: u32,
    pub cost: u32,
    pub shadow: bool,
}

/// One algorithm's answer for one limit, before anything is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether this limit has room for the request's cost.
    pub admits: bool,
    /// For a limit without room, the exact time in microseconds until it has.
    pub wait: u64,
    /// Where the limit stands if the request is not recorded.
    pub state: LimitState,
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
    /// One flag per check: whether that limit had no room for the request. For a shadow limit
    /// this is a rejection that was only counted; for the others, a reason for the rejection.
    pub rejecting: Vec<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot reach the store: {0}")]
    Connection(String),
    #[error("the store answered with an error: {0}")]
    Script(String),
    /// The breaker is open: the store failed repeatedly and is not being called until it
    /// answers a probe again.
    #[error("the store is failing; not calling it until it answers again")]
    Unavailable,
}

impl StoreError {
    /// The kind of a failed store call; `None` when no call was made (the breaker was open).
    pub fn kind(&self) -> Option<StoreErrorKind> {
        match self {
            StoreError::Timeout(_) => Some(StoreErrorKind::Timeout),
            StoreError::Connection(_) => Some(StoreErrorKind::Connection),
            StoreError::Script(_) => Some(StoreErrorKind::Script),
            StoreError::Unavailable => None,
        }
    }
}

/// The kinds of `StoreError`, as counted by `sluice_store_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    Timeout,
    Connection,
    Script,
}

impl StoreErrorKind {
    pub fn label(self) -> &'static str {
        match self {
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::Connection => "connection",
            StoreErrorKind::Script => "script",
        }
    }
}

/// `sluice_store_errors_total` of one store, one counter per kind.
struct ErrorCounters {
    timeout: IntCounter,
    connection: IntCounter,
    script: IntCounter,
}

impl ErrorCounters {
    fn new(metrics: &Metrics, store: &str) -> ErrorCounters {
        let counter = |kind: StoreErrorKind| {
            metrics
                .store_errors
                .with_label_values(&[store, kind.label()])
        };
        ErrorCounters {
            timeout: counter(StoreErrorKind::Timeout),
            connection: counter(StoreErrorKind::Connection),
            script: counter(StoreErrorKind::Script),
        }
    }

    /// The counter of a failed call; none when no call was made (the breaker was open).
    fn of(&self, err: &StoreError) -> Option<&IntCounter> {
        Some(match err.kind()? {
            StoreErrorKind::Timeout => &self.timeout,
            StoreErrorKind::Connection => &self.connection,
            StoreErrorKind::Script => &self.script,
        })
    }
}

enum Backend {
    Local(LocalStore),
    /// Shared by every instance, with the rejections it decided remembered locally, a
    /// breaker in front, and an in-process store for routes that fall back to local limits.
    Redis {
        store: Arc<RedisStore>,
        denials: DenyCache,
        /// `sluice_deny_cache_answers_total`.
        cache_answers: IntCounter,
        breaker: Arc<Breaker>,
        fallback: LocalStore,
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
    /// The in-process store, holding at most `max_keys` keys.
    pub fn local(max_keys: usize, metrics: &Metrics) -> Store {
        Store::with_backend(
            Backend::Local(local_store(max_keys, metrics)),
            "local",
            metrics,
        )
    }

    /// Redis, with an in-process store of at most `max_keys` keys for local fallback.
    pub fn redis(store: RedisStore, max_keys: usize, metrics: &Metrics) -> Store {
        let transitions = |to| metrics.store_breaker_transitions.with_label_values(&[to]);
        let backend = Backend::Redis {
            store: Arc::new(store),
            denials: DenyCache::new(),
            cache_answers: metrics.deny_cache_answers.clone(),
            breaker: Arc::new(Breaker::new(BreakerMetrics {
                open: metrics.store_fallback_active.clone(),
                opened: transitions("open"),
                closed: transitions("closed"),
            })),
            fallback: local_store(max_keys, metrics),
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
                breaker,
                ..
            } => {
                // A remembered denial is exact whatever state Redis is in.
                if let Some(decision) = denials.answer(checks, started) {
                    cache_answers.inc();
                    return Ok(decision);
                }
                if breaker.is_open() {
                    return Err(StoreError::Unavailable);
                }
                let result = store.decide(checks).await;
                match &result {
                    Ok(decision) => {
                        breaker.record_success();
                        denials.remember(checks, decision, started);
                    }
                    Err(_) => {
                        if breaker.record_failure() {
                            let store = Arc::clone(store);
                            tokio::spawn(Arc::clone(breaker).probe(move || {
                                let store = Arc::clone(&store);
                                async move { store.ping().await.is_ok() }
                            }));
                        }
                    }
                }
                result
            }
        };
        self.call_duration.observe(started.elapsed().as_secs_f64());
        if let Some(counter) = result.as_ref().err().and_then(|err| self.errors.of(err)) {
            counter.inc();
        }
        result
    }

    /// Decides in this process's memory, with the same algorithm: the `local` answer to a
    /// store that cannot decide. Each instance then counts on its own.
    pub fn decide_locally(&self, checks: &[Check]) -> Decision {
        match &self.backend {
            Backend::Local(store) => store.decide(checks),
            Backend::Redis { fallback, .. } => fallback.decide(checks),
        }
    }

    /// Whether the store answers now (for readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Local(_) => Ok(()),
            Backend::Redis { store, .. } => store.ping().await,
        }
    }
}

fn local_store(max_keys: usize, metrics: &Metrics) -> LocalStore {
    LocalStore::new(
        max_keys,
        LocalMetrics {
            keys: metrics.local_keys.clone(),
            evictions: metrics.local_evictions.clone(),
        },
    )
}
