//! Every Prometheus metric sluice exports, defined once with its help text.
//!
//! Label values are route, limit and upstream names from the policy, outcomes and error kinds:
//! never a client identity, so the number of series is bounded by the config.

use std::sync::Mutex;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The `action` labels of `sluice_store_fallback_decisions_total`: what a route's
/// `on_store_error` does when the store cannot decide.
pub const FALLBACK_ACTIONS: [&str; 3] = ["local", "allow", "deny"];

/// What happened to a request, as counted by `sluice_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted and forwarded; the upstream answered.
    Forwarded,
    /// Admitted and answered by the route's direct response.
    Responded,
    /// Rejected with 429; or 503 when a bound on bodies read whole is reached
    /// (`Refusal::BodyBudget`, `BodyStreams`): sluice limiting, not a fault.
    Limited,
    /// Admitted, but the upstream could not be reached or timed out.
    UpstreamError,
    /// The store could not decide; answered 503.
    StoreError,
    /// The client's fault, on a route: a field its limits read repeated (400, before the
    /// decision), or a body malformed or too large (400 or 413).
    ClientError,
    /// No route matched; answered 404.
    NoRoute,
    /// Refused before routing (a head over its limits, a path with no single meaning, a
    /// method spelled in another case, `Connection` naming a field the policy reads).
    Refused,
}

impl Outcome {
    /// The outcomes of a request that matched a route.
    const ROUTED: [Outcome; 6] = [
        Outcome::Forwarded,
        Outcome::Responded,
        Outcome::Limited,
        Outcome::UpstreamError,
        Outcome::StoreError,
        Outcome::ClientError,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Responded => "responded",
            Outcome::Limited => "limited",
            Outcome::UpstreamError => "upstream_error",
            Outcome::StoreError => "store_error",
            Outcome::ClientError => "client_error",
            Outcome::NoRoute => "no_route",
            Outcome::Refused => "refused",
        }
    }
}

/// Why sluice refused a request itself, as counted by `sluice_refused_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The request line is longer than `server.max_request_line` (414).
    RequestLine,
    /// More header fields than `server.max_headers` (431).
    HeaderCount,
    /// More header bytes than `server.max_header_bytes` (431).
    HeaderBytes,
    /// A path with no single meaning (400).
    Path,
    /// The body broke off or was malformed while it streamed (400).
    BodyMalformed,
    /// The body is larger than the route's `max_body` (413).
    BodyTooLarge,
    /// The body did not arrive within the route's `body_timeout`, or fell below its
    /// `body_min_rate` (408, or the upstream request aborted if it had answered already).
    BodySlow,
    /// A field the route's limits read (key part or `when:`) appears more than once (400).
    RepeatedField,
    /// `Connection` names a field the policy reads, which would be removed before forwarding
    /// after the limiter read it (400).
    ConnectionField,
    /// A standard method spelled in another case, `post` for `POST` (400).
    MethodSpelling,
    /// The process's `server.token_body_budget` of bytes held by bodies read whole is spent
    /// (503).
    BodyBudget,
    /// The HTTP/2 connection already reads `server.token_bodies_per_connection` bodies whole
    /// (503).
    BodyStreams,
    /// A WebSocket upgrade on a route with a token budget, whose messages nothing counts (501).
    TokenUpgrade,
}

impl Refusal {
    pub const ALL: [Refusal; 13] = [
        Refusal::RequestLine,
        Refusal::HeaderCount,
        Refusal::HeaderBytes,
        Refusal::Path,
        Refusal::BodyMalformed,
        Refusal::BodyTooLarge,
        Refusal::BodySlow,
        Refusal::RepeatedField,
        Refusal::ConnectionField,
        Refusal::MethodSpelling,
        Refusal::BodyBudget,
        Refusal::BodyStreams,
        Refusal::TokenUpgrade,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Refusal::RequestLine => "request_line",
            Refusal::HeaderCount => "header_count",
            Refusal::HeaderBytes => "header_bytes",
            Refusal::Path => "path",
            Refusal::BodyMalformed => "body_malformed",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::BodySlow => "body_slow",
            Refusal::RepeatedField => "repeated_field",
            Refusal::ConnectionField => "connection_field",
            Refusal::MethodSpelling => "method_spelling",
            Refusal::BodyBudget => "body_budget",
            Refusal::BodyStreams => "body_streams",
            Refusal::TokenUpgrade => "token_upgrade",
        }
    }
}

