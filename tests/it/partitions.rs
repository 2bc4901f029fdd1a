//! Redis across a real network link (`support::netns`: its own network namespace behind a
//! veth pair), cut silently by `iptables` DROP: no RST, no FIN, the kind of partition a
//! security group change or a vanished host makes. Judged from outside: a route that refuses
//! without the store (`on_store_error: deny`) answers 200 only when Redis decided.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::netns::NetRedis;
use support::{Limit, OnStoreError, Policy, Route, Sluice, Upstream, UpstreamSpec};

/// A route on Redis across `net` that refuses without it (`on_store_error: deny`), with a
/// limit no test reaches: a 200 is a decision Redis made. The default 50 ms store timeout.
fn deny_route(net: &NetRedis, up: &Upstream) -> Policy {
    deny_route_with(net, up, "50ms", Limit::requests("per-key", 1_000_000, "1m"))
}

/// The same with this store timeout and limit (keyed on `x-api-key`).
fn deny_route_with(net: &NetRedis, up: &Upstream, timeout: &str, limit: Limit) -> Policy {
    Policy::new()
        .store_redis_url(&net.url())
        .redis_setting("timeout", timeout)
        .redis_setting("pool_size", 4u32)
        .upstream("api", UpstreamSpec::new(&up.url()))
        .route(
            Route::new("default", "/")
                .upstream("api")
                .on_store_error(OnStoreError::Deny)
                .limit(limit.key(["header:x-api-key"])),
        )
}

/// After a silent partition of 8 s, decisions are in Redis again within 2 s of the heal,
/// and `/readyz` says ready within 2 s too: the connections caught with unacknowledged data
/// are given up within a second (TCP_USER_TIMEOUT) and replaced, instead of waiting for the
/// kernel's next retransmission (6 s and more after an 8 s partition without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_return_to_redis_within_2s_of_a_partition_healing() {
    back_in_redis_after(NetRedis::partition, Duration::from_secs(8)).await;
}

/// The same after 30 s: the kernel's retransmission backoff would by then wait 25 s more
/// (the measure before connections were given up); recovery does not grow with the
/// partition's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_return_to_redis_within_2s_of_a_30s_partition_healing() {
    back_in_redis_after(NetRedis::partition, Duration::from_secs(30)).await;
}

/// A half-open link for 8 s: Redis receives and runs every call but its answers are dropped
/// (its side's OUTPUT only). The same: no request hangs, only 503 meanwhile, back in Redis
/// within 2 s of the heal, the breaker steady after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_return_to_redis_within_2s_of_a_half_open_link_healing() {
    back_in_redis_after(NetRedis::drop_answers, Duration::from_secs(8)).await;
}

