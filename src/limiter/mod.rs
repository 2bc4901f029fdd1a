//! The limiter: given the (key, limit) pairs of one request, decide in one atomic step whether
//! the request is admitted, and say how much room is left.
//!
//! It knows nothing of HTTP. Each limit names its algorithm (`Algorithm`: the exact
//! sliding-window log by default, the sliding-window counter, the fixed window, GCRA): a
//! request is admitted only if every limit has room for its cost; if admitted, it is recorded
//! in every limit, and if rejected, in none. `Store` runs that decision either in
//! Redis (shared by every sluice instance, with an exact cache of its rejections in front; one
//! node, a master found through Sentinel, or a Cluster) or in process memory (one instance).
//! An admitted request's places can be given back (`Store::release`): for a held client that
//! leaves, an outcome a `count:` limit does not count, and a request rejected in another
//! cluster slot.

mod algorithm;
mod breaker;
pub mod calendar;
mod concurrency;
mod deny_cache;
mod fixed_window;
mod gcra;
pub mod key_text;
mod leases;
mod local;
pub mod overrides;
mod redis;
mod sliding_log;
mod sliding_window;
pub mod thresholds;
pub mod usage;
mod weighted_log;

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, IntCounter};

pub use self::algorithm::{Algorithm, PeekCount, Traits, ALGORITHMS};
use self::breaker::{Breaker, BreakerMetrics};
use self::deny_cache::{DenyCache, Lookup};
use self::leases::{Held, LeaseCounters};
pub use self::leases::{Lease, LeaseHold};
use self::local::{LocalMetrics, LocalStore};
pub use self::redis::{slot_of, ClusterSettings};
pub use self::redis::{RedisStore, SentinelSettings, Topology};
pub use self::thresholds::Thresholds;
use crate::metrics::Metrics;

/// Every parameter of one limit that changes a decision: declared here once, carried by the
/// policy's limit and by each check. The algorithms read it directly; the stores' microsecond
/// forms are its methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spec {
    pub algorithm: Algorithm,
    pub requests: u32,
    /// The window; for a calendar quota, the time left until its period ends, set per
    /// request by `request::store_key::check` (the policy's own spec holds the nominal length).
    pub window: Duration,
    /// GCRA only: how many requests may arrive at once (the other algorithms ignore it).
    pub burst: u32,
    /// How many requests one request counts as.
    pub cost: u32,
    /// Evaluated and counted, but never rejects the request (a shadow limit without room
    /// records nothing in itself).
    pub shadow: bool,
    /// `on_exceed: delay`: the longest a request this limit has no room for may be held to be
    /// admitted later instead of rejected; zero = reject (sliding_log and gcra only).
    pub max_delay: Duration,
    /// The request's place may be given back before it expires (`count:` by outcome), so
    /// this limit's room can grow other than with time: its rejections are never cached.
    pub returnable: bool,
    /// `overrides: true`: an identity's `requests` may be overridden at run time (the admin
    /// API, `limiter::overrides`); the store reads the override, if any, in the decision's
    /// own call, so one decision never mixes two numbers.
    pub overridable: bool,
    /// `notify`: the fractions of the limit in force whose crossing the store reports, once
    /// per identity and window or period (`thresholds`); empty: none, and nothing more is
    /// done or sent.
    pub notify: Thresholds,
}

impl Spec {
    /// The window in microseconds, the unit of the stores' clocks.
    pub fn window_us(&self) -> u64 {
        micros(self.window)
    }

