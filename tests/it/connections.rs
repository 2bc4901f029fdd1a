//! Connection-level defences, against a real sluice over TCP: slow request heads are cut at
//! `header_read_timeout` while normal clients go on being served, `max_connections` holds
//! new connections in the backlog until a slot frees, and silent connections are closed
//! after `idle_timeout`, gracefully, so a slow request in flight still gets its answer.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::wire::{NoResponse, Wire};
use support::{
    metric_sum, parse_metrics, raw_http, Limit, Policy, RawResponse, Route, Sluice, Upstream,
    UpstreamSpec,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous bound for one answer on a shared 2-core machine.
const WITHIN: Duration = Duration::from_secs(10);

/// `server` adds the test's `server:` settings.
fn config(up: &str, server: impl FnOnce(Policy) -> Policy) -> Policy {
    server(Policy::new())
        .upstream(
            "api",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("10s"),
        )
        .route(Route::new("default", "/").upstream("api"))
}

async fn setup(server: impl FnOnce(Policy) -> Policy) -> (Upstream, Sluice) {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url(), server)).await;
    (up, sluice)
}

async fn open_connections(sluice: &Sluice) -> f64 {
    let all = parse_metrics(&sluice.metrics().await);
    metric_sum(&all, "sluice_open_connections", &[("listener", "gateway")])
}

/// A keep-alive `GET path` on an open connection.
fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

fn assert_echo(response: &RawResponse, path: &str) {
    assert_eq!(response.status, 200, "{response:?}");
    let echo: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    assert_eq!(echo["path"], path);
}

/// The soft limit on open files, from /proc/self/limits.
fn open_files_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files in /proc/self/limits");
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

/// The `q` quantile of sorted `samples`.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// How one slowloris connection ended, timed from just before it connected and from when
/// its partial head had been sent.
enum Slow {
    Closed {
        since_start: Duration,
        since_head: Duration,
    },
    Open,
    Failed(String),
}

/// Connects, sends a partial head, then one more header byte every second, until sluice
/// closes the connection or 10 s pass.
async fn slowloris(addr: std::net::SocketAddr, ready: Arc<AtomicUsize>) -> Slow {
    let start = Instant::now();
    let mut stream = match TcpStream::connect(addr).await {
        Ok(stream) => stream,
        Err(err) => return Slow::Failed(format!("connect: {err}")),
    };
    if let Err(err) = stream
        .write_all(b"GET /slowloris HTTP/1.1\r\nHost: t\r\nX-Trickle: ")
        .await
    {
        return Slow::Failed(format!("send the partial head: {err}"));
    }
    let head_sent = Instant::now();
    ready.fetch_add(1, Ordering::SeqCst);
    // One reading of the clock for both, so that `since_start - since_head` (the connect and
    // send) cannot come out negative on a loaded machine.
    let closed = || {
        let now = Instant::now();
        Slow::Closed {
            since_start: now - start,
            since_head: now - head_sent,
        }
    };
    let second = Duration::from_secs(1);
    let mut tick = tokio::time::interval_at((head_sent + second).into(), second);
    let deadline = start + Duration::from_secs(10);
    let mut buf = [0u8; 1024];
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => return closed(),
                Ok(_) => {}
            },
            _ = tick.tick() => {
                if stream.write_all(b"a").await.is_err() {
                    return closed();
                }
            }
            _ = tokio::time::sleep_until(deadline.into()) => return Slow::Open,
        }
    }
}

