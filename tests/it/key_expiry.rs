//! Every key sluice writes in Redis expires on its own, whatever path wrote it: a real
//! sluice and a real Redis driven through every algorithm and every script path (admission,
//! rejection, delay, a held client that leaves, count-by-outcome give-back, token settlement
//! to less, more and zero, a kept reservation, an upstream that cannot be reached, the admin
//! API's read and reset, a calendar quota), then every key in Redis read with `SCAN` and
//! `PTTL`: each must expire, and no later than its limit keeps it.

use crate::support;

use std::time::Duration;

use serde_json::json;
use support::{
    chat_body, client, closed_port, Limit, LlmUpstream, Node, Policy, Redis, Route, Sluice,
    Upstream, UpstreamSpec,
};

const ALGORITHMS: [&str; 5] = [
    "sliding_log",
    "weighted_log",
    "sliding_window",
    "fixed_window",
    "gcra",
];

/// The window of every rolling limit here; sliding_window keeps its key two windows.
const WINDOW: Duration = Duration::from_secs(10);

/// A day quota's key lives until its day ends, plus a minute (`calendar.lua`).
const DAY_AND_SLACK: Duration = Duration::from_secs(86_400 + 60);

fn policy(redis: &Redis, api: &str, llm: &str, down: &str) -> Policy {
    let upstream = |url: &str| UpstreamSpec::new(url).timeout("5s");
    let mut policy = Policy::new()
        .store_redis(redis)
        .upstream("api", upstream(api))
        .upstream("llm", upstream(llm))
        .upstream("down", upstream(down));
    let by_key = |limit: Limit| limit.key(["header:x-api-key"]);
    for algorithm in ALGORITHMS {
        policy = policy.route(
            Route::new(
                &format!("plain-{algorithm}"),
                &format!("/plain/{algorithm}"),
            )
            .respond(200, "ok")
            .limit(by_key(Limit::requests("a", 2, "10s").algorithm(algorithm))),
        );
    }
    for algorithm in ["sliding_log", "gcra"] {
        policy = policy.route(
            Route::new(
                &format!("delay-{algorithm}"),
                &format!("/delay/{algorithm}"),
            )
            .respond(200, "ok")
            .limit(by_key(
                Limit::requests("a", 1, "2s")
                    .algorithm(algorithm)
                    .delay("5s"),
            )),
        );
    }
    // Count-by-outcome: counts 401 only, so each 200 is given back.
    let count = ALGORITHMS.iter().fold(
        Route::new("count", "/login").upstream("api"),
        |route, algorithm| {
            route.limit(by_key(
                Limit::requests(algorithm, 5, "10s")
                    .algorithm(algorithm)
                    .count_status([401]),
            ))
        },
    );
    policy = policy.route(count).route(
        Route::new("quota", "/quota")
            .respond(200, "ok")
            .limit(by_key(Limit::quota("a", 2, "day"))),
    );
    let reserve = Node::map([
        ("default_output", Node::from(256)),
        ("max_output", Node::from(4096)),
        ("max_body", Node::from("16KiB")),
    ]);
    for (name, limit) in [
        ("weighted_log", Limit::tokens("t", 20000, "10s")),
        (
            "sliding_log",
            Limit::tokens("t", 20000, "10s").algorithm("sliding_log"),
        ),
        ("calendar", Limit::tokens_quota("t", 20000, "day")),
    ] {
        for (prefix, upstream) in [("tok", "llm"), ("down", "down")] {
            policy = policy.route(
                Route::new(&format!("{prefix}-{name}"), &format!("/{prefix}/{name}/"))
                    .upstream(upstream)
                    .limit(by_key(limit.clone()).set("reserve", reserve.clone())),
            );
        }
    }
    policy
}

/// The longest a key of this test may live: its limit's window or period, with a margin.
fn longest_for(key: &str) -> Duration {
    let margin = Duration::from_secs(2);
    if key.contains(":calendar:") {
        DAY_AND_SLACK + margin
    } else if key.contains("sliding_window") {
        2 * WINDOW + margin
    } else {
        WINDOW + margin
    }
}

async fn get(url: &str, key: &str) -> u16 {
    client()
        .get(url)
        .header("x-api-key", key)
        .send()
        .await
        .expect("an answer")
        .status()
        .as_u16()
}