/// Why a forwarded request got no upstream response, as counted by
/// `sluice_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// The TCP connection could not be opened in `connect_timeout`.
    Connect,
    /// No response headers within the upstream's `timeout`.
    Timeout,
    /// Anything else: the connection broke, the response was malformed.
    Other,
}

impl UpstreamErrorKind {
    pub fn label(self) -> &'static str {
        match self {
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Other => "other",
        }
    }
}

/// How one limit decided a request, as counted by `sluice_limit_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitDecision {
    Admitted,
    Rejected,
    /// A shadow limit that would have rejected the request (which it never does).
    ShadowRejected,
    /// Admitted later: the limit had no room now but within its `max_delay`, and the request
    /// was held (`on_exceed: delay`).
    Delayed,
    /// Given back after the response: its status is not one the limit's `count:` counts.
    Released,
}

impl LimitDecision {
    pub fn label(self) -> &'static str {
        match self {
            LimitDecision::Admitted => "admitted",
            LimitDecision::Rejected => "rejected",
            LimitDecision::ShadowRejected => "shadow_rejected",
            LimitDecision::Delayed => "delayed",
            LimitDecision::Released => "released",
        }
    }
}

/// How an attempt to reload the config file ended, as counted by
/// `sluice_config_reloads_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    /// The new policy replaced the old one.
    Ok,
    /// The file was refused (invalid, or it changes what needs a restart); the old policy
    /// keeps serving.
    Error,
}

impl ReloadResult {
    pub const ALL: [ReloadResult; 2] = [ReloadResult::Ok, ReloadResult::Error];

    pub fn label(self) -> &'static str {
        match self {
            ReloadResult::Ok => "ok",
            ReloadResult::Error => "error",
        }
    }
}

/// Every metric sluice exports, grouped by what it observes; each family is defined once,
/// in its group's constructor, with its help text.
pub struct Metrics {
    registry: Registry,
    pub traffic: TrafficFamilies,
    pub store: StoreFamilies,
    pub leases: LeaseFamilies,
    pub tokens: TokenFamilies,
    pub jwt: JwtFamilies,
    pub listeners: ListenerFamilies,
    pub config: ConfigFamilies,
}

/// Buckets for whole requests: from a fast local answer to a slow upstream.
const REQUEST_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Buckets for the delays applied by `on_exceed: delay` (at most a minute).
const DELAY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets for one store call: a Redis round trip on a LAN is tens to hundreds of µs.
const STORE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// Requests as a whole: their outcomes, durations, the decisions of their limits, the
/// refusals before routing, the upstream's failures, and the holds of `on_exceed: delay`.
pub struct TrafficFamilies {
    pub requests: IntCounterVec,
    pub limit_decisions: IntCounterVec,
    pub request_duration: HistogramVec,
    pub upstream_errors: IntCounterVec,
    pub refused: IntCounterVec,
    pub delay: HistogramVec,
    pub held: IntGaugeVec,
}

