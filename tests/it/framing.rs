//! Request framing and size limits at the edge, sent as raw bytes: ambiguous framing is never
//! smuggled past sluice, a malformed body is the client's 400 (not an upstream error), heads
//! over their limits get 414 or 431, and bodies over `max_body` get 413 before the upstream
//! gets a whole request.

use crate::support;

use std::time::{Duration, Instant};

use support::wire::{parse_responses, Wire};
use support::{
    metric_sum, parse_metrics, pattern_chunk, Policy, RawResponse, Route, Sluice, UploadSeen,
    Upstream, UpstreamSpec,
};

/// Generous bound for one answer on a shared 2-core machine.
const WITHIN: Duration = Duration::from_secs(10);

/// `server` adds the test's `server:` settings (or none). Three routes share `/upload` by method, so
/// each can have its own `max_body`: PUT 1 KiB, PATCH 4 KiB, anything else the server's.
fn config(up: &str, server: impl FnOnce(Policy) -> Policy) -> Policy {
    server(Policy::new())
        .upstream(
            "api",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("10s"),
        )
        .route(
            Route::new("own-limit", "/upload")
                .methods(["PUT"])
                .upstream("api")
                .max_body("1KiB"),
        )
        .route(
            Route::new("larger-limit", "/upload")
                .methods(["PATCH"])
                .upstream("api")
                .max_body("4KiB"),
        )
        .route(Route::new("default", "/").upstream("api"))
}

async fn setup(server: impl FnOnce(Policy) -> Policy) -> (Upstream, Sluice) {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url(), server)).await;
    (up, sluice)
}

/// Sends `bytes` on a new connection and reads everything until sluice closes it.
async fn until_closed(sluice: &Sluice, bytes: &[u8]) -> Vec<RawResponse> {
    let mut wire = Wire::connect(sluice.addr()).await;
    wire.send(bytes).await.expect("send the request");
    assert!(
        wire.closed_within(WITHIN).await.is_some(),
        "sluice kept the connection open; received: {:?}",
        String::from_utf8_lossy(wire.rest())
    );
    parse_responses(wire.rest())
}

/// Sends `bytes` on a new connection and reads one response. The send may fail when sluice
/// refuses a head before reading all of it.
async fn ask(sluice: &Sluice, bytes: &[u8]) -> RawResponse {
    let mut wire = Wire::connect(sluice.addr()).await;
    let _ = wire.send(bytes).await;
    wire.response(WITHIN).await
}

/// A problem+json answer from sluice itself, with `status` in the body too.
fn assert_problem(response: &RawResponse, status: u16) -> serde_json::Value {
    assert_eq!(response.status, status, "{response:?}");
    assert!(
        response
            .header("content-type")
            .is_some_and(|ct| ct.starts_with("application/problem+json")),
        "expected a problem+json body: {response:?}"
    );
    let problem: serde_json::Value =
        serde_json::from_slice(&response.body).expect("problem body is JSON");
    assert_eq!(problem["status"], status, "{problem}");
    problem
}

/// A bare answer from hyper's parser: the status, no content type, no body.
fn assert_bare(response: &RawResponse, status: u16) {
    assert_eq!(response.status, status, "{response:?}");
    assert_eq!(response.header("content-type"), None, "{response:?}");
    assert!(response.body.is_empty(), "{response:?}");
}

/// `GET {target}` with `Host: t` and the given extra header lines (each ending in CRLF).
fn get(target: &str, extra: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: t\r\n{extra}\r\n").into_bytes()
}

/// A target that makes the request line `GET {target} HTTP/1.1` exactly `len` bytes long.
fn target_of_line(prefix: &str, len: usize) -> String {
    let filler = len - "GET ".len() - prefix.len() - " HTTP/1.1".len();
    format!("{prefix}{}", "a".repeat(filler))
}

/// An `x-big` header line that makes the header fields (`Host: t` and it, counted as
/// `name: value` plus CRLF each) exactly `bytes` long.
fn big_header_of(bytes: usize) -> String {
    let host = "host".len() + "t".len() + 4;
    let value = bytes - host - "x-big".len() - 4;
    format!("x-big: {}\r\n", "v".repeat(value))
}

/// `count` header lines after `Host`, so the request has `count + 1` fields.
fn header_lines(count: usize) -> String {
    (0..count).map(|i| format!("x-h-{i}: {i}\r\n")).collect()
}

