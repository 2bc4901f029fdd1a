//! What sluice itself answers: the IETF `RateLimit-Policy` / `RateLimit` fields, 429s with an
//! exact `Retry-After`, and RFC 9457 problem details for every error it produces.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::limiter::Decision;
use crate::policy::Route;
use crate::proxy::ProxyBody;
pub use crate::ratelimit_field::ceil_seconds;
use crate::ratelimit_field::limit_items;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// `"per-ip";r=4;t=60, ...`: where each limit stands after this decision (the limits the
/// store was asked about; `None` if there are none).
pub fn rate_limit(route: &Route, decision: &Decision) -> Option<HeaderValue> {
    limit_items(
        route
            .limits
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

/// Adds the RateLimit fields of a decided request to a response.
pub fn add_rate_limit_fields(
    response: &mut Response<ProxyBody>,
    route: &Route,
    decision: &Decision,
) {
    let headers = response.headers_mut();
    if let Some(policy) = &route.rate_limit_policy {
        headers.insert(RATELIMIT_POLICY, policy.clone());
    }
    if let Some(value) = rate_limit(route, decision) {
        headers.insert(RATELIMIT, value);
    }
}

/// The 429 for a rejected request, naming the route and, of the limits that rejected it (never
/// a shadow limit), the one that keeps it waiting longest.
pub fn too_many_requests(route: &Route, decision: &Decision, path: &str) -> Response<ProxyBody> {
    let retry_after = ceil_seconds(decision.retry_after).max(1);
    let limit = route
        .limits
        .iter()
        .zip(&decision.limits)
        .zip(&decision.rejecting)
        .filter(|((limit, _), &rejecting)| rejecting && !limit.shadow)
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
    add_rate_limit_fields(&mut response, route, decision);
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
