//! The request flow of a token route (issue 26), through the real binary, a real Redis and
//! the fake LLM API (`support::llm_upstream`), whose record of what it received and spent is
//! the ground truth:
//! - bodies read whole before the decision hold no more memory than `server.
//!   token_body_budget`, and one HTTP/2 connection reads at most `token_bodies_per_connection`
//!   of them at once (class 7), measured in the sluice process's RSS under the attack that
//!   raised it from 14 to 304 MiB: 2 connections × 150 streams, each sending 1 MiB and never
//!   finishing;
//! - an identity without room is refused before its body is read (class 7);
//! - a calendar quota's period is the one of the decision, after the body, not of the head
//!   (class 5);
//! - a WebSocket upgrade on a token route is refused (class 10);
//! - limits per model: a `model` key part and `when: { model: [...] }` (both stores).

use crate::support;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use support::{
    client, metric_sum, parse_metrics, sluice_check, write_config, Limit, LlmUpstream, Node,
    Policy, Route, Sluice, Store, StoreKind, UpstreamSpec,
};

const MIB: u64 = 1024 * 1024;

/// A request body that sends `left` bytes in 16 KiB frames, then never ends (and never
/// wakes its reader again): the attack's stalled stream.
struct Stalled {
    left: usize,
    /// Sent once `left` is spent, when set: the body's end (a body that does finish).
    then: Option<tokio::sync::oneshot::Receiver<Bytes>>,
    finished: bool,
}

impl Stalled {
    fn forever(bytes: usize) -> Stalled {
        Stalled {
            left: bytes,
            then: None,
            finished: false,
        }
    }
}

impl http_body::Body for Stalled {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left > 0 {
            let n = self.left.min(16 * 1024);
            self.left -= n;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b' '; n])))));
        }
        let finished = self.finished;
        match &mut self.then {
            None if finished => Poll::Ready(None),
            None => Poll::Pending,
            Some(rest) => match Pin::new(rest).poll(cx) {
                Poll::Ready(Ok(bytes)) => {
                    self.then = None;
                    self.finished = true;
                    Poll::Ready(Some(Ok(Frame::data(bytes))))
                }
                Poll::Ready(Err(_)) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// An HTTP/2 (prior knowledge) connection to sluice, its driver spawned.
async fn h2(
    addr: SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Stalled>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(tcp))
        .await
        .expect("an HTTP/2 handshake");
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    (send, driver)
}

fn post(addr: SocketAddr, key: &str, body: Stalled) -> Request<Stalled> {
    Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(body)
        .expect("a request")
}

/// A route `/v1/` to the fake LLM with `limits`, on `store` (a policy naming its store, or
/// [`Policy::new`] for the in-process one), with these `server:` settings.
fn policy(store: Policy, server: &[(&str, &str)], upstream: &str, limits: Vec<Limit>) -> Policy {
    let policy = server
        .iter()
        .fold(store, |policy, (field, value)| policy.server(field, *value));
    let route = limits
        .into_iter()
        .fold(Route::new("chat", "/v1/").upstream("llm"), Route::limit);
    policy
        .upstream("llm", UpstreamSpec::new(upstream).timeout("10s"))
        .route(route)
}

/// A token limit keyed by `x-api-key` (reserving the default 256 and at most 4,096 tokens of
/// output, reading bodies up to `max_body`): `tokens` per `window`.
fn tpm(name: &str, tokens: u32, window: &str, max_body: &str) -> Limit {
    Limit::tokens(name, tokens, window)
        .key(["header:x-api-key"])
        .set("reserve", reserve(max_body))
}

/// A token limit's `reserve:`: the default 256 and at most 4,096 tokens of output, bodies read
/// up to `max_body`.
fn reserve(max_body: &str) -> Node {
    Node::map([
        ("default_output", Node::from(256)),
        ("max_output", Node::from(4096)),
        ("max_body", Node::from(max_body)),
    ])
}

/// A chat body for `model`, with `max_tokens` and the fake's `sim`.
fn model_body(model: &str, max_tokens: u64, sim: Value) -> String {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "sim": sim,
    })
    .to_string()
}

async fn send(sluice: &Sluice, key: &str, body: String) -> reqwest::Response {
    client()
        .post(format!("{}/v1/chat/completions", sluice.url()))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer")
}

