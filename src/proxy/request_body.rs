//! The client's request body on its way to the upstream, streamed frame by frame, never
//! collected whole, and held to the route's size limit and pace.
//!
//! A request body fails where it breaks a bound, whoever is reading it: while the gateway
//! still waits for the upstream's answer (the client then gets 400, 413 or 408), or after the
//! upstream has answered, when the client's hyper connection is still sending it. Failing it
//! there aborts the upstream request, which frees the upstream connection, and drops the
//! client's body, so the client's connection closes once its response is written (an HTTP/2
//! stream is reset instead); that response says so, as does any answer that comes before the
//! client's body was read to its end (`BodyProgress`, `unread_body::after_reading`). So every
//! fault is counted here, once, when it happens.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use prometheus::{IntCounter, IntCounterVec};

use super::body_budget::Held;
use crate::metrics::Refusal;
use crate::policy::BodyPace;

/// What went wrong with a client's request body while it streamed to the upstream: the
/// client's fault, answered 400 or 413, never counted against the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyFault {
    #[error("the request body is malformed or broke off")]
    Malformed,
    #[error("the request body is larger than this route accepts")]
    TooLarge,
    #[error("the request body arrived too slowly")]
    TooSlow,
}

/// `sluice_refused_requests_total` of each body fault, looked up once.
pub struct BodyRefusals {
    malformed: IntCounter,
    too_large: IntCounter,
    too_slow: IntCounter,
}

impl BodyRefusals {
    /// `refused`: `sluice_refused_requests_total`.
    pub fn new(refused: &IntCounterVec) -> BodyRefusals {
        let counter = |reason: Refusal| refused.with_label_values(&[reason.label()]);
        BodyRefusals {
            malformed: counter(Refusal::BodyMalformed),
            too_large: counter(Refusal::BodyTooLarge),
            too_slow: counter(Refusal::BodySlow),
        }
    }

    fn count(&self, fault: BodyFault) {
        match fault {
            BodyFault::Malformed => &self.malformed,
            BodyFault::TooLarge => &self.too_large,
            BodyFault::TooSlow => &self.too_slow,
        }
        .inc();
    }
}

/// A client's body as the act phase gets it: still to stream, or already read whole (a route
/// with a token budget reads it to reserve for it, and forwards exactly those bytes).
pub enum ClientBody<B> {
    Streaming(B),
    Read(ReadWhole),
}

/// A body read whole, with its share of the process's `token_body_budget`, given back when
/// the body is dropped: once forwarded, or with a refused request.
pub struct ReadWhole {
    pub bytes: Bytes,
    held: Option<Held>,
}

impl ReadWhole {
    pub fn new(bytes: Bytes, held: Option<Held>) -> ReadWhole {
        ReadWhole { bytes, held }
    }
}

/// Where a forwarded body's bytes come from.
enum Source {
    Streaming(Incoming),
    /// Read whole before the decision, within the route's bounds: sent as one frame; its
    /// share of the budget is held until this body is dropped.
    Read {
        bytes: Option<Bytes>,
        _held: Option<Held>,
    },
}

/// Why a body could not be read whole: its own fault, or no room left in the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    Body(BodyFault),
    Budget,
}

/// What the gateway learns of a body it has handed to the upstream client: the fault it
/// failed on, and whether the client's body was read to its end. Shared with the body, which
/// the upstream client owns and drops.
#[derive(Default)]
pub struct BodyProgress {
    fault: OnceLock<BodyFault>,
    /// Set once the client's body has been read to its end (or was read whole before).
    read: AtomicBool,
}

impl BodyProgress {
    /// Why the body failed, if it did.
    pub fn fault(&self) -> Option<BodyFault> {
        self.fault.get().copied()
    }

    /// Whether the client's body has been read to its end: until then, an answer leaves part
    /// of it on the client's connection (see `unread_body`).
    pub fn read_to_end(&self) -> bool {
        self.read.load(Ordering::Acquire)
    }

    fn note_end(&self) {
        self.read.store(true, Ordering::Release);
    }
}

/// A client's request body on its way to the upstream, counted as it streams so that it can
/// be cut at the route's `max_body` or when it falls behind the route's pace, and remembering
/// a fault for the gateway to answer.
pub struct RequestBody {
    inner: Source,
    limit: u64,
    received: u64,
    pace: BodyPace,
    /// When the body was first asked for: with `Expect: 100-continue` a client sends nothing
    /// before, and a request held by shaping has not been read yet.
    started: Option<Instant>,
    /// Wakes the reader when the body falls due; made the first time the body has to wait.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    progress: Arc<BodyProgress>,
    refusals: Arc<BodyRefusals>,
}

