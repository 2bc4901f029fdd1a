//! `sluice explain`: what sluice would do with one request, worked out from the policy file
//! alone — the canonical path, the route, the client address, each limit and the exact store
//! key it would touch — without sending anything to the store or the upstream.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, Uri};

use crate::config::{self, ConfigError, KeyPart};
use crate::keys::{self, RequestParts};
use crate::metrics::Metrics;
use crate::policy::{Action, Policy};

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
    let source = config::load(file)?;
    let metrics = Metrics::new()?;
    let policy = Policy::compile(&source.config, file, &metrics)?;
    let method = Method::from_bytes(question.method.as_bytes())
        .map_err(|_| ExplainError::Method(question.method.to_owned()))?;
    let mut headers = parse_headers(question.headers)?;
    let sent: Uri = question
        .target
        .parse()
        .ok()
        .filter(|uri: &Uri| uri.path().starts_with('/'))
        .ok_or_else(|| ExplainError::Target(question.target.to_owned()))?;

    let mut out = String::new();
    let _ = writeln!(
        out,
        "request:    {method} {} from {}",
        question.target, question.from
    );
    let canonical = match crate::path::normalize(sent.path()) {
        Ok(path) => path.into_owned(),
        Err(err) => {
            let _ = writeln!(out, "refused:    400 Bad Request: {err}");
            return Ok(out);
        }
    };
    let uri: Uri = match sent.query() {
        Some(query) => format!("{canonical}?{query}"),
        None => canonical.clone(),
    }
    .parse()
    .map_err(|_| ExplainError::Target(question.target.to_owned()))?;
    if canonical != sent.path() {
        let _ = writeln!(
            out,
            "path:       {canonical} (normalized; forwarded like this)"
        );
    } else {
        let _ = writeln!(out, "path:       {canonical}");
    }
    if let Err(refused) = crate::one_request::check_method(&method).and_then(|()| {
        crate::one_request::join_cookie_crumbs(&mut headers);
        crate::one_request::remove_connection_options(&mut headers, &policy.connection_guarded)
    }) {
        let _ = writeln!(out, "refused:    400 Bad Request: {}", refused.detail);
        return Ok(out);
    }
    let Some(route) = policy.route(&method, &canonical) else {
        let _ = writeln!(out, "route:      none matches: 404 Not Found");
        return Ok(out);
    };
    let _ = writeln!(
        out,
        "route:      {} (the first route in the file that matches)",
        route.name
    );
    if let Err(refused) = crate::one_request::check_fields(&route.fields, &uri, &headers) {
        let _ = writeln!(out, "refused:    400 Bad Request: {}", refused.detail);
        return Ok(out);
    }
    match &route.action {
        Action::Forward(upstream) => {
            let _ = writeln!(
                out,
                "action:     forward to upstream `{}` as http://{}{}{}",
                upstream.name,
                upstream.authority,
                upstream.base_path,
                uri.path_and_query().map_or("/", |pq| pq.as_str())
            );
        }
        Action::Respond(direct) => {
            let _ = writeln!(out, "action:     respond {} directly", direct.status);
        }
    }
    let client_ip = keys::client_ip(
        question.from,
        &headers,
        &policy.trusted_proxies,
        policy.forwarded_header,
    );
    if client_ip != question.from.to_canonical() {
        let _ = writeln!(
            out,
            "client ip:  {client_ip} (from a trusted proxy's forwarded-for header)"
        );
    } else {
        let _ = writeln!(out, "client ip:  {client_ip}");
    }
    if route.limits.is_empty() {
        let _ = writeln!(out, "limits:     none");
        return Ok(out);
    }
    let request = RequestParts {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip,
    };
    let applied = keys::checks(route, &request);
    let cluster = source
        .config
        .store
        .redis
        .as_ref()
        .is_some_and(|redis| redis.value.cluster.is_some());
    if cluster && crate::limiter::spans_slots(&applied.checks) {
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
    for limit in &route.limits {
        let Some(at) = applied.limits.iter().position(|l| std::ptr::eq(*l, limit)) else {
            let _ = writeln!(
                out,
                "  {}: does not apply (its `when` does not hold)",
                limit.name
            );
            continue;
        };
        let check = &applied.checks[at];
        let parts: Vec<String> = limit.key.iter().map(describe).collect();
        let mut extras = vec![limit.spec.algorithm.label().to_owned()];
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
        let _ = writeln!(
            out,
            "  {}: {} per {} ({}), key [{}]",
            limit.name,
            limit.spec.requests,
            human(limit.spec.window),
            extras.join(", "),
            parts.join(", ")
        );
        if let Some(missing) = keys::missing_part(limit, &request) {
            let _ = writeln!(
                out,
                "    the request has no {}: this limit counts the client ip instead",
                describe(missing)
            );
        }
        let counts_client =
            keys::missing_part(limit, &request).is_some() || limit.key.contains(&KeyPart::ClientIp);
        if counts_client {
            let (network, bits) = keys::client_network(client_ip, limit.client_prefix);
            let _ = writeln!(
                out,
                "    client address counted as {network}/{bits} (IPv6 grouped by /{}, IPv4 by /{}: \
                 ipv6_prefix, ipv4_prefix)",
                limit.client_prefix.ipv6, limit.client_prefix.ipv4
            );
        }
        let _ = writeln!(out, "    store key: {}", check.key);
        if cluster {
            let _ = writeln!(
                out,
                "    cluster slot: {}",
                crate::limiter::slot_of(&check.key)
            );
        }
    }

    let _ = writeln!(
        out,
        "on store error: {}\nnothing was sent to the store or the upstream.",
        route.on_store_error.label()
    );
    Ok(out)
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

/// A key part as written in the policy file.
pub fn describe(part: &KeyPart) -> String {
    match part {
        KeyPart::ClientIp => "client_ip".to_owned(),
        KeyPart::Header(name) => format!("header:{name}"),
        KeyPart::Query(name) => format!("query:{name}"),
        KeyPart::Cookie(name) => format!("cookie:{name}"),
        KeyPart::Method => "method".to_owned(),
        KeyPart::Host => "host".to_owned(),
        KeyPart::Path => "path".to_owned(),
        KeyPart::Param(name) => format!("param:{name}"),
    }
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
