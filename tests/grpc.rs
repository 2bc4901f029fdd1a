//! gRPC through sluice: an upstream marked `http2: true` is spoken to over HTTP/2 with prior
//! knowledge, gets `te: trailers`, and a streaming call works both ways message by message,
//! with request and response trailers passed through unchanged (`grpc-status` 0 and 13).
//! A rate-limited gRPC route answers 429 with `grpc-status: 14`; an HTTP/1.1 client can
//! still make a plain request to the HTTP/2 upstream.
//!
//! The upstream is a real HTTP/2 server (hyper) reading length-prefixed messages from its
//! streaming request body and answering each one at once; the client is a real hyper h2c
//! client talking to the real sluice binary.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use support::Sluice;

type Body = UnsyncBoxBody<Bytes, Infallible>;
type FrameSender = mpsc::Sender<Result<Frame<Bytes>, Infallible>>;

/// Generous bound on each step of an exchange.
const STEP: Duration = Duration::from_secs(10);

/// A body fed frame by frame through the returned sender; it ends when the sender drops.
fn channel_body() -> (FrameSender, Body) {
    let (tx, rx) = mpsc::channel(16);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    });
    (tx, StreamBody::new(stream).boxed_unsync())
}

/// A gRPC length-prefixed message: uncompressed flag, 4-byte big-endian length, payload.
fn encode(payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.freeze()
}

/// Takes one whole message off the front of `buf`, if it holds one.
fn take_message(buf: &mut BytesMut) -> Option<Bytes> {
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
struct Seen {
    path: String,
    version: Version,
    te: Option<String>,
    messages: usize,
    trailers: Option<HeaderMap>,
}

/// An HTTP/2-only (prior knowledge) upstream: for each request message `m` it answers
/// `reply:m` at once; when the request ends it sends trailers, `grpc-status: 13` for a path
/// ending in `/Fail` and 0 otherwise, echoing the client's `x-client-trailer`. `/plain`
/// answers a whole body naming the version it was asked over.
struct GrpcUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl GrpcUpstream {
    async fn start() -> GrpcUpstream {
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
                    tokio::spawn(async move {
                        let service = service_fn(move |request| {
                            let seen = Arc::clone(&seen);
                            async move { Ok::<_, Infallible>(answer(request, seen)) }
                        });
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            }
        });
        GrpcUpstream { addr, seen, task }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn calls_to(&self, path: &str) -> usize {
        self.seen().iter().filter(|s| s.path == path).count()
    }
}

impl Drop for GrpcUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn answer(request: Request<Incoming>, seen: Arc<Mutex<Vec<Seen>>>) -> Response<Body> {
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
async fn h2c_client(addr: SocketAddr) -> SendRequest<Body> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2c handshake with sluice");
    tokio::spawn(connection);
    sender
}

fn grpc_request(addr: SocketAddr, path: &str, body: Body) -> Request<Body> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap()
}

/// The next frame of `body`, within [`STEP`].
async fn next_frame(body: &mut Incoming) -> Option<Frame<Bytes>> {
    tokio::time::timeout(STEP, body.frame())
        .await
        .expect("a response frame within the time bound")
        .map(|frame| frame.expect("response body frame"))
}

