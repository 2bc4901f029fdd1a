//! The policy as the request path reads it: routes, their actions and limits, and the upstreams
//! they forward to.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Method, StatusCode};

use super::{Condition, Field, Matcher};
use crate::config::{
    ForwardedHeader, IpNet, KeyPart, Name, OnStoreError, ResponseHeaders, StatusMatch,
    DEFAULT_IPV4_PREFIX, DEFAULT_IPV6_PREFIX,
};
use crate::jwt::{Claims, OnInvalid, Verifier};
use crate::limiter::calendar::Quota;
use crate::limiter::Spec;
use crate::metrics::{LimitMetrics, RouteMetrics};
use crate::ratelimit_field::{ceil_seconds, limit_items_in};
use crate::tls::UpstreamTls;

/// What a policy's routes and limits carry to count into: nothing once compiled
/// (`Unmetered`), their Prometheus handles once in force (`Metered`). Only `metrics` and
/// what holds it differ between the two: the rest of a route or limit is its `settings`,
/// moved whole when the handles are attached (`Compiled::metered`), and read through it
/// (`Deref`), so `route.name` reads `route.settings.name`.
pub trait Metering: 'static {
    type Route: 'static;
    type Limit: 'static;
}

/// A policy as compiled: checked and complete, but counting into nothing yet.
pub enum Unmetered {}

impl Metering for Unmetered {
    type Route = ();
    type Limit = ();
}

/// A policy with the metric handles of each route and limit: the one the request path uses.
pub enum Metered {}

impl Metering for Metered {
    type Route = RouteMetrics;
    type Limit = LimitMetrics;
}

impl<M: Metering> Deref for Policy<M> {
    type Target = PolicySettings;

    fn deref(&self) -> &PolicySettings {
        &self.settings
    }
}

impl<M: Metering> Deref for Route<M> {
    type Target = RouteSettings;

    fn deref(&self) -> &RouteSettings {
        &self.settings
    }
}

impl<M: Metering> Deref for Limit<M> {
    type Target = LimitSettings;

    fn deref(&self) -> &LimitSettings {
        &self.settings
    }
}

/// A compiled policy before its metric handles are attached.
pub type Compiled = Policy<Unmetered>;

pub struct Policy<M: Metering = Metered> {
    pub routes: Vec<Route<M>>,
    pub settings: PolicySettings,
}

/// A policy's settings besides its routes.
pub struct PolicySettings {
    /// Peers whose forwarded-for header is believed, and which header that is.
    pub trusted_proxies: Vec<IpNet>,
    pub forwarded_header: ForwardedHeader,
    /// The header fields a `Connection` option may not name (see `fields::connection_guarded`).
    pub connection_guarded: Vec<HeaderName>,
    /// `store.key_prefix`: what every store key starts with (`crate::request::store_key`).
    pub key_prefix: String,
    pub(super) index: super::index::RouteIndex,
}

pub struct Route<M: Metering = Metered> {
    pub settings: RouteSettings,
    pub limits: Vec<Limit<M>>,
    pub metrics: M::Route,
}

/// A route's settings besides its limits and metric handles.
pub struct RouteSettings {
    pub name: Name,
    pub matcher: Matcher,
    pub action: Action,
    /// The fields its limits read (keys and `when:`): each may appear only once in a request.
    pub fields: Vec<Field>,
    /// Largest request body forwarded, in bytes; `None`: unlimited.
    pub max_body: Option<u64>,
    /// How fast the request body must arrive.
    pub body_pace: BodyPace,
    /// What to do when the store cannot decide.
    pub on_store_error: OnStoreError,
    /// Which rate-limit fields responses carry.
    pub response_headers: ResponseHeaders,
    /// A 429 asking for a longer wait says `x-should-retry: false`.
    pub should_retry_within: std::time::Duration,
    /// Most requests held at once by `on_exceed: delay` limits (past it, 429).
    pub max_delayed: u32,
    /// The `RateLimit-Policy` field describing every limit of the route; `None` without limits
    /// or when some limit has conditions (the field then lists what applied to a request).
    pub rate_limit_policy: Option<HeaderValue>,
    /// `jwt:`: the verifier of the request's token and what an invalid one gets; `None`:
    /// no token is read.
    pub jwt: Option<RouteJwt>,
}

