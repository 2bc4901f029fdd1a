//! The body of every answer sluice sends to a client: its own (a problem, a direct
//! response), held whole, or the upstream's, streamed frame by frame and never collected.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

pub enum ProxyBody {
    Full(Option<Bytes>),
    /// Boxed, so that the answer's type does not depend on how upstream connections are kept
    /// (`proxy::upstream`'s pool, which builds this body): one allocation per forwarded answer.
    Stream(Pin<Box<dyn Body<Data = Bytes, Error = hyper::Error> + Send>>),
}

impl ProxyBody {
    pub fn full(bytes: Bytes) -> ProxyBody {
        ProxyBody::Full(Some(bytes).filter(|b| !b.is_empty()))
    }

    pub fn stream(body: impl Body<Data = Bytes, Error = hyper::Error> + Send + 'static) -> Self {
        ProxyBody::Stream(Box::pin(body))
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
            ProxyBody::Stream(upstream) => upstream.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(bytes) => bytes.is_none(),
            ProxyBody::Stream(upstream) => upstream.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            ProxyBody::Stream(upstream) => upstream.size_hint(),
        }
    }
}
