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

/// What `sluice explain` says of one request: the route it names (`None` when none
/// matches), the store keys it prints, and the status of a refusal it prints.
#[derive(Debug)]
struct Explained {
    route: Option<String>,
    keys: Vec<String>,
    refused: Option<u16>,
}

fn read_explain(stdout: &str) -> Explained {
    let mut explained = Explained {
        route: None,
        keys: Vec::new(),
        refused: None,
    };
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("route:      ") {
            if rest.starts_with("none matches: 404") {
                explained.refused = Some(404);
            } else {
                explained.route = rest.split_whitespace().next().map(str::to_owned);
            }
        } else if let Some(rest) = line.trim_start().strip_prefix("store key: ") {
            explained.keys.push(rest.to_owned());
        } else if let Some(rest) = line.strip_prefix("refused:    ") {
            explained.refused = rest.get(..3).and_then(|code| code.parse().ok());
        }
    }
    explained
}

/// The identity in a store key: the text between its braces.
fn identity_of(key: &str) -> &str {
    let start = key.find('{').expect("a store key has braces") + 1;
    let end = key.rfind('}').expect("a store key has braces");
    &key[start..end]
}

/// `sluice explain` and a real request through the running binary agree, for a table of
/// requests: on the route (each route answers a status of its own), the store key (the key
/// explain prints is the key Redis holds once the request is admitted, and the one the
/// admin API finds spent once the gateway answers 429), and the verdict (explain's refusal
/// or 404 is the gateway's status; a request it plans is admitted until its limit is spent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_and_the_gateway_agree_on_route_key_and_verdict() {
    let redis = Redis::start().await;
    let sluice = support::Sluice::start(&format!(
        r#"trusted_proxies: [127.0.0.5/32]
{store}routes:
  - name: orders
    match: {{ path_prefix: /orders }}
    respond: {{ status: 201 }}
    limits:
      - {{ name: per-key, key: ["header:x-api-key"], requests: 10, window: 1m }}
  - name: search
    match: {{ path_prefix: /search }}
    respond: {{ status: 202 }}
    limits:
      - {{ name: per-ip, key: [client_ip], requests: 1, window: 1m }}
  - name: profile
    match: {{ path_prefix: /profile }}
    respond: {{ status: 203 }}
    limits:
      - {{ name: per-session, key: ["query:k", "cookie:session"], requests: 10, window: 1m }}
  - name: open
    match: {{ path_prefix: /open }}
    respond: {{ status: 204 }}
"#,
        store = redis_store_yaml(&redis.url()),
    ))
    .await;
    let config = sluice.config_path().to_str().unwrap().to_owned();
    let route_status = |route: &str| match route {
        "orders" => 201,
        "search" => 202,
        "profile" => 203,
        "open" => 204,
        other => panic!("explain named an unknown route {other}"),
    };

    // (method, target, headers, client address, spent: the limit is used up by an earlier
    // row, so the gateway answers 429 where explain plans the request).
    type Row = (
        &'static str,
        &'static str,
        &'static [(&'static str, &'static str)],
        &'static str,
        bool,
    );
    let table: &[Row] = &[
        (
            "GET",
            "/orders/1",
            &[("x-api-key", "k1")],
            "127.0.0.2",
            false,
        ),
        // No header: the limit counts the client address instead.
        ("GET", "/orders/2", &[], "127.0.0.3", false),
        // A respelled path: the canonical one is routed and keyed.
        (
            "POST",
            "//ORDERS/%39",
            &[("x-api-key", "k2")],
            "127.0.0.2",
            false,
        ),
        ("GET", "/search?q=1", &[], "127.0.0.4", false),
        ("GET", "/search?q=2", &[], "127.0.0.4", true),
        // A trusted proxy: the forwarded-for client is counted.
        (
            "GET",
            "/search",
            &[("x-forwarded-for", "203.0.113.7")],
            "127.0.0.5",
            false,
        ),
        (
            "GET",
            "/search",
            &[("x-forwarded-for", "203.0.113.7")],
            "127.0.0.5",
            true,
        ),
        (
            "GET",
            "/profile?k=abc",
            &[("cookie", "session=s1")],
            "127.0.0.6",
            false,
        ),
        ("GET", "/open/x", &[], "127.0.0.7", false),
        // Refused before the store: a field a limit reads sent twice, an ambiguous path, no
        // route.
        (
            "GET",
            "/orders/3",
            &[("x-api-key", "a"), ("x-api-key", "b")],
            "127.0.0.2",
            false,
        ),
        ("GET", "/orders/a%2Fb", &[], "127.0.0.2", false),
        ("GET", "/nowhere", &[], "127.0.0.2", false),
    ];

    let mut planned_keys = 0;
    let mut spent_checked = 0;
    for &(method, target, headers, from, spent) in table {
        let mut args = vec!["explain", "--config", config.as_str(), method, target];
        let header_lines: Vec<String> = headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}"))
            .collect();
        for line in &header_lines {
            args.extend(["-H", line.as_str()]);
        }
        args.extend(["--from", from]);
        let out = run_sluice(&args, Duration::from_secs(10));
        assert!(out.status.success(), "{target}: {}", out.stderr);
        let explained = read_explain(&out.stdout);

        let client = support::client_from(from);
        let mut request = client.request(
            reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
            format!("{}{target}", sluice.url()),
        );
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let status = request
            .send()
            .await
            .expect("the gateway answers")
            .status()
            .as_u16();
        let context = format!(
            "{method} {target} from {from}: explain said\n{}",
            out.stdout
        );

        if let Some(refused) = explained.refused {
            assert_eq!(status, refused, "{context}");
            continue;
        }
        let route = explained.route.as_deref().expect("a route or a refusal");
        if spent {
            assert_eq!(status, 429, "{context}");
            // The key explain printed is the one the gateway found spent.
            let key = explained.keys.first().expect("a limited route has a key");
            let limit = key.split(':').nth(2).expect("prefix:route:limit:");
            let (admin_status, body) = admin_get(
                &sluice,
                &format!("/admin/v1/limits/{route}/{limit}?key={}", identity_of(key)),
            )
            .await;
            assert_eq!(admin_status, 200, "{body}");
            assert_eq!(body["key"], key.as_str(), "{context}");
            assert_eq!(body["remaining"], 0, "{body}\n{context}");
            spent_checked += 1;
            continue;
        }
        assert_eq!(status, route_status(route), "{context}");
        let stored = redis.keys().await;
        for key in &explained.keys {
            assert!(
                stored.contains(key),
                "explain's key {key} is not in the store: {stored:?}\n{context}"
            );
            planned_keys += 1;
        }
    }
    assert_eq!(planned_keys, 6, "every admitted limited row was checked");
    assert_eq!(spent_checked, 2);
    // Nothing but the keys explain printed was written.
    let mut stored = redis.keys().await;
    stored.sort();
    assert_eq!(
        stored,
        [
            "sluice-test:orders:per-key:{h:x-api-key=k1}",
            "sluice-test:orders:per-key:{h:x-api-key=k2}",
            "sluice-test:orders:per-key:{ip=127.0.0.3}",
            "sluice-test:profile:per-session:{q:k=abc|c:session=s1}",
            "sluice-test:search:per-ip:{ip=127.0.0.4}",
            "sluice-test:search:per-ip:{ip=203.0.113.7}",
        ]
    );
}

