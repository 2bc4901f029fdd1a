//! The token flow of a route with a token budget (`tokens:`), around the phases: its body is
//! read whole (within the route's bounds) after `plan`, each token limit's check costs the
//! reservation `llm::estimate` bounds from those bytes, and the same bytes are forwarded (one
//! request, one meaning). After the upstream answers, the reservation is settled to what the
//! answer says it used (`llm::usage`, or a header): the body streams through a scanner that
//! settles before it lets the end of the answer go, so a client that reads the answer and
//! sends its next request finds the unused tokens back. A compressed answer
//! (`Content-Encoding`) is scanned through a decoder, bounded as `llm::usage::DecodingScanner`
//! says; the client gets the upstream's bytes unchanged.
//!
//! Without a usage figure: no answer from the upstream because it could not be reached (a
//! connect error), or no upstream at all (a direct response) → everything is given back, the
//! upstream spent nothing; the upstream answered (any status) but gave no figure, the client
//! left before the end, the body failed, the upstream timed out → the whole reservation is
//! kept, since the upstream may have spent it. A figure above the reservation is charged:
//! the request's entry grows to it (`Store::settle`), so the window makes that identity wait
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

use super::decide::Decided;
use super::finish::Answered;
use super::forward::ForwardError;
use super::request_body::{BodyRefusals, ClientBody};
use super::stop::Stop;
use super::ForwardBody;
use crate::body::ProxyBody;
use crate::limiter::{Admission, Check, Store};
use crate::llm::usage::DecodingScanner;
use crate::llm::{self, EstimateError, Settle};
use crate::metrics::{Outcome, TokenMetrics};
use crate::plan::Plan;
use crate::policy::Route;

/// The most body bytes to read before deciding, when a token limit applies to the request
/// (`plan`): the smallest of the route's `max_body` and the limits' `reserve.max_body`.
/// `None`: no token limit applies, and the body streams.
pub fn read_limit(route: &Route, plan: &Plan<'_>) -> Option<u64> {
    let limit = plan
        .limits
        .iter()
        .filter_map(|limit| limit.tokens.as_ref())
        .map(|budget| budget.reserve.max_body)
        .min()?;
    Some(route.max_body.map_or(limit, |max| max.min(limit)))
}

/// Reads the body whole, within `limit` bytes and the route's pace, and sets its
/// `Content-Length`.
pub async fn read_body<B: ForwardBody>(
    route: &Route,
    limit: u64,
    head: &mut Parts,
    body: B,
    refusals: &Arc<BodyRefusals>,
) -> Result<ClientBody<B>, Stop> {
    let too_large = || {
        format!(
            "the request body is larger than {limit} bytes, the most this route reads to \
             reserve tokens for it"
        )
    };
    // A declared length over the bound is refused before a byte is read.
    if body.size_hint().lower() > limit {
        return Err(Stop::Refused {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            detail: too_large(),
            reason: crate::metrics::Refusal::BodyTooLarge,
        });
    }
    let bytes = match body
        .read_whole(limit, route.body_pace, Arc::clone(refusals))
        .await
    {
        Ok(bytes) => bytes,
        Err(super::BodyFault::TooLarge) => {
            return Err(Stop::Unreservable {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                detail: too_large(),
            })
        }
        Err(fault) => return Err(Stop::Body(fault)),
    };
    // The upstream gets these bytes, framed by their length: whatever framing the client
    // used, and without waiting for a `100 Continue` that sluice has already answered.
    head.headers.remove(TRANSFER_ENCODING);
    head.headers.remove(EXPECT);
    head.headers
        .insert(CONTENT_LENGTH, HeaderValue::from(bytes.len() as u64));
    Ok(ClientBody::Read(bytes))
}

/// Sets the cost of each token limit's check to the reservation of `body`. Refuses a body
/// that cannot be reserved for (400), a cap above the limit's `max_output`, and a reservation
/// that alone exceeds the limit, which no wait could ever admit (413).
pub fn reserve<B>(plan: &mut Plan<'_>, body: &ClientBody<B>) -> Result<(), Stop> {
    let ClientBody::Read(bytes) = body else {
        return Ok(());
    };
    for (limit, check) in plan.limits.iter().zip(plan.checks.iter_mut()) {
        let Some(budget) = &limit.tokens else {
            continue;
        };
        let reservation = llm::estimate(bytes, &budget.reserve).map_err(|err| {
            let status = match err {
                EstimateError::CapTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                _ => StatusCode::BAD_REQUEST,
            };
            Stop::Unreservable {
                status,
                detail: format!("limit `{}`: {err}", limit.name),
            }
        })?;
        let cost = u32::try_from(reservation.total).unwrap_or(u32::MAX);
        if cost > check.spec.requests {
            return Err(Stop::Unreservable {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                detail: format!(
                    "limit `{}` allows {} tokens per {} s and this request reserves {} \
                     ({} of body bytes bounding the prompt, {} for {} non-text parts, {} of \
                     output cap, {} per request): it can never fit; send a smaller request or \
                     a lower output cap",
                    limit.name,
                    check.spec.requests,
                    check.spec.window.as_secs(),
                    reservation.total,
                    reservation.prompt,
                    reservation.non_text_parts * u64::from(budget.reserve.per_non_text_part),
                    reservation.non_text_parts,
                    reservation.output,
                    budget.reserve.per_request,
                ),
            });
        }
        check.spec.cost = cost;
    }
    Ok(())
}

