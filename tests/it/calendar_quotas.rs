//! Calendar quotas (`quota: day | week | month`, `time_zone:`) through the real binary, on
//! the in-process store and on a real redis-server (and a Redis Cluster for a request whose
//! quota and other limit live in different slots). sluice's wall clock is started at a
//! chosen instant with `SLUICE_TEST_CLOCK_START` (time flows from there), so a test watches
//! a real month end, an ISO week start and a daylight-saving day go by.

use crate::support;

use std::time::{Duration, Instant};

use support::{
    client, command_at, header, sluice_check, wait_for, write_config, Limit, OnStoreError, Policy,
    RedisCluster, Route, Sluice, Store, StoreKind, Upstream,
};

const CLOCK: &str = "SLUICE_TEST_CLOCK_START";
const QUOTA_TYPE: &str = "tag:sluice,2026:quota-exhausted";
/// How long before a boundary the boundary tests start sluice's clock.
const LEAD: Duration = Duration::from_secs(5);

/// A sluice whose wall clock started at `start`, with a route `/` answering 200 directly and
/// named `route` (instances sharing a Redis count apart),
/// limited by `limits`, and the instant before it was spawned: sluice's clock reads at most
/// `start + (now - spawned)`.
async fn sluice_at(
    store: &Store,
    route: &str,
    start: &str,
    limits: Vec<Limit>,
) -> (Sluice, Instant) {
    let route = Route::new(route, "/").respond_status(200);
    let policy = Policy::new()
        .store(store)
        .route(limits.into_iter().fold(route, Route::limit));
    let spawned = Instant::now();
    let sluice = Sluice::start_with_env(&policy, &[(CLOCK, start)]).await;
    (sluice, spawned)
}

async fn get(sluice: &Sluice) -> reqwest::Response {
    client()
        .get(format!("{}/x", sluice.url()))
        .send()
        .await
        .expect("an answer")
}

/// The `t` of the one item of a `RateLimit` field.
fn rate_limit_t(response: &reqwest::Response) -> u64 {
    let field = header(response, "ratelimit");
    field
        .split(';')
        .find_map(|p| p.strip_prefix("t="))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no t in RateLimit: {field}"))
}

/// Seconds to the reset as sluice rounds them (up) when `left` was left at its clock's start
/// and at most `elapsed` has passed since: exactly `left` while under a second has passed,
/// which is the usual case; on a loaded machine, no more than the elapsed whole seconds less.
fn assert_seconds_left(seen: u64, left: u64, elapsed: Duration, what: &str) {
    let passed = elapsed.as_secs();
    assert!(
        seen <= left && seen + passed >= left,
        "{what}: {seen} s, expected {left} s less at most {passed} s elapsed"
    );
}

/// One boundary: a quota of 2 per period, the clock started 5 s before the period ends (time
/// for sluice to start and answer three requests on a loaded machine).
struct Boundary {
    quota: &'static str,
    zone: &'static str,
    start: &'static str,
    /// The reset instant the 429 names (the boundary, in the zone).
    resets_at: &'static str,
    /// How long the next period is, in seconds: its `t` right after the reset.
    next_len: u64,
}

