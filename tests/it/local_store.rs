//! The in-process store stays within `store.local.max_keys` under a flood of distinct
//! identities, counts what it evicts, and keeps limiting the identities it still tracks.

use crate::support;

use futures_util::StreamExt;
use support::{metric_sum, parse_metrics, Limit, Node, Policy, Route, Sluice};

const MAX_KEYS: usize = 1024;
const IDENTITIES: usize = 4000;

/// The in-process store bounded to `max_keys`; one request per `window` per `x-api-key`.
fn bounded(max_keys: usize, window: &str) -> Policy {
    let max_keys = u64::try_from(max_keys).expect("fits");
    Policy::new()
        .store_setting("local", Node::map([("max_keys", max_keys)]))
        .route(
            Route::new("api", "/")
                .respond(200, "ok")
                .limit(Limit::requests("per-key", 1, window).key(["header:x-api-key"])),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_identities_is_bounded_and_evictions_are_counted() {
    let _heavy = support::heavy().await;
    let sluice = Sluice::start(&bounded(MAX_KEYS, "1m")).await;
    let client = support::client();
    let url = format!("{}/", sluice.url());
    let statuses: Vec<u16> = futures_util::stream::iter(0..IDENTITIES)
        .map(|n| {
            let request = client.get(&url).header("x-api-key", format!("flood-{n}"));
            async move {
                request
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert!(
        statuses.iter().all(|&s| s == 200),
        "every new identity is admitted once"
    );

    let metrics = parse_metrics(&sluice.metrics().await);
    let keys = metric_sum(&metrics, "sluice_local_store_keys", &[]);
    let evictions = metric_sum(&metrics, "sluice_local_store_evictions_total", &[]);
    assert!(keys <= MAX_KEYS as f64, "{keys} keys tracked");
    assert!(keys >= (MAX_KEYS * 3 / 4) as f64, "{keys} keys tracked");
    assert_eq!(
        evictions + keys,
        IDENTITIES as f64,
        "every key that is not tracked was evicted and counted"
    );

    // The most recent identity is still tracked, so it is still limited.
    let last = client
        .get(&url)
        .header("x-api-key", format!("flood-{}", IDENTITIES - 1))
        .send()
        .await
        .unwrap();
    // buffer_unordered may finish the last few out of order; any of the last 32 was recent.
    let recent_limited = {
        let mut limited = u16::from(last.status() == 429);
        for n in IDENTITIES - 32..IDENTITIES - 1 {
            let r = client
                .get(&url)
                .header("x-api-key", format!("flood-{n}"))
                .send()
                .await
                .unwrap();
            limited += u16::from(r.status() == 429);
        }
        limited
    };
    assert_eq!(
        recent_limited, 32,
        "recently used identities stay tracked and limited"
    );
}

/// Sends one request per identity `prefix-0` .. `prefix-(count-1)`, 32 at a time; the
/// statuses, in no particular order.
async fn each_once(sluice: &Sluice, prefix: &str, count: usize) -> Vec<u16> {
    let client = support::client();
    let url = format!("{}/", sluice.url());
    futures_util::stream::iter(0..count)
        .map(|n| {
            let request = client
                .get(&url)
                .header("x-api-key", format!("{prefix}-{n}"));
            async move {
                request
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }
        })
        .buffer_unordered(32)
        .collect()
        .await
}

/// `max_keys` is a bound over the whole store (issue 27): with exactly `max_keys` live
/// identities, each having spent its limit, none is admitted afresh and nothing is evicted,
/// at several sizes; each identity past the bound evicts exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_keys_live_identities_are_all_kept() {
    let _heavy = support::heavy().await;
    // 1024 is the least `max_keys` the config accepts.
    for max_keys in [1024, 4096, 10_000] {
        let sluice = Sluice::start(&bounded(max_keys, "5m")).await;
        let first = each_once(&sluice, "live", max_keys).await;
        assert!(
            first.iter().all(|&s| s == 200),
            "{max_keys}: first requests"
        );
        let again = each_once(&sluice, "live", max_keys).await;
        let admitted = again.iter().filter(|&&s| s == 200).count();
        assert_eq!(
            admitted, 0,
            "max_keys {max_keys}: {admitted} identities that had spent their limit were admitted afresh"
        );
        assert!(again.iter().all(|&s| s == 429), "{max_keys}");
        let metrics = parse_metrics(&sluice.metrics().await);
        assert_eq!(
            metric_sum(&metrics, "sluice_local_store_evictions_total", &[]),
            0.0,
            "max_keys {max_keys}: an eviction before the bound"
        );
        assert_eq!(
            metric_sum(&metrics, "sluice_local_store_keys", &[]),
            max_keys as f64
        );
        // Past the bound: each new identity evicts exactly one, and the count stays.
        let past = each_once(&sluice, "past", 3).await;
        assert_eq!(past, [200, 200, 200]);
        let metrics = parse_metrics(&sluice.metrics().await);
        assert_eq!(
            metric_sum(&metrics, "sluice_local_store_evictions_total", &[]),
            3.0,
            "max_keys {max_keys}"
        );
        assert_eq!(
            metric_sum(&metrics, "sluice_local_store_keys", &[]),
            max_keys as f64
        );
    }
}
