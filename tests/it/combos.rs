//! The features that came in separately, tested together through the real sluice binary:
//! - a gRPC-style streaming call to an `https://` upstream marked `http2: true` (an HTTP/2
//!   server behind TLS that offers only ALPN `h2`, trusted through `ca_file`);
//! - an `https://` `http2: true` upstream that accepts only `http/1.1` is a 502 (`connect`):
//!   sluice offers it `h2` alone;
//! - a gRPC-style call from a client over TLS (HTTP/2 chosen through ALPN) to an h2c upstream,
//!   and over TLS on both sides;
//! - WebSocket over the TLS listener (`wss://`), with the upgrade counted by the limit;
//! - WebSocket to an `https://` upstream (a `wss://` echo server).
//!
//! Certificates are made at test time (rcgen); every server listens on 127.0.0.1.

use crate::support;

use std::net::SocketAddr;
use std::path::PathBuf;

use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, Request, StatusCode, Version};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use support::certs::Ca;
use support::grpc::{
    channel_body, encode, grpc_request, h2c_client, next_frame, read_message, read_trailers, Body,
    GrpcUpstream, STEP,
};
use support::websocket::{EchoServer, Ended};
use support::{Limit, Policy, Route, Sluice, UpstreamSpec};

/// The files of one test (certificates, keys), removed with it.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        Files {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

/// A policy whose listener serves TLS with a `localhost` certificate of `ca`.
fn listener_tls(ca: &Ca, files: &Files) -> Policy {
    let leaf = ca.server("sluice");
    let cert = files.write("sluice-cert.pem", &leaf.cert);
    let key = files.write("sluice-key.pem", &leaf.key);
    Policy::new().tls(&cert, &key)
}

/// Opens TLS to sluice at `addr` as `localhost`, offering `alpn`; returns the stream and the
/// protocol sluice chose.
async fn tls_to(ca: &Ca, addr: SocketAddr, alpn: &[&[u8]]) -> (TlsStream<TcpStream>, Vec<u8>) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let stream = tokio::time::timeout(
        STEP,
        ca.connector(alpn)
            .connect(ServerName::try_from("localhost").unwrap(), tcp),
    )
    .await
    .expect("TLS handshake within the time bound")
    .expect("TLS handshake with sluice");
    let chosen = stream.get_ref().1.alpn_protocol().unwrap_or(b"").to_vec();
    (stream, chosen)
}

/// Sends `messages` one at a time on a streaming call to `path`, reading each reply before
/// sending the next, then request trailers; returns the response trailers.
async fn streaming_call(
    client: &mut SendRequest<Body>,
    request: impl FnOnce(Body) -> Request<Body>,
    messages: &[Vec<u8>],
) -> HeaderMap {
    let (tx, body) = channel_body();
    let response = tokio::time::timeout(STEP, client.send_request(request(body)))
        .await
        .expect("response headers while the request body is still open")
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.headers()["content-type"], "application/grpc");
    let mut body: Incoming = response.into_body();
    let mut buf = BytesMut::new();
    for message in messages {
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
    assert!(
        next_frame(&mut body).await.is_none(),
        "nothing after trailers"
    );
    trailers
}

fn messages() -> Vec<Vec<u8>> {
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    vec![b"first".to_vec(), big, b"last".to_vec()]
}

/// Asserts the trailers are exactly those of a successful call that saw the client's trailer.
fn assert_ok_trailers(trailers: &HeaderMap) {
    assert_eq!(trailers.len(), 3, "{trailers:?}");
    assert_eq!(trailers["grpc-status"], "0", "{trailers:?}");
    assert_eq!(trailers["grpc-message"], "all good", "{trailers:?}");
    assert_eq!(trailers["x-seen-client-trailer"], "done", "{trailers:?}");
}

/// Makes one unary call to `/echo.Echo/Fail` and returns its trailers.
async fn failing_call(
    client: &mut SendRequest<Body>,
    request: impl FnOnce(Body) -> Request<Body>,
) -> HeaderMap {
    let (tx, body) = channel_body();
    tx.send(Ok(Frame::data(encode(b"ping")))).await.unwrap();
    drop(tx);
    let response = tokio::time::timeout(STEP, client.send_request(request(body)))
        .await
        .expect("response within the time bound")
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut buf = BytesMut::new();
    assert_eq!(&read_message(&mut body, &mut buf).await[..], b"reply:ping");
    read_trailers(&mut body, &buf).await
}

