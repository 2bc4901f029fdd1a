//! `sluice explain`: what sluice would do with one request, worked out from the policy file
//! alone — the canonical path, the route, the client address, each limit and the exact store
//! key it would touch — without sending anything to the store or the upstream. It is one
//! call of the gateway's own reading of a request up to the decision (`request::plan`), plus
//! formatting, so it cannot tell a different story.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Uri};

use crate::config::{ConfigError, KeyPart};
use crate::jwt::Claims;
use crate::limiter::Check;
use crate::metrics::Metrics;
use crate::policy::{Action, Limit, Route};
use crate::proxy::Stop;
use crate::request::client::client_network;
use crate::request::store_key::{self, RequestParts};
use crate::request::{self, HeadLimits, Now, Plan, Why};
use crate::version::{self, ListenerFiles};

/// The request to explain, as given on the command line.
pub struct Question<'a> {
    pub method: &'a str,
    /// A path with an optional query (`/users/42?x=1`).
    pub target: &'a str,
    /// `name: value` header lines.
    pub headers: &'a [String],
    /// The address the request comes from (the TCP peer sluice would see).
    pub from: IpAddr,
}

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("`{0}` is not an HTTP method")]
    Method(String),
    #[error("`{0}` is not a request target (a path like /users/42, with an optional query)")]
    Target(String),
    #[error("`{0}` is not a header line like `x-api-key: k1`")]
    Header(String),
    #[error("cannot create the metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// The explanation, as lines of text.
pub fn explain(file: &Path, question: &Question<'_>) -> Result<String, ExplainError> {
    let loaded = version::load(file, ListenerFiles::Skip)?;
    let source = loaded.source;
    // The gateway's phases read a policy with its metric handles; these count into a registry
    // of their own that nothing reads.
    let policy = loaded.policy.metered(&Metrics::new()?);
    let (mut head, sent) = head_of(question)?;

    let mut out = String::new();
    let _ = writeln!(
        out,
        "request:    {} {} from {}",
        head.method, question.target, question.from
    );
    // The gateway's own reading, up to the decision: what is refused here is refused there.
    let head_limits = HeadLimits::new(&source.config.server);
    let planned = request::plan(
        &policy,
        &head_limits,
        &mut head,
        0,
        question.from,
        Now::read(),
    );
    let (route, why) = match &planned {
        Ok(planned) => (Some(planned.route), None),
        Err(refused) => (refused.route, Some(&refused.why)),
    };
    // The head was read (its path is canonical) unless the head itself was refused.
    if route.is_some() || matches!(why, Some(Why::NoRoute)) {
        write_path(&mut out, head.uri.path(), sent.path());
    }
    let planned = match planned {
        Ok(planned) => planned,
        Err(refused) => {
            write_refused(&mut out, refused.why, refused.route, &head);
            return Ok(out);
        }
    };
    let route = planned.route;
    write_route(&mut out, route, &head);
    let claims = planned.claims;
    write_jwt(&mut out, route, claims.as_ref());
    let plan = planned.plan;
    let client_ip = plan.client_ip;
    write_client_ip(&mut out, client_ip, question.from);
    if route.limits.is_empty() {
        let _ = writeln!(out, "limits:     none");
        return Ok(out);
    }
    let cluster = source
        .config
        .store
        .redis
        .as_ref()
        .is_some_and(|redis| redis.value.cluster.is_some());
    write_store_calls(&mut out, cluster, &plan);
    let request = RequestParts {
        claims: claims.as_ref(),
        method: &head.method,
        uri: &head.uri,
        headers: &head.headers,
        client_ip,
        model: None,
    };
    let context = LimitContext {
        policy: &policy,
        route,
        request: &request,
        cluster,
    };
    write_limits(&mut out, &plan, &context);
    let _ = writeln!(
        out,
        "on store error: {}\nnothing was sent to the store or the upstream.",
        route.on_store_error.label()
    );
    Ok(out)
}

/// The route's `jwt:` verifier, and whether the request's token was taken (`claims`).
fn write_jwt(out: &mut String, route: &Route, claims: Option<&Claims>) {
    let Some(jwt) = &route.jwt else {
        return;
    };
    let verdict = match claims {
        Some(_) => "valid: its claims are read below",
        None => "missing or invalid: the limits of an anonymous client (on_invalid: anonymous)",
    };
    let _ = writeln!(
        out,
        "jwt:        verifier `{}`: token {verdict}",
        jwt.verifier.name
    );
}

