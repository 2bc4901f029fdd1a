//! Who a limit counts: the client behind trusted proxies, and key parts from the query,
//! cookies, method, host and path; and the response header styles.

use crate::support;

use support::{client_from, Limit, Node, Policy, Route, Sluice};

/// A route limited to `requests` per minute on `key`, answering 200 directly; `head` sets
/// the policy's other fields.
fn one_route<const N: usize>(head: Policy, key: [&str; N], requests: u32) -> Policy {
    head.route(
        Route::new("api", "/")
            .respond(200, "ok")
            .limit(Limit::requests("l", requests, "1m").key(key)),
    )
}

/// Statuses of GETs of `path` from `from`, each with the given headers.
async fn statuses(sluice: &Sluice, from: &str, requests: &[(&str, &[(&str, &str)])]) -> Vec<u16> {
    let client = client_from(from);
    let mut out = Vec::new();
    for (path, headers) in requests {
        let mut request = client.get(format!("{}{path}", sluice.url()));
        for (name, value) in *headers {
            request = request.header(*name, *value);
        }
        out.push(request.send().await.unwrap().status().as_u16());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoofed_forwarded_for_from_an_untrusted_peer_changes_nothing() {
    let head = Policy::new().set("trusted_proxies", ["127.0.0.2"]);
    let sluice = Sluice::start(&one_route(head, ["client_ip"], 2)).await;
    // 127.0.0.1 is not trusted: each request claims another client, all count as one.
    let got = statuses(
        &sluice,
        "127.0.0.1",
        &[
            ("/", &[("x-forwarded-for", "198.51.100.1")]),
            ("/", &[("x-forwarded-for", "198.51.100.2")]),
            ("/", &[("x-forwarded-for", "198.51.100.3")]),
        ],
    )
    .await;
    assert_eq!(got, [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_trusted_proxies_each_real_client_has_its_own_limit() {
    let head = Policy::new().set("trusted_proxies", ["127.0.0.2", "10.0.0.0/8"]);
    let sluice = Sluice::start(&one_route(head, ["client_ip"], 2)).await;
    // Through two trusted proxies (10.1.1.1 and the peer 127.0.0.2): the client is the
    // rightmost untrusted address, whatever the client wrote to the left of it.
    let chain = "198.51.100.7, 10.1.1.1";
    let spoofed = "1.2.3.4, 198.51.100.7, 10.1.1.1";
    let got = statuses(
        &sluice,
        "127.0.0.2",
        &[
            ("/", &[("x-forwarded-for", chain)]),
            ("/", &[("x-forwarded-for", spoofed)]),
            ("/", &[("x-forwarded-for", chain)]),
            // Another real client behind the same proxy has its own allowance.
            ("/", &[("x-forwarded-for", "198.51.100.8, 10.1.1.1")]),
            ("/", &[("x-forwarded-for", "198.51.100.8")]),
            ("/", &[("x-forwarded-for", "198.51.100.8")]),
        ],
    )
    .await;
    assert_eq!(got, [200, 200, 429, 200, 200, 429]);
    // Without the header, the trusted proxy itself is the client.
    let alone = statuses(&sluice, "127.0.0.2", &[("/", &[]), ("/", &[]), ("/", &[])]).await;
    assert_eq!(alone, [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rfc_7239_forwarded_header_when_configured() {
    let head = Policy::new()
        .set("trusted_proxies", ["127.0.0.2"])
        .set("forwarded_header", "forwarded");
    let sluice = Sluice::start(&one_route(head, ["client_ip"], 1)).await;
    let got = statuses(
        &sluice,
        "127.0.0.2",
        &[
            ("/", &[("forwarded", "for=198.51.100.9;proto=https")]),
            ("/", &[("forwarded", "for=\"[2001:db8::1]:4711\"")]),
            ("/", &[("forwarded", "for=198.51.100.9")]),
            // X-Forwarded-For is not what these proxies set: it is not believed.
            ("/", &[("x-forwarded-for", "203.0.113.1")]),
            ("/", &[("x-forwarded-for", "203.0.113.2")]),
        ],
    )
    .await;
    assert_eq!(got, [200, 200, 429, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_cookie_method_host_and_path_parts() {
    // A query parameter, decoded: spellings the upstream reads alike are one identity.
    let sluice = Sluice::start(&one_route(Policy::new(), ["query:api_key"], 1)).await;
    let got = statuses(
        &sluice,
        "127.0.0.1",
        &[
            ("/?api_key=abc", &[]),
            ("/?x=1&api_key=%61bc", &[]),
            ("/?api_key=abd", &[]),
        ],
    )
    .await;
    assert_eq!(got, [200, 429, 200]);
    drop(sluice);

    let sluice = Sluice::start(&one_route(Policy::new(), ["cookie:session"], 1)).await;
    let got = statuses(
        &sluice,
        "127.0.0.1",
        &[
            ("/", &[("cookie", "theme=dark; session=s1")]),
            ("/", &[("cookie", "session=\"s1\"")]),
            ("/", &[("cookie", "session=s2")]),
        ],
    )
    .await;
    assert_eq!(got, [200, 429, 200]);
    drop(sluice);

    // Path and method: `/Users/1` and `/users/1` are one path on a case-insensitive route.
    let sluice = Sluice::start(&one_route(Policy::new(), ["path", "method"], 1)).await;
    let client = client_from("127.0.0.1");
    let url = |path: &str| format!("{}{path}", sluice.url());
    assert_eq!(
        client.get(url("/users/1")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        client.get(url("/Users/1")).send().await.unwrap().status(),
        429
    );
    assert_eq!(
        client
            .get(url("/users/1;v=2"))
            .send()
            .await
            .unwrap()
            .status(),
        429
    );
    assert_eq!(
        client.post(url("/users/1")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        client.get(url("/users/2")).send().await.unwrap().status(),
        200
    );
    drop(sluice);

    let sluice = Sluice::start(&one_route(Policy::new(), ["host"], 1)).await;
    let got = statuses(
        &sluice,
        "127.0.0.1",
        &[
            ("/", &[("host", "a.example")]),
            ("/", &[("host", "A.EXAMPLE")]),
            ("/", &[("host", "b.example")]),
        ],
    )
    .await;
    assert_eq!(got, [200, 429, 200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_key_is_one_bucket_for_the_route() {
    let sluice = Sluice::start(&one_route(Policy::new(), [], 3)).await;
    let mut got = Vec::new();
    for from in ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        got.extend(statuses(&sluice, from, &[("/", &[("x-api-key", from)])]).await);
    }
    assert_eq!(got, [200, 200, 200, 429], "a global cap across clients");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_header_styles() {
    let per_ip = || Limit::requests("per-ip", 5, "1m");
    let policy = Policy::new()
        .set("response_headers", "legacy")
        .route(
            Route::new("legacy", "/legacy")
                .respond_status(200)
                .limit(per_ip())
                .limit(Limit::requests("tight", 2, "30s")),
        )
        .route(
            Route::new("both", "/both")
                .respond_status(200)
                .set("response_headers", "both")
                .limit(per_ip()),
        )
        .route(
            Route::new("none", "/none")
                .respond_status(200)
                .set("response_headers", "none")
                .limit(per_ip()),
        );
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    let get = |path: &str| client.get(format!("{}{path}", sluice.url())).send();

    let legacy = get("/legacy").await.unwrap();
    let h = |r: &reqwest::Response, name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(h(&legacy, "ratelimit"), None);
    assert_eq!(h(&legacy, "ratelimit-policy"), None);
    // The limit closest to exhaustion: `tight`, 1 of 2 left.
    assert_eq!(h(&legacy, "x-ratelimit-limit").as_deref(), Some("2"));
    assert_eq!(h(&legacy, "x-ratelimit-remaining").as_deref(), Some("1"));
    assert_eq!(h(&legacy, "x-ratelimit-reset").as_deref(), Some("30"));

    let both = get("/both").await.unwrap();
    assert!(h(&both, "ratelimit").is_some());
    assert_eq!(h(&both, "x-ratelimit-remaining").as_deref(), Some("4"));

    let none = get("/none").await.unwrap();
    assert_eq!(h(&none, "ratelimit"), None);
    assert_eq!(h(&none, "x-ratelimit-limit"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_by_header_and_conditions_on_method() {
    let plan = |condition: (&str, Node)| {
        Node::map([("header", Node::from("x-plan")), (condition.0, condition.1)])
    };
    let policy = Policy::new().route(
        Route::new("api", "/")
            .respond_status(200)
            .limit(
                Limit::requests("free", 2, "1m")
                    .key(["header:x-api-key"])
                    .set("when", vec![plan(("equals", "free".into()))]),
            )
            .limit(
                Limit::requests("paid", 4, "1m")
                    .key(["header:x-api-key"])
                    .set(
                        "when",
                        vec![plan(("one_of", ["paid", "enterprise"].into()))],
                    ),
            )
            .limit(Limit::requests("anonymous", 1, "1m").set(
                "when",
                vec![
                    plan(("present", false.into())),
                    Node::map([("method", ["POST"])]),
                ],
            )),
    );
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    let send = |plan: Option<&str>, post: bool| {
        let url = format!("{}/", sluice.url());
        let mut request = if post {
            client.post(url)
        } else {
            client.get(url)
        };
        request = request.header("x-api-key", "k");
        if let Some(plan) = plan {
            request = request.header("x-plan", plan);
        }
        request.send()
    };
    let mut free = Vec::new();
    for _ in 0..3 {
        free.push(send(Some("free"), false).await.unwrap());
    }
    assert_eq!(
        free.iter().map(|r| r.status().as_u16()).collect::<Vec<_>>(),
        [200, 200, 429]
    );
    // Only the limit that applied is described.
    assert_eq!(
        support::header(&free[0], "ratelimit-policy"),
        "\"free\";q=2;w=60"
    );
    let mut paid = Vec::new();
    for _ in 0..5 {
        paid.push(
            send(Some("enterprise"), false)
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(
        paid,
        [200, 200, 200, 200, 429],
        "the same key, the paid tier's limit"
    );
    // No plan, GET: no limit applies at all.
    let open = send(None, false).await.unwrap();
    assert_eq!(open.status(), 200);
    assert!(open.headers().get("ratelimit-policy").is_none());
    // No plan, POST: the anonymous limit.
    assert_eq!(send(None, true).await.unwrap().status(), 200);
    assert_eq!(send(None, true).await.unwrap().status(), 429);
}

#[test]
fn check_names_a_bad_condition_and_a_bad_key_part_with_line_and_column() {
    let head = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n";
    for (limit, expected) in [
        (
            "      - { name: l, key: [], requests: 1, window: 1s, when: [{ method: [GET], host: [a] }] }\n",
            ":8:61: routes[0].limits[0].when[0]: a condition names exactly one of",
        ),
        (
            "      - { name: l, key: [\"query:\"], requests: 1, window: 1s }\n",
            ":8:26: routes[0].limits[0].key[0]: `` is not a valid query parameter name",
        ),
        (
            "      - { name: l, key: [], requests: 1, window: 1s, when: [{ header: x-plan }] }\n",
            "routes[0].limits[0].when[0]: a header condition has exactly one of",
        ),
    ] {
        let file = support::write_config(&format!("{head}{limit}"));
        let (status, _, stderr) = support::sluice_check(file.path());
        assert!(!status.success());
        assert!(stderr.contains(expected), "{stderr}");
    }
    let file = support::write_config(&format!(
        "{head}      - {{ name: l, key: [], requests: 1, window: 1s }}\ntrusted_proxies: [10.0.0.0/33]\n"
    ));
    let (status, _, stderr) = support::sluice_check(file.path());
    assert!(!status.success());
    assert!(
        stderr.contains(":9:19: trusted_proxies[0]: `10.0.0.0/33`"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_parameter_keys_a_limit() {
    let policy = Policy::new()
        .route(
            Route::new("orders", "/users/{id}/orders")
                .respond_status(200)
                .limit(Limit::requests("per-user", 2, "1m").key(["param:id"])),
        )
        .route(Route::new("other", "/").respond_status(204));
    let sluice = Sluice::start(&policy).await;
    let got = statuses(
        &sluice,
        "127.0.0.1",
        &[
            ("/users/42/orders", &[]),
            ("/USERS/42/orders/7", &[]),
            ("/users/42/orders", &[]),
            ("/users/43/orders", &[]),
            ("/users/42/profile", &[]),
        ],
    )
    .await;
    assert_eq!(got, [200, 200, 429, 200, 204]);

    let bad = support::write_config(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: r\n    match: { path_prefix: \"/users/{id}\" }\n    respond: { status: 200 }\n    limits:\n      - { name: l, key: [\"param:user\"], requests: 1, window: 1s }\n",
    );
    let (status, _, stderr) = support::sluice_check(bad.path());
    assert!(!status.success());
    assert!(
        stderr.contains(":8:25: routes[0].limits[0].key[0]: the route's path prefix `/users/{id}` has no `{user}` segment"),
        "{stderr}"
    );
}