impl TrafficFamilies {
    fn new(registry: &Registry) -> Result<TrafficFamilies, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_requests_total",
                "Requests handled, by route and outcome.",
            ),
            &["route", "outcome"],
        )?;
        let limit_decisions = IntCounterVec::new(
            Opts::new(
                "sluice_limit_decisions_total",
                "Limit decisions, by route, limit and decision (admitted, rejected, shadow_rejected: a shadow limit that would have rejected, delayed: held by on_exceed: delay then admitted, released: given back after a response its count: does not count).",
            ),
            &["route", "limit", "decision"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_request_duration_seconds",
                "Time from a request's headers to its response headers, by route.",
            )
            .buckets(REQUEST_BUCKETS.to_vec()),
            &["route"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "sluice_upstream_errors_total",
                "Forwarded requests that got no upstream response, by upstream and kind (connect, timeout, other).",
            ),
            &["upstream", "kind"],
        )?;
        let refused = IntCounterVec::new(
            Opts::new(
                "sluice_refused_requests_total",
                "Requests sluice refused itself, by reason (request_line, header_count, header_bytes, path, body_malformed, body_too_large, body_slow, repeated_field, connection_field, method_spelling, body_budget, body_streams, token_upgrade).",
            ),
            &["reason"],
        )?;
        let delay = HistogramVec::new(
            HistogramOpts::new(
                "sluice_delay_seconds",
                "Delays applied to requests held by on_exceed: delay limits (from the decision to forwarding), by route.",
            )
            .buckets(DELAY_BUCKETS.to_vec()),
            &["route"],
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "sluice_held_requests",
                "Requests held now by on_exceed: delay limits, by route (bounded by the route's max_delayed).",
            ),
            &["route"],
        )?;
        for refusal in Refusal::ALL {
            refused.with_label_values(&[refusal.label()]);
        }
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(limit_decisions.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(delay.clone()))?;
        registry.register(Box::new(held.clone()))?;
        Ok(TrafficFamilies {
            requests,
            limit_decisions,
            request_duration,
            upstream_errors,
            refused,
            delay,
            held,
        })
    }
}

/// The limiter's store: its calls and their failures, the in-process store, the deny cache,
/// the breaker and what routes decide without the store.
pub struct StoreFamilies {
    pub store_call_duration: HistogramVec,
    pub store_errors: IntCounterVec,
    pub local_keys: IntGauge,
    pub local_evictions: IntCounter,
    pub deny_cache_answers: IntCounter,
    pub store_fallback_active: IntGauge,
    pub store_breaker_transitions: IntCounterVec,
    pub store_fallback_decisions: IntCounterVec,
    /// `sluice_store_events_total`: the store's event channel (`limiter::redis::events`).
    pub store_events: IntCounterVec,
    /// `sluice_override_changes_total`: overrides set and deleted through the admin API.
    pub override_changes: IntCounterVec,
    /// `sluice_usage_index_dropped_total`: admissions a full usage map did not note.
    pub usage_index_dropped: IntCounter,
    /// `sluice_usage_index_flushes_total`: pipelines sent to the usage index, by outcome.
    pub usage_index_flushes: IntCounterVec,
    /// `sluice_notifications_total`: threshold notifications and what became of them
    /// (`crate::notify`).
    pub notifications: IntCounterVec,
}

