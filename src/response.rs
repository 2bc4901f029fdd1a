//! What sluice itself answers: the IETF `RateLimit-Policy` / `RateLimit` fields, 429s with an
//! exact `Retry-After`, and RFC 9457 problem details for every error it produces.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::config::ResponseHeaders;
use crate::limiter::Decision;
use crate::policy::{rate_limit_policy, Limit, Route};
use crate::proxy::ProxyBody;
pub use crate::ratelimit_field::ceil_seconds;
use crate::ratelimit_field::limit_items;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// `"per-ip";r=4;t=60, ...`: where each limit stands after this decision (the limits the
/// store was asked about; `None` if there are none).
pub fn rate_limit(limits: &[&Limit], decision: &Decision) -> Option<HeaderValue> {
    limit_items(
        limits
            .iter()
            .zip(&decision.limits)
            .filter_map(|(limit, state)| state.as_ref().map(|state| (limit, state)))
            .map(|(limit, state)| {
                let params = [
                    ('r', u64::from(state.remaining)),
                    ('t', ceil_seconds(state.reset)),
                ];
                (&limit.name, params)
            }),
    )
}

pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Adds the rate-limit fields of a decided request to a response, in the route's style.
/// `limits`: the route's limits that applied, in the order of `decision.limits`.
pub fn add_rate_limit_fields(
    response: &mut Response<ProxyBody>,
    route: &Route,
    limits: &[&Limit],
    decision: &Decision,
) {
    let (ietf, legacy) = match route.response_headers {
        ResponseHeaders::Ietf => (true, false),
        ResponseHeaders::Legacy => (false, true),
        ResponseHeaders::Both => (true, true),
        ResponseHeaders::None => (false, false),
    };
    let headers = response.headers_mut();
    if ietf {
        let policy = match &route.rate_limit_policy {
            Some(policy) => Some(policy.clone()),
            // Conditional limits: the field lists those that applied.
            None => rate_limit_policy(limits.iter().copied()),
        };
        if let Some(policy) = policy {
            headers.insert(RATELIMIT_POLICY, policy);
        }
        if let Some(value) = rate_limit(limits, decision) {
            headers.insert(RATELIMIT, value);
        }
    }
    if legacy {
        // One limit only in this style: the one closest to exhaustion (the fewest requests
        // left; of those, the longest wait).
        let closest = limits
            .iter()
            .zip(&decision.limits)
            .filter_map(|(limit, state)| state.as_ref().map(|state| (limit, state)))
            .min_by_key(|(_, state)| (state.remaining, std::cmp::Reverse(state.reset)));
        if let Some((limit, state)) = closest {
            headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(limit.spec.requests));
            headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(state.remaining));
            headers.insert(
                X_RATELIMIT_RESET,
                HeaderValue::from(ceil_seconds(state.reset)),
            );
        }
    }
}

/// The 429 for a rejected request, naming the route and, of the limits that rejected it (never
/// a shadow limit), the one that keeps it waiting longest.
pub fn too_many_requests(
    route: &Route,
    limits: &[&Limit],
    decision: &Decision,
    path: &str,
) -> Response<ProxyBody> {
    let retry_after = ceil_seconds(decision.retry_after).max(1);
    let limit = limits
        .iter()
        .zip(&decision.limits)
        .zip(&decision.rejecting)
        .filter(|((limit, _), &rejecting)| rejecting && !limit.spec.shadow)
        .filter_map(|((limit, state), _)| state.as_ref().map(|state| (limit, state)))
        .max_by_key(|(_, state)| state.reset)
        .map_or("", |(limit, _)| limit.name.as_str());
    let body = serde_json::json!({
        "type": "about:blank",
        "title": "Too Many Requests",
        "status": 429,
        "detail": format!("route `{}`: limit `{limit}` is exhausted; retry in {retry_after} s", route.name),
        "instance": path,
        "route": route.name.as_str(),
        "limit": limit,
        "retry_after": retry_after,
    });
    let mut response = problem_response(StatusCode::TOO_MANY_REQUESTS, &body);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after));
    add_rate_limit_fields(&mut response, route, limits, decision);
    response
}

/// A problem-details response for an error sluice produces itself. `extra` members are added
/// to the standard ones.
pub fn problem(
    status: StatusCode,
    detail: &str,
    path: &str,
    extra: &[(&str, &str)],
) -> Response<ProxyBody> {
    let mut body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or(""),
        "status": status.as_u16(),
        "detail": detail,
        "instance": path,
    });
    if let Some(members) = body.as_object_mut() {
        for (name, value) in extra {
            members.insert((*name).to_owned(), serde_json::Value::from(*value));
        }
    }
    problem_response(status, &body)
}

fn problem_response(status: StatusCode, body: &serde_json::Value) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}
