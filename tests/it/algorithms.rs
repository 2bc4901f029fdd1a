//! One table of limits and request sequences, run against both stores (Redis and in-process)
//! with the same expected answers: each algorithm (sliding_log, sliding_window, fixed_window,
//! gcra), costs, shadow limits, and a request whose limits mix algorithms. Requests are sent back to back
//! against one-minute windows, so every expected figure holds for any run that takes less than
//! a second per step (the sliding window's `t` depends on where the fixed window boundary
//! falls, so it is checked against its bounds).

use crate::support;

use std::ops::RangeInclusive;

use support::{
    header, metric_sum, parse_limit_field, parse_metrics, Limit, Policy, Route, Sluice, Store,
    StoreKind,
};

/// One request's expected answer: status, then per limit of the route (in order) the
/// `RateLimit` item's `r` and the range its `t` falls in, then Retry-After for a 429.
struct Step {
    status: u16,
    limits: &'static [(i64, RangeInclusive<i64>)],
    retry_after: Option<RangeInclusive<i64>>,
}

const fn ok(limits: &'static [(i64, RangeInclusive<i64>)]) -> Step {
    Step {
        status: 200,
        limits,
        retry_after: None,
    }
}

const fn denied(
    limits: &'static [(i64, RangeInclusive<i64>)],
    retry_after: RangeInclusive<i64>,
) -> Step {
    Step {
        status: 429,
        limits,
        retry_after: Some(retry_after),
    }
}

struct Case {
    name: &'static str,
    /// The route's limits.
    limits: Vec<Limit>,
    steps: Vec<Step>,
}

fn table() -> Vec<Case> {
    vec![
        Case {
            name: "sliding-log",
            limits: vec![Limit::requests("a", 3, "1m")],
            steps: vec![
                ok(&[(2, 60..=60)]),
                ok(&[(1, 60..=60)]),
                ok(&[(0, 60..=60)]),
                denied(&[(0, 60..=60)], 60..=60),
            ],
        },
        Case {
            name: "sliding-window",
            limits: vec![Limit::requests("a", 3, "1m").algorithm("sliding_window")],
            // A fresh key counts only in the current fixed window, which ends within 60 s;
            // from then on its count weighs less each second: one more fits after the current
            // window plus (1 − (requests − remaining − 1) / count) of the next.
            steps: vec![
                ok(&[(2, 60..=120)]),
                ok(&[(1, 30..=90)]),
                ok(&[(0, 20..=80)]),
                denied(&[(0, 20..=80)], 20..=80),
            ],
        },
        Case {
            name: "fixed-window",
            limits: vec![Limit::requests("a", 3, "1m").algorithm("fixed_window")],
            steps: vec![
                ok(&[(2, 60..=60)]),
                ok(&[(1, 60..=60)]),
                ok(&[(0, 60..=60)]),
                denied(&[(0, 60..=60)], 60..=60),
            ],
        },
        Case {
            name: "gcra",
            // T = 6 s, bursts of 3.
            limits: vec![Limit::requests("a", 10, "1m").algorithm("gcra").burst(3)],
            steps: vec![
                ok(&[(2, 6..=6)]),
                ok(&[(1, 6..=6)]),
                ok(&[(0, 6..=6)]),
                denied(&[(0, 6..=6)], 6..=6),
            ],
        },
        Case {
            name: "gcra-default-burst",
            // burst defaults to requests: 4 at once, then one each 15 s.
            limits: vec![Limit::requests("a", 4, "1m").algorithm("gcra")],
            steps: vec![
                ok(&[(3, 15..=15)]),
                ok(&[(2, 15..=15)]),
                ok(&[(1, 15..=15)]),
                ok(&[(0, 15..=15)]),
                denied(&[(0, 15..=15)], 15..=15),
            ],
        },
        Case {
            name: "sliding-log-cost",
            limits: vec![Limit::requests("a", 5, "1m").cost(2)],
            steps: vec![
                ok(&[(3, 60..=60)]),
                ok(&[(1, 60..=60)]),
                denied(&[(1, 60..=60)], 60..=60),
            ],
        },
        Case {
            name: "fixed-window-cost",
            limits: vec![Limit::requests("a", 5, "1m")
                .cost(2)
                .algorithm("fixed_window")],
            steps: vec![
                ok(&[(3, 60..=60)]),
                ok(&[(1, 60..=60)]),
                denied(&[(1, 60..=60)], 60..=60),
            ],
        },
        Case {
            name: "gcra-cost",
            // T = 15 s, burst 4, each request counts 2: the third waits two intervals.
            limits: vec![Limit::requests("a", 4, "1m")
                .cost(2)
                .algorithm("gcra")
                .burst(4)],
            steps: vec![
                ok(&[(2, 15..=15)]),
                ok(&[(0, 15..=15)]),
                denied(&[(0, 15..=15)], 30..=30),
            ],
        },
        Case {
            name: "mixed",
            // The log rejects the third request; the others record nothing for it.
            limits: vec![
                Limit::requests("log", 2, "1m"),
                Limit::requests("bucket", 10, "1m")
                    .algorithm("gcra")
                    .burst(5),
                Limit::requests("fixed", 10, "1m").algorithm("fixed_window"),
                Limit::requests("approx", 10, "1m").algorithm("sliding_window"),
            ],
            steps: vec![
                ok(&[(1, 60..=60), (4, 6..=6), (9, 60..=60), (9, 60..=120)]),
                ok(&[(0, 60..=60), (3, 6..=6), (8, 60..=60), (8, 30..=90)]),
                denied(
                    &[(0, 60..=60), (3, 6..=6), (8, 60..=60), (8, 30..=90)],
                    60..=60,
                ),
            ],
        },
        Case {
            name: "shadow",
            // The shadow limit is full after one request, yet never rejects; the real one
            // rejects the fourth. The shadow limit records only the request it had room for.
            limits: vec![
                Limit::requests("trial", 1, "1m").algorithm("gcra").shadow(),
                Limit::requests("real", 3, "1m"),
            ],
            steps: vec![
                ok(&[(0, 60..=60), (2, 60..=60)]),
                ok(&[(0, 60..=60), (1, 60..=60)]),
                ok(&[(0, 60..=60), (0, 60..=60)]),
                denied(&[(0, 60..=60), (0, 60..=60)], 60..=60),
            ],
        },
    ]
}