impl StoreFamilies {
    fn new(registry: &Registry) -> Result<StoreFamilies, prometheus::Error> {
        let store_call_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_store_call_duration_seconds",
                "Duration of one limiter store call (all limits of a request), by store.",
            )
            .buckets(STORE_BUCKETS.to_vec()),
            &["store"],
        )?;
        let store_errors = IntCounterVec::new(
            Opts::new(
                "sluice_store_errors_total",
                "Store calls that failed, by store and kind (timeout, connection, script), and decisions refused because too many were waiting for the store (queue_full).",
            ),
            &["store", "kind"],
        )?;
        let local_keys = IntGauge::new(
            "sluice_local_store_keys",
            "Keys the in-process store tracks now.",
        )?;
        let local_evictions = IntCounter::new(
            "sluice_local_store_evictions_total",
            "Keys with admissions still in their window that the in-process store dropped because it was full.",
        )?;
        let deny_cache_answers = IntCounter::new(
            "sluice_deny_cache_answers_total",
            "Rejections answered from the exact deny cache without a store call.",
        )?;
        let store_fallback_active = IntGauge::new(
            "sluice_store_fallback_active",
            "1 while the store's breaker is open and limited routes decide by their on_store_error.",
        )?;
        let store_breaker_transitions = IntCounterVec::new(
            Opts::new(
                "sluice_store_breaker_transitions_total",
                "Times the store's breaker opened (the store kept failing) or closed (it answered again).",
            ),
            &["to"],
        )?;
        let store_fallback_decisions = IntCounterVec::new(
            Opts::new(
                "sluice_store_fallback_decisions_total",
                "Requests decided without the store because it failed, by route and on_store_error action (local, allow, deny).",
            ),
            &["route", "action"],
        )?;
        let store_events = IntCounterVec::new(
            Opts::new(
                "sluice_store_events_total",
                "The store's event channel, by event: subscribed (events heard from then on), lost (not heard: no denial is remembered until subscribed again), forget (a reset or an override elsewhere ended denials).",
            ),
            &["event"],
        )?;
        let override_changes = IntCounterVec::new(
            Opts::new(
                "sluice_override_changes_total",
                "Per-identity overrides changed through this instance's admin API, by action (set, deleted).",
            ),
            &["action"],
        )?;
        let usage_index_dropped = IntCounter::new(
            "sluice_usage_index_dropped_total",
            "Admissions of report: true limits that this instance did not add to the usage index because its map of identities since the last flush was full (store.local.max_keys entries); such an identity may be missing from usage reports.",
        )?;
        let usage_index_flushes = IntCounterVec::new(
            Opts::new(
                "sluice_usage_index_flushes_total",
                "Pipelines this instance sent to the store's usage index (one per reported limit and time bucket, once a second), by outcome (ok, failed: that second's notes are lost to the index).",
            ),
            &["outcome"],
        )?;
        for outcome in ["ok", "failed"] {
            usage_index_flushes.with_label_values(&[outcome]);
        }
        registry.register(Box::new(usage_index_dropped.clone()))?;
        registry.register(Box::new(usage_index_flushes.clone()))?;
        let notifications = IntCounterVec::new(
            Opts::new(
                "sluice_notifications_total",
                "Threshold notifications (a limit's notify) this instance decided to send, by outcome: sent (the webhook answered 2xx), retried (one more try after a connection error, a timeout or a 5xx), failed (given up after the last retry, or refused with 4xx), dropped (the send queue was full).",
            ),
            &["outcome"],
        )?;
        for outcome in ["sent", "retried", "failed", "dropped"] {
            notifications.with_label_values(&[outcome]);
        }
        registry.register(Box::new(store_events.clone()))?;
        registry.register(Box::new(override_changes.clone()))?;
        registry.register(Box::new(notifications.clone()))?;
        registry.register(Box::new(store_call_duration.clone()))?;
        registry.register(Box::new(store_errors.clone()))?;
        registry.register(Box::new(local_keys.clone()))?;
        registry.register(Box::new(local_evictions.clone()))?;
        registry.register(Box::new(deny_cache_answers.clone()))?;
        registry.register(Box::new(store_fallback_active.clone()))?;
        registry.register(Box::new(store_breaker_transitions.clone()))?;
        registry.register(Box::new(store_fallback_decisions.clone()))?;
        Ok(StoreFamilies {
            store_call_duration,
            store_errors,
            local_keys,
            local_evictions,
            deny_cache_answers,
            store_fallback_active,
            store_breaker_transitions,
            store_fallback_decisions,
            store_events,
            override_changes,
            usage_index_dropped,
            usage_index_flushes,
            notifications,
        })
    }
}

/// Concurrency limits: the leases held now and what became of them.
pub struct LeaseFamilies {
    pub concurrency_in_flight: IntGaugeVec,
    pub concurrency_leases: IntCounterVec,
}

