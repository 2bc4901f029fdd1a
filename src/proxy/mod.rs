//! The gateway's request path, as a fixed sequence of phases:
//! check the head and canonicalize the path → one reading of the request (`one_request`) →
//! route → refuse a repeated field the route's limits read → refuse a body over the route's
//! limit → decide all limits in one store call → answer 429, or act (forward to the upstream, or the
//! route's direct response) → add the RateLimit fields.
//! Every request is counted once, by route and outcome.
//!
//! The policy in force is a snapshot a request takes at its start; a reload installs a new
//! one (`Gateway::install`) with the clients of its upstreams from a registry that outlives
//! reloads (`upstreams`).

mod body;
mod forward;
mod grpc;
mod harden;
mod headers;
mod request_id;
mod shaping;
mod tunnel;
mod upstreams;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use hyper::body::Incoming;
use prometheus::{IntCounter, IntCounterVec};

pub use self::body::ProxyBody;
use self::body::{BodyFault, BodyRefusals};
use self::forward::ForwardError;
pub use self::harden::HeadLimits;
use self::request_id::{RequestIds, X_REQUEST_ID};
use self::shaping::Admitted;
use self::upstreams::{Clients, Upstreams};
use crate::config::OnStoreError;
use crate::keys;
use crate::limiter::{Decision, Store};
use crate::log::{RequestLog, Subject};
use crate::metrics::{Metrics, Outcome, Refusal};
use crate::one_request;
use crate::policy::{Action, DirectResponse, Limit, Policy, Route};
use crate::response;

/// The policy in force and the client of each upstream it forwards to: swapped together, in
/// one step, on reload. A request holds an `Arc` of it from routing to its response, so it
/// finishes under the policy it started with.
struct Active {
    policy: Policy,
    clients: Clients,
}

/// One policy in force, kept alive while held.
pub struct PolicySnapshot(Arc<Active>);

impl std::ops::Deref for PolicySnapshot {
    type Target = Policy;

    fn deref(&self) -> &Policy {
        &self.0.policy
    }
}

pub struct Gateway {
    active: ArcSwap<Active>,
    upstreams: Upstreams,
    /// Shared with the tasks that give back a held request's places when its client leaves.
    store: Arc<Store>,
    head_limits: HeadLimits,
    /// `sluice_requests_total{route="",outcome="no_route"}`: requests no route matches.
    unrouted: IntCounter,
    /// `sluice_requests_total{route="",outcome="refused"}`: requests refused before routing.
    refused_unrouted: IntCounter,
    /// `sluice_refused_requests_total`, by reason.
    refusals: IntCounterVec,
    /// The same, for the faults of a request body, counted where the body fails.
    body_refusals: Arc<BodyRefusals>,
    request_ids: RequestIds,
    /// Bounds the per-request log lines: rejections summarised, the others rate-limited.
    log: Arc<RequestLog>,
}

impl Gateway {
    pub fn new(
        policy: Policy,
        store: Store,
        head_limits: HeadLimits,
        metrics: &Metrics,
    ) -> Gateway {
        let unrouted =
            |outcome: Outcome| metrics.requests.with_label_values(&["", outcome.label()]);
        let upstreams = Upstreams::new(metrics.upstream_errors.clone());
        let clients = upstreams.clients_for(&policy);
        Gateway {
            active: ArcSwap::from_pointee(Active { policy, clients }),
            upstreams,
            store: Arc::new(store),
            head_limits,
            unrouted: unrouted(Outcome::NoRoute),
            refused_unrouted: unrouted(Outcome::Refused),
            refusals: metrics.refused.clone(),
            body_refusals: Arc::new(BodyRefusals::new(&metrics.refused)),
            request_ids: RequestIds::new(),
            log: RequestLog::start(),
        }
    }