/// One route per `(name, limit)`, at `/NAME`, answering 200 itself under that one limit.
fn one_limit_each(store: &Store, routes: impl IntoIterator<Item = (String, Limit)>) -> Policy {
    routes
        .into_iter()
        .fold(Policy::new().store(store), |policy, (name, limit)| {
            policy.route(
                Route::new(&name, &format!("/{name}"))
                    .respond(200, "ok")
                    .limit(limit),
            )
        })
}

fn config(store: &Store, cases: &[Case]) -> Policy {
    cases
        .iter()
        .fold(Policy::new().store(store), |policy, case| {
            let route = Route::new(case.name, &format!("/{}", case.name)).respond(200, "ok");
            policy.route(case.limits.iter().cloned().fold(route, Route::limit))
        })
}

async fn run_table(kind: StoreKind) -> Store {
    let cases = table();
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&config(&store, &cases)).await;
    let client = support::client();
    for case in &cases {
        for (index, step) in case.steps.iter().enumerate() {
            let at = format!("{kind:?} {} step {index}", case.name);
            let resp = client
                .get(format!("{}/{}", sluice.url(), case.name))
                .send()
                .await
                .unwrap_or_else(|e| panic!("{at}: {e}"));
            assert_eq!(resp.status().as_u16(), step.status, "{at}");
            let items = parse_limit_field(header(&resp, "ratelimit"));
            assert_eq!(items.len(), step.limits.len(), "{at}: {items:?}");
            // In Redis a log's reset is the lateness bound longer (in whole seconds, rounded
            // up: one more).
            let later = |limit: &Limit| i64::from(limit.is_log() && !store.lateness().is_zero());
            for ((item, (remaining, reset)), limit) in
                items.iter().zip(step.limits).zip(&case.limits)
            {
                assert_eq!(item.param("r"), *remaining, "{at}: {item:?}");
                assert!(
                    reset.contains(&(item.param("t") - later(limit))),
                    "{at}: {item:?}"
                );
            }
            if let Some(retry_after) = &step.retry_after {
                // The longest wait of the rejecting limits: which those are, the table says
                // only through its figure, so a log's second more is allowed either way.
                let seconds: i64 = header(&resp, "retry-after").parse().unwrap();
                let logs = case.limits.iter().any(|limit| later(limit) == 1);
                let seconds = if logs && !retry_after.contains(&seconds) {
                    seconds - 1
                } else {
                    seconds
                };
                assert!(
                    retry_after.contains(&seconds),
                    "{at}: retry-after {seconds}"
                );
                let body: serde_json::Value = resp.json().await.unwrap();
                assert_ne!(body["limit"], "trial", "{at}: a shadow limit never rejects");
            }
        }
    }
    let metrics = parse_metrics(&sluice.metrics().await);
    let count = |limit: &str, decision: &str| {
        metric_sum(
            &metrics,
            "sluice_limit_decisions_total",
            &[
                ("route", "shadow"),
                ("limit", limit),
                ("decision", decision),
            ],
        )
    };
    assert_eq!(count("trial", "shadow_rejected"), 3.0, "{kind:?}");
    assert_eq!(count("trial", "admitted"), 1.0, "{kind:?}");
    assert_eq!(count("real", "rejected"), 1.0, "{kind:?}");
    // Every answer came from the store under test, none from a fallback after a script error.
    assert_eq!(
        metric_sum(&metrics, "sluice_store_errors_total", &[]),
        0.0,
        "{kind:?}"
    );
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_answers_the_same_in_redis() {
    let store = run_table(StoreKind::Redis).await;
    let redis = store.redis.as_ref().expect("a Redis store");
    // After the mixed route's rejection, each key holds the two admissions only.
    let key = |limit: &str| format!("sluice-test:mixed:{limit}{{ip=127.0.0.1}}");
    assert_eq!(
        redis.cmd(&["ZCARD", &key("log:")]).await,
        redis::Value::Int(2)
    );
    assert_eq!(
        redis.cmd(&["GET", &key("fixed:fixed_window:")]).await,
        redis::Value::BulkString(b"2".to_vec())
    );
    assert_eq!(
        redis
            .cmd(&["HGET", &key("approx:sliding_window:"), "c"])
            .await,
        redis::Value::BulkString(b"2".to_vec())
    );
    // Two intervals of 6 s ahead of now (less the time the test took).
    let redis::Value::BulkString(tat) = redis.cmd(&["GET", &key("bucket:gcra:")]).await else {
        panic!("no TAT stored");
    };
    let tat: u64 = String::from_utf8_lossy(&tat).parse().expect("a TAT");
    let redis::Value::Array(time) = redis.cmd(&["TIME"]).await else {
        panic!("TIME");
    };
    let seconds = match &time[0] {
        redis::Value::BulkString(s) => String::from_utf8_lossy(s).parse::<u64>().unwrap(),
        other => panic!("{other:?}"),
    };
    let ahead = tat / 1_000_000 - seconds;
    assert!((10..=12).contains(&ahead), "TAT {ahead} s ahead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_answers_the_same_in_memory() {
    run_table(StoreKind::Memory).await;
}

/// What each algorithm costs Redis, as the README's "Which algorithm" table states it: the
/// bytes one key takes after 100 admissions (`MEMORY USAGE`), and the commands one admitted
/// decision runs inside the script (`INFO commandstats`, less the EVALSHA itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_commands_per_algorithm() {
    let store = Store::start(StoreKind::Redis).await;
    let redis = store.redis.as_ref().expect("a Redis store");
    let algorithms = ["sliding_log", "sliding_window", "fixed_window", "gcra"];
    let sluice = Sluice::start(&one_limit_each(
        &store,
        algorithms.map(|a| (a.to_owned(), Limit::requests("a", 1000, "1h").algorithm(a))),
    ))
    .await;
    let client = support::client();
    let commands = [
        "time",
        "zremrangebyscore",
        "zcard",
        "zrange",
        "zadd",
        "pexpire",
        "hmget",
        "hset",
        "get",
        "pttl",
        "set",
        "incrby",
    ];
    for algorithm in algorithms {
        let url = format!("{}/{algorithm}", sluice.url());
        // The first admission creates the key (it may take other commands); measure the next.
        for _ in 0..99 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        }
        redis.cmd(&["CONFIG", "RESETSTAT"]).await;
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        let mut per_decision = 0;
        for command in commands {
            per_decision += redis.commandstat(command).await;
        }
        assert_eq!(redis.commandstat("evalsha").await, 1, "{algorithm}");
        let suffix = if algorithm == "sliding_log" {
            String::new()
        } else {
            format!("{algorithm}:")
        };
        let key = format!("sluice-test:{algorithm}:a:{suffix}{{ip=127.0.0.1}}");
        let redis::Value::Int(bytes) = redis.cmd(&["MEMORY", "USAGE", &key]).await else {
            panic!("{key} holds nothing");
        };
        println!(
            "{algorithm}: {bytes} bytes after 100 admissions, {per_decision} commands per decision"
        );
        let expected_commands = match algorithm {
            // TIME, ZREMRANGEBYSCORE, ZCARD, ZRANGE, ZADD, PEXPIRE
            "sliding_log" => 6,
            // TIME, HMGET, HSET, PEXPIRE
            "sliding_window" => 4,
            // TIME, GET, PTTL, INCRBY
            "fixed_window" => 4,
            // TIME, GET, SET
            _ => 3,
        };
        assert_eq!(per_decision, expected_commands, "{algorithm}");
        if algorithm == "sliding_log" {
            assert!(bytes > 2000, "{algorithm}: {bytes}");
        } else {
            assert!(bytes < 200, "{algorithm}: {bytes}");
        }
    }
}

