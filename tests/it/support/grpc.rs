//! gRPC-style calls for the tests: length-prefixed messages in streaming bodies, a real
//! HTTP/2 upstream (cleartext with prior knowledge, or behind TLS) that answers each message
//! at once and ends with `grpc-status` trailers, and the client side's readers of replies and
//! trailers, each step bounded in time.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;
pub type FrameSender = mpsc::Sender<Result<Frame<Bytes>, Infallible>>;

/// Generous bound on each step of an exchange.
pub const STEP: Duration = Duration::from_secs(10);

/// A body fed frame by frame through the returned sender; it ends when the sender drops.
pub fn channel_body() -> (FrameSender, Body) {
    let (tx, rx) = mpsc::channel(16);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    });
    (tx, StreamBody::new(stream).boxed_unsync())
}

/// A gRPC length-prefixed message: uncompressed flag, 4-byte big-endian length, payload.
pub fn encode(payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.freeze()
}

/// Takes one whole message off the front of `buf`, if it holds one.
pub fn take_message(buf: &mut BytesMut) -> Option<Bytes> {
    if buf.len() < 5 {
        return None;
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return None;
    }
    buf.advance(5);
    Some(buf.split_to(len).freeze())
}

/// What the upstream saw of one call.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub version: Version,
    pub te: Option<String>,
    pub messages: usize,
    pub trailers: Option<HeaderMap>,
    /// The ALPN protocol agreed on the connection of the call, when it came over TLS.
    pub tls_alpn: Option<Vec<u8>>,
}

/// An HTTP/2-only (prior knowledge) upstream: for each request message `m` it answers
/// `reply:m` at once; when the request ends it sends trailers, `grpc-status: 13` for a path
/// ending in `/Fail` and 0 otherwise, echoing the client's `x-client-trailer`. `/plain`
/// answers a whole body naming the version it was asked over.
pub struct GrpcUpstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl GrpcUpstream {
    pub async fn start() -> GrpcUpstream {
        GrpcUpstream::start_with(None).await
    }

    /// The same server behind TLS: `acceptor` decides the certificate and the ALPN offered.
    pub async fn start_tls(acceptor: tokio_rustls::TlsAcceptor) -> GrpcUpstream {
        GrpcUpstream::start_with(Some(acceptor)).await
    }

    async fn start_with(acceptor: Option<tokio_rustls::TlsAcceptor>) -> GrpcUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let seen = Arc::clone(&seen);
            async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let seen = Arc::clone(&seen);
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        match acceptor {
                            None => serve_h2(stream, seen, None).await,
                            Some(acceptor) => {
                                let Ok(stream) = acceptor.accept(stream).await else {
                                    return;
                                };
                                let alpn = stream.get_ref().1.alpn_protocol().unwrap_or(b"");
                                let alpn = Some(alpn.to_vec());
                                serve_h2(stream, seen, alpn).await;
                            }
                        }
                    });
                }
            }
        });
        GrpcUpstream { addr, seen, task }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn calls_to(&self, path: &str) -> usize {
        self.seen().iter().filter(|s| s.path == path).count()
    }
}

impl Drop for GrpcUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves HTTP/2 (only) on `io`; `tls_alpn` is noted in what each call saw.
async fn serve_h2<I>(io: I, seen: Arc<Mutex<Vec<Seen>>>, tls_alpn: Option<Vec<u8>>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |request| {
        let (seen, tls_alpn) = (Arc::clone(&seen), tls_alpn.clone());
        async move { Ok::<_, Infallible>(answer(request, seen, tls_alpn)) }
    });
    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), service)
        .await;
}

fn answer(
    request: Request<Incoming>,
    seen: Arc<Mutex<Vec<Seen>>>,
    tls_alpn: Option<Vec<u8>>,
) -> Response<Body> {
    let (parts, mut body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let index = {
        let mut seen = seen.lock().unwrap();
        seen.push(Seen {
            path: path.clone(),
            version: parts.version,
            te: parts
                .headers
                .get("te")
                .map(|v| v.to_str().unwrap().to_owned()),
            messages: 0,
            trailers: None,
            tls_alpn,
        });
        seen.len() - 1
    };
    if path == "/plain" {
        let text = format!("plain over {:?}", parts.version);
        return Response::new(Full::new(Bytes::from(text)).boxed_unsync());
    }
    let (tx, response_body) = channel_body();
    tokio::spawn(async move {
        let mut buf = BytesMut::new();
        let mut client_trailers = None;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return };
            match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    while let Some(message) = take_message(&mut buf) {
                        seen.lock().unwrap()[index].messages += 1;
                        let mut reply = b"reply:".to_vec();
                        reply.extend_from_slice(&message);
                        if tx.send(Ok(Frame::data(encode(&reply)))).await.is_err() {
                            return;
                        }
                    }
                }
                Err(frame) => client_trailers = frame.into_trailers().ok(),
            }
        }
        seen.lock().unwrap()[index].trailers = client_trailers.clone();
        let mut trailers = HeaderMap::new();
        if path.ends_with("/Fail") {
            trailers.insert("grpc-status", HeaderValue::from_static("13"));
            trailers.insert("grpc-message", HeaderValue::from_static("boom%20here"));
        } else {
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            trailers.insert("grpc-message", HeaderValue::from_static("all good"));
        }
        if let Some(value) = client_trailers.and_then(|t| t.get("x-client-trailer").cloned()) {
            trailers.insert("x-seen-client-trailer", value);
        }
        let _ = tx.send(Ok(Frame::trailers(trailers))).await;
    });
    Response::builder()
        .header("content-type", "application/grpc")
        .body(response_body)
        .unwrap()
}

/// A hyper client speaking HTTP/2 with prior knowledge to sluice.
pub async fn h2c_client(addr: SocketAddr) -> SendRequest<Body> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2c handshake with sluice");
    tokio::spawn(connection);
    sender
}

pub fn grpc_request(addr: SocketAddr, path: &str, body: Body) -> Request<Body> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap()
}

/// The next frame of `body`, within [`STEP`].
pub async fn next_frame(body: &mut Incoming) -> Option<Frame<Bytes>> {
    tokio::time::timeout(STEP, body.frame())
        .await
        .expect("a response frame within the time bound")
        .map(|frame| frame.expect("response body frame"))
}

/// Reads `body` until one whole message is in `buf`, and returns it.
pub async fn read_message(body: &mut Incoming, buf: &mut BytesMut) -> Bytes {
    loop {
        if let Some(message) = take_message(buf) {
            return message;
        }
        let frame = next_frame(body)
            .await
            .expect("the response ended before the next message");
        match frame.into_data() {
            Ok(data) => buf.extend_from_slice(&data),
            Err(frame) => panic!("trailers before the expected message: {frame:?}"),
        }
    }
}

/// Reads what is left of `body`: no more messages, then the trailers.
pub async fn read_trailers(body: &mut Incoming, buf: &BytesMut) -> HeaderMap {
    assert!(buf.is_empty(), "unread response bytes: {buf:?}");
    loop {
        let frame = next_frame(body)
            .await
            .expect("the response ended without trailers");
        match frame.into_trailers() {
            Ok(trailers) => return trailers,
            Err(frame) => assert!(
                frame.data_ref().is_some_and(|d| d.is_empty()),
                "a message after the last expected one: {frame:?}"
            ),
        }
    }
}
