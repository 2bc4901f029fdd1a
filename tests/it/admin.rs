//! Admin endpoints: /healthz, /readyz (follows Redis), /metrics series and
//! labels; and the 503 answer of limited routes while the store is down.

use crate::support;

use std::time::{Duration, Instant};

use support::{
    metric_sum, parse_metrics, Limit, OnStoreError, Policy, Redis, Route, Sluice, Upstream,
    UpstreamSpec,
};

const API_KEY: &str = "sk-live-SECRET-0123456789";
/// How long the upstream takes on `/slow/…`: between two request-duration bucket bounds.
const SLOW_MS: u64 = 1200;
/// Requests sent to a limited route while Redis is down.
const STORE_FAILURES: usize = 3;

fn config(store: Policy, up: &str, closed_port: u16) -> Policy {
    store
        .upstream(
            "api",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("10s"),
        )
        .upstream(
            "dead",
            UpstreamSpec::new(&format!("http://127.0.0.1:{closed_port}"))
                .connect_timeout("1s")
                .timeout("5s"),
        )
        .route(Route::new("status", "/status").respond(200, "ok\n"))
        .route(Route::new("dead", "/dead").upstream("dead"))
        .route(Route::new("slow", "/slow").upstream("api"))
        .route(
            Route::new("default", "/api")
                .upstream("api")
                .on_store_error(OnStoreError::Deny)
                .limit(Limit::requests("per-key", 2, "1m").key(["header:x-api-key"])),
        )
}

