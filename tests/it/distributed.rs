//! Two sluice instances sharing one Redis enforce one exact limit together.
//!
//! First, on a quiet key, the window's end is probed: a key filled with `LIMIT` admissions
//! stays closed, on both instances, until exactly one window after its first admission, and
//! opens right then. Then 60 concurrent clients hammer another key, alternating between the
//! two instances, for ~3.5 s; both instances admit requests, the upstream receives exactly the
//! admitted ones, and no `LIMIT + 1` admissions are provably decided within one window.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Limit, Policy, Redis, Route, Sluice, Upstream, UpstreamSpec, REDIS_TIMEOUT};

const LIMIT: usize = 20;
const WINDOW: Duration = Duration::from_secs(1);
const CLIENTS: usize = 60;
const RUN_FOR: Duration = Duration::from_millis(3500);
const MAX_PER_CLIENT: usize = 300;
/// The probes must reach this far into the window, so a window 3% short always fails.
const PROBED: f64 = 0.97;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_one_exact_limit() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = Policy::new()
        .store_redis(&redis)
        .upstream(
            "api",
            UpstreamSpec::new(&up.url())
                .connect_timeout("2s")
                .timeout("10s"),
        )
        .route(
            Route::new("default", "/")
                .upstream("api")
                .limit(Limit::requests("per-key", LIMIT as u32, "1s").key(["header:x-api-key"])),
        );
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let urls = Arc::new([format!("{}/shared", a.url()), format!("{}/shared", b.url())]);
    let client = support::client();

    // A request that stalls for tens of milliseconds on a busy machine can keep the probes
    // out of the window's last percents; then the probing is done again on a fresh key.
    let mut reached = Vec::new();
    for attempt in 1..=3 {
        let key = format!("window-edge-{attempt}");
        let covered = the_window_ends_exactly_on_time(&client, &urls, &key).await;
        reached.push(covered);
        if covered >= WINDOW.mul_f64(PROBED) {
            break;
        }
        assert!(
            attempt < 3,
            "the probes were answered in time up to only {reached:?} of the {WINDOW:?} \
             window in 3 tries; {PROBED} is needed to tell a short window"
        );
    }
    let edge_hits = up.hits();
    assert_eq!(
        edge_hits,
        reached.len() * (LIMIT + 1),
        "each window probe: LIMIT, then the one that got in"
    );

    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let client = client.clone();
        let urls = urls.clone();
        tasks.push(tokio::spawn(async move {
            // (status, instance, sent, answered) of every response
            let mut seen: Vec<(u16, usize, Instant, Instant)> = Vec::new();
            let mut n = 0usize;
            while start.elapsed() < RUN_FOR && n < MAX_PER_CLIENT {
                let inst = (i + n) % 2;
                let sent = Instant::now();
                let r = client
                    .get(&urls[inst])
                    .header("x-api-key", "one-shared-key")
                    .send()
                    .await;
                match r {
                    Ok(r) => seen.push((r.status().as_u16(), inst, sent, Instant::now())),
                    Err(e) => panic!("request to instance {inst} failed: {e}"),
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("client task hung")
                .expect("client task panicked"),
        );
    }
    let elapsed = start.elapsed();

    let ok = all.iter().filter(|r| r.0 == 200).count();
    let limited = all.iter().filter(|r| r.0 == 429).count();
    let other: Vec<_> = all
        .iter()
        .filter(|r| r.0 != 200 && r.0 != 429)
        .map(|r| r.0)
        .collect();
    let admitted_by = [0, 1].map(|i| all.iter().filter(|r| r.0 == 200 && r.1 == i).count());
    let admissions: Vec<(Instant, Instant)> = all
        .iter()
        .filter(|r| r.0 == 200)
        .map(|r| (r.2, r.3))
        .collect();
    let tightest = support::tightest_admissions(&admissions, LIMIT + 1);
    println!(
        "{} requests in {elapsed:?}: {ok} admitted, {limited} limited, admitted per instance \
         {admitted_by:?}; {} admissions surely decided within {tightest:?} at the least",
        all.len(),
        LIMIT + 1
    );
    assert!(
        other.is_empty(),
        "every response must be 200 or 429; got {} others, e.g. {:?}",
        other.len(),
        &other[..other.len().min(5)]
    );
    assert!(
        admitted_by[0] > 0 && admitted_by[1] > 0,
        "both instances must admit requests, admitted per instance {admitted_by:?}"
    );
    assert!(limited > 0, "the load must exceed the limit");
    assert_eq!(
        up.hits() - edge_hits,
        ok,
        "the upstream must receive exactly the admitted requests"
    );

    // Each admission was decided in Redis between its request's sending and its answer, so
    // `LIMIT + 1` admissions whose requests were all sent and answered within less than a
    // window prove an over-admission, however late the machine delivered them (no jitter
    // allowance needed). Under this load the tightest such span is a few percent over the
    // window; a limit of LIMIT + 1 fails here.
    assert!(
        tightest.is_none_or(|span| span >= WINDOW),
        "{} admissions were decided within {tightest:?}, limit is {LIMIT} per {WINDOW:?}",
        LIMIT + 1
    );
    // Sanity on the other side: a sliding log with this much pressure admits
    // about LIMIT per WINDOW, so over 3.5 s well over one window's worth.
    assert!(
        ok >= 2 * LIMIT,
        "only {ok} admitted in {elapsed:?} under constant pressure (limit {LIMIT}/s)"
    );
}

/// Fills a fresh key with `LIMIT` admissions, then probes it, alternating instances: once at
/// once, then from 85% of the window on until it admits again. Every probe answered before
/// one window (and the store's lateness bound, for which the log counts it longer) after the
/// first admission was sent must be rejected (that admission happened after `first_sent`),
/// and the first probe sent that long after the first admission was answered
/// (`first_answered`) must be admitted. Returns how far into the window, counted
/// from `first_answered`, the probes that had to be rejected were sent: a window short by more
/// than what is left from there to its end fails here.
async fn the_window_ends_exactly_on_time(
    client: &reqwest::Client,
    urls: &[String; 2],
    key: &str,
) -> Duration {
    let send = |n: usize| client.get(&urls[n % 2]).header("x-api-key", key).send();
    let first_sent = Instant::now();
    assert_eq!(send(0).await.expect("first request").status(), 200);
    let first_answered = Instant::now();
    for n in 1..LIMIT {
        let status = send(n).await.expect("filling request").status();
        assert_eq!(status, 200, "request {} of {LIMIT} on a fresh key", n + 1);
    }

    // The log counts an admission for the window and the store's lateness bound.
    let counted = WINDOW + REDIS_TIMEOUT;
    let closes_no_earlier = first_sent + counted;
    let opens_by = first_answered + counted;
    let mut covered = Duration::ZERO;
    for n in LIMIT.. {
        if n == LIMIT + 1 {
            tokio::time::sleep_until((first_answered + counted.mul_f64(0.85)).into()).await;
        }
        let sent = Instant::now();
        let status = send(n).await.expect("probe").status().as_u16();
        let answered = Instant::now();
        let at = sent - first_answered;
        if answered < closes_no_earlier {
            assert_eq!(
                status,
                429,
                "request {} on instance {}, sent {at:?} after the first admission was \
                 answered, got {status} before the {counted:?} it is counted ended",
                n + 1,
                n % 2
            );
            covered = at;
        }
        if sent >= opens_by {
            assert_eq!(
                status,
                200,
                "request {} on instance {}, sent {at:?} after the first admission was \
                 answered, was refused after the {counted:?} it is counted had ended",
                n + 1,
                n % 2
            );
        }
        if status == 200 {
            break;
        }
    }
    println!(
        "window probe {key}: refused until at least {covered:?} after the first admission, \
         which took {:?} to answer",
        first_answered - first_sent
    );
    covered
}
