//! The token flow of a route with a token budget (`tokens:`), around the phases: after `plan`,
//! the store is asked whether each token limit has any room (`check_room`: none, and the body
//! is never read); then its body is read whole (within the route's bounds and the process's
//! `body_budget`), the request is planned again with the body's `model` and the time of the
//! decision (`crate::request::checks::with_body`), each token limit's check costs the reservation
//! `llm::estimate` bounds from those bytes, and the same bytes are forwarded (one request, one
//! meaning). After the upstream answers, the reservation is settled to what the
//! answer says it used (`llm::usage`, or a header): the body streams through a scanner that
//! settles before it lets the end of the answer go, so a client that reads the answer and
//! sends its next request finds the unused tokens back. A compressed answer
//! (`Content-Encoding`) is scanned through a decoder, bounded as `llm::usage::DecodingScanner`
//! says; the client gets the upstream's bytes unchanged.
//!
//! Without a usage figure: no answer from the upstream because it could not be reached (a
//! connect error), or no upstream at all (a direct response) → everything is given back, the
//! upstream spent nothing; the upstream answered `429` (its own rate limit: providers do not
//! bill it) → everything is given back; the upstream answered (any other status) but gave no
//! figure, the client
//! left before the end, the body failed, the upstream timed out → the whole reservation is
//! kept, since the upstream may have spent it. A figure above the reservation is charged:
//! the request's entry grows to it (`Store::keep`), so the window makes that identity wait
//! for what the upstream really spent, and the overrun and its excess tokens are counted.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, EXPECT, TRANSFER_ENCODING};
use http::request::Parts;
use http::{HeaderValue, StatusCode};
use http_body::{Body, Frame, SizeHint};

use std::time::Duration;

use super::body_budget::BodyBudget;
use super::decide::Decided;
use super::finish::Answered;
use super::request_body::{BodyRefusals, ClientBody, ReadError, ReadWhole};
use super::stop::Stop;
use super::unread_body;
use super::upstream::forward::ForwardError;
use super::{Exchange, ForwardBody, Gateway};
use crate::body::ProxyBody;
use crate::limiter::{Admission, Check, Decision, LimitState, Store};
use crate::llm::usage::DecodingScanner;
use crate::llm::{self, estimate, Api, EstimateError, Prices, Unit, Usage, UsageFrom};
use crate::metrics::Refusal;
use crate::metrics::{Outcome, TokenMetrics};
use crate::policy::Route;
use crate::request::Plan;
use crate::server::ConnectionReaders;

/// The most body bytes to read before deciding, when a token limit applies to the request
/// (`plan`, its limits that read the body's `model` included): the smallest of the route's
/// `max_body` and the limits' `reserve.max_body`.
/// `None`: no token limit applies, and the body streams.
pub fn read_limit(route: &Route, plan: &Plan<'_>) -> Option<u64> {
    let limit = plan
        .limits
        .limits()
        .iter()
        .chain(&plan.deferred)
        .filter_map(|limit| limit.tokens.as_ref())
        .map(|budget| budget.reserve.max_body)
        .min()?;
    Some(route.max_body.map_or(limit, |max| max.min(limit)))
}

/// The steps before the decision of a request whose token limits apply (`plan`; `limit`: the
/// most of its body to read, `read_limit`): an upgrade is refused, and so is a request whose
/// token limits have no room at all (`check_room`) or whose body is declared larger than
/// `limit`, each before a byte of the body is read (a small body is read and dropped, so the
/// connection may carry the next request: `Exchange::refuse`); then the body is read whole
/// (`read_body`). A body refused part read leaves the connection to close after the answer.
pub async fn check_and_read<'r, B: ForwardBody>(
    gateway: &Gateway,
    route: &'r Route,
    plan: &Plan<'r>,
    limit: u64,
    head: &mut Parts,
    body: B,
    exchange: &mut Exchange<'r>,
) -> Result<ClientBody<B>, Stop> {
    let declared = body.size_hint().lower();
    let room = match refuse_upgrade(route, head) {
        Ok(()) => check_room(&gateway.store, plan, declared, exchange).await,
        Err(stop) => Err(stop),
    };
    if let Err(stop) = room.and_then(|()| refuse_declared(limit, declared)) {
        let body = ClientBody::Streaming(body);
        return exchange.refuse(head.version, body, stop).await;
    }
    let read = read_body(
        route,
        limit,
        head,
        body,
        &gateway.body_refusals,
        &gateway.body_budget,
    )
    .await;
    read.inspect_err(|_| {
        // Dropped part read: the connection closes after the answer.
        exchange.connection = unread_body::after_reading(head.version, false);
    })
}