    /// The longest delay instead of a rejection in microseconds, as the stores apply it; 0 =
    /// reject. Only an algorithm whose wait is exact delays in the store: a concurrency limit's
    /// `max_delay` is a wait for a place outside it (`proxy::hold`), holding nothing.
    pub fn max_delay_us(&self) -> u64 {
        if self.algorithm.traits().delays_in_store {
            micros(self.max_delay)
        } else {
            0
        }
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// One limit to check for a request: the full store key (prefix, route, limit, identity) and
/// the limit's parameters. `Default` is there so code that builds checks by hand can name
/// only the fields it cares about (`..Spec::default()`).
#[derive(Debug, Clone, Default)]
pub struct Check {
    pub key: String,
    pub spec: Spec,
}

/// Whether `checks` live in more than one Redis Cluster slot (and so are decided per slot).
pub fn spans_slots(checks: &[Check]) -> bool {
    redis::cluster::slot_groups(checks).is_some()
}

/// Whether one limit has room for a request's cost, as its algorithm answers before anything
/// is recorded: how long until it has, and where the limit stands meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
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
    /// The identity's override of the limit's `requests` that decided this (`overrides:
    /// true`); `None`: the policy's number.
    pub overridden: Option<u32>,
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
    /// this is a rejection that was only counted; for the others, a reason for the rejection
    /// (or, for an admitted request, for its delay).
    pub rejecting: Vec<bool>,
    /// For an admitted request, what `Store::release` needs to give its places back; `None`
    /// for a rejection.
    pub admission: Option<Admission>,
    /// The thresholds (`Spec::notify`) this admission newly crossed and marked, one set of
    /// bits per check (bit i: the limit's i-th threshold); empty when it crossed none, as for
    /// every limit without `notify`.
    pub crossed: Vec<u8>,
}

impl Decision {
    /// How long an admitted request must be held before it is forwarded (`on_exceed: delay`):
    /// zero unless some limit delayed it.
    pub fn delay(&self) -> Duration {
        self.admission.as_ref().map_or(Duration::ZERO, |a| {
            Duration::from_micros(a.at_us - a.decided_us)
        })
    }
}

/// Where an admitted request was recorded, so that it can be given back (`Store::release`).
/// Times are on the clock of the store that decided (Redis TIME, or the in-process store's
/// monotonic clock): only that store can use them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// The Redis script's member prefix of this request (`{instance:016x}-{seq}`): the
    /// sliding log's entries are `member:1` .. `member:cost`. Empty for an in-process decision.
    pub member: String,
    /// When the request was recorded in the exact algorithms (sliding_log, gcra): the time it
    /// is forwarded, in the future for a delayed request. Store-clock microseconds.
    pub at_us: u64,
    /// When the store decided: the counters (fixed_window, sliding_window) are recorded then.
    pub decided_us: u64,
    /// Decided by the in-process store (the local store, or Redis's local fallback), which
    /// is then the one to give it back to.
    pub local: bool,
}

/// Where one identity's limit stands, read without recording anything (the admin API).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peek {
    /// Requests counted against the limit now (see `scripts/peek.lua` for each algorithm).
    pub count: u64,
    /// Requests of cost 1 the limit would still admit now.
    pub remaining: u32,
    /// Time until the limit admits one more request than now; zero when it holds nothing.
    pub reset: Duration,
    /// Time until a request of the check's cost fits; zero when it fits now.
    pub wait: Duration,
    /// The identity's override of `requests` in force (`overrides`); `None`: the policy's.
    pub overridden: Option<u32>,
}

/// One request holding a place of a concurrency limit (the admin API's list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The lease id: the request's member (`{instance:016x}-{seq}`; a number in process).
    pub lease: String,
    /// The instance holding it (16 hex digits), `local` for the in-process store.
    pub instance: String,
    /// How long it has been held.
    pub age: Duration,
}

/// What a reset forgot: the store's key, a remembered denial, the local fallback's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Forgotten {
    pub store_key: bool,
    pub deny_cache: bool,
    pub fallback: bool,
    /// How many instances (this one included) were told to forget their denials of the key
    /// (`redis::events`); `None` in process, or when the event could not be published (the
    /// others then answer their remembered denial until it ends).
    pub instances_told: Option<u64>,
}

#[derive(Debug, Clone, thiserror::Error)]
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
    /// Too many decisions are already waiting for the store on this connection: Redis is not
    /// keeping up with the requests (see `redis::batch`). Nothing was sent.
    #[error("too many decisions are waiting for the store")]
    Busy,
}

