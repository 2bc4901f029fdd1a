//! LLM token budgets (`tokens:`), through a real sluice, a real Redis and a fake LLM API of
//! our own (`support::llm_upstream`) that reports the usage each request asks for. A request
//! reserves its body's bytes plus its output cap before it is forwarded, and is settled to
//! the usage its answer reports (JSON, event stream, header) as the answer ends; with no
//! figure, the stated rule applies. Under concurrency, on Redis with two instances and in
//! process, the usage admitted in any window stays within the limit, and the tokens settled
//! back admit more requests than the reservations alone would.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{
    chat_body, client, closed_port, metric_sum, parse_metrics, Limit, LlmUpstream, Node,
    OnStoreError, Policy, Route, Sluice, Store, StoreKind, UpstreamSpec,
};

/// A route `/v1/` to `upstream_url` with one token limit, keyed by `x-api-key`.
fn policy(store: Policy, upstream_url: &str, tokens: u32, window: &str, settle: Node) -> Policy {
    let reserve = Node::map([
        ("default_output", Node::from(256)),
        ("max_output", Node::from(4096)),
        ("max_body", Node::from("16KiB")),
    ]);
    store
        .upstream("llm", UpstreamSpec::new(upstream_url).timeout("10s"))
        .route(
            Route::new("chat", "/v1/").upstream("llm").limit(
                Limit::tokens("tpm", tokens, window)
                    .key(["header:x-api-key"])
                    .set("reserve", reserve)
                    .set("settle", settle),
            ),
        )
}