/// A route's `jwt:`, its verifier resolved.
#[derive(Debug, Clone)]
pub struct RouteJwt {
    pub verifier: Arc<Verifier>,
    pub on_invalid: OnInvalid,
}

/// How fast a request body must arrive, so that a client trickling bytes cannot hold an
/// upstream connection for as long as it likes (an idle timeout never fires while a byte
/// arrives now and then). Both bounds count from when the body is first read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyPace {
    /// The whole body must have arrived within this.
    pub timeout: Duration,
    /// After `grace`, at least this many bytes a second on average; 0: no minimum. Like
    /// Apache's `mod_reqtimeout` `MinRate`: each `min_rate` bytes received earn one more
    /// second beyond the grace.
    pub min_rate: u64,
    pub grace: Duration,
}

impl BodyPace {
    /// When a body first read at `started`, of which `received` bytes have arrived, is too
    /// slow if it has not ended yet.
    pub fn due(&self, started: std::time::Instant, received: u64) -> std::time::Instant {
        let whole = started + self.timeout;
        if self.min_rate == 0 {
            return whole;
        }
        let earned_micros = u128::from(received) * 1_000_000 / u128::from(self.min_rate);
        let earned = Duration::from_micros(u64::try_from(earned_micros).unwrap_or(u64::MAX));
        whole.min(
            started
                .checked_add(self.grace.saturating_add(earned))
                .unwrap_or(whole),
        )
    }
}

pub enum Action {
    Forward(Arc<Upstream>),
    Respond(DirectResponse),
}

pub struct DirectResponse {
    pub status: StatusCode,
    pub body: Bytes,
    pub content_type: HeaderValue,
}

pub struct Limit<M: Metering = Metered> {
    pub settings: LimitSettings,
    pub metrics: M::Limit,
}

/// A limit's settings besides its metric handles.
pub struct LimitSettings {
    pub name: Name,
    pub key: Vec<KeyPart>,
    /// What the limiter decides with: algorithm, requests, window, burst (`requests` unless
    /// configured), cost, shadow, max_delay, and whether a place can be given back (`count`).
    pub spec: Spec,
    /// `count: { status: [...] }`: the statuses this limit counts; a request answered with
    /// another is given back. `None`: every request counts.
    pub count: Option<Box<[StatusMatch]>>,
    /// All must hold for the limit to apply to a request; empty: it always applies.
    pub when: Vec<Condition>,
    /// A calendar quota's period and zone (`spec.algorithm` is then `Calendar`, and
    /// `spec.window` the period's nominal length until `request::store_key::check` sets the time
    /// left).
    pub quota: Option<Quota>,
    /// How client addresses are grouped in this limit's keys.
    pub client_prefix: ClientPrefix,
    /// `tokens:`: the limit counts LLM tokens, reserved from the request body and settled
    /// from the response; `None`: it counts requests.
    pub tokens: Option<Box<crate::llm::TokenBudget>>,
    /// `report: true`: each admission is added to the limit's usage index (`limiter::usage`),
    /// for the admin API's usage reports.
    pub report: bool,
}

/// The prefix lengths client addresses count by: every address of one network is one
/// client, so a holder of an IPv6 /64 does not get 2^64 buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientPrefix {
    pub ipv4: u8,
    pub ipv6: u8,
}

impl Default for ClientPrefix {
    fn default() -> Self {
        ClientPrefix {
            ipv4: DEFAULT_IPV4_PREFIX as u8,
            ipv6: DEFAULT_IPV6_PREFIX as u8,
        }
    }
}