impl StoreError {
    /// The kind of a failed store call; `None` when no call was made (the breaker was open).
    pub fn kind(&self) -> Option<StoreErrorKind> {
        match self {
            StoreError::Timeout(_) => Some(StoreErrorKind::Timeout),
            StoreError::Connection(_) => Some(StoreErrorKind::Connection),
            StoreError::Script(_) => Some(StoreErrorKind::Script),
            StoreError::Busy => Some(StoreErrorKind::QueueFull),
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
    /// Not a call that failed: the decision found its connection's queue full.
    QueueFull,
}

impl StoreErrorKind {
    pub fn label(self) -> &'static str {
        match self {
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::Connection => "connection",
            StoreErrorKind::Script => "script",
            StoreErrorKind::QueueFull => "queue_full",
        }
    }
}

/// `sluice_store_errors_total` of one store, one counter per kind.
struct ErrorCounters {
    timeout: IntCounter,
    connection: IntCounter,
    script: IntCounter,
    queue_full: IntCounter,
}

impl ErrorCounters {
    fn new(metrics: &Metrics, store: &str) -> ErrorCounters {
        let counter = |kind: StoreErrorKind| {
            metrics
                .store
                .store_errors
                .with_label_values(&[store, kind.label()])
        };
        ErrorCounters {
            timeout: counter(StoreErrorKind::Timeout),
            connection: counter(StoreErrorKind::Connection),
            script: counter(StoreErrorKind::Script),
            queue_full: counter(StoreErrorKind::QueueFull),
        }
    }

    /// The counter of a failed call; none when no call was made (the breaker was open).
    fn of(&self, err: &StoreError) -> Option<&IntCounter> {
        Some(match err.kind()? {
            StoreErrorKind::Timeout => &self.timeout,
            StoreErrorKind::Connection => &self.connection,
            StoreErrorKind::Script => &self.script,
            StoreErrorKind::QueueFull => &self.queue_full,
        })
    }
}

enum Backend {
    Local(LocalStore),
    /// Shared by every instance, with the rejections it decided remembered locally, a
    /// breaker in front, and an in-process store for routes that fall back to local limits.
    Redis {
        store: Arc<RedisStore>,
        denials: Arc<DenyCache>,
        /// `sluice_deny_cache_answers_total`.
        cache_answers: IntCounter,
        breaker: Arc<Breaker>,
        fallback: LocalStore,
        /// The concurrency leases this instance holds in Redis, renewed by a task of their own.
        leases: Arc<Held>,
        /// Who used the reported limits since the last flush (`usage`), flushed by a task of
        /// its own.
        usage: Arc<usage::UsageIndex>,
    },
}

/// The store every limit decision goes through, with its metrics.
pub struct Store {
    backend: Backend,
    call_duration: Histogram,
    name: &'static str,
    errors: ErrorCounters,
    lease_counters: LeaseCounters,
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
        let transitions = |to| {
            metrics
                .store
                .store_breaker_transitions
                .with_label_values(&[to])
        };
        let store = Arc::new(store);
        let leases = Arc::new(Held::default());
        tokio::spawn(leases::renew(
            Arc::downgrade(&leases),
            Arc::clone(&store),
            lease_counters(metrics),
        ));
        let denials = Arc::new(DenyCache::new());
        tokio::spawn(redis::listen(Arc::downgrade(&store), {
            let denials = Arc::clone(&denials);
            let events = metrics.store.store_events.clone();
            move |event| heard(&denials, &events, event)
        }));
        let usage = Arc::new(usage::UsageIndex::new(
            usage::DEFAULT_MAX_PENDING,
            metrics.store.usage_index_dropped.clone(),
        ));
        tokio::spawn(flush_usage(
            Arc::downgrade(&usage),
            Arc::downgrade(&store),
            metrics.store.usage_index_flushes.clone(),
        ));
        let timeout = store.timeout();
        let backend = Backend::Redis {
            store,
            denials,
            cache_answers: metrics.store.deny_cache_answers.clone(),
            breaker: Arc::new(Breaker::new(
                BreakerMetrics {
                    open: metrics.store.store_fallback_active.clone(),
                    opened: transitions("open"),
                    closed: transitions("closed"),
                },
                timeout,
            )),
            fallback: local_store(max_keys, metrics),
            leases,
            usage,
        };
        Store::with_backend(backend, "redis", metrics)
    }

    fn with_backend(backend: Backend, name: &'static str, metrics: &Metrics) -> Store {
        Store {
            backend,
            call_duration: metrics.store.store_call_duration.with_label_values(&[name]),
            name,
            errors: ErrorCounters::new(metrics, name),
            lease_counters: lease_counters(metrics),
        }
    }

    /// The concurrency leases this instance holds in Redis; `None` in process.
    fn held_leases(&self) -> Option<&Arc<Held>> {
        match &self.backend {
            Backend::Local(_) => None,
            Backend::Redis { leases, .. } => Some(leases),
        }
    }

