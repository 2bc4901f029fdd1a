//! The finish phase, last for every request: the one place an answer is completed. A `Stop`
//! becomes its problem body here; then every answer, sluice's own or the upstream's, gets
//! the RateLimit fields of its decision, `Retry-After`, gRPC's status for a 429, the request
//! id, no body for HEAD, its count in the metrics and its line in the access and rejection
//! logs.

use std::sync::Arc;

use std::time::Duration;

use http::header::{HeaderName, HeaderValue, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Response, StatusCode};
use prometheus::{IntCounter, IntCounterVec};

use super::decide::Decided;
use super::request_id::X_REQUEST_ID;
use super::stop::Stop;
use super::upstream::forward::ForwardError;
use super::upstream::grpc;
use super::Exchange;
use crate::body::ProxyBody;
use crate::log::{RequestLog, Subject};
use crate::metrics::{Metrics, Outcome};
use crate::policy::Route;
use crate::response::{self, retry_after_seconds};

/// On an answer whose request a soft limit sent to another model (`super::switch`):
/// `gpt-4o -> gpt-4o-mini` (the model the body named, normalised, then the fallback as the
/// policy writes it).
const MODEL_SWITCHED: HeaderName = HeaderName::from_static("sluice-model-switched");

/// What an answer from the upstream or a direct response is counted as.
pub struct Answered {
    pub outcome: Outcome,
    pub response: Response<ProxyBody>,
}

/// The wait before a retry in milliseconds, rounded up, at least 1 (as `Retry-After` is never
/// 0): read by OpenAI's and Anthropic's SDKs before `Retry-After`.
pub const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// `true` or `false`: whether the client should retry at all (OpenAI's and Anthropic's SDKs
/// obey it over their own rules).
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

fn retry_after_ms(wait: Duration) -> u64 {
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    let partial = u64::from(wait.subsec_nanos() % 1_000_000 > 0);
    ms.saturating_add(partial).max(1)
}

/// The counters and logs every answer goes to.
pub struct Finisher {
    /// `sluice_requests_total{route="",outcome="no_route"}`: requests no route matches.
    unrouted: IntCounter,
    /// `sluice_requests_total{route="",outcome="refused"}`: requests refused before routing.
    refused_unrouted: IntCounter,
    /// `sluice_refused_requests_total`, by reason.
    refusals: IntCounterVec,
    /// Bounds the per-request log lines: rejections summarised, the others rate-limited.
    pub log: Arc<RequestLog>,
}

impl Finisher {
    pub fn new(metrics: &Metrics) -> Finisher {
        let unrouted = |outcome: Outcome| {
            metrics
                .traffic
                .requests
                .with_label_values(&["", outcome.label()])
        };
        Finisher {
            unrouted: unrouted(Outcome::NoRoute),
            refused_unrouted: unrouted(Outcome::Refused),
            refusals: metrics.traffic.refused.clone(),
            log: RequestLog::start(),
        }
    }

