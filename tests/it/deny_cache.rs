//! The exact deny cache under a flood: two sluice instances on one Redis, one key far over
//! its limit. Rejections are answered from memory (almost no Redis calls), yet nothing is
//! admitted beyond the limit, and no request is rejected when the key had room; when a
//! denial expires, one request asks Redis while the others wait for its answer, so a flood
//! costs Redis under 0.05 commands per rejection with every algorithm.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Limit, Policy, Redis, Route, Sluice, Upstream, REDIS_TIMEOUT};

const LIMIT: usize = 5;
const WINDOW: Duration = Duration::from_secs(1);
const RUN_FOR: Duration = Duration::from_secs(4);
const CLIENTS: usize = 32;
/// Slack for the over-denial check: a rejection counts as justified when `LIMIT` admissions
/// may have been in the window up to this much before it (the cache's deadline and the test's
/// clock are read at slightly different moments on a loaded machine). A cache 150 ms stale
/// still fails the test.
const MARGIN: Duration = Duration::from_millis(80);

/// One response: when the request left, when its answer came back, and whether it passed.
#[derive(Clone, Copy)]
struct Exchange {
    sent: Instant,
    answered: Instant,
    admitted: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_is_answered_from_memory_without_over_admission_or_over_denial() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream("api", up.url())
        .route(
            Route::new("api", "/")
                .upstream("api")
                .limit(Limit::requests("per-key", LIMIT as u32, "1s").key(["header:x-api-key"])),
        );
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let urls = Arc::new([format!("{}/flood", a.url()), format!("{}/flood", b.url())]);
    redis.cmd(&["CONFIG", "RESETSTAT"]).await;