async fn get_status(c: &reqwest::Client, url: &str) -> u16 {
    c.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let mut redis = Redis::start().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(
        Policy::new().store_redis(&redis),
        &up.url(),
        support::closed_port(),
    ))
    .await;
    // Redis is stopped at the end to see /readyz fail.
    sluice.expect_store_faults();
    let c = support::client();
    let admin = sluice.admin_url();

    assert_eq!(get_status(&c, &format!("{admin}/healthz")).await, 200);
    assert_eq!(
        get_status(&c, &format!("{admin}/readyz")).await,
        200,
        "ready: config loaded and Redis answers"
    );

    // Traffic: 2 forwarded + 1 limited on `default`, 1 responded, 1
    // upstream error, 1 no route, 1 slow (1.2 s) forwarded on `slow`.
    let api = format!("{}/api/thing", sluice.url());
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = c
            .get(&api)
            .header("x-api-key", API_KEY)
            .send()
            .await
            .unwrap();
        got.push(r.status().as_u16());
    }
    assert_eq!(got, vec![200, 200, 429]);
    assert_eq!(
        get_status(&c, &format!("{}/status", sluice.url())).await,
        200
    );
    assert_eq!(get_status(&c, &format!("{}/dead", sluice.url())).await, 502);
    assert_eq!(
        get_status(&c, &format!("{}/nowhere", sluice.url())).await,
        404
    );
    assert_eq!(
        get_status(&c, &format!("{}/slow/{SLOW_MS}", sluice.url())).await,
        200
    );

    let text = sluice.metrics().await;
    let m = parse_metrics(&text);
    let count = |name: &str, labels: &[(&str, &str)]| metric_sum(&m, name, labels);

    assert_eq!(
        count(
            "sluice_requests_total",
            &[("route", "default"), ("outcome", "forwarded")]
        ),
        2.0,
        "forwarded on default\n{text}"
    );
    assert_eq!(
        count(
            "sluice_requests_total",
            &[("route", "default"), ("outcome", "limited")]
        ),
        1.0,
        "limited on default\n{text}"
    );
    assert_eq!(
        count(
            "sluice_requests_total",
            &[("route", "status"), ("outcome", "responded")]
        ),
        1.0,
        "responded on status\n{text}"
    );
    assert_eq!(
        count(
            "sluice_requests_total",
            &[("route", "dead"), ("outcome", "upstream_error")]
        ),
        1.0,
        "upstream_error on dead\n{text}"
    );
    assert_eq!(
        count("sluice_requests_total", &[("outcome", "no_route")]),
        1.0,
        "no_route\n{text}"
    );
    assert_eq!(
        count(
            "sluice_limit_decisions_total",
            &[
                ("route", "default"),
                ("limit", "per-key"),
                ("decision", "admitted")
            ]
        ),
        2.0,
        "admitted decisions\n{text}"
    );
    assert_eq!(
        count(
            "sluice_limit_decisions_total",
            &[
                ("route", "default"),
                ("limit", "per-key"),
                ("decision", "rejected")
            ]
        ),
        1.0,
        "rejected decisions\n{text}"
    );
    assert_eq!(
        count(
            "sluice_upstream_errors_total",
            &[("upstream", "dead"), ("kind", "connect")]
        ),
        1.0,
        "the refused connection counted as kind=connect\n{text}"
    );
    assert_eq!(
        count("sluice_upstream_errors_total", &[]),
        1.0,
        "one upstream error in all\n{text}"
    );
    // Histograms: every request observed once, in seconds. The three requests on `default`
    // are fast; the one on `slow` takes 1.2 s, between the 1 s and 2.5 s bounds.
    let bucket = |route: &str, le: &str| {
        count(
            "sluice_request_duration_seconds_bucket",
            &[("route", route), ("le", le)],
        )
    };
    let durations = |route: &str| {
        [
            bucket(route, "1"),
            bucket(route, "2.5"),
            bucket(route, "+Inf"),
            count("sluice_request_duration_seconds_count", &[("route", route)]),
        ]
    };
    assert_eq!(
        durations("default"),
        [3.0, 3.0, 3.0, 3.0],
        "request durations of `default` (le=1, le=2.5, le=+Inf, count)\n{text}"
    );
    assert_eq!(
        durations("slow"),
        [0.0, 1.0, 1.0, 1.0],
        "request durations of `slow` (le=1, le=2.5, le=+Inf, count)\n{text}"
    );
    let slow_sum = count("sluice_request_duration_seconds_sum", &[("route", "slow")]);
    assert!(
        (1.2..2.5).contains(&slow_sum),
        "the slow request took {slow_sum} s by the histogram's sum\n{text}"
    );
    assert_eq!(
        count(
            "sluice_store_call_duration_seconds_count",
            &[("store", "redis")]
        ),
        3.0,
        "one store call per request on a limited route\n{text}"
    );

    // Now take Redis away.
    redis.stop();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = get_status(&c, &format!("{admin}/readyz")).await;
        if s == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz still {s} 5 s after Redis stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        get_status(&c, &format!("{admin}/healthz")).await,
        200,
        "healthz stays 200 while the process is up"
    );

    // A limited route cannot decide: 503 problem+json with Retry-After.
    let hits_before = up.hits();
    for _ in 1..STORE_FAILURES {
        // The last one is checked in detail below.
        let r = c.get(&api).header("x-api-key", "another-key").send();
        assert_eq!(
            r.await.unwrap().status(),
            503,
            "store down on a limited route"
        );
    }
    let r = c
        .get(&api)
        .header("x-api-key", "another-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "store down on a limited route");
    let ra = r
        .headers()
        .get("retry-after")
        .expect("503 carries retry-after")
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        ra.parse::<u64>().is_ok(),
        "retry-after {ra:?} is whole seconds"
    );
    assert!(r
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("application/problem+json"));
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["status"], 503, "{body}");
    assert_eq!(up.hits(), hits_before, "not forwarded while undecidable");

    // A route without limits does not need the store.
    assert_eq!(
        get_status(&c, &format!("{}/status", sluice.url())).await,
        200
    );

    let text = sluice.metrics().await;
    let m = parse_metrics(&text);
    let failures = STORE_FAILURES as f64;
    assert_eq!(
        metric_sum(
            &m,
            "sluice_requests_total",
            &[("route", "default"), ("outcome", "store_error")]
        ),
        failures,
        "store_error outcome\n{text}"
    );
    // Redis is gone, so every call fails to connect: counted under kind=connection, and under
    // no other kind.
    assert_eq!(
        metric_sum(
            &m,
            "sluice_store_errors_total",
            &[("store", "redis"), ("kind", "connection")]
        ),
        failures,
        "store errors of kind connection\n{text}"
    );
    assert_eq!(
        metric_sum(&m, "sluice_store_errors_total", &[]),
        failures,
        "store errors of every kind\n{text}"
    );
    assert_eq!(
        metric_sum(
            &m,
            "sluice_store_call_duration_seconds_count",
            &[("store", "redis")]
        ),
        3.0 + failures,
        "failed store calls are timed too\n{text}"
    );

    // No label value carries a client identity.
    for s in &m {
        for (k, v) in &s.labels {
            assert!(
                !v.contains(API_KEY) && !v.contains("another-key"),
                "label {k}={v:?} on {} contains an API key",
                s.name
            );
            assert!(
                !v.contains("127.0.0.1"),
                "label {k}={v:?} on {} contains an IP address",
                s.name
            );
        }
    }
    assert!(!text.contains(API_KEY), "API key appears in /metrics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_with_in_process_store() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(Policy::new(), &up.url(), support::closed_port())).await;
    let c = support::client();
    assert_eq!(
        get_status(&c, &format!("{}/healthz", sluice.admin_url())).await,
        200
    );
    assert_eq!(
        get_status(&c, &format!("{}/readyz", sluice.admin_url())).await,
        200
    );
    let r = c
        .get(format!("{}/api/x", sluice.url()))
        .header("x-api-key", API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = sluice.metrics().await;
    let m = parse_metrics(&text);
    assert!(
        metric_sum(
            &m,
            "sluice_limit_decisions_total",
            &[
                ("route", "default"),
                ("limit", "per-key"),
                ("decision", "admitted")
            ]
        ) == 1.0,
        "{text}"
    );
    assert!(!text.contains(API_KEY), "API key appears in /metrics");
}
