//! Per-identity overrides set at run time through the admin API (`overrides: true` on a
//! limit): in force on every instance from the moment they are written, exact at the new
//! number under load (judged by the upstream's own count), gone when they expire, kept
//! across a restart, and refused on a limit that does not take them.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Limit, Policy, Redis, Route, Sluice, Upstream};

fn policy(up: &Upstream, limit: Limit) -> Policy {
    Policy::new().upstream("api", up.url()).route(
        Route::new("api", "/")
            .upstream("api")
            .limit(limit.key(["header:x-api-key"])),
    )
}

/// A limit of 3 an hour that takes overrides.
fn hourly() -> Limit {
    Limit::requests("hourly", 3, "1h").set("overrides", true)
}

/// An admin API call on `sluice`: its status and JSON body.
async fn admin(sluice: &Sluice, method: reqwest::Method, query: &str) -> (u16, serde_json::Value) {
    let response = support::client()
        .request(
            method,
            format!(
                "{}/admin/v1/limits/api/hourly/override?{query}",
                sluice.admin_url()
            ),
        )
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    let status = response.status().as_u16();
    let body = response.json().await.expect("a JSON answer");
    (status, body)
}

/// The overrides listed by `sluice`'s admin API for the hourly limit: (identity, requests).
async fn listed(sluice: &Sluice) -> Vec<(String, u64)> {
    let response = support::client()
        .get(format!(
            "{}/admin/v1/limits/api/hourly/overrides",
            sluice.admin_url()
        ))
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.expect("JSON");
    body["overrides"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|entry| {
            (
                entry["identity"].as_str().unwrap_or_default().to_owned(),
                entry["requests"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

async fn hit(client: &reqwest::Client, sluice: &Sluice, key: &str) -> reqwest::Response {
    client
        .get(format!("{}/x", sluice.url()))
        .header("x-api-key", key)
        .send()
        .await
        .expect("a response")
}

/// Three instances on one Redis. Customer `big` spends the policy's 3 and is refused by every
/// instance (each remembers the denial). An override of 10, set through one instance, is in
/// force on all three at once: twelve clients spread over them for 1.5 s get exactly 7 more
/// through (the upstream's own count), the answers say `q=10`, and another customer keeps the
/// policy's 3. Lowered to 4, nothing more passes (10 are counted); removed, the policy's 3
/// holds. Seeded: a store that ignores the override admits 3 in all, and the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_override_is_exact_on_every_instance_from_the_moment_it_is_set() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = policy(&up, hourly()).store_redis(&redis);
    let instances = Arc::new([
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
    ]);
    let client = support::client();
    for _ in 0..3 {
        assert_eq!(hit(&client, &instances[0], "big").await.status(), 200);
    }
    for sluice in instances.iter() {
        assert_eq!(hit(&client, sluice, "big").await.status(), 429);
        assert_eq!(hit(&client, sluice, "big").await.status(), 429);
    }
    let (status, body) = admin(
        &instances[1],
        reqwest::Method::PUT,
        "key=h:x-api-key=big&requests=10",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["old"], serde_json::Value::Null, "{body}");
    assert_eq!(body["requests"], 10, "{body}");
    assert_eq!(body["instances_told"], 3, "{body}");
    assert_eq!(
        listed(&instances[2]).await,
        [("h:x-api-key=big".to_owned(), 10)]
    );
    let metrics = support::parse_metrics(&instances[1].metrics().await);
    assert_eq!(
        support::metric_sum(
            &metrics,
            "sluice_override_changes_total",
            &[("action", "set")]
        ),
        1.0
    );
    let start = Instant::now();
    let tasks: Vec<_> = (0..12usize)
        .map(|i| {
            let (client, instances) = (client.clone(), Arc::clone(&instances));
            tokio::spawn(async move {
                let mut policies = Vec::new();
                while start.elapsed() < Duration::from_millis(1500) {
                    let response = hit(&client, &instances[i % 3], "big").await;
                    if response.status() == 200 {
                        let field = response.headers().get("ratelimit-policy").cloned();
                        policies.push(field.map(|f| f.to_str().unwrap_or_default().to_owned()));
                    }
                }
                policies
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for task in tasks {
        admitted.extend(task.await.unwrap());
    }
    assert_eq!(
        up.hits(),
        10,
        "exactly the override's 10 reached the upstream"
    );
    assert_eq!(admitted.len(), 7);
    for field in &admitted {
        assert_eq!(field.as_deref(), Some("\"hourly\";q=10;w=3600"));
    }
    for _ in 0..3 {
        assert_eq!(hit(&client, &instances[2], "small").await.status(), 200);
    }
    assert_eq!(
        hit(&client, &instances[2], "small").await.status(),
        429,
        "others keep 3"
    );

    let (status, body) = admin(
        &instances[0],
        reqwest::Method::PUT,
        "key=h:x-api-key=big&requests=4",
    )
    .await;
    assert_eq!((status, body["old"].as_u64()), (200, Some(10)), "{body}");
    for sluice in instances.iter() {
        assert_eq!(
            hit(&client, sluice, "big").await.status(),
            429,
            "10 counted, 4 allowed"
        );
    }
    let (status, body) = admin(&instances[2], reqwest::Method::GET, "key=h:x-api-key=big").await;
    assert_eq!(
        (status, body["requests"].as_u64()),
        (200, Some(4)),
        "{body}"
    );
    // Set without a ttl: the default's 30 days.
    let expires_in = body["expires_in"].as_f64().expect("an expiry");
    assert!(
        (30.0 * 86_400.0 - 60.0..=30.0 * 86_400.0).contains(&expires_in),
        "{body}"
    );
    let (status, body) = admin(
        &instances[2],
        reqwest::Method::DELETE,
        "key=h:x-api-key=big",
    )
    .await;
    assert_eq!((status, body["old"].as_u64()), (200, Some(4)), "{body}");
    let (_, body) = admin(&instances[0], reqwest::Method::GET, "key=h:x-api-key=big").await;
    assert_eq!(body["requests"], serde_json::Value::Null, "{body}");
    assert!(listed(&instances[0]).await.is_empty());
    assert_eq!(up.hits(), 13);
}

/// An override with a `ttl` raises the limit until it expires, then the policy's number holds
/// again; its key in Redis carries the expiry (it goes on its own, even if sluice dies; one
/// set without a `ttl` gets 30 days, which the Redis harness's check that every key expires
/// covers). It is kept across a restart of sluice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_expires_on_its_own_and_outlives_a_restart() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = policy(&up, hourly()).store_redis(&redis);
    let client = support::client();
    {
        let sluice = Sluice::start(&yaml).await;
        let (status, body) = admin(
            &sluice,
            reqwest::Method::PUT,
            "key=h:x-api-key=a&requests=5&ttl=2s",
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let expires_in = body["expires_in"].as_f64().expect("an expiry");
        assert!((1.9..=2.0).contains(&expires_in), "{body}");
        let (_, body) = admin(
            &sluice,
            reqwest::Method::PUT,
            "key=h:x-api-key=b&requests=6",
        )
        .await;
        assert_eq!(body["requests"], 6, "{body}");
    }
    let keys = redis.keys().await;
    let override_key = keys
        .iter()
        .find(|key| key.ends_with("{h:x-api-key=a}:o"))
        .unwrap_or_else(|| panic!("the override's key, among {keys:?}"));
    match redis.cmd(&["PTTL", override_key]).await {
        redis::Value::Int(ms) => assert!((1..=2000).contains(&ms), "PTTL {ms}"),
        other => panic!("PTTL answered {other:?}"),
    }
    let sluice = Sluice::start(&yaml).await;
    for _ in 0..5 {
        assert_eq!(
            hit(&client, &sluice, "a").await.status(),
            200,
            "the override, after a restart"
        );
    }
    assert_eq!(hit(&client, &sluice, "a").await.status(), 429);
    for _ in 0..6 {
        assert_eq!(hit(&client, &sluice, "b").await.status(), 200);
    }
    assert_eq!(hit(&client, &sluice, "b").await.status(), 429);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (_, body) = admin(&sluice, reqwest::Method::GET, "key=h:x-api-key=a").await;
    assert_eq!(body["requests"], serde_json::Value::Null, "expired: {body}");
    assert_eq!(
        hit(&client, &sluice, "a").await.status(),
        429,
        "5 counted, the policy's 3 again"
    );
}

/// `GET /admin/v1/overrides` on `sluice`: (route, limit, overrides) of the policy's limits
/// holding some, and (index, overrides) of those the policy does not have.
async fn holders(sluice: &Sluice) -> (Vec<(String, String, u64)>, Vec<(String, u64)>) {
    let response = support::client()
        .get(format!("{}/admin/v1/overrides", sluice.admin_url()))
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.expect("JSON");
    let text = |value: &serde_json::Value| value.as_str().unwrap_or_default().to_owned();
    let limits = body["limits"].as_array().expect("a list");
    let gone = body["not_in_policy"].as_array().expect("a list");
    (
        limits
            .iter()
            .map(|l| {
                (
                    text(&l["route"]),
                    text(&l["limit"]),
                    l["overrides"].as_u64().unwrap_or(0),
                )
            })
            .collect(),
        gone.iter()
            .map(|l| (text(&l["index"]), l["overrides"].as_u64().unwrap_or(0)))
            .collect(),
    )
}

/// A limit removed from the policy (here: renamed, on a second instance of the same Redis)
/// keeps its overrides until they expire, applied to nothing: the renamed limit counts with
/// the policy's number, and the admin API lists the removed limit's overrides apart, while an
/// instance whose policy still has the limit names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_limits_overrides_are_listed_apart_and_applied_to_nothing() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let old = Sluice::start(&policy(&up, hourly()).store_redis(&redis)).await;
    for key in ["a", "b"] {
        let (status, body) = admin(
            &old,
            reqwest::Method::PUT,
            &format!("key=h:x-api-key={key}&requests=10"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let renamed = Limit::requests("per-hour", 3, "1h").set("overrides", true);
    let new = Sluice::start(&policy(&up, renamed).store_redis(&redis)).await;
    let client = support::client();
    for _ in 0..3 {
        assert_eq!(hit(&client, &new, "a").await.status(), 200);
    }
    assert_eq!(
        hit(&client, &new, "a").await.status(),
        429,
        "the removed limit's override of 10 is not the renamed limit's"
    );
    assert_eq!(
        holders(&old).await,
        (vec![("api".to_owned(), "hourly".to_owned(), 2)], vec![])
    );
    let (named, gone) = holders(&new).await;
    assert_eq!(named, vec![]);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert!(gone[0].0.contains(":hourly:"), "{gone:?}");
    assert_eq!(gone[0].1, 2);
    assert!(
        redis
            .assert_every_key_expires(Duration::from_secs(400 * 86_400))
            .await
            > 0,
        "the list of limits holding overrides expires too"
    );
}

/// In process: the same endpoint, the override kept in sluice's memory; a limit without
/// `overrides: true` refuses one with 409 and says how to allow it; a bad number is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_overrides_and_the_refusals() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&policy(&up, hourly())).await;
    let client = support::client();
    let (status, body) = admin(
        &sluice,
        reqwest::Method::PUT,
        "key=h:x-api-key=a&requests=4",
    )
    .await;
    assert_eq!(
        (status, body["store"].as_str()),
        (200, Some("local")),
        "{body}"
    );
    for _ in 0..4 {
        let response = hit(&client, &sluice, "a").await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["ratelimit-policy"],
            "\"hourly\";q=4;w=3600"
        );
    }
    assert_eq!(hit(&client, &sluice, "a").await.status(), 429);
    assert_eq!(listed(&sluice).await, [("h:x-api-key=a".to_owned(), 4)]);
    let (status, body) = admin(
        &sluice,
        reqwest::Method::PUT,
        "key=h:x-api-key=a&requests=ten",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("requests=`ten`"),
        "{body}"
    );
    let (status, _) = admin(&sluice, reqwest::Method::PUT, "key=h:x-api-key=a").await;
    assert_eq!(status, 400, "PUT without requests=");

    let plain = Sluice::start(&policy(&up, Limit::requests("hourly", 3, "1h"))).await;
    let (status, body) = admin(&plain, reqwest::Method::PUT, "key=h:x-api-key=a&requests=4").await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("overrides: true"),
        "{body}"
    );
}