/// Settled to the usage the answer's body reports.
fn usage() -> Node {
    Node::map([("from", "usage")])
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

fn metric(metrics: &str, name: &str) -> f64 {
    metric_sum(
        &parse_metrics(metrics),
        name,
        &[("route", "chat"), ("limit", "tpm")],
    )
}

/// Each request reserves about 4,150 of 6,000 tokens: a second one fits only once the first
/// is settled to the 100 it used.
async fn settlement_frees_the_unused_tokens(mode: &str, settle: Node) {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", settle)).await;
    let mut reserved = 0;
    for n in 0..5 {
        let body = chat_body(4000, json!({"usage": 100, "mode": mode}));
        reserved += body.len() + 4000;
        let reservation = body.len() + 4000;
        let answer = send(&sluice, "k", body).await;
        assert_eq!(answer.status(), 200, "request {n} ({mode})");
        assert_eq!(
            support::header(&answer, "ratelimit-policy"),
            "\"tpm\";q=6000;w=60;qu=\"tokens\""
        );
        // Decided with only the earlier requests' usage (100 each) kept: the room is in tokens.
        let remaining = 6000 - n * 100 - reservation;
        assert_eq!(
            support::header(&answer, "ratelimit"),
            format!("\"tpm\";r={remaining};t=60"),
            "request {n}"
        );
        let text = answer.text().await.expect("the answer's body");
        if mode == "sse" {
            assert!(
                text.contains("\"total_tokens\":100"),
                "the usage event reaches the client: {text}"
            );
        }
    }
    assert_eq!(upstream.answers().len(), 5);
    let metrics = sluice.metrics().await;
    assert_eq!(
        metric(&metrics, "sluice_tokens_reserved_total"),
        reserved as f64
    );
    assert_eq!(metric(&metrics, "sluice_tokens_settled_total"), 500.0);
    assert_eq!(
        metric(&metrics, "sluice_tokens_returned_total"),
        (reserved - 500) as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_usage_settles_the_reservation() {
    settlement_frees_the_unused_tokens("json", usage()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_event_stream_settles_the_reservation() {
    settlement_frees_the_unused_tokens("sse", usage()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_event_stream_settles_the_reservation() {
    settlement_frees_the_unused_tokens("anthropic", usage()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_header_settles_the_reservation() {
    settlement_frees_the_unused_tokens(
        "header",
        Node::map([("from", "header"), ("header", "x-tokens-used")]),
    )
    .await;
}

/// An answer without a figure (any status) keeps the whole reservation: the next request
/// does not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_figure_the_reservation_is_kept() {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
    let cases = [
        ("no-usage", json!({"mode": "none"}), 200),
        ("error", json!({"mode": "none", "status": 500}), 500),
    ];
    for (key, sim, status) in cases {
        let answer = send(&sluice, key, chat_body(4000, sim)).await;
        assert_eq!(answer.status(), status, "{key}");
        answer.bytes().await.expect("the whole answer");
        let next = send(&sluice, key, chat_body(4000, json!({}))).await;
        assert_eq!(next.status(), 429, "{key}: the reservation is kept");
        let problem: Value = next.json().await.expect("a problem body");
        assert_eq!(problem["limit"], "tpm", "{problem}");
        assert_eq!(problem["unit"], "tokens", "{problem}");
    }
    let metrics = sluice.metrics().await;
    assert_eq!(metric(&metrics, "sluice_token_overruns_total"), 0.0);
    assert_eq!(metric(&metrics, "sluice_tokens_returned_total"), 0.0);
    assert_eq!(upstream.answers().len(), 2);
}

/// An answer that reports more than its reservation is charged what it reports (JSON and
/// event stream): the window then holds the real spend, so the identity's next request that
/// does not fit beside it waits, with a Retry-After until the overrun leaves the window, one
/// that fits beside it is admitted with the room the real spend leaves, and one past the
/// whole limit makes the identity wait the whole window. The excess tokens are counted.
async fn an_overrun_is_charged(kind: StoreKind) {
    let upstream = LlmUpstream::start().await;
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &upstream.url(),
        6000,
        "10s",
        usage(),
    ))
    .await;
    let mut excess = 0;
    for (key, mode, usage) in [
        ("json", "json", 5000),
        ("sse", "sse", 5000),
        ("big", "json", 9000),
    ] {
        let body = chat_body(100, json!({"usage": usage, "mode": mode}));
        let reservation = (body.len() + 100) as u64;
        excess += usage - reservation;
        let answer = send(&sluice, key, body).await;
        assert_eq!(answer.status(), 200, "{key}");
        answer.bytes().await.expect("the whole answer");
        // 1,500 more do not fit beside the 5,000 spent (they would beside the reservation).
        let refused = send(&sluice, key, chat_body(1500, json!({}))).await;
        assert_eq!(refused.status(), 429, "{key}: the overrun is charged");
        let retry_after: u64 = support::header(&refused, "retry-after")
            .parse()
            .expect("seconds");
        // The window and, in Redis, the lateness bound the log counts it longer.
        let most = (Duration::from_secs(10) + store.lateness())
            .as_secs_f64()
            .ceil() as u64;
        assert!(
            (9..=most).contains(&retry_after),
            "{key}: Retry-After {retry_after} s, not until the overrun leaves the 10 s window"
        );
        let small = chat_body(100, json!({"usage": 10}));
        let small_reservation = (small.len() + 100) as u64;
        let answer = send(&sluice, key, small).await;
        if usage > 6000 {
            assert_eq!(answer.status(), 429, "{key}: the window is past its limit");
            continue;
        }
        assert_eq!(answer.status(), 200, "{key}: room beside the real spend");
        assert_eq!(
            support::header(&answer, "ratelimit"),
            format!("\"tpm\";r={};t={most}", 6000 - usage - small_reservation),
            "{key}: the window holds exactly the reported usage"
        );
        answer.bytes().await.expect("the whole answer");
    }
    let metrics = sluice.metrics().await;
    assert_eq!(metric(&metrics, "sluice_token_overruns_total"), 3.0);
    assert_eq!(
        metric(&metrics, "sluice_token_overrun_tokens_total"),
        excess as f64
    );
    // What the upstream spent for each identity, from its own record: within the limit but
    // for the one answer that alone spent more than the limit, which nothing could stop.
    let spent: Vec<u64> = upstream.answers().iter().map(|a| a.usage).collect();
    assert_eq!(spent, [5000, 10, 5000, 10, 9000]);
    if let Some(redis) = &store.redis {
        assert_eq!(
            redis
                .assert_every_key_expires(Duration::from_secs(10))
                .await,
            3
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_is_charged_redis() {
    an_overrun_is_charged(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_is_charged_memory() {
    an_overrun_is_charged(StoreKind::Memory).await;
}

/// An upstream that cannot be reached spent nothing: each 502 gives everything back, so the
/// next request is tried too instead of refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_gives_everything_back() {
    let down = format!("http://127.0.0.1:{}", closed_port());
    let sluice = Sluice::start(&policy(Policy::new(), &down, 6000, "1m", usage())).await;
    for n in 0..4 {
        let answer = send(&sluice, "k", chat_body(4000, json!({}))).await;
        assert_eq!(answer.status(), 502, "request {n}");
    }
    let metrics = sluice.metrics().await;
    assert_eq!(
        metric(&metrics, "sluice_tokens_returned_total"),
        metric(&metrics, "sluice_tokens_reserved_total")
    );
}

/// A client that leaves in the middle of a streamed answer keeps the whole reservation: the
/// upstream may go on generating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_keeps_the_reservation() {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
    let body = chat_body(
        4000,
        json!({"mode": "sse", "usage": 100, "gate": true, "events": 5}),
    );
    let reservation = (body.len() + 4000) as f64;
    let mut answer = send(&sluice, "k", body).await;
    assert_eq!(answer.status(), 200);
    let first = answer
        .chunk()
        .await
        .expect("a chunk")
        .expect("the first event");
    assert!(first.starts_with(b"data:"), "{first:?}");
    drop(answer);
    support::wait_for(
        Duration::from_secs(10),
        "sluice to see the client leave",
        || async { metric(&sluice.metrics().await, "sluice_tokens_settled_total") == reservation },
    )
    .await;
    upstream.open_gate();
    let next = send(&sluice, "k", chat_body(4000, json!({}))).await;
    assert_eq!(next.status(), 429, "the reservation is kept");
}

/// What a token budget refuses before anything is reserved, each with a problem body; none
/// reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreservable_requests_are_refused_with_a_problem() {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 3000, "1m", usage())).await;
    let too_big = chat_body(10, json!({"pad": "x".repeat(20 * 1024)}));
    let cases = [
        (too_big, 413, "larger than 16384 bytes"),
        (chat_body(2900, json!({})), 413, "can never fit"),
        (chat_body(5000, json!({})), 413, "at most 4096"),
        ("{\"messages\": [".to_owned(), 400, "not JSON"),
        ("[]".to_owned(), 400, "not a JSON object"),
    ];
    for (body, status, says) in cases {
        let answer = send(&sluice, "k", body).await;
        assert_eq!(answer.status(), status, "{says}");
        assert_eq!(
            support::header(&answer, "content-type"),
            "application/problem+json"
        );
        let problem: Value = answer.json().await.expect("a problem");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "{detail}");
    }
    // Sent chunked, without a length: refused once the bytes read pass the bound.
    let chunks: Vec<Result<String, std::io::Error>> =
        (0..20).map(|_| Ok("x".repeat(1024))).collect();
    let answer = client()
        .post(format!("{}/v1/chat/completions", sluice.url()))
        .header("x-api-key", "k")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status(), 413);
    let problem: Value = answer.json().await.expect("a problem");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("larger than 16384 bytes"),
        "{problem}"
    );
    assert!(upstream.answers().is_empty());
    // A request that fits still goes through, its body as sent.
    let body = chat_body(100, json!({"usage": 5}));
    assert_eq!(send(&sluice, "k", body.clone()).await.status(), 200);
    assert_eq!(upstream.bodies(), vec![bytes::Bytes::from(body)]);
}

/// The first event reaches the client while the upstream still holds the rest; many MB of
/// events pass with sluice's memory bounded, and the usage at their end is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_stays_streaming_in_bounded_memory() {
    let _heavy = support::heavy().await;
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
    // Warm up, so the peak below is the stream's, not the first connection's.
    let warm = send(&sluice, "warm", chat_body(100, json!({"mode": "sse"}))).await;
    warm.bytes().await.expect("the warm-up answer");
    let peak_before = sluice.peak_rss_kb();
    let events = 4096;
    let body = chat_body(
        4000,
        json!({"mode": "sse", "usage": 100, "gate": true, "events": events, "event_bytes": 4096}),
    );
    let mut answer = send(&sluice, "k", body).await;
    let first = answer
        .chunk()
        .await
        .expect("a chunk")
        .expect("the first event");
    assert!(first.starts_with(b"data:"));
    assert!(
        upstream.answers()[1].finished.is_none(),
        "the first event arrived before the upstream sent its last"
    );
    upstream.open_gate();
    let mut received = first.len() as u64;
    while let Some(chunk) = answer.chunk().await.expect("the stream") {
        received += chunk.len() as u64;
    }
    assert!(received > 16 << 20, "{received} bytes");
    let growth_kb = sluice.peak_rss_kb().saturating_sub(peak_before);
    assert!(
        growth_kb < 8 * 1024,
        "sluice grew by {growth_kb} kB for a {received}-byte stream"
    );
    let next = send(&sluice, "k", chat_body(4000, json!({}))).await;
    assert_eq!(
        next.status(),
        200,
        "settled to 100 before the end reached the client"
    );
}

/// 50 clients at once (two instances on one Redis, or one in process), each answer's usage
/// random below its cap: the usage admitted in any window never exceeds the limit, and more
/// requests are admitted within one window than the reservations alone would allow.
async fn concurrent_budgets_never_overshoot(kind: StoreKind) {
    let _heavy = support::heavy().await;
    const LIMIT: u64 = 20_000;
    const WINDOW: Duration = Duration::from_secs(3);
    const CAP: u64 = 1500;
    let upstream = LlmUpstream::start().await;
    let store = Store::start(kind).await;
    let instances = if store.redis.is_some() { 2 } else { 1 };
    let mut sluices = Vec::new();
    for _ in 0..instances {
        sluices.push(
            Sluice::start(&policy(
                Policy::new().store(&store),
                &upstream.url(),
                LIMIT as u32,
                "3s",
                usage(),
            ))
            .await,
        );
    }
    let urls: Vec<String> = sluices
        .iter()
        .map(|s| format!("{}/v1/chat/completions", s.url()))
        .collect();
    let started = Instant::now();
    let run = WINDOW * 2;
    let c = client();
    let tasks: Vec<_> = (0..50u64)
        .map(|n| {
            let c = c.clone();
            let url = urls[n as usize % instances].clone();
            tokio::spawn(async move {
                let mut smallest_reservation = u64::MAX;
                let mut sent = 0u64;
                while started.elapsed() < run && sent < 400 {
                    sent += 1;
                    let usage = 50 + (n * 7919 + sent * 104_729) % 350;
                    let mode = if sent % 2 == 0 { "sse" } else { "json" };
                    let body =
                        chat_body(CAP, json!({"usage": usage, "mode": mode, "delay_ms": 20}));
                    smallest_reservation = smallest_reservation.min(body.len() as u64 + CAP);
                    let answer = c
                        .post(&url)
                        .header("x-api-key", "shared")
                        .body(body)
                        .send()
                        .await
                        .expect("an answer");
                    match answer.status().as_u16() {
                        200 => {
                            answer.bytes().await.expect("the whole answer");
                        }
                        429 => tokio::time::sleep(Duration::from_millis(50)).await,
                        other => panic!("status {other}"),
                    }
                }
                smallest_reservation
            })
        })
        .collect();
    let mut smallest_reservation = u64::MAX;
    for task in tasks {
        smallest_reservation = smallest_reservation.min(task.await.expect("a client"));
    }
    if let Some(redis) = &store.redis {
        assert_eq!(redis.assert_every_key_expires(WINDOW).await, 1);
    }
    let answers = upstream.answers();
    // An answer arrives at the upstream after its admission, at most `margin` after (a
    // generous bound on a loaded machine): answers arriving within WINDOW - margin were all
    // admitted within one WINDOW, which the limit bounds.
    let margin = Duration::from_millis(500);
    let span = WINDOW - margin;
    let mut most = 0;
    for first in &answers {
        let used: u64 = answers
            .iter()
            .filter(|a| a.at >= first.at && a.at < first.at + span)
            .map(|a| a.usage)
            .sum();
        most = most.max(used);
        assert!(
            used <= LIMIT,
            "{used} tokens used within {span:?} of {:?}",
            first.at - started
        );
    }
    let first_window = answers.iter().filter(|a| a.at < started + span).count() as u64;
    let by_reservations = LIMIT / smallest_reservation;
    assert!(
        first_window > 2 * by_reservations,
        "{first_window} requests in the first window; reservations alone admit {by_reservations}"
    );
    eprintln!(
        "{} answers, {first_window} in the first {span:?} (reservations alone: {by_reservations}), \
         at most {most} of {LIMIT} tokens in any {span:?}",
        answers.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_budgets_never_overshoot_redis() {
    concurrent_budgets_never_overshoot(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_budgets_never_overshoot_memory() {
    concurrent_budgets_never_overshoot(StoreKind::Memory).await;
}

/// On a Redis Cluster, a request whose token limits live in different slots (one per key,
/// one for the whole route) is reserved in both and settled in both: requests that fit only
/// once the earlier ones are settled all pass, and the next one past the budget does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_in_different_cluster_slots_settle_in_each() {
    let cluster = support::RedisCluster::start().await;
    let upstream = LlmUpstream::start().await;
    let yaml = Policy::new()
        .store_cluster(&cluster)
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("chat", "/v1/")
                .upstream("llm")
                .on_store_error(OnStoreError::Deny)
                .limit(Limit::tokens("tpm", 6000, "1m").key(["header:x-api-key"]))
                .limit(Limit::tokens("all", 7000, "1m").key([])),
        );
    let sluice = Sluice::start(&yaml).await;
    let checks = [
        "sluice:chat:tpm:weighted_log:{h:x-api-key=k}",
        "sluice:chat:all:weighted_log:{*}",
    ];
    assert_ne!(
        cluster.slot_of(checks[0]).await,
        cluster.slot_of(checks[1]).await,
        "the test needs two slots"
    );
    for n in 0..5 {
        let answer = send(&sluice, "k", chat_body(4000, json!({"usage": 100}))).await;
        assert_eq!(answer.status(), 200, "request {n}");
        answer.bytes().await.expect("the whole answer");
    }
    // 500 settled in both; a request naming no usage keeps its reservation in both.
    let kept = send(&sluice, "k", chat_body(4000, json!({"mode": "none"}))).await;
    assert_eq!(kept.status(), 200);
    kept.bytes().await.expect("the whole answer");
    let next = send(&sluice, "other", chat_body(4000, json!({}))).await;
    assert_eq!(next.status(), 429, "`all` holds 500 + the kept reservation");
    // The window and the cluster store's 1 s timeout, its lateness bound.
    assert_eq!(
        cluster
            .assert_every_key_expires(Duration::from_secs(61))
            .await,
        2
    );
}

/// A daily token quota (a calendar limit) reserves and settles like a rolling budget: each
/// request fits only once the earlier ones are settled, and a kept reservation holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_token_quota_settles_too() {
    let upstream = LlmUpstream::start().await;
    let daily = Limit::tokens_quota("tpm", 6000, "day").key(["header:x-api-key"]);
    let yaml = Policy::new()
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(Route::new("chat", "/v1/").upstream("llm").limit(daily));
    let sluice = Sluice::start(&yaml).await;
    for n in 0..5 {
        let answer = send(
            &sluice,
            "k",
            chat_body(4000, json!({"usage": 100, "mode": "sse"})),
        )
        .await;
        assert_eq!(answer.status(), 200, "request {n}");
        answer.bytes().await.expect("the whole answer");
    }
    let kept = send(&sluice, "k", chat_body(4000, json!({"mode": "none"}))).await;
    assert_eq!(kept.status(), 200);
    kept.bytes().await.expect("the whole answer");
    let next = send(&sluice, "k", chat_body(4000, json!({}))).await;
    assert_eq!(
        next.status(),
        429,
        "500 settled + a kept reservation leave no room"
    );
}

/// The client's copy of a compressed answer, decoded as `encoding` says.
fn decoded(encoding: &str, bytes: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    match encoding {
        "gzip" => flate2::read::MultiGzDecoder::new(bytes).read_to_end(&mut out),
        "deflate" => flate2::read::ZlibDecoder::new(bytes).read_to_end(&mut out),
        "deflate-raw" => flate2::read::DeflateDecoder::new(bytes).read_to_end(&mut out),
        "br" => brotli::Decompressor::new(bytes, 4096).read_to_end(&mut out),
        "zstd" => ruzstd::decoding::StreamingDecoder::new(bytes)
            .expect("a zstd frame")
            .read_to_end(&mut out),
        other => panic!("no decoder for {other}"),
    }
    .unwrap_or_else(|e| panic!("{encoding}: the client's bytes do not decode: {e}"));
    out
}

/// A compressed answer (each coding the scanner decodes, JSON and both event streams, sent
/// in 64-byte frames) settles to exactly the usage it reports, as a plain one does: three
/// requests reserving about 4,150 of 6,000 tokens each all fit. The client gets the bytes
/// the upstream sent, unchanged, and they decode to the answer with its usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_answers_settle_to_their_usage() {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
    let mut answers = 0;
    for encoding in ["gzip", "deflate", "deflate-raw", "br", "zstd"] {
        for mode in ["json", "sse", "anthropic"] {
            let key = format!("{encoding}-{mode}");
            for n in 0..3 {
                let body = chat_body(
                    4000,
                    json!({"usage": 100, "mode": mode, "encoding": encoding}),
                );
                let answer = client()
                    .post(format!("{}/v1/chat/completions", sluice.url()))
                    .header("x-api-key", &key)
                    .header("accept-encoding", "gzip, deflate, br, zstd")
                    .body(body)
                    .send()
                    .await
                    .expect("an answer");
                assert_eq!(answer.status(), 200, "{key} request {n}: settled to 100");
                let coding = if encoding == "deflate-raw" {
                    "deflate"
                } else {
                    encoding
                };
                assert_eq!(support::header(&answer, "content-encoding"), coding);
                let bytes = answer.bytes().await.expect("the whole answer");
                answers += 1;
                let sent = upstream.sent();
                assert_eq!(sent.len(), answers);
                assert_eq!(
                    bytes,
                    sent[answers - 1],
                    "{key}: the client's bytes are the upstream's"
                );
                let text = String::from_utf8(decoded(encoding, &bytes)).expect("text");
                let usage = if mode == "anthropic" {
                    "\"output_tokens\":67"
                } else {
                    "\"total_tokens\":100"
                };
                assert!(text.contains(usage), "{key}: {text}");
            }
        }
    }
    let metrics = sluice.metrics().await;
    assert_eq!(
        metric(&metrics, "sluice_tokens_settled_total"),
        (answers * 100) as f64
    );
}

/// A decompression bomb (about 1 MB on the wire that gzip-decodes to 1 GiB, its usage at the
/// very start): sluice stops decoding at its bound, keeps the whole reservation (the next
/// request does not fit), passes the bytes unchanged, and its memory stays flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decompression_bomb_keeps_the_reservation_in_bounded_memory() {
    let _heavy = support::heavy().await;
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
    let warm = send(&sluice, "warm", chat_body(100, json!({"encoding": "gzip"}))).await;
    warm.bytes().await.expect("the warm-up answer");
    let peak_before = sluice.peak_rss_kb();
    let answer = client()
        .post(format!("{}/v1/chat/completions", sluice.url()))
        .header("x-api-key", "k")
        .header("accept-encoding", "gzip")
        .body(chat_body(
            4000,
            json!({"usage": 100, "encoding": "gzip", "bomb_mb": 1024, "frame_bytes": 16384}),
        ))
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status(), 200);
    let bytes = answer.bytes().await.expect("the whole answer");
    assert_eq!(bytes, upstream.sent()[1], "the bomb's bytes pass unchanged");
    assert!(bytes.len() < 4 << 20, "{} bytes on the wire", bytes.len());
    let growth_kb = sluice.peak_rss_kb().saturating_sub(peak_before);
    assert!(
        growth_kb < 8 * 1024,
        "sluice grew by {growth_kb} kB decoding a bomb"
    );
    // Decoded whole, its usage (1 token) would have settled it: the next one would fit.
    let next = send(&sluice, "k", chat_body(4000, json!({}))).await;
    assert_eq!(next.status(), 429, "the bomb's reservation is kept");
}

/// A client that closes as soon as it has a stream's last event (OpenAI's sync Python client
/// stops at `data: [DONE]`; an Anthropic client at `message_stop`), before the body's end,
/// which here comes 5 s later: the reservation is settled to the usage at that event, not
/// kept whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_after_the_last_event_settles_to_the_usage() {
    for mode in ["sse", "anthropic"] {
        let upstream = LlmUpstream::start().await;
        let sluice =
            Sluice::start(&policy(Policy::new(), &upstream.url(), 6000, "1m", usage())).await;
        let body = chat_body(4000, json!({"mode": mode, "usage": 100, "tail_ms": 5000}));
        let mut answer = send(&sluice, "k", body).await;
        assert_eq!(answer.status(), 200);
        let mut seen = Vec::new();
        let last: &[u8] = if mode == "sse" {
            b"[DONE]"
        } else {
            b"message_stop"
        };
        while !seen.windows(last.len()).any(|w| w == last) {
            let chunk = tokio::time::timeout(Duration::from_secs(3), answer.chunk())
                .await
                .expect("the last event within 3 s")
                .expect("a chunk")
                .expect("the stream goes on");
            seen.extend_from_slice(&chunk);
        }
        drop(answer);
        support::wait_for(Duration::from_secs(2), "the settlement", || async {
            metric(&sluice.metrics().await, "sluice_tokens_settled_total") == 100.0
        })
        .await;
        let next = send(&sluice, "k", chat_body(4000, json!({}))).await;
        assert_eq!(
            next.status(),
            200,
            "{mode}: the unused reservation came back"
        );
    }
}

/// A request refused before its body is read is told when what it will reserve fits, not
/// when one token does: a token limit reserves at least the body's bytes, so a request
/// declaring 400 bytes waits for 400 tokens. Here the first 100 tokens of the window free up
/// 7 s before the other 5,900: a `Retry-After` for one token (7 s) would send the client back
/// to be refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_refusal_waits_for_what_the_request_will_reserve() {
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(
        Policy::new(),
        &upstream.url(),
        6000,
        "10s",
        usage(),
    ))
    .await;
    let first = send(
        &sluice,
        "k",
        chat_body(300, json!({"mode": "json", "usage": 100})),
    )
    .await;
    assert_eq!(first.status(), 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = send(
        &sluice,
        "k",
        chat_body(300, json!({"mode": "json", "usage": 5900})),
    )
    .await;
    assert_eq!(second.status(), 200);
    let body = chat_body(10, json!({"pad": "x".repeat(400)}));
    let refused = send(&sluice, "k", body).await;
    assert_eq!(refused.status(), 429);
    let retry: u64 = support::header(&refused, "retry-after").parse().unwrap();
    assert!(
        (9..=10).contains(&retry),
        "Retry-After {retry}: until the 5,900 leave (about 10 s), not the first 100 (about 7 s)"
    );
    assert_eq!(upstream.answers().len(), 2, "refused before the upstream");
}
