//! The compiled policy: routes with their matchers, actions and limits, built once from the
//! config and never changed afterwards. This is where the parts of the file are checked against
//! each other (every upstream a route names exists, names are unique), with positions.
//!
//! A policy is plain data, built once per config file and swapped whole on reload; what must
//! outlive a reload (upstream connection pools, the store) lives outside it, so nothing here
//! needs the proxy. Compiling is a pure function of the parsed config and the upstreams' TLS
//! settings, read from their files beforehand (`tls::UpstreamTlsSet`): it reads no file and
//! creates no metric series. The metric handles each route and limit counts into are
//! attached afterwards (`Compiled::metered`), by whoever puts the policy in force, so a file
//! that is refused leaves no series behind.

mod condition;
mod fields;
mod matcher;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Method, StatusCode};

pub use self::condition::{Condition, HeaderTest};
pub use self::fields::Field;
pub use self::matcher::Matcher;
use self::matcher::RouteIndex;
use crate::config::{
    Config, ConfigError, ForwardedHeader, IpNet, KeyPart, LimitConfig, Name, OnStoreError,
    Position, ResponseHeaders, RouteConfig, StatusMatch, DEFAULT_IPV4_PREFIX, DEFAULT_IPV6_PREFIX,
    DEFAULT_MAX_DELAYED, MAX_MAX_DELAY_MS,
};
use crate::identity::{Claims, OnInvalid, Verifier, Verifiers};
use crate::limiter::calendar::Quota;
use crate::limiter::{Algorithm, Check, Spec};
use crate::metrics::{LimitMetrics, Metrics, RouteMetrics};
use crate::ratelimit_field::{ceil_seconds, limit_items_in};
use crate::tls::{UpstreamTls, UpstreamTlsSet};

/// What a policy's routes and limits carry to count into: nothing once compiled
/// (`Unmetered`), their Prometheus handles once in force (`Metered`).
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

/// A compiled policy before its metric handles are attached.
pub type Compiled = Policy<Unmetered>;

pub struct Policy<M: Metering = Metered> {
    pub routes: Vec<Route<M>>,
    /// Peers whose forwarded-for header is believed, and which header that is.
    pub trusted_proxies: Vec<IpNet>,
    pub forwarded_header: ForwardedHeader,
    /// The header fields a `Connection` option may not name (see `fields::connection_guarded`).
    pub connection_guarded: Vec<HeaderName>,
    index: RouteIndex,
}

pub struct Route<M: Metering = Metered> {
    pub name: Name,
    pub matcher: Matcher,
    pub action: Action,
    pub limits: Vec<Limit<M>>,
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
    /// Most requests held at once by `on_exceed: delay` limits (past it, 429).
    pub max_delayed: u32,
    /// The `RateLimit-Policy` field describing every limit of the route; `None` without limits
    /// or when some limit has conditions (the field then lists what applied to a request).
    pub rate_limit_policy: Option<HeaderValue>,
    /// `jwt:`: the verifier of the request's token and what an invalid one gets; `None`:
    /// no token is read.
    pub jwt: Option<RouteJwt>,
    pub metrics: M::Route,
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
    pub name: Name,
    pub key: Vec<KeyPart>,
    /// What the limiter decides with: algorithm, requests, window, burst (`requests` unless
    /// configured), cost, shadow, max_delay, and whether a place can be given back (`count`).
    pub spec: Spec,
    /// `count: { status: [...] }`: the statuses this limit counts; a request answered with
    /// another is given back. `None`: every request counts.
    pub count: Option<Box<[StatusMatch]>>,
    /// `prefix:route:limit:` (with the algorithm after the limit for all but the sliding log,
    /// so a reload that changes the algorithm starts afresh instead of reading another
    /// algorithm's state); the identity completes the store key.
    pub key_prefix: String,
    /// All must hold for the limit to apply to a request; empty: it always applies.
    pub when: Vec<Condition>,
    /// A calendar quota's period and zone (`spec.algorithm` is then `Calendar`, and
    /// `spec.window` the period's nominal length until `check` sets the time left).
    pub quota: Option<Quota>,
    /// How client addresses are grouped in this limit's keys.
    pub client_prefix: ClientPrefix,
    /// `tokens:`: the limit counts LLM tokens, reserved from the request body and settled
    /// from the response; `None`: it counts requests.
    pub tokens: Option<Box<crate::llm::TokenBudget>>,
    pub metrics: M::Limit,
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

impl Compiled {
    /// Checks the config as a whole and builds the policy. `file` names the source in errors;
    /// `tls` holds the settings of every https upstream, read from their files by the caller
    /// (`UpstreamTlsSet::load`). A config with JWT verifiers compiles with
    /// [`Compiled::compile_with`].
    pub fn compile(
        config: &Config,
        file: &Path,
        tls: &UpstreamTlsSet,
    ) -> Result<Compiled, ConfigError> {
        Compiled::compile_with(config, file, tls, &Verifiers::default())
    }