    let client = support::client();
    let start = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let client = client.clone();
            let urls = Arc::clone(&urls);
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut n = 0;
                while start.elapsed() < RUN_FOR && n < 20_000 {
                    let sent = Instant::now();
                    let response = client
                        .get(&urls[(i + n) % 2])
                        .header("x-api-key", "flooder")
                        .send()
                        .await
                        .expect("a response");
                    let status = response.status().as_u16();
                    assert!(status == 200 || status == 429, "status {status}");
                    seen.push(Exchange {
                        sent,
                        answered: Instant::now(),
                        admitted: status == 200,
                    });
                    n += 1;
                }
                seen
            })
        })
        .collect();
    let mut exchanges = Vec::new();
    for task in tasks {
        exchanges.extend(task.await.expect("client task"));
    }

    let admitted: Vec<Exchange> = exchanges.iter().copied().filter(|e| e.admitted).collect();
    let rejected = exchanges.len() - admitted.len();
    let evalsha = redis.commandstat("evalsha").await;
    println!(
        "{} requests, {} admitted, {rejected} rejected, {evalsha} EVALSHA",
        exchanges.len(),
        admitted.len()
    );
    assert!(
        rejected > 1_000,
        "the flood was too thin to test: {rejected} rejections"
    );

    // No over-admission: the upstream never saw more than the limit in any window.
    assert_eq!(up.hits(), admitted.len());
    let spans: Vec<(Instant, Instant)> = admitted.iter().map(|e| (e.sent, e.answered)).collect();
    let tightest = support::tightest_admissions(&spans, LIMIT + 1);
    assert!(
        tightest.is_none_or(|span| span >= WINDOW),
        "{} admissions were decided within {tightest:?}",
        LIMIT + 1
    );

    // No over-denial: every rejected request was decided while at least LIMIT admissions
    // were in the window before it. An admission happened between its `sent` and
    // `answered`; a rejection was decided between its own. So a rejection is justified if at
    // least LIMIT admissions were sent before it was answered and answered after its sending
    // minus the window and the store's lateness bound, for which the log counts each
    // admission past its window (with the margin for clocks and scheduling).
    let counted = WINDOW + REDIS_TIMEOUT + MARGIN;
    let mut unjustified = 0;
    for rejection in exchanges.iter().filter(|e| !e.admitted) {
        let in_window = admitted
            .iter()
            .filter(|a| a.sent <= rejection.answered && a.answered + counted > rejection.sent)
            .count();
        if in_window < LIMIT {
            unjustified += 1;
        }
    }
    assert_eq!(unjustified, 0, "rejections while the key had room");
    // The limit was used: admissions resumed as soon as entries left their window (the
    // window and the lateness bound).
    let windows = RUN_FOR.as_secs_f64() / (WINDOW + REDIS_TIMEOUT).as_secs_f64();
    assert!(
        admitted.len() as f64 >= LIMIT as f64 * (windows - 1.0),
        "only {} admitted in {windows} windows",
        admitted.len()
    );

    // A key's denial is remembered until its oldest entry leaves the window; then every
    // client in flight may miss the cache once before the next call remembers a new denial.
    // So the calls are bounded by the admissions (the windows that opened), not by the flood:
    // without the cache every one of the requests would be a call.
    let bound = (admitted.len() + 2) * CLIENTS;
    assert!(
        bound < exchanges.len(),
        "the flood was too thin to tell: {} requests against a bound of {bound} calls",
        exchanges.len()
    );
    assert!(
        evalsha as usize <= bound,
        "{evalsha} Redis calls for {} admissions and {rejected} rejections (bound {bound})",
        admitted.len()
    );
    // Decisions Redis made: batched, several share one EVALSHA, so they are counted by
    // sluice (a store call timed is a decision sent), and the calls can only be fewer.
    let mut answered_from_cache = 0.0;
    let mut decided_by_redis = 0.0;
    for sluice in [&a, &b] {
        let metrics = support::parse_metrics(&sluice.metrics().await);
        answered_from_cache +=
            support::metric_sum(&metrics, "sluice_deny_cache_answers_total", &[]);
        decided_by_redis += support::metric_sum(
            &metrics,
            "sluice_store_call_duration_seconds_count",
            &[("store", "redis")],
        );
    }
    let (answered_from_cache, decided_by_redis) =
        (answered_from_cache as usize, decided_by_redis as usize);
    assert!(
        evalsha as usize <= decided_by_redis,
        "{evalsha} calls for {decided_by_redis} decisions"
    );
    // Every rejection was answered either by a Redis decision that did not admit, or from
    // memory.
    assert_eq!(
        answered_from_cache,
        rejected - (decided_by_redis - admitted.len()),
        "rejections answered from memory: {rejected} rejected, {decided_by_redis} decided by Redis, {} admitted",
        admitted.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_rejection_carries_the_exact_wait_and_fields() {
    let redis = Redis::start().await;
    let yaml = Policy::new().store_redis(&redis).route(
        Route::new("api", "/")
            .respond(200, "ok")
            .limit(Limit::requests("per-key", 2, "30s").key(["header:x-api-key"]))
            .limit(Limit::requests("per-ip", 1000, "1m")),
    );
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let send = || {
        client
            .get(format!("{}/", sluice.url()))
            .header("x-api-key", "k")
            .send()
    };
    assert_eq!(send().await.unwrap().status(), 200);
    assert_eq!(send().await.unwrap().status(), 200);
    let from_redis = send().await.unwrap();
    assert_eq!(from_redis.status(), 429);
    let monitor = redis.monitor().await;
    let cached = send().await.unwrap();
    assert_eq!(cached.status(), 429);
    assert_eq!(
        monitor.commands().await,
        Vec::<String>::new(),
        "answered from memory: no command of any kind reached Redis"
    );

    let retry =
        |r: &reqwest::Response| -> i64 { support::header(r, "retry-after").parse().unwrap() };
    assert_eq!(retry(&cached), retry(&from_redis));
    // The 30 s window and the lateness bound, rounded up.
    assert!((30..=31).contains(&retry(&cached)));
    assert_eq!(
        support::header(&cached, "ratelimit-policy"),
        support::header(&from_redis, "ratelimit-policy")
    );
    // The exhausted limit is reported exactly; the other was not asked about, so it is left
    // out rather than guessed.
    let fields = support::parse_limit_field(support::header(&cached, "ratelimit"));
    assert_eq!(fields.len(), 1, "{fields:?}");
    assert_eq!(fields[0].name, "per-key");
    assert_eq!(fields[0].param("r"), 0);
    assert_eq!(fields[0].param("t"), retry(&cached));
    let body: serde_json::Value = cached.json().await.unwrap();
    assert_eq!(body["limit"], "per-key");
}

/// Floods one key per algorithm from two instances and counts every command Redis ran
/// (inside scripts too) against the rejections: when a short denial expires, one request asks
/// Redis and the others wait for its answer, so the flood costs Redis a few commands per
/// denial, not one decision per waiting client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_costs_redis_under_a_twentieth_of_a_command_per_rejection() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let algorithms = ["sliding_window", "gcra", "sliding_log", "fixed_window"];
    let policy = algorithms.into_iter().fold(
        Policy::new().store_redis(&redis).upstream("api", up.url()),
        |policy, algorithm| {
            policy.route(
                Route::new(algorithm, &format!("/{algorithm}"))
                    .upstream("api")
                    .limit(
                        Limit::requests("a", 1, "2s")
                            .key(["header:x-api-key"])
                            .algorithm(algorithm),
                    ),
            )
        },
    );
    let a = Sluice::start(&policy).await;
    let b = Sluice::start(&policy).await;
    let client = support::client();
    for algorithm in algorithms {
        let urls = Arc::new([
            format!("{}/{algorithm}", a.url()),
            format!("{}/{algorithm}", b.url()),
        ]);
        // The flood's steady state, not its first wave: the key full, and both instances
        // holding its denial (every client's first request would miss the cache at once).
        for url in urls.iter() {
            let mut tries = 0;
            while client
                .get(url)
                .header("x-api-key", "flooder")
                .send()
                .await
                .expect("a response")
                .status()
                == 200
            {
                tries += 1;
                assert!(tries < 10, "{algorithm}: never rejected");
            }
        }
        let warm_up = up.hits();
        redis.cmd(&["CONFIG", "RESETSTAT"]).await;
        let start = Instant::now();
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let (client, urls) = (client.clone(), Arc::clone(&urls));
                tokio::spawn(async move {
                    let (mut admitted, mut rejected, mut n) = (0, 0, 0);
                    while start.elapsed() < Duration::from_secs(5) {
                        let response = client
                            .get(&urls[(i + n) % 2])
                            .header("x-api-key", "flooder")
                            .send()
                            .await
                            .expect("a response");
                        match response.status().as_u16() {
                            200 => admitted += 1,
                            429 => rejected += 1,
                            other => panic!("status {other}"),
                        }
                        n += 1;
                    }
                    (admitted, rejected)
                })
            })
            .collect();
        let (mut admitted, mut rejected) = (0_usize, 0_usize);
        for task in tasks {
            let (yes, no) = task.await.expect("client task");
            admitted += yes;
            rejected += no;
        }
        let commands = redis.commands_total().await;
        let per_rejection = commands as f64 / rejected as f64;
        println!(
            "{algorithm}: {admitted} admitted, {rejected} rejected, {commands} Redis commands, {per_rejection:.4} per rejection"
        );
        assert!(
            rejected > 1_000,
            "{algorithm}: the flood was too thin to test: {rejected} rejections"
        );
        assert_eq!(
            up.hits() - warm_up,
            admitted,
            "{algorithm}: the upstream's record"
        );
        assert!(
            per_rejection < 0.05,
            "{algorithm}: {commands} Redis commands for {rejected} rejections ({per_rejection:.4} each)"
        );
    }
}