impl LeaseFamilies {
    fn new(registry: &Registry) -> Result<LeaseFamilies, prometheus::Error> {
        let concurrency_in_flight = IntGaugeVec::new(
            Opts::new(
                "sluice_concurrency_in_flight",
                "Concurrency limits: leases this instance holds now (requests in flight it admitted), by route and limit; the sum over instances is the limit's use.",
            ),
            &["route", "limit"],
        )?;
        let concurrency_leases = IntCounterVec::new(
            Opts::new(
                "sluice_concurrency_leases_total",
                "Concurrency leases by event: reclaimed (taken back by the store from an instance that stopped renewing them, counted by the instance that renews next), gone (a release found its lease already gone), restored (re-registered after the store forgot them: restarted empty, failed over), lost (a request cut because its lease could not be renewed in time), wait_timeout (a request that waited for a place up to max_delay and was refused).",
            ),
            &["event"],
        )?;
        registry.register(Box::new(concurrency_in_flight.clone()))?;
        registry.register(Box::new(concurrency_leases.clone()))?;
        Ok(LeaseFamilies {
            concurrency_in_flight,
            concurrency_leases,
        })
    }
}

/// Token budgets (`llm`): what was reserved, settled, given back and overrun, by route,
/// limit and unit.
pub struct TokenFamilies {
    pub tokens_reserved: IntCounterVec,
    pub tokens_settled: IntCounterVec,
    pub tokens_returned: IntCounterVec,
    pub token_overruns: IntCounterVec,
    pub token_overrun_tokens: IntCounterVec,
    /// `sluice_model_switches_total{route, limit, to}`: requests a soft limit sent to its
    /// fallback model (`on_exceed: { switch_model }`).
    pub model_switches: IntCounterVec,
}

impl TokenFamilies {
    fn new(registry: &Registry) -> Result<TokenFamilies, prometheus::Error> {
        let token_counter = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["route", "limit", "unit"])
        };
        let tokens_reserved = token_counter(
            "sluice_tokens_reserved_total",
            "Token budgets: tokens (or micro-currency, `unit` says) reserved by admitted requests (the upper bound from the request body), by route, limit and unit.",
        )?;
        let tokens_settled = token_counter(
            "sluice_tokens_settled_total",
            "Token budgets: tokens (or micro-currency) the reservations were settled to (the response's usage, above the reservation for an overrun; the whole reservation when the response gave no figure), by route, limit and unit.",
        )?;
        let tokens_returned = token_counter(
            "sluice_tokens_returned_total",
            "Token budgets: tokens (or micro-currency) reserved but not used, given back to the limit, by route, limit and unit.",
        )?;
        let token_overruns = token_counter(
            "sluice_token_overruns_total",
            "Token budgets: responses that reported more tokens (or micro-currency) than were reserved (the excess is charged to the limit), by route, limit and unit.",
        )?;
        let token_overrun_tokens = token_counter(
            "sluice_token_overrun_tokens_total",
            "Token budgets: tokens (or micro-currency) responses reported beyond what was reserved for them, charged to the limit, by route, limit and unit.",
        )?;
        let model_switches = IntCounterVec::new(
            Opts::new(
                "sluice_model_switches_total",
                "Soft budgets: requests a limit with on_exceed: { switch_model } had no room for and sent on to its fallback model (decided again there: admitted, or refused by the fallback's own limits), by route, limit and the model switched to.",
            ),
            &["route", "limit", "to"],
        )?;
        registry.register(Box::new(model_switches.clone()))?;
        registry.register(Box::new(tokens_reserved.clone()))?;
        registry.register(Box::new(tokens_settled.clone()))?;
        registry.register(Box::new(tokens_returned.clone()))?;
        registry.register(Box::new(token_overruns.clone()))?;
        registry.register(Box::new(token_overrun_tokens.clone()))?;
        Ok(TokenFamilies {
            tokens_reserved,
            tokens_settled,
            tokens_returned,
            token_overruns,
            token_overrun_tokens,
            model_switches,
        })
    }
}

/// JWT identities: tokens that gave none, and the fetches of `jwks_url` key sets.
pub struct JwtFamilies {
    /// `sluice_jwt_invalid_total{route, reason}`: requests whose token gave no identity.
    pub jwt_invalid: IntCounterVec,
    /// `sluice_jwks_fetches_total{verifier, outcome}`: fetches of a `jwks_url`.
    pub jwks_fetches: IntCounterVec,
    /// `sluice_jwks_keys_age_seconds{verifier}`: time since the keys in force were fetched.
    pub jwks_keys_age: GaugeVec,
}