const BOUNDARIES: [Boundary; 8] = [
    // January's 31 days end; February 2027 has 28.
    Boundary {
        quota: "month",
        zone: "UTC",
        start: "2027-01-31T23:59:55Z",
        resets_at: "2027-02-01T00:00:00+00:00",
        next_len: 28 * 86_400,
    },
    Boundary {
        quota: "month",
        zone: "UTC",
        start: "2027-02-28T23:59:55Z",
        resets_at: "2027-03-01T00:00:00+00:00",
        next_len: 31 * 86_400,
    },
    // 2028 is a leap year: February ends on the 29th.
    Boundary {
        quota: "month",
        zone: "UTC",
        start: "2028-02-29T23:59:55Z",
        resets_at: "2028-03-01T00:00:00+00:00",
        next_len: 31 * 86_400,
    },
    Boundary {
        quota: "month",
        zone: "UTC",
        start: "2026-04-30T23:59:55Z",
        resets_at: "2026-05-01T00:00:00+00:00",
        next_len: 31 * 86_400,
    },
    // Sunday 2026-11-29 ends; the ISO week starts on Monday.
    Boundary {
        quota: "week",
        zone: "UTC",
        start: "2026-11-29T23:59:55Z",
        resets_at: "2026-11-30T00:00:00+00:00",
        next_len: 7 * 86_400,
    },
    // New York: 2026-03-08 is 23 hours long (clocks go forward at 02:00).
    Boundary {
        quota: "day",
        zone: "America/New_York",
        start: "2026-03-08T04:59:55Z",
        resets_at: "2026-03-08T00:00:00-05:00",
        next_len: 23 * 3_600,
    },
    // ... and 2026-11-01 is 25 hours long (clocks go back at 02:00).
    Boundary {
        quota: "day",
        zone: "America/New_York",
        start: "2026-11-01T03:59:55Z",
        resets_at: "2026-11-01T00:00:00-04:00",
        next_len: 25 * 3_600,
    },
    // A month in a zone east of UTC ends at 23:00 UTC.
    Boundary {
        quota: "month",
        zone: "Europe/Berlin",
        start: "2026-11-30T22:59:55Z",
        resets_at: "2026-12-01T00:00:00+01:00",
        next_len: 31 * 86_400,
    },
];

/// Two requests use up the quota, the third gets the quota's 429 naming the reset instant,
/// and once the boundary passes (on sluice's clock) a request is admitted again, in a period
/// of the expected length.
async fn quota_resets_at_the_boundary(store: &Store, case: &Boundary) {
    let limit = Limit::quota("plan", 2, case.quota).set("time_zone", case.zone);
    // Two cases can count in the same period (January's next is February's own).
    let route = format!("b{}", case.start.replace([':', '-'], ""));
    let (sluice, spawned) = sluice_at(store, &route, case.start, vec![limit]).await;
    for n in 0..2 {
        assert_eq!(
            get(&sluice).await.status(),
            200,
            "{}: request {n}",
            case.start
        );
    }
    let refused = get(&sluice).await;
    assert_eq!(refused.status(), 429, "{}", case.start);
    let retry_after: u64 = header(&refused, "retry-after").parse().expect("seconds");
    assert!(
        (1..=LEAD.as_secs()).contains(&retry_after),
        "{}: {retry_after} s (far more: sluice took over {LEAD:?} to start, and the period \
         had ended)",
        case.start
    );
    let body: serde_json::Value = refused.json().await.expect("a problem body");
    assert_eq!(body["type"], QUOTA_TYPE, "{body}");
    assert_eq!(body["resets_at"], case.resets_at, "{}: {body}", case.start);
    assert_eq!(body["quota"], case.quota);

    let admitted = std::sync::Mutex::new(None);
    wait_for(Duration::from_secs(30), "the quota's reset", || {
        let (sluice, admitted) = (&sluice, &admitted);
        async move {
            let response = get(sluice).await;
            if response.status() != 200 {
                return false;
            }
            let t = rate_limit_t(&response);
            *admitted.lock().expect("unpoisoned") = Some(t);
            true
        }
    })
    .await;
    let t = admitted
        .into_inner()
        .expect("unpoisoned")
        .expect("admitted after the reset");
    assert_seconds_left(
        t,
        case.next_len,
        spawned.elapsed().saturating_sub(LEAD),
        &format!("the period after {}", case.resets_at),
    );
}

