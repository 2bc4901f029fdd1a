//! The admin API on `admin_listen`, through the real binary, against a real redis-server and
//! the in-process store: one identity's quota read without consuming it and reset (also past
//! the deny cache), the policy in force with its secrets redacted, reloads on request, the
//! bearer token, and the refusal to start without one on a non-loopback address.

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use support::{
    metric_sum, parse_metrics, Limit, Node, Policy, Redis, Route, Sluice, Store, StoreKind,
    SLUICE_BIN,
};

const TOKEN_ENV: &str = "SLUICE_TEST_ADMIN_TOKEN";
const TOKEN: &str = "adm-tok-7f3c9e2b41d8";
/// Each algorithm's limit: this many per day (no window boundary or refill within a test).
const LIMIT: u64 = 5;
const ALGORITHMS: [&str; 4] = ["sliding_log", "sliding_window", "fixed_window", "gcra"];

/// One route per algorithm, `/ALGORITHM`, limited per API key, on `policy`.
fn routes(policy: Policy) -> Policy {
    ALGORITHMS.into_iter().fold(policy, |policy, algorithm| {
        policy.route(
            Route::new(algorithm, &format!("/{algorithm}"))
                .respond(200, "ok\n")
                .limit(
                    Limit::requests("per-key", LIMIT as u32, "1d")
                        .key(["header:x-api-key"])
                        .algorithm(algorithm),
                ),
        )
    })
}

/// The admin section of every test here: the token in [`TOKEN_ENV`].
fn admin_section() -> String {
    format!("admin:\n  token_env: {TOKEN_ENV}\n")
}

async fn start(store: &Store) -> Sluice {
    let policy = routes(Policy::new().admin_token_env(TOKEN_ENV).store(store));
    Sluice::start_with_env(&policy, &[(TOKEN_ENV, TOKEN)]).await
}

/// Sends `GET /{route}` with `key`; the status.
async fn hit(c: &reqwest::Client, sluice: &Sluice, route: &str, key: &str) -> u16 {
    c.get(format!("{}/{route}", sluice.url()))
        .header("x-api-key", key)
        .send()
        .await
        .expect("GET through sluice")
        .status()
        .as_u16()
}

/// An admin API call with the token; the status and the JSON body.
async fn admin(
    c: &reqwest::Client,
    sluice: &Sluice,
    method: reqwest::Method,
    path_and_query: &str,
) -> (u16, Value) {
    let r = c
        .request(method, format!("{}{path_and_query}", sluice.admin_url()))
        .bearer_auth(TOKEN)
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("admin API call");
    let status = r.status().as_u16();
    let text = r.text().await.expect("admin API body");
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{path_and_query}: not JSON ({e}): {text}"));
    (status, body)
}

async fn peek(c: &reqwest::Client, sluice: &Sluice, route: &str, query: &str) -> Value {
    let path = format!("/admin/v1/limits/{route}/per-key?{query}");
    let (status, body) = admin(c, sluice, reqwest::Method::GET, &path).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// Seconds in a day: the limits' window.
const DAY: f64 = 86_400.0;

/// The `reset` a limit of `LIMIT` per day reports after `USED` (3) back-to-back admissions,
/// as an interval of the seconds it may read: the store recorded the first of them after
/// `first_hit` (taken before it was sent) and before `first_answered` (taken after its
/// answer), and read it after `peeked` (before the read was sent); each store's own clock is
/// bounded the same way (Redis `TIME` read just before and just after the read; the in-process store's clock
/// starts while sluice starts, between `before_start` and `after_start`).
/// - sliding_log: the oldest entry leaves one window after it was recorded;
/// - fixed_window: the counter's expiry, one window after the first hit;
/// - gcra: T = window / requests; the TAT is 3 T ahead of the first hit and one more request
///   fits when it is 2 T ahead: T after the first hit;
/// - sliding_window: the current fixed window (epoch-aligned: Redis time, or the in-process
///   store's clock) holds 3; one more fits once the weighted count falls to 2, a third of a
///   window into the next one: (window − elapsed) + window / 3.
fn expected_reset(
    algorithm: &str,
    since_first_hit: (f64, f64),
    window_elapsed: (f64, f64),
    lateness: f64,
) -> (f64, f64) {
    let (first_lo, first_hi) = since_first_hit;
    match algorithm {
        // The log counts an admission until the lateness bound after its window.
        "sliding_log" => (DAY + lateness - first_hi, DAY + lateness - first_lo),
        "fixed_window" => (DAY - first_hi, DAY - first_lo),
        "gcra" => {
            let t = DAY / LIMIT as f64;
            (t - first_hi, t - first_lo)
        }
        "sliding_window" => {
            let (elapsed_lo, elapsed_hi) = window_elapsed;
            let full = DAY + DAY / 3.0;
            (full - elapsed_hi, full - elapsed_lo)
        }
        other => panic!("no expected reset for {other}"),
    }
}

/// Seconds into the current epoch-aligned day on Redis's clock (`TIME`).
async fn redis_day_elapsed(redis: &Redis) -> f64 {
    let redis::Value::Array(time) = redis.cmd(&["TIME"]).await else {
        panic!("TIME did not answer an array");
    };
    let part = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).parse::<f64>().expect("a number"),
        other => panic!("TIME answered {other:?}"),
    };
    (part(&time[0]) % DAY) + part(&time[1]) / 1e6
}