    /// Completes the answer to the request `exchange` followed.
    pub fn finish(
        &self,
        exchange: Exchange<'_>,
        result: Result<Answered, Stop>,
    ) -> Response<ProxyBody> {
        let route = exchange.route;
        let decided = exchange.decided.as_ref();
        let (outcome, mut response) = match result {
            Ok(answered) => (answered.outcome, answered.response),
            Err(stop) => {
                if let Some(reason) = stop.refusal() {
                    self.refusals.with_label_values(&[reason.label()]).inc();
                }
                let outcome = stop.outcome(route.is_some());
                (outcome, self.answer(&stop, &exchange))
            }
        };
        if let (Some(route), Some(decided)) = (route, decided) {
            response::add_rate_limit_fields(
                response.headers_mut(),
                route,
                decided.limits.limits(),
                &decided.decision,
            );
        }
        response
            .headers_mut()
            .insert(X_REQUEST_ID, exchange.request_id.clone());
        if let Some(switched) = &exchange.switched {
            response
                .headers_mut()
                .insert(MODEL_SWITCHED, switched.clone());
        }
        // hyper closes an HTTP/1.x connection whose request body was left unread after
        // this answer: the answer says so, and no client sends its next request into it.
        exchange.connection.mark(response.headers_mut());
        // An answer to HEAD has no body (RFC 9110 §9.3.2). hyper drops sluice's own bodies
        // (429, problems) on HTTP/1.1 but sends them on HTTP/2, where the client then resets
        // the stream as malformed.
        if let (true, ProxyBody::Full(body)) = (exchange.head_only, response.body_mut()) {
            *body = None;
        }
        let elapsed = exchange.started.elapsed();
        match route {
            Some(route) => {
                route.metrics.count(outcome);
                route.metrics.duration.observe(elapsed.as_secs_f64());
            }
            None if outcome == Outcome::NoRoute => self.unrouted.inc(),
            None => self.refused_unrouted.inc(),
        }
        // An access log, off by default (RUST_LOG=sluice::access=debug turns it on); it holds
        // no client identity, like the metrics. Bounded by its budget, not by traffic.
        if let Some(route) = route {
            if tracing::enabled!(target: "sluice::access", tracing::Level::DEBUG)
                && self.log.access.allow()
            {
                tracing::debug!(
                    target: "sluice::access",
                    route = %route.name,
                    outcome = outcome.label(),
                    status = response.status().as_u16(),
                    micros = elapsed.as_micros() as u64,
                    shadow_rejected = %exchange.shadow_rejected,
                    request_id = exchange.id(),
                );
            }
        }
        response
    }

    /// The answer sluice makes for `stop`, with its own fields (`Retry-After`, gRPC's status);
    /// the logs a stop deserves are written here too.
    fn answer(&self, stop: &Stop, exchange: &Exchange<'_>) -> Response<ProxyBody> {
        let route = exchange.route;
        let instance = exchange.instance.path();
        let status = stop.status();
        let (mut response, wait) = match (stop, route, exchange.decided.as_ref()) {
            (Stop::Limited, Some(route), Some(decided)) => {
                let wait = decided.decision.retry_after;
                self.log_rejection(route, decided, exchange, retry_after_seconds(wait));
                (
                    too_many_requests(route, decided, instance, retry_after_seconds(wait)),
                    Some(wait),
                )
            }
            _ => {
                let wait = match stop {
                    Stop::TooManyHeld { delay } => Some(*delay),
                    Stop::StoreUnavailable | Stop::LeaseLost | Stop::Busy { .. } => {
                        Some(Duration::from_secs(1))
                    }
                    _ => None,
                };
                let mut extra: &[(&str, &str)] = &[];
                let named;
                if let Stop::Upstream { error, upstream } = stop {
                    self.log_upstream_failure(route, upstream.as_str(), error, exchange);
                    named = [("upstream", upstream.as_str())];
                    extra = &named;
                }
                let detail = stop.detail(route);
                (response::problem(status, &detail, instance, extra), wait)
            }
        };
        if let Stop::Unauthenticated(invalid) = stop {
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, www_authenticate(*invalid));
        }
        if let Some(wait) = wait {
            let seconds = retry_after_seconds(wait);
            let headers = response.headers_mut();
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
            // What OpenAI's and Anthropic's SDKs read first: the wait to the millisecond.
            headers.insert(RETRY_AFTER_MS, HeaderValue::from(retry_after_ms(wait)));
            if status == StatusCode::TOO_MANY_REQUESTS {
                // Past the route's bound, those SDKs raise at once instead of sleeping.
                let within = route.is_none_or(|route| wait <= route.should_retry_within);
                headers.insert(
                    X_SHOULD_RETRY,
                    HeaderValue::from_static(if within { "true" } else { "false" }),
                );
                if exchange.grpc {
                    grpc::mark_limited(headers, seconds);
                }
            }
        }
        response
    }

    /// "upstream failed", by rate, not by traffic.
    fn log_upstream_failure(
        &self,
        route: Option<&Route>,
        upstream: &str,
        error: &ForwardError,
        exchange: &Exchange<'_>,
    ) {
        let Some(route) = route else { return };
        if tracing::enabled!(tracing::Level::WARN) && self.log.upstream_failed.allow() {
            tracing::warn!(target: "sluice::proxy", route = %route.name, upstream, error = %error, request_id = exchange.id(), "upstream failed");
        }
    }

    /// The first rejection of an identity by a limit is logged at once: the route, the limit,
    /// a hash of the identity (never the identity itself: API keys are secrets), the
    /// Retry-After and the request id. Its next rejections are counted and summarised
    /// (`crate::log::summary`).
    fn log_rejection(
        &self,
        route: &Route,
        decided: &Decided<'_>,
        exchange: &Exchange<'_>,
        retry_after: u64,
    ) {
        if !tracing::enabled!(target: "sluice::rejected", tracing::Level::INFO) {
            return;
        }
        let rejecting = decided.limits.iter().zip(&decided.decision.rejecting);
        for ((limit, check), &rejecting) in rejecting {
            let subject = || Subject {
                route: route.name.to_string(),
                limit: limit.name.to_string(),
                identity: crate::log::key_hash(&check.key),
            };
            if rejecting && !limit.spec.shadow && self.log.rejections.record(&check.key, subject) {
                tracing::info!(
                    target: "sluice::rejected",
                    route = %route.name,
                    limit = %limit.name,
                    identity = %crate::log::key_hash(&check.key),
                    retry_after,
                    request_id = exchange.id(),
                    "rejected"
                );
            }
        }
    }
}

