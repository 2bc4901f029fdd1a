//! How sluice spells its own answers: RFC 9457 problem details, the IETF `RateLimit-Policy` /
//! `RateLimit` fields (or the legacy `X-RateLimit-*` ones) and `Retry-After`. The gateway's
//! `finish` phase is the one caller on the request path; the admin listener uses the same
//! problem builder.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};

use crate::body::ProxyBody;
use crate::config::ResponseHeaders;
use crate::limiter::Decision;
use crate::policy::{rate_limit_policy_in_force, Limit, Route};
pub use crate::ratelimit_field::ceil_seconds;
use crate::ratelimit_field::limit_items;

pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The `Retry-After` of a wait, in whole seconds: rounded up, so a client that waits this
/// long is never early, and at least 1, since `0` would invite an immediate retry.
pub fn retry_after_seconds(wait: std::time::Duration) -> u64 {
    ceil_seconds(wait).max(1)
}

/// `"per-ip";r=4;t=60, ...`: where each limit stands after this decision (the limits the
/// store was asked about; `None` if there are none).
pub fn rate_limit(limits: &[&Limit], decision: &Decision) -> Option<HeaderValue> {
    limit_items(
        limits
            .iter()
            .zip(&decision.limits)
            .filter_map(|(limit, state)| state.as_ref().map(|state| (limit, state)))
            .map(|(limit, state)| {
                // A place of a concurrency limit frees at no time known in advance: no `t`.
                let concurrent = limit.spec.algorithm == crate::limiter::Algorithm::Concurrency;
                let params = [
                    Some(('r', u64::from(state.remaining))),
                    (!concurrent).then(|| ('t', ceil_seconds(state.reset))),
                ];
                (&limit.name, params.into_iter().flatten())
            }),
    )
}

/// Adds the rate-limit fields of a decided request, in the route's style. `limits`: the
/// route's limits that applied, in the order of `decision.limits`.
pub fn add_rate_limit_fields(
    headers: &mut HeaderMap,
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
    if ietf {
        let overridden = |index: usize| {
            decision
                .limits
                .get(index)
                .and_then(|state| state.and_then(|state| state.overridden))
        };
        let any_overridden = (0..limits.len()).any(|index| overridden(index).is_some());
        let policy = match &route.rate_limit_policy {
            Some(policy) if !any_overridden => Some(policy.clone()),
            // Conditional limits: the field lists those that applied; an identity's override
            // is its own number.
            _ => rate_limit_policy_in_force(
                limits
                    .iter()
                    .enumerate()
                    .map(|(index, &limit)| (limit, overridden(index))),
            ),
        };
        if let Some(policy) = policy {
            headers.insert(RATELIMIT_POLICY, policy);
        }
        if let Some(value) = rate_limit(limits, decision) {
            headers.insert(RATELIMIT, value);
        }
    }
    if ietf || legacy {
        add_openai_fields(headers, limits, decision);
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
            headers.insert(
                X_RATELIMIT_LIMIT,
                HeaderValue::from(state.overridden.unwrap_or(limit.spec.requests)),
            );
            headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(state.remaining));
            headers.insert(
                X_RATELIMIT_RESET,
                HeaderValue::from(ceil_seconds(state.reset)),
            );
        }
    }
}

/// On a route with a token or money budget, OpenAI's fields for the applications that parse
/// them (the SDKs do not): `x-ratelimit-{limit,remaining,reset}-tokens` for the budget closest
/// to exhaustion, and `-requests` for the request limit closest to it, when there is one.
fn add_openai_fields(headers: &mut HeaderMap, limits: &[&Limit], decision: &Decision) {
    if !limits.iter().any(|limit| limit.tokens.is_some()) {
        return;
    }
    let closest = |budgets: bool| {
        limits
            .iter()
            .zip(&decision.limits)
            .filter(|(limit, _)| {
                limit.tokens.is_some() == budgets
                    && limit.spec.algorithm != crate::limiter::Algorithm::Concurrency
            })
            .filter_map(|(limit, state)| state.as_ref().map(|state| (limit, state)))
            .min_by_key(|(_, state)| (state.remaining, std::cmp::Reverse(state.reset)))
    };
    for (budgets, [limit_name, remaining_name, reset_name]) in
        [(true, OPENAI_TOKENS), (false, OPENAI_REQUESTS)]
    {
        if let Some((limit, state)) = closest(budgets) {
            let number = state.overridden.unwrap_or(limit.spec.requests);
            headers.insert(limit_name, HeaderValue::from(number));
            headers.insert(remaining_name, HeaderValue::from(state.remaining));
            if let Ok(value) = HeaderValue::from_str(&go_duration(state.reset)) {
                headers.insert(reset_name, value);
            }
        }
    }
}