/// Normal requests until `stop`: over one keep-alive client, or a new connection each time.
/// Each request's latency, or a panic on any failure.
async fn normal_client(
    sluice_url: String,
    addr: std::net::SocketAddr,
    fresh_connections: bool,
    stop: Arc<AtomicBool>,
) -> Vec<Duration> {
    let client = support::client();
    let mut latencies = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        if fresh_connections {
            let response = raw_http(
                addr,
                "GET /normal/fresh HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
            )
            .await;
            assert_eq!(response.status, 200, "{response:?}");
        } else {
            let response = client
                .get(format!("{sluice_url}/normal/kept"))
                .send()
                .await
                .expect("a normal request during the slowloris");
            assert_eq!(response.status(), 200);
            response.bytes().await.expect("its body");
        }
        latencies.push(started.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    latencies
}

/// 1,000 connections trickle a request head one byte a second. sluice closes every one of
/// them at `header_read_timeout` (3 s), while normal clients, on kept and on new connections,
/// are all served with low latency throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_heads_are_cut_while_normal_clients_are_served() {
    let _heavy = support::heavy().await;
    const SLOW: usize = 1000;
    let limit = open_files_limit();
    assert!(
        limit >= 2 * SLOW as u64 + 500,
        "this test needs {} open files (both ends of {SLOW} connections); `ulimit -n` is {limit}",
        2 * SLOW + 500
    );
    let test_started = Instant::now();
    let (up, sluice) = setup(|p| p.server("header_read_timeout", "3s")).await;
    let addr = sluice.addr();

    // In batches of 100, well within any listen backlog (the kernel caps sluice's 1024 at
    // net.core.somaxconn), so that no SYN is dropped and waits a second to be sent again.
    const BATCH: usize = 100;
    let ready = Arc::new(AtomicUsize::new(0));
    let opening = Instant::now();
    let deadline = opening + WITHIN;
    let mut slow = Vec::with_capacity(SLOW);
    while slow.len() < SLOW {
        slow.extend((0..BATCH).map(|_| tokio::spawn(slowloris(addr, Arc::clone(&ready)))));
        while ready.load(Ordering::SeqCst) < slow.len() {
            assert!(
                Instant::now() < deadline,
                "only {} of {SLOW} slowloris connections sent their head within {WITHIN:?}",
                ready.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    println!(
        "{SLOW} slowloris connections open in {:?}",
        opening.elapsed()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let normal: Vec<_> = [false, false, true]
        .into_iter()
        .map(|fresh| tokio::spawn(normal_client(sluice.url(), addr, fresh, Arc::clone(&stop))))
        .collect();

    // All of them are open in sluice at once (the first closes 3 s after its accept).
    let counting = Instant::now();
    loop {
        let held = open_connections(&sluice).await;
        if held >= SLOW as f64 {
            break;
        }
        assert!(
            counting.elapsed() < Duration::from_secs(1),
            "sluice_open_connections is {held} while {SLOW} slowloris connections are held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut since_start = Vec::new();
    let mut since_head = Vec::new();
    let mut connect = Vec::new();
    for handle in slow {
        match handle.await.unwrap() {
            Slow::Closed {
                since_start: a,
                since_head: b,
            } => {
                since_start.push(a);
                since_head.push(b);
                connect.push(a - b);
            }
            Slow::Open => panic!("a slowloris connection was still open after 10 s"),
            Slow::Failed(why) => panic!("a slowloris connection failed: {why}"),
        }
    }
    // Normal clients go on a little after the last slowloris connection is closed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let mut latencies = Vec::new();
    let mut kept = 0;
    for (i, handle) in normal.into_iter().enumerate() {
        let mine = handle.await.expect("normal client");
        if i < 2 {
            kept += mine.len();
        }
        latencies.extend(mine);
    }

    since_start.sort();
    since_head.sort();
    latencies.sort();
    let (p50, p99, max) = (
        quantile(&latencies, 0.5),
        quantile(&latencies, 0.99),
        *latencies.last().unwrap(),
    );
    connect.sort();
    println!(
        "slowloris connect+send: p50 {:?}, max {:?}, {} over 500 ms",
        quantile(&connect, 0.5),
        connect[SLOW - 1],
        connect
            .iter()
            .filter(|d| **d > Duration::from_millis(500))
            .count()
    );
    println!(
        "slowloris closed {:?}..{:?} after their head, {:?}..{:?} after connecting; \
         normal requests: {} ({kept} kept-alive), p50 {p50:?}, p99 {p99:?}, max {max:?}",
        since_head[0],
        since_head[SLOW - 1],
        since_start[0],
        since_start[SLOW - 1],
        latencies.len(),
    );
    assert_eq!(since_start.len(), SLOW);
    assert!(
        since_start[SLOW - 1] <= Duration::from_secs(6),
        "every slowloris connection is closed within header_read_timeout (3 s) + 3 s; the \
         last took {:?}",
        since_start[SLOW - 1]
    );
    // sluice counts from the accept, which comes after the client starts connecting.
    assert!(
        since_start[0] >= Duration::from_millis(2900),
        "not before header_read_timeout: one was closed {:?} after it started connecting",
        since_start[0]
    );
    assert!(
        latencies.len() >= 50,
        "only {} normal requests",
        latencies.len()
    );
    assert!(p99 < Duration::from_millis(500), "p99 {p99:?}");
    let paths = up.paths();
    assert_eq!(
        paths.len(),
        latencies.len(),
        "every normal request was forwarded once"
    );
    assert!(paths.iter().all(|p| p.starts_with("/normal/")), "{paths:?}");

    // Every connection is gone once the clients are: the gauge returns to zero.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let open = open_connections(&sluice).await;
        if open == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} connections still open");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let whole = test_started.elapsed();
    println!("whole test: {whole:?}");
    assert!(
        whole < Duration::from_secs(20),
        "the whole test took {whole:?}"
    );
}

/// With `max_connections: 4`, four connected clients hold every slot: a fifth connects (the
/// kernel completes the handshake) but its request is not served until one of them closes.
#[tokio::test]
async fn past_max_connections_a_new_connection_waits_for_a_slot() {
    let (up, sluice) = setup(|p| p.server("max_connections", 4)).await;
    let mut held = Vec::new();
    for i in 0..4 {
        let mut wire = Wire::connect(sluice.addr()).await;
        wire.send(&get(&format!("/held/{i}"))).await.unwrap();
        assert_echo(&wire.response(WITHIN).await, &format!("/held/{i}"));
        held.push(wire);
    }
    assert_eq!(open_connections(&sluice).await, 4.0);

    let mut fifth = Wire::connect(sluice.addr()).await;
    fifth.send(&get("/fifth")).await.unwrap();
    assert_eq!(
        fifth.try_response(Duration::from_secs(1)).await.err(),
        Some(NoResponse::Timeout),
        "the fifth connection is not served while four are held"
    );
    assert_eq!(open_connections(&sluice).await, 4.0);
    assert!(!up.paths().contains(&"/fifth".to_string()));

    let released = Instant::now();
    drop(held.remove(0));
    assert_echo(&fifth.response(WITHIN).await, "/fifth");
    let waited = released.elapsed();
    println!("the fifth connection was served {waited:?} after a slot freed");
    assert!(
        waited < Duration::from_secs(2),
        "served {waited:?} after a slot freed"
    );
    assert_eq!(
        open_connections(&sluice).await,
        4.0,
        "three held and the fifth"
    );

    // The held connections are still served.
    for (i, wire) in held.iter_mut().enumerate() {
        wire.send(&get(&format!("/again/{i}"))).await.unwrap();
        assert_echo(&wire.response(WITHIN).await, &format!("/again/{i}"));
    }
}

/// An h2c connection to sluice, with its connection task.
async fn h2c<B>(
    sluice: &Sluice,
) -> (
    hyper::client::conn::http2::SendRequest<B>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
)
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(sluice.addr()).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2c handshake with sluice");
    (sender, tokio::spawn(connection))
}

/// An HTTP/2 GET of `path` on `sender`: the status and the body.
async fn h2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    path: &str,
) -> (u16, Bytes) {
    let request = http::Request::get(format!("http://t{path}"))
        .body(Empty::new())
        .unwrap();
    let response = sender.send_request(request).await.expect("h2 request");
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

fn idle(policy: Policy) -> Policy {
    policy
        .server("idle_timeout", "1s")
        .server("header_read_timeout", "30s")
}

/// A silent connection is closed after `idle_timeout` (1 s), on HTTP/1.1 keep-alive and on
/// h2c alike; `header_read_timeout` is 30 s, so it is the idle timeout that acts.
#[tokio::test]
async fn silent_connections_are_closed_after_idle_timeout() {
    let (_up, sluice) = setup(idle).await;

    let http1 = async {
        let mut wire = Wire::connect(sluice.addr()).await;
        wire.send(&get("/idle/h1")).await.unwrap();
        let response = wire.response(WITHIN).await;
        assert_echo(&response, "/idle/h1");
        assert_eq!(response.header("connection"), None, "kept alive");
        wire.closed_within(Duration::from_secs(5)).await
    };
    let http2 = async {
        let (mut sender, connection) = h2c(&sluice).await;
        let (status, _) = h2_get(&mut sender, "/idle/h2").await;
        assert_eq!(status, 200);
        let silent = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), connection)
            .await
            .ok()
            .map(|_| silent.elapsed())
    };
    let (http1, http2) = tokio::join!(http1, http2);
    println!("silent connections closed after: HTTP/1.1 {http1:?}, h2c {http2:?}");
    for (protocol, closed) in [("HTTP/1.1", http1), ("h2c", http2)] {
        let closed = closed.unwrap_or_else(|| panic!("{protocol}: still open after 5 s"));
        assert!(
            closed >= Duration::from_millis(900) && closed <= Duration::from_secs(3),
            "{protocol}: closed after {closed:?}, expected about 1 s"
        );
    }
}

/// A request that takes 2.5 s upstream, longer than `idle_timeout` (1 s) of silence on the
/// client connection, still gets its whole answer; then the connection is closed.
#[tokio::test]
async fn a_slow_request_in_flight_outlives_idle_timeout() {
    let (_up, sluice) = setup(idle).await;

    let http1 = async {
        let mut wire = Wire::connect(sluice.addr()).await;
        let started = Instant::now();
        wire.send(&get("/slow/2500")).await.unwrap();
        let response = wire.response(WITHIN).await;
        let took = started.elapsed();
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.body, b"slow");
        assert_eq!(
            response.header("connection"),
            Some("close"),
            "the idle timeout asked for a graceful close"
        );
        let closed = wire.closed_within(Duration::from_secs(2)).await;
        (took, closed)
    };
    let http2 = async {
        let (mut sender, connection) = h2c(&sluice).await;
        let started = Instant::now();
        let (status, body) = h2_get(&mut sender, "/slow/2500").await;
        let took = started.elapsed();
        assert_eq!(status, 200);
        assert_eq!(&body[..], b"slow");
        let answered = Instant::now();
        let closed = tokio::time::timeout(Duration::from_secs(2), connection)
            .await
            .ok()
            .map(|_| answered.elapsed());
        (took, closed)
    };
    let ((took1, closed1), (took2, closed2)) = tokio::join!(http1, http2);
    println!(
        "slow requests answered after HTTP/1.1 {took1:?}, h2c {took2:?}; \
         then closed after {closed1:?}, {closed2:?}"
    );
    for (protocol, took, closed) in [("HTTP/1.1", took1, closed1), ("h2c", took2, closed2)] {
        assert!(took >= Duration::from_millis(2500), "{protocol}: {took:?}");
        assert!(
            closed.is_some(),
            "{protocol}: still open 2 s after its answer"
        );
    }
}

/// With `header_read_timeout: 1s`, a client that stops half-way through its head is
/// disconnected after about 1 s; so is one that connects and sends nothing, or stops in the
/// middle of the HTTP/2 preface.
#[tokio::test]
async fn header_read_timeout_is_configurable() {
    let (up, sluice) = setup(|p| p.server("header_read_timeout", "1s")).await;
    let stalled = |first_bytes: &'static [u8]| {
        let addr = sluice.addr();
        async move {
            let mut wire = Wire::connect(addr).await;
            wire.send(first_bytes).await.unwrap();
            wire.closed_within(Duration::from_secs(5)).await
        }
    };
    let (half_head, nothing, half_preface) = tokio::join!(
        stalled(b"GET /half HTTP/1.1\r\nHost: t\r\n"),
        stalled(b""),
        stalled(b"PRI * HTTP/2.0\r\n"),
    );
    println!(
        "closed after: half a head {half_head:?}, nothing {nothing:?}, \
         half the h2 preface {half_preface:?}"
    );
    for (client, closed) in [
        ("half a head", half_head),
        ("nothing sent", nothing),
        ("half the h2 preface", half_preface),
    ] {
        let closed = closed.unwrap_or_else(|| panic!("{client}: still open after 5 s"));
        assert!(
            closed >= Duration::from_millis(900) && closed <= Duration::from_secs(3),
            "{client}: closed after {closed:?}, expected about 1 s"
        );
    }
    assert_eq!(up.paths(), Vec::<String>::new());
}