/// Three instances on one Redis, a day quota of 3 spent: each instance answers the key's
/// refusals from its deny cache (a denial held until midnight). A reset through one instance's
/// admin API reaches every instance's deny cache through the store's event channel: at once,
/// each instance asks Redis again and admits. Seeded: without the event, the other two answer
/// 429 from memory until the day ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reset_through_one_instance_ends_the_denials_of_every_instance() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream("api", up.url())
        .route(
            Route::new("api", "/")
                .upstream("api")
                .limit(Limit::quota("daily", 3, "day").key(["header:x-api-key"])),
        );
    let instances = [
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
        Sluice::start(&yaml).await,
    ];
    let client = support::client();
    let hit = |sluice: &Sluice| {
        let request = client
            .get(format!("{}/x", sluice.url()))
            .header("x-api-key", "customer-4711");
        async move { request.send().await.expect("a response").status().as_u16() }
    };
    for _ in 0..3 {
        assert_eq!(hit(&instances[0]).await, 200);
    }
    for sluice in &instances {
        for _ in 0..3 {
            assert_eq!(hit(sluice).await, 429, "the quota is spent");
        }
        let metrics = support::parse_metrics(&sluice.metrics().await);
        assert_eq!(
            support::metric_sum(&metrics, "sluice_deny_cache_answers_total", &[]),
            2.0,
            "the instance remembers the denial"
        );
    }
    let reset = client
        .delete(format!(
            "{}/admin/v1/limits/api/daily?header.x-api-key=customer-4711",
            instances[0].admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(reset.status(), 200);
    let body: serde_json::Value = reset.json().await.expect("JSON");
    assert_eq!(body["instances_told"], 3, "{body}");
    // Pub/sub delivers in milliseconds; a second is a generous bound on a loaded machine.
    for (index, sluice) in instances.iter().enumerate().rev() {
        support::wait_for(
            Duration::from_secs(1),
            &format!("instance {index} admits after the reset"),
            || async { hit(sluice).await == 200 },
        )
        .await;
    }
    assert_eq!(
        up.hits(),
        6,
        "three before the reset and one per instance after"
    );
}

/// The event subscriptions cut by Redis (`CLIENT KILL TYPE pubsub`): each instance subscribes
/// again on its own, and a reset made afterwards still ends the other's denial. Seeded: a
/// listener that does not come back leaves the channel with no subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_event_subscription_is_cut_subscribes_again() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream("api", up.url())
        .route(
            Route::new("api", "/")
                .upstream("api")
                .limit(Limit::quota("daily", 1, "day").key(["header:x-api-key"])),
        );
    let (a, b) = (Sluice::start(&yaml).await, Sluice::start(&yaml).await);
    let subscribers = || async {
        match redis.cmd(&["PUBSUB", "NUMSUB", "sluice:events"]).await {
            redis::Value::Array(reply) => match reply.get(1) {
                Some(redis::Value::Int(n)) => *n,
                _ => -1,
            },
            _ => -1,
        }
    };
    support::wait_for(Duration::from_secs(2), "both subscribed", || async {
        subscribers().await == 2
    })
    .await;
    redis.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]).await;
    support::wait_for(Duration::from_secs(3), "both subscribed again", || async {
        subscribers().await == 2
    })
    .await;
    let client = support::client();
    let hit = |sluice: &Sluice| {
        let request = client
            .get(format!("{}/x", sluice.url()))
            .header("x-api-key", "k");
        async move { request.send().await.expect("a response").status().as_u16() }
    };
    assert_eq!(hit(&a).await, 200);
    assert_eq!(hit(&b).await, 429);
    assert_eq!(hit(&b).await, 429, "remembered");
    let reset = client
        .delete(format!(
            "{}/admin/v1/limits/api/daily?header.x-api-key=k",
            a.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(reset.status(), 200);
    support::wait_for(
        Duration::from_secs(1),
        "b admits after the reset",
        || async { hit(&b).await == 200 },
    )
    .await;
}