impl JwtFamilies {
    fn new(registry: &Registry) -> Result<JwtFamilies, prometheus::Error> {
        let jwt_invalid = IntCounterVec::new(
            Opts::new(
                "sluice_jwt_invalid_total",
                "Requests on a route with `jwt:` whose token gave no identity, by route and reason (missing, malformed, signature, expired, not_yet_valid, issuer, audience, algorithm, unknown_key); the route's on_invalid says whether they got 401 or the anonymous limits.",
            ),
            &["route", "reason"],
        )?;
        let jwks_fetches = IntCounterVec::new(
            Opts::new(
                "sluice_jwks_fetches_total",
                "Fetches of a verifier's jwks_url, by verifier and outcome (ok; status, too_large, timeout, bad_set, network: refused, the last good keys keep serving; bad_set: not a JWK set, no usable key, or a repeated kid).",
            ),
            &["verifier", "outcome"],
        )?;
        let jwks_keys_age = GaugeVec::new(
            Opts::new(
                "sluice_jwks_keys_age_seconds",
                "Seconds since a jwks_url verifier's keys were last fetched successfully (updated every second); absent until a first fetch succeeds.",
            ),
            &["verifier"],
        )?;
        registry.register(Box::new(jwt_invalid.clone()))?;
        registry.register(Box::new(jwks_fetches.clone()))?;
        registry.register(Box::new(jwks_keys_age.clone()))?;
        Ok(JwtFamilies {
            jwt_invalid,
            jwks_fetches,
            jwks_keys_age,
        })
    }
}

/// The listeners: connections open and accepted, and the listener's TLS.
pub struct ListenerFamilies {
    pub open_connections: IntGaugeVec,
    pub worker_connections: IntCounterVec,
    pub tls_cert_reloads: IntCounterVec,
    pub tls_handshake_errors: IntCounter,
}

impl ListenerFamilies {
    fn new(registry: &Registry) -> Result<ListenerFamilies, prometheus::Error> {
        let open_connections = IntGaugeVec::new(
            Opts::new(
                "sluice_open_connections",
                "Client connections open now, by listener (gateway, admin).",
            ),
            &["listener"],
        )?;
        let worker_connections = IntCounterVec::new(
            Opts::new(
                "sluice_worker_connections_total",
                "Gateway connections accepted, by worker (`server.workers`: each has its own listener).",
            ),
            &["worker"],
        )?;
        let tls_cert_reloads = IntCounterVec::new(
            Opts::new(
                "sluice_tls_cert_reloads_total",
                "Changes of the listener's TLS certificate or key files, by result: ok (new handshakes use the new pair), error (refused; the old pair keeps serving).",
            ),
            &["result"],
        )?;
        let tls_handshake_errors = IntCounter::new(
            "sluice_tls_handshake_errors_total",
            "Client TLS handshakes that failed or were not done within server.header_read_timeout.",
        )?;
        for result in ReloadResult::ALL {
            tls_cert_reloads.with_label_values(&[result.label()]);
        }
        registry.register(Box::new(open_connections.clone()))?;
        registry.register(Box::new(worker_connections.clone()))?;
        registry.register(Box::new(tls_cert_reloads.clone()))?;
        registry.register(Box::new(tls_handshake_errors.clone()))?;
        Ok(ListenerFamilies {
            open_connections,
            worker_connections,
            tls_cert_reloads,
            tls_handshake_errors,
        })
    }
}

/// The config file: reloads, the version serving, versions skipped.
pub struct ConfigFamilies {
    pub config_reloads: IntCounterVec,
    pub config_hash: IntGauge,
    /// `sluice_config_versions_skipped_total`: versions of the config (or a key file) that
    /// changed again before they settled, never applied.
    pub config_versions_skipped: IntCounter,
}

