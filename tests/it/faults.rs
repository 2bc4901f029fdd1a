//! The fault suite: real Redis, upstreams and sluice processes broken on purpose under load,
//! each test asserting what clients saw.

use crate::support;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{
    metric_sum, parse_metrics, Limit, OnStoreError, Policy, Redis, Route, Sluice, Upstream,
    UpstreamSpec,
};

const TIMEOUT_MS: u64 = 300;

fn three_routes(redis: &Redis, upstream: &Upstream) -> Policy {
    let route = |name: &str, action: OnStoreError| {
        Route::new(name, &format!("/{name}"))
            .upstream("api")
            .on_store_error(action)
            .limit(Limit::requests("per-key", 5, "30s").key(["header:x-api-key"]))
    };
    Policy::new()
        .store_redis_defaults(redis)
        .redis_setting("timeout", format!("{TIMEOUT_MS}ms"))
        .upstream("api", upstream.url())
        .route(route("local", OnStoreError::Local))
        .route(route("allow", OnStoreError::Allow))
        .route(route("deny", OnStoreError::Deny))
}

/// Statuses seen per route, and whether every 503 carried Retry-After.
#[derive(Default)]
struct Seen {
    statuses: BTreeMap<String, Vec<u16>>,
    /// Could not connect (after a listener closed, say): never in flight.
    not_connected: usize,
    /// Connected but got no answer, and when.
    unanswered: Vec<Instant>,
    retry_after_missing: usize,
}

impl Seen {
    /// `Ok((status, has Retry-After))`, or `Err(could not connect)`.
    fn record(&mut self, route: &str, outcome: Result<(u16, bool), bool>) {
        match outcome {
            Ok((status, retry_after)) => {
                if status == 503 && !retry_after {
                    self.retry_after_missing += 1;
                }
                self.statuses
                    .entry(route.to_owned())
                    .or_default()
                    .push(status);
            }
            Err(true) => self.not_connected += 1,
            Err(false) => self.unanswered.push(Instant::now()),
        }
    }
}