async fn admin_get(sluice: &support::Sluice, path: &str) -> (u16, serde_json::Value) {
    let response = support::client()
        .get(format!("{}{path}", sluice.admin_url()))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

/// A concurrency limit is explained as places at once with its lease, its key, and where a
/// running instance shows who holds them.
#[test]
fn explains_a_concurrency_limit() {
    let yaml = r#"listen: 127.0.0.1:1
admin_listen: 127.0.0.1:2
upstreams:
  api: { url: "http://127.0.0.1:3000" }
routes:
  - name: chat
    match: { path_prefix: /chat }
    upstream: api
    limits:
      - { name: at-once, key: ["header:x-api-key"], concurrent: 5 }
      - { name: window, key: ["header:x-api-key"], requests: 5, window: 1m, algorithm: fixed_window }
"#;
    let config = write_config(yaml);
    let path = config.path().to_str().unwrap().to_owned();
    let out = run_sluice(
        &[
            "explain",
            "--config",
            &path,
            "GET",
            "/chat",
            "-H",
            "x-api-key: k1",
        ],
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "{}", out.stderr);
    for line in [
        "  at-once: 5 at once (lease 10s) (concurrency), key [header:x-api-key]",
        "    store key: sluice:chat:at-once:concurrency:{h:x-api-key=k1}",
        "    in flight now: GET /admin/v1/limits/chat/at-once?key=h:x-api-key=k1 on a running instance lists the holders",
        "  window: 5 per 1m (fixed_window, approximate), key [header:x-api-key]",
    ] {
        assert!(out.stdout.contains(line), "missing {line:?} in\n{}", out.stdout);
    }
}
