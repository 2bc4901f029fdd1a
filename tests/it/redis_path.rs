//! The Redis path: concurrent decisions sharing a few connections and leaving together (one
//! EVALSHA for the decisions waiting on a connection, and nothing else), a lone decision
//! leaving at once, every decision bounded by the store timeout (also while Redis hangs),
//! and a lost connection re-established by itself, with `/readyz` following.

use crate::support;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use support::{Limit, OnStoreError, Policy, Redis, Route, Sluice};

const TIMEOUT_MS: u64 = 200;

async fn start(redis: &Redis) -> Sluice {
    let policy = Policy::new()
        .store_redis(redis)
        .redis_setting("timeout", format!("{TIMEOUT_MS}ms"))
        .redis_setting("pool_size", 2)
        .on_store_error(OnStoreError::Deny)
        .route(
            Route::new("api", "/")
                .respond(200, "ok")
                .limit(Limit::requests("per-key", 1_000_000, "1m").key(["header:x-api-key"])),
        );
    Sluice::start(&policy).await
}

/// Sends `count` requests, 16 at a time, and returns their statuses.
async fn burst(sluice: &Sluice, count: usize) -> Vec<u16> {
    let client = support::client();
    let url = format!("{}/", sluice.url());
    futures_util::stream::iter(0..count)
        .map(|n| {
            let request = client.get(&url).header("x-api-key", format!("k{}", n % 50));
            async move { request.send().await.map_or(0, |r| r.status().as_u16()) }
        })
        .buffer_unordered(16)
        .collect()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_leave_batched_and_nothing_else_is_sent() {
    let redis = Redis::start().await;
    let sluice = start(&redis).await;
    // Warm up (the script is loaded at start; connections open on first use).
    assert!(burst(&sluice, 20).await.iter().all(|&s| s == 200));
    let monitor = redis.monitor().await;
    let statuses = burst(&sluice, 500).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    // Every command sluice sent, whatever its name, is an EVALSHA of the decide script (no
    // PING, no EVAL with the script's text, no SCRIPT LOAD, no MULTI), and decisions that
    // waited on a connection together left in one: fewer calls than decisions.
    let commands = monitor.commands().await;
    println!("{} EVALSHA for 500 decisions", commands.len());
    assert!(commands.iter().all(|c| c == "EVALSHA"), "{commands:?}");
    assert!(
        commands.len() <= 375,
        "{} calls for 500 concurrent decisions: not batched",
        commands.len()
    );
    // Concurrent decisions share the configured two connections (and nothing is pooled
    // beyond them): CLIENT LIST counts our connection for the query, plus sluice's.
    let clients = match redis.cmd(&["CLIENT", "LIST"]).await {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        redis::Value::VerbatimString { text, .. } => text,
        other => panic!("CLIENT LIST answered {other:?}"),
    };
    // Not counted: the store event channel's subscriber (flag P), not a decision connection.
    let sluice_connections = clients
        .lines()
        .filter(|l| !l.contains("cmd=client") && !l.contains(" flags=P "))
        .count();
    assert!(
        sluice_connections <= 2,
        "sluice holds {sluice_connections} connections:\n{clients}"
    );
    // Every decision of every batch was recorded: the 50 keys' logs hold all 520 admissions.
    let redis::Value::Array(keys) = redis.cmd(&["KEYS", "*"]).await else {
        panic!("KEYS answered no array");
    };
    assert_eq!(keys.len(), 50, "one key per identity");
    let mut recorded = 0;
    for key in keys {
        let redis::Value::BulkString(key) = key else {
            panic!("a key that is not a string: {key:?}");
        };
        let key = String::from_utf8(key).expect("a UTF-8 key");
        let redis::Value::Int(entries) = redis.cmd(&["ZCARD", &key]).await else {
            panic!("ZCARD {key}");
        };
        recorded += entries;
    }
    assert_eq!(recorded, 520, "admissions recorded in Redis");
}

/// A decision alone on its connection is sent at once: no timer waits for others to join
/// it. Sequential requests each cost one call, and the fastest limited request takes less
/// than a millisecond more than the fastest unlimited one (a batching window of a
/// millisecond, the usual timer, would add at least that to every lone decision).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_decision_leaves_at_once() {
    let redis = Redis::start().await;
    let yaml = Policy::new()
        .store_redis_url_defaults(&redis.url())
        .redis_setting("timeout", format!("{TIMEOUT_MS}ms"))
        .redis_setting("pool_size", 2)
        .route(Route::new("plain", "/plain").respond(200, "ok"))
        .route(
            Route::new("api", "/")
                .respond(200, "ok")
                .limit(Limit::requests("per-key", 1_000_000, "1m").key(["header:x-api-key"])),
        );
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let time = |path: &'static str| {
        let request = client
            .get(format!("{}{path}", sluice.url()))
            .header("x-api-key", "alone");
        async move {
            let started = Instant::now();
            let status = request.send().await.unwrap().status();
            assert_eq!(status, 200, "{path}");
            started.elapsed()
        }
    };
    for _ in 0..20 {
        time("/plain").await;
        time("/limited").await;
    }
    redis.cmd(&["CONFIG", "RESETSTAT"]).await;
    let (mut plain, mut limited) = (Vec::new(), Vec::new());
    for _ in 0..200 {
        plain.push(time("/plain").await);
        limited.push(time("/limited").await);
    }
    assert_eq!(
        redis.commandstat("evalsha").await,
        200,
        "one call per lone decision"
    );
    // The fastest of each: a timer would add its wait to every lone decision, while the
    // noise of a busy machine only ever adds.
    let (plain, limited) = (
        plain.iter().min().copied().unwrap_or_default(),
        limited.iter().min().copied().unwrap_or_default(),
    );
    println!("fastest: {plain:?} unlimited, {limited:?} limited");
    assert!(
        limited < plain + Duration::from_micros(1000),
        "the fastest lone decision took {limited:?}, against {plain:?} without a limit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_each_request_at_most_the_timeout() {
    let redis = Redis::start().await;
    let sluice = start(&redis).await;
    sluice.expect_store_faults();
    assert!(burst(&sluice, 10).await.iter().all(|&s| s == 200));
    // Redis stops answering for 3 s.
    redis.cmd(&["CLIENT", "PAUSE", "3000", "ALL"]).await;
    let client = support::client();
    let mut slowest = Duration::ZERO;
    for n in 0..5 {
        let started = Instant::now();
        let response = client
            .get(format!("{}/", sluice.url()))
            .header("x-api-key", format!("hung-{n}"))
            .send()
            .await
            .unwrap();
        slowest = slowest.max(started.elapsed());
        assert_eq!(response.status(), 503);
    }
    // The timeout plus a generous margin for a debug build on a busy machine.
    assert!(
        slowest < Duration::from_millis(TIMEOUT_MS + 400),
        "a request waited {slowest:?} for a hung Redis"
    );
    // Once Redis answers again (the pause ends 3 s after it began), so does sluice.
    support::wait_for(
        Duration::from_secs(10),
        "sluice to decide with Redis again",
        || async { burst(&sluice, 10).await.iter().all(|&s| s == 200) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_is_reconnected_and_readyz_follows() {
    let mut redis = Redis::start().await;
    let sluice = start(&redis).await;
    sluice.expect_store_faults();
    let client = support::client();
    let readyz = format!("{}/readyz", sluice.admin_url());
    assert!(burst(&sluice, 20).await.iter().all(|&s| s == 200));
    assert_eq!(client.get(&readyz).send().await.unwrap().status(), 200);

    redis.stop();
    let down = burst(&sluice, 10).await;
    assert!(down.iter().all(|&s| s == 503), "{down:?}");
    assert_eq!(client.get(&readyz).send().await.unwrap().status(), 503);

    // Back on the same port, empty: no script loaded, no connection open.
    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let statuses = burst(&sluice, 10).await;
        if statuses.iter().all(|&s| s == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {statuses:?} 5 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(client.get(&readyz).send().await.unwrap().status(), 200);
    // Decided in the new Redis, which started empty: the decide script ran there (batched,
    // so in fewer calls than decisions) and wrote each of the ten identities' keys.
    assert!(
        redis.commandstat("evalsha").await >= 1,
        "the decisions were made in the new Redis"
    );
    let keys = redis.keys().await;
    assert!(
        keys.len() >= 10,
        "the new Redis holds the ten identities' keys: {keys:?}"
    );
}