/// A request answered before its body is read (a 429, a route's own `respond:`) has its
/// small HTTP/1.1 body read and dropped first, even when the body arrives after the head:
/// the connection stays open,
/// and the client's next request on it is answered. Answered with its body unread, the
/// connection would be closed after an answer that did not say so, and the next request on
/// it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_keep_their_connection() {
    let up = Upstream::start().await;
    let policy = Policy::new()
        .upstream("api", up.url())
        .route(
            Route::new("limited", "/upload")
                .upstream("api")
                .limit(Limit::requests("one", 1, "1m").key(["header:x-api-key"])),
        )
        .route(Route::new("open", "/open").respond(200, "ok"));
    let sluice = Sluice::start(&policy).await;
    let body = "x".repeat(2000);
    let mut wire = Wire::connect(sluice.addr()).await;
    let mut statuses = Vec::new();
    // `/upload` reads the body at the upstream; `/open` is answered by sluice itself.
    for path in ["/upload", "/upload", "/open", "/upload", "/upload", "/open"] {
        wire.post_body_after_head(path, "x-api-key: k\r\n", body.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("{path} after {statuses:?} on the kept connection: {e}"));
        match wire.try_response(WITHIN).await {
            Ok(answer) => statuses.push(answer.status),
            Err(e) => panic!("{path} after {statuses:?} on the kept connection: {e:?}"),
        }
    }
    assert_eq!(statuses, [200, 429, 200, 429, 429, 200]);
    assert!(!wire.is_closed(), "the connection is kept");
    assert_eq!(up.hits(), 1, "only the first request was forwarded");
    // A body too large to read and drop is not waited for: the answer says the connection
    // closes, so no client sends its next request into it.
    wire.send(
        b"POST /upload HTTP/1.1\r\nHost: x\r\nx-api-key: k\r\ncontent-length: 1048576\r\n\r\n",
    )
    .await
    .expect("a head");
    let answer = wire.response(WITHIN).await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.header("connection"), Some("close"), "{answer:?}");
}