    /// `compile`, with the JWT verifiers of `config.jwt`, their keys read from their files by
    /// the caller (`Verifiers::load`).
    pub fn compile_with(
        config: &Config,
        file: &Path,
        tls: &UpstreamTlsSet,
        verifiers: &Verifiers,
    ) -> Result<Compiled, ConfigError> {
        if config.listen == config.admin_listen.value {
            return Err(ConfigError::invalid(
                file,
                Position::from(&config.admin_listen),
                "admin_listen",
                format!("must differ from `listen` ({})", config.listen),
            ));
        }
        let upstreams: HashMap<&Name, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, upstream)| {
                let compiled = Upstream {
                    name: name.clone(),
                    authority: upstream.url.authority.clone(),
                    base_path: upstream.url.base_path.clone(),
                    connect_timeout: upstream.connect_timeout.0,
                    timeout: upstream.timeout.0,
                    tls: upstream_tls(name, upstream.url.https, tls, file)?,
                    http2: upstream.http2,
                };
                Ok((name, Arc::new(compiled)))
            })
            .collect::<Result<_, ConfigError>>()?;
        let mut seen: HashMap<&Name, Position> = HashMap::new();
        let mut actions = Vec::with_capacity(config.routes.len());
        let mut conditions = Vec::with_capacity(config.routes.len());
        let mut jwts = Vec::with_capacity(config.routes.len());
        let models = crate::llm::config::models(config, file)?;
        for (index, route) in config.routes.iter().enumerate() {
            let field = format!("routes[{index}]");
            if let Some(first) = seen.insert(&route.name.value, Position::from(&route.name)) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(&route.name),
                    format!("{field}.name"),
                    format!(
                        "duplicate route name `{}` (first used at line {})",
                        route.name.value, first.line
                    ),
                ));
            }
            actions.push(compile_action(route, &upstreams, file, &field)?);
            conditions.push(check_limits(route, &models, file, &field)?);
            jwts.push(route_jwt(route, verifiers, file, &field)?);
        }
        let routes: Vec<Route<Unmetered>> = config
            .routes
            .iter()
            .zip(actions)
            .zip(conditions)
            .zip(jwts)
            .map(|(((route, action), conditions), jwt)| {
                let limits = build_limits(config, route, conditions, &models);
                let mut fields = fields::read_by(&limits);
                // The token is read once too: two of its fields would be two readings.
                if let Some(field) = jwt.as_ref().and_then(|jwt| token_field(&jwt.verifier)) {
                    if !fields.contains(&field) {
                        fields.push(field);
                    }
                }
                Route {
                    name: route.name.value.clone(),
                    matcher: Matcher::new(&route.matcher),
                    action,
                    max_body: route.max_body.or(config.server.max_body).map(|size| size.0),
                    body_pace: BodyPace {
                        timeout: route.body_timeout.unwrap_or(config.server.body_timeout).0,
                        min_rate: route.body_min_rate.unwrap_or(config.server.body_min_rate).0,
                        grace: config.server.body_rate_grace.0,
                    },
                    on_store_error: route.on_store_error.unwrap_or(config.store.on_store_error),
                    response_headers: route.response_headers.unwrap_or(config.response_headers),
                    max_delayed: route
                        .max_delayed
                        .as_ref()
                        .map_or(DEFAULT_MAX_DELAYED, |m| m.value.0),
                    rate_limit_policy: if limits.iter().any(|l| !l.when.is_empty()) {
                        None
                    } else {
                        rate_limit_policy(limits.iter())
                    },
                    fields,
                    limits,
                    jwt,
                    metrics: (),
                }
            })
            .collect();
        let index = RouteIndex::new(routes.iter().map(|route| &route.matcher));
        let connection_guarded = fields::connection_guarded(
            &routes,
            !config.trusted_proxies.is_empty(),
            config.forwarded_header,
        );
        Ok(Policy {
            routes,
            trusted_proxies: config.trusted_proxies.clone(),
            forwarded_header: config.forwarded_header,
            connection_guarded,
            index,
        })
    }

    /// The policy with the metric handles of each route and limit, for the request path to
    /// count into. Called only for a policy about to be put in force: the series of a route
    /// exist from then on.
    pub fn metered(self, metrics: &Metrics) -> Policy {
        let routes = self
            .routes
            .into_iter()
            .map(|route| {
                let limits = route
                    .limits
                    .into_iter()
                    .map(|limit| Limit {
                        metrics: {
                            let (route, name) = (route.name.as_str(), limit.name.as_str());
                            let mut counters = metrics.for_limit(route, name);
                            if let Some(budget) = &limit.tokens {
                                counters.tokens =
                                    Some(metrics.for_token_limit(route, name, budget.unit.label()));
                            }
                            counters
                        },
                        name: limit.name,
                        key: limit.key,
                        spec: limit.spec,
                        count: limit.count,
                        key_prefix: limit.key_prefix,
                        when: limit.when,
                        quota: limit.quota,
                        client_prefix: limit.client_prefix,
                        tokens: limit.tokens,
                    })
                    .collect();
                Route {
                    metrics: metrics.for_route(route.name.as_str()),
                    name: route.name,
                    matcher: route.matcher,
                    action: route.action,
                    limits,
                    fields: route.fields,
                    max_body: route.max_body,
                    body_pace: route.body_pace,
                    on_store_error: route.on_store_error,
                    response_headers: route.response_headers,
                    max_delayed: route.max_delayed,
                    rate_limit_policy: route.rate_limit_policy,
                    jwt: route.jwt,
                }
            })
            .collect();
        Policy {
            routes,
            trusted_proxies: self.trusted_proxies,
            forwarded_header: self.forwarded_header,
            connection_guarded: self.connection_guarded,
            index: self.index,
        }
    }
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

    /// The first route, in file order, that matches the request. `path` is canonical (see
    /// `crate::path::normalize`); its `;` parameters are ignored here.
    pub fn route(&self, method: &Method, path: &str) -> Option<&Route<M>> {
        let path = crate::path::without_parameters(path);
        let first = self
            .index
            .first(&path, |i| self.routes[i].matcher.matches(method, &path))?;
        self.routes.get(first)
    }
}