async fn every_boundary(kind: StoreKind) {
    let store = Store::start(kind).await;
    let cases = BOUNDARIES
        .iter()
        .map(|case| quota_resets_at_the_boundary(&store, case));
    futures_util::future::join_all(cases).await;
    if let Some(redis) = &store.redis {
        // A period's key lives until the period ends plus a minute; the longest period
        // here, a month, ends within 31 days of now on each case's clock.
        assert!(
            redis
                .assert_every_key_expires(Duration::from_secs(31 * 86_400 + 60))
                .await
                > 0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_reset_at_month_week_and_dst_day_boundaries_memory() {
    every_boundary(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_reset_at_month_week_and_dst_day_boundaries_redis() {
    every_boundary(StoreKind::Redis).await;
}

/// At the start of a 23-hour and a 25-hour day in New York, Retry-After and the RateLimit
/// `t` are the day's true length, and the 429 is the quota's problem: its own type and
/// title, the period, zone and reset instant.
async fn retry_after_is_exact_across_a_dst_day(kind: StoreKind) {
    let store = Store::start(kind).await;
    for (start, left, resets_at) in [
        (
            "2026-03-08T05:00:00Z",
            23 * 3_600,
            "2026-03-09T00:00:00-04:00",
        ),
        (
            "2026-11-01T04:00:00Z",
            25 * 3_600,
            "2026-11-02T00:00:00-05:00",
        ),
    ] {
        let (sluice, spawned) = sluice_at(
            &store,
            &format!("d{}", &start[..10]),
            start,
            vec![Limit::quota("daily", 1, "day").set("time_zone", "America/New_York")],
        )
        .await;
        assert!(
            sluice.log().contains("SLUICE_TEST_CLOCK_START is set"),
            "the test clock is announced at warn: {}",
            sluice.log()
        );
        let first = get(&sluice).await;
        assert_eq!(first.status(), 200);
        assert_seconds_left(rate_limit_t(&first), left, spawned.elapsed(), start);
        // The policy's `w` is the period's nominal length (a day: 86400 s).
        assert_eq!(header(&first, "ratelimit-policy"), "\"daily\";q=1;w=86400");
        let refused = get(&sluice).await;
        assert_eq!(refused.status(), 429);
        assert_eq!(header(&refused, "content-type"), "application/problem+json");
        let retry_after: u64 = header(&refused, "retry-after").parse().expect("seconds");
        assert_seconds_left(retry_after, left, spawned.elapsed(), start);
        assert_eq!(rate_limit_t(&refused), retry_after);
        let body: serde_json::Value = refused.json().await.expect("a problem body");
        assert_eq!(body["type"], QUOTA_TYPE, "{body}");
        assert_eq!(body["title"], "Quota exhausted");
        assert_eq!(body["status"], 429);
        assert_eq!(body["limit"], "daily");
        assert_eq!(body["quota"], "day");
        assert_eq!(body["time_zone"], "America/New_York");
        assert_eq!(body["resets_at"], resets_at, "{body}");
        assert_eq!(body["retry_after"], retry_after);
        let detail = body["detail"].as_str().expect("a detail");
        assert!(
            detail.contains("1 requests per day, America/New_York")
                && detail.contains(&format!("resets at {resets_at}")),
            "{detail}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_exact_across_a_dst_day_memory() {
    retry_after_is_exact_across_a_dst_day(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_exact_across_a_dst_day_redis() {
    retry_after_is_exact_across_a_dst_day(StoreKind::Redis).await;
}

/// A quota with `count:` gives back what it does not count: failed logins (401) cost
/// nothing, and the counter in Redis is the period's key, expiring a minute after the period.
async fn a_quota_gives_back_what_it_does_not_count(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let store = Store::start(kind).await;
    let yaml = Policy::new()
        .store(&store)
        .upstream("api", upstream.url())
        .route(
            Route::new("login", "/")
                .upstream("api")
                .limit(Limit::quota("monthly", 2, "month").count_status(["2xx"])),
        );
    let spawned = Instant::now();
    let sluice = Sluice::start_with_env(&yaml, &[(CLOCK, "2026-11-30T23:00:00Z")]).await;
    let c = client();
    let login = |password: &'static str| {
        let c = c.clone();
        let url = format!("{}/login?password={password}", sluice.url());
        async move {
            c.get(url)
                .send()
                .await
                .expect("an answer")
                .status()
                .as_u16()
        }
    };
    for n in 0..5 {
        assert_eq!(login("wrong").await, 401, "failure {n} is given back");
    }
    assert_eq!(login("right").await, 200);
    assert_eq!(login("right").await, 200);
    assert_eq!(login("right").await, 429, "two successes use up the quota");
    assert_eq!(login("wrong").await, 429);
    assert_eq!(upstream.hits(), 7);
    // The admin API reads the current period's count without consuming anything.
    let admin: serde_json::Value = c
        .get(format!(
            "{}/admin/v1/limits/login/monthly?client_ip=127.0.0.1",
            sluice.admin_url()
        ))
        .send()
        .await
        .expect("an admin answer")
        .json()
        .await
        .expect("JSON");
    assert_eq!(admin["quota"], "month", "{admin}");
    assert_eq!(admin["period"], "2026-11", "{admin}");
    assert_eq!(admin["resets_at"], "2026-12-01T00:00:00+00:00", "{admin}");
    assert_eq!(admin["count"], 2, "{admin}");
    assert_eq!(admin["remaining"], 0, "{admin}");
    if let Some(redis) = &store.redis {
        let keys = redis.keys().await;
        let key = keys
            .iter()
            .find(|k| k.contains(":monthly:"))
            .unwrap_or_else(|| panic!("no quota key in {keys:?}"));
        assert_eq!(
            key, "sluice-test:login:monthly:calendar:{ip=127.0.0.1}:2026-11",
            "the period's label follows the identity's hash tag"
        );
        let count = redis.cmd(&["GET", key]).await;
        assert_eq!(count, redis::Value::BulkString(b"2".to_vec()));
        let pttl = match redis.cmd(&["PTTL", key]).await {
            redis::Value::Int(ms) => ms as u64,
            other => panic!("PTTL answered {other:?}"),
        };
        // An hour left in November, and a minute's slack.
        let most = 3_600_000 + 60_000;
        let least = most - spawned.elapsed().as_millis() as u64 - 1_000;
        assert!((least..=most).contains(&pttl), "PTTL {pttl} ms");
        assert_eq!(
            redis
                .assert_every_key_expires(Duration::from_millis(most))
                .await,
            1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_gives_back_what_it_does_not_count_memory() {
    a_quota_gives_back_what_it_does_not_count(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_gives_back_what_it_does_not_count_redis() {
    a_quota_gives_back_what_it_does_not_count(StoreKind::Redis).await;
}

/// On a Redis Cluster, a global monthly quota (`{*}`) and a per-user limit live in different
/// slots: a request the quota rejects leaves nothing in the user's limit, and one the user's
/// limit rejects leaves nothing in the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_and_a_limit_in_different_cluster_slots_consume_nothing_on_a_rejection() {
    let cluster = RedisCluster::start().await;
    let yaml = Policy::new().store_cluster(&cluster).route(
        Route::new("api", "/")
            .respond_status(200)
            .on_store_error(OnStoreError::Deny)
            .limit(Limit::requests("per_user", 3, "1m").key(["header:x-user"]))
            .limit(Limit::quota("plan", 4, "month").key([])),
    );
    let sluice = Sluice::start_with_env(&yaml, &[(CLOCK, "2026-11-15T12:00:00Z")]).await;
    let as_user = |user: &'static str| {
        let url = format!("{}/x", sluice.url());
        async move {
            client()
                .get(url)
                .header("x-user", user)
                .send()
                .await
                .expect("an answer")
        }
    };
    let mut alice = Vec::new();
    for _ in 0..5 {
        alice.push(as_user("alice").await.status().as_u16());
    }
    assert_eq!(alice, [200, 200, 200, 429, 429]);
    let quota_key = "sluice-test:api:plan:calendar:{*}:2026-11";
    let alice_key = "sluice-test:api:per_user:{h:x-user=alice}";
    let slot = |key: &'static str| cluster.slot_of(key);
    assert_ne!(slot(quota_key).await, slot(alice_key).await);
    assert_eq!(
        get_at(&cluster, quota_key).await,
        redis::Value::BulkString(b"3".to_vec()),
        "the quota counted what the user's limit rejected"
    );
    assert_eq!(as_user("bob").await.status(), 200);
    let refused = as_user("bob").await;
    assert_eq!(refused.status(), 429);
    let body: serde_json::Value = refused.json().await.expect("a problem body");
    assert_eq!(body["type"], QUOTA_TYPE, "{body}");
    assert_eq!(body["resets_at"], "2026-12-01T00:00:00+00:00");
    let bob_key = "sluice-test:api:per_user:{h:x-user=bob}";
    let owner = cluster.owner_of(cluster.slot_of(bob_key).await).await;
    assert_eq!(
        command_at(cluster.nodes[owner].port(), &["ZCARD", bob_key])
            .await
            .expect("ZCARD"),
        redis::Value::Int(1),
        "the request the quota rejected was given back in bob's limit"
    );
    assert_eq!(
        get_at(&cluster, quota_key).await,
        redis::Value::BulkString(b"4".to_vec())
    );
    // Each slot's give-back left its key with an expiry, on whichever node holds it.
    assert!(
        cluster
            .assert_every_key_expires(Duration::from_secs(31 * 86_400 + 60))
            .await
            >= 3
    );
}

/// `sluice explain` names the quota, its zone and the reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_quota_and_its_reset() {
    let config = write_config(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: free, key: [client_ip], requests: 10000, quota: month, time_zone: Europe/Berlin }\n",
    );
    let path = config.path().to_str().expect("a path").to_owned();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(support::SLUICE_BIN)
            .args(["explain", "--config", &path, "GET", "/x"])
            .env(CLOCK, "2026-11-15T12:00:00Z")
            .output()
            .expect("run explain")
    })
    .await
    .expect("joined");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains(
            "free: 10000 per month (Europe/Berlin), resets at 2026-12-01T00:00:00+01:00 (calendar)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("{ip=127.0.0.1}:2026-11"), "{stdout}");
}

/// A test clock that is not an instant stops sluice instead of being ignored.
#[test]
fn a_test_clock_that_is_not_an_instant_is_refused() {
    let config = write_config(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n",
    );
    for command in ["explain", "run"] {
        let mut args = vec![command, "--config", config.path().to_str().expect("a path")];
        if command == "explain" {
            args.extend(["GET", "/x"]);
        }
        let mut child = std::process::Command::new(support::SLUICE_BIN)
            .args(&args)
            .env(CLOCK, "next tuesday")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run sluice");
        // Bounded: a sluice that ignored the value would serve until killed.
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("`sluice {command}` ignored a bad {CLOCK} and kept running");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let output = child.wait_with_output().expect("its output");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{command} started: {stderr}");
        assert!(
            stderr.contains("SLUICE_TEST_CLOCK_START=\"next tuesday\" is not an RFC 3339 instant"),
            "{command}: {stderr}"
        );
    }
}

/// `sluice check` refuses what a quota cannot be, naming file, line, column and field.
#[test]
fn check_refuses_what_a_quota_cannot_be() {
    let head = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\nroutes:\n  - name: api\n    match:\n      path_prefix: /\n    respond:\n      status: 200\n    limits:\n      - name: plan\n        key: [client_ip]\n        requests: 10\n";
    for (extra, at, field, says) in [
        (
            "        quota: month\n        time_zone: Mars/Olympus\n",
            "14:20",
            "routes[0].limits[0].time_zone",
            "unknown time zone `Mars/Olympus`",
        ),
        (
            "        window: 1m\n        quota: month\n",
            "14:16",
            "routes[0].limits[0].quota",
            "either a rolling `window` or a calendar `quota`",
        ),
        (
            "        quota: week\n        algorithm: gcra\n",
            "14:20",
            "routes[0].limits[0].algorithm",
            "remove `algorithm`",
        ),
        (
            "        quota: day\n        on_exceed: delay\n        max_delay: 1s\n",
            "14:20",
            "routes[0].limits[0].on_exceed",
            "cannot delay",
        ),
        (
            "        quota: day\n        burst: 5\n",
            "14:16",
            "routes[0].limits[0].burst",
            "`burst` applies to `algorithm: gcra` only",
        ),
        (
            "        window: 1m\n        time_zone: UTC\n",
            "14:20",
            "routes[0].limits[0].time_zone",
            "applies to a calendar `quota` only",
        ),
        (
            "        quota: year\n",
            "13:16",
            "routes[0].limits[0].quota",
            "",
        ),
        (
            "",
            "10:15",
            "routes[0].limits[0].window",
            "needs a `window`",
        ),
    ] {
        let file = write_config(&format!("{head}{extra}"));
        let (status, _, stderr) = sluice_check(file.path());
        assert!(!status.success(), "accepted:\n{extra}");
        let expected = format!("{}:{at}: {field}: ", file.path().display());
        assert!(
            stderr.contains(&expected) && stderr.contains(says),
            "for\n{extra}expected `{expected}...{says}`, got: {stderr}"
        );
    }
}

/// GET `key` on the cluster node that owns its slot.
async fn get_at(cluster: &RedisCluster, key: &str) -> redis::Value {
    let owner = cluster.owner_of(cluster.slot_of(key).await).await;
    command_at(cluster.nodes[owner].port(), &["GET", key])
        .await
        .expect("GET")
}