/// Refuses a WebSocket upgrade on a route whose token limits apply (501): the tunnel's
/// messages would pass uncounted.
fn refuse_upgrade(route: &Route, head: &Parts) -> Result<(), Stop> {
    if !super::upstream::tunnel::asks_websocket(head.version, &head.headers) {
        return Ok(());
    }
    Err(Stop::Refused {
        status: StatusCode::NOT_IMPLEMENTED,
        detail: format!(
            "route `{}` counts LLM tokens, which a WebSocket's messages would pass uncounted: \
             upgrades are not accepted on it",
            route.name
        ),
        reason: Refusal::TokenUpgrade,
    })
}

/// Refuses a body whose declared length (`declared`) is over `limit`, the most the route
/// reads (413), before a byte of it is read.
fn refuse_declared(limit: u64, declared: u64) -> Result<(), Stop> {
    if declared <= limit {
        return Ok(());
    }
    Err(Stop::Refused {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        detail: body_too_large(limit),
        reason: crate::metrics::Refusal::BodyTooLarge,
    })
}

fn body_too_large(limit: u64) -> String {
    format!(
        "the request body is larger than {limit} bytes, the most this route reads to reserve \
         tokens for it"
    )
}

/// Reads the body whole (its declared length already checked, `refuse_declared`), within
/// `limit` bytes and the route's pace, and sets its `Content-Length`. The bytes held come out
/// of `budget` as they arrive; an HTTP/2 stream also takes a place among its connection's
/// readers (`body_budget`). Either bound reached: 503, the body dropped unread.
async fn read_body<B: ForwardBody>(
    route: &Route,
    limit: u64,
    head: &mut Parts,
    body: B,
    refusals: &Arc<BodyRefusals>,
    budget: &Arc<BodyBudget>,
) -> Result<ClientBody<B>, Stop> {
    // Held while this stream reads; the bytes it keeps are the budget's from then on.
    let _reader = match head.extensions.get::<ConnectionReaders>() {
        None => None,
        Some(readers) => {
            Some(
                readers
                    .enter(budget.per_connection())
                    .ok_or_else(|| Stop::Busy {
                        detail: format!(
                    "this connection already has {} requests whose bodies sluice reads whole \
                     before deciding (server.token_bodies_per_connection); retry when one is \
                     done",
                    budget.per_connection()
                ),
                        reason: Refusal::BodyStreams,
                    })?,
            )
        }
    };
    let mut held = budget.share();
    let bytes = match body
        .read_whole(limit, route.body_pace, Arc::clone(refusals), &mut held)
        .await
    {
        Ok(bytes) => bytes,
        Err(ReadError::Body(super::BodyFault::TooLarge)) => {
            return Err(Stop::Unreservable {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                detail: body_too_large(limit),
            })
        }
        Err(ReadError::Body(fault)) => return Err(Stop::Body(fault)),
        Err(ReadError::Budget) => {
            return Err(Stop::Busy {
                detail: format!(
                    "sluice already holds {} bytes of request bodies it reads whole before \
                     deciding (server.token_body_budget); retry shortly",
                    budget.limit()
                ),
                reason: Refusal::BodyBudget,
            })
        }
    };
    // The upstream gets these bytes, framed by their length: whatever framing the client
    // used, and without waiting for a `100 Continue` that sluice has already answered.
    head.headers.remove(TRANSFER_ENCODING);
    head.headers.remove(EXPECT);
    head.headers
        .insert(CONTENT_LENGTH, HeaderValue::from(bytes.len() as u64));
    Ok(ClientBody::Read(ReadWhole::new(bytes, Some(held))))
}