    /// The gateway's per-request log, to write its last report at shutdown.
    pub fn request_log(&self) -> Arc<RequestLog> {
        Arc::clone(&self.log)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Puts `policy` in force for every request that starts from now on.
    pub fn install(&self, policy: Policy) {
        let clients = self.upstreams.clients_for(&policy);
        self.active.store(Arc::new(Active { policy, clients }));
    }

    /// The policy in force now (for the admin API); held, it stays valid across a reload.
    pub fn policy(&self) -> PolicySnapshot {
        PolicySnapshot(self.active.load_full())
    }

    /// Whether some limited route answers 503 when the store cannot decide.
    pub fn refuses_without_store(&self) -> bool {
        self.active
            .load()
            .policy
            .routes
            .iter()
            .any(|route| !route.limits.is_empty() && route.on_store_error == OnStoreError::Deny)
    }

    /// Answers one request; every answer carries the request's id.
    pub async fn handle(
        &self,
        request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let request_id = self.request_ids.id_for(request.headers());
        let mut trace = Trace {
            request_id: request_id.clone(),
            shadow_rejected: String::new(),
        };
        let head = request.method() == http::Method::HEAD;
        let mut response = self
            .answer(request, peer, request_id.clone(), &mut trace)
            .await;
        response.headers_mut().insert(X_REQUEST_ID, request_id);
        // An answer to HEAD has no body (RFC 9110 §9.3.2). hyper drops sluice's own bodies
        // (429, problems) on HTTP/1.1 but sends them on HTTP/2, where the client then resets
        // the stream as malformed.
        if let (true, ProxyBody::Full(body)) = (head, response.body_mut()) {
            *body = None;
        }
        response
    }

    async fn answer(
        &self,
        mut request: Request<Incoming>,
        peer: SocketAddr,
        request_id: HeaderValue,
        trace: &mut Trace,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        if let Err(refused) = harden::admit_head(&mut request, &self.head_limits) {
            self.refused_unrouted.inc();
            self.count_refusal(refused.reason);
            return response::problem(refused.status, &refused.detail, request.uri().path(), &[]);
        }
        let active = self.active.load_full();
        // Before anything reads the request: the router, the limiter and the upstream read
        // the same one.
        if let Err(refused) = one_request::prepare(&mut request, &active.policy) {
            self.refused_unrouted.inc();
            self.count_refusal(refused.reason);
            let path = request.uri().path();
            return response::problem(StatusCode::BAD_REQUEST, &refused.detail, path, &[]);
        }
        // The upstream gets the id too.
        request.headers_mut().insert(X_REQUEST_ID, request_id);
        let Some(route) = active.policy.route(request.method(), request.uri().path()) else {
            self.unrouted.inc();
            return response::problem(
                StatusCode::NOT_FOUND,
                "no route matches this request",
                request.uri().path(),
                &[],
            );
        };
        let (outcome, response) = self
            .handle_routed(&active, route, request, peer, trace)
            .await;
        let elapsed = started.elapsed();
        route.metrics.count(outcome);
        route.metrics.duration.observe(elapsed.as_secs_f64());
        // An access log, off by default (RUST_LOG=sluice::access=debug turns it on); it holds
        // no client identity, like the metrics. Bounded by its budget, not by traffic.
        if tracing::enabled!(target: "sluice::access", tracing::Level::DEBUG)
            && self.log.access.allow()
        {
            tracing::debug!(
                target: "sluice::access",
                route = %route.name,
                outcome = outcome.label(),
                status = response.status().as_u16(),
                micros = elapsed.as_micros() as u64,
                shadow_rejected = %trace.shadow_rejected,
                request_id = trace.id(),
            );
        }
        response
    }

    fn count_refusal(&self, reason: Refusal) {
        self.refusals.with_label_values(&[reason.label()]).inc();
    }

    async fn handle_routed(
        &self,
        active: &Active,
        route: &Route,
        request: Request<Incoming>,
        peer: SocketAddr,
        trace: &mut Trace,
    ) -> (Outcome, Response<ProxyBody>) {
        if let Err(refused) =
            one_request::check_fields(&route.fields, request.uri(), request.headers())
        {
            self.count_refusal(refused.reason);
            let path = request.uri().path();
            return (
                Outcome::ClientError,
                response::problem(StatusCode::BAD_REQUEST, &refused.detail, path, &[]),
            );
        }
        // A declared length over the limit is refused before it costs a decision.
        if let Some(max_body) = route.max_body {
            if request.body().size_hint().lower() > max_body {
                self.count_refusal(Refusal::BodyTooLarge);
                let path = request.uri().path();
                return (
                    Outcome::ClientError,
                    body_problem(BodyFault::TooLarge, route, path),
                );
            }
        }
        let decided = self
            .decide(&active.policy, route, &request, peer, trace)
            .await;
        let admitted = match decided {
            Ok(admitted) => admitted,
            Err(rejection) => return rejection,
        };
        // `on_exceed: delay`: held until the time the store recorded the request at.
        if let Some(admitted) = &admitted {
            if let Err(full) =
                shaping::hold(&self.store, route, admitted, request.uri().path()).await
            {
                return (Outcome::Limited, full);
            }
        }
        let (outcome, mut response) = match &route.action {
            Action::Respond(direct) => (Outcome::Responded, direct_response(direct)),
            Action::Forward(upstream) => {
                // A cheap clone (shared bytes), kept only to name the path in an error.
                let uri = request.uri().clone();
                let result = match active.clients.get(&upstream.name) {
                    Some(client) => {
                        forward::forward(
                            upstream,
                            client,
                            request,
                            peer,
                            route,
                            &self.body_refusals,
                        )
                        .await
                    }
                    // `install` builds a client for every upstream of the policy.
                    None => Err(ForwardError::Other(
                        "no client for this upstream".to_owned(),
                    )),
                };
                match result {
                    Ok(response) => (Outcome::Forwarded, response.map(ProxyBody::Stream)),
                    // Counted by the body when it failed.
                    Err(ForwardError::Body(fault)) => {
                        (Outcome::ClientError, body_problem(fault, route, uri.path()))
                    }
                    Err(err) => {
                        if tracing::enabled!(tracing::Level::WARN)
                            && self.log.upstream_failed.allow()
                        {
                            tracing::warn!(route = %route.name, upstream = %upstream.name, error = %err, request_id = trace.id(), "upstream failed");
                        }
                        (
                            Outcome::UpstreamError,
                            upstream_problem(&err, upstream.name.as_str(), uri.path()),
                        )
                    }
                }
            }
        };
        if let Some(admitted) = &admitted {
            // `count:`: the places of an outcome a limit does not count are given back.
            shaping::give_back_uncounted(&self.store, route, admitted, response.status()).await;
            response::add_rate_limit_fields(
                &mut response,
                route,
                &admitted.limits,
                &admitted.decision,
            );
        }
        (outcome, response)
    }

    /// Decides the route's limits that apply to the request, with those limits. `Ok(None)`:
    /// none applies (or the store failed and the route allows). `Err`: the answer to send
    /// instead of acting (429, or 503 when the store cannot decide). The names of shadow
    /// limits that would have rejected the request are added to `trace.shadow_rejected` (for
    /// the access log), separated by commas.
    async fn decide<'r>(
        &self,
        policy: &Policy,
        route: &'r Route,
        request: &Request<Incoming>,
        peer: SocketAddr,
        trace: &mut Trace,
    ) -> Result<Option<Admitted<'r>>, (Outcome, Response<ProxyBody>)> {
        if route.limits.is_empty() {
            return Ok(None);
        }
        let client_ip = keys::client_ip(
            peer.ip(),
            request.headers(),
            &policy.trusted_proxies,
            policy.forwarded_header,
        );
        let parts = keys::RequestParts {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            client_ip,
        };
        let keys::Applied { limits, checks } = keys::checks(route, &parts);
        if limits.is_empty() {
            return Ok(None);
        }
        let decision = match self.store.decide(&checks).await {
            Ok(decision) => decision,
            Err(err) => {
                // Per request at debug: during an outage the breaker's transitions (warn) and
                // the fallback counters say it once, not once per request.
                if tracing::enabled!(tracing::Level::DEBUG) && self.log.store_failed.allow() {
                    tracing::debug!(route = %route.name, store = self.store.name(), error = %err, action = route.on_store_error.label(), "store failed");
                }
                route.metrics.count_fallback(route.on_store_error);
                match route.on_store_error {
                    OnStoreError::Local => self.store.decide_locally(&checks),
                    OnStoreError::Allow => return Ok(None),
                    OnStoreError::Deny => {
                        return Err((Outcome::StoreError, store_problem(request.uri().path())))
                    }
                }
            }
        };
        for (limit, &rejecting) in limits.iter().zip(&decision.rejecting) {
            if limit.shadow && rejecting {
                limit.metrics.shadow_rejected.inc();
                if !trace.shadow_rejected.is_empty() {
                    trace.shadow_rejected.push(',');
                }
                trace.shadow_rejected.push_str(limit.name.as_str());
            } else if decision.admitted && rejecting {
                limit.metrics.delayed.inc();
            } else if decision.admitted {
                limit.metrics.admitted.inc();
            } else if rejecting {
                limit.metrics.rejected.inc();
            }
        }
        if decision.admitted {
            Ok(Some(Admitted {
                limits,
                checks,
                decision,
            }))
        } else {
            log_rejection(&self.log, route, &limits, &checks, &decision, trace);
            let path = request.uri().path();
            let mut response = response::too_many_requests(route, &limits, &decision, path);
            if grpc::is_grpc(request.headers()) {
                let retry_after = response::ceil_seconds(decision.retry_after).max(1);
                grpc::mark_limited(&mut response, retry_after);
            }
            Err((Outcome::Limited, response))
        }
    }
}

