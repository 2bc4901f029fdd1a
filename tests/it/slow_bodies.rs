//! A client that trickles its request body cannot hold an upstream connection: the body must
//! arrive whole within `body_timeout`, and after `body_rate_grace` at `body_min_rate` or more.
//!
//! Each case runs through the real sluice binary, over HTTP/1.1 (a raw TCP client) and HTTP/2
//! (a hyper h2c client), against a real upstream written at the byte level so the test sees
//! exactly when its connection ends and how much of the body reached it:
//! - an upstream that waits for the whole body: the client gets 408 problem+json, and the
//!   upstream's request is aborted;
//! - an upstream that answers at once and then reads on: the client gets that answer, then its
//!   connection (HTTP/1.1) or stream (HTTP/2) is closed, and the upstream's request is aborted.
//!
//! Every cut is counted in `sluice_refused_requests_total{reason="body_slow"}`, exactly; a
//! body sent at a normal rate, or in one go, is untouched. Time bounds are generous (a cut due
//! after 1 s must come within 10 s) so a loaded machine does not fail them.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::grpc::{channel_body, h2c_client};
use support::{metric_sum, parse_metrics, Policy, Route, Sluice};

/// The body every trickling client announces; at one byte per [`TRICKLE`] it would take
/// 100 s, far beyond every bound the tests wait for.
const ANNOUNCED: usize = 1000;
const TRICKLE: Duration = Duration::from_millis(100);
/// The most a cut due after about a second may take on a loaded machine.
const CUT_WITHIN: Duration = Duration::from_secs(10);

/// How one request body ended at the upstream.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    bytes: usize,
    complete: bool,
}

/// A real HTTP/1.1 upstream at the byte level. A request whose path contains `early` is
/// answered `200 early` as soon as its head arrives, and its body is read on afterwards; any
/// other request is answered once its whole body has arrived (`200` and the byte count).
/// Each body's end (whole, or the connection lost part way) is recorded.
struct RawUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_raw(stream, Arc::clone(&record)));
            }
        });
        RawUpstream { addr, seen, task }
    }

    fn seen(&self, path: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|s| s.path == path).cloned().collect()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves requests on one connection, kept alive, until it ends.
async fn serve_raw(mut stream: TcpStream, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let head_end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        buf.drain(..head_end);
        let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .expect("the tests send a Content-Length, which sluice forwards");
        let early = path.contains("early");
        if early
            && stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nearly")
                .await
                .is_err()
        {
            return;
        }
        let mut lost = false;
        while buf.len() < length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    lost = true;
                    break;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let bytes = buf.len().min(length);
        buf.drain(..bytes);
        seen.lock().unwrap().push(Seen {
            path,
            bytes,
            complete: !lost,
        });
        if lost {
            return;
        }
        if !early {
            let body = bytes.to_string();
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            if stream.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
        }
    }
}

/// Four routes to one upstream: `/deadline/*` under `server.body_timeout` (1 s, no minimum
/// rate), `/rate/*` with the route's own 60 s deadline and a 1 KiB/s minimum after the
/// server's 1 s grace.
fn config(upstream: SocketAddr) -> Policy {
    Policy::new()
        .server("body_timeout", "1s")
        .server("body_min_rate", 0)
        .server("body_rate_grace", "1s")
        .upstream("raw", format!("http://{upstream}"))
        .route(Route::new("deadline", "/deadline").upstream("raw"))
        .route(
            Route::new("rate", "/rate")
                .upstream("raw")
                .set("body_timeout", "60s")
                .set("body_min_rate", "1KiB"),
        )
}

async fn refused_slow(sluice: &Sluice) -> f64 {
    let metrics = parse_metrics(&sluice.metrics().await);
    metric_sum(
        &metrics,
        "sluice_refused_requests_total",
        &[("reason", "body_slow")],
    )
}

/// What a trickling client saw.
#[derive(Debug)]
struct Trickled {
    status: u16,
    body: String,
    content_type: String,
    /// From the request head to the response head.
    answered_after: Duration,
    /// From the request head to the end of the connection (HTTP/1.1) or of the request
    /// stream (HTTP/2: its body could no longer be sent).
    cut_after: Duration,
    /// Body bytes the client managed to send.
    sent: usize,
}