/// `"per-ip";q=5;w=60, "per-key";q=100;w=1`: the given limits (of a route: built once per
/// policy, unless limits have conditions).
pub fn rate_limit_policy<'a, M: Metering>(
    limits: impl ExactSizeIterator<Item = &'a Limit<M>>,
) -> Option<HeaderValue> {
    if limits.len() == 0 {
        return None;
    }
    limit_items_in(limits.map(|limit| {
        let params = [
            ('q', u64::from(limit.spec.requests)),
            ('w', ceil_seconds(limit.spec.window)),
        ];
        (
            &limit.name,
            params,
            limit.tokens.as_ref().map(|b| b.unit.label()),
        )
    }))
}

/// The TLS settings of upstream `name`, loaded before compiling: `None` for an `http://` one.
fn upstream_tls(
    name: &Name,
    https: bool,
    tls: &UpstreamTlsSet,
    file: &Path,
) -> Result<Option<Arc<UpstreamTls>>, ConfigError> {
    if !https {
        return Ok(None);
    }
    match tls.get(name) {
        Some(settings) => Ok(Some(settings)),
        // The caller loaded the set from another config than this one: say so rather than
        // serve an https upstream without its CAs.
        None => Err(ConfigError::invalid(
            file,
            Position::default(),
            format!("upstreams.{name}.url"),
            "the TLS settings of this https upstream were not loaded",
        )),
    }
}