/// What is logged about one request beyond its route and outcome.
pub struct Trace {
    /// Checked to be visible ASCII (see `request_id`), so it always reads as text.
    pub request_id: HeaderValue,
    /// Shadow limits that would have rejected it, comma-separated.
    pub shadow_rejected: String,
}

impl Trace {
    fn id(&self) -> &str {
        self.request_id.to_str().unwrap_or("-")
    }
}

/// The first rejection of an identity by a limit is logged at once: the route, the limit, a
/// hash of the identity (never the identity itself: API keys are secrets), the Retry-After and
/// the request id. Its next rejections are counted and summarised (`crate::log::summary`).
fn log_rejection(
    log: &RequestLog,
    route: &Route,
    limits: &[&Limit],
    checks: &[crate::limiter::Check],
    decision: &Decision,
    trace: &Trace,
) {
    if !tracing::enabled!(target: "sluice::rejected", tracing::Level::INFO) {
        return;
    }
    for ((limit, check), &rejecting) in limits.iter().zip(checks).zip(&decision.rejecting) {
        let subject = || Subject {
            route: route.name.to_string(),
            limit: limit.name.to_string(),
            identity: keys::identity_hash(&check.key),
        };
        if rejecting && !limit.shadow && log.rejections.record(&check.key, subject) {
            tracing::info!(
                target: "sluice::rejected",
                route = %route.name,
                limit = %limit.name,
                identity = %keys::identity_hash(&check.key),
                retry_after = response::ceil_seconds(decision.retry_after).max(1),
                request_id = trace.id(),
                "rejected"
            );
        }
    }
}

