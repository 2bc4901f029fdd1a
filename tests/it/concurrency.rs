//! Concurrency limits (`concurrent:`), judged by the upstream's own record of how many
//! requests of each key it serves at once (`support::in_flight_upstream`): exact across
//! instances on one Redis, released on every way a request ends (a client that reads nothing
//! too, cut at the idle timeout), reclaimed from an instance killed while holding places, kept
//! by a stream that outlives its lease, restored when Redis comes back empty, kept through a
//! reload that lowers or removes the limit and released as the requests end; the refusal's
//! fields; waiting for a place.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use support::in_flight_upstream::InFlightUpstream;
use support::{Limit, Policy, Redis, Route, Sluice, UpstreamSpec};

const KEY: &str = "k";

fn policy(up: &InFlightUpstream, limit: Limit) -> Policy {
    Policy::new()
        .upstream(
            "api",
            UpstreamSpec::new(&up.url())
                .connect_timeout("2s")
                .timeout("20s"),
        )
        .route(
            Route::new("default", "/")
                .upstream("api")
                .limit(limit.key(["header:x-api-key"])),
        )
}

async fn get(client: &reqwest::Client, url: &str) -> reqwest::Response {
    client
        .get(url)
        .header("x-api-key", KEY)
        .send()
        .await
        .expect("a response")
}

/// The status of a GET of `url`, its body read whole (so the answer has ended).
async fn status_of(client: &reqwest::Client, url: &str) -> u16 {
    let response = get(client, url).await;
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    status
}

/// Sends GETs of `path` through `urls` in turn until one is admitted (200, body read whole);
/// how long that took. Panics after `limit`.
async fn admitted_within(client: &reqwest::Client, url: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let response = get(client, url).await;
        if response.status() == 200 {
            response.bytes().await.expect("the body");
            return start.elapsed();
        }
        assert_eq!(response.status(), 429, "only refusals while waiting");
        assert!(
            start.elapsed() < limit,
            "not admitted again within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The keys of Redis that hold leases of the limit `limit`.
async fn lease_count(redis: &Redis, limit: &str) -> i64 {
    let mut total = 0;
    for key in redis.keys().await {
        if key.contains(&format!(":{limit}:concurrency:{{")) && !key.ends_with(":i") {
            if let redis::Value::Int(n) = redis.cmd(&["HLEN", &key]).await {
                total += n;
            }
        }
    }
    total
}

/// Three instances on one Redis, 45 clients of one key: the upstream never serves more than
/// the limit at once, the limit is used whole, every admitted request reached the upstream
/// and every lease is gone from Redis afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_never_serve_more_than_the_limit_at_once() {
    const LIMIT: usize = 5;
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("at-once", LIMIT as u32)).store_redis(&redis);
    let instances = [
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
    ];
    let urls: Arc<Vec<String>> = Arc::new(instances.iter().map(Sluice::url).collect());
    let client = support::client();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..45usize {
        let client = client.clone();
        let urls = Arc::clone(&urls);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut refused) = (0usize, 0usize);
            let mut n = 0usize;
            while start.elapsed() < Duration::from_secs(3) && n < 400 {
                let url = format!("{}/hold/{}", urls[(i + n) % 3], 20 + (i * 7 + n * 13) % 60);
                let response = get(&client, &url).await;
                match response.status().as_u16() {
                    200 => {
                        response.bytes().await.expect("the body");
                        ok += 1;
                    }
                    429 => refused += 1,
                    other => panic!("unexpected status {other}"),
                }
                n += 1;
            }
            (ok, refused)
        }));
    }
    let (mut ok, mut refused) = (0, 0);
    for task in tasks {
        let (o, r) = task.await.unwrap();
        ok += o;
        refused += r;
    }
    let record = up.of(KEY);
    assert!(
        record.max <= LIMIT,
        "the upstream served {} at once under a limit of {LIMIT}",
        record.max
    );
    assert_eq!(record.max, LIMIT, "the limit is used whole, not a deny-all");
    assert_eq!(
        record.served, ok,
        "every admitted request reached the upstream"
    );
    assert!(
        refused > 0,
        "45 clients on 5 places must be refused sometimes"
    );
    support::wait_for(Duration::from_secs(3), "every lease released", || async {
        lease_count(&redis, "at-once").await == 0
    })
    .await;
    redis
        .assert_every_key_expires(Duration::from_secs(11))
        .await;
}

/// The in-process store gives the same guarantee per instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_in_process_store_is_exact_per_instance() {
    let _heavy = support::heavy().await;
    let up = InFlightUpstream::start().await;
    let sluice = Sluice::start(&policy(&up, Limit::concurrent("at-once", 2))).await;
    let client = support::client();
    let url = format!("{}/hold/60", sluice.url());
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let start = Instant::now();
                while start.elapsed() < Duration::from_millis(1500) {
                    let response = get(&client, &url).await;
                    let _ = response.bytes().await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(up.of(KEY).max, 2, "exactly the limit at once");
}