fn compile_action(
    route: &RouteConfig,
    upstreams: &HashMap<&Name, Arc<Upstream>>,
    file: &Path,
    field: &str,
) -> Result<Action, ConfigError> {
    match (&route.upstream, &route.respond) {
        (Some(upstream), None) => upstreams
            .get(&upstream.value)
            .map(|u| Action::Forward(Arc::clone(u)))
            .ok_or_else(|| {
                let mut known: Vec<&str> = upstreams.keys().map(|n| n.as_str()).collect();
                known.sort_unstable();
                ConfigError::invalid(
                    file,
                    Position::from(upstream),
                    format!("{field}.upstream"),
                    format!(
                        "unknown upstream `{}` (defined: {})",
                        upstream.value,
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        }
                    ),
                )
            }),
        (None, Some(respond)) => {
            let content_type =
                HeaderValue::from_str(&respond.value.content_type).map_err(|_| {
                    ConfigError::invalid(
                        file,
                        Position::from(respond),
                        format!("{field}.respond.content_type"),
                        "not a valid header value",
                    )
                })?;
            Ok(Action::Respond(DirectResponse {
                status: respond.value.status.0,
                body: Bytes::from(respond.value.body.clone()),
                content_type,
            }))
        }
        (Some(_), Some(respond)) => Err(ConfigError::invalid(
            file,
            Position::from(respond),
            format!("{field}.respond"),
            "a route has either `upstream` or `respond`, not both",
        )),
        (None, None) => Err(ConfigError::invalid(
            file,
            Position::from(&route.name),
            field,
            "a route needs `upstream` (forward) or `respond` (direct response)",
        )),
    }
}

/// The field a verifier reads the token from.
fn token_field(verifier: &Verifier) -> Option<Field> {
    Some(match &verifier.from {
        crate::config::TokenFrom::Header(name) => Field::Header(name.clone()),
        crate::config::TokenFrom::Cookie(name) => Field::Cookie(name.clone()),
    })
}

/// A route's `jwt:` with its verifier; a `jwt:` key part or condition needs one.
fn route_jwt(
    route: &RouteConfig,
    verifiers: &Verifiers,
    file: &Path,
    field: &str,
) -> Result<Option<RouteJwt>, ConfigError> {
    let Some(jwt) = &route.jwt else {
        for (index, limit) in route.limits.iter().enumerate() {
            let field = format!("{field}.limits[{index}]");
            if let Some(at) = limit
                .key
                .value
                .iter()
                .position(|p| matches!(p, KeyPart::Jwt(_)))
            {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(&limit.key),
                    format!("{field}.key[{at}]"),
                    "a `jwt:` key part needs a verified token: give the route `jwt: { verifier: NAME }`",
                ));
            }
            if let Some((at, when)) = limit
                .when
                .iter()
                .enumerate()
                .find(|(_, when)| when.value.jwt.is_some())
            {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(when),
                    format!("{field}.when[{at}].jwt"),
                    "a `jwt` condition needs a verified token: give the route `jwt: { verifier: NAME }`",
                ));
            }
        }
        return Ok(None);
    };
    let name = &jwt.value.verifier;
    let verifier = verifiers.get(&name.value).ok_or_else(|| {
        let known = verifiers.names();
        ConfigError::invalid(
            file,
            Position::from(name),
            format!("{field}.jwt.verifier"),
            format!(
                "unknown verifier `{}` (defined under `jwt:`: {})",
                name.value,
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ),
        )
    })?;
    Ok(Some(RouteJwt {
        verifier: Arc::clone(verifier),
        on_invalid: jwt.value.on_invalid,
    }))
}

