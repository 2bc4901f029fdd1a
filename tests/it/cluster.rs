//! The Redis store on a real three-master Redis Cluster, created by the harness with
//! `redis-cli --cluster create`: limits hold across instances, a request whose limits live in
//! different slots consumes nothing when one of them rejects it, and a slot moved to another
//! master under load (ASK, then MOVED) keeps its log: no limit admits more than it allows.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{
    client, command_at, Limit, OnStoreError, Policy, RedisCluster, Route, Sluice, Upstream,
};

fn config(cluster: &RedisCluster, upstream: &Upstream, limits: Vec<Limit>) -> Policy {
    let route = Route::new("api", "/")
        .upstream("app")
        .on_store_error(OnStoreError::Deny);
    Policy::new()
        .store_cluster(cluster)
        .upstream("app", upstream.url())
        .route(limits.into_iter().fold(route, Route::limit))
}

/// Every key on every node, with the index of the node holding it.
async fn all_keys(cluster: &RedisCluster) -> Vec<(usize, String)> {
    let mut keys = Vec::new();
    for (index, node) in cluster.nodes.iter().enumerate() {
        for key in node.keys().await {
            keys.push((index, key));
        }
    }
    keys.sort();
    keys
}

/// ZCARD of `key` on the node that holds its slot (0 when absent).
async fn log_len(cluster: &RedisCluster, key: &str) -> i64 {
    let owner = cluster.owner_of(cluster.slot_of(key).await).await;
    match command_at(cluster.nodes[owner].port(), &["ZCARD", key]).await {
        Ok(redis::Value::Int(n)) => n,
        other => panic!("ZCARD {key} answered {other:?}"),
    }
}