/// A long lease, so that only a release can free the place: after each way a request can
/// end, the next request of the key is admitted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_way_a_request_ends_releases_its_place() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let limit = || {
        Limit::concurrent("one", 1)
            .set("lease", "60s")
            .key(["header:x-api-key"])
    };
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream("api", UpstreamSpec::new(&up.url()).timeout("20s"))
        .upstream(
            "dead",
            UpstreamSpec::new(&format!("http://127.0.0.1:{}", support::closed_port()))
                .connect_timeout("1s"),
        )
        .upstream("slow", UpstreamSpec::new(&up.url()).timeout("200ms"))
        .route(Route::new("dead", "/dead").upstream("dead").limit(limit()))
        .route(Route::new("slow", "/slow").upstream("slow").limit(limit()))
        .route(
            Route::new("small", "/small")
                .upstream("api")
                .max_body("1KiB")
                .limit(limit()),
        )
        .route(Route::new("default", "/").upstream("api").limit(limit()));
    let sluice = Sluice::start(&yaml).await;
    sluice.expect_store_faults();
    let client = support::client();
    let base = sluice.url();
    let again = format!("{base}/hold/0");

    // A complete answer.
    let response = get(&client, &format!("{base}/hold/10")).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    assert_eq!(
        status_of(&client, &again).await,
        200,
        "after a complete answer"
    );

    // The client goes away mid-stream (HTTP/1: its connection closes).
    let mut response = get(&client, &format!("{base}/stream/200/20")).await;
    assert_eq!(response.status(), 200);
    response.chunk().await.unwrap().expect("a first event");
    assert_eq!(
        status_of(&client, &again).await,
        429,
        "held while streaming"
    );
    drop(response);
    let waited = admitted_within(&client, &again, Duration::from_secs(3)).await;
    assert!(
        waited < Duration::from_secs(3),
        "after the client left: {waited:?}"
    );

    // An HTTP/2 stream reset mid-answer, its connection kept.
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let mut response = get(&h2, &format!("{base}/stream/200/20")).await;
    assert_eq!(response.version(), http::Version::HTTP_2);
    response.chunk().await.unwrap().expect("a first event");
    assert_eq!(
        status_of(&h2, &again).await,
        429,
        "held while streaming (h2)"
    );
    drop(response);
    admitted_within(&h2, &again, Duration::from_secs(3)).await;

    assert_eq!(up.of(KEY).max, 1, "never two at once");

    // An upstream that cannot be reached, twice: the second is not refused for a place.
    for _ in 0..2 {
        assert_eq!(status_of(&client, &format!("{base}/dead")).await, 502);
    }
    // An upstream that does not answer in time. (The place is free when sluice gives up;
    // the upstream, never told, may still be working on it.)
    for _ in 0..2 {
        assert_eq!(
            status_of(&client, &format!("{base}/slow/hold/2000")).await,
            504
        );
    }
    // A body cut by sluice after admission (over max_body while it streams).
    for _ in 0..2 {
        let chunks = futures_util::stream::iter(
            (0..64).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 1024]))),
        );
        let response = client
            .post(format!("{base}/small/hold/300"))
            .header("x-api-key", KEY)
            .body(reqwest::Body::wrap_stream(chunks))
            .send()
            .await;
        if let Ok(response) = response {
            assert_eq!(response.status(), 413, "the body is over max_body");
        }
    }
    support::wait_for(Duration::from_secs(3), "every lease released", || async {
        lease_count(&redis, "one").await == 0
    })
    .await;
}

/// A stream that outlives its lease several times over keeps its place (renewed), and
/// arrives whole; another request of the key is refused throughout, admitted after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_longer_than_its_lease_keeps_its_place() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("one", 1).set("lease", "1s")).store_redis(&redis);
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let client = support::client();
    let stream = get(&client, &format!("{}/stream/35/100", a.url())).await;
    assert_eq!(stream.status(), 200);
    let reading = tokio::spawn(async move {
        let mut body = Vec::new();
        let mut chunks = stream.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            body.extend_from_slice(&chunk.expect("the stream is never cut"));
        }
        String::from_utf8(body).unwrap()
    });
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        for url in [a.url(), b.url()] {
            assert_eq!(
                status_of(&client, &format!("{url}/hold/0")).await,
                429,
                "the stream still holds the place"
            );
        }
    }
    let body = reading.await.unwrap();
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "the whole stream arrived: {body:?}"
    );
    admitted_within(
        &client,
        &format!("{}/hold/0", b.url()),
        Duration::from_secs(2),
    )
    .await;
    assert_eq!(up.of(KEY).max, 1);
}