/// The client's address as the limits read it, and whether a trusted proxy said it.
fn write_client_ip(out: &mut String, client_ip: IpAddr, from: IpAddr) {
    if client_ip != from.to_canonical() {
        let _ = writeln!(
            out,
            "client ip:  {client_ip} (from a trusted proxy's forwarded-for header)"
        );
    } else {
        let _ = writeln!(out, "client ip:  {client_ip}");
    }
}

/// How many store calls decide the request: one, unless its keys span Redis Cluster slots.
fn write_store_calls(out: &mut String, cluster: bool, plan: &Plan<'_>) {
    if cluster && crate::limiter::spans_slots(plan.limits.checks()) {
        let _ = writeln!(
            out,
            "limits:     in different Redis Cluster slots: each slot decided by its own call, \
             and what one admits given back when another rejects"
        );
    } else {
        let _ = writeln!(
            out,
            "limits:     all that apply decided together, in one store call"
        );
    }
}

/// Each of the route's limits: its check, or why it has none.
fn write_limits(out: &mut String, plan: &Plan<'_>, context: &LimitContext<'_>) {
    for limit in &context.route.limits {
        let Some(check) = plan.limits.check_of(limit) else {
            let why = if plan.deferred.iter().any(|l| std::ptr::eq(*l, limit)) {
                "reads the body's `model`: planned once the body is read (explain reads no body)"
            } else {
                "does not apply (its `when` does not hold)"
            };
            let _ = writeln!(out, "  {}: {why}", limit.name);
            continue;
        };
        write_limit(out, limit, check, context);
    }
}

/// The request's head as the gateway would receive it, and the target as sent.
fn head_of(question: &Question<'_>) -> Result<(http::request::Parts, Uri), ExplainError> {
    let method = Method::from_bytes(question.method.as_bytes())
        .map_err(|_| ExplainError::Method(question.method.to_owned()))?;
    let headers = parse_headers(question.headers)?;
    let sent: Uri = question
        .target
        .parse()
        .ok()
        .filter(|uri: &Uri| uri.path().starts_with('/'))
        .ok_or_else(|| ExplainError::Target(question.target.to_owned()))?;
    let mut request = http::Request::new(());
    *request.method_mut() = method;
    *request.uri_mut() = sent.clone();
    *request.headers_mut() = headers;
    Ok((request.into_parts().0, sent))
}

fn write_path(out: &mut String, canonical: &str, sent: &str) {
    if canonical != sent {
        let _ = writeln!(
            out,
            "path:       {canonical} (normalized; forwarded like this)"
        );
    } else {
        let _ = writeln!(out, "path:       {canonical}");
    }
}

/// The lines of a request refused before its limits: the route, when one matched, and the
/// answer.
fn write_refused(out: &mut String, why: Why, route: Option<&Route>, head: &http::request::Parts) {
    match (&why, route) {
        (Why::NoRoute, _) => {
            let _ = writeln!(out, "route:      none matches: 404 Not Found");
        }
        (Why::Unauthenticated(_) | Why::KeysUnavailable, Some(route)) => {
            write_route(out, route, head);
            write_refusal(out, why, Some(route));
        }
        (_, route) => {
            if let Some(route) = route {
                write_route_name(out, route);
            }
            write_refusal(out, why, route);
        }
    }
}

/// What every limit's lines read besides the limit itself.
struct LimitContext<'a> {
    policy: &'a crate::policy::Policy,
    route: &'a Route,
    request: &'a RequestParts<'a>,
    cluster: bool,
}

/// One limit that applies: what it allows and how it counts, its key and store key, and where
/// a running instance shows more.
fn write_limit(out: &mut String, limit: &Limit, check: &Check, context: &LimitContext<'_>) {
    let parts: Vec<String> = limit.key.iter().map(KeyPart::to_string).collect();
    let _ = writeln!(
        out,
        "  {}: {} ({}), key [{}]",
        limit.name,
        amount(limit, check),
        how_it_counts(limit).join(", "),
        parts.join(", ")
    );
    if let Some(budget) = &limit.tokens {
        let _ = writeln!(out, "    {}", crate::llm::describe(budget));
    }
    let missing = store_key::missing_part(limit, context.request);
    if let Some(missing) = missing {
        let _ = writeln!(
            out,
            "    the request has no {missing}: this limit counts the client ip instead"
        );
    }
    if missing.is_some() || limit.key.contains(&KeyPart::ClientIp) {
        let client_ip = context.request.client_ip;
        let (network, bits) = client_network(client_ip, limit.client_prefix);
        let _ = writeln!(
            out,
            "    client address counted as {network}/{bits} (IPv6 grouped by /{}, IPv4 by /{}: \
             ipv6_prefix, ipv4_prefix)",
            limit.client_prefix.ipv6, limit.client_prefix.ipv4
        );
    }
    let _ = writeln!(out, "    store key: {}", check.key);
    if limit.spec.algorithm == crate::limiter::Algorithm::Concurrency {
        // `explain` asks no store; a running instance's admin API does.
        let identity = store_key::identity_of(context.policy, context.route, limit, &check.key);
        let _ = writeln!(
            out,
            "    in flight now: GET /admin/v1/limits/{}/{}?key={} on a running instance \
             lists the holders",
            context.route.name,
            limit.name,
            query_value(identity)
        );
    }
    if context.cluster {
        let _ = writeln!(
            out,
            "    cluster slot: {}",
            crate::limiter::slot_of(&check.key)
        );
    }
}