/// Over HTTP/1.1: a request head announcing [`ANNOUNCED`] bytes, then one byte each
/// [`TRICKLE`], while the response and the end of the connection are read.
async fn trickle_h1(addr: SocketAddr, path: &str) -> Trickled {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = format!("POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {ANNOUNCED}\r\n\r\n");
    write.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        let mut sent = 0;
        while sent < ANNOUNCED && started.elapsed() < CUT_WITHIN * 2 {
            if write.write_all(b"x").await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(TRICKLE).await;
        }
        sent
    });
    let mut received = Vec::new();
    let mut answered_after = None;
    let cut_after = loop {
        let mut chunk = [0u8; 4096];
        let read = tokio::time::timeout(CUT_WITHIN * 2, read.read(&mut chunk))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{path}: the connection still open after {CUT_WITHIN:?} x2; got {:?}",
                    String::from_utf8_lossy(&received)
                )
            });
        match read {
            Ok(0) | Err(_) => break started.elapsed(),
            Ok(n) => {
                received.extend_from_slice(&chunk[..n]);
                if answered_after.is_none() && received.windows(4).any(|w| w == b"\r\n\r\n") {
                    answered_after = Some(started.elapsed());
                }
            }
        }
    };
    let sent = sender.await.unwrap();
    let text = String::from_utf8_lossy(&received).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{path}: no response before the connection closed: {text:?}"));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let content_type = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Trickled {
        status,
        body: body.to_owned(),
        content_type,
        answered_after: answered_after.expect("answered"),
        cut_after,
        sent,
    }
}

/// Over HTTP/2 (h2c): the same request on a stream whose body is fed one byte each
/// [`TRICKLE`]; the stream is cut when its body can no longer be sent.
async fn trickle_h2(addr: SocketAddr, path: &str) -> Trickled {
    let mut client = h2c_client(addr).await;
    let (tx, body) = channel_body();
    let request = Request::post(format!("http://{addr}{path}"))
        .header("content-length", ANNOUNCED)
        .body(body)
        .unwrap();
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        let mut sent = 0;
        while sent < ANNOUNCED && started.elapsed() < CUT_WITHIN * 2 {
            // A sent frame waits in the channel until the stream takes it; a stream gone
            // drops the channel's receiver and the send fails.
            if tx
                .send(Ok(Frame::data(Bytes::from_static(b"x"))))
                .await
                .is_err()
            {
                break;
            }
            sent += 1;
            tokio::time::sleep(TRICKLE).await;
        }
        // `tx` is dropped only here: the body never ends early by itself.
        (sent, started.elapsed())
    });
    let response = tokio::time::timeout(CUT_WITHIN * 2, client.send_request(request))
        .await
        .unwrap_or_else(|_| panic!("{path}: no response within {CUT_WITHIN:?} x2"))
        .expect("a response");
    let answered_after = started.elapsed();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = tokio::time::timeout(CUT_WITHIN * 2, response.into_body().collect())
        .await
        .expect("the response body ends")
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    let (sent, cut_after) = sender.await.unwrap();
    Trickled {
        status,
        body,
        content_type,
        answered_after,
        cut_after,
        sent,
    }
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

async fn trickle(proto: Proto, addr: SocketAddr, path: &str) -> Trickled {
    match proto {
        Proto::H1 => trickle_h1(addr, path).await,
        Proto::H2 => trickle_h2(addr, path).await,
    }
}

/// The upstream waits for the body: the client gets 408 problem+json once its bound breaks,
/// the upstream's request is aborted part way, and the client's connection or stream ends.
async fn cut_before_the_answer(proto: Proto, path: &str, sluice: &Sluice, upstream: &RawUpstream) {
    let seen = trickle(proto, sluice.addr(), path).await;
    assert_eq!(seen.status, 408, "{proto:?} {path}: {seen:?}");
    assert_eq!(seen.content_type, "application/problem+json", "{seen:?}");
    let problem: serde_json::Value = serde_json::from_str(&seen.body).expect("problem JSON");
    assert_eq!(problem["status"], 408);
    assert!(
        problem["detail"].as_str().unwrap().contains("too slowly"),
        "{problem}"
    );
    // Cut by the bound (due after about 1 s), not before it, and not long after.
    assert!(
        seen.answered_after >= Duration::from_millis(900),
        "{proto:?} {path}: cut before its bound: {seen:?}"
    );
    assert!(
        seen.answered_after < CUT_WITHIN,
        "{proto:?} {path}: {seen:?}"
    );
    assert!(seen.cut_after < CUT_WITHIN, "{proto:?} {path}: {seen:?}");
    assert!(seen.sent < ANNOUNCED / 2, "{seen:?}");
    support::wait_for(CUT_WITHIN, "the upstream's request aborted", || async {
        upstream.seen(path).len() == 1
    })
    .await;
    let at_upstream = &upstream.seen(path)[0];
    assert!(
        !at_upstream.complete && at_upstream.bytes < ANNOUNCED,
        "{at_upstream:?}"
    );
}

