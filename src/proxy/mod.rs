//! The gateway: the acting side of a request's path. `crate::request::plan` reads the request
//! and plans it (head, route, identify, plan); here the phases that act on that plan run, one
//! file each, in the order `crate::request` states: `tokens` (a token budget's body and
//! reservation) → `decide` (one store call; on a token route through `switch`, which sends a
//! request only soft budgets refused to their cheaper model and decides it again) → `hold` (`on_exceed: delay`) → act (the
//! upstream side, `upstream`, or the route's direct response) → `give_back` (count by
//! outcome) → the token settlement (`tokens::settle`) → `finish`. A concurrency limit's
//! lease, taken by `decide`, rides with the answer until its last byte (`in_flight`). A phase that cannot go on
//! returns a `Stop`; `finish` completes every answer, sluice's own and the upstream's, in one
//! place, and counts every request once, by route and outcome.
//!
//! The policy in force is a snapshot a request takes at its start; a reload installs a new
//! one (`Gateway::install`) with the clients of its upstreams from a registry that outlives
//! reloads (`upstream::clients`).

mod body_budget;
mod decide;
mod finish;
mod give_back;
mod held;
mod hold;
mod in_flight;
mod request_body;
mod request_id;
mod stop;
mod switch;
mod tokens;
mod unread_body;
mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, Uri};
use hyper::body::Incoming;

use self::decide::Decided;
pub use self::finish::Answered;
use self::finish::Finisher;
use self::request_body::{BodyFault, BodyRefusals, ClientBody, ReadError};
use self::request_id::{RequestIds, X_REQUEST_ID};
pub use self::stop::{Fault, Stop};
use self::upstream::clients::{Clients, Upstreams};
use self::upstream::forward::{self, ForwardError, UpstreamClient};
use self::upstream::grpc;
pub use crate::body::ProxyBody;
use crate::config::OnStoreError;
use crate::limiter::Store;
use crate::log::RequestLog;
use crate::metrics::{Metrics, Outcome};
use crate::policy::{Action, BodyPace, DirectResponse, Policy, Route, Upstream};
use crate::request::{self, HeadLimits, Now};
use bytes::Bytes;

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
    /// `sluice_refused_requests_total` of the faults of a request body, counted where the
    /// body fails.
    body_refusals: Arc<BodyRefusals>,
    request_ids: RequestIds,
    /// The bytes bodies read whole may hold, across the process, and the most streams of one
    /// HTTP/2 connection reading one (`server.token_body_budget`, `token_bodies_per_connection`).
    body_budget: Arc<body_budget::BodyBudget>,
    /// `sluice_jwt_invalid_total`, counted by the identify phase.
    jwt_invalid: prometheus::IntCounterVec,
    /// Requests waiting for a concurrency limit's place, by key (`in_flight`).
    waiting: in_flight::Waiting,
    finisher: Finisher,
    /// Where the thresholds a decision crossed go (`notify`): a bounded queue, never waited on.
    notifier: crate::notify::Notifier,
}

impl Gateway {
    pub fn new(
        policy: Policy,
        store: Store,
        server: &crate::config::ServerConfig,
        metrics: &Metrics,
    ) -> Gateway {
        let upstreams = Upstreams::new(metrics.traffic.upstream_errors.clone());
        let clients = upstreams.clients_for(&policy);
        Gateway {
            active: ArcSwap::from_pointee(Active { policy, clients }),
            upstreams,
            store: Arc::new(store),
            head_limits: HeadLimits::new(server),
            body_budget: body_budget::BodyBudget::new(
                server.token_body_budget.0,
                server.token_bodies_per_connection.0,
            ),
            body_refusals: Arc::new(BodyRefusals::new(&metrics.traffic.refused)),
            request_ids: RequestIds::new(),
            jwt_invalid: metrics.jwt.jwt_invalid.clone(),
            waiting: in_flight::Waiting::default(),
            notifier: crate::notify::Notifier::off(metrics),
            finisher: Finisher::new(metrics),
        }
    }