/// Steady traffic on a `deny` route, the link cut by `cut` for `length`, then healed.
async fn back_in_redis_after(cut: fn(&NetRedis), length: Duration) {
    let _heavy = support::heavy().await;
    let net = NetRedis::start().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&deny_route(&net, &up)).await;
    sluice.expect_store_faults();
    let client = support::client();
    let url = format!("{}/x", sluice.url());
    // Steady traffic from several clients, so every connection has calls in flight when the
    // link is cut.
    let seen: Arc<Mutex<Vec<(Instant, u16)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slowest: Arc<Mutex<Duration>> = Arc::default();
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let (client, url, seen, stop, slowest) = (
                client.clone(),
                url.clone(),
                Arc::clone(&seen),
                Arc::clone(&stop),
                Arc::clone(&slowest),
            );
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let asked = Instant::now();
                    let sent = client
                        .get(&url)
                        .header("x-api-key", format!("k{i}"))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await;
                    let response = sent.expect("an answer within 5 s: no request hangs");
                    let took = asked.elapsed();
                    {
                        let mut slowest = slowest.lock().unwrap();
                        *slowest = (*slowest).max(took);
                    }
                    seen.lock()
                        .unwrap()
                        .push((Instant::now(), response.status().as_u16()));
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
    cut(&net);
    let cut = Instant::now();
    tokio::time::sleep(length).await;
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
    let opened = |text: &str| {
        support::metric_sum(
            &support::parse_metrics(text),
            "sluice_store_breaker_transitions_total",
            &[("to", "open")],
        )
    };
    let opened_before_heal = opened(&sluice.metrics().await);
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
    // Two more seconds of traffic: the breaker, closed again, stays closed (it does not flap
    // while some connections recover before others).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let opened_after_heal = opened(&sluice.metrics().await) - opened_before_heal;
    let failed_late = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|&&(at, s)| at > healed + Duration::from_secs(2) && s != 200)
        .count();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in clients {
        task.await.unwrap();
    }
    eprintln!("after the heal: decided in Redis {decided_after:?}, ready {ready_after:?}, breaker opened {opened_after_heal} times, {failed_late} refused after 2 s");
    assert_eq!(
        opened_after_heal, 0.0,
        "the breaker did not open again after the heal"
    );
    let slowest = *slowest.lock().unwrap();
    assert!(
        slowest < Duration::from_millis(1500),
        "no request waited long: the slowest took {slowest:?}"
    );
    assert_eq!(
        failed_late, 0,
        "every request from 2 s after the heal decided in Redis"
    );
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
/// (`scripts/tunrelay.py`: 0.5 ms each way and its own wake-ups), a `deny` route with the
/// default 50 ms store timeout: most requests are still answered from Redis. A lost segment
/// that Linux recovers only after 200 ms times out every call multiplexed behind it, all at
/// one instant; the breaker does not take that burst for a store that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deny_route_answers_from_redis_under_one_percent_loss() {
    let _heavy = support::heavy().await;
    let net = NetRedis::start_relayed(0.5, 0.01).await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&deny_route(&net, &up)).await;
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
    // Measured 95.6-95.9 % on a quiet machine, 83 % beside the rest of the suite (the relay,
    // a Python process, starved of CPU: longer stalls, and the breaker opened once); 26-44 %
    // on a quiet machine when a burst of timeouts from one stalled connection opened the
    // breaker. The bound is generous for a loaded machine and still fails that.
    assert!(
        share >= 0.75,
        "{:.1} % answered from Redis under 1 % loss",
        100.0 * share
    );
}

/// What the upstream receives stays within the limit under 1 % loss, judged from its own
/// record: 60 per 1 s (a sliding log), hammered on one key through the lossy link with a
/// 300 ms store timeout, so that an admission's answer held ~200 ms by a retransmission still
/// arrives in time. Redis decides exactly, but the late admission reaches the upstream after
/// the admission that took its place a window later; unless the log counts every admission
/// the lateness bound (the store timeout) past its window, some second of the upstream's
/// record holds more than 60.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_upstream_receives_no_more_than_the_limit_under_one_percent_loss() {
    const LIMIT: usize = 60;
    const WINDOW: Duration = Duration::from_secs(1);
    let _heavy = support::heavy().await;
    let net = NetRedis::start_relayed(0.5, 0.01).await;
    let up = Upstream::start().await;
    let limit = Limit::requests("per-key", LIMIT as u32, "1s");
    let sluice = Sluice::start(&deny_route_with(&net, &up, "300ms", limit)).await;
    sluice.expect_store_faults();
    let client = support::client();
    let url = format!("{}/x", sluice.url());
    let start = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut admitted = 0u32;
                while start.elapsed() < Duration::from_secs(12) {
                    let response = client
                        .get(&url)
                        .header("x-api-key", "one")
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await
                        .expect("an answer");
                    match response.status().as_u16() {
                        200 => admitted += 1,
                        // Refused, or the store's answer came too late (a store error): a
                        // short pause keeps the flood from starving the relay of CPU.
                        429 | 503 => tokio::time::sleep(Duration::from_millis(5)).await,
                        other => panic!("unexpected {other}"),
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), admitted as usize);
    // The tightest span of LIMIT + 1 consecutive arrivals: at least a window, less 50 ms for
    // the time between sluice's forwarding and the upstream's reading on a loaded machine.
    let tightest = arrivals
        .windows(LIMIT + 1)
        .map(|w| w[LIMIT] - w[0])
        .min()
        .expect("more than the limit arrived");
    eprintln!(
        "under 1 % loss: {admitted} admitted in 12 s; the tightest {} arrivals span {tightest:?}",
        LIMIT + 1
    );
    assert!(
        tightest + Duration::from_millis(50) >= WINDOW,
        "{} requests reached the upstream within {tightest:?}, over {LIMIT} per {WINDOW:?}",
        LIMIT + 1
    );
    // The limit was used: about LIMIT per window and the lateness bound (1.3 s).
    assert!(
        admitted as usize >= LIMIT * 12 / 2,
        "only {admitted} admitted in 12 s"
    );
}