/// The upstream answered at once: the client has that answer, then its connection (HTTP/1.1)
/// or stream (HTTP/2) is cut at the bound, and the upstream's request is aborted part way.
async fn cut_after_the_answer(proto: Proto, path: &str, sluice: &Sluice, upstream: &RawUpstream) {
    let seen = trickle(proto, sluice.addr(), path).await;
    assert_eq!(seen.status, 200, "{proto:?} {path}: {seen:?}");
    assert_eq!(seen.body, "early", "{seen:?}");
    assert!(
        seen.cut_after >= Duration::from_millis(900),
        "{proto:?} {path}: cut before its bound: {seen:?}"
    );
    assert!(seen.cut_after < CUT_WITHIN, "{proto:?} {path}: {seen:?}");
    assert!(seen.sent < ANNOUNCED / 2, "{seen:?}");
    support::wait_for(CUT_WITHIN, "the upstream's request aborted", || async {
        upstream.seen(path).len() == 1
    })
    .await;
    let at_upstream = &upstream.seen(path)[0];
    assert!(
        !at_upstream.complete && at_upstream.bytes < ANNOUNCED,
        "{at_upstream:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_not_whole_within_body_timeout_is_cut() {
    let upstream = RawUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    // The cases run side by side: each is bounded on its own.
    tokio::join!(
        cut_before_the_answer(Proto::H1, "/deadline/h1", &sluice, &upstream),
        cut_before_the_answer(Proto::H2, "/deadline/h2", &sluice, &upstream),
        cut_after_the_answer(Proto::H1, "/deadline/early-h1", &sluice, &upstream),
        cut_after_the_answer(Proto::H2, "/deadline/early-h2", &sluice, &upstream),
    );
    assert_eq!(refused_slow(&sluice).await, 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_below_body_min_rate_is_cut_after_the_grace() {
    let upstream = RawUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    // 10 bytes a second against a 1 KiB/s minimum: due about 1 s in (the grace), long before
    // the route's 60 s deadline.
    tokio::join!(
        cut_before_the_answer(Proto::H1, "/rate/h1", &sluice, &upstream),
        cut_before_the_answer(Proto::H2, "/rate/h2", &sluice, &upstream),
        cut_after_the_answer(Proto::H1, "/rate/early-h1", &sluice, &upstream),
        cut_after_the_answer(Proto::H2, "/rate/early-h2", &sluice, &upstream),
    );
    assert_eq!(refused_slow(&sluice).await, 4.0);
}

/// Sends `chunks` chunks of `size` bytes, `gap` apart, over HTTP/1.1 or HTTP/2; the status
/// and body of the answer.
async fn upload(
    proto: Proto,
    addr: SocketAddr,
    path: &str,
    chunks: usize,
    size: usize,
    gap: Duration,
) -> (u16, String) {
    let total = chunks * size;
    match proto {
        Proto::H1 => {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {total}\r\nconnection: close\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            for _ in 0..chunks {
                stream.write_all(&vec![b'u'; size]).await.unwrap();
                tokio::time::sleep(gap).await;
            }
            let mut answer = Vec::new();
            tokio::time::timeout(CUT_WITHIN, stream.read_to_end(&mut answer))
                .await
                .expect("answered")
                .unwrap();
            let text = String::from_utf8_lossy(&answer).into_owned();
            let (head, body) = text.split_once("\r\n\r\n").expect("a response");
            let status = head.split(' ').nth(1).unwrap().parse().unwrap();
            (status, body.to_owned())
        }
        Proto::H2 => {
            let mut client = h2c_client(addr).await;
            let (tx, body) = channel_body();
            let request = Request::post(format!("http://{addr}{path}"))
                .header("content-length", total)
                .body(body)
                .unwrap();
            let feeder = tokio::spawn(async move {
                for _ in 0..chunks {
                    let chunk = Bytes::from(vec![b'u'; size]);
                    tx.send(Ok(Frame::data(chunk))).await.unwrap();
                    tokio::time::sleep(gap).await;
                }
            });
            let response = tokio::time::timeout(CUT_WITHIN, client.send_request(request))
                .await
                .expect("answered")
                .unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            feeder.await.unwrap();
            (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bodies_at_a_normal_rate_are_untouched() {
    let upstream = RawUpstream::start().await;
    let sluice = Sluice::start(&config(upstream.addr)).await;
    for proto in [Proto::H1, Proto::H2] {
        // 1 MiB in one go.
        let path = format!("/rate/whole-{proto:?}");
        let (status, body) =
            upload(proto, sluice.addr(), &path, 16, 64 * 1024, Duration::ZERO).await;
        assert_eq!((status, body.as_str()), (200, "1048576"), "{proto:?}");
        // 2 KiB every 250 ms for 2 s (8 KiB/s) past the 1 s grace: above 1 KiB/s throughout.
        let path = format!("/rate/steady-{proto:?}");
        let gap = Duration::from_millis(250);
        let (status, body) = upload(proto, sluice.addr(), &path, 8, 2048, gap).await;
        assert_eq!((status, body.as_str()), (200, "16384"), "{proto:?}");
        let seen = upstream.seen(&path);
        assert!(seen.len() == 1 && seen[0].complete, "{seen:?}");
    }
    assert_eq!(refused_slow(&sluice).await, 0.0);
}