/// The deny cache answers a full key of every algorithm from memory (one Redis call, then
/// none while it is denied), but never a shadow limit's "rejection".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_serves_every_algorithm_but_never_a_shadow_limit() {
    let store = Store::start(StoreKind::Redis).await;
    let redis = store.redis.as_ref().expect("a Redis store");
    let routes = [
        ("sliding_log", false),
        ("sliding_window", false),
        ("fixed_window", false),
        ("gcra", false),
        ("shadow", true),
    ];
    let sluice = Sluice::start(&one_limit_each(
        &store,
        routes.map(|(name, shadow)| {
            let algorithm = if shadow { "gcra" } else { name };
            let limit = Limit::requests("a", 2, "1m").algorithm(algorithm);
            (name.to_owned(), if shadow { limit.shadow() } else { limit })
        }),
    ))
    .await;
    let client = support::client();
    for (name, _) in routes {
        let url = format!("{}/{name}", sluice.url());
        for _ in 0..2 {
            assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        }
        redis.cmd(&["CONFIG", "RESETSTAT"]).await;
        let mut statuses = Vec::new();
        for _ in 0..20 {
            statuses.push(client.get(&url).send().await.unwrap().status().as_u16());
        }
        let calls = redis.commandstat("evalsha").await;
        if name == "shadow" {
            assert_eq!(statuses, [200; 20], "{name}");
            assert_eq!(calls, 20, "{name}: every request asks Redis");
        } else {
            assert_eq!(statuses, [429; 20], "{name}");
            assert_eq!(calls, 1, "{name}: one call, then the cache answers");
        }
    }
}

