//! Redis across a real network link (`support::netns`: its own network namespace behind a
//! veth pair), cut silently by `iptables` DROP: no RST, no FIN, the kind of partition a
//! security group change or a vanished host makes. Judged from outside: a route that refuses
//! without the store (`on_store_error: deny`) answers 200 only when Redis decided.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::netns::NetRedis;
use support::{Limit, OnStoreError, Policy, Route, Sluice, Upstream, UpstreamSpec};

/// After a silent partition of 8 s, decisions are in Redis again within 2 s of the heal,
/// and `/readyz` says ready within 2 s too: the connections caught with unacknowledged data
/// are given up within a second (TCP_USER_TIMEOUT) and replaced, instead of waiting for the
/// kernel's next retransmission (6 s and more after an 8 s partition without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_return_to_redis_within_2s_of_a_partition_healing() {
    let _heavy = support::heavy().await;
    let net = NetRedis::start().await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis_url(&net.url())
        .redis_setting("timeout", "50ms")
        .redis_setting("pool_size", 4u32)
        .upstream("api", UpstreamSpec::new(&up.url()))
        .route(
            Route::new("default", "/")
                .upstream("api")
                .on_store_error(OnStoreError::Deny)
                .limit(Limit::requests("per-key", 1_000_000, "1m").key(["header:x-api-key"])),
        );
    let sluice = Sluice::start(&yaml).await;
    sluice.expect_store_faults();
    let client = support::client();
    let url = format!("{}/x", sluice.url());
    // Steady traffic from several clients, so every connection has calls in flight when the
    // link is cut.
    let seen: Arc<Mutex<Vec<(Instant, u16)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let (client, url, seen, stop) = (
                client.clone(),
                url.clone(),
                Arc::clone(&seen),
                Arc::clone(&stop),
            );
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let sent = client
                        .get(&url)
                        .header("x-api-key", format!("k{i}"))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await;
                    if let Ok(response) = sent {
                        seen.lock()
                            .unwrap()
                            .push((Instant::now(), response.status().as_u16()));
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        seen.lock().unwrap().iter().any(|&(_, s)| s == 200),
        "decided in Redis before the partition"
    );
    net.partition();
    let cut = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    {
        let during = seen.lock().unwrap();
        let late = during
            .iter()
            .filter(|&&(at, _)| at > cut + Duration::from_millis(500))
            .collect::<Vec<_>>();
        assert!(
            !late.is_empty(),
            "requests were answered during the partition"
        );
        assert!(
            late.iter().all(|&&(_, s)| s == 503),
            "only 503 while Redis is cut off (deny)"
        );
    }
    net.heal();
    let healed = Instant::now();
    let readyz = format!("{}/readyz", sluice.admin_url());
    let mut ready_after = None;
    let mut decided_after = None;
    while healed.elapsed() < Duration::from_secs(10)
        && (ready_after.is_none() || decided_after.is_none())
    {
        if ready_after.is_none() {
            if let Ok(r) = client
                .get(&readyz)
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                if r.status() == 200 {
                    ready_after = Some(healed.elapsed());
                }
            }
        }
        if decided_after.is_none() {
            let decided = seen
                .lock()
                .unwrap()
                .iter()
                .any(|&(at, s)| at > healed && s == 200);
            if decided {
                decided_after = Some(healed.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in clients {
        task.await.unwrap();
    }
    eprintln!("after the heal: decided in Redis {decided_after:?}, ready {ready_after:?}");
    let decided_after = decided_after.expect("decided in Redis again within 10 s");
    let ready_after = ready_after.expect("ready again within 10 s");
    assert!(
        decided_after <= Duration::from_secs(2),
        "back in Redis {decided_after:?} after the heal"
    );
    assert!(
        ready_after <= Duration::from_secs(2),
        "/readyz ready {ready_after:?} after the heal"
    );
}

/// 1 % of packets lost each way between sluice and Redis on a link of about 2.3 ms round trip
/// (`scripts/tunrelay.py`: 0.5 ms each way and its own wake-ups): a route that refuses without
/// the store (`on_store_error: deny`, the default 50 ms store timeout) still answers at least
/// 95 % of its requests from Redis. (Measured: 100 % at 1 %, 99.9 % at 3 %, 99.7 % at 5 %; a
/// 20 % loss, seeded once, fails it with 1.6 %.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deny_route_answers_from_redis_under_one_percent_loss() {
    let _heavy = support::heavy().await;
    let net = NetRedis::start_relayed(0.5, 0.01).await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis_url(&net.url())
        .upstream("api", UpstreamSpec::new(&up.url()))
        .route(
            Route::new("default", "/")
                .upstream("api")
                .on_store_error(OnStoreError::Deny)
                .limit(Limit::requests("per-key", 1_000_000, "1m").key(["header:x-api-key"])),
        );
    let sluice = Sluice::start(&yaml).await;
    sluice.expect_store_faults();
    let client = support::client();
    let url = format!("{}/x", sluice.url());
    let start = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, 0u32);
                while start.elapsed() < Duration::from_secs(10) {
                    let response = client
                        .get(&url)
                        .header("x-api-key", format!("k{i}"))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await
                        .expect("an answer");
                    match response.status().as_u16() {
                        200 => ok += 1,
                        503 => failed += 1,
                        other => panic!("unexpected {other}"),
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for task in tasks {
        let (o, f) = task.await.unwrap();
        ok += o;
        failed += f;
    }
    let share = f64::from(ok) / f64::from(ok + failed);
    eprintln!(
        "under 1 % loss: {ok} answered from Redis, {failed} 503 ({:.1} %)",
        100.0 * share
    );
    let metrics = sluice.metrics().await;
    for line in metrics.lines().filter(|l| {
        l.starts_with("sluice_store_errors_total") || l.starts_with("sluice_store_breaker")
    }) {
        eprintln!("{line}");
    }
    assert!(
        ok + failed > 1000,
        "traffic flowed ({} answers)",
        ok + failed
    );
    assert!(
        share >= 0.95,
        "{:.1} % answered from Redis under 1 % loss",
        100.0 * share
    );
}
