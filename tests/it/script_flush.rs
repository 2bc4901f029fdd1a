//! `SCRIPT FLUSH` on the Redis (as after a Redis restart or failover) must not
//! disturb decisions: the gateway reloads its script transparently.

use crate::support;

use support::{metric_sum, parse_metrics, Limit, Policy, Redis, Route, Sluice, Upstream};

async fn status(c: &reqwest::Client, url: &str, key: &str) -> u16 {
    c.get(url)
        .header("x-api-key", key)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .status()
        .as_u16()
}

async fn store_errors(s: &Sluice) -> f64 {
    let m = parse_metrics(&s.metrics().await);
    metric_sum(&m, "sluice_store_errors_total", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_survive_script_flush() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(
        &Policy::new()
            .store_redis(&redis)
            .upstream("api", up.url())
            .route(
                Route::new("default", "/")
                    .upstream("api")
                    .limit(Limit::requests("per-key", 5, "1m").key(["header:x-api-key"])),
            ),
    )
    .await;
    let c = support::client();
    let url = format!("{}/flush", sluice.url());
    let errors_before = store_errors(&sluice).await;

    // Flush before the very first request (scripts may be preloaded at start).
    redis.cmd(&["SCRIPT", "FLUSH"]).await;
    for i in 1..=3 {
        assert_eq!(status(&c, &url, "a").await, 200, "request {i} of key a");
    }

    redis.cmd(&["SCRIPT", "FLUSH"]).await;
    let got: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(status(&c, &url, "a").await);
        }
        v
    };
    assert_eq!(
        got,
        vec![200, 200, 429, 429],
        "after SCRIPT FLUSH: 3 used of 5, so 2 more admitted then rejected"
    );

    redis.cmd(&["SCRIPT", "FLUSH"]).await;
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(status(&c, &url, "b").await);
    }
    assert_eq!(got, vec![200, 200, 200, 200, 200, 429], "fresh key b");

    // Flush between a rejection and a fresh key's admissions.
    redis.cmd(&["SCRIPT", "FLUSH"]).await;
    assert_eq!(status(&c, &url, "a").await, 429, "key a stays exhausted");
    assert_eq!(status(&c, &url, "c").await, 200, "fresh key c");

    assert_eq!(up.hits(), 5 + 5 + 1);
    let keys = redis.keys().await;
    assert!(!keys.is_empty(), "the Redis store holds the logs");
    for k in &keys {
        assert!(
            k.starts_with("sluice-test"),
            "key {k:?} lacks the configured key_prefix"
        );
    }
    let errors_after = store_errors(&sluice).await;
    assert_eq!(
        errors_after, errors_before,
        "sluice_store_errors_total must not increase across SCRIPT FLUSH"
    );
    let m = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(
            &m,
            "sluice_requests_total",
            &[("route", "default"), ("outcome", "store_error")]
        ),
        0.0,
        "no request may end in a store error"
    );
}