impl ConfigFamilies {
    fn new(registry: &Registry) -> Result<ConfigFamilies, prometheus::Error> {
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "sluice_config_reloads_total",
                "Attempts to reload the config file (on change or SIGHUP), by result: ok (applied), error (refused; the old policy keeps serving).",
            ),
            &["result"],
        )?;
        let config_hash = IntGauge::new(
            "sluice_config_hash",
            "The config file serving now: the first 52 bits of its SHA-256 as an integer (exact in a float64), e.g. compare with `sha256sum FILE | cut -c1-13` read as hex.",
        )?;
        let config_versions_skipped = IntCounter::new(
            "sluice_config_versions_skipped_total",
            "Versions of the config file, or of a JWT key file it names, that changed again within reload.settle of being read: never applied (a file written in several steps; write a temp file and rename it over the path).",
        )?;
        for result in ReloadResult::ALL {
            config_reloads.with_label_values(&[result.label()]);
        }
        registry.register(Box::new(config_reloads.clone()))?;
        registry.register(Box::new(config_hash.clone()))?;
        registry.register(Box::new(config_versions_skipped.clone()))?;
        Ok(ConfigFamilies {
            config_reloads,
            config_hash,
            config_versions_skipped,
        })
    }
}

impl Metrics {
    /// Registers a collector defined next to what it measures (the rate limit service's
    /// metrics, `rls::metrics`), so `/metrics` exports it with the rest.
    pub fn register(&self, collector: Box<dyn Collector>) -> Result<(), prometheus::Error> {
        self.registry.register(collector)
    }