/// Reads `body` until one whole message is in `buf`, and returns it.
async fn read_message(body: &mut Incoming, buf: &mut BytesMut) -> Bytes {
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
async fn read_trailers(body: &mut Incoming, buf: &BytesMut) -> HeaderMap {
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

fn config(upstream: SocketAddr) -> String {
    format!(
        r#"upstreams:
  grpc:
    url: "http://{upstream}"
    http2: true
    timeout: 10s
routes:
  - name: limited
    match:
      path_prefix: /limited.Svc
    upstream: grpc
    limits:
      - name: calls
        key: [client_ip]
        requests: 2
        window: 1m
  - name: grpc
    match:
      path_prefix: /
    upstream: grpc
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_call_passes_message_by_message_with_trailers_both_ways() {
    let upstream = GrpcUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    let mut client = h2c_client(sluice.addr()).await;

    let (tx, body) = channel_body();
    let response = tokio::time::timeout(
        STEP,
        client.send_request(grpc_request(sluice.addr(), "/echo.Echo/Chat", body)),
    )
    .await
    .expect("response headers while the request body is still open")
    .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.headers()["content-type"], "application/grpc");
    let mut body = response.into_body();
    let mut buf = BytesMut::new();
    // Each reply is read before the next message is sent: nothing on the way may wait for
    // the request body to end.
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let messages: Vec<Vec<u8>> = vec![b"first".to_vec(), b"second".to_vec(), big, b"last".to_vec()];
    for message in &messages {
        tx.send(Ok(Frame::data(encode(message)))).await.unwrap();
        let reply = read_message(&mut body, &mut buf).await;
        let mut expected = b"reply:".to_vec();
        expected.extend_from_slice(message);
        assert!(
            reply[..] == expected[..],
            "reply of {} bytes differs from the expected {} bytes",
            reply.len(),
            expected.len()
        );
    }
    let mut request_trailers = HeaderMap::new();
    request_trailers.insert("x-client-trailer", HeaderValue::from_static("done"));
    tx.send(Ok(Frame::trailers(request_trailers)))
        .await
        .unwrap();
    drop(tx);

    let trailers = read_trailers(&mut body, &buf).await;
    assert_eq!(trailers["grpc-status"], "0", "{trailers:?}");
    assert_eq!(trailers["grpc-message"], "all good", "{trailers:?}");
    assert_eq!(trailers["x-seen-client-trailer"], "done", "{trailers:?}");
    assert!(
        next_frame(&mut body).await.is_none(),
        "nothing after trailers"
    );

    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].version,
        Version::HTTP_2,
        "the upstream must get HTTP/2"
    );
    assert_eq!(seen[0].te.as_deref(), Some("trailers"), "{seen:?}");
    assert_eq!(seen[0].messages, messages.len());
    let request_trailers = seen[0].trailers.as_ref().expect("request trailers arrived");
    assert_eq!(request_trailers["x-client-trailer"], "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_status_trailer_passes_unchanged() {
    let upstream = GrpcUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    let mut client = h2c_client(sluice.addr()).await;

    let (tx, body) = channel_body();
    tx.send(Ok(Frame::data(encode(b"ping")))).await.unwrap();
    drop(tx);
    let response = tokio::time::timeout(
        STEP,
        client.send_request(grpc_request(sluice.addr(), "/echo.Echo/Fail", body)),
    )
    .await
    .expect("response within the time bound")
    .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut buf = BytesMut::new();
    assert_eq!(&read_message(&mut body, &mut buf).await[..], b"reply:ping");
    let trailers = read_trailers(&mut body, &buf).await;
    assert_eq!(trailers["grpc-status"], "13", "{trailers:?}");
    assert_eq!(trailers["grpc-message"], "boom%20here", "{trailers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_call_gets_429_with_grpc_status_unavailable() {
    let upstream = GrpcUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    let mut client = h2c_client(sluice.addr()).await;

    for call in 1..=3 {
        let (tx, body) = channel_body();
        tx.send(Ok(Frame::data(encode(b"hello")))).await.unwrap();
        drop(tx);
        let response = tokio::time::timeout(
            STEP,
            client.send_request(grpc_request(sluice.addr(), "/limited.Svc/Call", body)),
        )
        .await
        .expect("response within the time bound")
        .expect("response");
        if call <= 2 {
            assert_eq!(response.status(), StatusCode::OK, "call {call}");
            assert!(!response.headers().contains_key("grpc-status"));
            let mut body = response.into_body();
            let mut buf = BytesMut::new();
            assert_eq!(&read_message(&mut body, &mut buf).await[..], b"reply:hello");
            let trailers = read_trailers(&mut body, &buf).await;
            assert_eq!(trailers["grpc-status"], "0");
        } else {
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
            let headers = response.headers();
            assert_eq!(headers["grpc-status"], "14", "{headers:?}");
            let message = headers["grpc-message"].to_str().unwrap();
            assert!(
                message.starts_with("rate limited by sluice; retry in "),
                "{message}"
            );
            assert!(headers.contains_key("retry-after"), "{headers:?}");
        }
    }
    assert_eq!(
        upstream.calls_to("/limited.Svc/Call"),
        2,
        "the refused call must not reach the upstream"
    );

    // A client that is not gRPC gets a plain 429, no gRPC status.
    let plain = support::client()
        .post(format!("{}/limited.Svc/Call", sluice.url()))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 429);
    assert!(plain.headers().get("grpc-status").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_reaches_the_http2_upstream() {
    let upstream = GrpcUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    let response = support::client()
        .post(format!("{}/plain", sluice.url()))
        .header("te", "trailers")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_11);
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "plain over HTTP/2.0");
    let seen = upstream.seen();
    assert_eq!(seen[0].version, Version::HTTP_2);
    assert_eq!(seen[0].te.as_deref(), Some("trailers"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_turns_http2_on_replaces_the_upstream_client() {
    let upstream = GrpcUpstream::start().await;
    let config = config(upstream.addr).replace("http2: true", "http2: false");
    let sluice = Sluice::start(&config).await;
    let client = support::client();
    let plain = || async {
        client
            .post(format!("{}/plain", sluice.url()))
            .body("x")
            .send()
            .await
            .map(|response| response.status().as_u16())
            .unwrap_or(0)
    };
    // HTTP/1.1 to a server that speaks only HTTP/2: the upstream exchange fails.
    assert_eq!(plain().await, 502);
    let path = sluice.config_path();
    let text = std::fs::read_to_string(path).unwrap();
    std::fs::write(path, text.replace("http2: false", "http2: true")).unwrap();
    // The pooled HTTP/1.1 client must not be kept for the same address.
    support::wait_for(
        STEP,
        "the reloaded upstream to answer over HTTP/2",
        || async { plain().await == 200 },
    )
    .await;
    assert!(upstream.seen().iter().all(|s| s.version == Version::HTTP_2));
}