/// Before a byte of the body is read: whether each token limit the plan checks (those whose
/// key and conditions do not read the body) has any room at all, asked of the store without
/// recording anything. One without: the request is refused here, with the RateLimit fields
/// and `Retry-After` of a rejection, and its body is never read, so an exhausted or invented
/// identity cannot make sluice hold its bodies. It asks for room for the least the request
/// will reserve: a token limit reserves at least the body's bytes, so a body of declared
/// length `declared` needs that many tokens (one when its length is unknown; one unit of a
/// money limit), and the `Retry-After` of its refusal is the time until those fit, not
/// until one token does (which sent a client that obeyed it back to be refused again). The
/// decision after the body is read stays the one atomic step that admits. A shadow limit,
/// one that delays instead of refusing, and a store that cannot answer are left to it.
async fn check_room<'r>(
    store: &Store,
    plan: &Plan<'r>,
    declared: u64,
    exchange: &mut Exchange<'r>,
) -> Result<(), Stop> {
    let mut states: Vec<Option<LimitState>> = vec![None; plan.limits.len()];
    let mut rejecting = vec![false; plan.limits.len()];
    let mut retry_after = Duration::ZERO;
    for (index, (limit, check)) in plan.limits.iter().enumerate() {
        if limit.tokens.is_none() || limit.spec.shadow || !limit.spec.max_delay.is_zero() {
            continue;
        }
        let least = match limit.tokens.as_ref().map(|budget| &budget.unit) {
            Some(Unit::Tokens) => u32::try_from(declared).unwrap_or(u32::MAX),
            _ => 1,
        };
        let asked = Check {
            key: check.key.clone(),
            spec: crate::limiter::Spec {
                cost: least.clamp(1, check.spec.requests.max(1)),
                ..check.spec
            },
        };
        let Ok((peek, _)) = store.peek(&asked).await else {
            continue;
        };
        states[index] = Some(LimitState {
            remaining: peek.remaining,
            reset: peek.reset,
            overridden: None,
        });
        if !peek.wait.is_zero() {
            rejecting[index] = true;
            retry_after = retry_after.max(peek.wait);
        }
    }
    if !rejecting.contains(&true) {
        return Ok(());
    }
    for ((limit, _), _) in plan.limits.iter().zip(&rejecting).filter(|(_, r)| **r) {
        limit.metrics.rejected.inc();
    }
    exchange.decided = Some(Decided {
        limits: plan.limits.clone(),
        decision: Decision {
            admitted: false,
            retry_after,
            limits: states,
            rejecting,
            admission: None,
            crossed: Vec::new(),
        },
        lease: None,
    });
    Err(Stop::Limited)
}

/// The `model` of a body read whole, for the limits that read it (`plan.deferred`); a body
/// whose model has no single reading is refused (400).
pub fn body_model(plan: &Plan<'_>, body: &ClientBody<impl Sized>) -> Result<Option<String>, Stop> {
    let (false, ClientBody::Read(read)) = (plan.deferred.is_empty(), body) else {
        return Ok(None);
    };
    crate::model::read(&read.bytes).map_err(|err| Stop::Unreservable {
        status: StatusCode::BAD_REQUEST,
        detail: format!("a limit of this route is per model: {err}"),
    })
}