async fn refused(sluice: &Sluice, reason: &str) -> f64 {
    metric_sum(
        &parse_metrics(&sluice.metrics().await),
        "sluice_refused_requests_total",
        &[("reason", reason)],
    )
}

/// The `r` of the `RateLimit` field.
fn remaining(response: &reqwest::Response) -> u64 {
    let field = support::header(response, "ratelimit");
    field
        .split(';')
        .find_map(|p| p.strip_prefix("r="))
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no r in RateLimit: {field}"))
}

const ATTACK_SERVER: [(&str, &str); 2] = [("body_timeout", "60s"), ("body_rate_grace", "60s")];

/// A token limit no test here fills: what it tests is the reading of bodies.
fn roomy() -> Limit {
    tpm("tpm", 100_000_000, "1m", "2MiB")
}

/// The attack: `connections` HTTP/2 connections, `streams` streams each, each stream sending
/// 1 MiB and never finishing, every one from its own invented API key. Returns the
/// connections' drivers (aborting them closes the connections) and the answers that came
/// within `wait` (the others are still being read).
async fn attack(
    addr: SocketAddr,
    connections: usize,
    streams: usize,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    tokio::sync::mpsc::UnboundedReceiver<http::Response<hyper::body::Incoming>>,
) {
    let (answers, received) = tokio::sync::mpsc::unbounded_channel();
    let mut drivers = Vec::new();
    for c in 0..connections {
        let (send, driver) = h2(addr).await;
        drivers.push(driver);
        for s in 0..streams {
            let mut send = send.clone();
            let answers = answers.clone();
            let request = post(
                addr,
                &format!("invented-{c}-{s}"),
                Stalled::forever(MIB as usize),
            );
            drivers.push(tokio::spawn(async move {
                if send.ready().await.is_err() {
                    return;
                }
                if let Ok(response) = send.send_request(request).await {
                    let _ = answers.send(response);
                }
            }));
        }
    }
    (drivers, received)
}

/// The most RSS of the sluice process seen over `span`, sampled every 50 ms, in kB.
async fn peak_rss(sluice: &Sluice, span: Duration) -> u64 {
    let end = Instant::now() + span;
    let mut peak = 0;
    while Instant::now() < end {
        peak = peak.max(sluice.rss_kb());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    peak
}

/// Budget 16 MiB, no tighter per-connection bound than the stream count: the attack's bodies
/// take the budget and every stream past it is refused with 503 and `Retry-After`, counted as
/// `body_budget`; the process's RSS grows by less than the budget plus 24 MiB (the HTTP/2
/// connections' receive windows, the allocator's slack and the refused streams' answers).
/// Once the attack's connections close, the budget is back and a request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_hold_no_more_than_the_budget() {
    let _heavy = support::heavy().await;
    let upstream = LlmUpstream::start().await;
    let server = [
        ATTACK_SERVER[0],
        ATTACK_SERVER[1],
        ("token_body_budget", "16MiB"),
        ("token_bodies_per_connection", "1000"),
    ];
    let sluice = Sluice::start(&policy(
        Policy::new(),
        &server,
        &upstream.url(),
        vec![roomy()],
    ))
    .await;
    let warm = send(&sluice, "k", support::chat_body(10, json!({"usage": 10}))).await;
    assert_eq!(warm.status(), 200);
    let before = sluice.rss_kb();

    let (drivers, mut answers) = attack(sluice.addr(), 2, 150).await;
    // At most 16 of the 300 bodies fit 16 MiB whole: the others are refused.
    support::wait_for(Duration::from_secs(30), "284 budget refusals", || async {
        refused(&sluice, "body_budget").await >= 284.0
    })
    .await;
    let peak = peak_rss(&sluice, Duration::from_secs(2))
        .await
        .max(sluice.rss_kb());
    let grown_mib = (peak.saturating_sub(before)) as f64 / 1024.0;
    eprintln!("RSS before {before} kB, peak during the attack {peak} kB: +{grown_mib:.1} MiB");
    assert!(
        grown_mib < 16.0 + 24.0,
        "RSS grew by {grown_mib:.1} MiB under the attack, over the 16 MiB budget plus a 24 MiB \
         margin"
    );
    let answer = answers.recv().await.expect("a refused stream's answer");
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers()["retry-after"], "1");
    assert_eq!(answer.headers()["content-type"], "application/problem+json");
    assert!(upstream.bodies().len() == 1, "no attack body was forwarded");

    for driver in drivers {
        driver.abort();
    }
    // The held bodies break off with their connections and give their bytes back.
    support::wait_for(
        Duration::from_secs(10),
        "a request served again",
        || async {
            send(&sluice, "k", support::chat_body(10, json!({"usage": 10})))
                .await
                .status()
                == 200
        },
    )
    .await;
}