/// One token limit of an admitted request: its check (its cost the reservation) and counters.
struct Reserved {
    check: Check,
    metrics: Option<TokenMetrics>,
}

/// The reservations of the request's token limits that settle the same way.
struct Settlement {
    store: Arc<Store>,
    admission: Admission,
    reserved: Vec<Reserved>,
}

impl Settlement {
    /// Settles every reservation to `used` tokens (`None`: no figure, keep them all).
    async fn settle(self, used: Option<u64>) {
        let Some(used) = used else {
            self.keep();
            return;
        };
        let used = u32::try_from(used).unwrap_or(u32::MAX);
        for reserved in &self.reserved {
            let cost = reserved.check.spec.cost;
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
        }
        // Less than reserved is given back, more is charged (an overrun).
        let checks: Vec<Check> = self
            .reserved
            .iter()
            .filter(|r| used != r.check.spec.cost)
            .map(|r| r.check.clone())
            .collect();
        if checks.is_empty() {
            return;
        }
        if let Err(err) = self.store.settle(&checks, &self.admission, used).await {
            // The tokens stay reserved until they leave the window: the limit under-admits
            // meanwhile, never over-admits.
            tracing::debug!(store = self.store.name(), error = %err, "cannot settle a token reservation");
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

/// Settles the request's token reservations by what `acted` says: at once for a connect
/// error, a direct response or a header figure; as the body ends for a usage figure.
pub async fn settle(
    store: &Arc<Store>,
    decided: &Decided<'_>,
    acted: Result<Answered, Stop>,
) -> Result<Answered, Stop> {
    let Some(admission) = decided.decision.admission.as_ref() else {
        return acted;
    };
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
        };
        match &budget.settle {
            Settle::Header(name) => by_header.push((reserved, name)),
            Settle::Usage => by_usage.push(reserved),
        }
    }
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
            .map(|(r, _)| Reserved {
                check: r.check.clone(),
                metrics: r.metrics.clone(),
            })
            .chain(by_usage.iter().map(|r| Reserved {
                check: r.check.clone(),
                metrics: r.metrics.clone(),
            }))
            .collect::<Vec<_>>()
    };
    let mut answered = match acted {
        Ok(answered) if answered.outcome == Outcome::Forwarded => answered,
        // No upstream was asked (a direct response), or it could not be reached: nothing
        // was spent.
        Ok(answered) => {
            settlement(all()).settle(Some(0)).await;
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
                settlement.settle(Some(0)).await;
            } else {
                settlement.keep();
            }
            return Err(stop);
        }
    };
    for (reserved, name) in by_header {
        let used = answered
            .response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .and_then(|text| text.trim().parse::<u64>().ok());
        settlement(vec![reserved]).settle(used).await;
    }
    if !by_usage.is_empty() {
        // A compressed answer is read through a decoder; the client gets its bytes as sent.
        let headers = answered.response.headers();
        let scanner = DecodingScanner::new(
            headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes),
            headers.get(CONTENT_ENCODING).map(HeaderValue::as_bytes),
        );
        let settlement = settlement(by_usage);
        let body = std::mem::replace(answered.response.body_mut(), ProxyBody::full(Bytes::new()));
        *answered.response.body_mut() = ProxyBody::stream(SettlingBody {
            inner: body,
            scanner,
            settlement: Some(settlement),
            settling: None,
            held: None,
            done: false,
        });
    }
    Ok(answered)
}

/// An answer's body on its way to the client, frame by frame as it arrives, read by a usage
/// scanner; when the upstream's body ends, the reservation is settled before the last frame
/// (or, when the end is only known after it, the end of the stream) goes to the client.
struct SettlingBody {
    inner: ProxyBody,
    scanner: DecodingScanner,
    /// Until the body ends; dropped unsettled (client gone, body failed): kept whole.
    settlement: Option<Settlement>,
    settling: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The last frame, let go once the settlement is done.
    held: Option<Frame<Bytes>>,
    done: bool,
}

impl SettlingBody {
    fn start_settling(&mut self) {
        if let Some(settlement) = self.settlement.take() {
            let used = self.scanner.used();
            self.settling = Some(Box::pin(settlement.settle(used)));
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
                this.done = true;
            }
            if this.done {
                return Poll::Ready(this.held.take().map(Ok));
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        this.scanner.feed(data);
                    }
                    if !this.inner.is_end_stream() {
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    // A client that knows the length has the whole answer with this frame.
                    this.held = Some(frame);
                    this.start_settling();
                }
                Some(Err(err)) => {
                    if let Some(settlement) = this.settlement.take() {
                        settlement.keep();
                    }
                    this.done = true;
                    return Poll::Ready(Some(Err(err)));
                }
                None => this.start_settling(),
            }
            if this.settling.is_none() {
                this.done = true;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.held.is_none()
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