/// Checks what the YAML types cannot check alone in a route's limits; returns each limit's
/// compiled conditions.
fn check_limits(
    route: &RouteConfig,
    models: &crate::llm::Models,
    file: &Path,
    field: &str,
) -> Result<Vec<Vec<Condition>>, ConfigError> {
    let mut seen: HashMap<&Name, Position> = HashMap::new();
    let mut conditions = Vec::with_capacity(route.limits.len());
    for (index, limit) in route.limits.iter().enumerate() {
        let field = format!("{field}.limits[{index}]");
        if let Some(first) = seen.insert(&limit.name.value, Position::from(&limit.name)) {
            return Err(ConfigError::invalid(
                file,
                Position::from(&limit.name),
                format!("{field}.name"),
                format!(
                    "duplicate limit name `{}` in this route (first used at line {})",
                    limit.name.value, first.line
                ),
            ));
        }
        crate::llm::config::check(limit, models, file, &field)?;
        check_quota(limit, file, &field)?;
        check_cost(limit, file, &field)?;
        check_params(route, limit, file, &field)?;
        check_shaping(limit, file, &field)?;
        check_prefixes(limit, file, &field)?;
        check_model(limit, file, &field)?;
        let when = limit
            .when
            .iter()
            .enumerate()
            .map(|(n, condition)| {
                Condition::compile(condition, file, &format!("{field}.when[{n}]"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        conditions.push(when);
    }
    if let Some(max_delayed) = &route.max_delayed {
        if !route.limits.iter().any(delays) {
            return Err(ConfigError::invalid(
                file,
                Position::from(max_delayed),
                format!("{field}.max_delayed"),
                "`max_delayed` needs a limit with `on_exceed: delay` in this route",
            ));
        }
    }
    Ok(conditions)
}

/// A `model` key part or condition reads the request body: only a token limit's, whose body
/// is read before the decision anyway. (Any other limit would make every request of its route
/// wait for its whole body.)
fn check_model(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    if limit.tokens.is_some() || limit.money.is_some() {
        return Ok(());
    }
    let why = "reads the JSON body's `model`, which only a token or money limit (`tokens:`, \
               `money:`) reads: its body is read before the decision anyway";
    if let Some(at) = limit.key.value.iter().position(|p| *p == KeyPart::Model) {
        return Err(ConfigError::invalid(
            file,
            Position::from(&limit.key),
            format!("{field}.key[{at}]"),
            format!("the key part `model` {why}"),
        ));
    }
    if let Some((at, when)) = limit
        .when
        .iter()
        .enumerate()
        .find(|(_, when)| when.value.model.is_some())
    {
        return Err(ConfigError::invalid(
            file,
            Position::from(when),
            format!("{field}.when[{at}].model"),
            format!("a `model` condition {why}"),
        ));
    }
    Ok(())
}

fn delays(limit: &LimitConfig) -> bool {
    limit.delay().is_some()
}

/// `on_exceed`, `max_delay` and `count`: what each needs and what it cannot go with.
fn check_shaping(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    let refuse = |position: Position, name: &str, message: String| {
        Err(ConfigError::invalid(
            file,
            position,
            format!("{field}.{name}"),
            message,
        ))
    };
    if let Some(on_exceed) = limit.delay() {
        let at = Position::from(on_exceed);
        if !matches!(limit.algorithm(), Algorithm::SlidingLog | Algorithm::Gcra) {
            return refuse(
                at,
                "on_exceed",
                format!(
                    "`on_exceed: delay` needs an exact algorithm (sliding_log or gcra), not `{}`: \
                     its wait must say exactly when the request fits",
                    limit.algorithm().label()
                ),
            );
        }
        if limit.shadow {
            return refuse(
                at,
                "on_exceed",
                "a shadow limit never rejects, so it has nothing to delay".to_owned(),
            );
        }
        if let Some(when) = limit.when.first() {
            return refuse(
                Position::from(when),
                "when",
                "a limit with `on_exceed: delay` applies to every request of its route: \
                 remove `when:` (put the conditions on another route)"
                    .to_owned(),
            );
        }
        if let Some(count) = &limit.count {
            return refuse(
                Position::from(count),
                "count",
                "`count:` and `on_exceed: delay` cannot go on the same limit".to_owned(),
            );
        }
        let Some(max_delay) = &limit.max_delay else {
            return refuse(
                at,
                "on_exceed",
                "`on_exceed: delay` needs `max_delay` (the longest a request is held)".to_owned(),
            );
        };
        if max_delay.value.0.as_millis() > u128::from(MAX_MAX_DELAY_MS) {
            return refuse(
                Position::from(max_delay),
                "max_delay",
                format!(
                    "at most {} s: a held request keeps its connection open",
                    MAX_MAX_DELAY_MS / 1000
                ),
            );
        }
    } else if let Some(max_delay) = &limit.max_delay {
        return refuse(
            Position::from(max_delay),
            "max_delay",
            "`max_delay` applies with `on_exceed: delay` only".to_owned(),
        );
    }
    if let Some(count) = &limit.count {
        if count.value.status.is_empty() {
            return refuse(
                Position::from(count),
                "count.status",
                "list at least one status or class (e.g. [401, 403] or [5xx])".to_owned(),
            );
        }
    }
    Ok(())
}

/// `ipv6_prefix` and `ipv4_prefix` must fit their address. A prefix of 0 would make every
/// client one bucket, which `key: []` says plainly.
fn check_prefixes(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    for (name, prefix, bits) in [
        ("ipv6_prefix", &limit.ipv6_prefix, 128),
        ("ipv4_prefix", &limit.ipv4_prefix, 32),
    ] {
        if let Some(prefix) = prefix {
            if !(1..=bits).contains(&prefix.value) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(prefix),
                    format!("{field}.{name}"),
                    format!(
                        "a prefix length from 1 to {bits} bits, got {} (for one bucket for \
                         every client, use `key: []`)",
                        prefix.value
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A `param:NAME` key part must name a `{NAME}` segment of the route's path prefix.
fn check_params(
    route: &RouteConfig,
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    let prefix = &route.matcher.path_prefix.0;
    let params: Vec<&str> = prefix
        .split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .collect();
    for (index, part) in limit.key.value.iter().enumerate() {
        if let KeyPart::Param(name) = part {
            if !params.contains(&name.as_str()) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(&limit.key),
                    format!("{field}.key[{index}]"),
                    format!("the route's path prefix `{prefix}` has no `{{{name}}}` segment"),
                ));
            }
        }
    }
    Ok(())
}

/// A cost the limit could never admit is refused: above `requests`, or for GCRA above `burst`.
/// A `burst` on another algorithm is refused too, since it would be silently ignored.
fn check_cost(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    if let Some(burst) = &limit.burst {
        if limit.algorithm() != Algorithm::Gcra {
            return Err(ConfigError::invalid(
                file,
                Position::from(burst),
                format!("{field}.burst"),
                format!(
                    "`burst` applies to `algorithm: gcra` only, not `{}`",
                    limit.algorithm().label()
                ),
            ));
        }
    }
    let Some(cost) = &limit.cost else {
        return Ok(());
    };
    let (most, what) = match (&limit.burst, limit.algorithm()) {
        (Some(burst), Algorithm::Gcra) => (burst.value.0, "burst"),
        _ => (crate::llm::config::quota(limit), "requests"),
    };
    if cost.value.0 > most {
        return Err(ConfigError::invalid(
            file,
            Position::from(cost),
            format!("{field}.cost"),
            format!(
                "a cost of {} can never be admitted: it is above `{what}` ({most})",
                cost.value.0
            ),
        ));
    }
    Ok(())
}

impl<M: Metering> Limit<M> {
    /// The check of this limit for one identity's store key: the one place a `Check` is built.
    /// A calendar quota's key gets the current period's label (`:2026-11`, outside the
    /// identity's `{...}`, so Redis Cluster places every period of one identity in its slot)
    /// and its window is the time left in that period, both from sluice's wall clock.
    pub fn check(&self, key: String) -> Check {
        let mut check = Check {
            key,
            spec: self.spec,
        };
        if let Some(quota) = &self.quota {
            let now = crate::clock::now();
            check.key.push(':');
            match quota.span_at(now) {
                Ok(span) => {
                    span.push_label(&mut check.key);
                    check.spec.window = span.left_at(now);
                }
                // Only a clock set beyond the year 9999 gets here: count in a key of its own,
                // one second at a time, rather than fail the request.
                Err(_) => {
                    check.key.push_str("beyond-the-calendar");
                    check.spec.window = Duration::from_secs(1);
                }
            }
        }
        check
    }
}

/// A calendar quota (`quota:`) is a limit of its own kind: exactly one of `window` and
/// `quota`; `time_zone` only with a quota, naming a zone of the bundled tz database; and none
/// of what shapes a rolling window (`algorithm`, `burst`, `on_exceed: delay`).
fn check_quota(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    let refuse = |position: Position, name: &str, message: String| {
        Err(ConfigError::invalid(
            file,
            position,
            format!("{field}.{name}"),
            message,
        ))
    };
    let Some(quota) = &limit.quota else {
        if limit.window.is_none() {
            return refuse(
                Position::from(&limit.name),
                "window",
                "a limit needs a `window` (rolling, e.g. `60s`) or a calendar `quota` (`day`, \
                 `week` or `month`)"
                    .to_owned(),
            );
        }
        if let Some(zone) = &limit.time_zone {
            return refuse(
                Position::from(zone),
                "time_zone",
                "`time_zone` applies to a calendar `quota` only (a rolling `window` has no \
                 calendar)"
                    .to_owned(),
            );
        }
        return Ok(());
    };
    let period = crate::limiter::calendar::Period::from(quota.value).label();
    if limit.window.is_some() {
        return refuse(
            Position::from(quota),
            "quota",
            format!(
                "a limit has either a rolling `window` or a calendar `quota`, not both: remove \
                 `window` for {} requests per {period}",
                crate::llm::config::quota(limit)
            ),
        );
    }
    if let Some(algorithm) = &limit.algorithm {
        return refuse(
            Position::from(algorithm),
            "algorithm",
            "a calendar `quota` counts exactly in its own way (one counter per period): \
             remove `algorithm`"
                .to_owned(),
        );
    }
    if let Some(burst) = &limit.burst {
        return refuse(
            Position::from(burst),
            "burst",
            "`burst` applies to `algorithm: gcra` only, not to a calendar `quota`".to_owned(),
        );
    }
    if let Some(on_exceed) = limit.delay() {
        return refuse(
            Position::from(on_exceed),
            "on_exceed",
            format!(
                "a calendar `quota` cannot delay a request: room comes back only when the \
                 {period} ends"
            ),
        );
    }
    if let Some(zone) = &limit.time_zone {
        if let Err(err) = jiff::tz::TimeZone::get(&zone.value) {
            return refuse(
                Position::from(zone),
                "time_zone",
                format!(
                    "unknown time zone `{}`: name an IANA zone such as `Europe/Berlin` or \
                     `UTC` ({err})",
                    zone.value
                ),
            );
        }
    }
    Ok(())
}

/// The quota of a limit that passed `check_quota`.
fn quota_of(limit: &LimitConfig) -> Option<Quota> {
    let period = limit.quota.as_ref()?.value.into();
    let zone_name = limit
        .time_zone
        .as_ref()
        .map_or("UTC", |zone| zone.value.as_str());
    Some(Quota {
        period,
        zone: jiff::tz::TimeZone::get(zone_name).unwrap_or(jiff::tz::TimeZone::UTC),
        zone_name: zone_name.to_owned(),
    })
}

/// The limits of a route that passed `check_limits`.
fn build_limits(
    config: &Config,
    route: &RouteConfig,
    conditions: Vec<Vec<Condition>>,
    models: &Arc<crate::llm::Models>,
) -> Vec<Limit<Unmetered>> {
    route
        .limits
        .iter()
        .zip(conditions)
        .map(|(limit, when)| Limit {
            name: limit.name.value.clone(),
            key: limit.key.value.clone(),
            spec: Spec {
                algorithm: limit.algorithm(),
                requests: crate::llm::config::quota(limit),
                window: match (&limit.window, quota_of(limit)) {
                    (Some(window), _) => window.0,
                    (None, Some(quota)) => quota.period.nominal(),
                    (None, None) => Duration::ZERO,
                },
                burst: limit
                    .burst
                    .as_ref()
                    .map_or(crate::llm::config::quota(limit), |b| b.value.0),
                cost: limit.cost.as_ref().map_or(1, |c| c.value.0),
                shadow: limit.shadow,
                max_delay: match (delays(limit), &limit.max_delay) {
                    (true, Some(max_delay)) => max_delay.value.0,
                    _ => Duration::ZERO,
                },
                // A token budget gives back what a request did not use.
                returnable: limit.count.is_some()
                    || limit.tokens.is_some()
                    || limit.money.is_some(),
            },
            tokens: crate::llm::config::budget(limit, models).map(Box::new),
            count: limit
                .count
                .as_ref()
                .map(|count| count.value.status.clone().into_boxed_slice()),
            key_prefix: match limit.algorithm() {
                Algorithm::SlidingLog => format!(
                    "{}:{}:{}:",
                    config.store.key_prefix, route.name.value, limit.name.value
                ),
                other => format!(
                    "{}:{}:{}:{}:",
                    config.store.key_prefix,
                    route.name.value,
                    limit.name.value,
                    other.label()
                ),
            },
            when,
            quota: quota_of(limit),
            client_prefix: ClientPrefix {
                ipv4: prefix_bits(&limit.ipv4_prefix, DEFAULT_IPV4_PREFIX),
                ipv6: prefix_bits(&limit.ipv6_prefix, DEFAULT_IPV6_PREFIX),
            },
            metrics: (),
        })
        .collect()
}

/// A prefix length `check_prefixes` accepted, or the default.
fn prefix_bits(prefix: &Option<crate::config::Spanned<u32>>, default: u32) -> u8 {
    u8::try_from(prefix.as_ref().map_or(default, |p| p.value)).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_on_store_error_has_its_fallback_counter() {
        for action in [OnStoreError::Local, OnStoreError::Allow, OnStoreError::Deny] {
            assert!(crate::metrics::FALLBACK_ACTIONS.contains(&action.label()));
        }
    }

    /// Compiling creates no series; attaching the handles creates each route's and each
    /// limit's, under their own names.
    #[test]
    fn series_exist_once_the_policy_is_metered_not_when_it_is_compiled() {
        let yaml = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: api\n    match: { path_prefix: /api }\n    respond: { status: 200 }\n    limits:\n      - { name: per-ip, key: [client_ip], requests: 5, window: 1s }\n";
        let config = crate::config::parse(yaml, Path::new("t.yaml")).expect("valid");
        let metrics = Metrics::new().expect("metrics");
        let compiled = Compiled::compile(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .expect("valid");
        let text = || String::from_utf8(metrics.render()).expect("UTF-8");
        assert!(!text().contains("api"), "{}", text());
        let policy = compiled.metered(&metrics);
        policy.routes[0].limits[0].metrics.admitted.inc();
        assert!(
            text().contains(
                r#"sluice_limit_decisions_total{decision="admitted",limit="per-ip",route="api"} 1"#
            ),
            "{}",
            text()
        );
    }

    /// An https upstream compiled without the TLS settings read for it is refused, naming
    /// it, rather than served without its CAs.
    #[test]
    fn an_https_upstream_needs_its_loaded_tls_settings() {
        let yaml = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nupstreams:\n  secure: { url: \"https://127.0.0.1:9\" }\nroutes:\n  - name: r\n    match: { path_prefix: / }\n    upstream: secure\n";
        let config = crate::config::parse(yaml, Path::new("t.yaml")).expect("valid");
        let refused = Compiled::compile(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .err()
            .expect("refused");
        assert!(
            refused.to_string().contains("upstreams.secure.url"),
            "{refused}"
        );
        let loaded =
            UpstreamTlsSet::load(&config.upstreams, Path::new("t.yaml")).expect("builtin roots");
        let policy = Compiled::compile(&config, Path::new("t.yaml"), &loaded).expect("valid");
        let upstream = policy.upstreams().next().expect("one upstream");
        assert!(upstream.tls.is_some());
    }

    use proptest::prelude::*;

    fn segment() -> impl Strategy<Value = String> {
        proptest::sample::select(vec!["a", "A", "b", "api", "Api", "x;p", "%C3%A9"])
            .prop_map(str::to_owned)
    }

    fn path() -> impl Strategy<Value = String> {
        (proptest::collection::vec(segment(), 0..4), any::<bool>()).prop_map(|(segments, slash)| {
            let mut path = format!("/{}", segments.join("/"));
            if slash && !segments.is_empty() {
                path.push('/');
            }
            path
        })
    }

    fn policy(routes: &[(String, bool, bool)]) -> Compiled {
        let mut yaml = String::from("listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n");
        for (n, (prefix, case_sensitive, post_only)) in routes.iter().enumerate() {
            let prefix = prefix.replace(";p", "");
            let methods = if *post_only { "[POST]" } else { "[]" };
            yaml.push_str(&format!(
                "  - name: r{n}\n    match: {{ path_prefix: \"{prefix}\", case_sensitive: {case_sensitive}, methods: {methods} }}\n    respond: {{ status: 200 }}\n"
            ));
        }
        let config = crate::config::parse(&yaml, Path::new("t.yaml")).expect("valid");
        Compiled::compile(&config, Path::new("t.yaml"), &UpstreamTlsSet::default()).expect("valid")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The first-segment index never changes which route matches: it is the first
        /// route in file order, as a scan of every route finds it.
        #[test]
        fn the_index_finds_what_a_scan_finds(
            routes in proptest::collection::vec((path(), any::<bool>(), any::<bool>()), 1..8),
            paths in proptest::collection::vec(path(), 1..8),
            post in any::<bool>(),
        ) {
            let policy = policy(&routes);
            let method = if post { Method::POST } else { Method::GET };
            for path in &paths {
                let stripped = crate::path::without_parameters(path);
                let scanned = policy.routes.iter().find(|r| r.matcher.matches(&method, &stripped));
                let indexed = policy.route(&method, path);
                prop_assert_eq!(
                    indexed.map(|r| r.name.as_str()),
                    scanned.map(|r| r.name.as_str()),
                    "{}", path
                );
            }
        }
    }
}