async fn get(sluice: &Sluice, user: &str) -> u16 {
    client()
        .get(format!("{}/x", sluice.url()))
        .header("x-user", user)
        .send()
        .await
        .expect("a response")
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_across_instances_with_keys_on_their_slots_owner() {
    let cluster = RedisCluster::start().await;
    let upstream = Upstream::start().await;
    let limits = vec![Limit::requests("per_user", 5, "1m").key(["header:x-user"])];
    let yaml = config(&cluster, &upstream, limits);
    let (a, b) = (Sluice::start(&yaml).await, Sluice::start(&yaml).await);
    let mut statuses = Vec::new();
    for i in 0..12 {
        statuses.push(get(if i % 2 == 0 { &a } else { &b }, "alice").await);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        7,
        "{statuses:?}"
    );
    assert_eq!(upstream.hits(), 5);
    // The admin API reads and resets the identity on the master owning its slot.
    let quota = format!(
        "{}/admin/v1/limits/api/per_user?header.x-user=alice",
        a.admin_url()
    );
    let read: serde_json::Value = client()
        .get(&quota)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read["count"], 5, "{read}");
    assert_eq!(read["remaining"], 0, "{read}");
    assert_eq!(read["store"], "redis", "{read}");
    let reset = client()
        .delete(&quota)
        .header("x-sluice-admin", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    assert_eq!(get(&a, "alice").await, 200);
    assert_eq!(upstream.hits(), 6);
    // Other identities hash elsewhere: ten users spread their keys over the masters.
    for user in 0..10 {
        assert_eq!(get(&a, &format!("user-{user}")).await, 200);
    }
    let keys = all_keys(&cluster).await;
    assert_eq!(keys.len(), 11, "{keys:?}");
    for (node, key) in &keys {
        let owner = cluster.owner_of(cluster.slot_of(key).await).await;
        assert_eq!(*node, owner, "{key} is not on the master owning its slot");
    }
    let nodes_used: std::collections::BTreeSet<usize> = keys.iter().map(|(n, _)| *n).collect();
    assert!(nodes_used.len() >= 2, "every key on one node: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_rejected_in_one_slot_consumes_nothing_in_the_others() {
    let cluster = RedisCluster::start().await;
    let upstream = Upstream::start().await;
    // A per-user limit and a global cap: `{<user>}` and `{*}` are different slots.
    let limits = vec![
        Limit::requests("per_user", 3, "1m").key(["header:x-user"]),
        Limit::requests("global", 6, "1m").key([]),
    ];
    let sluice = Sluice::start(&config(&cluster, &upstream, limits)).await;

    // The per-user limit rejects: the global cap must not count the rejected requests.
    let alice: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..8 {
            v.push(get(&sluice, "alice").await);
        }
        v
    };
    assert_eq!(alice, [200, 200, 200, 429, 429, 429, 429, 429]);
    let keys = all_keys(&cluster).await;
    let global = keys
        .iter()
        .map(|(_, k)| k.clone())
        .find(|k| k.contains(":global:"))
        .expect("the global key");
    let alice_key = keys
        .iter()
        .map(|(_, k)| k.clone())
        .find(|k| k.contains(":per_user:"))
        .expect("alice's key");
    assert_ne!(
        cluster.slot_of(&global).await,
        cluster.slot_of(&alice_key).await,
        "the test needs the two limits in different slots"
    );
    assert_eq!(
        log_len(&cluster, &global).await,
        3,
        "the global cap counted rejected requests"
    );
    assert_eq!(log_len(&cluster, &alice_key).await, 3);

    // The global cap rejects: each rejected user's own limit must stay empty.
    let mut statuses = Vec::new();
    for user in 0..6 {
        statuses.push(get(&sluice, &format!("user-{user}")).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    let keys = all_keys(&cluster).await;
    for user in 0..6 {
        let key = keys
            .iter()
            .map(|(_, k)| k.clone())
            .find(|k| k.contains(":per_user:") && k.contains(&format!("user-{user}")));
        let held = match &key {
            Some(key) => log_len(&cluster, key).await,
            None => 0,
        };
        let expected = if user < 3 { 1 } else { 0 };
        assert_eq!(held, expected, "user-{user}'s limit: {key:?}");
    }
    assert_eq!(upstream.hits(), 6);
}

/// GET `path` as `user` through `url`: the status, 0 when no response came.
async fn get_at(c: &reqwest::Client, url: &str, path: &str, user: &str) -> u16 {
    c.get(format!("{url}{path}"))
        .header("x-user", user)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// Two sluice instances with two routes limiting one identity, so their keys share a slot.
/// `/a` (40 a minute, 20 spent at start) is spent while the cluster changes; `/b`
/// (`b_limits`, with room throughout) keeps its decisions reaching Redis (a spent limit's
/// rejections are answered from the deny cache), and every one must be recorded exactly once.
struct TwoRoutes {
    a: Sluice,
    b: Sluice,
    key_a: String,
    key_b: String,
}

impl TwoRoutes {
    async fn start(cluster: &RedisCluster, upstream: &Upstream, b_limits: Vec<Limit>) -> TwoRoutes {
        let route = |name: &str| {
            Route::new(name, &format!("/{name}"))
                .upstream("app")
                .on_store_error(OnStoreError::Deny)
        };
        let yaml = Policy::new()
            .store_cluster(cluster)
            .upstream("app", upstream.url())
            .route(route("a").limit(Limit::requests("l", 40, "1m").key(["header:x-user"])))
            .route(b_limits.into_iter().fold(route("b"), Route::limit));
        let (a, b) = (Sluice::start(&yaml).await, Sluice::start(&yaml).await);
        let c = client();
        // Spend 20 of `/a`'s 40 first, so the log has something to carry.
        for _ in 0..20 {
            assert_eq!(get_at(&c, &a.url(), "/a", "mallory").await, 200);
        }
        assert_eq!(get_at(&c, &a.url(), "/b", "mallory").await, 200);
        let keys: Vec<String> = all_keys(cluster)
            .await
            .into_iter()
            .map(|(_, k)| k)
            .collect();
        let find = |part: &str| keys.iter().find(|k| k.contains(part)).cloned();
        let key_a = find(":a:l:").expect("/a's key");
        let key_b = find(":b:l:").expect("/b's key");
        assert_eq!(cluster.slot_of(&key_a).await, cluster.slot_of(&key_b).await);
        TwoRoutes { a, b, key_a, key_b }
    }

    /// Load on `/b`: four clients on the two instances, bounded in count and time.
    fn load(&self) -> Load {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let tasks = (0..4)
            .map(|worker| {
                let url = if worker % 2 == 0 {
                    self.a.url()
                } else {
                    self.b.url()
                };
                let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
                tokio::spawn(async move {
                    let c = client();
                    let started = Instant::now();
                    for _ in 0..3_000 {
                        if stop.load(Ordering::Relaxed)
                            || started.elapsed() > Duration::from_secs(20)
                        {
                            break;
                        }
                        match get_at(&c, &url, "/b", "mallory").await {
                            200 => ok.fetch_add(1, Ordering::Relaxed),
                            _ => failed.fetch_add(1, Ordering::Relaxed),
                        };
                        tokio::time::sleep(Duration::from_millis(3)).await;
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failed,
            tasks,
        }
    }

    /// 40 concurrent attempts on `/a`, half through each instance: their statuses.
    async fn attempts_on_a(&self) -> Vec<u16> {
        let attempts: Vec<_> = (0..40)
            .map(|i| {
                let url = if i % 2 == 0 {
                    self.a.url()
                } else {
                    self.b.url()
                };
                tokio::spawn(async move { get_at(&client(), &url, "/a", "mallory").await })
            })
            .collect();
        let mut statuses = Vec::new();
        for attempt in attempts {
            statuses.push(attempt.await.expect("an attempt"));
        }
        statuses
    }
}

/// The background load of `TwoRoutes::load`.
struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Stops the load: how many requests were admitted, and how many failed.
    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("load task");
        }
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_under_load_keeps_its_log() {
    let _heavy = support::heavy().await;
    let cluster = RedisCluster::start().await;
    let upstream = Upstream::start().await;
    // Two limits on `/b`: each decision is a two-key script call, which the cluster answers
    // with TRYAGAIN, ASK or MOVED while the slot moves.
    let routes = TwoRoutes::start(
        &cluster,
        &upstream,
        vec![
            Limit::requests("l", 100_000, "1m").key(["header:x-user"]),
            Limit::requests("m", 100_000, "1m").key(["header:x-user"]),
        ],
    )
    .await;
    let slot = cluster.slot_of(&routes.key_a).await;
    let source = cluster.owner_of(slot).await;
    let target = (source + 1) % 3;
    let (source_id, target_id) = (cluster.node_id(source).await, cluster.node_id(target).await);
    let asking_before = cluster.nodes[target].commandstat("asking").await;
    let load = routes.load();

    // Move the slot by hand, pausing in each state so the load meets it: importing and
    // migrating with the keys still on the source; keys moved, so the source answers ASK;
    // the new owner announced to every node, so the source answers MOVED.
    let (sp, tp) = (cluster.nodes[source].port(), cluster.nodes[target].port());
    let slot_text = slot.to_string();
    tokio::time::sleep(Duration::from_millis(300)).await;
    command_at(
        tp,
        &["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &source_id],
    )
    .await
    .expect("IMPORTING");
    command_at(
        sp,
        &["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &target_id],
    )
    .await
    .expect("MIGRATING");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let moving: Vec<String> = match command_at(sp, &["CLUSTER", "GETKEYSINSLOT", &slot_text, "100"])
        .await
        .expect("GETKEYSINSLOT")
    {
        redis::Value::Array(keys) => keys
            .into_iter()
            .map(|k| match k {
                redis::Value::BulkString(b) => String::from_utf8(b).expect("a key"),
                other => panic!("a key, not {other:?}"),
            })
            .collect(),
        other => panic!("GETKEYSINSLOT answered {other:?}"),
    };
    assert_eq!(moving.len(), 3, "every limit's key in the slot: {moving:?}");
    let port = tp.to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(moving.iter().map(String::as_str));
    command_at(sp, &migrate).await.expect("MIGRATE");

    // While the source answers ASK: 40 concurrent attempts on `/a` from both instances.
    let during = routes.attempts_on_a().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for node in &cluster.nodes {
        command_at(
            node.port(),
            &["CLUSTER", "SETSLOT", &slot_text, "NODE", &target_id],
        )
        .await
        .expect("SETSLOT NODE");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (ok_b, failed_b) = load.finish().await;

    assert_eq!(cluster.owner_of(slot).await, target);
    assert_eq!(cluster.keys_in_slot(target, slot).await, 3);
    assert_eq!(cluster.keys_in_slot(source, slot).await, 0);
    assert!(
        cluster.nodes[target].commandstat("asking").await > asking_before,
        "no call was redirected with ASK while the slot moved"
    );
    // `/a`'s log moved with the slot: 20 spent before, so exactly 20 more, never more.
    assert_eq!(
        during.iter().filter(|s| **s == 200).count(),
        20,
        "{during:?}"
    );
    assert_eq!(
        during.iter().filter(|s| **s == 429).count(),
        20,
        "{during:?}"
    );
    assert_eq!(log_len(&cluster, &routes.key_a).await, 40);
    let c = client();
    assert_eq!(get_at(&c, &routes.a.url(), "/a", "mallory").await, 429);
    assert_eq!(get_at(&c, &routes.b.url(), "/a", "mallory").await, 429);
    // `/b`: every admission recorded once, none lost or doubled by a retried call.
    eprintln!("/b during the move: {ok_b} admitted, {failed_b} failed");
    assert!(ok_b > 100, "too little load on /b: {ok_b}");
    assert_eq!(failed_b, 0, "decisions failed while the slot moved");
    assert_eq!(log_len(&cluster, &routes.key_b).await, ok_b as i64 + 1);
    let hits_a = upstream
        .paths()
        .iter()
        .filter(|p| p.starts_with("/a"))
        .count();
    assert_eq!(hits_a, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_outcomes_are_given_back_in_every_slot() {
    let cluster = RedisCluster::start().await;
    let upstream = Upstream::start().await;
    // Failed logins only, per user and for everyone: `{<user>}` and `{*}` are two slots.
    let limits = vec![
        Limit::requests("per_user", 3, "1m")
            .key(["header:x-user"])
            .count_status([401]),
        Limit::requests("global", 10, "1m")
            .key([])
            .count_status([401]),
    ];
    let sluice = Sluice::start(&config(&cluster, &upstream, limits)).await;
    let login = |password: &'static str| {
        let url = format!("{}/login?password={password}", sluice.url());
        async move {
            client()
                .post(url)
                .header("x-user", "alice")
                .send()
                .await
                .expect("an answer")
                .status()
                .as_u16()
        }
    };
    for n in 0..20 {
        assert_eq!(login("right").await, 200, "success {n}");
    }
    let keys: Vec<String> = all_keys(&cluster)
        .await
        .into_iter()
        .map(|(_, k)| k)
        .collect();
    for key in &keys {
        assert_eq!(log_len(&cluster, key).await, 0, "{key} kept a success");
    }
    for n in 0..3 {
        assert_eq!(login("wrong").await, 401, "failure {n}");
    }
    assert_eq!(login("wrong").await, 429);
    assert_eq!(login("right").await, 429, "alice's failures are spent");
    let keys: Vec<String> = all_keys(&cluster)
        .await
        .into_iter()
        .map(|(_, k)| k)
        .collect();
    let global = keys
        .iter()
        .find(|k| k.contains(":global:"))
        .expect("the global key");
    let alice = keys
        .iter()
        .find(|k| k.contains(":per_user:"))
        .expect("alice's key");
    assert_ne!(cluster.slot_of(global).await, cluster.slot_of(alice).await);
    assert_eq!(log_len(&cluster, global).await, 3);
    assert_eq!(log_len(&cluster, alice).await, 3);
    assert_eq!(upstream.hits(), 23);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_promoted_under_load_keeps_the_log() {
    let _heavy = support::heavy().await;
    let cluster = RedisCluster::start_with_replicas(1).await;
    let upstream = Upstream::start().await;
    // As in the slot move: `/a` is spent after the failover, `/b` has room throughout.
    let routes = TwoRoutes::start(
        &cluster,
        &upstream,
        vec![Limit::requests("l", 100_000, "1m").key(["header:x-user"])],
    )
    .await;
    let slot = cluster.slot_of(&routes.key_a).await;
    let master = cluster.owner_of(slot).await;
    let replica = cluster.replica_of(master).await;
    let load = routes.load();

    // A coordinated failover: the replica catches up with its master, then takes its slots.
    tokio::time::sleep(Duration::from_millis(300)).await;
    command_at(cluster.nodes[replica].port(), &["CLUSTER", "FAILOVER"])
        .await
        .expect("CLUSTER FAILOVER");
    let promoted = Instant::now();
    while cluster.owner_of(slot).await != replica {
        assert!(
            promoted.elapsed() < Duration::from_secs(15),
            "the replica did not take the slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // After the failover: 40 concurrent attempts on `/a`, which has 20 left.
    let after = routes.attempts_on_a().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (ok_b, failed_b) = load.finish().await;

    let evalsha_new = cluster.nodes[replica].commandstat("evalsha").await;
    assert!(evalsha_new > 0, "no decision reached the promoted replica");
    assert_eq!(after.iter().filter(|s| **s == 200).count(), 20, "{after:?}");
    assert_eq!(after.iter().filter(|s| **s == 429).count(), 20, "{after:?}");
    assert_eq!(log_len(&cluster, &routes.key_a).await, 40);
    eprintln!("/b across the failover: {ok_b} admitted, {failed_b} failed");
    assert!(ok_b > 100, "too little load on /b: {ok_b}");
    // None may be admitted without being recorded. A refused decision answers 503
    // (on_store_error: deny): a coordinated failover of a synced replica only pauses the
    // master's clients for the handover, within the 1 s timeout on a quiet machine (none failed
    // in eight runs alone); with the whole suite beside it on 2 cores, 2 of 552 once did. The
    // README states both; the bound is 1 %.
    assert_eq!(log_len(&cluster, &routes.key_b).await, ok_b as i64 + 1);
    assert!(
        failed_b * 100 <= ok_b + failed_b,
        "{failed_b} of {} decisions failed",
        ok_b + failed_b
    );
    // Those refused decisions are store errors the failover caused, which the harness's
    // end-of-test guard would take for decisions Redis did not make; the route denies on a
    // store error (no local decision), and the log's exact length above shows Redis decided
    // every admitted request. So they are declared only when some happened.
    if failed_b > 0 {
        routes.a.expect_store_faults();
        routes.b.expect_store_faults();
    }
}
