//! Concurrency limits on the request path: a request a concurrency limit admitted holds its
//! lease (`limiter::Lease`) until its answer's last byte has gone, and a request refused only
//! for want of a place may wait for one (`on_exceed: delay`).
//!
//! The lease rides with the answer: the response body ([`LeasedBody`]) holds it until the
//! body ends or is dropped (the client went away: an HTTP/1 connection closed, an HTTP/2
//! stream reset, a stalled reader cut), a WebSocket tunnel holds it until it closes, and a
//! request that ends before its answer (a refusal after admission, an upstream error or
//! timeout, a drain) drops it where it ends. Every way out is a drop, so every way out
//! releases. A lease the store will reclaim because this instance cannot renew it ends the
//! answer early: a place the store gave to another request is never still in use here.
//!
//! Waiting: the requests of one key waiting on this instance queue in arrival order behind a
//! turn; the one holding the turn asks the store again (at the refusal's hint, within
//! `POLL_MIN`..`POLL_MAX`) until it is admitted or its `max_delay` passes. At most the limit's
//! number of places wait per key and instance; more are refused at once. Across instances
//! there is no order: each instance's first waiter asks in turn.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::Semaphore;

use super::{Answered, Stop};
use crate::body::ProxyBody;
use crate::limiter::{Algorithm, LeaseHold};
use crate::policy::Limit;

/// The shortest and longest gap between two asks of a waiting request.
const POLL_MIN: Duration = Duration::from_millis(10);
const POLL_MAX: Duration = Duration::from_millis(250);

/// An answer's body that holds its request's lease until it ends: the lease is released
/// before the last frame is handed over (or, when the end is only known after it, before the
/// end of the stream), so a client that sends its next request the moment it has this answer
/// finds the place free. Dropped before its end (the client went away), the lease's drop
/// releases it. It ends early, without its last frame, if the lease is lost.
pub struct LeasedBody {
    inner: ProxyBody,
    lease: Option<LeaseHold>,
    lost: Pin<Box<dyn Future<Output = ()> + Send>>,
    ending: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The last frame, handed over once the release is done.
    last: Option<Frame<Bytes>>,
    done: bool,
}

/// Hands a request's concurrency lease (if it holds one) to its answer: the answer's body
/// holds it until its last byte (`LeasedBody`). With no answer of the upstream's to hold it,
/// it is freed before sluice's own answer goes; a WebSocket's 101 has no body to hold it: its
/// tunnel does.
pub async fn ride_with_answer(
    lease: Option<LeaseHold>,
    mut acted: Result<Answered, Stop>,
) -> Result<Answered, Stop> {
    let Some(lease) = lease else {
        return acted;
    };
    match &mut acted {
        Err(_) => Box::pin(lease.0.end()).await,
        Ok(answered) if answered.response.status() == http::StatusCode::SWITCHING_PROTOCOLS => {}
        Ok(answered) => {
            let body =
                std::mem::replace(answered.response.body_mut(), ProxyBody::full(Bytes::new()));
            *answered.response.body_mut() = LeasedBody::wrap(body, lease);
        }
    }
    acted
}

impl LeasedBody {
    pub fn wrap(inner: ProxyBody, lease: LeaseHold) -> ProxyBody {
        let lost = Box::pin(lease.0.lost());
        ProxyBody::stream(LeasedBody {
            inner,
            lease: Some(lease),
            lost,
            ending: None,
            last: None,
            done: false,
        })
    }

    fn end(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.ending = Some(Box::pin(lease.0.end()));
        }
    }
}

impl Body for LeasedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(ending) = &mut this.ending {
                ready!(ending.as_mut().poll(cx));
                this.ending = None;
                this.done = true;
            }
            if this.done {
                return Poll::Ready(this.last.take().map(Ok));
            }
            if this.lease.is_some() && this.lost.as_mut().poll(cx).is_ready() {
                // The store will give this place to another request: the answer stops here,
                // short (HTTP/1: the connection closes before its length or last chunk;
                // HTTP/2: no END_STREAM), so the client knows it is incomplete.
                this.lease = None;
                this.done = true;
                continue;
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) if this.inner.is_end_stream() => {
                    this.last = Some(frame);
                    this.end();
                }
                Some(Ok(frame)) => return Poll::Ready(Some(Ok(frame))),
                Some(Err(err)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(err)));
                }
                None => this.end(),
            }
            if this.ending.is_none() {
                this.done = true;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.last.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The requests waiting for a concurrency limit's place on this instance, by key.
#[derive(Default)]
pub struct Waiting {
    keys: Mutex<HashMap<String, Arc<Turn>>>,
}

struct Turn {
    /// One permit: the waiter allowed to ask the store. Tokio's semaphore is fair, so the
    /// turn passes in arrival order.
    ask: Semaphore,
    /// Requests in this queue; changed only under the map's lock.
    waiting: AtomicUsize,
}

/// A request's place in a key's queue, left when dropped.
pub struct InQueue<'a> {
    waiting: &'a Waiting,
    key: String,
    turn: Arc<Turn>,
}

impl Waiting {
    /// Joins `key`'s queue, unless `bound` requests already wait there.
    pub fn join(&self, key: &str, bound: usize) -> Option<InQueue<'_>> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let turn = keys.entry(key.to_owned()).or_insert_with(|| {
            Arc::new(Turn {
                ask: Semaphore::new(1),
                waiting: AtomicUsize::new(0),
            })
        });
        if turn.waiting.load(Ordering::Relaxed) >= bound {
            return None;
        }
        turn.waiting.fetch_add(1, Ordering::Relaxed);
        Some(InQueue {
            waiting: self,
            key: key.to_owned(),
            turn: Arc::clone(turn),
        })
    }
}

impl InQueue<'_> {
    /// Waits for this request's turn to ask the store, until `deadline`; `None` if it passed.
    pub async fn turn(&self, deadline: Instant) -> Option<tokio::sync::SemaphorePermit<'_>> {
        tokio::time::timeout_at(deadline.into(), self.turn.ask.acquire())
            .await
            .ok()?
            .ok()
    }
}

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        let mut keys = self.waiting.keys.lock().unwrap_or_else(|p| p.into_inner());
        if self.turn.waiting.fetch_sub(1, Ordering::Relaxed) == 1 {
            keys.remove(&self.key);
        }
    }
}

/// The gap before asking again, from the refusal's hint.
pub fn poll_gap(hint: Duration) -> Duration {
    hint.clamp(POLL_MIN, POLL_MAX)
}

/// Whether `limit` waits for a place instead of refusing.
pub fn waits(limit: &Limit) -> bool {
    limit.spec.algorithm == Algorithm::Concurrency && !limit.spec.max_delay.is_zero()
}