/// The 429 of a rejected request, naming the route and, of the limits that rejected it
/// (never a shadow limit), the one that keeps it waiting longest.
fn too_many_requests(
    route: &Route,
    decided: &Decided<'_>,
    instance: &str,
    retry_after: u64,
) -> Response<ProxyBody> {
    let limit = decided
        .limits
        .limits()
        .iter()
        .zip(&decided.decision.limits)
        .zip(&decided.decision.rejecting)
        .filter(|((limit, _), &rejecting)| rejecting && !limit.spec.shadow)
        .filter_map(|((limit, state), _)| state.as_ref().map(|state| (limit, state)))
        .max_by_key(|(_, state)| state.reset)
        .map(|(limit, _)| *limit);
    if let Some(quota) = limit.and_then(|limit| limit.quota.as_ref().map(|q| (limit, q))) {
        return response::quota_exhausted(
            route,
            quota,
            decided.decision.retry_after,
            instance,
            retry_after,
        );
    }
    let at_once = limit
        .filter(|limit| limit.spec.algorithm == crate::limiter::Algorithm::Concurrency)
        .map(|limit| limit.spec.requests);
    let unit = limit.map_or("requests", |limit| limit.unit());
    let limit = limit.map_or("", |limit| limit.name.as_str());
    let detail = if let Some(at_once) = at_once {
        // Retry-After is a hint here: the average time a place was held recently, over the
        // places held (the expected wait for the first to free when requests are alike).
        format!(
            "route `{}`: limit `{limit}` allows {at_once} requests in flight at once and has \
             none free; one is expected to free in about {retry_after} s",
            route.name
        )
    } else if unit != "requests" {
        format!(
            "route `{}`: limit `{limit}` has no room for this request's reserved {unit}; retry \
             in {retry_after} s",
            route.name
        )
    } else {
        format!(
            "route `{}`: limit `{limit}` is exhausted; retry in {retry_after} s",
            route.name
        )
    };
    response::problem_with(
        StatusCode::TOO_MANY_REQUESTS,
        &detail,
        instance,
        [
            ("route", route.name.as_str().into()),
            ("limit", limit.into()),
            ("unit", unit.into()),
            ("retry_after", retry_after.into()),
        ],
    )
}

/// RFC 6750 §3: `Bearer error="invalid_token"` with a description; a request without any
/// token gets the bare challenge (§3.1: no error code when no credentials were sent).
fn www_authenticate(invalid: crate::jwt::Invalid) -> HeaderValue {
    if invalid == crate::jwt::Invalid::Missing {
        return HeaderValue::from_static("Bearer");
    }
    let value = format!(
        "Bearer error=\"invalid_token\", error_description=\"{}\"",
        invalid.detail().replace(['"', '\\'], "'")
    );
    HeaderValue::from_str(&value)
        .unwrap_or(HeaderValue::from_static("Bearer error=\"invalid_token\""))
}