    /// The gateway, sending the thresholds its decisions cross to `notifier` (`webhook:`).
    pub fn notifying(self, notifier: crate::notify::Notifier) -> Gateway {
        Gateway { notifier, ..self }
    }

    /// The gateway's per-request log, to write its last report at shutdown.
    pub fn request_log(&self) -> Arc<RequestLog> {
        Arc::clone(&self.finisher.log)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The store, shared with the rate limit service (`crate::rls`).
    pub fn shared_store(&self) -> Arc<Store> {
        Arc::clone(&self.store)
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

    /// Answers one request: its phases in order, each returning data or a `Stop`, then
    /// `finish`, the one place that completes every answer.
    pub async fn handle<B: ForwardBody>(
        &self,
        request: Request<B>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let active = self.active.load_full();
        let mut exchange = Exchange::start(&request, &self.request_ids);
        let result = self.run(&active, &mut exchange, request, peer).await;
        self.finisher.finish(exchange, result)
    }

    async fn run<'r, B: ForwardBody>(
        &self,
        active: &'r Active,
        exchange: &mut Exchange<'r>,
        sent: Request<B>,
        peer: SocketAddr,
    ) -> Result<Answered, Stop> {
        let (mut head, body) = sent.into_parts();
        let planned = request::plan(
            &active.policy,
            &self.head_limits,
            &mut head,
            body.size_hint().lower(),
            peer.ip(),
            Now::read(),
        );
        exchange.instance = head.uri.clone();
        let planned = match planned {
            Ok(planned) => planned,
            Err(refused) => {
                exchange.route = refused.route;
                if let (Some(route), request::Why::Unauthenticated(reason)) =
                    (refused.route, &refused.why)
                {
                    self.count_invalid(route, *reason);
                }
                let body = ClientBody::Streaming(body);
                return exchange
                    .refuse(head.version, body, refused.why.into())
                    .await;
            }
        };
        let request::Planned {
            route,
            claims,
            invalid,
            mut plan,
        } = planned;
        exchange.route = Some(route);
        if let Some(reason) = invalid {
            self.count_invalid(route, reason);
        }
        // The upstream gets the id too.
        head.headers
            .insert(X_REQUEST_ID, exchange.request_id.clone());
        let mut model = None;
        let mut body = match tokens::read_limit(route, &plan) {
            None => ClientBody::Streaming(body),
            Some(limit) => {
                // Boxed, like the token settlement below: only routes with a token budget
                // take these steps, and inline their future would make every request's as
                // large.
                let read =
                    tokens::check_and_read(self, route, &plan, limit, &mut head, body, exchange);
                let body = Box::pin(read).await?;
                // Planned again now that the body is read: the limits on its `model`, and
                // each calendar quota's period at the decision's time, not the head's.
                model = tokens::body_model(&plan, &body)?;
                plan = request::checks::with_body(
                    &active.policy,
                    route,
                    &head,
                    peer.ip(),
                    claims.as_ref(),
                    model.as_deref(),
                    Now::read().calendar,
                );
                body
            }
        };
        let decided = async {
            // On a token route, a soft limit may switch the request to another model and
            // decide it again (`switch`).
            let again = switch::Replan {
                policy: &active.policy,
                route,
                peer: peer.ip(),
                claims: claims.as_ref(),
                model: model.as_deref(),
            };
            let decide =
                switch::reserve_and_decide(self, &again, plan, &mut head, &mut body, exchange);
            let prices = decide.await?;
            if let Some(decided) = &exchange.decided {
                hold::hold(&self.store, route, decided).await?;
            }
            Ok(prices)
        }
        .await;
        let prices = match decided {
            Ok(prices) => prices,
            Err(stop) => {
                // A request admitted, then refused (held too long): its places are free
                // before the answer goes, as for any request that ends.
                if let Some(lease) = exchange.decided.as_ref().and_then(|d| d.lease.clone()) {
                    Box::pin(lease.0.end()).await;
                }
                return exchange.refuse(head.version, body, stop).await;
            }
        };
        let lease = exchange.decided.as_ref().and_then(|d| d.lease.clone());
        let mut acted = match &lease {
            None => {
                let request = Request::from_parts(head, body);
                self.act(active, route, request, peer, &mut exchange.connection)
                    .await
            }
            // Boxed: only a request holding a lease takes this branch.
            Some(lease) => {
                if upstream::tunnel::asks_websocket(head.version, &head.headers) {
                    // The tunnel holds it until it closes.
                    head.extensions.insert(lease.clone());
                }
                let request = Request::from_parts(head, body);
                let act = self.act(active, route, request, peer, &mut exchange.connection);
                let lost = lease.0.lost();
                Box::pin(async {
                    tokio::select! {
                        acted = act => acted,
                        // The store will give its place to another request.
                        () = lost => Err(Stop::LeaseLost),
                    }
                })
                .await
            }
        };
        if let Some(decided) = &exchange.decided {
            let status = match &acted {
                Ok(answered) => answered.response.status(),
                Err(stop) => stop.status(),
            };
            give_back::give_back_uncounted(&self.store, route, decided, status).await;
            if route.limits.iter().any(|limit| limit.tokens.is_some()) {
                acted =
                    Box::pin(tokens::settle(&self.store, decided, acted, prices.as_ref())).await;
            }
        }
        // A WebSocket's 101 has no body to hold it: its tunnel does.
        let switched = |a: &Answered| a.response.status() == http::StatusCode::SWITCHING_PROTOCOLS;
        if let (Some(lease), Err(_)) = (&lease, &acted) {
            // No answer of the upstream's to hold the lease: free before sluice's own goes.
            Box::pin(lease.0.end()).await;
        }
        if let (Some(lease), Ok(answered)) = (lease, &mut acted) {
            if switched(answered) {
                return acted;
            }
            let body =
                std::mem::replace(answered.response.body_mut(), ProxyBody::full(Bytes::new()));
            *answered.response.body_mut() = in_flight::LeasedBody::wrap(body, lease);
        }
        acted
    }

    /// Counts a token that was not taken (`sluice_jwt_invalid_total`), by route and reason.
    fn count_invalid(&self, route: &Route, reason: crate::jwt::Invalid) {
        self.jwt_invalid
            .with_label_values(&[route.name.as_str(), reason.label()])
            .inc();
    }

    /// The route's action: forward to its upstream, or its direct response. `connection`
    /// learns whether the client's connection can carry the next request after the answer.
    async fn act<B: ForwardBody>(
        &self,
        active: &Active,
        route: &Route,
        request: Request<ClientBody<B>>,
        peer: SocketAddr,
        connection: &mut unread_body::Connection,
    ) -> Result<Answered, Stop> {
        let upstream = match &route.action {
            Action::Respond(direct) => {
                let (head, body) = request.into_parts();
                let waits = unread_body::expects_continue(head.version, &head.headers);
                *connection = unread_body::drop_unread(head.version, body, waits).await;
                return Ok(Answered {
                    outcome: Outcome::Responded,
                    response: direct_response(direct),
                });
            }
            Action::Forward(upstream) => upstream,
        };
        // `install` builds a client for every upstream of the policy.
        let client = active
            .clients
            .get(&upstream.name)
            .ok_or(Stop::Internal("no client for this upstream"))?;
        // Awaited where it is made: a future bound to a name first takes its room twice in
        // this one (and it is the largest part of a request's future).
        let (forwarded, after) =
            B::forward(upstream, client, request, peer, route, &self.body_refusals).await;
        *connection = after;
        match forwarded {
            Ok(response) => Ok(Answered {
                outcome: Outcome::Forwarded,
                response,
            }),
            // Counted by the body when it failed.
            Err(ForwardError::Body(fault)) => Err(Stop::Body(fault)),
            Err(error) => Err(Stop::Upstream {
                error,
                upstream: upstream.name.clone(),
            }),
        }
    }
}

/// An upstream's answer, or why there is none.
pub type Forwarded = Result<Response<ProxyBody>, ForwardError>;

/// A request body the act phase can send to an upstream: hyper's, read from a client's
/// connection. The phases before it never read a body, so they run on any body type; the
/// in-process tests of the phases use one that has no upstream to go to.
pub trait ForwardBody: http_body::Body + Send + Sized + 'static {
    fn forward<'a>(
        upstream: &'a Upstream,
        client: &'a UpstreamClient,
        request: Request<ClientBody<Self>>,
        peer: SocketAddr,
        route: &'a Route,
        refusals: &'a Arc<BodyRefusals>,
    ) -> impl Future<Output = (Forwarded, unread_body::Connection)> + Send + 'a;

    /// Reads the body whole, within `limit` bytes and `pace` (a fault counted in
    /// `refusals`) and the bytes `held` may grow to, for a route that must see it before
    /// deciding.
    fn read_whole(
        self,
        limit: u64,
        pace: BodyPace,
        refusals: Arc<BodyRefusals>,
        held: &mut body_budget::Held,
    ) -> impl Future<Output = Result<Bytes, ReadError>> + Send;
}