/// An instance killed (SIGKILL) while holding places: the other instance, which holds the
/// last place itself (so its renewals keep the key alive: only a reclaim can free the dead
/// one's), refuses at first, and admits again within one lease period, without anyone
/// resetting anything; the reclaimed leases are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_instances_places_come_back_within_the_lease() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("three", 3).set("lease", "2s")).store_redis(&redis);
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let client = support::client();
    let mut held = Vec::new();
    for url in [a.url(), a.url(), b.url()] {
        let mut response = get(&client, &format!("{url}/stream/600/50")).await;
        assert_eq!(response.status(), 200);
        response.chunk().await.unwrap();
        held.push(response);
    }
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", b.url())).await,
        429
    );
    let status = std::process::Command::new("kill")
        .args(["-KILL", &a.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let killed = Instant::now();
    let b_holds = held.pop();
    drop(held);
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", b.url())).await,
        429,
        "the dead instance's leases count until its deadline"
    );
    let waited = admitted_within(
        &client,
        &format!("{}/hold/0", b.url()),
        Duration::from_secs(4),
    )
    .await;
    let since_kill = killed.elapsed();
    assert!(
        since_kill <= Duration::from_millis(3500),
        "reclaimed {since_kill:?} after the kill (lease 2 s; waited {waited:?})"
    );
    // B's next renewal reads the count the reclaim left.
    support::wait_for(
        Duration::from_secs(2),
        "2 reclaimed leases counted",
        || async {
            let metrics = support::parse_metrics(&b.metrics().await);
            support::metric_sum(
                &metrics,
                "sluice_concurrency_leases_total",
                &[("event", "reclaimed")],
            ) == 2.0
        },
    )
    .await;
    drop(b_holds);
}

/// Redis restarted empty while two streams on instance A hold both places: instance B, which
/// has used the limit before, gets nothing admitted until A's renewal has put both leases
/// back (the limit's epoch is gone with them, so the store holds the limit back for a quarter
/// lease and a margin), judged by the upstream's own record; then the restored leases count,
/// and once the streams end B is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_come_back_when_redis_restarts_empty() {
    let _heavy = support::heavy().await;
    let mut redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    // Refused while Redis is down, not decided in process (`local` would count per instance).
    let yaml = policy(&up, Limit::concurrent("two", 2).set("lease", "4s"))
        .store_redis(&redis)
        .on_store_error(support::OnStoreError::Deny);
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    a.expect_store_faults();
    b.expect_store_faults();
    let client = support::client();
    // B has used the limit: its later checks hold back a limit the store forgot.
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", b.url())).await,
        200
    );
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut response = get(&client, &format!("{}/stream/120/50", a.url())).await;
        assert_eq!(response.status(), 200);
        response.chunk().await.unwrap();
        held.push(response);
    }
    redis.restart().await;
    // Until A's next renewal (a quarter of the lease: 1 s) and well past it, B gets nothing
    // admitted: 503 while Redis comes back, then 429.
    let (mut refused, mut unavailable) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let response = get(&client, &format!("{}/stream/120/50", b.url())).await;
        match response.status().as_u16() {
            429 => refused += 1,
            503 => unavailable += 1,
            other => panic!(
                "B got {other} {:.1} s after Redis restarted empty, with both places held on A",
                start.elapsed().as_secs_f64()
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        refused > 20,
        "Redis answers again and refuses ({refused} 429, {unavailable} 503)"
    );
    assert_eq!(
        lease_count(&redis, "two").await,
        2,
        "A's two leases restored"
    );
    assert!(
        up.of(KEY).max <= 2,
        "the upstream served {} at once",
        up.of(KEY).max
    );
    let metrics = support::parse_metrics(&a.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_concurrency_leases_total",
            &[("event", "restored")]
        ),
        2.0
    );
    drop(held);
    admitted_within(
        &client,
        &format!("{}/hold/0", b.url()),
        Duration::from_secs(3),
    )
    .await;
}

/// The refusal: 429 problem+json naming the limit in concurrent requests, the policy field
/// with the draft's `concurrent-requests` unit and no window, and a Retry-After of at least 1.
#[tokio::test]
async fn a_refusal_says_what_happened() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let sluice =
        Sluice::start(&policy(&up, Limit::concurrent("at-once", 1)).store_redis(&redis)).await;
    let client = support::client();
    let mut holding = get(&client, &format!("{}/stream/100/20", sluice.url())).await;
    assert_eq!(holding.status(), 200);
    assert_eq!(
        support::header(&holding, "ratelimit-policy"),
        "\"at-once\";q=1;qu=\"concurrent-requests\""
    );
    assert_eq!(support::header(&holding, "ratelimit"), "\"at-once\";r=0");
    holding.chunk().await.unwrap();
    let refused = get(&client, &format!("{}/hold/0", sluice.url())).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(
        support::header(&refused, "content-type"),
        "application/problem+json"
    );
    let retry: u64 = support::header(&refused, "retry-after").parse().unwrap();
    assert!(retry >= 1);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["limit"], "at-once");
    assert_eq!(body["unit"], "concurrent-requests");
    assert_eq!(body["status"], 429);
}