/// How much a limit allows: `100 per 1m`, `5000 tokens per day (UTC), resets at ...`, `4 at
/// once (lease 10s)`.
fn amount(limit: &Limit, check: &Check) -> String {
    if limit.spec.algorithm == crate::limiter::Algorithm::Concurrency {
        return format!(
            "{} at once (lease {})",
            limit.spec.requests,
            human(limit.spec.window)
        );
    }
    let unit = limit
        .tokens
        .as_ref()
        .map_or(String::new(), |b| format!(" {}", b.unit.label()));
    // A calendar quota: its period and zone, and when the one holding now ends.
    let per = match &limit.quota {
        Some(quota) => format!(
            "{} ({}), resets at {}",
            quota.period.label(),
            quota.zone_name,
            crate::response::reset_instant(quota, check.spec.window)
        ),
        None => human(limit.spec.window),
    };
    format!("{}{unit} per {per}", limit.spec.requests)
}

/// The algorithm and what else changes how a limit counts: cost, shadow, a hold, the outcomes
/// it counts.
fn how_it_counts(limit: &Limit) -> Vec<String> {
    let traits = limit.spec.algorithm.traits();
    let mut extras = vec![traits.label.to_owned()];
    if !traits.exact {
        extras.push("approximate".to_owned());
    }
    if limit.spec.cost > 1 {
        extras.push(format!("cost {}", limit.spec.cost));
    }
    if limit.spec.shadow {
        extras.push("shadow: counted, never rejects".to_owned());
    }
    if !limit.spec.max_delay.is_zero() {
        extras.push(format!(
            "over the limit: held up to {}, then 429",
            human(limit.spec.max_delay)
        ));
    }
    if let Some(statuses) = &limit.count {
        let listed: Vec<String> = statuses
            .iter()
            .map(|s| match s {
                crate::config::StatusMatch::Exact(code) => code.to_string(),
                crate::config::StatusMatch::Class(class) => format!("{class}xx"),
            })
            .collect();
        extras.push(format!(
            "counts only responses {}: others are given back",
            listed.join(", ")
        ));
    }
    extras
}

/// The line for a request the request layer refused: what the gateway would answer instead,
/// in the gateway's own words (`Stop`).
fn write_refusal(out: &mut String, why: Why, route: Option<&Route>) {
    let stop = Stop::from(why);
    let _ = writeln!(out, "refused:    {}: {}", stop.status(), stop.detail(route));
}

fn write_route_name(out: &mut String, route: &Route) {
    let _ = writeln!(
        out,
        "route:      {} (the first route in the file that matches)",
        route.name
    );
}

/// The route's lines: its name and its action.
fn write_route(out: &mut String, route: &Route, head: &http::request::Parts) {
    write_route_name(out, route);
    match &route.action {
        Action::Forward(upstream) => {
            let scheme = if upstream.tls.is_some() {
                "https"
            } else {
                "http"
            };
            let _ = writeln!(
                out,
                "action:     forward to upstream `{}` as {scheme}://{}{}{}",
                upstream.name,
                upstream.authority,
                upstream.base_path,
                head.uri.path_and_query().map_or("/", |pq| pq.as_str())
            );
        }
        Action::Respond(direct) => {
            let _ = writeln!(out, "action:     respond {} directly", direct.status);
        }
    }
}

fn parse_headers(lines: &[String]) -> Result<HeaderMap, ExplainError> {
    let mut headers = HeaderMap::new();
    for line in lines {
        let bad = || ExplainError::Header(line.clone());
        let (name, value) = line.split_once(':').ok_or_else(bad)?;
        let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad())?;
        let value = HeaderValue::from_str(value.trim()).map_err(|_| bad())?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// A window in the policy file's units (`1m`, `30s`, `1500ms`).
fn human(duration: Duration) -> String {
    let ms = duration.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// `text` as a URL query value: every byte but the unreserved ones, `:` and `=` percent-encoded
/// (an identity holds `|` between parts and `#` before a hash).
fn query_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~:=".contains(&byte) {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}
