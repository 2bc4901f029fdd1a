//! sluice finds its Redis master through Redis Sentinel and follows a failover without a
//! restart: a real master, replica and three sentinels; steady load through sluice while the
//! master is failed over (by `SENTINEL FAILOVER`, or by killing it); decisions move to the new
//! master within a second of the sentinels naming it, 503s stop within 3 s (forced) or 6 s
//! (killed) of the failover's start, no request hangs, and limits filled before the failover
//! still hold after it.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{
    closed_port, command_at, sluice_check, wait_for, write_config, Limit, OnStoreError, Policy,
    Redis, Route, SentinelCluster, Sluice, Upstream, MASTER_NAME,
};

/// The store timeout sluice is given; no request may take much longer than this.
const STORE_TIMEOUT_MS: u64 = 200;
/// Bound on any one request: the store timeout plus a generous margin for a busy machine.
const REQUEST_BOUND: Duration = Duration::from_millis(1_500);
/// sluice's own part of a failover: from the sentinels naming the new master to the first
/// decision on it (it asks them every 500 ms, and listens to their announcements). Measured
/// 0.1–0.2 s; the README states this bound.
const SWITCH_BOUND: Duration = Duration::from_secs(1);

fn config(nodes: &[String], upstream: &str) -> Policy {
    let per_key = || Limit::requests("per-key", 20, "5m").key(["header:x-api-key"]);
    Policy::new()
        .store_sentinel(MASTER_NAME, nodes)
        .redis_setting("timeout", format!("{STORE_TIMEOUT_MS}ms"))
        .redis_setting("pool_size", 2)
        // The exactness across a failover is measured in Redis: during the switch, `default`
        // refuses (503) rather than deciding locally. `local` shows the default choice.
        .on_store_error(OnStoreError::Deny)
        .upstream("api", upstream)
        .route(
            Route::new("local", "/local")
                .upstream("api")
                .on_store_error(OnStoreError::Local)
                .limit(per_key()),
        )
        .route(Route::new("default", "/").upstream("api").limit(per_key()))
}

/// What one request of the steady load got.
struct Outcome {
    /// The request's key is `load-{key}`.
    key: u64,
    /// When it was sent, from the start of the load.
    sent: Duration,
    took: Duration,
    status: u16,
    body: String,
}

