//! The body of a request answered without being read: one refused before its body (a 429
//! from a limit, a 401, a 400 from the one-reading rules, a token route's room check), one a
//! route answers itself (`respond:`), one whose upstream answered (or the forward failed)
//! before the client had sent all of it, and one cut while sluice read it whole.
//!
//! On HTTP/1.x a connection can carry the next request only once this one's body has been
//! read. Answered with its body unread, hyper closes the connection after the answer, and
//! the answer does not say so: a client that sends its next request on it (it was not told
//! `close`) loses that request (seen: "connection closed before message completed" and a
//! broken pipe on the request after a 429, `tests/it/connections.rs`). So a small body
//! (at most `DRAIN_MAX` bytes, within `DRAIN_TIME`) is read and dropped before the answer,
//! and the connection is kept; a larger or slower one is not waited for, and the answer
//! says `Connection: close`. Nothing is kept, so the memory bound holds. An upstream's answer
//! relayed while the client's body is still arriving (an upload the upstream refuses with a
//! 413 or 401 at once) cannot be drained so: the body is the upstream's to read, and it may
//! never read more. That answer says `Connection: close` too (`after_reading`), as Envoy's
//! does; so does one to a body sluice reads whole and stops reading part way (a token
//! route's, over its bound or too slow). An HTTP/2 stream is refused (reset) on its own and
//! needs none of this; its connection carries on.
//!
//! A request that says `Expect: 100-continue` is waiting to be told to send its body, and
//! hyper tells it (`100 Continue`) the moment the body is first read. Refused, it must not be
//! told to upload what will be dropped (RFC 9110 §10.1.1 lets the final status go first):
//! its body is left unread, and the answer says `Connection: close`, since the client may
//! then send the body or not, and the connection cannot tell which it will be.

use std::time::Duration;

use http::header::{HeaderValue, CONNECTION};
use http::HeaderMap;

use crate::proxy::request_body::ClientBody;
use crate::proxy::ForwardBody;

/// Most body bytes read and dropped to keep a refused request's connection.
const DRAIN_MAX: u64 = 64 * 1024;
/// Longest wait for them.
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// What the answer must say of its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    Kept,
    /// The body was not read whole: the answer says `Connection: close`.
    Close,
}

impl Connection {
    /// Says so in the answer's `headers`: `Connection: close` when the connection closes
    /// after it.
    pub fn mark(self, headers: &mut HeaderMap) {
        if self == Connection::Close {
            headers.insert(CONNECTION, HeaderValue::from_static("close"));
        }
    }
}

/// For an answer that comes once the client's body has begun to be read, by the upstream
/// or whole by sluice (a token route's, which a fault or the budget can cut): `Close` when
/// that body had not been read to its end (`read_to_end`), on HTTP/1.x. Once its body is
/// dropped part read, hyper closes the connection after the answer; a body the upstream goes
/// on reading may still end, but the answer does not wait to learn it: it says `close`, and
/// the connection ends with this exchange.
pub fn after_reading(version: http::Version, read_to_end: bool) -> Connection {
    if version >= http::Version::HTTP_2 || read_to_end {
        Connection::Kept
    } else {
        Connection::Close
    }
}

/// Whether an HTTP/1.1 request waits for `100 Continue` before sending its body.
pub fn expects_continue(version: http::Version, headers: &HeaderMap) -> bool {
    version == http::Version::HTTP_11
        && headers
            .get(http::header::EXPECT)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Reads and drops what is left of `body` when it is small and arrives soon; `Close` when
/// it does not and the connection is HTTP/1.x, and at once, unread, for a request waiting
/// for `100 Continue` (`waits`). A body already read whole (a token route's) left nothing on
/// the connection.
pub async fn drop_unread<B: ForwardBody>(
    version: http::Version,
    body: ClientBody<B>,
    waits: bool,
) -> Connection {
    match body {
        ClientBody::Streaming(body) if waits && !body.is_end_stream() => Connection::Close,
        ClientBody::Streaming(body) => drain(version, body).await,
        ClientBody::Read(_) => Connection::Kept,
    }
}

async fn drain<B: ForwardBody>(version: http::Version, body: B) -> Connection {
    // A request without a body (most refused ones: a flood of GETs) costs nothing here.
    if version >= http::Version::HTTP_2 || body.is_end_stream() {
        return Connection::Kept;
    }
    if body.size_hint().lower() > DRAIN_MAX {
        return Connection::Close;
    }
    // Boxed: only a refused request with a body pays for the drain's future.
    let drain = Box::pin(async {
        let mut body = std::pin::pin!(body);
        let mut read = 0u64;
        loop {
            match std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                None => return Connection::Kept,
                Some(Err(_)) => return Connection::Close,
                Some(Ok(frame)) => {
                    read += frame
                        .data_ref()
                        .map_or(0, |data| bytes::Buf::remaining(data) as u64);
                    if read > DRAIN_MAX {
                        return Connection::Close;
                    }
                }
            }
        }
    });
    tokio::time::timeout(DRAIN_TIME, drain)
        .await
        .unwrap_or(Connection::Close)
}