impl ForwardBody for Incoming {
    async fn forward<'a>(
        upstream: &'a Upstream,
        client: &'a UpstreamClient,
        request: Request<ClientBody<Incoming>>,
        peer: SocketAddr,
        route: &'a Route,
        refusals: &'a Arc<BodyRefusals>,
    ) -> (Forwarded, unread_body::Connection) {
        let (forwarded, connection) =
            forward::forward(upstream, client, request, peer, route, refusals).await;
        (
            forwarded.map(|response| response.map(ProxyBody::stream)),
            connection,
        )
    }

    async fn read_whole(
        self,
        limit: u64,
        pace: BodyPace,
        refusals: Arc<BodyRefusals>,
        held: &mut body_budget::Held,
    ) -> Result<Bytes, ReadError> {
        request_body::read_whole(self, limit, pace, refusals, held).await
    }
}

/// What the phases of one request learn, for the phases after them and for `finish`.
pub struct Exchange<'r> {
    started: Instant,
    /// Checked to be visible ASCII (see `request_id`), so it always reads as text.
    request_id: HeaderValue,
    head_only: bool,
    /// A gRPC call: a 429 gets gRPC's status too.
    grpc: bool,
    /// The request's URI, canonical once the head is read: the `instance` of a problem.
    instance: Uri,
    route: Option<&'r Route>,
    decided: Option<Decided<'r>>,
    /// Shadow limits that would have rejected the request, comma-separated (access log).
    shadow_rejected: String,
    /// Whether a refused request's connection can carry the next one (`unread_body`).
    connection: unread_body::Connection,
    /// The client waits for `100 Continue` before its body: a refusal answers at once.
    expects_continue: bool,
    /// `sluice-model-switched` for the answer: a soft limit sent the request to another
    /// model (`switch`).
    switched: Option<HeaderValue>,
}