fn direct_response(direct: &DirectResponse) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(direct.body.clone()));
    *response.status_mut() = direct.status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, direct.content_type.clone());
    response
}

fn upstream_problem(err: &ForwardError, upstream: &str, path: &str) -> Response<ProxyBody> {
    let status = match err {
        ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
        ForwardError::Connect(_) | ForwardError::Other(_) => StatusCode::BAD_GATEWAY,
        ForwardError::Body(_) => StatusCode::BAD_REQUEST,
    };
    response::problem(status, &err.to_string(), path, &[("upstream", upstream)])
}

/// The client's body failed: 413 past the route's limit, 408 behind its pace, 400 when it
/// was malformed.
fn body_problem(fault: BodyFault, route: &Route, path: &str) -> Response<ProxyBody> {
    match fault {
        BodyFault::TooLarge => response::problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "the request body is larger than {} bytes, the most this route accepts",
                route.max_body.unwrap_or(u64::MAX)
            ),
            path,
            &[],
        ),
        BodyFault::TooSlow => {
            let pace = &route.body_pace;
            let rate = if pace.min_rate == 0 {
                String::new()
            } else {
                format!(
                    " and, after the first {} ms, at {} bytes a second or more",
                    pace.grace.as_millis(),
                    pace.min_rate
                )
            };
            response::problem(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "the request body came too slowly: it must arrive whole within {} ms{rate}; \
                     it was not forwarded whole",
                    pace.timeout.as_millis()
                ),
                path,
                &[],
            )
        }
        BodyFault::Malformed => response::problem(
            StatusCode::BAD_REQUEST,
            "the request body is malformed or broke off; it was not forwarded whole",
            path,
            &[],
        ),
    }
}

/// The store could not decide: refuse rather than admit unchecked, and ask for a short wait.
fn store_problem(path: &str) -> Response<ProxyBody> {
    let mut response = response::problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "the rate-limit store is unavailable; the request was not forwarded",
        path,
        &[],
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}
