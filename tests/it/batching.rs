//! Batched decisions stay exact: two sluice instances on one Redis, many clients at once on
//! keys of every algorithm, so that most calls carry several decisions. Every key admits
//! exactly its limit, counted from the upstream's record of what it received, and Redis ran
//! fewer script calls than it made decisions.

use crate::support;

use std::sync::Arc;

use futures_util::StreamExt;
use support::{Limit, Policy, Redis, Route, Sluice, Upstream};

const LIMIT: usize = 20;
const KEYS_PER_ALGORITHM: usize = 8;
const REQUESTS_PER_KEY: usize = 40;
const CLIENTS: usize = 64;
const ALGORITHMS: [&str; 4] = ["sliding_log", "sliding_window", "fixed_window", "gcra"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_decisions_never_exceed_a_limit() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    // A window far longer than the test: every key's count can only grow, so "exactly
    // LIMIT admitted" is exact for each algorithm (GCRA's burst is the limit).
    let policy = ALGORITHMS.into_iter().fold(
        Policy::new().store_redis(&redis).upstream("api", up.url()),
        |policy, algorithm| {
            policy.route(
                Route::new(algorithm, &format!("/{algorithm}/"))
                    .upstream("api")
                    .limit(
                        Limit::requests("a", LIMIT as u32, "1h")
                            .key(["header:x-api-key"])
                            .algorithm(algorithm),
                    ),
            )
        },
    );
    let a = Sluice::start(&policy).await;
    let b = Sluice::start(&policy).await;
    let bases = Arc::new([a.url(), b.url()]);
    redis.cmd(&["CONFIG", "RESETSTAT"]).await;

    // Every (algorithm, key) pair REQUESTS_PER_KEY times, interleaved, alternating instances.
    let requests: Vec<(usize, String)> = (0..REQUESTS_PER_KEY)
        .flat_map(|round| {
            ALGORITHMS.iter().flat_map(move |algorithm| {
                (0..KEYS_PER_ALGORITHM)
                    .map(move |key| (round + key, format!("/{algorithm}/k{key}")))
            })
        })
        .collect();
    let client = support::client();
    let statuses: Vec<u16> = futures_util::stream::iter(requests)
        .map(|(n, path)| {
            let key = path.rsplit('/').next().unwrap_or_default().to_owned();
            let request = client
                .get(format!("{}{path}", bases[n % 2]))
                .header("x-api-key", key);
            async move { request.send().await.expect("a response").status().as_u16() }
        })
        .buffer_unordered(CLIENTS)
        .collect()
        .await;
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 429),
        "only 200 and 429 expected"
    );

    // The upstream's record: each key exactly its limit, never more.
    let paths = up.paths();
    for algorithm in ALGORITHMS {
        for key in 0..KEYS_PER_ALGORITHM {
            let path = format!("/{algorithm}/k{key}");
            let forwarded = paths.iter().filter(|p| **p == path).count();
            assert_eq!(forwarded, LIMIT, "{path}: forwarded to the upstream");
        }
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    assert_eq!(
        admitted,
        paths.len(),
        "every admission reached the upstream"
    );

    // Batched: fewer script calls than decisions Redis made (sluice times each decision it
    // sent; the rejections answered from its deny cache were never sent).
    let mut decided = 0.0;
    for sluice in [&a, &b] {
        let metrics = support::parse_metrics(&sluice.metrics().await);
        decided += support::metric_sum(
            &metrics,
            "sluice_store_call_duration_seconds_count",
            &[("store", "redis")],
        );
    }
    let calls = redis.commandstat("evalsha").await;
    println!(
        "{} requests, {admitted} admitted, {decided} decided by Redis in {calls} calls",
        statuses.len()
    );
    assert!(
        (calls as f64) < decided * 0.8,
        "{calls} script calls for {decided} decisions: not batched"
    );
}