/// Clients sending requests to each of `routes` with fresh keys until `stop` is set.
fn steady_load(
    sluice: &Sluice,
    routes: &'static [&'static str],
    stop: Arc<AtomicBool>,
) -> (Vec<tokio::task::JoinHandle<()>>, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let client = support::client();
    let tasks = (0..4)
        .map(|worker| {
            let (client, seen, stop) = (client.clone(), Arc::clone(&seen), Arc::clone(&stop));
            let base = sluice.url();
            tokio::spawn(async move {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) && n < 20_000 {
                    let route = routes[n % routes.len()];
                    let sent = client
                        .get(format!("{base}/{route}"))
                        .header("x-api-key", format!("steady-{worker}-{n}"))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await;
                    let status = match sent {
                        Ok(response) => Ok((
                            response.status().as_u16(),
                            response.headers().contains_key("retry-after"),
                        )),
                        Err(err) => Err(err.is_connect()),
                    };
                    seen.lock().unwrap().record(route, status);
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect();
    (tasks, seen)
}

async fn statuses(sluice: &Sluice, route: &str, key: &str, count: usize) -> Vec<u16> {
    let client = support::client();
    let mut out = Vec::new();
    for _ in 0..count {
        let response = client
            .get(format!("{}/{route}", sluice.url()))
            .header("x-api-key", key)
            .send()
            .await
            .unwrap();
        out.push(response.status().as_u16());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_killed_under_load_local_and_allow_keep_serving_then_redis_decides_again() {
    let _heavy = support::heavy().await;
    let mut redis = Redis::start().await;
    let upstream = Upstream::start().await;
    let sluice = Sluice::start(&three_routes(&redis, &upstream)).await;
    sluice.expect_store_faults();
    let stop = Arc::new(AtomicBool::new(false));
    let (tasks, seen) = steady_load(&sluice, &["local", "allow", "deny"], Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(700)).await;

    redis.stop();
    // The breaker opens after the failures the load meets.
    support::wait_for(
        Duration::from_secs(10),
        "the store's breaker to open",
        || async {
            let metrics = parse_metrics(&sluice.metrics().await);
            metric_sum(&metrics, "sluice_store_fallback_active", &[]) == 1.0
        },
    )
    .await;
    // During the outage: `local` still limits, on this instance's own count; `allow` admits.
    let local = statuses(&sluice, "local", "outage-key", 8).await;
    assert_eq!(
        local,
        [200, 200, 200, 200, 200, 429, 429, 429],
        "local limits"
    );
    let allow = statuses(&sluice, "allow", "outage-key", 8).await;
    assert_eq!(allow, [200; 8], "allow admits");
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "sluice_store_fallback_active", &[]),
        1.0
    );

    redis.restart().await;
    let back = Instant::now();
    // Decisions return to Redis: the new Redis's own counter shows the calls.
    loop {
        if redis.commandstat("evalsha").await > 0 {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(2),
            "no decision reached Redis within 2 s of its return"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "decisions back in Redis {:?} after it returned",
        back.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!((seen.unanswered.len(), seen.not_connected), (0, 0));
    for route in ["local", "allow"] {
        let statuses = &seen.statuses[route];
        let failed = statuses.iter().filter(|s| **s >= 500).count();
        assert_eq!(failed, 0, "{route}: {failed} of {} failed", statuses.len());
    }
    let deny = &seen.statuses["deny"];
    let refused = deny.iter().filter(|s| **s == 503).count();
    assert!(refused > 0, "deny answered 503 while Redis was down");
    assert!(deny.iter().all(|s| *s == 200 || *s == 503), "{deny:?}");
    assert_eq!(seen.retry_after_missing, 0, "every 503 carries Retry-After");

    let metrics = parse_metrics(&sluice.metrics().await);
    let metric = |name: &str, labels: &[(&str, &str)]| metric_sum(&metrics, name, labels);
    assert_eq!(metric("sluice_store_fallback_active", &[]), 0.0);
    assert_eq!(
        metric("sluice_store_breaker_transitions_total", &[("to", "open")]),
        1.0
    );
    assert_eq!(
        metric(
            "sluice_store_breaker_transitions_total",
            &[("to", "closed")]
        ),
        1.0
    );
    for (route, action) in [("local", "local"), ("allow", "allow"), ("deny", "deny")] {
        let fallbacks = metric(
            "sluice_store_fallback_decisions_total",
            &[("route", route), ("action", action)],
        );
        assert!(fallbacks >= 1.0, "{route}: {fallbacks} fallback decisions");
    }
    assert_eq!(
        metric(
            "sluice_store_fallback_decisions_total",
            &[("route", "deny")]
        ),
        refused as f64,
        "every 503 on deny is a counted fallback"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_costs_a_few_requests_the_timeout_then_none() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let upstream = Upstream::start().await;
    let sluice = Sluice::start(&three_routes(&redis, &upstream)).await;
    sluice.expect_store_faults();
    assert_eq!(statuses(&sluice, "local", "warm", 1).await, [200]);
    redis.cmd(&["CLIENT", "PAUSE", "5000", "ALL"]).await;

    let client = support::client();
    let mut waits = Vec::new();
    for n in 0..20 {
        let started = Instant::now();
        let response = client
            .get(format!("{}/local", sluice.url()))
            .header("x-api-key", format!("hung-{n}"))
            .send()
            .await
            .unwrap();
        waits.push(started.elapsed());
        assert_eq!(response.status(), 200, "local decides while Redis hangs");
    }
    println!("waits: {waits:?}");
    let bound = Duration::from_millis(TIMEOUT_MS + 300);
    assert!(waits.iter().all(|w| *w < bound), "{waits:?}");
    // The breaker opens after 5 failures; from then on no request waits for Redis.
    for wait in &waits[6..] {
        assert!(*wait < Duration::from_millis(100), "{waits:?}");
    }
}

/// A `python3 -m http.server` upstream: a separate process, so killing it closes every
/// connection sluice has pooled to it.
fn python_upstream(port: u16, dir: &std::path::Path) -> Child {
    Command::new("python3")
        .args([
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 is needed for this test (apt-get install python3)")
}

async fn wait_for_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_upstream_gives_fast_502s_and_is_used_again_when_it_returns() {
    let _heavy = support::heavy().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.html"), "up").unwrap();
    let port = support::free_port();
    let mut upstream = python_upstream(port, dir.path());
    wait_for_port(port).await;
    let policy = Policy::new()
        .upstream(
            "api",
            UpstreamSpec::new(&format!("http://127.0.0.1:{port}"))
                .connect_timeout("2s")
                .timeout("5s"),
        )
        .route(Route::new("all", "/").upstream("api"));
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    let get = || client.get(format!("{}/", sluice.url())).send();
    assert_eq!(get().await.unwrap().status(), 200);

    upstream.kill().unwrap();
    upstream.wait().unwrap();
    for _ in 0..5 {
        let started = Instant::now();
        let response = get().await.unwrap();
        assert_eq!(response.status(), 502);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
    }

    let mut upstream = python_upstream(port, dir.path());
    wait_for_port(port).await;
    let back = Instant::now();
    loop {
        if get().await.unwrap().status() == 200 {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(3),
            "still failing after the upstream returned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    upstream.kill().unwrap();
    let _ = upstream.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_load_fails_nothing_in_flight_and_readyz_goes_first() {
    let _heavy = support::heavy().await;
    let upstream = Upstream::start().await;
    let policy = Policy::new()
        .server("shutdown_delay", "1s")
        .server("shutdown_grace", "10s")
        .upstream("api", upstream.url())
        .route(Route::new("all", "/").upstream("api"));
    let mut sluice = Sluice::start(&policy).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (tasks, seen) = steady_load(&sluice, &["fast"], Arc::clone(&stop));
    let slow = {
        let url = format!("{}/slow/1800", sluice.url());
        tokio::spawn(async move { support::client().get(url).send().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let signalled = Instant::now();
    sluice.terminate();
    let readyz = format!("{}/readyz", sluice.admin_url());
    let probe = support::client();
    let mut unready_at = None;
    let mut refused_at = None;
    while refused_at.is_none() && signalled.elapsed() < Duration::from_secs(5) {
        if unready_at.is_none() {
            if let Ok(r) = probe.get(&readyz).send().await {
                if r.status() == 503 {
                    unready_at = Some(signalled.elapsed());
                }
            }
        }
        if tokio::net::TcpStream::connect(sluice.addr()).await.is_err() {
            refused_at = Some(signalled.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let unready_at = unready_at.expect("/readyz never answered 503");
    let refused_at = refused_at.expect("the listener never closed");
    println!("unready after {unready_at:?}, listener closed after {refused_at:?}");
    assert!(unready_at < Duration::from_millis(300), "{unready_at:?}");
    assert!(
        refused_at >= Duration::from_millis(900),
        "closed before the delay: {refused_at:?}"
    );
    assert!(unready_at < refused_at);

    let slow = slow
        .await
        .unwrap()
        .expect("the request in flight is answered");
    assert_eq!(slow.status(), 200);
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let status = sluice
        .wait_exit(Duration::from_secs(12))
        .await
        .expect("sluice exits");
    assert!(status.success(), "{status}");

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let statuses = &seen.statuses["fast"];
    assert!(statuses.len() > 50, "the load ran: {}", statuses.len());
    assert!(
        statuses.iter().all(|s| *s == 200),
        "a request failed: {statuses:?}"
    );
    // Requests that could not connect once the listener closed were never in flight; every
    // one that sluice accepted was answered. A connection the kernel completed in the
    // listen backlog just as the listener closed is reset without sluice ever seeing it:
    // that can only happen at the moment of closing, never before or after.
    let closed = signalled + refused_at;
    for at in &seen.unanswered {
        assert!(
            *at + Duration::from_millis(150) > closed && *at < closed + Duration::from_millis(100),
            "a request failed {:?} before the listener closed",
            closed.saturating_duration_since(*at)
        );
    }
    println!(
        "{} answered, {} could not connect after the close, {} reset in the backlog as it closed",
        statuses.len(),
        seen.not_connected,
        seen.unanswered.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_flush_under_load_costs_no_request_an_error() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let upstream = Upstream::start().await;
    let sluice = Sluice::start(&three_routes(&redis, &upstream)).await;
    let stop = Arc::new(AtomicBool::new(false));
    // `deny` answers 503 on any store error, so it shows every one.
    let (tasks, seen) = steady_load(&sluice, &["deny"], Arc::clone(&stop));
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        redis.cmd(&["SCRIPT", "FLUSH"]).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let statuses = &seen.statuses["deny"];
    assert!(statuses.len() > 100, "the load ran: {}", statuses.len());
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(metric_sum(&metrics, "sluice_store_errors_total", &[]), 0.0);
    // Redis decided every request: sluice sent each decision (batched, several to a call).
    let decided = metric_sum(
        &metrics,
        "sluice_store_call_duration_seconds_count",
        &[("store", "redis")],
    );
    assert!(
        decided as usize >= statuses.len(),
        "{decided} decisions sent"
    );
    assert!(redis.commandstat("evalsha").await > 0);
}
