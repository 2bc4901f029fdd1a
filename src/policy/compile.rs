//! Compiling: the parsed config becomes a policy, its parts checked against each other (every
//! upstream a route names exists, names are unique, the limits' options go together by
//! `rules`), with positions; and the metric handles attached when it is put in force.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;

use super::index::RouteIndex;
use super::rules::{self, delays, Seen};
use super::*;
use crate::config::{
    Config, ConfigError, LimitConfig, Name, Position, RouteConfig, DEFAULT_IPV4_PREFIX,
    DEFAULT_IPV6_PREFIX, DEFAULT_MAX_DELAYED,
};
use crate::jwt::{Verifier, Verifiers};
use crate::limiter::calendar::Quota;
use crate::limiter::Spec;
use crate::metrics::{LimitMetrics, Metrics};
use crate::tls::{UpstreamTls, UpstreamTlsSet};

impl Compiled {
    /// [`Compiled::compile`] of a config without `jwt:` verifiers (tests and benchmarks).
    pub fn compile_without_jwt(
        config: &Config,
        file: &Path,
        tls: &UpstreamTlsSet,
    ) -> Result<Compiled, ConfigError> {
        Compiled::compile(config, file, tls, &Verifiers::default())
    }

    /// Checks the config as a whole and builds the policy: what every load runs. `file` names
    /// the source in errors; `tls` holds the settings of every https upstream, read from their
    /// files by the caller (`UpstreamTlsSet::load`); `verifiers` the JWT verifiers of
    /// `config.jwt`, their keys read from their files by the caller (`Verifiers::load`).
    pub fn compile(
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
        let upstreams = compile_upstreams(config, tls, file)?;
        let models = crate::llm::config::models(config, file)?;
        let checked = check_routes(config, &upstreams, &models, verifiers, file)?;
        let routes: Vec<Route<Unmetered>> = config
            .routes
            .iter()
            .zip(checked)
            .map(|(route, checked)| build_route(config, route, checked, &models))
            .collect();
        let index = RouteIndex::new(routes.iter().map(|route| &route.matcher));
        let connection_guarded = fields::connection_guarded(
            &routes,
            !config.trusted_proxies.is_empty(),
            config.forwarded_header,
        );
        Ok(Policy {
            routes,
            settings: PolicySettings {
                trusted_proxies: config.trusted_proxies.clone(),
                forwarded_header: config.forwarded_header,
                connection_guarded,
                key_prefix: config.store.key_prefix.as_str().to_owned(),
                index,
            },
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
                let name = route.settings.name.as_str();
                Route {
                    metrics: metrics.for_route(name),
                    limits: route
                        .limits
                        .into_iter()
                        .map(|limit| Limit {
                            metrics: limit_metrics(metrics, name, &limit.settings),
                            settings: limit.settings,
                        })
                        .collect(),
                    settings: route.settings,
                }
            })
            .collect();
        Policy {
            routes,
            settings: self.settings,
        }
    }
}

/// The handles limit `limit` of route `route` counts into: its token counters too when it is
/// a token or money budget, its in-flight gauge when it is a concurrency limit.
fn limit_metrics(metrics: &Metrics, route: &str, limit: &LimitSettings) -> LimitMetrics {
    let name = limit.name.as_str();
    let mut counters = metrics.for_limit(route, name);
    if let Some(budget) = &limit.tokens {
        let mut tokens = metrics.for_token_limit(route, name, budget.unit.label());
        if let Some(fallback) = &budget.switch_to {
            tokens.switches = Some(metrics.tokens.model_switches.with_label_values(&[
                route,
                name,
                fallback.model.as_str(),
            ]));
        }
        counters.tokens = Some(tokens);
    }
    if limit.spec.algorithm == crate::limiter::Algorithm::Concurrency {
        counters.in_flight = Some(
            metrics
                .leases
                .concurrency_in_flight
                .with_label_values(&[route, name]),
        );
    }
    counters
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

/// The upstreams of `config`, by name, each with its TLS settings (from `tls`).
fn compile_upstreams<'c>(
    config: &'c Config,
    tls: &UpstreamTlsSet,
    file: &Path,
) -> Result<HashMap<&'c Name, Arc<Upstream>>, ConfigError> {
    config
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
        .collect()
}

/// What checking one route made of it: its action, each limit's conditions, its `jwt:`.
struct CheckedRoute {
    action: Action,
    conditions: Vec<Vec<Condition>>,
    jwt: Option<RouteJwt>,
}

/// Checks every route of `config` (a unique name, an upstream that exists, its limits by the
/// rules, a verifier that exists), each to its first mistake, so one reading reports them
/// all; one `CheckedRoute` per route, in order, when none has a mistake.
fn check_routes(
    config: &Config,
    upstreams: &HashMap<&Name, Arc<Upstream>>,
    models: &crate::llm::Models,
    verifiers: &Verifiers,
    file: &Path,
) -> Result<Vec<CheckedRoute>, ConfigError> {
    let mut seen: HashMap<&Name, Position> = HashMap::new();
    let mut checked = Vec::with_capacity(config.routes.len());
    let mut mistakes = Vec::new();
    for (index, route) in config.routes.iter().enumerate() {
        let field = format!("routes[{index}]");
        let mut check_route = || {
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
            Ok(CheckedRoute {
                action: compile_action(route, upstreams, file, &field)?,
                conditions: check_limits(route, models, file, &field)?,
                jwt: route_jwt(route, verifiers, file, &field)?,
            })
        };
        match check_route() {
            Ok(route) => checked.push(route),
            Err(err) => mistakes.push(err),
        }
    }
    if config.webhook.is_none() {
        mistakes.extend(notify_without_webhook(config, file));
    }
    if !mistakes.is_empty() {
        return Err(ConfigError::all(mistakes));
    }
    Ok(checked)
}