/// Sets the cost of each token limit's check to the reservation of `body` (`llm::estimate`,
/// the API read from the request's path), in the limit's unit: tokens, or micro-currency at
/// the prices of the body's model. When the request names no output cap, writes the smallest
/// cap the limits reserve into the body (and its `Content-Length`), so the upstream cannot
/// generate more than was reserved. Refuses a body that cannot be reserved for (400, 413 or
/// 422 by `EstimateError::status`), a model a money limit cannot price (422), and a
/// reservation that alone exceeds the limit, which no wait could ever admit (413). Returns the
/// model's prices when a money limit applies, for the settlement.
pub fn reserve<B>(
    plan: &mut Plan<'_>,
    head: &mut Parts,
    body: &mut ClientBody<B>,
) -> Result<Option<Prices>, Stop> {
    let ClientBody::Read(ReadWhole { bytes, .. }) = body else {
        return Ok(None);
    };
    let Some(first) = plan
        .limits
        .limits()
        .iter()
        .find(|limit| limit.tokens.is_some())
    else {
        return Ok(None);
    };
    let api = Api::of_path(head.uri.path());
    let refuse = |name: &str, err: EstimateError| Stop::Unreservable {
        status: err.status(),
        detail: format!("limit `{name}`: {err}"),
    };
    let mut fields = estimate::parse(bytes).map_err(|err| refuse(first.name.as_str(), err))?;
    // The cap to write when the request names none: the smallest any limit would reserve.
    let mut write: Option<(&'static str, u64)> = None;
    for limit in plan.limits.limits() {
        let Some(budget) = &limit.tokens else {
            continue;
        };
        let r = llm::estimate(
            api,
            &fields,
            bytes.len() as u64,
            &budget.reserve,
            &budget.models,
        )
        .map_err(|err| refuse(limit.name.as_str(), err))?;
        if let Some(field) = r.write_cap {
            write = Some((field, write.map_or(r.cap, |(_, cap)| cap.min(r.cap))));
        }
    }
    if let Some((field, cap)) = write {
        let written = Bytes::from(estimate::with_cap(fields, field, cap));
        head.headers
            .insert(CONTENT_LENGTH, HeaderValue::from(written.len() as u64));
        *bytes = written;
        fields = estimate::parse(bytes).map_err(|err| refuse(first.name.as_str(), err))?;
    }
    let model = estimate::model_of(&fields);
    let caches = estimate::asks_caching(&fields);
    let mut priced = None;
    for (limit, check) in plan.limits.iter_mut() {
        let Some(budget) = &limit.tokens else {
            continue;
        };
        let reservation = llm::estimate(
            api,
            &fields,
            bytes.len() as u64,
            &budget.reserve,
            &budget.models,
        )
        .map_err(|err| refuse(limit.name.as_str(), err))?;
        let total = match &budget.unit {
            Unit::Tokens => reservation.total,
            Unit::Money { currency, .. } => {
                let prices = budget
                    .models
                    .lookup(model)
                    .prices
                    .as_ref()
                    .filter(|p| &p.currency == currency)
                    .ok_or_else(|| Stop::Unreservable {
                        status: StatusCode::UNPROCESSABLE_ENTITY,
                        detail: format!(
                            "limit `{}` counts {currency} and `models:` gives no prices in \
                             {currency} for model `{}`: this request cannot be priced",
                            limit.name,
                            model.unwrap_or("(none named)")
                        ),
                    })?;
                priced = Some(prices.clone());
                reservation.price(prices, caches)
            }
        };
        let cost = u32::try_from(total).unwrap_or(u32::MAX);
        if cost > check.spec.requests {
            return Err(Stop::Unreservable {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                detail: too_large(limit, check, budget, &reservation, total),
            });
        }
        check.spec.cost = cost;
    }
    Ok(priced)
}

/// The detail of a reservation that can never fit its limit: each term of the bound.
fn too_large(
    limit: &crate::policy::Limit,
    check: &Check,
    budget: &llm::TokenBudget,
    r: &llm::Reservation,
    total: u64,
) -> String {
    let unit = budget.unit.label();
    format!(
        "limit `{}` allows {} {unit} per {} s and this request reserves {total} {unit} ({} \
         tokens: {} of body bytes bounding the prompt, {} for {} images, {} for {} other \
         non-text parts, {} per request and tool prompt, {} of stored state, {} for {} server \
         tools, {} of output cap × {} completions): it can never fit; send a smaller request \
         or a lower output cap",
        limit.name,
        check.spec.requests,
        check.spec.window.as_secs(),
        r.total,
        r.prompt,
        r.image_tokens,
        r.images,
        r.part_tokens,
        r.parts,
        r.overhead,
        r.stored,
        r.server_tool_tokens,
        r.server_tools,
        r.cap,
        r.completions,
    )
}

/// One token limit of an admitted request: its check (its cost the reservation), counters,
/// and for a money limit the prices its figure is settled at.
struct Reserved {
    check: Check,
    metrics: Option<TokenMetrics>,
    prices: Option<Prices>,
}

impl Reserved {
    /// What `usage` comes to in this limit's unit: tokens, or micro-currency at its prices.
    fn figure(&self, usage: &Usage) -> Option<u64> {
        match &self.prices {
            None => usage.used(),
            Some(prices) => usage.priced(prices),
        }
    }
}

/// The reservations of the request's token limits that settle the same way.
struct Settlement {
    store: Arc<Store>,
    admission: Admission,
    reserved: Vec<Reserved>,
}

impl Settlement {
    /// Settles every reservation to what `usage` comes to in its unit (`None`, or no figure:
    /// keep it whole).
    async fn settle(self, usage: Option<Usage>) {
        // Checks settled to the same figure go to the store together.
        let mut by_figure: Vec<(u32, Vec<Check>)> = Vec::new();
        for reserved in &self.reserved {
            let cost = reserved.check.spec.cost;
            let Some(used) = usage.as_ref().and_then(|usage| reserved.figure(usage)) else {
                if let Some(metrics) = &reserved.metrics {
                    metrics.settled.inc_by(u64::from(cost));
                }
                continue;
            };
            let used = u32::try_from(used).unwrap_or(u32::MAX);
            if let Some(metrics) = &reserved.metrics {
                metrics.settled.inc_by(u64::from(used));
                metrics
                    .returned
                    .inc_by(u64::from(cost.saturating_sub(used)));
                if used > cost {
                    metrics.overruns.inc();
                    metrics.overrun_tokens.inc_by(u64::from(used - cost));
                }
            }
            // Less than reserved is given back, more is charged (an overrun).
            if used != cost {
                match by_figure.iter_mut().find(|(figure, _)| *figure == used) {
                    Some((_, checks)) => checks.push(reserved.check.clone()),
                    None => by_figure.push((used, vec![reserved.check.clone()])),
                }
            }
        }
        for (used, checks) in by_figure {
            if let Err(err) = self.store.keep(&checks, &self.admission, used).await {
                // The tokens stay reserved until they leave the window: the limit
                // under-admits meanwhile, never over-admits.
                tracing::debug!(store = self.store.name(), error = %err, "cannot settle a token reservation");
            }
        }
    }

    /// No figure: the whole reservation stays counted.
    fn keep(&self) {
        for reserved in &self.reserved {
            if let Some(metrics) = &reserved.metrics {
                metrics.settled.inc_by(u64::from(reserved.check.spec.cost));
            }
        }
    }
}

/// Nothing was spent.
const NOTHING: Usage = Usage {
    input: Some(0),
    output: Some(0),
    total: Some(0),
    cached: None,
    cache_write: None,
};

/// Settles the request's token reservations by what `acted` says: at once for a connect
/// error, a direct response or a header figure; as the body ends for a usage figure.
pub async fn settle(
    store: &Arc<Store>,
    decided: &Decided<'_>,
    acted: Result<Answered, Stop>,
    prices: Option<&Prices>,
) -> Result<Answered, Stop> {
    let Some(admission) = decided.decision.admission.as_ref() else {
        return acted;
    };
    let (by_header, by_usage) = reservations(decided, prices);
    if by_header.is_empty() && by_usage.is_empty() {
        return acted;
    }
    let settlement = |reserved: Vec<Reserved>| Settlement {
        store: Arc::clone(store),
        admission: admission.clone(),
        reserved,
    };
    let all = || {
        by_header
            .iter()
            .map(|(r, _)| r)
            .chain(by_usage.iter())
            .map(|r| Reserved {
                check: r.check.clone(),
                metrics: r.metrics.clone(),
                prices: r.prices.clone(),
            })
            .collect::<Vec<_>>()
    };
    let mut answered = match acted {
        Ok(answered) if answered.outcome == Outcome::Forwarded => answered,
        // No upstream was asked (a direct response), or it could not be reached: nothing
        // was spent.
        Ok(answered) => {
            settlement(all()).settle(Some(NOTHING)).await;
            return Ok(answered);
        }
        Err(stop) => {
            let spent_nothing = matches!(
                &stop,
                Stop::Upstream {
                    error: ForwardError::Connect(_),
                    ..
                } | Stop::Internal(_)
            );
            let settlement = settlement(all());
            if spent_nothing {
                settlement.settle(Some(NOTHING)).await;
            } else {
                settlement.keep();
            }
            return Err(stop);
        }
    };
    // The provider refused the request for its own rate limit: providers do not bill a 429,
    // so the reservation is given back whole, at once (a client's retries against a busy
    // upstream would otherwise hold a reservation each until their windows end).
    if answered.response.status() == StatusCode::TOO_MANY_REQUESTS {
        settlement(all()).settle(Some(NOTHING)).await;
        return Ok(answered);
    }
    for (reserved, name) in by_header {
        let used = header_usage(&answered.response, name);
        settlement(vec![reserved]).settle(used).await;
    }
    if !by_usage.is_empty() {
        settle_as_read(&mut answered.response, settlement(by_usage));
    }
    Ok(answered)
}

/// The request's token reservations (`decided`'s recorded token limits), counted as
/// reserved: those settled by a header of the answer, with its name, and those settled by
/// the usage its body reports. A money limit's carry the model's `prices`.
fn reservations<'d>(
    decided: &'d Decided<'_>,
    prices: Option<&Prices>,
) -> (Vec<(Reserved, &'d http::HeaderName)>, Vec<Reserved>) {
    let mut by_header: Vec<(Reserved, &http::HeaderName)> = Vec::new();
    let mut by_usage: Vec<Reserved> = Vec::new();
    for (limit, check) in decided.recorded(|limit| limit.tokens.is_some()) {
        let Some(budget) = &limit.tokens else {
            continue;
        };
        let metrics = limit.metrics.tokens.clone();
        if let Some(metrics) = &metrics {
            metrics.reserved.inc_by(u64::from(check.spec.cost));
        }
        let reserved = Reserved {
            check: check.clone(),
            metrics,
            prices: match budget.unit {
                Unit::Tokens => None,
                Unit::Money { .. } => prices.cloned(),
            },
        };
        match &budget.usage_from {
            UsageFrom::Header(name) => by_header.push((reserved, name)),
            UsageFrom::Usage => by_usage.push(reserved),
        }
    }
    (by_header, by_usage)
}

/// The tokens the answer's header `name` says were used, if it says a whole number.
fn header_usage(response: &http::Response<ProxyBody>, name: &http::HeaderName) -> Option<Usage> {
    response
        .headers()
        .get(name)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.trim().parse::<u64>().ok())
        .map(|total| Usage {
            total: Some(total),
            ..Usage::default()
        })
}

