//! Usage reports (`report: true`, `GET /admin/v1/limits/{route}/{limit}/usage?top=N`,
//! `GET /admin/v1/usage?<parts>`, `sluice usage`) and the bulk load of overrides
//! (`POST .../overrides`, `sluice overrides load`). The truth each report is judged by is
//! the test's own count of the answers it got (or the upstream's record of what it spent),
//! never sluice's metrics.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::llm_upstream::{priced_models, LlmUpstream};
use support::{Limit, Policy, Redis, Route, Sluice, Upstream, UpstreamSpec};

/// Route `api`: `per-key` (1000 an hour by `x-api-key`, reported, overridable) and `per-ip`
/// (10,000 an hour by client address, not reported).
fn policy(up: &Upstream) -> Policy {
    Policy::new().upstream("api", up.url()).route(
        Route::new("api", "/")
            .upstream("api")
            .limit(
                Limit::requests("per-key", 1000, "1h")
                    .key(["header:x-api-key"])
                    .set("report", true)
                    .set("overrides", true),
            )
            .limit(Limit::requests("per-ip", 10_000, "1h").key(["client_ip"])),
    )
}

/// Requests per key, sent over `instances` in turn; the 200s each key got (the truth).
const TRAFFIC: [(&str, usize); 5] = [("k1", 7), ("k2", 3), ("k3", 12), ("k4", 1), ("k5", 5)];

async fn send_traffic(instances: &[&Sluice]) -> HashMap<String, u64> {
    let client = support::client();
    let mut ok = HashMap::new();
    let mut turn = 0;
    for (key, count) in TRAFFIC {
        for _ in 0..count {
            let sluice = instances[turn % instances.len()];
            turn += 1;
            let status = client
                .get(format!("{}/x", sluice.url()))
                .header("x-api-key", key)
                .send()
                .await
                .expect("an answer")
                .status();
            if status == 200 {
                *ok.entry(key.to_owned()).or_insert(0) += 1;
            }
        }
    }
    ok
}

async fn admin_get(sluice: &Sluice, path: &str) -> (u16, Value) {
    let response = support::client()
        .get(format!("{}{path}", sluice.admin_url()))
        .send()
        .await
        .expect("the admin API answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON"))
}