/// The upstream's echo of a forwarded request.
fn echo(response: &RawResponse) -> serde_json::Value {
    assert_eq!(response.status, 200, "{response:?}");
    serde_json::from_slice(&response.body).expect("echo body is JSON")
}

/// With both Content-Length and Transfer-Encoding, sluice reads the body as chunked, answers
/// once with `Connection: close` and closes: a request pipelined behind it, which a peer
/// reading by Content-Length would have seen differently, never reaches the upstream.
#[tokio::test]
async fn a_request_with_both_lengths_smuggles_nothing() {
    let (up, sluice) = setup(|p| p).await;
    let smuggled = "GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n";

    // By Content-Length the body is `0\r\n\r` and the rest garbage; by chunked it is empty
    // and `GET /smuggled` is a second request.
    let cl_first = format!(
        "POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\
         Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"
    );
    let responses = until_closed(&sluice, cl_first.as_bytes()).await;
    assert_eq!(responses.len(), 1, "exactly one response: {responses:?}");
    assert_eq!(responses[0].header("connection"), Some("close"));
    let seen = echo(&responses[0]);
    assert_eq!(seen["path"], "/first");
    let headers = seen["headers"].as_object().unwrap();
    assert!(
        !headers.contains_key("content-length"),
        "the client's Content-Length is not forwarded next to sluice's own framing: {seen}"
    );

    // By chunked the body is `hello`; by Content-Length it would run into the next request.
    let te_first = format!(
        "POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\
         Content-Length: 40\r\n\r\n5\r\nhello\r\n0\r\n\r\n{smuggled}"
    );
    let responses = until_closed(&sluice, te_first.as_bytes()).await;
    assert_eq!(responses.len(), 1, "exactly one response: {responses:?}");
    assert_eq!(responses[0].status, 200, "{:?}", responses[0]);
    assert_eq!(responses[0].header("connection"), Some("close"));
    assert_eq!(
        responses[0].body, b"5",
        "the upstream got the chunked body, 5 bytes"
    );

    assert_eq!(
        up.paths(),
        ["/first", "/upload"],
        "/smuggled never reached the upstream"
    );
    assert_eq!(up.uploads(), [UploadSeen::Complete(5)]);
}

/// Two different Content-Length values are refused with 400 and the connection closed;
/// nothing, not even the pipelined request, is forwarded.
#[tokio::test]
async fn conflicting_content_lengths_are_refused() {
    let (up, sluice) = setup(|p| p).await;
    for lengths in [
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "Content-Length: 5, 6\r\n",
    ] {
        let request = format!(
            "POST /upload HTTP/1.1\r\nHost: t\r\n{lengths}\r\nhello!\
             GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
        );
        let responses = until_closed(&sluice, request.as_bytes()).await;
        assert_eq!(responses.len(), 1, "{lengths:?}: {responses:?}");
        assert_bare(&responses[0], 400);
    }
    assert_eq!(up.paths(), Vec::<String>::new(), "nothing was forwarded");
}

/// A chunk size that is not hex, after a first good chunk: the upstream exchange fails
/// because of the client's body, so the answer is 400 (not 502), counted as the client's
/// error and never as the upstream's.
#[tokio::test]
async fn a_malformed_chunked_body_is_the_clients_400() {
    let (up, sluice) = setup(|p| p).await;
    let request = b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n\
                    5\r\nhello\r\nzz\r\n";
    let responses = until_closed(&sluice, request).await;
    assert_eq!(responses.len(), 1, "{responses:?}");
    assert_problem(&responses[0], 400);

    let all = parse_metrics(&sluice.metrics().await);
    let refused = |reason| metric_sum(&all, "sluice_refused_requests_total", &[("reason", reason)]);
    assert_eq!(refused("body_malformed"), 1.0);
    assert_eq!(refused("body_too_large"), 0.0);
    let upstream_errors = metric_sum(&all, "sluice_upstream_errors_total", &[("upstream", "api")]);
    assert_eq!(upstream_errors, 0.0, "the upstream is not blamed");
    let outcome = |outcome| {
        metric_sum(
            &all,
            "sluice_requests_total",
            &[("route", "default"), ("outcome", outcome)],
        )
    };
    assert_eq!(outcome("client_error"), 1.0);
    assert_eq!(outcome("upstream_error"), 0.0);
    assert_eq!(outcome("forwarded"), 0.0);
    // The upstream may have seen the good chunk before the exchange broke; never a whole body.
    for seen in up.uploads() {
        assert!(matches!(seen, UploadSeen::Broken(n) if n <= 5), "{seen:?}");
    }
}