/// An upload the upstream answers from its head (413), before sluice has sent it the body,
/// leaves the rest of that body on the client's HTTP/1.1 connection, which is then closed:
/// the relayed 413 says `Connection: close`, so no keep-alive client sends its next request
/// into it. A small body the upstream reads whole keeps the connection for the next request.
/// On h2c the refused stream is reset alone: no `Connection` field, and the connection
/// carries the next request.
#[tokio::test]
async fn an_upstream_answer_before_the_whole_body_says_the_connection_closes() {
    let (up, sluice) = setup(|p| p).await;
    let mut wire = Wire::connect(sluice.addr()).await;
    let small = "x".repeat(2000);
    wire.post_body_after_head("/upload", "", small.as_bytes())
        .await
        .unwrap();
    let read = wire.response(WITHIN).await;
    assert_eq!(
        (read.status, &read.body[..]),
        (200, &b"2000"[..]),
        "{read:?}"
    );
    assert_eq!(read.header("connection"), None, "kept: {read:?}");
    wire.send(&get("/after-upload")).await.unwrap();
    assert_echo(&wire.response(WITHIN).await, "/after-upload");

    // 1 MiB declared, 16 KiB sent: the upstream answers from the head and reads no more.
    wire.send(b"POST /too-large HTTP/1.1\r\nHost: t\r\ncontent-length: 1048576\r\n\r\n")
        .await
        .unwrap();
    wire.send(&[b'x'; 16 * 1024]).await.unwrap();
    let refused = wire.response(WITHIN).await;
    assert_eq!(refused.status, 413, "{refused:?}");
    assert_eq!(
        refused.header("connection"),
        Some("close"),
        "the upstream's early answer says the connection closes: {refused:?}"
    );
    assert!(
        wire.closed_within(WITHIN).await.is_some(),
        "and the connection is closed"
    );

    let (mut sender, _connection) = h2c::<BoxBody<Bytes, std::convert::Infallible>>(&sluice).await;
    // A body that sends 16 KiB of its declared 1 MiB and then nothing.
    let first = Frame::data(Bytes::from(vec![b'x'; 16 * 1024]));
    let unending =
        futures_util::stream::once(async { Ok(first) }).chain(futures_util::stream::pending());
    let upload = http::Request::post("http://t/too-large")
        .header("content-length", "1048576")
        .body(BodyExt::boxed(StreamBody::new(unending)))
        .unwrap();
    let refused = tokio::time::timeout(WITHIN, sender.send_request(upload))
        .await
        .expect("an h2 answer in time")
        .expect("the upstream's 413 on h2c");
    assert_eq!(refused.status(), 413);
    assert_eq!(
        refused.headers().get("connection"),
        None,
        "no such field in HTTP/2"
    );
    let next = http::Request::get("http://t/after-h2")
        .body(Empty::new().map_err(|never| match never {}).boxed())
        .unwrap();
    let next = tokio::time::timeout(WITHIN, sender.send_request(next))
        .await
        .expect("an h2 answer in time")
        .expect("the h2c connection carries the next request");
    assert_eq!(next.status(), 200);
    assert_eq!(
        up.paths(),
        [
            "/upload",
            "/after-upload",
            "/too-large",
            "/too-large",
            "/after-h2"
        ]
    );
}

