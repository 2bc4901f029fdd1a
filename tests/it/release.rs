//! The release primitive (`Store::release`) through a real Redis and through the in-process
//! store: for every algorithm, an admitted request given back leaves the limit as if it had
//! never been admitted (the stored state in Redis is compared value for value), a subset of a
//! request's checks can be given back alone, and a denial this instance cached is forgotten
//! when a release makes room.

use crate::support;

use std::time::Duration;

use sluice::limiter::{Algorithm, Check, RedisStore, Spec, Store};
use sluice::metrics::Metrics;
use support::Redis;

const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::SlidingLog,
    Algorithm::WeightedLog,
    Algorithm::SlidingWindow,
    Algorithm::FixedWindow,
    Algorithm::Gcra,
];

fn check(key: &str, algorithm: Algorithm, requests: u32, cost: u32) -> Check {
    Check {
        key: key.to_owned(),
        spec: Spec {
            algorithm,
            requests,
            cost,
            window: Duration::from_secs(60),
            burst: requests,
            ..Spec::default()
        },
    }
}

async fn redis_store(redis: &Redis, metrics: &Metrics) -> Store {
    let store = RedisStore::new(&redis.url(), 1, Duration::from_secs(2)).expect("a store");
    store.load_script().await.expect("scripts load");
    let store = Store::redis(store, 1000, metrics);
    // Denials are remembered only once the store's event channel is heard (so a reset
    // elsewhere can end them): wait for it, or a test of the deny cache races the subscribe.
    let subscribed = metrics
        .store
        .store_events
        .with_label_values(&["subscribed"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while subscribed.get() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "never subscribed to the store's events"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    store
}

/// The key's stored value, whatever its type, without its expiry.
async fn stored(redis: &Redis, key: &str) -> String {
    let kind = format!("{:?}", redis.cmd(&["TYPE", key]).await);
    let value = if kind.contains("zset") {
        redis.cmd(&["ZRANGE", key, "0", "-1", "WITHSCORES"]).await
    } else if kind.contains("hash") {
        redis.cmd(&["HGETALL", key]).await
    } else {
        redis.cmd(&["GET", key]).await
    };
    format!("{kind} {value:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_request_leaves_redis_as_if_never_admitted() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = redis_store(&redis, &metrics).await;
    for algorithm in ALGORITHMS {
        let key = format!("sluice-test:release:{}", algorithm.label());
        let first = check(&key, algorithm, 5, 1);
        assert!(
            store
                .decide(std::slice::from_ref(&first))
                .await
                .unwrap()
                .admitted
        );
        let before = stored(&redis, &key).await;
        let second = check(&key, algorithm, 5, 2);
        let decision = store.decide(std::slice::from_ref(&second)).await.unwrap();
        assert!(decision.admitted, "{algorithm:?}");
        let admission = decision.admission.expect("an admission");
        assert_ne!(stored(&redis, &key).await, before, "{algorithm:?} recorded");
        store
            .release(std::slice::from_ref(&second), &admission)
            .await
            .unwrap();
        assert_eq!(stored(&redis, &key).await, before, "{algorithm:?}");
        // And the limit answers as before: four more of cost 1 fit.
        let remaining = store.decide(&[first]).await.unwrap().limits[0]
            .unwrap()
            .remaining;
        assert_eq!(remaining, 3, "{algorithm:?}");
    }
    assert!(
        redis
            .assert_every_key_expires(Duration::from_secs(120))
            .await
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_gives_back_only_the_checks_it_names() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    for store in [
        redis_store(&redis, &metrics).await,
        Store::local(1000, &metrics),
    ] {
        for algorithm in ALGORITHMS {
            let kept = check(
                &format!("{}:kept:{algorithm:?}", store.name()),
                algorithm,
                2,
                1,
            );
            let given = check(
                &format!("{}:given:{algorithm:?}", store.name()),
                algorithm,
                2,
                1,
            );
            let both = [kept.clone(), given.clone()];
            let d = store.decide(&both).await.unwrap();
            store
                .release(std::slice::from_ref(&given), &d.admission.unwrap())
                .await
                .unwrap();
            let d = store.decide(&both).await.unwrap();
            assert!(d.admitted);
            let remaining: Vec<u32> = d.limits.iter().map(|s| s.unwrap().remaining).collect();
            assert_eq!(remaining, [0, 1], "{} {algorithm:?}", store.name());
        }
    }
    assert!(
        redis
            .assert_every_key_expires(Duration::from_secs(120))
            .await
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_forgets_the_denial_this_instance_cached() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = redis_store(&redis, &metrics).await;
    let one = [check(
        "sluice-test:release:denied",
        Algorithm::SlidingLog,
        1,
        1,
    )];
    let admitted = store.decide(&one).await.unwrap();
    assert!(!store.decide(&one).await.unwrap().admitted);
    let cached = metrics.store.deny_cache_answers.get();
    assert!(!store.decide(&one).await.unwrap().admitted);
    assert_eq!(
        metrics.store.deny_cache_answers.get(),
        cached + 1,
        "the denial is cached"
    );
    store
        .release(&one, &admitted.admission.unwrap())
        .await
        .unwrap();
    assert!(
        store.decide(&one).await.unwrap().admitted,
        "the release made room; a cached denial would refuse"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returnable_limit_is_never_answered_from_the_cache() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = redis_store(&redis, &metrics).await;
    let mut login = check("sluice-test:release:login", Algorithm::SlidingLog, 1, 1);
    login.spec.returnable = true;
    let one = [login];
    let admitted = store.decide(&one).await.unwrap();
    for _ in 0..3 {
        assert!(!store.decide(&one).await.unwrap().admitted);
    }
    assert_eq!(metrics.store.deny_cache_answers.get(), 0);
    // Given back by another instance (another store on the same Redis): admitted at once.
    let other = redis_store(&redis, &Metrics::new().unwrap()).await;
    other
        .release(&one, &admitted.admission.unwrap())
        .await
        .unwrap();
    assert!(store.decide(&one).await.unwrap().admitted);
}

/// When Redis cannot decide and a route decides locally, the admission is the in-process
/// store's: it is given back there, not to Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_fallback_admission_is_given_back_locally() {
    let metrics = Metrics::new().unwrap();
    let url = format!("redis://127.0.0.1:{}/0", support::closed_port());
    let store = Store::redis(
        RedisStore::new(&url, 1, Duration::from_millis(200)).expect("a store"),
        1000,
        &metrics,
    );
    let one = [check(
        "sluice-test:release:local",
        Algorithm::SlidingLog,
        1,
        1,
    )];
    assert!(store.decide(&one).await.is_err(), "no Redis there");
    let admitted = store.decide_locally(&one);
    let admission = admitted.admission.expect("admitted locally");
    assert!(admission.local);
    assert!(!store.decide_locally(&one).admitted);
    store
        .release(&one, &admission)
        .await
        .expect("no Redis call");
    assert!(store.decide_locally(&one).admitted);
}

/// `Store::keep`: a reservation of 10 settled to 3 used leaves every algorithm where an
/// admission of cost 3 would (in Redis, the sliding log's entries are the request's first
/// three, the others' values the same); settling to the whole cost gives nothing back, and
/// to more charges the excess where a token budget can run. Both stores; every Redis key
/// still expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_reservation_stands_as_an_admission_of_what_it_used() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    for store in [
        redis_store(&redis, &metrics).await,
        Store::local(1000, &metrics),
    ] {
        for algorithm in ALGORITHMS.into_iter().chain([Algorithm::Calendar]) {
            let key = format!("sluice-test:settle:{}:{}", store.name(), algorithm.label());
            let reserved = check(&key, algorithm, 20, 10);
            let decision = store.decide(std::slice::from_ref(&reserved)).await.unwrap();
            let admission = decision.admission.expect("admitted");
            store
                .keep(std::slice::from_ref(&reserved), &admission, 3)
                .await
                .unwrap();
            let probe = check(&key, algorithm, 20, 1);
            let remaining = store
                .decide(std::slice::from_ref(&probe))
                .await
                .unwrap()
                .limits[0]
                .unwrap()
                .remaining;
            // 20 - 3 used - 1 probe.
            assert_eq!(remaining, 16, "{} {algorithm:?}", store.name());
            if store.name() == "redis" && algorithm == Algorithm::SlidingLog {
                let members = format!("{:?}", redis.cmd(&["ZRANGE", &key, "0", "-1"]).await);
                let ours = |j: u32| format!("{}:{j}\"", admission.member);
                assert!((1..=3).all(|j| members.contains(&ours(j))), "{members}");
                assert!(!members.contains(&ours(4)), "{members}");
            }

            // Used as much as reserved: nothing comes back. Then one more than reserved: the
            // overrun is charged by the algorithms a token budget runs on, ignored by the
            // others.
            let key = format!("{key}:full");
            let reserved = check(&key, algorithm, 20, 10);
            let admission = store
                .decide(std::slice::from_ref(&reserved))
                .await
                .unwrap()
                .admission
                .expect("admitted");
            for used in [10, 11] {
                store
                    .keep(std::slice::from_ref(&reserved), &admission, used)
                    .await
                    .unwrap();
            }
            let probe = check(&key, algorithm, 20, 1);
            let remaining = store
                .decide(std::slice::from_ref(&probe))
                .await
                .unwrap()
                .limits[0]
                .unwrap()
                .remaining;
            let charged = u32::from(algorithm.traits().settles_exactly);
            assert_eq!(
                remaining,
                9 - charged,
                "{} {algorithm:?} full",
                store.name()
            );
        }
    }
    assert!(
        redis
            .assert_every_key_expires(Duration::from_secs(120))
            .await
            > 0
    );
}

/// Every row of the algorithm table is reachable through every script entry point, in a real
/// Redis: decided (decide.lua), read (peek.lua: one counted), given back (release.lua: one
/// check held something) and read again (nothing counted). A row whose Lua functions the
/// generated dispatchers do not reach fails here with Redis's "unknown algorithm".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_of_the_table_is_reachable_in_every_script() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = redis_store(&redis, &metrics).await;
    for traits in sluice::limiter::ALGORITHMS {
        let algorithm = traits.algorithm;
        let key = format!("sluice-test:table:{}:{{id}}", traits.label);
        let one = check(&key, algorithm, 5, 1);
        let decision = store.decide(std::slice::from_ref(&one)).await.unwrap();
        assert!(decision.admitted, "{algorithm:?}");
        let (peek, answered) = store.peek(&one).await.unwrap();
        assert_eq!(
            (peek.count, answered),
            (1, "redis"),
            "{algorithm:?} counted one"
        );
        let admission = decision.admission.expect("an admission");
        let held = store
            .release(std::slice::from_ref(&one), &admission)
            .await
            .unwrap();
        assert_eq!(held, 1, "{algorithm:?} gave it back");
        let (peek, _) = store.peek(&one).await.unwrap();
        assert_eq!(peek.count, 0, "{algorithm:?} counts nothing after");
    }
    redis
        .assert_every_key_expires(Duration::from_secs(120))
        .await;
}