/// README (Security, Framing): a connection cut mid-body is the client's fault: `400` if
/// nothing was answered yet, counted as `body_malformed` and under `client_error`, never as
/// an upstream error. The client sends 10 of the 100 bytes it announced, waits until the
/// upstream is reading the body, then closes its sending side (it can still read the answer).
#[tokio::test]
async fn a_connection_cut_mid_body_is_the_clients_400() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (up, sluice) = setup(|p| p).await;
    let mut stream = tokio::net::TcpStream::connect(sluice.addr())
        .await
        .expect("connect");
    stream
        .write_all(b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .expect("send the head and 10 bytes");
    support::wait_for(WITHIN, "the upstream to get the request", || async {
        up.paths() == ["/upload"]
    })
    .await;
    stream.shutdown().await.expect("close the sending side");
    let mut received = Vec::new();
    tokio::time::timeout(WITHIN, stream.read_to_end(&mut received))
        .await
        .expect("sluice answers and closes within the bound")
        .expect("read the answer");
    let responses = parse_responses(&received);
    assert_eq!(responses.len(), 1, "{responses:?}");
    assert_problem(&responses[0], 400);

    let all = parse_metrics(&sluice.metrics().await);
    let refused = |reason| metric_sum(&all, "sluice_refused_requests_total", &[("reason", reason)]);
    assert_eq!(refused("body_malformed"), 1.0);
    let upstream_errors = metric_sum(&all, "sluice_upstream_errors_total", &[("upstream", "api")]);
    assert_eq!(upstream_errors, 0.0, "the upstream is not blamed");
    let outcome = |outcome| {
        metric_sum(
            &all,
            "sluice_requests_total",
            &[("route", "default"), ("outcome", outcome)],
        )
    };
    assert_eq!(outcome("client_error"), 1.0);
    assert_eq!(outcome("upstream_error"), 0.0);
    support::wait_for(WITHIN, "the upstream to see the body end", || async {
        !up.uploads().is_empty()
    })
    .await;
    assert_eq!(up.uploads(), [UploadSeen::Broken(10)], "never a whole body");
}

/// Default limits: 8 KiB request line (414), 32 KiB of header fields and 100 fields (431 with
/// a problem body); a head past twice the limits is cut by the parser with a bare 431.
#[tokio::test]
async fn heads_over_the_default_limits_are_refused() {
    let (up, sluice) = setup(|p| p).await;

    // ~40 KB of one header: over 32 KiB, under twice.
    let r = ask(&sluice, &get("/big", &big_header_of(40_000))).await;
    let problem = assert_problem(&r, 431);
    assert!(
        problem["detail"].as_str().unwrap().contains("32768"),
        "{problem}"
    );
    // ~200 KB: past the parser's own cap.
    let r = ask(&sluice, &get("/huge", &big_header_of(200_000))).await;
    assert_bare(&r, 431);
    // 101 fields.
    let r = ask(&sluice, &get("/many", &header_lines(100))).await;
    assert_problem(&r, 431);
    // A request line one byte over 8 KiB.
    let r = ask(&sluice, &get(&target_of_line("/long/", 8193), "")).await;
    assert_problem(&r, 414);

    // At the limits, forwarded.
    let at_line = target_of_line("/line-ok/", 8192);
    let r = ask(&sluice, &get(&at_line, "")).await;
    assert_eq!(echo(&r)["path"], at_line.as_str());
    let r = ask(&sluice, &get("/bytes-ok", &big_header_of(32_768))).await;
    assert_eq!(echo(&r)["path"], "/bytes-ok");

    assert_eq!(up.paths(), [at_line.as_str(), "/bytes-ok"]);
    let all = parse_metrics(&sluice.metrics().await);
    let refused = |reason| metric_sum(&all, "sluice_refused_requests_total", &[("reason", reason)]);
    // The parser's bare 431 never reaches the gateway, so it is not counted.
    assert_eq!(refused("header_bytes"), 1.0);
    assert_eq!(refused("header_count"), 1.0);
    assert_eq!(refused("request_line"), 1.0);
    let unrouted_refused = metric_sum(
        &all,
        "sluice_requests_total",
        &[("route", ""), ("outcome", "refused")],
    );
    assert_eq!(unrouted_refused, 3.0);
}