/// Per connection 8, budget 32 MiB: each of the 2 attacking connections gets 8 streams read
/// and 142 refused (`body_streams`), so the budget keeps room, and a legitimate client is
/// served during the attack; RSS stays under 16 MiB (the 16 bodies held) plus 24 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_cannot_take_the_budget() {
    let _heavy = support::heavy().await;
    let upstream = LlmUpstream::start().await;
    let server = [
        ATTACK_SERVER[0],
        ATTACK_SERVER[1],
        ("token_body_budget", "32MiB"),
        ("token_bodies_per_connection", "8"),
    ];
    let sluice = Sluice::start(&policy(
        Policy::new(),
        &server,
        &upstream.url(),
        vec![roomy()],
    ))
    .await;
    let warm = send(&sluice, "k", support::chat_body(10, json!({"usage": 10}))).await;
    assert_eq!(warm.status(), 200);
    let before = sluice.rss_kb();

    let (drivers, _answers) = attack(sluice.addr(), 2, 150).await;
    support::wait_for(Duration::from_secs(30), "284 stream refusals", || async {
        refused(&sluice, "body_streams").await >= 284.0
    })
    .await;
    let during = send(
        &sluice,
        "legit",
        support::chat_body(10, json!({"usage": 10})),
    )
    .await;
    assert_eq!(
        during.status(),
        200,
        "a legitimate request during the attack"
    );
    let peak = peak_rss(&sluice, Duration::from_secs(2))
        .await
        .max(sluice.rss_kb());
    let grown_mib = (peak.saturating_sub(before)) as f64 / 1024.0;
    eprintln!("RSS before {before} kB, peak during the attack {peak} kB: +{grown_mib:.1} MiB");
    assert!(
        grown_mib < 16.0 + 24.0,
        "RSS grew by {grown_mib:.1} MiB; 16 bodies of 1 MiB are held, margin 24 MiB"
    );
    assert_eq!(refused(&sluice, "body_streams").await, 284.0);
    assert_eq!(refused(&sluice, "body_budget").await, 0.0);
    assert_eq!(upstream.bodies().len(), 2, "the two legitimate bodies only");
    for driver in drivers {
        driver.abort();
    }
}

/// The body of exactly `tokens` of reservation: its bytes plus its `max_tokens`.
fn body_reserving(model: &str, tokens: u64, sim: &Value) -> String {
    let mut max = tokens;
    for _ in 0..4 {
        let body = model_body(model, max, sim.clone());
        max = tokens - body.len() as u64;
    }
    let body = model_body(model, max, sim.clone());
    assert_eq!(body.len() as u64 + max, tokens, "a body reserving {tokens}");
    body
}