/// The report of `per-key`, polled until it lists `expected` identities (the instances
/// flush once a second).
async fn report(sluice: &Sluice, top: usize, expected: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = admin_get(
            sluice,
            &format!("/admin/v1/limits/api/per-key/usage?top={top}"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        if body["identities"].as_array().map_or(0, Vec::len) >= expected
            || Instant::now() > deadline
        {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// (identity, used, limit, remaining) of each line of a report.
fn lines(body: &Value) -> Vec<(String, u64, u64, u64)> {
    body["identities"]
        .as_array()
        .expect("identities")
        .iter()
        .map(|one| {
            (
                one["identity"].as_str().unwrap_or_default().to_owned(),
                one["used"].as_u64().expect("used"),
                one["limit"].as_u64().expect("limit"),
                one["remaining"].as_u64().expect("remaining"),
            )
        })
        .collect()
}

/// The truth as a report should read: by 200s, most first (ties by identity), with the limit
/// in force (k2's override of 50).
fn expected(ok: &HashMap<String, u64>, top: usize) -> Vec<(String, u64, u64, u64)> {
    let mut truth: Vec<_> = ok
        .iter()
        .map(|(key, &used)| {
            let limit = if key == "k2" { 50 } else { 1000 };
            (format!("h:x-api-key={key}"), used, limit, limit - used)
        })
        .collect();
    truth.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    truth.truncate(top);
    truth
}

/// Two instances on one Redis, five customers with known counts. The report (asked of either
/// instance) lists them in the order of the 200s they got, with exactly those counts, k2's
/// override as its limit; `top=2` the first two. One identity's use names both limits when
/// both its parts are given, and says which limit it could not name otherwise. Redis never
/// ran KEYS or SCAN. `sluice usage` prints the same table.
/// Seeded: reports sorted by the index's order reversed (ascending) fail on the order; a
/// limit read from the policy instead of the override fails on k2's line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_top_identities_are_the_ones_that_got_the_most_answers() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = policy(&up).store_redis(&redis);
    let (a, b) = (Sluice::start(&yaml).await, Sluice::start(&yaml).await);
    let put = support::client()
        .put(format!(
            "{}/admin/v1/limits/api/per-key/override?header.x-api-key=k2&requests=50",
            a.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(put.status(), 200);
    let ok = send_traffic(&[&a, &b]).await;
    assert_eq!(
        ok.values().sum::<u64>(),
        28,
        "every request is within its limits"
    );

    let body = report(&b, 10, 5).await;
    assert_eq!(lines(&body), expected(&ok, 10), "{body}");
    let k2 = body["identities"]
        .as_array()
        .and_then(|all| all.iter().find(|one| one["identity"] == "h:x-api-key=k2"))
        .expect("k2 listed");
    assert_eq!(k2["overridden"], true, "{body}");
    let two = report(&a, 2, 2).await;
    assert_eq!(lines(&two), expected(&ok, 2), "{two}");

    let (status, one) = admin_get(&a, "/admin/v1/usage?header.x-api-key=k3").await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["limits"].as_array().map(Vec::len), Some(1), "{one}");
    assert_eq!(one["limits"][0]["limit"], 1000, "{one}");
    assert_eq!(one["limits"][0]["used"], 12, "{one}");
    assert_eq!(one["not_named"][0]["limit"], "per-ip", "{one}");
    let (_, both) = admin_get(
        &a,
        "/admin/v1/usage?header.x-api-key=k3&client_ip=127.0.0.1",
    )
    .await;
    let used: Vec<(String, u64)> = both["limits"]
        .as_array()
        .expect("limits")
        .iter()
        .map(|l| {
            (
                l["name"].as_str().unwrap_or_default().to_owned(),
                l["used"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        used,
        [("per-key".to_owned(), 12), ("per-ip".to_owned(), 28)],
        "{both}"
    );
    let (status, _) = admin_get(&a, "/admin/v1/limits/api/per-ip/usage?top=3").await;
    assert_eq!(status, 409, "a limit without report: true keeps no index");

    assert_eq!(
        redis.commandstat("keys").await,
        0,
        "a report never reads KEYS"
    );
    assert_eq!(redis.commandstat("scan").await, 0, "a report never SCANs");
    assert!(
        redis.commandstat("zincrby").await >= 5,
        "the instances flushed"
    );

    let admin = a.admin_url();
    let out = tokio::task::spawn_blocking(move || {
        support::run_sluice(
            &[
                "usage", "--admin", &admin, "--route", "api", "--limit", "per-key", "--top", "3",
            ],
            Duration::from_secs(30),
        )
    })
    .await
    .expect("the CLI ran");
    assert!(out.status.success(), "{}", out.stderr);
    let rows: Vec<&str> = out.stdout.lines().skip(2).collect();
    assert_eq!(rows.len(), 3, "{}", out.stdout);
    for (row, (identity, used, limit, _)) in rows.iter().zip(expected(&ok, 3)) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[0], identity, "{}", out.stdout);
        assert_eq!(cells[1], used.to_string(), "{}", out.stdout);
        assert!(cells[2].starts_with(&limit.to_string()), "{}", out.stdout);
    }
}

/// The in-process store answers from its own keys: the same order and numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_store_reports_from_its_own_keys() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&policy(&up)).await;
    let put = support::client()
        .put(format!(
            "{}/admin/v1/limits/api/per-key/override?header.x-api-key=k2&requests=50",
            sluice.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(put.status(), 200);
    let ok = send_traffic(&[&sluice]).await;
    let body = report(&sluice, 4, 4).await;
    assert_eq!(body["store"], "local", "{body}");
    assert_eq!(lines(&body), expected(&ok, 4), "{body}");
}

/// Each instance's map of identities since its last flush holds at most
/// `store.local.max_reported` (here 3): ten new customers in one burst (well within a second,
/// so at most two flushes' maps fill) are each either noted (and then reported) or dropped
/// and counted, and at least four are dropped.
/// Seeded: a map that never drops reports all ten and counts none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_map_between_flushes_is_bounded_and_its_drops_are_counted() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = policy(&up)
        .store_redis(&redis)
        .store_setting("local", support::Node::map([("max_reported", 3)]));
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let sends = (0..10).map(|n| {
        client
            .get(format!("{}/x", sluice.url()))
            .header("x-api-key", format!("burst{n}"))
            .send()
    });
    for answer in futures_util::future::join_all(sends).await {
        assert_eq!(answer.expect("an answer").status(), 200);
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let body = report(&sluice, 20, 10).await;
    let reported = body["identities"].as_array().map_or(0, Vec::len) as u64;
    let metrics = support::parse_metrics(&sluice.metrics().await);
    let dropped = support::metric_sum(&metrics, "sluice_usage_index_dropped_total", &[]) as u64;
    assert_eq!(reported + dropped, 10, "{body}");
    assert!(dropped >= 4, "dropped {dropped}: {body}");
}

/// A money budget's report: spend in the currency, exactly the micro-units used, and the
/// micro-units of both customers together what the upstream's record says it spent at the
/// models' prices (rounding up to 1 µUSD per answer).
/// Seeded: a spend printed from `limit` instead of `used` fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_money_budget_reports_spend_in_its_currency() {
    let redis = Redis::start().await;
    let upstream = LlmUpstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .set("models", priced_models())
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("llm", "/v1/").upstream("llm").limit(
                Limit::money("budget", 5.0, "USD", "1h")
                    .reserve_max_output(1000)
                    .key(["header:x-api-key"])
                    .set("report", true),
            ),
        );
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    for (key, count) in [("big", 4), ("small", 1)] {
        for _ in 0..count {
            let answer = client
                .post(format!("{}/v1/chat/completions", sluice.url()))
                .header("x-api-key", key)
                .body(
                    json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Write at length."}]})
                        .to_string(),
                )
                .send()
                .await
                .expect("an answer");
            assert_eq!(answer.status(), 200);
            answer.bytes().await.expect("the body");
        }
    }
    let body = loop {
        let (status, body) = admin_get(&sluice, "/admin/v1/limits/llm/budget/usage?top=5").await;
        assert_eq!(status, 200, "{body}");
        if body["identities"].as_array().map_or(0, Vec::len) == 2 {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(body["currency"], "USD", "{body}");
    assert_eq!(
        body["identities"][0]["identity"], "h:x-api-key=big",
        "{body}"
    );
    let mut total = 0;
    for one in body["identities"].as_array().expect("identities") {
        let used = one["used"].as_u64().expect("used");
        assert_eq!(
            one["spend"],
            format!("{}.{:06}", used / 1_000_000, used % 1_000_000),
            "{body}"
        );
        assert_eq!(one["budget"], "5.000000", "{body}");
        total += used;
    }
    let spent: f64 = upstream.answers().iter().map(|a| a.micro_usd).sum();
    assert!(
        (total as f64 - spent).abs() <= 5.0,
        "report {total} µUSD, upstream spent {spent}: {body}"
    );
}

/// A bulk load with two bad lines writes nothing and names both; the file fixed and sent with
/// `sluice overrides load` writes every line, each counted as a single PUT is.
/// Seeded: writing the good lines before answering the errors leaves overrides behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_load_with_a_bad_line_writes_nothing_and_names_every_bad_line() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&policy(&up).store_redis(&redis)).await;
    let bad = [
        r#"{"identity": {"header.x-api-key": "c1"}, "requests": 100, "ttl": "30d"}"#,
        r#"{"identity": {"header.x-api-key": "c2"}, "requests": 0}"#,
        r#"{"identity": {"key": "h:x-api-key=c3"}, "requests": 300}"#,
        r#"{"identity": {"colour": "red"}, "requests": 5}"#,
        r#"{"identity": {"header.x-api-key": "c5"}, "requests": 500, "ttl": "1h"}"#,
    ]
    .join("\n");
    let answer = support::client()
        .post(format!(
            "{}/admin/v1/limits/api/per-key/overrides",
            sluice.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .body(bad.clone())
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(answer.status(), 422);
    let problem: Value = answer.json().await.expect("a problem");
    let named: Vec<u64> = problem["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .map(|e| e["line"].as_u64().expect("a line"))
        .collect();
    assert_eq!(named, [2, 4], "{problem}");
    assert_eq!(problem["written"], 0, "{problem}");
    let (_, listed) = admin_get(&sluice, "/admin/v1/limits/api/per-key/overrides").await;
    assert_eq!(listed["overrides"], json!([]), "nothing written: {listed}");

    let good = bad
        .replace(r#""requests": 0}"#, r#""requests": 200}"#)
        .replace(r#"{"colour": "red"}"#, r#"{"header.x-api-key": "c4"}"#);
    let file = tempfile::NamedTempFile::new().expect("a temp file");
    std::fs::write(file.path(), good).expect("written");
    let (admin, path) = (sluice.admin_url(), file.path().to_owned());
    let out = tokio::task::spawn_blocking(move || {
        support::run_sluice(
            &[
                "overrides",
                "load",
                "--admin",
                &admin,
                "--route",
                "api",
                "--limit",
                "per-key",
                path.to_str().expect("a path"),
            ],
            Duration::from_secs(30),
        )
    })
    .await
    .expect("the CLI ran");
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stdout.starts_with("5 overrides"), "{}", out.stdout);
    let (_, listed) = admin_get(&sluice, "/admin/v1/limits/api/per-key/overrides").await;
    let mut numbers: Vec<(String, u64)> = listed["overrides"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|o| {
            (
                o["identity"].as_str().unwrap_or_default().to_owned(),
                o["requests"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    numbers.sort();
    let want: Vec<(String, u64)> = [
        ("c1", 100),
        ("c2", 200),
        ("c3", 300),
        ("c4", 5),
        ("c5", 500),
    ]
    .iter()
    .map(|(k, n)| (format!("h:x-api-key={k}"), *n))
    .collect();
    assert_eq!(numbers, want, "{listed}");
    let metrics = support::parse_metrics(&sluice.metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_override_changes_total",
            &[("action", "set")]
        ),
        5.0
    );
    assert!(sluice.log().contains("override set (bulk load)"), "audited");
}
