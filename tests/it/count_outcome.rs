//! `count: { status: [...] }`: a limit that counts only some outcomes. Each request reserves
//! its place when it is checked and gives it back once its response status is known if the
//! limit does not count that status. A real upstream answers `/login` with 401 for a wrong
//! password and 200 for the right one; on the in-process store, and on Redis (two instances
//! sharing one redis-server for the concurrent test).

use crate::support;

use std::time::Duration;

use support::{
    client, closed_port, metric_sum, parse_metrics, Limit, Node, Policy, Route, Sluice, Store,
    StoreKind, Upstream, UpstreamSpec,
};

/// One route `name` to `upstream_url` (with its `timeout`) under one limit.
fn one_route(store: Policy, name: &str, upstream_url: &str, timeout: &str, limit: Limit) -> Policy {
    store
        .upstream("api", UpstreamSpec::new(upstream_url).timeout(timeout))
        .route(Route::new(name, "/").upstream("api").limit(limit))
}

/// `/login`: five failures a minute per client address, counting `count`.
fn policy<T: Into<Node>>(
    store: Policy,
    upstream_url: &str,
    count: impl IntoIterator<Item = T>,
) -> Policy {
    let failures = Limit::requests("failures", 5, "1m").count_status(count);
    one_route(store, "login", upstream_url, "5s", failures)
}

async fn login(c: &reqwest::Client, sluice: &Sluice, password: &str) -> u16 {
    c.post(format!("{}/login?password={password}", sluice.url()))
        .send()
        .await
        .expect("an answer")
        .status()
        .as_u16()
}