/// One route that passed `check_routes`, its settings defaulted from `config`'s.
fn build_route(
    config: &Config,
    route: &RouteConfig,
    checked: CheckedRoute,
    models: &Arc<crate::llm::Models>,
) -> Route<Unmetered> {
    let CheckedRoute {
        action,
        conditions,
        jwt,
    } = checked;
    let limits = build_limits(route, conditions, models);
    let mut fields = fields::read_by(&limits);
    // The token is read once too: two of its fields would be two readings.
    if let Some(field) = jwt.as_ref().and_then(|jwt| token_field(&jwt.verifier)) {
        if !fields.contains(&field) {
            fields.push(field);
        }
    }
    let settings = RouteSettings {
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
        should_retry_within: route
            .should_retry_within
            .or(config.should_retry_within)
            .map_or(crate::config::DEFAULT_SHOULD_RETRY_WITHIN, |d| d.0),
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
        jwt,
    };
    Route {
        settings,
        limits,
        metrics: (),
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
                        "unknown upstream `{}` (defined: {}){}",
                        upstream.value,
                        if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        },
                        crate::config::did_you_mean(upstream.value.as_str(), known.iter().copied())
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

/// A route's `jwt:` with its verifier.
fn route_jwt(
    route: &RouteConfig,
    verifiers: &Verifiers,
    file: &Path,
    field: &str,
) -> Result<Option<RouteJwt>, ConfigError> {
    let Some(jwt) = &route.jwt else {
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

/// Checks a route's limits against each other and against the rules of which options go
/// together (`rules`); returns each limit's compiled conditions.
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
        let seen = Seen {
            limit,
            route,
            models,
        };
        rules::check_limit(&seen, file, &field)?;
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
    rules::check_route(route, file, field)?;
    Ok(conditions)
}

/// The quota of a limit that passed the rules.
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
    route: &RouteConfig,
    conditions: Vec<Vec<Condition>>,
    models: &Arc<crate::llm::Models>,
) -> Vec<Limit<Unmetered>> {
    route
        .limits
        .iter()
        .zip(conditions)
        .map(|(limit, when)| Limit {
            settings: build_limit(limit, when, models),
            metrics: (),
        })
        .collect()
}

/// One limit that passed the rules.
fn build_limit(
    limit: &LimitConfig,
    when: Vec<Condition>,
    models: &Arc<crate::llm::Models>,
) -> LimitSettings {
    LimitSettings {
        name: limit.name.value.clone(),
        key: limit.key.value.clone(),
        spec: Spec {
            algorithm: limit.algorithm(),
            requests: crate::llm::config::quota(limit),
            window: match (&limit.window, quota_of(limit)) {
                _ if limit.concurrent.is_some() => limit
                    .lease
                    .as_ref()
                    .map_or(crate::config::DEFAULT_LEASE, |lease| lease.value.0),
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
            overridable: limit.overrides,
            notify: notify_thresholds(limit),
            max_delay: match (delays(limit), &limit.max_delay) {
                (true, Some(max_delay)) => max_delay.value.0,
                _ => Duration::ZERO,
            },
            // A token budget gives back what a request did not use.
            returnable: limit.count.is_some() || limit.tokens.is_some() || limit.money.is_some(),
        },
        tokens: crate::llm::config::budget(limit, models).map(Box::new),
        report: limit.report,
        count: limit
            .count
            .as_ref()
            .map(|count| count.value.status.clone().into_boxed_slice()),
        when,
        quota: quota_of(limit),
        client_prefix: ClientPrefix {
            ipv4: prefix_bits(&limit.ipv4_prefix, DEFAULT_IPV4_PREFIX),
            ipv6: prefix_bits(&limit.ipv6_prefix, DEFAULT_IPV6_PREFIX),
        },
    }
}

/// The first limit that says `notify` in a config without `webhook:`: nowhere to send to.
fn notify_without_webhook(config: &Config, file: &Path) -> Option<ConfigError> {
    config.routes.iter().enumerate().find_map(|(r, route)| {
        route.limits.iter().enumerate().find_map(|(l, limit)| {
            let notify = limit.notify.as_ref()?;
            Some(ConfigError::invalid(
                file,
                Position::from(notify),
                format!("routes[{r}].limits[{l}].notify"),
                "notifications need somewhere to go: add a top-level `webhook: { url: \
                 http://..., secret_env: NAME }`",
            ))
        })
    })
}

/// The `notify` thresholds of a limit that passed the rules, in permille.
fn notify_thresholds(limit: &LimitConfig) -> crate::limiter::Thresholds {
    let permille: Vec<u16> = limit.notify.as_ref().map_or_else(Vec::new, |notify| {
        notify
            .value
            .at
            .iter()
            .map(|f| crate::limiter::thresholds::permille(f.value))
            .collect()
    });
    crate::limiter::Thresholds::new(&permille).unwrap_or_default()
}

/// A prefix length the rules accepted, or the default.
fn prefix_bits(prefix: &Option<crate::config::Spanned<u32>>, default: u32) -> u8 {
    u8::try_from(prefix.as_ref().map_or(default, |p| p.value)).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OnStoreError;

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
        let compiled =
            Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
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
        let refused =
            Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
                .err()
                .expect("refused");
        assert!(
            refused.to_string().contains("upstreams.secure.url"),
            "{refused}"
        );
        let loaded =
            UpstreamTlsSet::load(&config.upstreams, Path::new("t.yaml")).expect("builtin roots");
        let policy =
            Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &loaded).expect("valid");
        let upstream = policy.upstreams().next().expect("one upstream");
        assert!(upstream.tls.is_some());
    }
}
