//! gRPC through sluice: an upstream marked `http2: true` is spoken to over HTTP/2 with prior
//! knowledge, gets `te: trailers`, and a streaming call works both ways message by message,
//! with request and response trailers passed through unchanged (`grpc-status` 0 and 13).
//! A rate-limited gRPC route answers 429 with `grpc-status: 14`; an HTTP/1.1 client can
//! still make a plain request to the HTTP/2 upstream.
//!
//! The upstream is a real HTTP/2 server (hyper) reading length-prefixed messages from its
//! streaming request body and answering each one at once; the client is a real hyper h2c
//! client talking to the real sluice binary.

use crate::support;

use std::net::SocketAddr;

use bytes::BytesMut;
use http::{HeaderMap, HeaderValue, StatusCode, Version};
use hyper::body::Frame;

use support::grpc::{
    channel_body, encode, grpc_request, h2c_client, next_frame, read_message, read_trailers,
    GrpcUpstream, STEP,
};
use support::{Limit, Policy, Route, Sluice, UpstreamSpec};

/// `http2` is the upstream's setting, written either way (a reload test turns it on in the
/// file): gRPC needs it on.
fn config(upstream: SocketAddr, http2: bool) -> Policy {
    let grpc = UpstreamSpec::new(&format!("http://{upstream}"))
        .set("http2", http2)
        .timeout("10s");
    Policy::new()
        .upstream("grpc", grpc)
        .route(
            Route::new("limited", "/limited.Svc")
                .upstream("grpc")
                .limit(Limit::requests("calls", 2, "1m")),
        )
        .route(Route::new("grpc", "/").upstream("grpc"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_call_passes_message_by_message_with_trailers_both_ways() {
    let upstream = GrpcUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr, true)).await;
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
    let sluice = Sluice::start(&config(upstream.addr, true)).await;
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
    let sluice = Sluice::start(&config(upstream.addr, true)).await;
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
    let sluice = Sluice::start(&config(upstream.addr, true)).await;
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
    let sluice = Sluice::start(&config(upstream.addr, false)).await;
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
    support::replace_file(path, &text.replace("http2: false", "http2: true"));
    // The pooled HTTP/1.1 client must not be kept for the same address.
    support::wait_for(
        STEP,
        "the reloaded upstream to answer over HTTP/2",
        || async { plain().await == 200 },
    )
    .await;
    assert!(upstream.seen().iter().all(|s| s.version == Version::HTTP_2));
}