/// A GCRA flood through the cache: one request per 100 ms is let through, never more (the
/// cached denial never outlasts Redis's, nor ends before it). Each request's decision falls
/// between its send and its answer, so for consecutive admissions k, k+1 (decided T apart at
/// least) the later one's answer comes T or more after the earlier one's send; and a refused
/// request was sent less than T after the answer of the last admission before it (else its
/// decision came T after that admission, and it would have been admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_gcra_denial_lasts_exactly_one_interval() {
    use std::time::{Duration, Instant};
    let store = Store::start(StoreKind::Redis).await;
    let policy = Policy::new().store(&store).route(
        Route::new("api", "/")
            .respond(200, "ok")
            .limit(Limit::requests("a", 10, "1s").algorithm("gcra").burst(1)),
    );
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    let url = format!("{}/", sluice.url());
    const T: Duration = Duration::from_millis(100);
    // Redis's clock and this process's may drift apart a little over a second.
    const CLOCKS: Duration = Duration::from_millis(2);
    let started = Instant::now();
    // (sent, answered, admitted) of each request, bounded in count and time.
    let mut requests = Vec::new();
    while started.elapsed() < Duration::from_millis(1050) && requests.len() < 20_000 {
        let sent = Instant::now();
        let status = client.get(&url).send().await.unwrap().status();
        requests.push((sent, Instant::now(), status == 200));
    }
    let admissions: Vec<(Instant, Instant)> = requests
        .iter()
        .filter(|r| r.2)
        .map(|&(sent, answered, _)| (sent, answered))
        .collect();
    assert!(admissions.len() >= 2, "{} admitted", admissions.len());
    for pair in admissions.windows(2) {
        let (earlier_sent, later_answered) = (pair[0].0, pair[1].1);
        assert!(
            later_answered + CLOCKS >= earlier_sent + T,
            "two admissions within {:?}",
            later_answered - earlier_sent
        );
    }
    let mut last_admission: Option<Instant> = None;
    for &(sent, answered, admitted) in &requests {
        if admitted {
            last_admission = Some(answered);
        } else if let Some(answered_before) = last_admission {
            assert!(
                sent < answered_before + T + CLOCKS,
                "refused {:?} after the last admission was answered: the denial outlasted T",
                sent - answered_before
            );
        }
    }
}