async fn read_only_and_reset(kind: StoreKind) {
    let store = Store::start(kind).await;
    let before_start = Instant::now();
    let sluice = start(&store).await;
    let after_start = Instant::now();
    let c = support::client();
    let expected_store = match kind {
        StoreKind::Redis => "redis",
        StoreKind::Memory => "local",
    };
    const USED: u64 = 3;
    for algorithm in ALGORITHMS {
        // An identity with nothing recorded: all of the quota, nothing to wait for.
        let empty = peek(&c, &sluice, algorithm, "header.x-api-key=never-sent").await;
        assert_eq!(empty["count"], 0, "{algorithm}: {empty}");
        assert_eq!(empty["remaining"], LIMIT, "{algorithm}: {empty}");
        assert_eq!(empty["reset"], 0.0, "{algorithm}: {empty}");
        let key = format!("k-{algorithm}");
        let first_hit = Instant::now();
        let mut first_answered = None;
        for _ in 0..USED {
            assert_eq!(hit(&c, &sluice, algorithm, &key).await, 200, "{algorithm}");
            first_answered.get_or_insert_with(Instant::now);
        }
        let first_answered = first_answered.expect("at least one hit");
        let query = format!("header.x-api-key={key}");
        // Read twice: a read must not count.
        for _ in 0..2 {
            let elapsed_before = match &store.redis {
                Some(redis) => redis_day_elapsed(redis).await,
                None => after_start.elapsed().as_secs_f64(),
            };
            // The least time since the store recorded the first hit: on a loaded machine its
            // answer can come tens of milliseconds after it was sent.
            let since_first_lo = first_answered.elapsed().as_secs_f64();
            let body = peek(&c, &sluice, algorithm, &query).await;
            let since_first_hi = first_hit.elapsed().as_secs_f64();
            let elapsed_after = match &store.redis {
                Some(redis) => redis_day_elapsed(redis).await,
                None => before_start.elapsed().as_secs_f64(),
            };
            assert_eq!(body["count"], USED, "{algorithm}: {body}");
            assert_eq!(body["remaining"], LIMIT - USED, "{algorithm}: {body}");
            assert_eq!(body["algorithm"], algorithm, "{body}");
            assert_eq!(body["store"], expected_store, "{body}");
            assert_eq!(body["requests"], LIMIT, "{body}");
            assert_eq!(body["window"], 86_400.0, "{body}");
            let reset = body["reset"].as_f64().expect("reset is a number");
            let (lo, hi) = expected_reset(
                algorithm,
                (since_first_lo, since_first_hi),
                (elapsed_before, elapsed_after),
                store.lateness().as_secs_f64(),
            );
            // 10 ms for the stores' rounding (PTTL is in milliseconds).
            assert!(
                reset >= lo - 0.01 && reset <= hi + 0.01,
                "{algorithm}: reset {reset}, expected within [{lo:.3}, {hi:.3}]: {body}"
            );
            assert_eq!(body["identity"], format!("h:x-api-key={key}"), "{body}");
        }
        // The same identity named by `key=`, bare or as the whole store key.
        let by_key = peek(&c, &sluice, algorithm, &format!("key=h:x-api-key={key}")).await;
        let whole = by_key["key"].as_str().expect("the store key").to_owned();
        assert!(
            whole.ends_with(&format!("{{h:x-api-key={key}}}")),
            "{whole}"
        );
        let by_whole = peek(&c, &sluice, algorithm, &format!("key={}", encode(&whole))).await;
        assert_eq!(by_key["count"], USED);
        assert_eq!(by_whole["key"], whole.as_str());
        if let Some(redis) = &store.redis {
            assert!(
                redis.keys().await.contains(&whole),
                "{whole} is the key in Redis"
            );
        }
        // Nothing was consumed: exactly LIMIT - USED more pass.
        for n in USED..LIMIT {
            assert_eq!(
                hit(&c, &sluice, algorithm, &key).await,
                200,
                "{algorithm} #{n}"
            );
        }
        assert_eq!(hit(&c, &sluice, algorithm, &key).await, 429, "{algorithm}");
        let full = peek(&c, &sluice, algorithm, &query).await;
        assert_eq!(full["remaining"], 0, "{full}");
        assert_eq!(full["count"], LIMIT, "{full}");
        // Reset: admitted again at once, with the whole quota.
        let path = format!("/admin/v1/limits/{algorithm}/per-key?{query}");
        let (status, body) = admin(&c, &sluice, reqwest::Method::DELETE, &path).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["forgotten"]["store_key"], true, "{body}");
        assert_eq!(hit(&c, &sluice, algorithm, &key).await, 200, "{algorithm}");
        assert_eq!(
            peek(&c, &sluice, algorithm, &query).await["remaining"],
            LIMIT - 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_consumes_nothing_and_a_reset_readmits_in_process() {
    read_only_and_reset(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_consumes_nothing_and_a_reset_readmits_with_redis() {
    read_only_and_reset(StoreKind::Redis).await;
}

/// Percent-encodes a query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_clears_a_denial_the_deny_cache_remembers() {
    let store = Store::start(StoreKind::Redis).await;
    let sluice = start(&store).await;
    let c = support::client();
    // A key too long to be written raw: the per-part form must find the hashed key.
    let key = format!("sk-{}", "x".repeat(100));
    let mut rejected = 0;
    for _ in 0..(LIMIT + 20) {
        if hit(&c, &sluice, "sliding_log", &key).await == 429 {
            rejected += 1;
        }
    }
    assert_eq!(rejected, 20);
    let metrics = parse_metrics(&sluice.metrics().await);
    // Redis refused the first; the deny cache answered the other 19.
    assert_eq!(
        metric_sum(&metrics, "sluice_deny_cache_answers_total", &[]),
        19.0,
        "the flood was answered from the deny cache"
    );
    let query = format!("header.x-api-key={key}");
    let body = peek(&c, &sluice, "sliding_log", &query).await;
    assert!(
        body["identity"]
            .as_str()
            .unwrap()
            .starts_with("h:x-api-key=#"),
        "{body}"
    );
    assert_eq!(body["count"], LIMIT, "{body}");
    let path = format!("/admin/v1/limits/sliding_log/per-key?{query}");
    let (status, body) = admin(&c, &sluice, reqwest::Method::DELETE, &path).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["forgotten"]["deny_cache"], true, "{body}");
    assert_eq!(body["forgotten"]["store_key"], true, "{body}");
    assert_eq!(hit(&c, &sluice, "sliding_log", &key).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_names_and_bad_identities_are_refused() {
    let store = Store::start(StoreKind::Memory).await;
    let sluice = start(&store).await;
    let c = support::client();
    let get = |path: &'static str| {
        let (c, sluice) = (&c, &sluice);
        async move { admin(c, sluice, reqwest::Method::GET, path).await }
    };
    let (status, body) = get("/admin/v1/limits/nope/per-key?key=ip=1.2.3.4").await;
    assert_eq!(
        (status, body["route"].as_str()),
        (404, Some("nope")),
        "{body}"
    );
    let (status, body) = get("/admin/v1/limits/gcra/nope?key=ip=1.2.3.4").await;
    assert_eq!(
        (status, body["limit"].as_str()),
        (404, Some("nope")),
        "{body}"
    );
    // A missing or malformed identity: 400 whose detail states the limit's key shape, as the
    // README promises; a query that is wrong in itself: 400 naming what is wrong.
    const SHAPE: &str = "the limit's key is [header:x-api-key]";
    for (bad, names) in [
        ("/admin/v1/limits/gcra/per-key", SHAPE),
        ("/admin/v1/limits/gcra/per-key?key=", SHAPE),
        ("/admin/v1/limits/gcra/per-key?key=q:other=1", SHAPE),
        (
            "/admin/v1/limits/gcra/per-key?key=h:x-api-key=a%7D%7Bb",
            SHAPE,
        ),
        ("/admin/v1/limits/gcra/per-key?header.x-other=1", SHAPE),
        (
            "/admin/v1/limits/gcra/per-key?client_ip=not-an-ip",
            "not-an-ip",
        ),
        ("/admin/v1/limits/gcra/per-key?bogus=1", "bogus"),
        (
            "/admin/v1/limits/gcra/per-key?key=ip=1.2.3.4&client_ip=1.2.3.4",
            "either key= or per-part values",
        ),
    ] {
        let (status, body) = get(bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(names), "{bad}: `{names}` not in {body}");
    }
    // A request without the header counts its client IP: `client_ip=` names that bucket.
    let body = peek(&c, &sluice, "gcra", "client_ip=203.0.113.9").await;
    assert_eq!(body["identity"], "ip=203.0.113.9", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_in_force_hides_its_secrets() {
    const PASSWORD: &str = "hunter2-redis-Pa55";
    let redis = Redis::start_with(&["--requirepass", PASSWORD]).await;
    assert!(redis.url().contains(PASSWORD));
    let policy = routes(Policy::new().admin_token_env(TOKEN_ENV).store_redis(&redis));
    let sluice = Sluice::start_with_env(&policy, &[(TOKEN_ENV, TOKEN)]).await;
    let c = support::client();
    assert_eq!(
        hit(&c, &sluice, "gcra", "k").await,
        200,
        "Redis is reachable"
    );
    let r = c
        .get(format!("{}/admin/v1/config", sluice.admin_url()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("GET config");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("body");
    assert!(
        !text.contains(PASSWORD),
        "the Redis password leaked: {text}"
    );
    assert!(!text.contains(TOKEN), "the token leaked: {text}");
    let body: Value = serde_json::from_str(&text).expect("JSON");
    let url = body["config"]["store"]["redis"]["url"]
        .as_str()
        .expect("url");
    assert_eq!(
        url,
        format!("redis://:[redacted]@127.0.0.1:{}/0", redis.port())
    );
    assert_eq!(body["config"]["admin"]["token_env"], TOKEN_ENV);
    let file = std::fs::read(sluice.config_path()).expect("config file");
    assert_eq!(body["sha256"], hex(&Sha256::digest(&file)));
    assert_eq!(body["routes"][3]["limits"][0]["algorithm"], "gcra");
    assert_eq!(
        body["routes"][3]["limits"][0]["burst"], LIMIT,
        "defaults filled in"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lines of sluice's log that contain `text`.
fn log_count(sluice: &Sluice, text: &str) -> usize {
    sluice.log().lines().filter(|l| l.contains(text)).count()
}

/// The lines of sluice's log that contain `text`, once there are `n` of them (or more, which
/// the caller's assertion then shows): a background thread writes the log, so that no request
/// waits on a write, and a line may land a moment after the answer it belongs to.
async fn logged(sluice: &Sluice, text: &str, n: usize) -> usize {
    support::wait_for(Duration::from_secs(10), text, || async move {
        log_count(sluice, text) >= n
    })
    .await;
    log_count(sluice, text)
}

/// The reloads the log names with `text`, once they are as many as
/// `sluice_config_reloads_total{result}` counts (at least one): the log may lag the metric.
async fn reloads_logged(sluice: &Sluice, text: &str, result: &str) -> usize {
    support::wait_for(Duration::from_secs(10), text, || async move {
        let lines = log_count(sluice, text);
        lines > 0 && lines as f64 == reloads(sluice, result).await
    })
    .await;
    log_count(sluice, text)
}

/// `sluice_config_reloads_total{result}`.
async fn reloads(sluice: &Sluice, result: &str) -> f64 {
    let metrics = parse_metrics(&sluice.metrics().await);
    metric_sum(
        &metrics,
        "sluice_config_reloads_total",
        &[("result", result)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_on_request_applies_a_good_file_and_refuses_a_bad_one() {
    let store = Store::start(StoreKind::Memory).await;
    let sluice = start(&store).await;
    let c = support::client();
    let original = std::fs::read_to_string(sluice.config_path()).expect("config");
    let head: String = original.lines().take(2).map(|l| format!("{l}\n")).collect();
    let one = "routes:\n  - name: api\n    match: { path_prefix: /api }\n    respond: { status: 200 }\n    limits:\n      - { name: per-key, key: [\"header:x-api-key\"], requests: 1, window: 1d }\n";
    let text = format!("{head}{}{one}", admin_section());
    support::replace_file(sluice.config_path(), &text);
    let (status, body) = admin(&c, &sluice, reqwest::Method::POST, "/admin/v1/reload").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["applied"], true);
    assert_eq!(body["sha256"], hex(&Sha256::digest(text.as_bytes())));
    assert_eq!(body["routes"], 1);
    // In force as soon as the answer came.
    assert_eq!(hit(&c, &sluice, "api", "k").await, 200);
    assert_eq!(
        hit(&c, &sluice, "api", "k").await,
        429,
        "the new limit of 1"
    );
    // The file poll (every 250 ms) may have applied the new file too, between the write and
    // the request: the metric counts exactly the reloads sluice logged, one of them this one.
    assert_eq!(
        logged(&sluice, "admin API: reloading the config file", 1).await,
        1
    );
    let applied = reloads_logged(&sluice, "config reloaded", "ok").await;
    assert!(applied == 1 || applied == 2, "{}", sluice.log());
    assert_eq!(reloads(&sluice, "ok").await, applied as f64);
    assert_eq!(reloads(&sluice, "error").await, 0.0);

    let bad = one.replace("requests: 1,", "requests: many,");
    support::replace_file(
        sluice.config_path(),
        &format!("{head}{}{bad}", admin_section()),
    );
    let (status, body) = admin(&c, &sluice, reqwest::Method::POST, "/admin/v1/reload").await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["applied"], false);
    let error = &body["error"];
    assert_eq!(error["field"], "routes[0].limits[0].requests", "{body}");
    assert_eq!(error["line"], 10, "{body}");
    assert!(error["column"].as_u64().is_some_and(|c| c > 0), "{body}");
    assert_eq!(error["file"], sluice.config_path().display().to_string());
    assert_eq!(
        logged(&sluice, "admin API: reloading the config file", 2).await,
        2
    );
    let refused = reloads_logged(&sluice, "config reload refused", "error").await;
    assert!(refused == 1 || refused == 2, "{}", sluice.log());
    assert_eq!(reloads(&sluice, "error").await, refused as f64);
    assert_eq!(reloads(&sluice, "ok").await, applied as f64);
    // The old policy keeps serving.
    assert_eq!(hit(&c, &sluice, "api", "other").await, 200);
    assert_eq!(hit(&c, &sluice, "api", "other").await, 429);
    let (_, config) = admin(&c, &sluice, reqwest::Method::GET, "/admin/v1/config").await;
    assert_eq!(config["sha256"], hex(&Sha256::digest(text.as_bytes())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_needs_the_token_and_the_probes_do_not() {
    let store = Store::start(StoreKind::Memory).await;
    let sluice = start(&store).await;
    let c = support::client();
    let url = format!("{}/admin/v1/config", sluice.admin_url());
    let denied = [
        c.get(&url).send().await.expect("no token"),
        c.get(&url)
            .bearer_auth("wrong")
            .send()
            .await
            .expect("wrong"),
        c.get(&url)
            .bearer_auth(format!("{TOKEN}x"))
            .send()
            .await
            .expect("longer"),
        c.get(&url)
            .header("authorization", format!("Basic {TOKEN}"))
            .send()
            .await
            .expect("other scheme"),
        c.post(format!("{}/admin/v1/reload", sluice.admin_url()))
            .header("x-sluice-admin", "1")
            .send()
            .await
            .expect("reload without a token"),
        c.delete(format!(
            "{}/admin/v1/limits/gcra/per-key?key=ip=1.2.3.4",
            sluice.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("reset without a token"),
    ];
    for r in denied {
        assert_eq!(r.status(), 401, "{}", r.url());
        let challenge = r.headers().get("www-authenticate").expect("a challenge");
        assert_eq!(challenge, "Bearer realm=\"sluice-admin\"", "{}", r.url());
    }
    let r = c.get(&url).bearer_auth(TOKEN).send().await.expect("token");
    assert_eq!(r.status(), 200);
    for open in ["/metrics", "/healthz", "/readyz"] {
        let r = c
            .get(format!("{}{open}", sluice.admin_url()))
            .send()
            .await
            .expect("probe");
        assert_eq!(r.status(), 200, "{open} needs no token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_api_is_open_on_loopback_only_and_can_be_off() {
    let sluice = Sluice::start(&routes(Policy::new())).await;
    let c = support::client();
    let r = c
        .get(format!("{}/admin/v1/config", sluice.admin_url()))
        .send()
        .await
        .expect("GET config");
    assert_eq!(r.status(), 200, "loopback without a token: open");
    drop(sluice);
    let off = Sluice::start(&routes(Policy::new().admin_api(false))).await;
    let r = c
        .get(format!("{}/admin/v1/config", off.admin_url()))
        .send()
        .await
        .expect("GET config");
    assert_eq!(r.status(), 404, "api: false");
    let r = c
        .get(format!("{}/metrics", off.admin_url()))
        .send()
        .await
        .expect("GET metrics");
    assert_eq!(r.status(), 200);
}

/// Runs `sluice run` on `yaml` with `env`; it must exit (not serve) within 10 s. The exit
/// status and what it wrote to stderr.
fn run_until_exit(yaml: &str, env: &[(&str, &str)]) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("sluice.yaml");
    std::fs::write(&config, yaml).expect("write config");
    let stderr = dir.path().join("stderr");
    let mut child = Command::new(SLUICE_BIN)
        .args(["run", "--config"])
        .arg(&config)
        .env_remove(TOKEN_ENV)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("spawn sluice");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice started serving:\n{yaml}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, read(&stderr))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn sluice_refuses_to_start_without_a_token_it_needs() {
    let (port, admin_port) = (support::free_port(), support::free_port());
    let head = format!("listen: 127.0.0.1:{port}\n");
    let open = format!(
        "{head}admin_listen: 0.0.0.0:{admin_port}\n{}",
        routes(Policy::new()).to_yaml()
    );
    let (status, stderr) = run_until_exit(&open, &[]);
    assert!(!status.success());
    assert!(stderr.contains(":2:15: admin_listen:"), "{stderr}");
    assert!(stderr.contains("not a loopback address"), "{stderr}");
    assert!(stderr.contains("admin: { token_env: NAME }"), "{stderr}");

    let named = format!(
        "{head}admin_listen: 0.0.0.0:{admin_port}\n{}",
        routes(Policy::new().admin_token_env(TOKEN_ENV)).to_yaml()
    );
    let (status, stderr) = run_until_exit(&named, &[]);
    assert!(!status.success());
    assert!(
        stderr.contains(TOKEN_ENV) && stderr.contains("not set"),
        "{stderr}"
    );
    let (status, stderr) = run_until_exit(&named, &[(TOKEN_ENV, "")]);
    assert!(!status.success());
    assert!(
        stderr.contains(TOKEN_ENV) && stderr.contains("empty"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_down_the_local_fallback_answers_and_is_reset() {
    let mut store = Store::start(StoreKind::Redis).await;
    let sluice = start(&store).await;
    sluice.expect_store_faults();
    let c = support::client();
    store.redis.as_mut().expect("redis").stop();
    // Failures open the breaker; from then on the in-process fallback decides (local is the
    // default on_store_error).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut admitted = 0;
    loop {
        let metrics = parse_metrics(&sluice.metrics().await);
        if metric_sum(&metrics, "sluice_store_fallback_active", &[]) == 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the breaker never opened");
        hit(&c, &sluice, "fixed_window", "warm-up").await;
    }
    for _ in 0..2 {
        if hit(&c, &sluice, "fixed_window", "k").await == 200 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 2, "the fallback admits within the limit");
    let body = peek(&c, &sluice, "fixed_window", "header.x-api-key=k").await;
    assert_eq!(body["store"], "local_fallback", "{body}");
    assert_eq!(body["count"], 2, "{body}");
    // Redis is down: the store part fails (503), this instance's fallback state is forgotten.
    let path = "/admin/v1/limits/fixed_window/per-key?header.x-api-key=k";
    let (status, body) = admin(&c, &sluice, reqwest::Method::DELETE, path).await;
    assert_eq!(status, 503, "{body}");
    let body = peek(&c, &sluice, "fixed_window", "header.x-api-key=k").await;
    assert_eq!(body["count"], 0, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_key_sluice_explain_prints_names_the_identity() {
    let policy = Policy::new().route(
        Route::new("api", "/api")
            .respond_status(200)
            .limit(Limit::requests("per-client", 10, "1d").key(["client_ip", "header:x-api-key"])),
    );
    let sluice = Sluice::start(&policy).await;
    let config = sluice.config_path().to_str().expect("path").to_owned();
    let explained = support::run_sluice(
        &[
            "explain",
            "--config",
            &config,
            "GET",
            "/api",
            "-H",
            "x-api-key: a|b c",
            "--from",
            "127.0.0.1",
        ],
        Duration::from_secs(20),
    );
    assert!(explained.status.success(), "{}", explained.stderr);
    let store_key = explained
        .stdout
        .lines()
        .find_map(|line| line.trim().strip_prefix("store key: "))
        .unwrap_or_else(|| panic!("no store key in:\n{}", explained.stdout))
        .to_owned();
    let c = support::client();
    for _ in 0..2 {
        let r = c
            .get(format!("{}/api", sluice.url()))
            .header("x-api-key", "a|b c")
            .send()
            .await
            .expect("GET /api");
        assert_eq!(r.status(), 200);
    }
    let identity = store_key
        .split_once('{')
        .and_then(|(_, rest)| rest.strip_suffix('}'))
        .expect("an identity in braces");
    for query in [
        format!("key={}", encode(&store_key)),
        format!("key={}", encode(identity)),
        format!("key={}", encode(&format!("{{{identity}}}"))),
        format!("client_ip=127.0.0.1&header.x-api-key={}", encode("a|b c")),
    ] {
        let url = format!(
            "{}/admin/v1/limits/api/per-client?{query}",
            sluice.admin_url()
        );
        let body: Value = c
            .get(&url)
            .send()
            .await
            .expect("GET limit")
            .json()
            .await
            .expect("JSON");
        assert_eq!(body["key"], store_key.as_str(), "{query}: {body}");
        assert_eq!(body["count"], 2, "{query}: {body}");
        assert_eq!(body["remaining"], 8, "{query}: {body}");
    }
}

/// README: other methods on the API's paths get `405` with `Allow`; other paths under
/// `/admin/v1/` get `404`; both as problem+json.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_methods_get_405_with_allow_and_unknown_paths_404() {
    let store = Store::start(StoreKind::Memory).await;
    let sluice = start(&store).await;
    let c = support::client();
    use reqwest::Method;
    for (method, path, allow) in [
        (Method::POST, "/admin/v1/config", "GET"),
        (Method::DELETE, "/admin/v1/config", "GET"),
        (Method::GET, "/admin/v1/reload", "POST"),
        (Method::PUT, "/admin/v1/reload", "POST"),
        (
            Method::POST,
            "/admin/v1/limits/gcra/per-key?key=ip=1.2.3.4",
            "GET, DELETE",
        ),
        (
            Method::PUT,
            "/admin/v1/limits/gcra/per-key?key=ip=1.2.3.4",
            "GET, DELETE",
        ),
    ] {
        let r = c
            .request(method.clone(), format!("{}{path}", sluice.admin_url()))
            .bearer_auth(TOKEN)
            .header("x-sluice-admin", "1")
            .send()
            .await
            .expect("admin API call");
        assert_eq!(r.status(), 405, "{method} {path}");
        assert_eq!(
            r.headers().get("allow").map(|v| v.to_str().unwrap()),
            Some(allow),
            "{method} {path}"
        );
        assert_eq!(
            support::header(&r, "content-type"),
            "application/problem+json",
            "{method} {path}"
        );
        let body: Value = r.json().await.expect("a problem body");
        assert_eq!(body["status"], 405, "{body}");
    }
    for path in [
        "/admin/v1/",
        "/admin/v1/nope",
        "/admin/v1/limits",
        "/admin/v1/limits/gcra",
        "/admin/v1/limits/gcra/per-key/extra",
        "/admin/v1/config/extra",
    ] {
        let (status, body) = admin(&c, &sluice, reqwest::Method::GET, path).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["status"], 404, "{path}: {body}");
        assert_eq!(body["instance"], path, "{body}");
    }
}

/// README (Admin API, config): every secret-looking field the README lists is redacted in
/// `GET /admin/v1/config`, through the real binary: the Sentinel `password` and
/// `sentinel_password`, a Cluster's `password`, a Redis URL's userinfo password (and
/// userinfo without `:`, and `password`/`secret`/`token` query parameters), and the values a
/// `when:` condition compares to a credential-like header (`authorization`, `cookie`, names
/// containing `key`, `token`, `secret`, `session`, `password`). `token_env` and ordinary
/// values stay. (Member names containing `credential` or `api_key` have no config field
/// today: the unit tests of `src/admin/config_view.rs` cover them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_secret_the_readme_lists_is_redacted() {
    let nowhere = support::closed_port();
    let conditions = [
        ("authorization", "equals", json!("Bearer s3cr-auth")),
        ("cookie", "equals", json!("sid=s3cr-cookie")),
        ("x-api-key", "one_of", json!(["s3cr-key1", "s3cr-key2"])),
        ("x-auth-token", "equals", json!("s3cr-token")),
        ("x-client-secret", "equals", json!("s3cr-secret")),
        ("x-session-id", "equals", json!("s3cr-session")),
        ("x-password", "equals", json!("s3cr-password")),
        ("x-plan", "equals", json!("gold-plan")),
    ];
    let when: Vec<Node> = conditions
        .iter()
        .map(|(header, op, value)| {
            let value = match value {
                Value::Array(items) => Node::from(
                    items
                        .iter()
                        .map(|v| v.as_str().expect("a string"))
                        .collect::<Vec<_>>(),
                ),
                v => Node::from(v.as_str().expect("a string")),
            };
            Node::map([("header", Node::from(*header)), (*op, value)])
        })
        .collect();
    let routes = |policy: Policy| {
        policy.route(
            Route::new("api", "/")
                .respond_status(200)
                .limit(Limit::requests("l", 5, "1m").when(when.clone())),
        )
    };
    let nodes = vec![format!("127.0.0.1:{nowhere}")];
    let stores = [
        Policy::new()
            .store_sentinel("mymaster", &nodes)
            .sentinel_setting("password", "s3cr-master")
            .sentinel_setting("sentinel_password", "s3cr-sentinel"),
        Policy::new()
            .store_cluster_nodes(&nodes)
            .cluster_setting("username", "app")
            .cluster_setting("password", "s3cr-cluster"),
        Policy::new().store_redis_url_defaults(&format!("redis://app:s3cr-userinfo@127.0.0.1:{nowhere}/0?password=s3cr-qp&secret=s3cr-qs&token=s3cr-qt&protocol=resp2")),
        Policy::new().store_redis_url_defaults(&format!("redis://s3cr-bare@127.0.0.1:{nowhere}/0")),
    ];
    let c = support::client();
    for store in stores {
        let policy = routes(store.admin_token_env(TOKEN_ENV));
        let store = policy.to_yaml();
        let sluice = Sluice::start_with_env(&policy, &[(TOKEN_ENV, TOKEN)]).await;
        let (status, body) = admin(&c, &sluice, reqwest::Method::GET, "/admin/v1/config").await;
        assert_eq!(status, 200, "{body}");
        let text = body.to_string();
        assert!(!text.contains("s3cr"), "a secret leaked:\n{store}\n{text}");
        assert!(text.contains("[redacted]"), "{text}");
        assert!(
            text.contains("gold-plan"),
            "a plan name is no secret: {text}"
        );
        assert_eq!(body["config"]["admin"]["token_env"], TOKEN_ENV, "{text}");
        let when = &body["config"]["routes"][0]["limits"][0]["when"];
        for (i, (header, op, _)) in conditions.iter().enumerate() {
            assert_eq!(when[i]["header"], *header, "{when}");
            if *header != "x-plan" {
                let hidden = &when[i][*op];
                let all_hidden = match hidden {
                    Value::Array(items) => items.iter().all(|v| v == "[redacted]"),
                    v => v == "[redacted]",
                };
                assert!(all_hidden, "{header}: {hidden}");
            }
        }
        let redis = &body["config"]["store"]["redis"];
        if let Some(url) = redis["url"].as_str() {
            assert!(
                url == format!("redis://app:[redacted]@127.0.0.1:{nowhere}/0?password=[redacted]&secret=[redacted]&token=[redacted]&protocol=resp2")
                    || url == format!("redis://[redacted]@127.0.0.1:{nowhere}/0"),
                "{url}"
            );
        }
        if redis["cluster"].is_object() {
            assert_eq!(redis["cluster"]["username"], "app", "{redis}");
            assert_eq!(redis["cluster"]["password"], "[redacted]", "{redis}");
        }
        if redis["sentinel"].is_object() {
            assert_eq!(redis["sentinel"]["password"], "[redacted]", "{redis}");
            assert_eq!(
                redis["sentinel"]["sentinel_password"], "[redacted]",
                "{redis}"
            );
            assert_eq!(redis["sentinel"]["master_name"], "mymaster", "{redis}");
        }
    }
}