/// Smaller configured limits hold at their exact boundaries: at the limit forwarded, one
/// over refused with a problem body, past twice cut by the parser.
#[tokio::test]
async fn configured_head_limits_hold_at_their_boundaries() {
    let (up, sluice) = setup(|p| {
        p.server("max_header_bytes", "4KiB")
            .server("max_headers", 20)
            .server("max_request_line", "1KiB")
    })
    .await;

    let at_line = target_of_line("/line-ok/", 1024);
    let r = ask(&sluice, &get(&at_line, "")).await;
    assert_eq!(echo(&r)["path"], at_line.as_str());
    let r = ask(&sluice, &get(&target_of_line("/long/", 1025), "")).await;
    let problem = assert_problem(&r, 414);
    assert!(
        problem["detail"].as_str().unwrap().contains("1024"),
        "{problem}"
    );

    let r = ask(&sluice, &get("/bytes-ok", &big_header_of(4096))).await;
    assert_eq!(echo(&r)["path"], "/bytes-ok");
    let r = ask(&sluice, &get("/big", &big_header_of(4097))).await;
    let problem = assert_problem(&r, 431);
    assert!(
        problem["detail"].as_str().unwrap().contains("4096"),
        "{problem}"
    );
    // The parser's cap is twice (1 KiB + 4 KiB) of buffered head; it checks the cap between
    // reads, so a head a little past it may still arrive whole and get the problem answer.
    // Far past it, the parser cuts it.
    let r = ask(&sluice, &get("/huge", &big_header_of(100_000))).await;
    assert_bare(&r, 431);

    let r = ask(&sluice, &get("/count-ok", &header_lines(19))).await;
    assert_eq!(echo(&r)["path"], "/count-ok");
    let r = ask(&sluice, &get("/many", &header_lines(20))).await;
    let problem = assert_problem(&r, 431);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("21 header fields"),
        "{problem}"
    );
    // Past twice the fields: the parser's bare 431.
    let r = ask(&sluice, &get("/too-many", &header_lines(45))).await;
    assert_bare(&r, 431);

    assert_eq!(up.paths(), [at_line.as_str(), "/bytes-ok", "/count-ok"]);
    let all = parse_metrics(&sluice.metrics().await);
    let refused = |reason| metric_sum(&all, "sluice_refused_requests_total", &[("reason", reason)]);
    assert_eq!(refused("request_line"), 1.0);
    assert_eq!(refused("header_bytes"), 1.0);
    assert_eq!(refused("header_count"), 1.0);
}

/// `len` bytes of the upload pattern, which the upstream's `/upload` checks.
fn pattern(len: usize) -> Vec<u8> {
    pattern_chunk()[..len].to_vec()
}