impl Exchange<'_> {
    fn start<B>(request: &Request<B>, request_ids: &RequestIds) -> Self {
        Exchange {
            started: Instant::now(),
            request_id: request_ids.id_for(request.headers()),
            head_only: request.method() == Method::HEAD,
            grpc: grpc::is_grpc(request.headers()),
            instance: request.uri().clone(),
            route: None,
            decided: None,
            shadow_rejected: String::new(),
            connection: unread_body::Connection::Kept,
            expects_continue: unread_body::expects_continue(request.version(), request.headers()),
            switched: None,
        }
    }

    fn id(&self) -> &str {
        self.request_id.to_str().unwrap_or("-")
    }

    /// Refuses the request with `stop`, its body unread: a refusal reads and drops a small
    /// body first, and learns whether its connection can carry the next request
    /// (`unread_body`). Every refusal before the act phase goes through here.
    async fn refuse<B: ForwardBody, T>(
        &mut self,
        version: http::Version,
        body: ClientBody<B>,
        stop: Stop,
    ) -> Result<T, Stop> {
        self.connection = unread_body::drop_unread(version, body, self.expects_continue).await;
        Err(stop)
    }

    fn note_shadow_rejection(&mut self, limit: &str) {
        if !self.shadow_rejected.is_empty() {
            self.shadow_rejected.push(',');
        }
        self.shadow_rejected.push_str(limit);
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

#[cfg(test)]
mod tests;