impl RequestBody {
    /// `limit`: the most bytes forwarded (`u64::MAX` for no limit). The returned progress
    /// tells the gateway why the forward failed, if the body did, and whether the client's
    /// body was read to its end.
    pub fn new(
        inner: ClientBody<Incoming>,
        limit: u64,
        pace: BodyPace,
        refusals: Arc<BodyRefusals>,
    ) -> (RequestBody, Arc<BodyProgress>) {
        let progress = Arc::new(BodyProgress::default());
        let inner = match inner {
            ClientBody::Streaming(incoming) => {
                // An empty body (most GETs) is never polled.
                if incoming.is_end_stream() {
                    progress.note_end();
                }
                Source::Streaming(incoming)
            }
            ClientBody::Read(read) => {
                progress.note_end();
                Source::Read {
                    bytes: Some(read.bytes).filter(|b| !b.is_empty()),
                    _held: read.held,
                }
            }
        };
        let body = RequestBody {
            inner,
            limit,
            received: 0,
            pace,
            started: None,
            timer: None,
            progress: Arc::clone(&progress),
            refusals,
        };
        (body, progress)
    }

    fn fail(&self, fault: BodyFault) -> Poll<Option<Result<Frame<Bytes>, BodyFault>>> {
        if self.progress.fault.set(fault).is_ok() {
            self.refusals.count(fault);
        }
        Poll::Ready(Some(Err(fault)))
    }

    /// The body has nothing new: whether it is now too late, else a wake-up at its due time.
    fn overdue(&mut self, started: Instant, cx: &mut Context<'_>) -> bool {
        let due = self.pace.due(started, self.received);
        if Instant::now() >= due {
            return true;
        }
        let due = tokio::time::Instant::from_std(due);
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if timer.deadline() != due {
            timer.as_mut().reset(due);
        }
        timer.as_mut().poll(cx).is_ready()
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyFault;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyFault>>> {
        let this = self.get_mut();
        let incoming = match &mut this.inner {
            Source::Streaming(incoming) => incoming,
            Source::Read { bytes, .. } => {
                return Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b))))
            }
        };
        let started = *this.started.get_or_insert_with(Instant::now);
        match Pin::new(&mut *incoming).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received = this.received.saturating_add(data.len() as u64);
                    if this.received > this.limit {
                        return this.fail(BodyFault::TooLarge);
                    }
                }
                // A body of known length ends with its last frame: hyper does not poll
                // it again.
                if incoming.is_end_stream() {
                    this.progress.note_end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => this.fail(BodyFault::Malformed),
            Poll::Ready(None) => {
                this.progress.note_end();
                Poll::Ready(None)
            }
            Poll::Pending if this.overdue(started, cx) => this.fail(BodyFault::TooSlow),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Source::Streaming(incoming) => incoming.is_end_stream(),
            Source::Read { bytes, .. } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Source::Streaming(incoming) => incoming.size_hint(),
            Source::Read { bytes, .. } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

/// Reads a client's body whole, held to `limit` bytes and to `pace`, for a route that must
/// see it before deciding (a token budget). A fault is counted, as when it streams. Each
/// frame's bytes are taken from `held` before they are kept: when the budget has no room,
/// the body is dropped at once (`ReadError::Budget`), so a crowd of bodies that never end
/// pins no more than the budget.
pub async fn read_whole(
    body: Incoming,
    limit: u64,
    pace: BodyPace,
    refusals: Arc<BodyRefusals>,
    held: &mut Held,
) -> Result<Bytes, ReadError> {
    use http_body_util::BodyExt;
    let (mut body, progress) = RequestBody::new(ClientBody::Streaming(body), limit, pace, refusals);
    // The declared length, taken up front (already checked against `limit` by the caller).
    let declared = body.size_hint().lower().min(limit);
    if !held.grow_to(declared) {
        return Err(ReadError::Budget);
    }
    // The budget counts the buffer's capacity, not only its bytes: grown here, by doubling,
    // each growth taken from the budget before it is allocated.
    let mut bytes: Vec<u8> = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(err) => return Err(ReadError::Body(progress.fault().unwrap_or(err))),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let needed = bytes.len() + data.len();
        if needed > bytes.capacity() {
            let most = usize::try_from(limit).unwrap_or(usize::MAX).max(needed);
            let capacity = needed.max(bytes.capacity().saturating_mul(2)).min(most);
            if !held.grow_to(capacity as u64) {
                return Err(ReadError::Budget);
            }
            bytes.reserve_exact(capacity - bytes.len());
        }
        bytes.extend_from_slice(&data);
    }
    Ok(Bytes::from(bytes))
}
