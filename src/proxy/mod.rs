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
use std::pin::Pin;
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
use crate::limiter::{LeaseHold, Store};
use crate::llm::Prices;
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

    /// The request's phases, in the order `crate::request` states: `request::plan` (head,
    /// route, identify, plan), then tokens → decide and hold → act → give back and settle →
    /// the lease handed to the answer. A phase that cannot go on returns its `Stop`.
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
                let body = ClientBody::Streaming(body);
                return self
                    .refuse_unplanned(exchange, head.version, body, refused)
                    .await;
            }
        };
        let request::Planned {
            route,
            claims,
            invalid,
            mut plan,
        } = planned;
        self.note_planned(exchange, route, invalid, &mut head);
        // tokens: a token budget's body, read before deciding.
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
        // On a token route, a soft limit may switch the request to another model and decide
        // it again (`switch`).
        let again = switch::Replan {
            policy: &active.policy,
            route,
            peer: peer.ip(),
            claims: claims.as_ref(),
            model: model.as_deref(),
        };
        let prices = match self
            .decide_and_hold(&again, plan, &mut head, &mut body, exchange)
            .await
        {
            Ok(prices) => prices,
            Err(stop) => return exchange.refuse_admitted(head.version, body, stop).await,
        };
        // act: while a concurrency lease is held, only until the store reclaims it.
        let lease = exchange.decided.as_ref().and_then(|d| d.lease.clone());
        let request = Request::from_parts(head, body);
        let connection = &mut exchange.connection;
        let acted = match &lease {
            None => self.act(active, route, request, peer, connection).await,
            Some(lease) => {
                self.act_unless_lost(active, route, request, peer, connection, lease)
                    .await
            }
        };
        let acted = self
            .give_back_and_settle(route, exchange, acted, prices.as_ref())
            .await;
        in_flight::ride_with_answer(lease, acted).await
    }

    /// Refuses a request `request::plan` refused (`refused.why`), counting a token that was
    /// not taken.
    async fn refuse_unplanned<'r, B: ForwardBody>(
        &self,
        exchange: &mut Exchange<'r>,
        version: http::Version,
        body: ClientBody<B>,
        refused: request::Refused<'r>,
    ) -> Result<Answered, Stop> {
        exchange.route = refused.route;
        if let (Some(route), request::Why::Unauthenticated(reason)) = (refused.route, &refused.why)
        {
            self.count_invalid(route, *reason);
        }
        exchange.refuse(version, body, refused.why.into()).await
    }

    /// Notes a planned request's route, counts a token an anonymous route did not take
    /// (`invalid`), and gives the request's id to the upstream too.
    fn note_planned<'r>(
        &self,
        exchange: &mut Exchange<'r>,
        route: &'r Route,
        invalid: Option<crate::jwt::Invalid>,
        head: &mut http::request::Parts,
    ) {
        exchange.route = Some(route);
        if let Some(reason) = invalid {
            self.count_invalid(route, reason);
        }
        head.headers
            .insert(X_REQUEST_ID, exchange.request_id.clone());
    }

    /// The token reservation and the decision in one store call, again at a soft limit's
    /// fallback model if only soft limits refused (`switch::reserve_and_decide`, as `again`
    /// says), then the wait of `on_exceed: delay` (`hold`). Returns the prices the
    /// settlement uses.
    async fn decide_and_hold<'r, B>(
        &self,
        again: &switch::Replan<'_, 'r>,
        plan: request::Plan<'r>,
        head: &mut http::request::Parts,
        body: &mut ClientBody<B>,
        exchange: &mut Exchange<'r>,
    ) -> Result<Option<Prices>, Stop> {
        let decide = switch::reserve_and_decide(self, again, plan, head, body, exchange);
        let prices = decide.await?;
        if let Some(decided) = &exchange.decided {
            hold::hold(&self.store, again.route, decided).await?;
        }
        Ok(prices)
    }

    /// The act phase (`act`) of a request holding a concurrency lease, cut short if the
    /// store reclaims the lease meanwhile. Boxed: only a request holding a lease takes this
    /// way, and inline its future would make every request's larger.
    fn act_unless_lost<'a, B: ForwardBody>(
        &'a self,
        active: &'a Active,
        route: &'a Route,
        mut request: Request<ClientBody<B>>,
        peer: SocketAddr,
        connection: &'a mut unread_body::Connection,
        lease: &LeaseHold,
    ) -> Pin<Box<impl Future<Output = Result<Answered, Stop>> + 'a>> {
        if upstream::tunnel::asks_websocket(request.version(), request.headers()) {
            // The tunnel holds it until it closes.
            request.extensions_mut().insert(lease.clone());
        }
        let act = self.act(active, route, request, peer, connection);
        let lost = lease.0.lost();
        Box::pin(async {
            tokio::select! {
                acted = act => acted,
                // The store will give its place to another request.
                () = lost => Err(Stop::LeaseLost),
            }
        })
    }

    /// Gives back what `count:` does not keep (`give_back`), then settles a token budget at
    /// what the answer reports it used (`tokens::settle`; `prices`: the model's, for a
    /// money limit).
    async fn give_back_and_settle(
        &self,
        route: &Route,
        exchange: &Exchange<'_>,
        acted: Result<Answered, Stop>,
        prices: Option<&Prices>,
    ) -> Result<Answered, Stop> {
        let Some(decided) = &exchange.decided else {
            return acted;
        };
        let status = match &acted {
            Ok(answered) => answered.response.status(),
            Err(stop) => stop.status(),
        };
        give_back::give_back_uncounted(&self.store, route, decided, status).await;
        if !route.limits.iter().any(|limit| limit.tokens.is_some()) {
            return acted;
        }
        Box::pin(tokens::settle(&self.store, decided, acted, prices)).await
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

    /// Refuses a request after its decision (held too long): an admitted request's places
    /// are free before the answer goes, as for any request that ends.
    async fn refuse_admitted<B: ForwardBody, T>(
        &mut self,
        version: http::Version,
        body: ClientBody<B>,
        stop: Stop,
    ) -> Result<T, Stop> {
        if let Some(lease) = self.decided.as_ref().and_then(|d| d.lease.clone()) {
            Box::pin(lease.0.end()).await;
        }
        self.refuse(version, body, stop).await
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