async fn five_failures_then_refused_while_successes_pass(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &upstream.url(),
        [401, 403],
    ))
    .await;
    let c = client();
    for n in 0..100 {
        assert_eq!(login(&c, &sluice, "right").await, 200, "success {n}");
    }
    for n in 0..5 {
        assert_eq!(login(&c, &sluice, "wrong").await, 401, "failure {n}");
    }
    assert_eq!(login(&c, &sluice, "wrong").await, 429, "the sixth failure");
    assert_eq!(login(&c, &sluice, "right").await, 429, "the limit is full");
    assert_eq!(
        upstream.hits(),
        105,
        "refused attempts never reach the upstream"
    );
    let metrics = parse_metrics(&sluice.metrics().await);
    let released = metric_sum(
        &metrics,
        "sluice_limit_decisions_total",
        &[("limit", "failures"), ("decision", "released")],
    );
    assert_eq!(released, 100.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_failures_then_refused_while_successes_pass_redis() {
    five_failures_then_refused_while_successes_pass(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_failures_then_refused_while_successes_pass_memory() {
    five_failures_then_refused_while_successes_pass(StoreKind::Memory).await;
}

async fn concurrent_failures_reach_the_upstream_at_most_the_limit(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let store = Store::start(kind).await;
    let instances = if store.redis.is_some() { 2 } else { 1 };
    let mut sluices = Vec::new();
    for _ in 0..instances {
        sluices.push(
            Sluice::start(&policy(
                Policy::new().store(&store),
                &upstream.url(),
                [401, 403],
            ))
            .await,
        );
    }
    let c = client();
    let tasks: Vec<_> = (0..50)
        .map(|n| {
            let c = c.clone();
            let url = format!("{}/login?password=wrong", sluices[n % instances].url());
            tokio::spawn(async move { c.post(url).send().await.unwrap().status().as_u16() })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap());
    }
    let failed = statuses.iter().filter(|&&s| s == 401).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(failed + refused, 50, "{statuses:?}");
    assert!(
        upstream.hits() <= 5,
        "{} reached the upstream",
        upstream.hits()
    );
    assert_eq!(upstream.hits(), failed);
    assert_eq!(failed, 5, "reservations are not lost either: {statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_failures_reach_the_upstream_at_most_the_limit_redis() {
    concurrent_failures_reach_the_upstream_at_most_the_limit(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_failures_reach_the_upstream_at_most_the_limit_memory() {
    concurrent_failures_reach_the_upstream_at_most_the_limit(StoreKind::Memory).await;
}

/// sluice's own answers are statuses the client sees: a 502 for an upstream that is down
/// counts under `5xx`, and is given back under `[401]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_own_errors_count_as_the_status_the_client_gets() {
    let down = format!("http://127.0.0.1:{}", closed_port());
    let counted = Sluice::start(&policy(Policy::new(), &down, ["5xx"])).await;
    let c = client();
    for _ in 0..5 {
        assert_eq!(login(&c, &counted, "x").await, 502);
    }
    assert_eq!(login(&c, &counted, "x").await, 429);
    let ignored = Sluice::start(&policy(Policy::new(), &down, [401])).await;
    for _ in 0..10 {
        assert_eq!(login(&c, &ignored, "x").await, 502);
    }
}

/// A client that leaves while its request is at the upstream keeps its reservation: the
/// upstream may have processed the attempt, and giving the place back would let a client
/// escape the count by disconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_flight_keeps_its_reservation() {
    let upstream = Upstream::start().await;
    let store = Store::start(StoreKind::Redis).await;
    let failures = Limit::requests("failures", 1, "1m").count_status([401]);
    let policy = one_route(
        Policy::new().store(&store),
        "login",
        &upstream.url(),
        "5s",
        failures,
    );
    let sluice = Sluice::start(&policy).await;
    let c = client();
    // The upstream would answer 200 (uncounted) after a second; the client leaves first.
    let left = c
        .get(format!("{}/slow/1000", sluice.url()))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(left.is_err(), "{left:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(login(&c, &sluice, "right").await, 429);
}

/// sluice's own 504 (the upstream slower than its `timeout`) is a status the client gets:
/// counted under `5xx`, given back under `[401]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_own_504_counts_under_5xx() {
    let upstream = Upstream::start().await;
    let yaml = |count: Node| {
        let failures = Limit::requests("failures", 2, "1m").count_status([count]);
        one_route(Policy::new(), "slow", &upstream.url(), "300ms", failures)
    };
    let c = client();
    let slow = |sluice: &Sluice| format!("{}/slow/2000", sluice.url());
    let counted = Sluice::start(&yaml("5xx".into())).await;
    for n in 0..2 {
        let status = c.get(slow(&counted)).send().await.unwrap().status();
        assert_eq!(status, 504, "timeout {n}");
    }
    let status = c.get(slow(&counted)).send().await.unwrap().status();
    assert_eq!(status, 429, "two 504s fill a limit of 2 counting 5xx");
    let ignored = Sluice::start(&yaml(401.into())).await;
    for n in 0..4 {
        let status = c.get(slow(&ignored)).send().await.unwrap().status();
        assert_eq!(status, 504, "timeout {n}: a 504 is given back under [401]");
    }
}

/// The place is given back before the response goes to the client: with a limit of one
/// counted failure, a success followed at once by a failure finds its place free (were the
/// give-back made after the answer, the failure would race it and could get 429). Repeated
/// for 20 identities; each then has its one failure counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_place_is_given_back_before_the_answer() {
    for kind in [StoreKind::Redis, StoreKind::Memory] {
        let upstream = Upstream::start().await;
        let store = Store::start(kind).await;
        let failures = Limit::requests("failures", 1, "1m")
            .key(["header:x-user"])
            .count_status([401]);
        let policy = one_route(
            Policy::new().store(&store),
            "login",
            &upstream.url(),
            "5s",
            failures,
        );
        let sluice = Sluice::start(&policy).await;
        let c = client();
        let login = |user: String, password: &'static str| {
            let (c, url) = (
                c.clone(),
                format!("{}/login?password={password}", sluice.url()),
            );
            async move {
                c.post(url)
                    .header("x-user", user)
                    .send()
                    .await
                    .expect("an answer")
                    .status()
                    .as_u16()
            }
        };
        for n in 0..20 {
            let user = format!("user-{n}");
            assert_eq!(login(user.clone(), "right").await, 200, "{kind:?} {user}");
            assert_eq!(
                login(user.clone(), "wrong").await,
                401,
                "{kind:?} {user}: the success's place was free"
            );
            assert_eq!(login(user.clone(), "right").await, 429, "{kind:?} {user}");
        }
        assert_eq!(upstream.hits(), 40, "{kind:?}");
    }
}
