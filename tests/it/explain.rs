//! `sluice explain` names the route, the limits and the exact store keys a request would
//! touch, from the policy file alone: the store is never called.

use crate::support;

use std::time::Duration;

use support::{redis_store_yaml, run_sluice, write_config, Redis};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explains_a_request_without_touching_the_store() {
    let redis = Redis::start().await;
    let yaml = format!(
        r#"listen: 127.0.0.1:1
admin_listen: 127.0.0.1:2
trusted_proxies: [10.0.0.0/8]
{store}upstreams:
  api: {{ url: "http://127.0.0.1:3000/v1" }}
routes:
  - name: orders
    match: {{ path_prefix: /users }}
    upstream: api
    limits:
      - {{ name: per-key, key: ["header:x-api-key"], requests: 100, window: 1m }}
      - {{ name: per-ip, key: [client_ip], requests: 1000, window: 1h }}
"#,
        store = redis_store_yaml(&redis.url()),
    );
    let config = write_config(&yaml);
    let path = config.path().to_str().unwrap().to_owned();
    let monitor = redis.monitor().await;
    let run = |args: &[&str]| {
        let mut all = vec!["explain", "--config", path.as_str()];
        all.extend_from_slice(args);
        run_sluice(&all, Duration::from_secs(10))
    };

    let out = run(&[
        "GET",
        "//USERS/42/%6Frders?x=1",
        "-H",
        "x-api-key: k1",
        "-H",
        "x-forwarded-for: 203.0.113.9",
        "--from",
        "10.0.0.5",
    ]);
    assert!(out.status.success(), "{}", out.stderr);
    for line in [
        "path:       /USERS/42/orders (normalized; forwarded like this)",
        "route:      orders",
        "action:     forward to upstream `api` as http://127.0.0.1:3000/v1/USERS/42/orders?x=1",
        "client ip:  203.0.113.9 (from a trusted proxy's forwarded-for header)",
        "  per-key: 100 per 1m (sliding_log), key [header:x-api-key]",
        "    store key: sluice-test:orders:per-key:{h:x-api-key=k1}",
        "  per-ip: 1000 per 1h (sliding_log), key [client_ip]",
        "    store key: sluice-test:orders:per-ip:{ip=203.0.113.9}",
        "nothing was sent to the store or the upstream.",
    ] {
        assert!(
            out.stdout.contains(line),
            "missing {line:?} in:\n{}",
            out.stdout
        );
    }

    // Without the header, the per-key limit counts the client IP, and says so.
    let out = run(&["GET", "/users/7"]);
    assert!(
        out.stdout.contains(
            "the request has no header:x-api-key: this limit counts the client ip instead"
        ),
        "{}",
        out.stdout
    );
    assert!(out
        .stdout
        .contains("store key: sluice-test:orders:per-key:{ip=127.0.0.1}"));

    let refused = run(&["GET", "/users/%2e%2e/admin"]);
    assert!(
        refused.stdout.contains("refused:    400 Bad Request"),
        "{}",
        refused.stdout
    );
    let unrouted = run(&["GET", "/other"]);
    assert!(
        unrouted.stdout.contains("route:      none matches: 404"),
        "{}",
        unrouted.stdout
    );
    let bad = run(&["GET", "/users/1", "-H", "no colon"]);
    assert!(!bad.status.success());
    assert!(bad.stderr.contains("not a header line"), "{}", bad.stderr);

    assert_eq!(
        monitor.commands().await,
        Vec::<String>::new(),
        "explain sent commands to the store"
    );
    assert!(redis.keys().await.is_empty(), "explain wrote to the store");
}

#[test]
fn explains_shaping_and_counting_by_outcome() {
    let yaml = r#"listen: 127.0.0.1:1
admin_listen: 127.0.0.1:2
upstreams:
  api: { url: "http://127.0.0.1:3000" }
routes:
  - name: login
    match: { path_prefix: /login }
    upstream: api
    limits:
      - { name: shaped, key: [client_ip], requests: 50, window: 1s, on_exceed: delay, max_delay: 250ms }
      - { name: failed, key: [client_ip], requests: 5, window: 1m, count: { status: [401, 5xx] } }
"#;
    let config = write_config(yaml);
    let path = config.path().to_str().unwrap().to_owned();
    let out = run_sluice(
        &["explain", "--config", &path, "POST", "/login"],
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "{}", out.stderr);
    for line in [
        "  shaped: 50 per 1s (sliding_log, over the limit: held up to 250ms, then 429), key [client_ip]",
        "  failed: 5 per 1m (sliding_log, counts only responses 401, 5xx: others are given back), key [client_ip]",
    ] {
        assert!(out.stdout.contains(line), "missing {line:?} in\n{}", out.stdout);
    }
}

/// A money budget is explained in its unit, micro-units of its currency, with how its
/// reservation is priced.
#[test]
fn explains_a_money_budget_in_its_unit() {
    let yaml = r#"listen: 127.0.0.1:1
admin_listen: 127.0.0.1:2
upstreams:
  llm: { url: "http://127.0.0.1:3000" }
models:
  - { match: "gpt-4o-mini*", prices: { currency: USD, input: 0.15, output: 0.6 } }
routes:
  - name: chat
    match: { path_prefix: /v1/ }
    upstream: llm
    limits:
      - { name: dollars, key: [header:x-api-key], money: 2.5, currency: USD, window: 1h }
"#;
    let config = write_config(yaml);
    let path = config.path().to_str().unwrap().to_owned();
    let out = run_sluice(
        &[
            "explain",
            "--config",
            &path,
            "POST",
            "/v1/chat/completions",
            "-H",
            "x-api-key: k",
        ],
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "{}", out.stderr);
    for line in [
        "  dollars: 2500000 microUSD per 1h (weighted_log), key [header:x-api-key]",
        "priced at the model's prices in USD and counted in microUSD",
        "stored state refused; server tools refused",
    ] {
        assert!(
            out.stdout.contains(line),
            "missing {line:?} in\n{}",
            out.stdout
        );
    }
}