/// An identity whose limit has no room left gets 429 (with `Retry-After` and the RateLimit
/// fields) while its body is still arriving, and the body is never forwarded: sluice asks the
/// store before it reads a byte.
async fn exhausted_identity_is_refused_unread(kind: StoreKind) {
    let store = Store::start(kind).await;
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &[("body_timeout", "30s"), ("body_rate_grace", "30s")],
        &upstream.url(),
        vec![tpm("tpm", 2000, "1m", "2MiB")],
    ))
    .await;
    // No usage figure: the whole reservation of 2,000 stays counted.
    let spent = send(
        &sluice,
        "spent",
        body_reserving("fake-1", 2000, &json!({"mode": "none"})),
    )
    .await;
    assert_eq!(spent.status(), 200);
    assert_eq!(remaining(&spent), 0, "the limit is spent");
    let forwarded = upstream.bodies().len();

    let (mut send_h2, driver) = h2(sluice.addr()).await;
    send_h2.ready().await.expect("ready");
    let started = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        send_h2.send_request(post(sluice.addr(), "spent", Stalled::forever(MIB as usize))),
    )
    .await
    .expect("an answer before the body ends (it never does)")
    .expect("a response");
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        answer.headers().contains_key("retry-after") && answer.headers().contains_key("ratelimit"),
        "{:?}",
        answer.headers()
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(upstream.bodies().len(), forwarded, "nothing was forwarded");
    driver.abort();

    // Over HTTP/1.1, a small body is read and dropped before the refusal, even when it
    // arrives after the head: the connection stays open for the next request. Refused with
    // its body unread, the connection would be closed after the 429, and a client that
    // reuses it (it did not say `close`) would lose its next request (seen:
    // "connection closed before message completed").
    let mut wire = support::wire::Wire::connect(sluice.addr()).await;
    let body = body_reserving("fake-1", 1000, &json!({"mode": "none"}));
    let fields = "x-api-key: spent\r\ncontent-type: application/json\r\n";
    for n in 0..10 {
        wire.post_body_after_head("/v1/chat/completions", fields, body.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("request {n} on the kept connection: {e}"));
        let answer = wire.response(Duration::from_secs(5)).await;
        assert_eq!(answer.status, 429, "request {n} on the kept connection");
    }
    assert!(!wire.is_closed(), "the connection is kept");
    assert_eq!(upstream.bodies().len(), forwarded, "nothing was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_identity_is_refused_unread_redis() {
    exhausted_identity_is_refused_unread(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_identity_is_refused_unread_memory() {
    exhausted_identity_is_refused_unread(StoreKind::Memory).await;
}

/// A head sent before midnight whose body ends after it: charged to the new day. A day quota
/// of 1,000 tokens; request B (reserving 700, using 600) straddles midnight; request C
/// (reserving 500) after it finds 400 left and is refused. Charged to the old day, B would
/// leave the new day empty and C would pass: 1,100 tokens spent in one day, by the upstream's
/// own record.
async fn period_is_the_decisions(kind: StoreKind) {
    const LEAD: Duration = Duration::from_secs(10);
    let store = Store::start(kind).await;
    let upstream = LlmUpstream::start().await;
    let daily = Limit::tokens_quota("daily", 1000, "day")
        .key(["header:x-api-key"])
        .set("reserve", reserve("64KiB"));
    let yaml = policy(
        Policy::new().store(&store),
        &ATTACK_SERVER,
        &upstream.url(),
        vec![daily],
    );
    let spawned = Instant::now();
    let sluice = Sluice::start_with_env(
        &yaml,
        &[("SLUICE_TEST_CLOCK_START", "2026-03-10T23:59:50Z")],
    )
    .await;
    let ready = Instant::now();

    // 100 bytes of leading whitespace (valid JSON) before midnight, the object after it:
    // 700 tokens reserved in all.
    let body = body_reserving("fake-1", 600, &json!({"usage": 600}));
    let (rest, later) = tokio::sync::oneshot::channel();
    let straddling = Stalled {
        left: 100,
        then: Some(later),
        finished: false,
    };
    let (mut send_h2, driver) = h2(sluice.addr()).await;
    send_h2.ready().await.expect("ready");
    let answer = tokio::spawn(send_h2.send_request(post(sluice.addr(), "k", straddling)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        spawned.elapsed() < LEAD - Duration::from_secs(1),
        "the head must reach sluice before its midnight; it took {:?} to start",
        spawned.elapsed()
    );
    // Sluice's clock is past midnight once LEAD has passed since it was ready.
    tokio::time::sleep(
        (ready + LEAD + Duration::from_secs(1)).saturating_duration_since(Instant::now()),
    )
    .await;
    rest.send(Bytes::from(body)).expect("the body's end");
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("an answer")
        .expect("the task")
        .expect("a response");
    assert_eq!(answer.status(), 200);
    let window = answer;
    driver.abort();

    let after = send(
        &sluice,
        "k",
        body_reserving("fake-1", 500, &json!({"usage": 500})),
    )
    .await;
    let spent: u64 = upstream.answers().iter().map(|a| a.usage).sum();
    assert!(
        spent <= 1000,
        "the upstream spent {spent} of 1,000 in the new day"
    );
    assert_eq!(
        after.status(),
        429,
        "the new day has 400 tokens left; the upstream has spent {spent} today"
    );
    let t: u64 = window.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .split(';')
        .find_map(|p| p.strip_prefix("t="))
        .and_then(|t| t.parse().ok())
        .expect("t in RateLimit");
    assert!(
        t > 86_000,
        "the straddling request's window is the new day's ({t} s left), not the old one's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_period_is_the_decisions_redis() {
    period_is_the_decisions(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_period_is_the_decisions_memory() {
    period_is_the_decisions(StoreKind::Memory).await;
}

/// A WebSocket upgrade on a token route is refused with 501 and a problem body naming the
/// reason; the upstream sees no upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_on_a_token_route_is_refused() {
    let echo = support::websocket::EchoServer::start().await;
    let yaml = policy(
        Policy::new(),
        &[("body_timeout", "10s")],
        &format!("http://{}", echo.addr),
        vec![roomy()],
    );
    let sluice = Sluice::start(&yaml).await;
    let url = format!("ws://127.0.0.1:{}/v1/realtime", sluice.addr().port());
    let refused_with = match tokio_tungstenite::connect_async(url).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => response,
        other => panic!("expected an HTTP refusal, got {:?}", other.map(|(_, r)| r)),
    };
    assert_eq!(refused_with.status(), 501);
    let body =
        String::from_utf8_lossy(refused_with.body().as_deref().unwrap_or_default()).into_owned();
    assert!(body.contains("WebSocket"), "{body}");
    assert!(echo.upgrades().is_empty(), "the upstream saw no upgrade");
    assert_eq!(refused(&sluice, "token_upgrade").await, 1.0);
}

/// "3,000 tokens a minute on the large model, 20,000 on the small one, per key", one route;
/// and a route keyed by key and model. A respelled model name (case, spaces) is the same
/// model; a body naming `model` twice is refused. By the upstream's record, no model's
/// spending passes its limit.
async fn limits_per_model(kind: StoreKind) {
    let store = Store::start(kind).await;
    let upstream = LlmUpstream::start().await;
    let model = |patterns: Vec<&str>| vec![Node::map([("model", patterns)])];
    let yaml = Policy::new()
        .store(&store)
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("chat", "/v1/")
                .upstream("llm")
                .limit(tpm("large", 3000, "1m", "64KiB").when(model(vec!["big-1", "big-1-20*"])))
                .limit(tpm("small", 20000, "1m", "64KiB").when(model(vec!["small-1*"]))),
        )
        .route(
            Route::new("keyed", "/v2/")
                .upstream("llm")
                .limit(tpm("per_model", 2000, "1m", "64KiB").key(["header:x-api-key", "model"])),
        );
    let sluice = Sluice::start(&yaml).await;
    let sim = json!({"usage": 900});
    let mut statuses = Vec::new();
    for model in ["big-1", "BIG-1", " big-1-2024-08-06", "Big-1 ", "big-1"] {
        let answer = send(&sluice, "k", body_reserving(model, 1000, &sim)).await;
        statuses.push((model, answer.status().as_u16()));
    }
    assert_eq!(
        statuses,
        [
            ("big-1", 200),
            ("BIG-1", 200),
            (" big-1-2024-08-06", 200),
            ("Big-1 ", 429),
            ("big-1", 429)
        ],
        "3 × 900 spent of 3,000: the fourth reservation of 1,000 does not fit, however spelled"
    );
    for n in 0..5 {
        let answer = send(&sluice, "k", body_reserving("small-1-mini", 1000, &sim)).await;
        assert_eq!(answer.status(), 200, "small model request {n}");
    }
    let other_key = send(&sluice, "other", body_reserving("big-1", 1000, &sim)).await;
    assert_eq!(other_key.status(), 200, "per key");
    let twice = client()
        .post(format!("{}/v1/chat/completions", sluice.url()))
        .header("x-api-key", "k")
        .body(r#"{"model":"small-1","model":"big-1","max_tokens":10,"messages":[]}"#)
        .send()
        .await
        .expect("an answer");
    assert_eq!(twice.status(), 400);

    let keyed = |model: &'static str| {
        let sluice = &sluice;
        let sim = sim.clone();
        async move {
            client()
                .post(format!("{}/v2/chat/completions", sluice.url()))
                .header("x-api-key", "k")
                .body(body_reserving(model, 1000, &sim))
                .send()
                .await
                .expect("an answer")
                .status()
                .as_u16()
        }
    };
    assert_eq!(keyed("big-1").await, 200);
    assert_eq!(keyed("big-1").await, 200);
    assert_eq!(keyed(" BIG-1").await, 429, "one bucket for every spelling");
    assert_eq!(keyed("small-1").await, 200, "another model, another bucket");

    // The upstream's record: what each model spent.
    let bodies = upstream.bodies();
    let answers = upstream.answers();
    assert_eq!(bodies.len(), answers.len());
    let spent = |prefix: &str, route_first: usize, route_end: usize| -> u64 {
        bodies[route_first..route_end]
            .iter()
            .zip(&answers[route_first..route_end])
            .filter(|(body, _)| {
                let body: Value = serde_json::from_slice(body).expect("JSON");
                let model = body["model"]
                    .as_str()
                    .unwrap_or_default()
                    .trim()
                    .to_lowercase();
                model.starts_with(prefix)
            })
            .map(|(_, answer)| answer.usage)
            .sum()
    };
    // On /v1/: 3 large, 5 small, 1 large of another key; then 3 on /v2/.
    assert_eq!(bodies.len(), 12, "nothing refused was forwarded");
    assert_eq!(spent("big-1", 0, 3), 2700, "large, key k: within 3,000");
    assert_eq!(spent("small-1", 3, 8), 4500, "small, key k: within 20,000");
    assert_eq!(spent("big-1", 9, 11), 1800, "big-1 on /v2/: within 2,000");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_per_model_redis() {
    limits_per_model(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_per_model_memory() {
    limits_per_model(StoreKind::Memory).await;
}

/// `sluice check` refuses a `model` key part or condition on a limit that counts requests,
/// naming file, line, column and field.
#[test]
fn check_refuses_model_outside_token_limits() {
    for (limit, field) in [
        (
            "{ name: l, key: [client_ip, model], requests: 5, window: 1m }",
            "routes[0].limits[0].key[1]",
        ),
        (
            "{ name: l, key: [client_ip], requests: 5, window: 1m, when: [{ model: [gpt-4o] }] }",
            "routes[0].limits[0].when[0].model",
        ),
    ] {
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nupstreams:\n  u: {{ url: \"http://127.0.0.1:9\" }}\nroutes:\n  - name: r\n    match: {{ path_prefix: / }}\n    upstream: u\n    limits:\n      - {limit}\n"
        );
        let file = write_config(&yaml);
        let (status, _, stderr) = sluice_check(file.path());
        assert!(!status.success(), "{limit}");
        assert!(
            stderr.contains(field)
                && stderr.contains(":10:")
                && stderr.contains("token or money limit"),
            "{stderr}"
        );
    }
}

/// A body declared over the 1 KiB this route reads is refused (413) from its head, a small
/// one read and dropped first, so the connection carries the next request. A body sluice
/// reads whole and cuts part way (a chunked one growing past the 1 KiB) leaves the rest on
/// the client's HTTP/1.1 connection, which then closes: that 413 says `Connection: close`,
/// so the client sends no next request into it. The upstream gets nothing.
#[tokio::test]
async fn a_body_cut_while_read_whole_says_the_connection_closes() {
    let upstream = LlmUpstream::start().await;
    let limit = tpm("tpm", 100_000_000, "1m", "1KiB");
    let yaml = policy(
        Policy::new(),
        &[("body_timeout", "10s")],
        &upstream.url(),
        vec![limit],
    );
    let sluice = Sluice::start(&yaml).await;
    let mut wire = support::wire::Wire::connect(sluice.addr()).await;
    let fields = "x-api-key: k\r\ncontent-type: application/json\r\n";
    for n in 0..2 {
        wire.post_body_after_head("/v1/chat/completions", fields, &[b'x'; 1500])
            .await
            .unwrap_or_else(|e| panic!("request {n} on the kept connection: {e}"));
        let answer = wire.response(Duration::from_secs(5)).await;
        assert_eq!(answer.status, 413, "{answer:?}");
        assert_eq!(answer.header("connection"), None, "kept: {answer:?}");
    }
    wire.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: k\r\n\
          content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    // Two chunks of 600 bytes (0x258), and no end.
    let chunk = format!("258\r\n{}\r\n", "x".repeat(600));
    wire.send(chunk.repeat(2).as_bytes()).await.unwrap();
    let answer = wire.response(Duration::from_secs(5)).await;
    assert_eq!(answer.status, 413, "{answer:?}");
    assert_eq!(
        answer.header("connection"),
        Some("close"),
        "the 413 of a body cut while read whole says the connection closes: {answer:?}"
    );
    assert!(
        wire.closed_within(Duration::from_secs(5)).await.is_some(),
        "and the connection closes"
    );
    assert!(upstream.bodies().is_empty(), "nothing was forwarded");
}