/// A large cost on the sliding log (one entry per unit) is recorded in both stores alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_cost_on_the_log_is_recorded_whole() {
    for kind in [StoreKind::Redis, StoreKind::Memory] {
        let store = Store::start(kind).await;
        // Recording 100,000 entries takes Redis longer than the harness's 500 ms timeout on a
        // busy machine; a timed-out call would be decided by the local fallback instead.
        let mut policy = Policy::new().store(&store).route(
            Route::new("api", "/")
                .respond(200, "ok")
                .limit(Limit::requests("a", 250_000, "1m").cost(100_000)),
        );
        if store.redis.is_some() {
            policy = policy.redis_setting("timeout", "10s");
        }
        let sluice = Sluice::start(&policy).await;
        let client = support::client();
        let url = format!("{}/", sluice.url());
        for (status, remaining) in [(200, 150000), (200, 50000), (429, 50000)] {
            let resp = client.get(&url).send().await.unwrap();
            assert_eq!(resp.status(), status, "{kind:?}");
            let items = parse_limit_field(header(&resp, "ratelimit"));
            assert_eq!(items[0].param("r"), remaining, "{kind:?}");
        }
        // Decided by Redis itself, not by the local fallback.
        if let Some(redis) = &store.redis {
            let key = "sluice-test:api:a:{ip=127.0.0.1}";
            assert_eq!(redis.cmd(&["ZCARD", key]).await, redis::Value::Int(200_000));
        }
    }
}

/// When each algorithm's Redis key expires (`PTTL`), as the README states it: so idle keys
/// vanish. A limit of 5 per 10 s, two admissions 300 ms apart:
/// - sliding_log: one window after its last admission;
/// - sliding_window: two windows after its last admission (the next window weighs this one's
///   count);
/// - fixed_window: one window after its first admission (the window's start);
/// - gcra: when its TAT passes: T = 2 s per admission from the first, so 2 T after the first.
///
/// Each admission is recorded between its request's send and its answer, and `PTTL` is read
/// between two instants; the expected interval follows from those, plus 2 ms for rounding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_expires_when_the_readme_says() {
    use std::time::{Duration, Instant};
    let store = Store::start(StoreKind::Redis).await;
    let redis = store.redis.as_ref().expect("a Redis store");
    let algorithms = ["sliding_log", "sliding_window", "fixed_window", "gcra"];
    let sluice = Sluice::start(&one_limit_each(
        &store,
        algorithms.map(|a| (a.to_owned(), Limit::requests("a", 5, "10s").algorithm(a))),
    ))
    .await;
    let client = support::client();
    let window = 10_000.0;
    let ms = |later: Instant, earlier: Instant| {
        if later >= earlier {
            (later - earlier).as_secs_f64() * 1000.0
        } else {
            -((earlier - later).as_secs_f64() * 1000.0)
        }
    };
    for algorithm in algorithms {
        let url = format!("{}/{algorithm}", sluice.url());
        let s1 = Instant::now();
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        let r1 = Instant::now();
        // The gap keeps "after the first admission" and "after the last" apart.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s2 = Instant::now();
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
        let r2 = Instant::now();
        let suffix = if algorithm == "sliding_log" {
            String::new()
        } else {
            format!("{algorithm}:")
        };
        let key = format!("sluice-test:{algorithm}:a:{suffix}{{ip=127.0.0.1}}");
        let p0 = Instant::now();
        let redis::Value::Int(pttl) = redis.cmd(&["PTTL", &key]).await else {
            panic!("PTTL {key}");
        };
        let p1 = Instant::now();
        let pttl = pttl as f64;
        // (earliest recording, latest recording, how long after it the key expires)
        let (from_lo, from_hi, lasts) = match algorithm {
            // Its entries are counted until the lateness bound after their window.
            "sliding_log" => (
                s2,
                r2,
                window + support::REDIS_TIMEOUT.as_secs_f64() * 1000.0,
            ),
            "sliding_window" => (s2, r2, 2.0 * window),
            "fixed_window" => (s1, r1, window),
            _ => (s1, r1, 2.0 * 2_000.0),
        };
        let lo = lasts - ms(p1, from_lo) - 2.0;
        let hi = lasts - ms(p0, from_hi) + 2.0;
        assert!(
            (lo..=hi).contains(&pttl),
            "{algorithm}: PTTL {pttl} ms, expected within [{lo:.0}, {hi:.0}]"
        );
    }
}