impl<M: Metering> Limit<M> {
    /// What this limit's number counts, as the answers and the admin API name it: `requests`,
    /// `concurrent-requests` (the RateLimit draft's quota unit for a concurrency limit), or a
    /// budget's unit (`tokens`, `microUSD`, ...).
    pub fn unit(&self) -> &str {
        match (&self.tokens, self.spec.algorithm) {
            (Some(budget), _) => budget.unit.label(),
            (None, crate::limiter::Algorithm::Concurrency) => "concurrent-requests",
            (None, _) => "requests",
        }
    }

    /// Whether this limit keeps a request answered with `status` (always, without `count`).
    pub fn counts(&self, status: u16) -> bool {
        self.count
            .as_ref()
            .is_none_or(|statuses| statuses.iter().any(|s| s.matches(status)))
    }

    /// Whether this limit applies to the request; `model`: its body's (`crate::model`), or
    /// `None` when the body was not read or names none.
    pub fn applies(
        &self,
        method: &Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        claims: Option<&Claims>,
        model: Option<&str>,
    ) -> bool {
        self.when
            .iter()
            .all(|condition| condition.holds(method, uri, headers, claims, model))
    }

    /// Whether its key or a condition reads the request body's `model` (a token limit's
    /// only): such a limit is planned once the body is read.
    pub fn reads_body(&self) -> bool {
        self.key.contains(&KeyPart::Model) || self.when.iter().any(Condition::reads_body)
    }

    /// Whether the conditions that read the head hold (those that read the body are left
    /// for when it is read).
    pub fn applies_to_head(
        &self,
        method: &Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        claims: Option<&Claims>,
    ) -> bool {
        self.when.iter().all(|condition| {
            condition.reads_body() || condition.holds(method, uri, headers, claims, None)
        })
    }
}

/// Where a route forwards to. Plain settings: the proxy keeps the pooled client of each
/// upstream in a registry that outlives reloads (see `proxy::Upstreams`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub name: Name,
    pub authority: Authority,
    pub base_path: String,
    /// Time allowed to open a TCP connection.
    pub connect_timeout: Duration,
    /// Time allowed for the response headers.
    pub timeout: Duration,
    /// `https://` upstreams: how to verify them and what to present; `None`: cleartext.
    pub tls: Option<Arc<UpstreamTls>>,
    /// Spoken to over HTTP/2 with prior knowledge (h2c) instead of HTTP/1.1.
    pub http2: bool,
}

impl<M: Metering> Policy<M> {
    /// Every upstream some route forwards to, once each.
    pub fn upstreams(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        let mut seen = std::collections::HashSet::new();
        self.routes
            .iter()
            .filter_map(|route| match &route.action {
                Action::Forward(upstream) => Some(upstream),
                Action::Respond(_) => None,
            })
            .filter(move |upstream| seen.insert(upstream.name.clone()))
    }
}

/// `"per-ip";q=5;w=60, "per-key";q=100;w=1`: the given limits (of a route: built once per
/// policy, unless limits have conditions).
pub fn rate_limit_policy<'a, M: Metering>(
    limits: impl ExactSizeIterator<Item = &'a Limit<M>>,
) -> Option<HeaderValue> {
    rate_limit_policy_in_force(limits.map(|limit| (limit, None)))
}

/// `rate_limit_policy` with the number in force per limit: an identity's override (`None`:
/// the limit's own).
pub fn rate_limit_policy_in_force<'a, M: Metering>(
    limits: impl ExactSizeIterator<Item = (&'a Limit<M>, Option<u32>)>,
) -> Option<HeaderValue> {
    if limits.len() == 0 {
        return None;
    }
    limit_items_in(limits.map(|(limit, overridden)| {
        // A concurrency limit has no window (its `window` is the lease period): the draft's
        // quota unit `concurrent-requests` says what its quota counts.
        let concurrent = limit.spec.algorithm == crate::limiter::Algorithm::Concurrency;
        let params = [
            Some(('q', u64::from(overridden.unwrap_or(limit.spec.requests)))),
            (!concurrent).then(|| ('w', ceil_seconds(limit.spec.window))),
        ];
        let unit = (limit.unit() != "requests").then(|| limit.unit());
        (&limit.name, params.into_iter().flatten(), unit)
    }))
}