    /// Every family, registered: those whose labels are known in advance with their series
    /// at zero (reload results, refusal reasons), so a dashboard sees them at zero before the first is counted.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        let registry = Registry::new();
        let metrics = Metrics {
            traffic: TrafficFamilies::new(&registry)?,
            store: StoreFamilies::new(&registry)?,
            leases: LeaseFamilies::new(&registry)?,
            tokens: TokenFamilies::new(&registry)?,
            jwt: JwtFamilies::new(&registry)?,
            listeners: ListenerFamilies::new(&registry)?,
            config: ConfigFamilies::new(&registry)?,
            registry,
        };
        let log_lines_dropped = LogLinesDropped {
            counter: IntCounter::new(
                "sluice_log_lines_dropped_total",
                "Log lines dropped because standard error took them too slowly (the log queue was full) or refused them.",
            )?,
            one_scrape_at_a_time: Mutex::new(()),
        };
        metrics.registry.register(Box::new(log_lines_dropped))?;
        Ok(metrics)
    }

    /// The counters and histogram of one route, resolved once so the request path does no
    /// label lookups.
    pub fn for_route(&self, route: &str) -> RouteMetrics {
        let outcomes = Outcome::ROUTED.map(|o| {
            (
                o,
                self.traffic.requests.with_label_values(&[route, o.label()]),
            )
        });
        let fallback = FALLBACK_ACTIONS.map(|action| {
            let counter = self
                .store
                .store_fallback_decisions
                .with_label_values(&[route, action]);
            (action, counter)
        });
        RouteMetrics {
            outcomes,
            fallback,
            duration: self.traffic.request_duration.with_label_values(&[route]),
            delay: self.traffic.delay.with_label_values(&[route]),
            held: self.traffic.held.with_label_values(&[route]),
        }
    }

    pub fn for_limit(&self, route: &str, limit: &str) -> LimitMetrics {
        let counter = |decision: LimitDecision| {
            self.traffic
                .limit_decisions
                .with_label_values(&[route, limit, decision.label()])
        };
        LimitMetrics {
            admitted: counter(LimitDecision::Admitted),
            rejected: counter(LimitDecision::Rejected),
            shadow_rejected: counter(LimitDecision::ShadowRejected),
            delayed: counter(LimitDecision::Delayed),
            released: counter(LimitDecision::Released),
            tokens: None,
            in_flight: None,
        }
    }

    /// The token counters of a limit counted in tokens (only those get the series).
    pub fn for_token_limit(&self, route: &str, limit: &str, unit: &str) -> TokenMetrics {
        TokenMetrics {
            reserved: self
                .tokens
                .tokens_reserved
                .with_label_values(&[route, limit, unit]),
            settled: self
                .tokens
                .tokens_settled
                .with_label_values(&[route, limit, unit]),
            returned: self
                .tokens
                .tokens_returned
                .with_label_values(&[route, limit, unit]),
            overruns: self
                .tokens
                .token_overruns
                .with_label_values(&[route, limit, unit]),
            overrun_tokens: self
                .tokens
                .token_overrun_tokens
                .with_label_values(&[route, limit, unit]),
            switches: None,
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// `sluice_log_lines_dropped_total`, read from the log queue's own count when scraped: logging
/// starts before any registry exists, and the queue counts without knowing of one.
struct LogLinesDropped {
    counter: IntCounter,
    one_scrape_at_a_time: Mutex<()>,
}

impl Collector for LogLinesDropped {
    fn desc(&self) -> Vec<&Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Two scrapes at once would both add the same difference.
        let _guard = self
            .one_scrape_at_a_time
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let shown = self.counter.get();
        let dropped = crate::log::lines_dropped();
        if dropped > shown {
            self.counter.inc_by(dropped - shown);
        }
        self.counter.collect()
    }
}

#[derive(Clone)]
pub struct RouteMetrics {
    outcomes: [(Outcome, IntCounter); Outcome::ROUTED.len()],
    /// `sluice_store_fallback_decisions_total` of this route, by action.
    fallback: [(&'static str, IntCounter); FALLBACK_ACTIONS.len()],
    pub duration: Histogram,
    /// `sluice_delay_seconds` of this route.
    pub delay: Histogram,
    /// `sluice_held_requests` of this route: also the count `max_delayed` bounds, shared by
    /// the policies before and after a reload (same label, same gauge).
    pub held: IntGauge,
}

impl RouteMetrics {
    pub fn count(&self, outcome: Outcome) {
        // Outcomes before routing have no route to count under; the gateway counts them.
        if let Some((_, counter)) = self.outcomes.iter().find(|(o, _)| *o == outcome) {
            counter.inc();
        }
    }

    /// Counts a request decided without the store, by what the route did instead (one of
    /// `FALLBACK_ACTIONS`: the labels of `on_store_error`).
    pub fn count_fallback(&self, action: &str) {
        if let Some((_, counter)) = self.fallback.iter().find(|(a, _)| *a == action) {
            counter.inc();
        }
    }
}

#[derive(Clone)]
pub struct LimitMetrics {
    pub admitted: IntCounter,
    pub rejected: IntCounter,
    pub shadow_rejected: IntCounter,
    pub delayed: IntCounter,
    pub released: IntCounter,
    /// A limit counted in tokens: its token counters.
    pub tokens: Option<TokenMetrics>,
    /// A concurrency limit: `sluice_concurrency_in_flight` of it.
    pub in_flight: Option<IntGauge>,
}

/// The counters of a token budget, in tokens, by route and limit.
#[derive(Clone)]
pub struct TokenMetrics {
    /// `sluice_tokens_reserved_total`: reserved by admitted requests.
    pub reserved: IntCounter,
    /// `sluice_tokens_settled_total`: what the reservations were settled to (above the
    /// reservation for an overrun; kept whole when the answer gave no figure).
    pub settled: IntCounter,
    /// `sluice_tokens_returned_total`: reserved but not used, given back.
    pub returned: IntCounter,
    /// `sluice_token_overruns_total`: answers that reported more than was reserved.
    pub overruns: IntCounter,
    /// `sluice_token_overrun_tokens_total`: the tokens those answers reported beyond their
    /// reservations, charged to the limit.
    pub overrun_tokens: IntCounter,
    /// `sluice_model_switches_total` of a limit that switches models (`None` for the others).
    pub switches: Option<IntCounter>,
}