const OPENAI_TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

const OPENAI_REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];

/// A wait as OpenAI writes its reset fields (Go's duration text): `20ms` under a second,
/// else whole seconds rounded up, `59s`, `6m0s`, `1h2m3s`.
fn go_duration(wait: std::time::Duration) -> String {
    if wait < std::time::Duration::from_secs(1) {
        let ms = wait.as_millis() + u128::from(wait.subsec_nanos() % 1_000_000 > 0);
        return format!("{ms}ms");
    }
    let total = ceil_seconds(wait);
    let (hours, minutes, seconds) = (total / 3600, total / 60 % 60, total % 60);
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, _) => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m{seconds}s"),
    }
}

/// A problem-details answer: the standard members, then `members` (which may add to them).
pub fn problem_with(
    status: StatusCode,
    detail: &str,
    instance: &str,
    members: impl IntoIterator<Item = (&'static str, serde_json::Value)>,
) -> Response<ProxyBody> {
    let mut body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or(""),
        "status": status.as_u16(),
        "detail": detail,
        // The same words where OpenAI's SDK looks for them (its exception's text).
        "message": detail,
        "instance": instance,
    });
    if let Some(object) = body.as_object_mut() {
        for (name, value) in members {
            object.insert(name.to_owned(), value);
        }
    }
    let mut response = Response::new(ProxyBody::full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}

/// A problem-details answer whose extra members are strings.
pub fn problem(
    status: StatusCode,
    detail: &str,
    instance: &str,
    extra: &[(&'static str, &str)],
) -> Response<ProxyBody> {
    problem_with(
        status,
        detail,
        instance,
        extra
            .iter()
            .map(|(name, value)| (*name, serde_json::Value::from(*value))),
    )
}

/// The `type` of a 429 whose longest wait is a calendar quota's: its own, since the client's
/// answer to it differs (wait for the reset, or buy a larger plan), not retry soon.
pub const QUOTA_EXHAUSTED_TYPE: &str = "tag:sluice,2026:quota-exhausted";

/// The 429 of a request whose longest wait is a calendar quota's: names the quota, its period
/// and zone, and the instant it resets, in that zone and in seconds from now.
pub fn quota_exhausted(
    route: &Route,
    (limit, quota): (&Limit, &crate::limiter::calendar::Quota),
    wait: std::time::Duration,
    instance: &str,
    retry_after: u64,
) -> Response<ProxyBody> {
    let resets_at = reset_instant(quota, wait);
    let period = quota.period.label();
    let detail = format!(
        "route `{}`: quota `{}` ({} {} per {period}, {}) is used up; it resets at \
         {resets_at}, in {retry_after} s",
        route.name,
        limit.name,
        limit.spec.requests,
        limit.unit(),
        quota.zone_name
    );
    problem_with(
        StatusCode::TOO_MANY_REQUESTS,
        &detail,
        instance,
        [
            ("type", QUOTA_EXHAUSTED_TYPE.into()),
            ("title", "Quota exhausted".into()),
            ("route", route.name.as_str().into()),
            ("limit", limit.name.as_str().into()),
            ("quota", period.into()),
            ("unit", limit.unit().into()),
            ("time_zone", quota.zone_name.as_str().into()),
            ("resets_at", resets_at.into()),
            ("retry_after", retry_after.into()),
        ],
    )
}

/// When a quota whose period ends `wait` from now resets, as RFC 3339 in its zone (periods
/// start on whole seconds, so the store's microseconds are rounded off).
pub fn reset_instant(quota: &crate::limiter::calendar::Quota, wait: std::time::Duration) -> String {
    let now = crate::runtime::clock::now();
    let wait = jiff::SignedDuration::try_from(wait).unwrap_or(jiff::SignedDuration::ZERO);
    let at = now.checked_add(wait).unwrap_or(now);
    let at = at
        .round(jiff::Unit::Second)
        .unwrap_or(at)
        .to_zoned_datetime(quota.zone.clone());
    at.strftime("%Y-%m-%dT%H:%M:%S%:z").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn resets_are_written_as_openai_writes_them() {
        assert_eq!(go_duration(Duration::from_micros(19_001)), "20ms");
        assert_eq!(go_duration(Duration::from_millis(1_001)), "2s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_secs(3_723)), "1h2m3s");
    }
}