/// Sends requests one after another, each with a new key (so each is decided in Redis and
/// admitted when Redis answers), about every 10 ms until `stop`.
async fn steady_load(
    url: String,
    path: &'static str,
    stop: Arc<AtomicBool>,
    start: Instant,
) -> Vec<Outcome> {
    let client = support::client();
    let mut outcomes = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let sent = Instant::now();
        let result = client
            .get(format!("{url}{path}"))
            .header("x-api-key", format!("load-{i}"))
            .send()
            .await;
        let (status, body) = match result {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        };
        outcomes.push(Outcome {
            key: i,
            sent: sent - start,
            took: sent.elapsed(),
            status,
            body,
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    outcomes
}

async fn statuses(url: &str, path: &str, key: &str, n: usize) -> Vec<u16> {
    let client = support::client();
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let r = client
            .get(format!("{url}{path}"))
            .header("x-api-key", key)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        got.push(r.status().as_u16());
    }
    got
}

/// The `n` of every `load-n` key on the Redis at `port`.
async fn load_keys(port: u16) -> std::collections::HashSet<u64> {
    let keys: Vec<String> = redis::from_redis_value(
        command_at(port, &["KEYS", "*load-*"])
            .await
            .expect("KEYS on a node"),
    )
    .expect("a key list");
    keys.iter()
        .filter_map(|k| {
            let (_, rest) = k.split_once("load-")?;
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

fn count(got: &[u16], status: u16) -> usize {
    got.iter().filter(|&&s| s == status).count()
}

/// Entries in the sliding log of `identity` on the Redis at `port` (0 when it has no log).
async fn log_entries(port: u16, identity: &str) -> i64 {
    let pattern = format!("*{identity}*");
    let keys: Vec<String> = redis::from_redis_value(
        command_at(port, &["KEYS", &pattern])
            .await
            .expect("KEYS on a node"),
    )
    .expect("a key list");
    assert!(
        keys.len() <= 1,
        "one key for {identity} on {port}: {keys:?}"
    );
    let Some(key) = keys.first() else {
        return 0;
    };
    redis::from_redis_value(
        command_at(port, &["ZCARD", key])
            .await
            .expect("ZCARD on a node"),
    )
    .expect("a count")
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Failover {
    /// `SENTINEL FAILOVER mymaster`: the old master stays up and is demoted later.
    Forced,
    /// The master process is killed; the sentinels agree it is down and promote the replica.
    Kill,
}

impl Failover {
    /// 503s must stop this long after the failover starts, as the README states: measured
    /// 1.1 s (forced: the sentinels' promotion) and 2.2–2.6 s (killed: 1 s until the master
    /// is deemed down, then an election), with room for a loaded 2-core machine.
    fn recovery_bound(self) -> Duration {
        match self {
            Failover::Forced => Duration::from_secs(3),
            Failover::Kill => Duration::from_secs(6),
        }
    }
}

async fn follows(failover: Failover) {
    let recovery_bound = failover.recovery_bound();
    let mut cluster = SentinelCluster::start().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&cluster.nodes(), &up.url())).await;
    sluice.expect_store_faults();
    let url = sluice.url();
    let new_port = cluster.first_replica.port();

    // Before the failover: `half` uses 10 of its 20, `full` all 20.
    assert_eq!(statuses(&url, "/half", "half", 10).await, vec![200; 10]);
    let full = statuses(&url, "/full", "full", 25).await;
    assert_eq!((count(&full, 200), count(&full, 429)), (20, 5), "{full:?}");
    wait_for(
        Duration::from_secs(10),
        "the replica to hold both logs",
        || async {
            log_entries(new_port, "half").await == 10 && log_entries(new_port, "full").await == 20
        },
    )
    .await;

    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(steady_load(url.clone(), "/load", stop.clone(), start));
    let local_load = tokio::spawn(steady_load(url.clone(), "/local", stop.clone(), start));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let evalsha_before = cluster.first_replica.commandstat("evalsha").await;

    let failed_at = start.elapsed();
    match failover {
        Failover::Forced => {
            let sentinel = cluster.sentinels[0].port;
            command_at(sentinel, &["SENTINEL", "FAILOVER", MASTER_NAME])
                .await
                .expect("SENTINEL FAILOVER");
        }
        Failover::Kill => cluster.first_master.stop(),
    }
    let mut promoted = None;
    let mut moved = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while moved.is_none() {
        if promoted.is_none() && cluster.master_port().await == Some(new_port) {
            promoted = Some(start.elapsed() - failed_at);
        }
        // Sentinel disconnects the promoted replica's clients: a failed poll is retried.
        let evalsha = cluster.first_replica.try_commandstat("evalsha").await;
        if evalsha.is_ok_and(|calls| calls > evalsha_before) {
            moved = Some(start.elapsed() - failed_at);
        }
        assert!(
            Instant::now() < deadline,
            "no decision reached the new master within 20 s of the failover\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Named by the sentinels: if sluice heard the announcement before they answered it, poll on.
    while promoted.is_none() {
        if cluster.master_port().await == Some(new_port) {
            promoted = Some(start.elapsed() - failed_at);
        }
        assert!(
            Instant::now() < deadline,
            "the sentinels never named the new master\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let until = failed_at + recovery_bound + Duration::from_secs(2);
    tokio::time::sleep(until.saturating_sub(start.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    let outcomes = load.await.expect("the load task");
    let local = local_load.await.expect("the local load task");
    assert!(local.len() > 50, "the local load ran: {}", local.len());
    let failed: Vec<u16> = local
        .iter()
        .map(|o| o.status)
        .filter(|s| *s != 200)
        .collect();
    assert!(
        failed.is_empty(),
        "on_store_error: local answered {failed:?}"
    );

    let unavailable: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 503).collect();
    let last_503 = unavailable.last().map(|o| o.sent.saturating_sub(failed_at));
    let slowest = outcomes.iter().map(|o| o.took).max().unwrap_or_default();
    let admitted_after = outcomes
        .iter()
        .filter(|o| o.status == 200 && o.sent > failed_at + recovery_bound)
        .count();
    eprintln!(
        "{failover:?}: {} requests, {} answered 503, last 503 sent {last_503:?} after the \
         failover started; sentinels named the new master after {promoted:?}, first decision \
         on it after {moved:?}; slowest request {slowest:?}; {admitted_after} admitted in the \
         last 2 s",
        outcomes.len(),
        unavailable.len(),
    );
    for o in &outcomes {
        assert!(
            o.status == 200 || o.status == 503,
            "only 200, or 503 while the store switches, expected; got {} at {:?}: {}",
            o.status,
            o.sent,
            o.body
        );
        if o.status == 503 {
            assert!(
                o.body.contains("rate-limit store is unavailable"),
                "a 503 must come from the store: {}",
                o.body
            );
        }
        assert!(
            o.took < REQUEST_BOUND,
            "a request took {:?} (store timeout {STORE_TIMEOUT_MS} ms)",
            o.took
        );
    }
    if let Some(last) = last_503 {
        assert!(
            last < recovery_bound,
            "503s went on {last:?} after the failover"
        );
    }
    assert!(
        admitted_after >= 50,
        "steady load admitted after recovery: {admitted_after}"
    );
    let moved = moved.unwrap_or_default();
    assert!(moved < recovery_bound, "decisions moved after {moved:?}");
    let promoted = promoted.unwrap_or_default();
    assert!(
        moved <= promoted + SWITCH_BOUND,
        "decisions moved {:?} after the sentinels named the new master",
        moved.saturating_sub(promoted)
    );

    // Admissions the new master does not know were written to the old master after the
    // replica stopped following it (Redis replication is asynchronous). They may only come
    // from the switch itself: everything admitted before it, or after the first decision on
    // the new master, is there.
    let on_new_master = load_keys(new_port).await;
    let lost: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.status == 200 && !on_new_master.contains(&o.key))
        .collect();
    eprintln!(
        "{failover:?}: {} admissions missing on the new master, sent from {:?} to {:?} \
         after the failover started",
        lost.len(),
        lost.first().map(|o| o.sent.saturating_sub(failed_at)),
        lost.last().map(|o| o.sent.saturating_sub(failed_at)),
    );
    if failover == Failover::Forced {
        // The sentinel announces the promotion before it makes it, and sluice stops deciding
        // on the old master when it hears that: nothing admitted is lost.
        assert!(
            lost.is_empty(),
            "{} admissions lost in a forced failover",
            lost.len()
        );
    }
    for o in &lost {
        assert!(
            o.sent + Duration::from_millis(100) >= failed_at && o.sent <= failed_at + moved,
            "admission {} sent at {:?} is missing on the new master, outside the switch \
             ({failed_at:?} to {:?})",
            o.key,
            o.sent,
            failed_at + moved
        );
    }

    // The limits filled before the failover hold on the new master: `half` has 10 left,
    // `full` none, and the upstream saw exactly 20 of each.
    let half = statuses(&url, "/half", "half", 15).await;
    assert_eq!(half, [vec![200; 10], vec![429; 5]].concat());
    assert_eq!(statuses(&url, "/full", "full", 3).await, vec![429; 3]);
    let paths = up.paths();
    assert_eq!(paths.iter().filter(|p| *p == "/half").count(), 20);
    assert_eq!(paths.iter().filter(|p| *p == "/full").count(), 20);
    assert_eq!(log_entries(new_port, "half").await, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_forced_failover() {
    let _heavy = support::heavy().await;
    follows(Failover::Forced).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_when_the_master_dies() {
    let _heavy = support::heavy().await;
    follows(Failover::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_first_sentinel_is_skipped() {
    let _heavy = support::heavy().await;
    let cluster = SentinelCluster::start().await;
    let up = Upstream::start().await;
    let mut nodes = vec![format!("127.0.0.1:{}", closed_port())];
    nodes.extend(cluster.nodes());
    let sluice = Sluice::start(&config(&nodes, &up.url())).await;
    let started = Instant::now();
    let got = statuses(&sluice.url(), "/x", "k", 3).await;
    assert_eq!(got, vec![200; 3], "{}", sluice.log());
    assert!(started.elapsed() < REQUEST_BOUND * 3);
    assert_eq!(cluster.first_master.commandstat("evalsha").await, 3);
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn a_sentinel_that_knows_no_such_master_is_skipped() {
    // A plain Redis answers `SENTINEL ...` with an error: as unhelpful as a sentinel that
    // does not know the master, and skipped the same way.
    let cluster = SentinelCluster::start().await;
    let not_a_sentinel = Redis::start().await;
    let up = Upstream::start().await;
    let mut nodes = vec![format!("127.0.0.1:{}", not_a_sentinel.port())];
    nodes.extend(cluster.nodes());
    let sluice = Sluice::start(&config(&nodes, &up.url())).await;
    assert_eq!(statuses(&sluice.url(), "/x", "k", 2).await, vec![200; 2]);
    assert_eq!(cluster.first_master.commandstat("evalsha").await, 2);
}

#[test]
fn check_refuses_url_and_sentinel_together() {
    let yaml = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\nstore:\n  redis:\n    \
                url: redis://127.0.0.1:6379/0\n    sentinel:\n      master_name: mymaster\n      \
                nodes: [\"127.0.0.1:26379\"]\nroutes: []\n";
    let file = write_config(yaml);
    let (status, _, stderr) = sluice_check(file.path());
    assert!(!status.success());
    let expected = format!(
        "error: {}:7:7: store.redis.sentinel: give exactly one of `url`",
        file.path().display()
    );
    assert!(stderr.contains(&expected), "{stderr}");

    let file = write_config(&yaml.replace("    url: redis://127.0.0.1:6379/0\n", ""));
    let (status, stdout, _) = sluice_check(file.path());
    assert!(status.success(), "sentinel alone is valid");
    assert!(stdout.contains("store: redis"), "{stdout}");

    let neither = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\nstore:\n  redis:\n    \
                   timeout: 1s\nroutes: []\n";
    let file = write_config(neither);
    let (status, _, stderr) = sluice_check(file.path());
    assert!(!status.success());
    let expected = format!(
        "error: {}:5:5: store.redis: needs `url` (one Redis), `sentinel`",
        file.path().display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_for_the_nodes_and_the_sentinels() {
    let cluster =
        SentinelCluster::start_with_passwords(Some("data-secret"), Some("sentinel-secret")).await;
    let up = Upstream::start().await;
    let with_passwords = config(&cluster.nodes(), &up.url())
        .sentinel_setting("password", "data-secret")
        .sentinel_setting("sentinel_password", "sentinel-secret");
    let sluice = Sluice::start(&with_passwords).await;
    let got = statuses(&sluice.url(), "/x", "k", 3).await;
    assert_eq!(got, vec![200; 3], "{}", sluice.log());
    assert_eq!(cluster.first_master.commandstat("evalsha").await, 3);

    // Without the sentinels' password no master is found, and limited requests get 503.
    let without = config(&cluster.nodes(), &up.url()).sentinel_setting("password", "data-secret");
    let refused = Sluice::start(&without).await;
    refused.expect_store_faults();
    assert_eq!(statuses(&refused.url(), "/x", "k", 2).await, vec![503; 2]);
    assert_eq!(cluster.first_master.commandstat("evalsha").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_counts_as_unreachable() {
    // A master demoted under sluice answers READONLY. That must read as "the store is not
    // reachable here" (which sends the Sentinel store back to the sentinels), not as a
    // script error.
    use sluice::limiter::{Algorithm, Check, RedisStore, Spec, StoreError};
    let master = Redis::start().await;
    let port = master.port().to_string();
    let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &port]).await;
    let store = RedisStore::new(&replica.url(), 1, Duration::from_secs(2)).expect("a store");
    let check = Check {
        key: "sluice-test:r:l:{k}".to_owned(),
        spec: Spec {
            algorithm: Algorithm::SlidingLog,
            requests: 5,
            window: Duration::from_secs(60),
            burst: 5,
            cost: 1,
            ..Spec::default()
        },
    };
    match store.decide(&[check]).await {
        Err(StoreError::Connection(message)) => {
            assert!(message.contains("read only replica"), "{message}")
        }
        other => panic!("expected a connection error (READONLY), got {other:?}"),
    }
}
