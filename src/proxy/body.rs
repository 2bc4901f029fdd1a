//! Bodies streamed through sluice frame by frame, never collected whole: the body of every
//! response it sends (its own, or the upstream's), and the client's request body on its way
//! to the upstream, held to the route's size limit.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

pub enum ProxyBody {
    Full(Option<Bytes>),
    Stream(Incoming),
}

impl ProxyBody {
    pub fn full(bytes: Bytes) -> ProxyBody {
        ProxyBody::Full(Some(bytes).filter(|b| !b.is_empty()))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ProxyBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Stream(incoming) => Pin::new(incoming).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(bytes) => bytes.is_none(),
            ProxyBody::Stream(incoming) => incoming.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            ProxyBody::Stream(incoming) => incoming.size_hint(),
        }
    }
}

/// What went wrong with a client's request body while it streamed to the upstream: the
/// client's fault, answered 400 or 413, never counted against the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyFault {
    #[error("the request body is malformed or broke off")]
    Malformed,
    #[error("the request body is larger than this route accepts")]
    TooLarge,
}

/// A client's request body on its way to the upstream, counted as it streams so that it can
/// be cut at the route's `max_body`, and remembering a fault for the gateway to answer.
pub struct RequestBody {
    inner: Incoming,
    limit: u64,
    received: u64,
    fault: Arc<OnceLock<BodyFault>>,
}

impl RequestBody {
    /// `limit`: the most bytes forwarded (`u64::MAX` for no limit). The returned cell is set
    /// if the body fails, and tells the gateway why the forward failed.
    pub fn new(inner: Incoming, limit: u64) -> (RequestBody, Arc<OnceLock<BodyFault>>) {
        let fault = Arc::new(OnceLock::new());
        let body = RequestBody {
            inner,
            limit,
            received: 0,
            fault: Arc::clone(&fault),
        };
        (body, fault)
    }

    fn fail(&self, fault: BodyFault) -> Poll<Option<Result<Frame<Bytes>, BodyFault>>> {
        let _ = self.fault.set(fault);
        Poll::Ready(Some(Err(fault)))
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
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received = this.received.saturating_add(data.len() as u64);
                    if this.received > this.limit {
                        return this.fail(BodyFault::TooLarge);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => this.fail(BodyFault::Malformed),
            other => other.map_err(|_| BodyFault::Malformed),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