/// Settles `settlement` by the usage the answer's body reports, as the body goes to the
/// client (`SettlingBody`). A compressed answer is read through a decoder; the client gets
/// its bytes as sent.
fn settle_as_read(response: &mut http::Response<ProxyBody>, settlement: Settlement) {
    let headers = response.headers();
    let scanner = DecodingScanner::new(
        headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
        headers.get(CONTENT_ENCODING).map(HeaderValue::as_bytes),
    );
    let body = std::mem::replace(response.body_mut(), ProxyBody::full(Bytes::new()));
    *response.body_mut() = ProxyBody::stream(SettlingBody {
        inner: body,
        scanner,
        settlement: Some(settlement),
        settling: None,
        held: None,
        done: false,
    });
}

/// An answer's body on its way to the client, frame by frame as it arrives, read by a usage
/// scanner; the reservation is settled before the frame that completes the usage goes to the
/// client: a stream's last event (`data: [DONE]`, `message_stop`, `response.completed`),
/// which a client may close on without reading the end of the body (OpenAI's sync Python
/// client does), or else the body's last frame (or, when the end is only known after it, the
/// end of the stream).
struct SettlingBody {
    inner: ProxyBody,
    scanner: DecodingScanner,
    /// Until settled; dropped unsettled (client gone before the usage was whole, body
    /// failed): kept whole.
    settlement: Option<Settlement>,
    settling: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The frame that completed the usage, let go once the settlement is done.
    held: Option<Frame<Bytes>>,
    /// The upstream's body has ended.
    done: bool,
}

