//! The weighted sliding log (token budgets' store) through a real Redis and the in-process
//! store, with the same answers: a request is one entry however many units it costs, a
//! reservation settled to its use frees the rest at once and keeps its time, a rejection
//! waits exactly until the oldest entries that make room leave, and a cost above the limit
//! never fits.

use crate::support;

use std::time::Duration;

use sluice::limiter::{Algorithm, Check, RedisStore, Spec, Store};
use sluice::metrics::Metrics;
use support::Redis;

fn check(key: &str, cost: u32) -> Check {
    Check {
        key: key.to_owned(),
        spec: Spec {
            algorithm: Algorithm::WeightedLog,
            requests: 10_000,
            window: Duration::from_secs(60),
            cost,
            returnable: true,
            ..Spec::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_stores_weigh_requests_and_settle_them_alike() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    // Also the Redis store's lateness bound: the log counts an entry that much past its window.
    let timeout = Duration::from_secs(2);
    let store = RedisStore::new(&redis.url(), 1, timeout).expect("a store");
    store.load_script().await.expect("scripts load");
    for store in [
        Store::redis(store, 1000, &metrics),
        Store::local(1000, &metrics),
    ] {
        let name = store.name();
        let late = if name == "redis" {
            timeout
        } else {
            Duration::ZERO
        };
        let key = format!("sluice-test:weighted:{name}");
        let decide = |cost| {
            let store = &store;
            let check = check(&key, cost);
            async move { store.decide(std::slice::from_ref(&check)).await.unwrap() }
        };
        let first = decide(6_000).await;
        assert!(first.admitted, "{name}");
        assert_eq!(first.limits[0].unwrap().remaining, 4_000, "{name}");
        let second = decide(3_000).await;
        assert_eq!(second.limits[0].unwrap().remaining, 1_000, "{name}");
        // 2,000 more must wait for the first entry (6,000 units) to leave: about a minute.
        let refused = decide(2_000).await;
        assert!(!refused.admitted, "{name}");
        let wait = refused.retry_after.as_secs_f64() - late.as_secs_f64();
        assert!((58.0..=60.0).contains(&wait), "{name}: {wait} and {late:?}");
        // The first request used 500 of its 6,000: 5,500 come back at once.
        store
            .keep(
                &[check(&key, 6_000)],
                first.admission.as_ref().unwrap(),
                500,
            )
            .await
            .unwrap();
        let after = decide(2_000).await;
        assert!(after.admitted, "{name}");
        assert_eq!(after.limits[0].unwrap().remaining, 4_500, "{name}");
        // Whatever is free, a cost above the limit never fits, and says so with a whole window.
        let never = decide(10_001).await;
        assert!(!never.admitted, "{name}");
        assert_eq!(never.retry_after, Duration::from_secs(60), "{name}");
        if name == "redis" {
            // One entry per request, named with the units it holds now; the settled one kept
            // its score (the first request's time).
            let entries = format!(
                "{:?}",
                redis.cmd(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]).await
            );
            assert_eq!(entries.matches('#').count(), 3, "{entries}");
            let settled = format!("{}#500", first.admission.as_ref().unwrap().member);
            assert!(entries.contains(&settled), "{entries}");
            let ttl = format!("{:?}", redis.cmd(&["PTTL", &key]).await);
            let ttl: i64 = ttl
                .trim_start_matches("int(")
                .trim_end_matches(')')
                .parse()
                .unwrap_or(-1);
            assert!((61_000..=62_000).contains(&ttl), "{ttl}");
        }
    }
    assert_eq!(
        redis
            .assert_every_key_expires(Duration::from_secs(60) + timeout)
            .await,
        1
    );
}