async fn chat(url: &str, key: &str, max_tokens: u64, sim: serde_json::Value) -> u16 {
    let answer = client()
        .post(url)
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(chat_body(max_tokens, sim))
        .send()
        .await
        .expect("an answer");
    let status = answer.status().as_u16();
    answer.bytes().await.expect("the whole answer");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_expires_after_every_path() {
    let redis = Redis::start().await;
    let api = Upstream::start().await;
    let llm = LlmUpstream::start().await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    let sluice = Sluice::start(&policy(&redis, &api.url(), &llm.url(), &down)).await;
    let base = sluice.url();

    // Admit, admit, reject; then the admin API reads each and resets one, which is used again.
    for algorithm in ALGORITHMS {
        let url = format!("{base}/plain/{algorithm}");
        let statuses = [
            get(&url, "k").await,
            get(&url, "k").await,
            get(&url, "k").await,
        ];
        assert_eq!(statuses, [200, 200, 429], "{algorithm}");
        let peek = format!(
            "{}/admin/v1/limits/plain-{algorithm}/a?header.x-api-key=k",
            sluice.admin_url()
        );
        assert_eq!(client().get(&peek).send().await.unwrap().status(), 200);
        // A fresh identity whose key the reset deletes, and which is then admitted again.
        assert_eq!(get(&url, "reset").await, 200);
        let reset = peek.replace("=k", "=reset");
        assert_eq!(
            client()
                .delete(&reset)
                .header("x-sluice-admin", "1")
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        assert_eq!(get(&url, "reset").await, 200, "{algorithm}");
    }

    // Delay: the second request waits for the first to leave; a third, whose client leaves
    // while it is held, is given back.
    for algorithm in ["sliding_log", "gcra"] {
        let url = format!("{base}/delay/{algorithm}");
        assert_eq!(get(&url, "k").await, 200);
        assert_eq!(
            get(&url, "k").await,
            200,
            "{algorithm}: delayed, then admitted"
        );
        let gone = client()
            .get(&url)
            .header("x-api-key", "k")
            .timeout(Duration::from_millis(300))
            .send()
            .await;
        assert!(
            gone.is_err(),
            "{algorithm}: held past the client's patience"
        );
    }

    // Count-by-outcome: a 200 is given back in every algorithm, a 401 kept.
    assert_eq!(get(&format!("{base}/login?password=right"), "k").await, 200);
    assert_eq!(get(&format!("{base}/login"), "k").await, 401);
    assert_eq!(
        get(&format!("{base}/login?password=right"), "alone").await,
        200
    );

    // A calendar quota: admit, admit, reject.
    let quota = format!("{base}/quota");
    let statuses = [
        get(&quota, "k").await,
        get(&quota, "k").await,
        get(&quota, "k").await,
    ];
    assert_eq!(statuses, [200, 200, 429]);

    // Token settlement: less, more (an overrun), zero, no figure (kept), and an upstream
    // that cannot be reached (everything given back). Each on an identity of its own, so
    // each entry is alone in its key: the case where a settled entry emptied its set.
    for name in ["weighted_log", "sliding_log", "calendar"] {
        let url = format!("{base}/tok/{name}/v1/chat/completions");
        for (identity, sim) in [
            ("less", json!({"usage": 100})),
            ("more", json!({"usage": 3000})),
            ("zero", json!({"usage": 0})),
            ("none", json!({"mode": "none"})),
            ("sse", json!({"usage": 50, "mode": "sse"})),
        ] {
            assert_eq!(
                chat(&url, identity, 1000, sim).await,
                200,
                "{name} {identity}"
            );
        }
        let url = format!("{base}/down/{name}/v1/chat/completions");
        assert_eq!(chat(&url, "down", 1000, json!({})).await, 502, "{name}");
    }

    // Every key Redis holds now, each within its own limit's keep.
    let ttls = redis.key_ttls().await;
    let mut wrong = Vec::new();
    for (key, pttl) in &ttls {
        let most = longest_for(key).as_millis() as i64;
        if *pttl != -2 && !(1..=most).contains(pttl) {
            wrong.push(format!("{key}: PTTL {pttl} ms (at most {most})"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} keys do not expire: {wrong:?}",
        wrong.len(),
        ttls.len()
    );
    // Plain 5×2, delay 2, count 5×2, quota 1, tokens 3 × 4 (the zero-usage and the
    // unreachable ones emptied theirs; a calendar key stays at 0 only if it never was).
    assert!(ttls.len() >= 30, "only {} keys: {ttls:?}", ttls.len());
    assert!(redis.assert_every_key_expires(DAY_AND_SLACK).await >= 30);
}