/// `on_exceed: delay`: a request finding no place waits for one (admitted when the holder
/// ends) instead of being refused, never beside it; with too short a wait, it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_can_wait_for_a_place() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let sluice =
        Sluice::start(&policy(&up, Limit::concurrent("one", 1).delay("3s")).store_redis(&redis))
            .await;
    let client = support::client();
    let holder = {
        let (client, url) = (client.clone(), format!("{}/hold/600", sluice.url()));
        tokio::spawn(async move { status_of(&client, &url).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let start = Instant::now();
    let waiter = get(&client, &format!("{}/hold/0", sluice.url())).await;
    assert_eq!(waiter.status(), 200, "admitted once the holder ended");
    assert!(
        start.elapsed() >= Duration::from_millis(300),
        "it waited for the place"
    );
    assert_eq!(holder.await.unwrap(), 200);
    assert_eq!(up.of(KEY).max, 1, "never beside the holder");

    let short =
        Sluice::start(&policy(&up, Limit::concurrent("one", 1).delay("100ms")).store_redis(&redis))
            .await;
    let holder = {
        let (client, url) = (client.clone(), format!("{}/hold/800", short.url()));
        tokio::spawn(async move { status_of(&client, &url).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", short.url())).await,
        429
    );
    assert_eq!(holder.await.unwrap(), 200);
    let metrics = support::parse_metrics(&short.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_concurrency_leases_total",
            &[("event", "wait_timeout")]
        ),
        1.0
    );
}

/// A WebSocket holds its place until it closes: a second upgrade of the key is refused while
/// the first is open, admitted once it closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_websocket_holds_its_place_until_it_closes() {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let redis = Redis::start().await;
    let echo = support::websocket::EchoServer::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream(
            "echo",
            UpstreamSpec::new(&format!("http://{}", echo.addr)).timeout("10s"),
        )
        .route(
            Route::new("ws", "/ws")
                .upstream("echo")
                .limit(Limit::concurrent("sockets", 1).set("lease", "60s").key([])),
        );
    let sluice = Sluice::start(&yaml).await;
    let url = format!("ws://127.0.0.1:{}/ws", sluice.addr().port());
    let (mut first, _) = tokio_tungstenite::connect_async(&url)
        .await
        .expect("the first");
    first.send(Message::text("hello")).await.unwrap();
    assert!(first.next().await.is_some(), "an echo");
    let second = tokio_tungstenite::connect_async(&url).await;
    match second {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 429, "refused while the first is open")
        }
        other => panic!(
            "the second upgrade must be refused: {:?}",
            other.map(|_| ())
        ),
    }
    first.close(None).await.unwrap();
    drop(first);
    let start = Instant::now();
    loop {
        match tokio_tungstenite::connect_async(&url).await {
            Ok(_) => break,
            Err(_) => {
                assert!(
                    start.elapsed() < Duration::from_secs(3),
                    "admitted after the close"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// SIGTERM while a stream holds the place: the drain cuts it at the grace's end, and the
/// place is released at exit, not left to the (long) lease: the other instance admits at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_releases_the_places_it_cuts() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("one", 1).set("lease", "60s"))
        .store_redis(&redis)
        .server("shutdown_grace", "1s");
    let mut a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let client = support::client();
    let mut stream = get(&client, &format!("{}/stream/600/50", a.url())).await;
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap();
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", b.url())).await,
        429
    );
    a.terminate();
    assert!(
        a.wait_exit(Duration::from_secs(10)).await.is_some(),
        "a exits"
    );
    drop(stream);
    assert_eq!(
        lease_count(&redis, "one").await,
        0,
        "the lease was released at exit"
    );
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", b.url())).await,
        200
    );
}

/// The admin API lists a concurrency key's holders (lease, instance, age) and ends one: its
/// place is free at once, and the request's own release later finds it gone (counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_api_lists_the_holders_and_ends_one() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("one", 1).set("lease", "60s"))
        .store_redis(&redis)
        .set("admin", support::Node::map([("api", true)]));
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let mut stream = get(&client, &format!("{}/stream/200/20", sluice.url())).await;
    assert_eq!(stream.status(), 200);
    stream.chunk().await.unwrap();
    let limit = format!(
        "{}/admin/v1/limits/default/one?header.x-api-key={KEY}",
        sluice.admin_url()
    );
    let listed: serde_json::Value = client
        .get(&limit)
        .header("x-sluice-admin", "1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["count"], 1, "{listed}");
    assert_eq!(listed["unit"], "concurrent-requests", "{listed}");
    let holders = listed["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 1, "{listed}");
    let lease = holders[0]["lease"].as_str().unwrap().to_owned();
    assert!(lease.starts_with(holders[0]["instance"].as_str().unwrap()));
    assert!(holders[0]["age"].as_f64().unwrap() < 10.0);
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", sluice.url())).await,
        429
    );
    let ended: serde_json::Value = client
        .delete(format!(
            "{}/admin/v1/limits/default/one/leases/{lease}?header.x-api-key={KEY}",
            sluice.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ended["ended"], true, "{ended}");
    assert_eq!(
        status_of(&client, &format!("{}/hold/0", sluice.url())).await,
        200
    );
    drop(stream);
    support::wait_for(
        Duration::from_secs(3),
        "the late release counted as gone",
        || async {
            let metrics = support::parse_metrics(&sluice.metrics().await);
            support::metric_sum(
                &metrics,
                "sluice_concurrency_leases_total",
                &[("event", "gone")],
            ) == 1.0
        },
    )
    .await;
}

/// On a Redis Cluster, with keys in several slots (each key's lease hashes live in its own
/// slot, renewed per slot): two instances, 30 clients over three keys, never more than the
/// limit of any key at once at the upstream, each limit used whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_holds_the_limit_of_every_key() {
    const LIMIT: usize = 3;
    let _heavy = support::heavy().await;
    let cluster = support::RedisCluster::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(
        &up,
        Limit::concurrent("at-once", LIMIT as u32).set("lease", "2s"),
    )
    .store_cluster(&cluster);
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let urls = Arc::new([a.url(), b.url()]);
    let keys = ["alpha", "bravo", "charlie"];
    let mut slots = Vec::new();
    for key in keys {
        slots.push(cluster.slot_of(&format!("{{h:x-api-key={key}}}")).await);
    }
    slots.dedup();
    assert!(slots.len() > 1, "the keys live in several slots: {slots:?}");
    let client = support::client();
    let start = Instant::now();
    let tasks: Vec<_> = (0..30usize)
        .map(|i| {
            let (client, urls) = (client.clone(), Arc::clone(&urls));
            tokio::spawn(async move {
                let key = ["alpha", "bravo", "charlie"][i % 3];
                let mut n = 0;
                // Past one lease period, so renewals happen.
                while start.elapsed() < Duration::from_millis(3000) {
                    let url = format!("{}/hold/{}", urls[(i + n) % 2], 30 + (i * 11 + n * 7) % 90);
                    let response = client
                        .get(&url)
                        .header("x-api-key", key)
                        .send()
                        .await
                        .unwrap();
                    let status = response.status().as_u16();
                    let _ = response.bytes().await;
                    assert!(status == 200 || status == 429, "status {status}");
                    n += 1;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    for key in keys {
        let record = up.of(key);
        assert!(
            record.max <= LIMIT,
            "{key}: {} at once under {LIMIT}",
            record.max
        );
        assert_eq!(record.max, LIMIT, "{key}: the limit is used whole");
    }
}

/// Redis stopped under a stream that holds the place: the instance cannot renew the lease, so
/// before its deadline in Redis passes it cuts the stream (the client sees it end short, never
/// complete) and counts it `lost`; with Redis back, the key admits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_that_cannot_be_renewed_cuts_its_request() {
    let _heavy = support::heavy().await;
    let mut redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("one", 1).set("lease", "1s"))
        .store_redis(&redis)
        .on_store_error(support::OnStoreError::Deny);
    let sluice = Sluice::start(&yaml).await;
    sluice.expect_store_faults();
    let client = support::client();
    let stream = get(&client, &format!("{}/stream/100/50", sluice.url())).await;
    assert_eq!(stream.status(), 200);
    let reading = tokio::spawn(async move {
        let mut body = Vec::new();
        let mut chunks = stream.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(bytes) => body.extend_from_slice(&bytes),
                Err(_) => break,
            }
        }
        (Instant::now(), String::from_utf8_lossy(&body).into_owned())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.stop();
    let stopped = Instant::now();
    let (ended, body) = reading.await.unwrap();
    assert!(
        !body.contains("[DONE]"),
        "the stream was cut, not completed: {body:?}"
    );
    assert!(
        ended.duration_since(stopped) < Duration::from_millis(1500),
        "cut within the lease: {:?}",
        ended.duration_since(stopped)
    );
    let metrics = support::parse_metrics(&sluice.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_concurrency_leases_total",
            &[("event", "lost")]
        ),
        1.0
    );
    redis.restart().await;
    support::wait_for(
        Duration::from_secs(5),
        "admitted with Redis back",
        || async { status_of(&client, &format!("{}/hold/0", sluice.url())).await == 200 },
    )
    .await;
}

/// Clients that go away at any moment, the moment a release is on its way among them (40
/// clients aborted mid-run): every lease is released all the same, and once no request is in
/// flight the keys expire (an instance that kept a lease registered would renew it for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_vanish_leave_no_lease_behind() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("many", 1000).set("lease", "1s")).store_redis(&redis);
    let sluice = Sluice::start(&yaml).await;
    let url = format!("{}/hold/0", sluice.url());
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let client = support::client();
                loop {
                    let response = client
                        .get(&url)
                        .header("x-api-key", format!("k{}", i % 4))
                        .send()
                        .await;
                    if let Ok(response) = response {
                        let _ = response.bytes().await;
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Every connection dropped wherever its request stands.
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    support::wait_for(Duration::from_secs(5), "every key gone", || async {
        redis
            .keys()
            .await
            .iter()
            .all(|key| !key.contains(":many:concurrency:{"))
    })
    .await;
}

/// `sluice_config_reloads_total{result}`.
async fn reloads(sluice: &Sluice, result: &str) -> f64 {
    support::metric_sum(
        &support::parse_metrics(&sluice.metrics().await),
        "sluice_config_reloads_total",
        &[("result", result)],
    )
}

/// `sluice_concurrency_leases_total{event}`.
async fn lease_events(sluice: &Sluice, event: &str) -> f64 {
    support::metric_sum(
        &support::parse_metrics(&sluice.metrics().await),
        "sluice_concurrency_leases_total",
        &[("event", event)],
    )
}

/// Reloads a running `sluice` with `policy` (same store, so no restart is needed): its config
/// file rewritten by a rename (the `listen` and `admin_listen` lines kept), then SIGHUP;
/// returns once the reload counts as applied.
async fn reload(sluice: &Sluice, policy: &Policy) {
    let before = reloads(sluice, "ok").await;
    let text = std::fs::read_to_string(sluice.config_path()).expect("read the config");
    let head: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
    support::replace_file(sluice.config_path(), &format!("{head}{}", policy.to_yaml()));
    let status = std::process::Command::new("kill")
        .args(["-HUP", &sluice.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -HUP {}", sluice.pid());
    support::wait_for(Duration::from_secs(10), "the reload applied", || async {
        reloads(sluice, "ok").await > before
    })
    .await;
    assert_eq!(reloads(sluice, "error").await, 0.0, "{}", sluice.log());
}

/// Waits (up to 5 s) until the upstream serves exactly `n` requests of the key at once.
async fn in_flight_at_upstream(up: &InFlightUpstream, n: usize) {
    support::wait_for(
        Duration::from_secs(5),
        &format!("{n} in flight at the upstream"),
        || async { up.of(KEY).now == n },
    )
    .await;
}

/// A reload lowers a limit from 10 to 4 while 7 requests hold places: the store key does not
/// carry the number, so the 7 still count. Nothing new is admitted while 7, 6, 5 or 4 are in
/// flight; with 3, one is; from then on the upstream never serves more than 4 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_that_lowers_a_limit_admits_nothing_until_below_it() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let with = |at_once: u32| {
        policy(
            &up,
            Limit::concurrent("at-once", at_once).set("lease", "60s"),
        )
        .store_redis(&redis)
    };
    let sluice = Sluice::start(&with(10)).await;
    let client = support::client();
    let probe = format!("{}/hold/0", sluice.url());
    // Seven streams that last until their clients leave (the 1000 events take 50 s).
    let mut held = Vec::new();
    for _ in 0..7 {
        let mut stream = get(&client, &format!("{}/stream/1000/50", sluice.url())).await;
        assert_eq!(stream.status(), 200);
        stream.chunk().await.unwrap().expect("a first event");
        held.push(stream);
    }
    in_flight_at_upstream(&up, 7).await;
    assert_eq!(
        status_of(&client, &probe).await,
        200,
        "under 10, an eighth is admitted"
    );

    reload(&sluice, &with(4)).await;
    up.reset_max(KEY);
    let refused = get(&client, &probe).await;
    assert_eq!(refused.status(), 429, "7 in flight under the lowered limit");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["limit"], "at-once", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("allows 4 "),
        "the lowered limit refused it: {body}"
    );
    for in_flight in (4..=7).rev() {
        in_flight_at_upstream(&up, in_flight).await;
        for _ in 0..3 {
            assert_eq!(
                status_of(&client, &probe).await,
                429,
                "{in_flight} in flight under a limit lowered to 4"
            );
        }
        // One of the old requests ends: its client leaves mid-stream.
        drop(held.pop());
    }
    in_flight_at_upstream(&up, 3).await;
    let record = up.of(KEY);
    assert!(
        record.max <= 7,
        "{} in flight at once after the reload, with 7 before it",
        record.max
    );
    up.reset_max(KEY);
    let waited = admitted_within(&client, &probe, Duration::from_secs(3)).await;
    println!("admitted {waited:?} after the fourth old request ended");

    // From 3 in flight on, many clients at once: never more than 4, and 4 reached.
    let start = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let client = client.clone();
            let url = format!("{}/hold/{}", sluice.url(), 40 + i * 10);
            tokio::spawn(async move {
                let mut admitted = 0;
                while start.elapsed() < Duration::from_millis(1500) {
                    match status_of(&client, &url).await {
                        200 => admitted += 1,
                        429 => tokio::time::sleep(Duration::from_millis(10)).await,
                        other => panic!("unexpected status {other}"),
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    let record = up.of(KEY);
    assert!(
        record.max <= 4,
        "{} in flight at once under the lowered limit of 4, once below it",
        record.max
    );
    assert_eq!(record.max, 4, "the lowered limit is used whole");
    assert!(admitted > 8, "the clients were admitted: {admitted}");
    drop(held);
    support::wait_for(Duration::from_secs(3), "every lease released", || async {
        lease_count(&redis, "at-once").await == 0
    })
    .await;
}

/// A reload removes the route's concurrency limit while 3 requests hold all its places: new
/// requests pass unlimited at once; the old ones keep their leases until they end, and their
/// ends release them (the old limit's lease hash empties, no release found its lease gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reload_that_removes_a_limit_releases_its_leases_as_requests_end() {
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let limited =
        policy(&up, Limit::concurrent("capped", 3).set("lease", "60s")).store_redis(&redis);
    let unlimited = Policy::new()
        .store_redis(&redis)
        .upstream(
            "api",
            UpstreamSpec::new(&up.url())
                .connect_timeout("2s")
                .timeout("20s"),
        )
        .route(Route::new("default", "/").upstream("api"));
    let sluice = Sluice::start(&limited).await;
    let client = support::client();
    let probe = format!("{}/hold/0", sluice.url());
    // Three streams of 60 events 50 ms apart: about 3 s, read whole later.
    let mut old = Vec::new();
    for _ in 0..3 {
        let mut stream = get(&client, &format!("{}/stream/60/50", sluice.url())).await;
        assert_eq!(stream.status(), 200);
        let first = stream.chunk().await.unwrap().expect("a first event");
        old.push((stream, first));
    }
    assert_eq!(status_of(&client, &probe).await, 429, "the 3 places taken");
    assert_eq!(lease_count(&redis, "capped").await, 3);

    reload(&sluice, &unlimited).await;
    let reloaded = Instant::now();
    // New requests: unlimited, 6 at once beside the 3 old ones.
    up.reset_max(KEY);
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (client, url) = (client.clone(), format!("{}/hold/400", sluice.url()));
            tokio::spawn(async move {
                let response = get(&client, &url).await;
                let status = response.status().as_u16();
                let limited = response.headers().contains_key("ratelimit-policy");
                let _ = response.bytes().await;
                (status, limited)
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(
            task.await.unwrap(),
            (200, false),
            "admitted, under no limit"
        );
    }
    let record = up.of(KEY);
    assert!(
        record.max >= 6,
        "{} in flight at once: the new requests were not held to the old limit",
        record.max
    );
    assert_eq!(
        up.of(KEY).now,
        3,
        "the old requests are still in flight ({:?} since the reload)",
        reloaded.elapsed()
    );
    assert_eq!(
        lease_count(&redis, "capped").await,
        3,
        "the old requests keep their leases"
    );

    // The old requests end, each answer read whole.
    for (stream, first) in old {
        let mut body = first.to_vec();
        body.extend_from_slice(&stream.bytes().await.expect("the rest of the stream"));
        assert!(
            String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"),
            "the old stream arrived whole"
        );
    }
    let ended = Instant::now();
    support::wait_for(
        Duration::from_secs(3),
        "the old limit's leases released",
        || async { lease_count(&redis, "capped").await == 0 },
    )
    .await;
    println!("the old leases released within {:?}", ended.elapsed());
    let keys = redis.keys().await;
    assert!(
        !keys
            .iter()
            .any(|key| key.contains(":capped:concurrency:{") && !key.ends_with(":i")),
        "the old limit's lease hash is gone: {keys:?}"
    );
    assert_eq!(
        lease_events(&sluice, "gone").await,
        0.0,
        "the releases found their leases"
    );
}

/// A client that requests an endless answer and then reads nothing: once sluice's writes to
/// it have been blocked for `idle_timeout` (1 s), its connection is cut, and so is the answer:
/// its place is free (the next request of the key is admitted, its lease gone from Redis)
/// and the upstream sees its request end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_reader_cut_by_the_idle_timeout_releases_its_place() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("one", 1).set("lease", "60s"))
        .store_redis(&redis)
        .server("idle_timeout", "1s");
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let probe = format!("{}/hold/0", sluice.url());

    // 1 GiB, never read: the buffers between sluice and the client fill at once.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(sluice.addr()).await.unwrap();
    stalled
        .write_all(
            format!(
                "GET /bytes/{} HTTP/1.1\r\nhost: sluice\r\nx-api-key: {KEY}\r\n\r\n",
                1u64 << 30
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    in_flight_at_upstream(&up, 1).await;
    let started = Instant::now();
    assert_eq!(
        status_of(&client, &probe).await,
        429,
        "the stalled reader holds the place"
    );
    // Cut between 1 and 1.25 idle timeouts after its last byte moved; 4 s of margin.
    let waited = admitted_within(&client, &probe, Duration::from_secs(5)).await;
    println!(
        "admitted {:?} after the stalled request reached the upstream",
        started.elapsed()
    );
    assert!(
        waited >= Duration::from_millis(800),
        "not before the idle timeout: {waited:?}"
    );
    support::wait_for(
        Duration::from_secs(2),
        "the lease gone from Redis",
        || async { lease_count(&redis, "one").await == 0 },
    )
    .await;
    in_flight_at_upstream(&up, 0).await;
    // sluice closed the connection: what the buffers held, then the end.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut read = 0usize;
        loop {
            match stalled.read(&mut buf).await {
                Ok(0) | Err(_) => return read,
                Ok(n) => read += n,
            }
        }
    })
    .await;
    let read = closed.expect("sluice closed the stalled connection");
    assert!(read < 1 << 30, "the answer was cut: {read} bytes");
    assert_eq!(up.of(KEY).max, 1, "never two at once");
}

/// Two concurrency limits on one request (3 per key, 4 for the route), two keys, 16 clients:
/// the ends ride in the connection's batched calls with decisions, and every one lands in
/// both limits: the upstream never serves more than 3 of a key or 4 in all, and afterwards
/// no lease is left in either limit and no end found its lease gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_under_two_limits_ends_in_both() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream("api", UpstreamSpec::new(&up.url()).timeout("20s"))
        .route(
            Route::new("default", "/")
                .upstream("api")
                .limit(Limit::concurrent("per-key", 3).key(["header:x-api-key"]))
                .limit(Limit::concurrent("route", 4).key::<0>([])),
        );
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let url = sluice.url();
    let start = Instant::now();
    let tasks: Vec<_> = (0..16usize)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let key = if i % 2 == 0 { "a" } else { "b" };
                let mut ok = 0;
                while start.elapsed() < Duration::from_secs(2) {
                    let response = client
                        .get(format!("{url}/hold/{}", 5 + i % 7))
                        .header("x-api-key", key)
                        .send()
                        .await
                        .expect("a response");
                    match response.status().as_u16() {
                        200 => {
                            response.bytes().await.expect("the body");
                            ok += 1;
                        }
                        429 => {}
                        other => panic!("unexpected status {other}"),
                    }
                }
                ok
            })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        ok += task.await.unwrap();
    }
    let (a, b) = (up.of("a"), up.of("b"));
    assert!(a.max <= 3 && b.max <= 3, "per key: {} and {}", a.max, b.max);
    assert_eq!(
        a.served + b.served,
        ok,
        "every admitted request reached the upstream"
    );
    assert!(ok > 50, "the limits admit ({ok} admitted)");
    for limit in ["per-key", "route"] {
        support::wait_for(Duration::from_secs(3), "every lease ended", || async {
            lease_count(&redis, limit).await == 0
        })
        .await;
    }
    let metrics = support::parse_metrics(&sluice.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_concurrency_leases_total",
            &[("event", "gone")]
        ),
        0.0,
        "every end found its lease"
    );
}

/// Sixty keys, each new to the instance, with short requests ending all the time: each key's
/// first renewal (125 ms in, a 1 s lease) is a restore, and requests end while it is on its
/// way. A lease whose release landed before the restore must not be written back: a moment
/// after the traffic stops (well inside the lease, so nothing expired), no key holds a lease,
/// and no end found its lease gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restore_on_its_way_as_requests_end_writes_back_none_of_them() {
    const KEYS: usize = 60;
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = InFlightUpstream::start().await;
    let yaml = policy(&up, Limit::concurrent("many", 1000).set("lease", "1s")).store_redis(&redis);
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let url = sluice.url();
    let start = Instant::now();
    let tasks: Vec<_> = (0..2 * KEYS)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                // The keys start one by one, so their first renewals spread over the run.
                tokio::time::sleep(Duration::from_millis(10 * (i % KEYS) as u64)).await;
                while start.elapsed() < Duration::from_millis(1500) {
                    let response = client
                        .get(format!("{url}/hold/1"))
                        .header("x-api-key", format!("k{}", i % KEYS))
                        .send()
                        .await
                        .expect("a response");
                    assert_eq!(response.status(), 200, "the limit is never reached");
                    response.bytes().await.expect("the body");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    support::wait_for(Duration::from_millis(400), "every lease ended", || async {
        lease_count(&redis, "many").await == 0
    })
    .await;
    let metrics = support::parse_metrics(&sluice.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_concurrency_leases_total",
            &[("event", "gone")]
        ),
        0.0,
        "every end found its lease"
    );
}