fn grpc_config(listener: Policy, upstream: UpstreamSpec) -> Policy {
    listener
        .upstream("grpc", upstream.http2().timeout("10s"))
        .route(Route::new("grpc", "/").upstream("grpc"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_to_an_https_http2_upstream_streams_both_ways_with_its_trailers() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let ca_file = files.write("ca.pem", &ca.pem());
    // The upstream offers only h2: an upstream client that offers http/1.1 alone is refused.
    let upstream = GrpcUpstream::start_tls(ca.server("grpc upstream").acceptor(&[b"h2"])).await;
    let url =
        UpstreamSpec::new(&format!("https://localhost:{}", upstream.addr.port())).ca_file(&ca_file);
    let sluice = Sluice::start(&grpc_config(Policy::new(), url)).await;
    let mut client = h2c_client(sluice.addr()).await;
    let addr = sluice.addr();

    let messages = messages();
    let trailers = streaming_call(
        &mut client,
        |body| grpc_request(addr, "/echo.Echo/Chat", body),
        &messages,
    )
    .await;
    assert_ok_trailers(&trailers);
    let trailers = failing_call(&mut client, |body| {
        grpc_request(addr, "/echo.Echo/Fail", body)
    })
    .await;
    assert_eq!(trailers["grpc-status"], "13", "{trailers:?}");
    assert_eq!(trailers["grpc-message"], "boom%20here", "{trailers:?}");

    let seen = upstream.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for call in &seen {
        assert_eq!(call.tls_alpn.as_deref(), Some(&b"h2"[..]), "{call:?}");
        assert_eq!(call.version, Version::HTTP_2, "{call:?}");
        assert_eq!(call.te.as_deref(), Some("trailers"), "{call:?}");
    }
    assert_eq!(seen[0].path, "/echo.Echo/Chat");
    assert_eq!(seen[0].messages, messages.len());
    let request_trailers = seen[0].trailers.as_ref().expect("request trailers arrived");
    assert_eq!(request_trailers["x-client-trailer"], "done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_http2_upstream_that_refuses_h2_is_a_bad_gateway() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let ca_file = files.write("ca.pem", &ca.pem());
    // Offers only http/1.1: sluice offers only h2 to an http2 upstream, so no protocol fits.
    let upstream =
        GrpcUpstream::start_tls(ca.server("grpc upstream").acceptor(&[b"http/1.1"])).await;
    let url =
        UpstreamSpec::new(&format!("https://localhost:{}", upstream.addr.port())).ca_file(&ca_file);
    let sluice = Sluice::start(&grpc_config(Policy::new(), url)).await;
    let response = support::client()
        .post(format!("{}/echo.Echo/Chat", sluice.url()))
        .header("content-type", "application/grpc")
        .body(encode(b"ping"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert!(upstream.seen().is_empty());
    let metrics = support::parse_metrics(&sluice.metrics().await);
    let connect_errors = support::metric_sum(
        &metrics,
        "sluice_upstream_errors_total",
        &[("upstream", "grpc"), ("kind", "connect")],
    );
    assert_eq!(connect_errors, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_over_the_tls_listener_reaches_an_h2c_upstream_with_its_trailers() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let upstream = GrpcUpstream::start().await;
    let url = UpstreamSpec::new(&format!("http://{}", upstream.addr));
    let sluice = Sluice::start(&grpc_config(listener_tls(&ca, &files), url)).await;

    let (stream, alpn) = tls_to(&ca, sluice.addr(), &[b"h2", b"http/1.1"]).await;
    assert_eq!(alpn, b"h2", "sluice must choose HTTP/2 through ALPN");
    let (mut client, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 over TLS with sluice");
    tokio::spawn(connection);
    let port = sluice.addr().port();
    let request = |path: &'static str| {
        move |body: Body| {
            Request::post(format!("https://localhost:{port}{path}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(body)
                .unwrap()
        }
    };

    let messages = messages();
    let trailers = streaming_call(&mut client, request("/echo.Echo/Chat"), &messages).await;
    assert_ok_trailers(&trailers);
    let trailers = failing_call(&mut client, request("/echo.Echo/Fail")).await;
    assert_eq!(trailers["grpc-status"], "13", "{trailers:?}");

    let seen = upstream.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|call| call.version == Version::HTTP_2));
    assert_eq!(seen[0].messages, messages.len());
    assert_eq!(seen[0].te.as_deref(), Some("trailers"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_over_tls_on_both_sides_streams_with_its_trailers() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let ca_file = files.write("ca.pem", &ca.pem());
    let upstream = GrpcUpstream::start_tls(ca.server("grpc upstream").acceptor(&[b"h2"])).await;
    let url =
        UpstreamSpec::new(&format!("https://localhost:{}", upstream.addr.port())).ca_file(&ca_file);
    let sluice = Sluice::start(&grpc_config(listener_tls(&ca, &files), url)).await;

    let (stream, alpn) = tls_to(&ca, sluice.addr(), &[b"h2"]).await;
    assert_eq!(alpn, b"h2");
    let (mut client, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 over TLS with sluice");
    tokio::spawn(connection);
    let port = sluice.addr().port();
    let messages = messages();
    let trailers = streaming_call(
        &mut client,
        |body| {
            Request::post(format!("https://localhost:{port}/echo.Echo/Chat"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(body)
                .unwrap()
        },
        &messages,
    )
    .await;
    assert_ok_trailers(&trailers);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].tls_alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(seen[0].version, Version::HTTP_2);
    assert_eq!(seen[0].messages, messages.len());
}

type WssClient = WebSocketStream<TlsStream<TcpStream>>;

/// A WebSocket client to `wss://localhost:PORT{path}` over rustls trusting only `ca`.
async fn wss_connect(ca: &Ca, addr: SocketAddr, path: &str) -> Result<WssClient, WsError> {
    let (stream, alpn) = tls_to(ca, addr, &[b"http/1.1"]).await;
    assert_eq!(alpn, b"http/1.1");
    let url = format!("wss://localhost:{}{path}", addr.port());
    tokio::time::timeout(STEP, tokio_tungstenite::client_async(url, stream))
        .await
        .expect("handshake within the time bound")
        .map(|(ws, response)| {
            assert_eq!(response.status(), 101);
            ws
        })
}

/// Sends each message and expects it echoed back unchanged.
async fn assert_echoes<S>(ws: &mut WebSocketStream<S>, label: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let big: Vec<u8> = (0..(256u32 << 10)).map(|i| (i % 253) as u8).collect();
    let messages = [
        Message::text(format!("hello from {label}")),
        Message::binary(vec![0u8, 1, 2, 255]),
        Message::binary(big),
    ];
    for message in messages {
        ws.send(message.clone()).await.unwrap();
        let echoed = tokio::time::timeout(STEP, ws.next())
            .await
            .expect("an echo within the time bound")
            .expect("an echo")
            .expect("an echo, not an error");
        assert!(echoed == message, "echo differs ({} bytes)", echoed.len());
    }
}

/// Closes `ws` and reads until the end.
async fn close<S>(mut ws: WebSocketStream<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    ws.close(None).await.unwrap();
    loop {
        match tokio::time::timeout(STEP, ws.next())
            .await
            .expect("the close within the time bound")
        {
            Some(Ok(Message::Close(_))) => {}
            Some(Ok(other)) => panic!("unexpected {other:?}"),
            Some(Err(_)) | None => break,
        }
    }
}

fn ws_config(listener: Policy, upstream: UpstreamSpec, requests: u32) -> Policy {
    listener
        .server("idle_timeout", "60s")
        .upstream("echo", upstream.timeout("10s"))
        .route(
            Route::new("ws", "/ws")
                .upstream("echo")
                .limit(Limit::requests("upgrades", requests, "1m")),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_over_the_tls_listener_echo_and_the_limit_counts_the_upgrades() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let upstream = EchoServer::start().await;
    let url = UpstreamSpec::new(&format!("http://{}", upstream.addr));
    let sluice = Sluice::start(&ws_config(listener_tls(&ca, &files), url, 2)).await;

    let mut open = Vec::new();
    for n in 0..2 {
        let mut ws = wss_connect(&ca, sluice.addr(), "/ws/chat")
            .await
            .expect("upgrade over TLS");
        assert_echoes(&mut ws, &format!("client {n}")).await;
        open.push(ws);
    }
    match wss_connect(&ca, sluice.addr(), "/ws/chat").await {
        Err(WsError::Http(response)) => {
            assert_eq!(response.status(), 429);
            assert!(response.headers().contains_key("retry-after"));
            assert!(response.headers().get("upgrade").is_none());
        }
        Err(other) => panic!("expected a 429, got {other:?}"),
        Ok(_) => panic!("the third upgrade must be refused"),
    }
    assert_eq!(
        upstream.upgrades().len(),
        2,
        "the refused one never reached it"
    );
    // The tunnels opened before the refusal still work.
    for ws in &mut open {
        assert_echoes(ws, "an open tunnel").await;
    }
    for ws in open {
        close(ws).await;
    }
    assert_eq!(
        upstream.wait_ended(2).await,
        vec![Ended::CloseFrame, Ended::CloseFrame]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_to_an_https_upstream_passes_its_upgrade_and_echoes() {
    let (ca, files) = (Ca::new("combos CA"), Files::new());
    let ca_file = files.write("ca.pem", &ca.pem());
    let upstream = EchoServer::start_tls(ca.server("wss upstream").acceptor(&[b"http/1.1"])).await;
    let url =
        UpstreamSpec::new(&format!("https://localhost:{}", upstream.addr.port())).ca_file(&ca_file);
    let sluice = Sluice::start(&ws_config(Policy::new(), url, 10)).await;

    let ws_url = format!("ws://127.0.0.1:{}/ws/chat", sluice.addr().port());
    let (mut ws, response) = tokio::time::timeout(STEP, tokio_tungstenite::connect_async(ws_url))
        .await
        .expect("handshake within the time bound")
        .expect("upgrade through sluice to the wss upstream");
    assert_eq!(response.status(), 101);
    assert_echoes(&mut ws, "the client").await;

    let upgrades = upstream.upgrades();
    assert_eq!(upgrades.len(), 1, "{upgrades:?}");
    assert_eq!(upgrades[0].0, "/ws/chat");
    assert!(
        upgrades[0].1.eq_ignore_ascii_case("websocket"),
        "{upgrades:?}"
    );
    assert!(upstream.tls_handshakes() >= 1);
    close(ws).await;
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::CloseFrame]);
}