impl SettlingBody {
    fn start_settling(&mut self, usage: Option<Usage>) {
        if let Some(settlement) = self.settlement.take() {
            self.settling = Some(Box::pin(settlement.settle(usage)));
        }
    }
}

impl Body for SettlingBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(settling) = &mut this.settling {
                ready!(settling.as_mut().poll(cx));
                this.settling = None;
                if let Some(frame) = this.held.take() {
                    return Poll::Ready(Some(Ok(frame)));
                }
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        this.scanner.feed(data);
                    }
                    // A client that knows the length has the whole answer with this frame.
                    this.done = this.inner.is_end_stream();
                    if this.settlement.is_some() {
                        let usage = if this.done {
                            Some(this.scanner.usage())
                        } else {
                            this.scanner.usage_at_last_event().map(Some)
                        };
                        if let Some(usage) = usage {
                            this.held = Some(frame);
                            this.start_settling(usage);
                            continue;
                        }
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Err(err)) => {
                    if let Some(settlement) = this.settlement.take() {
                        settlement.keep();
                    }
                    this.done = true;
                    return Poll::Ready(Some(Err(err)));
                }
                None => {
                    this.done = true;
                    let usage = this.scanner.usage();
                    this.start_settling(usage);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.held.is_none() && self.settling.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for SettlingBody {
    fn drop(&mut self) {
        // The client left before the end: the upstream may have spent it all.
        if let Some(settlement) = self.settlement.take() {
            settlement.keep();
        }
    }
}