/// A request that waits for `100 Continue` before its body, on a spent limit, is told 429 at
/// once, never `100 Continue` first (RFC 9110 §10.1.1: the final status may come without
/// reading the content): it is not asked to upload what would be dropped. The connection
/// closes after it, since the client may then send the body or not. An admitted one gets
/// `100 Continue` and its answer.
#[tokio::test]
async fn a_refused_request_expecting_100_continue_is_answered_at_once() {
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .upstream("api", UpstreamSpec::new(&up.url()).timeout("10s"))
        .route(
            Route::new("default", "/")
                .upstream("api")
                .limit(support::Limit::requests("one", 1, "1m")),
        );
    let sluice = Sluice::start(&yaml).await;
    let mut admitted = Wire::connect(sluice.addr()).await;
    admitted
        .send(b"POST /upload HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\ncontent-length: 5\r\n\r\n")
        .await
        .unwrap();
    let first = admitted.response(WITHIN).await;
    assert_eq!(
        first.status, 100,
        "the admitted request is asked for its body"
    );
    admitted.send(b"hello").await.unwrap();
    assert_eq!(admitted.response(WITHIN).await.status, 200);

    let mut refused = Wire::connect(sluice.addr()).await;
    refused
        .send(b"POST /upload HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\ncontent-length: 5\r\n\r\n")
        .await
        .unwrap();
    let answer = refused.response(WITHIN).await;
    assert_eq!(
        answer.status, 429,
        "the refusal comes first, without 100 Continue"
    );
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(
        refused.closed_within(WITHIN).await.is_some(),
        "then the connection closes"
    );
}