    /// Releases every concurrency lease this instance still holds in Redis: at exit, after
    /// the drain, for the requests it cut and the releases that had not landed (a drop at
    /// shutdown cannot count on its task running). Bounded by `within`.
    pub async fn end_leases(&self, within: Duration) {
        let Backend::Redis { store, leases, .. } = &self.backend else {
            return;
        };
        match tokio::time::timeout(within, leases::end_all(leases, store)).await {
            Ok(0) => {}
            Ok(ended) => tracing::info!(leases = ended, "released the concurrency leases of requests cut at exit"),
            Err(_) => tracing::warn!("could not release every concurrency lease at exit; the store reclaims them after their lease period"),
        }
    }

    /// Counts releases that found their lease already gone.
    fn count_gone(&self, gone: usize) {
        self.lease_counters.gone.inc_by(gone as u64);
    }

    /// Counts a request that waited for a concurrency limit's place up to its `max_delay` and
    /// was refused.
    pub fn count_wait_timeout(&self) {
        self.lease_counters.wait_timeout.inc();
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
                let asking = match denials.lookup(checks, started) {
                    Lookup::Denied(decision) => {
                        cache_answers.inc();
                        return Ok(decision);
                    }
                    Lookup::Miss => None,
                    Lookup::Ask(asking) => Some(asking),
                    Lookup::Wait(answered) => {
                        // Boxed for the same reason as the call below.
                        match Box::pin(wait_for_asker(denials, checks, answered, store.timeout()))
                            .await
                        {
                            Ok(decision) => {
                                cache_answers.inc();
                                return Ok(decision);
                            }
                            Err(asking) => asking,
                        }
                    }
                };
                if breaker.is_open() {
                    if let Some(asking) = asking {
                        denials.asked(asking, checks, None);
                    }
                    return Err(StoreError::Unavailable);
                }
                // Boxed: the Redis call's future is large, and inline it would make every
                // request's future (moved several times per request) as large, local or not.
                let result = Box::pin(store.decide(checks)).await;
                match &result {
                    Ok(decision) => {
                        breaker.record_success();
                        denials.remember(checks, decision, started);
                    }
                    // Not Redis failing: this instance has more decisions waiting than it
                    // lets queue. The breaker's probe would find Redis answering.
                    Err(StoreError::Busy) => {}
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
                if let Some(asking) = asking {
                    // After `remember`, so that the waiters find the new denial.
                    denials.asked(asking, checks, result.as_ref().ok());
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

    /// Gives back what an admitted request recorded in `checks` (a subset of the checks it was
    /// decided with, with the same parameters): afterwards those limits stand as if the
    /// request had never been admitted by them, as exactly as each algorithm allows (see
    /// `scripts/release.lua`). Used for a held client that leaves (`on_exceed: delay`), for
    /// an outcome a `count:` limit does not count, and by multi-call stores to undo the part
    /// of a request that was admitted when another part was rejected.
    ///
    /// Never answered from the deny cache. A release makes room other than with time, which
    /// the cache's exactness rests on, so this instance forgets its cached denials of those
    /// keys (a `returnable` limit's denials are never cached in the first place). Other
    /// instances may still hold a denial of those keys until its wait ends: they refuse
    /// where the store would now admit (under-admit), never the other way.
    /// Returns how many of `checks` held something to give back (for a concurrency limit: its
    /// lease, which a reclaim or an earlier release may have taken already).
    pub async fn release(
        &self,
        checks: &[Check],
        admission: &Admission,
    ) -> Result<usize, StoreError> {
        self.keep(checks, admission, 0).await
    }

    /// Keeps `used` units of each check's cost of an admitted request and gives back the
    /// rest, as `release` does, so each limit stands as if the request had been admitted with
    /// cost `used`: the store's part of the token settlement (`proxy::tokens::settle`). A
    /// token budget reserves an upper bound of what a request can consume and keeps here what
    /// the response says it did consume. When `used` is above a check's cost (the answer
    /// reports more than was reserved), the excess is charged to the request's entry, at its
    /// time, so its identity waits for what was really spent; that can take the limit past
    /// its `requests` (the units were spent upstream already). Only the algorithms a token
    /// budget runs on (the table's `settles_exactly`) charge; a request no longer recorded (reset, or
    /// gone from its window) is not charged.
    pub async fn keep(
        &self,
        checks: &[Check],
        admission: &Admission,
        used: u32,
    ) -> Result<usize, StoreError> {
        if checks.iter().all(|check| check.spec.cost == used) {
            return Ok(0);
        }
        match &self.backend {
            Backend::Local(store) => Ok(store.release(checks, admission, used)),
            Backend::Redis { fallback, .. } if admission.local => {
                Ok(fallback.release(checks, admission, used))
            }
            Backend::Redis { store, denials, .. } => {
                denials.forget_checks(checks);
                let result = Box::pin(store.release(checks, admission, used)).await;
                if let Some(counter) = result.as_ref().err().and_then(|err| self.errors.of(err)) {
                    counter.inc();
                }
                result
            }
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

/// One identity's state, for the admin API: read without consuming, and reset.
impl Store {
    /// Where `check` stands for one more request (`count`, `remaining` and `reset` for cost
    /// 1; `wait` for the check's own cost), and which store answered:
    /// `local`, `redis`, or `local_fallback` while the breaker is open (the store that decides
    /// then, for routes with `on_store_error: local`). Records nothing.
    pub async fn peek(&self, check: &Check) -> Result<(Peek, &'static str), StoreError> {
        match &self.backend {
            Backend::Local(store) => Ok((store.peek(check), "local")),
            Backend::Redis {
                store,
                breaker,
                fallback,
                ..
            } => {
                if breaker.is_open() {
                    return Ok((fallback.peek(check), "local_fallback"));
                }
                Ok((store.peek(check).await?, "redis"))
            }
        }
    }

    /// The requests holding places of the concurrency limit `check` now, and which store
    /// answered (as `peek`).
    pub async fn holders(&self, check: &Check) -> Result<(Vec<Holder>, &'static str), StoreError> {
        match &self.backend {
            Backend::Local(store) => Ok((store.holders(&check.key), "local")),
            Backend::Redis {
                store,
                breaker,
                fallback,
                ..
            } => {
                if breaker.is_open() {
                    return Ok((fallback.holders(&check.key), "local_fallback"));
                }
                let (held, now) = store.holders(&check.key).await?;
                let holders = held
                    .into_iter()
                    .map(|(lease, taken)| Holder {
                        instance: lease.split('-').next().unwrap_or_default().to_owned(),
                        lease,
                        age: Duration::from_micros(now.saturating_sub(taken)),
                    })
                    .collect();
                Ok((holders, "redis"))
            }
        }
    }

    /// Ends one lease of the concurrency limit `check` (the admin API): its place is free at
    /// once; the request holding it goes on, its own release later finding it gone. Whether
    /// it was held.
    pub async fn end_lease(&self, check: &Check, lease: &str) -> Result<bool, StoreError> {
        let admission = Admission {
            member: lease.to_owned(),
            at_us: 0,
            decided_us: 0,
            local: matches!(self.backend, Backend::Local(_)),
        };
        let released = self
            .release(std::slice::from_ref(check), &admission)
            .await?;
        Ok(released > 0)
    }

    /// Forgets everything this instance and the store hold for `check.key`: the store's key,
    /// and with Redis also this instance's remembered denial and local-fallback state, so the
    /// identity's next request is decided afresh. The local parts are forgotten even when
    /// Redis fails (the error is returned).
    pub async fn reset(&self, check: &Check) -> Result<Forgotten, StoreError> {
        match &self.backend {
            Backend::Local(store) => Ok(Forgotten {
                store_key: store.forget(&check.key),
                ..Forgotten::default()
            }),
            Backend::Redis {
                store,
                denials,
                fallback,
                ..
            } => {
                let deny_cache = denials.forget(&check.key);
                let fallback = fallback.forget(&check.key);
                let store_key = store.reset(&check.key).await?;
                // Every other instance forgets its denials of the key too (`redis::events`).
                let told = store.publish_forget(&check.key).await.ok();
                Ok(Forgotten {
                    store_key,
                    deny_cache,
                    fallback,
                    instances_told: told,
                })
            }
        }
    }
}

/// Overrides of one identity's limit (`overrides`), for the admin API.
impl Store {
    /// Sets the override of `check`'s identity to `requests` for `ttl`, its limit noted in
    /// `registry` (`overrides::registry_of`): the override it replaced, and how many
    /// instances were told to forget their denials of the identity (`None` in process, or
    /// when that could not be published).
    pub async fn set_override(
        &self,
        check: &Check,
        requests: u32,
        ttl: Duration,
        registry: &str,
    ) -> Result<(Option<u32>, Option<u64>), overrides::OverrideError> {
        let key = override_key(check)?;
        match &self.backend {
            Backend::Local(store) => Ok((store.set_override(&key, requests, ttl)?, None)),
            Backend::Redis { store, denials, .. } => {
                let old = store.set_override(&key, requests, ttl, registry).await?;
                Ok((old, changed(store, denials, &check.key).await))
            }
        }
    }

    /// The override of `check`'s identity in force, if any.
    pub async fn get_override(
        &self,
        check: &Check,
    ) -> Result<Option<overrides::Override>, StoreError> {
        let key = override_key(check)?;
        match &self.backend {
            Backend::Local(store) => Ok(store.get_override(&key)),
            Backend::Redis { store, .. } => store.get_override(&key).await,
        }
    }

    /// The limits holding overrides (noted in `registry` in Redis), at most `most`, whether
    /// or not the policy still has them.
    pub async fn overridden_limits(
        &self,
        registry: &str,
        most: usize,
    ) -> Result<Vec<overrides::Holder>, StoreError> {
        match &self.backend {
            Backend::Local(store) => Ok(store.overridden_limits(most)),
            Backend::Redis { store, .. } => store.overridden_limits(registry, most).await,
        }
    }

    /// The overrides of `check`'s limit (any identity), at most `most`, soonest to expire
    /// first.
    pub async fn list_overrides(
        &self,
        check: &Check,
        most: usize,
    ) -> Result<Vec<overrides::Listed>, StoreError> {
        match &self.backend {
            Backend::Local(store) => Ok(store.list_overrides(&check.key, most)),
            Backend::Redis { store, .. } => store.list_overrides(&check.key, most).await,
        }
    }

    /// Deletes the override of `check`'s identity: the one it was, and how many instances
    /// were told (as `set_override`).
    pub async fn delete_override(
        &self,
        check: &Check,
    ) -> Result<(Option<u32>, Option<u64>), StoreError> {
        let key = override_key(check)?;
        match &self.backend {
            Backend::Local(store) => Ok((store.delete_override(&key), None)),
            Backend::Redis { store, denials, .. } => {
                let old = store.delete_override(&key).await?;
                Ok((old, changed(store, denials, &check.key).await))
            }
        }
    }
}

fn override_key(check: &Check) -> Result<String, StoreError> {
    overrides::key_of(&check.key)
        .ok_or_else(|| StoreError::Script(format!("the key {} has no identity", check.key)))
}

/// After an override of the identity of `key` changed: every instance forgets its denials
/// of the identity (this one at once); how many instances heard it.
async fn changed(store: &RedisStore, denials: &DenyCache, key: &str) -> Option<u64> {
    let prefix = overrides::identity_prefix(key);
    denials.forget_prefix(prefix);
    store.publish_forget(prefix).await.ok()
}

/// What the store's event channel says, applied to this instance's deny cache.
fn heard(denials: &DenyCache, events: &prometheus::IntCounterVec, event: redis::Event) {
    let label = match &event {
        redis::Event::Subscribed => "subscribed",
        redis::Event::Lost => "lost",
        redis::Event::Forget(_) => "forget",
    };
    events.with_label_values(&[label]).inc();
    match event {
        redis::Event::Subscribed => {
            denials.listening(true);
            tracing::info!("listening to the store's events: denials are remembered");
        }
        redis::Event::Lost => {
            denials.listening(false);
            tracing::warn!("cannot hear the store's events: no denial is remembered (every decision asks the store) until they are heard again");
        }
        redis::Event::Forget(prefix) => {
            let forgotten = denials.forget_prefix(&prefix);
            tracing::debug!(forgotten, "store event: denials forgotten");
        }
    }
}

/// Waits (at most `bound`) while other requests ask the store about a key of `checks` whose
/// denial has just expired, looking again after each answer: the rejection a new denial
/// gives, or, when the key has room or the wait is over, whether this request is to ask the
/// store as the first one (`Some`) or as any other (`None`).
async fn wait_for_asker(
    denials: &DenyCache,
    checks: &[Check],
    mut answered: tokio::sync::watch::Receiver<()>,
    bound: Duration,
) -> Result<Decision, Option<deny_cache::Asking>> {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        // Ends with the asker's answer (its sender dropped), never with a value.
        if tokio::time::timeout_at(deadline, answered.changed())
            .await
            .is_err()
        {
            return Err(None);
        }
        match denials.lookup(checks, Instant::now()) {
            Lookup::Denied(decision) => return Ok(decision),
            Lookup::Miss => return Err(None),
            Lookup::Ask(asking) => return Err(Some(asking)),
            Lookup::Wait(next) => answered = next,
        }
    }
}

fn lease_counters(metrics: &Metrics) -> LeaseCounters {
    let counter = |event: &str| {
        metrics
            .leases
            .concurrency_leases
            .with_label_values(&[event])
    };
    LeaseCounters {
        reclaimed: counter("reclaimed"),
        gone: counter("gone"),
        restored: counter("restored"),
        lost: counter("lost"),
        wait_timeout: counter("wait_timeout"),
    }
}

fn local_store(max_keys: usize, metrics: &Metrics) -> LocalStore {
    LocalStore::new(
        max_keys,
        LocalMetrics {
            keys: metrics.store.local_keys.clone(),
            evictions: metrics.store.local_evictions.clone(),
        },
    )
}

/// Usage reports (`usage`): the index of who used a reported limit, and where each stands.
impl Store {
    /// Notes that the identity of `key` used `units` of its limit (nominal window `window`):
    /// with Redis, into this instance's map for the next flush (no store call); in process,
    /// nothing (the store's own keys answer a report).
    pub fn note_usage(&self, key: &str, window: Duration, units: u64) {
        if let Backend::Redis { usage, .. } = &self.backend {
            let now = u64::try_from(crate::runtime::clock::now().as_second()).unwrap_or(0);
            usage.note(key, window, units, now);
        }
    }

    /// Bounds this instance's map of identities between two flushes of the usage index
    /// (`store.local.max_reported`); in process there is no such map.
    pub fn bound_usage(&self, max: usize) {
        if let Backend::Redis { usage, .. } = &self.backend {
            usage.bound(max);
        }
    }

    /// Up to `most` identities per bucket (`usage::buckets_to_read`) that used the limit
    /// whose keys are `key`'s, best first, with what the index counts for them (in process:
    /// every identity the store holds a key of for the limit, counted 0; the caller peeks
    /// each). Reads no keyspace: with Redis one `ZREVRANGE` per bucket.
    pub async fn usage_candidates(
        &self,
        key: &str,
        window: Duration,
        calendar: bool,
        most: usize,
    ) -> Result<Vec<(String, f64)>, StoreError> {
        let prefix = key.find('{').map_or(key, |brace| &key[..brace]);
        match &self.backend {
            Backend::Local(store) => Ok(store
                .identities_under(prefix)
                .into_iter()
                .map(|identity| (identity, 0.0))
                .collect()),
            Backend::Redis { store, .. } => {
                let now = u64::try_from(crate::runtime::clock::now().as_second()).unwrap_or(0);
                let mut found: Vec<(String, f64)> = Vec::new();
                for bucket in usage::buckets_to_read(window, now, calendar) {
                    let index = usage::index_key(key, bucket);
                    for (identity, score) in store.top_usage(&index, most).await? {
                        match found.iter_mut().find(|(seen, _)| *seen == identity) {
                            Some((_, total)) => *total += score,
                            None => found.push((identity, score)),
                        }
                    }
                }
                found.sort_by(|a, b| b.1.total_cmp(&a.1));
                Ok(found)
            }
        }
    }
}

/// Adds what this instance noted (`usage`) to the store's index every `usage::FLUSH_EVERY`,
/// off the request path, until the store is dropped. A failed flush loses that second's
/// notes (counted): the index names candidates, the report's numbers come from the store.
async fn flush_usage(
    index: std::sync::Weak<usage::UsageIndex>,
    store: std::sync::Weak<RedisStore>,
    flushes: prometheus::IntCounterVec,
) {
    let mut every = tokio::time::interval(usage::FLUSH_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let (Some(index), Some(store)) = (index.upgrade(), store.upgrade()) else {
            return;
        };
        let pending = index.take();
        drop(index);
        for (key, one) in pending.indexes() {
            let outcome = match store.add_usage(&key, one.identities.iter(), one.ttl).await {
                Ok(()) => "ok",
                Err(err) => {
                    tracing::debug!(%err, index = key, "usage index: flush failed");
                    "failed"
                }
            };
            flushes.with_label_values(&[outcome]).inc();
        }
    }
}