/// A request to `/upload` with a Content-Length body.
fn upload(method: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "{method} /upload HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// Only the head of an upload declaring `len` bytes: the body is never sent.
fn declared(method: &str, len: usize) -> Vec<u8> {
    format!("{method} /upload HTTP/1.1\r\nHost: t\r\nContent-Length: {len}\r\n\r\n").into_bytes()
}

/// A chunked body of the pattern in chunks of these sizes, with the last chunk when `end`.
fn chunked(method: &str, sizes: &[usize], end: bool) -> Vec<u8> {
    let mut request =
        format!("{method} /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
            .into_bytes();
    let body = pattern(sizes.iter().sum());
    let mut at = 0;
    for size in sizes {
        request.extend_from_slice(format!("{size:x}\r\n").as_bytes());
        request.extend_from_slice(&body[at..at + size]);
        request.extend_from_slice(b"\r\n");
        at += size;
    }
    if end {
        request.extend_from_slice(b"0\r\n\r\n");
    }
    request
}

/// The upstream's answer to an upload that went through whole: the byte count, in order.
fn assert_uploaded(response: &RawResponse, len: usize) {
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(
        response.header("x-pattern-ok"),
        Some("true"),
        "{response:?}"
    );
    assert_eq!(response.body, len.to_string().as_bytes(), "{response:?}");
}

/// `max_body`: a declared length over it is refused with 413 from the head alone (the body
/// is never sent here), a chunked body is cut once it grows past it, and a body of exactly
/// the limit goes through intact. A route's own `max_body` wins over `server.max_body`, both
/// lower and higher.
#[tokio::test]
async fn bodies_over_max_body_get_413() {
    let (up, sluice) = setup(|p| p.server("max_body", "2KiB")).await;

    // PUT: the route's own 1 KiB. The head alone declares 2000 bytes.
    let started = Instant::now();
    let r = ask(&sluice, &declared("PUT", 2000)).await;
    let problem = assert_problem(&r, 413);
    assert!(
        problem["detail"].as_str().unwrap().contains("1024"),
        "{problem}"
    );
    println!("413 from the head alone after {:?}", started.elapsed());
    assert_eq!(up.paths(), Vec::<String>::new(), "nothing forwarded");

    // A chunked body that grows past 1 KiB, never finished: cut with 413.
    let mut wire = Wire::connect(sluice.addr()).await;
    wire.send(&chunked("PUT", &[600, 600], false))
        .await
        .unwrap();
    let r = wire.response(WITHIN).await;
    let problem = assert_problem(&r, 413);
    assert!(
        problem["detail"].as_str().unwrap().contains("1024"),
        "{problem}"
    );
    assert_eq!(
        r.header("connection"),
        Some("close"),
        "the 413 of a cut body says the connection closes: {r:?}"
    );
    assert!(
        wire.closed_within(WITHIN).await.is_some(),
        "closed after a cut body"
    );
    // The upstream's handler saw the body break off, or was dropped with it: never a whole body.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for seen in up.uploads() {
        assert!(
            matches!(seen, UploadSeen::Broken(n) if n <= 1024),
            "{seen:?}"
        );
    }
    let broken = up.uploads().len();
    println!("the upstream saw the cut body as {:?}", up.uploads());

    // Exactly 1 KiB, by length and chunked: forwarded intact.
    assert_uploaded(&ask(&sluice, &upload("PUT", &pattern(1024))).await, 1024);
    assert_uploaded(
        &ask(&sluice, &chunked("PUT", &[512, 512], true)).await,
        1024,
    );
    // Over the route's 1 KiB, though under the server's 2 KiB.
    let r = ask(&sluice, &declared("PUT", 1500)).await;
    assert_problem(&r, 413);

    // POST: no max_body of its own, so the server's 2 KiB.
    assert_uploaded(&ask(&sluice, &upload("POST", &pattern(1500))).await, 1500);
    assert_uploaded(&ask(&sluice, &upload("POST", &pattern(2048))).await, 2048);
    let r = ask(&sluice, &declared("POST", 2049)).await;
    let problem = assert_problem(&r, 413);
    assert!(
        problem["detail"].as_str().unwrap().contains("2048"),
        "{problem}"
    );

    // PATCH: its own 4 KiB, above the server's 2 KiB.
    assert_uploaded(&ask(&sluice, &upload("PATCH", &pattern(3000))).await, 3000);
    let r = ask(&sluice, &declared("PATCH", 4097)).await;
    let problem = assert_problem(&r, 413);
    assert!(
        problem["detail"].as_str().unwrap().contains("4096"),
        "{problem}"
    );

    let complete: Vec<UploadSeen> = up.uploads().split_off(broken);
    assert_eq!(
        complete,
        [1024, 1024, 1500, 2048, 3000].map(UploadSeen::Complete),
        "exactly the bodies within their limits reached the upstream, whole"
    );
    let all = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(
            &all,
            "sluice_refused_requests_total",
            &[("reason", "body_too_large")]
        ),
        5.0
    );
    let outcome = |route, outcome| {
        metric_sum(
            &all,
            "sluice_requests_total",
            &[("route", route), ("outcome", outcome)],
        )
    };
    assert_eq!(outcome("own-limit", "client_error"), 3.0);
    assert_eq!(outcome("own-limit", "forwarded"), 2.0);
    assert_eq!(outcome("default", "client_error"), 1.0);
    assert_eq!(outcome("default", "forwarded"), 2.0);
    assert_eq!(outcome("larger-limit", "client_error"), 1.0);
    assert_eq!(outcome("larger-limit", "forwarded"), 1.0);
    assert_eq!(
        metric_sum(&all, "sluice_upstream_errors_total", &[("upstream", "api")]),
        0.0
    );
}
