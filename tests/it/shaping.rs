//! `on_exceed: delay`: requests a limit would reject, but would admit within `max_delay`, are
//! held and forwarded at the time the store recorded them at. Run against two sluice
//! instances sharing one real redis-server, and against the in-process store with one
//! instance, with a real upstream that timestamps every request it receives:
//! - under a concurrent flood, no window of the configured length holds more than `requests`
//!   forwarded requests (sliding_log), and forwarded requests keep GCRA's spacing (gcra);
//!   requests whose wait is past `max_delay` get 429;
//! - `max_delayed` bounds the requests a route holds at once;
//! - a held client that disconnects gives its place back.
//!
//! What the upstream sees trails the store's record times by a loopback hop and scheduling,
//! differently for each request; the windows checked are `SLACK` shorter than the limit's
//! (and GCRA's spacing `SLACK` looser) to allow for it.

use crate::support;

use std::time::{Duration, Instant};

use support::{
    client, metric_sum, parse_metrics, Limit, Policy, Redis, Route, Sluice, Store, StoreKind,
    Upstream,
};

const SLACK: Duration = Duration::from_millis(80);

/// How much longer than `max_delay` a held request may take from send to answer: its
/// decision (one store call), the forwarding and the answer, on a loaded 2-core machine.
const HOLD_SLACK: Duration = Duration::from_millis(500);

/// The value of the one series `name{labels}`; a missing series fails the test rather than
/// reading 0.
fn series(metrics: &[support::Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found = support::samples(metrics, name, labels);
    assert_eq!(found.len(), 1, "one series {name}{labels:?}: {found:?}");
    found[0].value
}

/// `sluice_limit_decisions_total{route="api", decision}` summed over every instance.
async fn decisions(sluices: &[Sluice], decision: &str) -> f64 {
    let mut total = 0.0;
    for sluice in sluices {
        let metrics = parse_metrics(&sluice.metrics().await);
        total += metric_sum(
            &metrics,
            "sluice_limit_decisions_total",
            &[("route", "api"), ("decision", decision)],
        );
    }
    total
}

/// One route `api` to `upstream` with `limits`; `max_delayed`: the route's, if set.
fn policy(
    store: Policy,
    upstream: &Upstream,
    limits: Vec<Limit>,
    max_delayed: Option<u32>,
) -> Policy {
    let mut route = Route::new("api", "/").upstream("api");
    if let Some(max) = max_delayed {
        route = route.set("max_delayed", max);
    }
    store
        .upstream("api", upstream.url())
        .route(limits.into_iter().fold(route, Route::limit))
}

/// `requests` per `window` by method, an over-limit request held up to `max_delay`.
fn shaped(name: &str, requests: u32, window: &str, max_delay: &str) -> Limit {
    Limit::requests(name, requests, window)
        .key(["method"])
        .delay(max_delay)
}

/// One instance on the in-process store, or two sharing one Redis.
async fn instances(
    kind: StoreKind,
    yaml: impl Fn(Policy) -> Policy,
) -> (Option<Redis>, Vec<Sluice>) {
    let store = Store::start(kind).await;
    let count = if store.redis.is_some() { 2 } else { 1 };
    let mut sluices = Vec::new();
    for _ in 0..count {
        sluices.push(Sluice::start(&yaml(Policy::new().store(&store))).await);
    }
    (store.redis, sluices)
}

/// Sends `waves` waves of `per_wave` concurrent requests, `gap` apart, spread over the
/// instances; returns (status, time from send to answer) of each.
async fn flood(
    sluices: &[Sluice],
    waves: usize,
    per_wave: usize,
    gap: Duration,
) -> Vec<(u16, Duration)> {
    let c = client();
    let mut tasks = Vec::new();
    for wave in 0..waves {
        for n in 0..per_wave {
            let url = format!("{}/flood", sluices[(wave + n) % sluices.len()].url());
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let sent = Instant::now();
                let status = c
                    .get(url)
                    .send()
                    .await
                    .expect("an answer")
                    .status()
                    .as_u16();
                (status, sent.elapsed())
            }));
        }
        tokio::time::sleep(gap).await;
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// The most arrivals in any window `[t, t + length)` starting at an arrival.
fn busiest_window(arrivals: &[Instant], length: Duration) -> usize {
    let mut sorted = arrivals.to_vec();
    sorted.sort();
    (0..sorted.len())
        .map(|i| {
            sorted[i..]
                .iter()
                .take_while(|&&t| t < sorted[i] + length)
                .count()
        })
        .max()
        .unwrap_or(0)
}

async fn a_shaped_flood_never_crowds_a_window(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let limit = shaped("shaped", 5, "1s", "1500ms");
    let (_redis, sluices) =
        instances(kind, |s| policy(s, &upstream, vec![limit.clone()], None)).await;
    // 36 requests within about 0.5 s against 5 per second, held up to 1.5 s: about 5 now,
    // 10 held, the rest refused.
    let answers = flood(&sluices, 6, 6, Duration::from_millis(100)).await;
    let forwarded = answers.iter().filter(|(s, _)| *s == 200).count();
    let refused = answers.iter().filter(|(s, _)| *s == 429).count();
    assert_eq!(forwarded + refused, answers.len(), "{answers:?}");
    assert_eq!(upstream.hits(), forwarded);
    let busiest = busiest_window(&upstream.arrivals(), Duration::from_secs(1) - SLACK);
    assert!(
        busiest <= 5,
        "{busiest} forwarded within one window; {answers:?}"
    );
    assert!(
        forwarded >= 10,
        "requests were delayed, not refused: {answers:?}"
    );
    assert!(
        refused >= 10,
        "waits past max_delay are refused: {answers:?}"
    );
    let longest = answers
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, d)| *d)
        .max()
        .unwrap();
    assert!(longest > Duration::from_millis(900), "held: {longest:?}");
    assert!(
        longest < Duration::from_millis(1500) + HOLD_SLACK,
        "{longest:?}"
    );
    // Over every instance: each forwarded request was admitted now or delayed, each refused
    // one rejected, and every delay applied is in the histogram.
    let (admitted, delayed) = (
        decisions(&sluices, "admitted").await,
        decisions(&sluices, "delayed").await,
    );
    assert_eq!(admitted + delayed, forwarded as f64, "{answers:?}");
    assert_eq!(
        decisions(&sluices, "rejected").await,
        refused as f64,
        "{answers:?}"
    );
    // Five fit in the first second; every other forwarded request was held.
    assert_eq!(admitted, 5.0, "{answers:?}");
    let mut observed = 0.0;
    for sluice in &sluices {
        let metrics = parse_metrics(&sluice.metrics().await);
        observed += series(&metrics, "sluice_delay_seconds_count", &[("route", "api")]);
    }
    assert_eq!(observed, delayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shaped_flood_never_crowds_a_window_redis() {
    let _heavy = support::heavy().await;
    a_shaped_flood_never_crowds_a_window(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shaped_flood_never_crowds_a_window_memory() {
    let _heavy = support::heavy().await;
    a_shaped_flood_never_crowds_a_window(StoreKind::Memory).await;
}

/// GCRA with burst b and emission interval T admits at most b at once, then one per T: any
/// k forwarded requests in a row span at least (k − b)·T.
async fn a_shaped_flood_keeps_gcra_spacing(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let limit = shaped("shaped", 5, "1s", "1s").algorithm("gcra").burst(2);
    let (_redis, sluices) =
        instances(kind, |s| policy(s, &upstream, vec![limit.clone()], None)).await;
    let answers = flood(&sluices, 5, 5, Duration::from_millis(80)).await;
    let forwarded = answers.iter().filter(|(s, _)| *s == 200).count();
    let mut arrivals = upstream.arrivals();
    arrivals.sort();
    assert_eq!(arrivals.len(), forwarded);
    let t = Duration::from_millis(200);
    for i in 0..arrivals.len() {
        for j in i + 2..arrivals.len() {
            let k = (j - i + 1) as u32;
            let least = t * (k - 2);
            assert!(
                arrivals[j] - arrivals[i] + SLACK >= least,
                "{k} in a row within {:?}, less than {least:?}",
                arrivals[j] - arrivals[i]
            );
        }
    }
    assert!(forwarded >= 6, "delayed, not refused: {answers:?}");
    assert!(
        answers.iter().any(|(s, _)| *s == 429),
        "past max_delay: 429: {answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shaped_flood_keeps_gcra_spacing_redis() {
    let _heavy = support::heavy().await;
    a_shaped_flood_keeps_gcra_spacing(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shaped_flood_keeps_gcra_spacing_memory() {
    let _heavy = support::heavy().await;
    a_shaped_flood_keeps_gcra_spacing(StoreKind::Memory).await;
}

async fn max_delayed_bounds_the_requests_held(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let limit = shaped("shaped", 1, "1s", "10s");
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &upstream,
        vec![limit],
        Some(2),
    ))
    .await;
    let c = client();
    assert_eq!(
        c.get(format!("{}/a", sluice.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // Five more at once: each would wait a second longer than the one before; two are held.
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (c, url) = (c.clone(), format!("{}/b", sluice.url()));
            tokio::spawn(async move {
                let r = c.get(url).send().await.unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    // While they are held (the first for about a second), the gauge shows both.
    support::wait_for(
        Duration::from_secs(5),
        "sluice_held_requests{route=\"api\"} = 2",
        || async {
            let metrics = parse_metrics(&sluice.metrics().await);
            series(&metrics, "sluice_held_requests", &[("route", "api")]) == 2.0
        },
    )
    .await;
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    let held = answers.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!(held, 2, "{answers:?}");
    let refused: Vec<&String> = answers
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, body)| body)
        .collect();
    assert_eq!(refused.len(), 3, "{answers:?}");
    for body in refused {
        assert!(body.contains("max_delayed"), "{body}");
    }
    // The three refused gave their places back: the store holds the first three only (at
    // 0 s, 1 s, 2 s), so the next request, sent when the last held one is answered, waits
    // about a second (and, on Redis, the lateness bound, `REDIS_TIMEOUT`: the exact log
    // counts an entry that much past its window), not the four seconds five more entries
    // would make it wait. It read 1.500-1.504 s against a bound of 1.5 s under load.
    let sent = Instant::now();
    assert_eq!(
        c.get(format!("{}/c", sluice.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(
        sent.elapsed() < Duration::from_secs(1) + support::REDIS_TIMEOUT + Duration::from_secs(1),
        "{:?}",
        sent.elapsed()
    );
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        series(&metrics, "sluice_held_requests", &[("route", "api")]),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_delayed_bounds_the_requests_held_redis() {
    let _heavy = support::heavy().await;
    max_delayed_bounds_the_requests_held(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_delayed_bounds_the_requests_held_memory() {
    let _heavy = support::heavy().await;
    max_delayed_bounds_the_requests_held(StoreKind::Memory).await;
}

async fn a_held_client_that_leaves_gives_its_place_back(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let limit = shaped("shaped", 1, "2s", "5s");
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &upstream,
        vec![limit],
        None,
    ))
    .await;
    let c = client();
    let started = Instant::now();
    assert_eq!(
        c.get(format!("{}/first", sluice.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // Held for about 2 s; the client gives up after 300 ms.
    let gave_up = c
        .get(format!("{}/leaves", sluice.url()))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gave_up.is_err(), "the request was held: {gave_up:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(redis) = &store.redis {
        let keys = redis.keys().await;
        let key = keys
            .iter()
            .find(|k| k.contains(":shaped:"))
            .expect("the limit's key");
        let held = redis.cmd(&["ZCARD", key]).await;
        assert_eq!(
            held,
            redis::Value::Int(1),
            "only the first request stays recorded"
        );
    }
    // With the place given back, the next request waits for the first's window only
    // (2 s from the start), not for the one that left (4 s).
    assert_eq!(
        c.get(format!("{}/next", sluice.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert!(
        started.elapsed() < Duration::from_millis(3000),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        upstream.paths(),
        ["/first", "/next"],
        "the one that left was never forwarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_client_that_leaves_gives_its_place_back_redis() {
    let _heavy = support::heavy().await;
    a_held_client_that_leaves_gives_its_place_back(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_client_that_leaves_gives_its_place_back_memory() {
    let _heavy = support::heavy().await;
    a_held_client_that_leaves_gives_its_place_back(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_response_carries_the_fields_as_at_admission() {
    let _heavy = support::heavy().await;
    let upstream = Upstream::start().await;
    let limit = shaped("shaped", 1, "1s", "2s");
    let sluice = Sluice::start(&policy(Policy::new(), &upstream, vec![limit], None)).await;
    let c = client();
    c.get(format!("{}/a", sluice.url())).send().await.unwrap();
    let sent = Instant::now();
    let r = c.get(format!("{}/b", sluice.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        sent.elapsed() > Duration::from_millis(800),
        "held: {:?}",
        sent.elapsed()
    );
    // At admission the limit was full, and had room again in two windows' time (the entry
    // recorded a second ahead leaves a second after that).
    assert_eq!(support::header(&r, "ratelimit"), "\"shaped\";r=0;t=2");
}

/// README: with several limits, the request is recorded at the longest wait among its delay
/// limits, every other limit must admit it now, and all record it at that same time. Two
/// delay limits (1 per second, 1 per 2 s) and a rejecting one (2 per minute): the second
/// request waits the longer 2 s and is recorded at exactly that instant in both logs; the
/// third, which the delay limits could hold, is refused at once because the rejecting limit
/// is full.
async fn several_limits_record_at_the_longest_wait(kind: StoreKind) {
    let upstream = Upstream::start().await;
    let limits = vec![
        shaped("fast", 1, "1s", "5s"),
        shaped("slow", 1, "2s", "5s"),
        Limit::requests("cap", 2, "1m").key(["method"]),
    ];
    let store = Store::start(kind).await;
    let sluice = Sluice::start(&policy(
        Policy::new().store(&store),
        &upstream,
        limits,
        None,
    ))
    .await;
    let c = client();
    let get = |path: &'static str| {
        let (c, url) = (c.clone(), format!("{}{path}", sluice.url()));
        async move {
            let sent = Instant::now();
            let r = c.get(url).send().await.expect("an answer");
            (
                r.status().as_u16(),
                sent.elapsed(),
                r.text().await.expect("a body"),
            )
        }
    };
    let first_sent = Instant::now();
    let (status, _, _) = get("/first").await;
    assert_eq!(status, 200);
    // The second is recorded 2 s after the first was (which was after `first_sent`), so it
    // is held at least 2 s less the time between the two sends. In Redis the first counts
    // from the lateness bound after it was decided (it may reach the upstream that late), so
    // the second is held that much longer.
    let hold = Duration::from_secs(2) + store.lateness();
    let since_first = first_sent.elapsed();
    let (status, took, body) = get("/second").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        took + since_first + SLACK >= hold && took < hold + HOLD_SLACK,
        "held for the longer wait, {hold:?}: {took:?} ({since_first:?} after the first)"
    );
    // Read before the next decision drops `fast`'s first entry, older than its window.
    if let Some(redis) = &store.redis {
        let keys = redis.keys().await;
        let scores = |limit: &'static str| {
            let key = keys
                .iter()
                .find(|k| k.contains(&format!(":{limit}:")))
                .unwrap_or_else(|| panic!("{limit}'s key in {keys:?}"))
                .clone();
            async move {
                let redis::Value::Array(items) =
                    redis.cmd(&["ZRANGE", &key, "0", "-1", "WITHSCORES"]).await
                else {
                    panic!("ZRANGE {key}");
                };
                items
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .map(|v| match v {
                        redis::Value::BulkString(b) => {
                            String::from_utf8_lossy(b).parse::<f64>().expect("a score") as u64
                        }
                        redis::Value::Double(d) => *d as u64,
                        other => panic!("score {other:?}"),
                    })
                    .collect::<Vec<u64>>()
            }
        };
        let (fast, slow) = (scores("fast").await, scores("slow").await);
        assert_eq!(fast.len(), 2, "{fast:?}");
        assert_eq!(fast, slow, "both limits record the same instants");
        assert_eq!(
            Duration::from_micros(fast[1] - fast[0]),
            hold,
            "the second is recorded when `slow` (2 s) has room, not `fast` (1 s)"
        );
    }
    let (status, took, body) = get("/third").await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("`cap`"), "the full limit refuses it: {body}");
    assert!(
        took < Duration::from_millis(900),
        "refused now, not held: {took:?}"
    );
    assert_eq!(upstream.paths(), ["/first", "/second"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_limits_record_at_the_longest_wait_redis() {
    let _heavy = support::heavy().await;
    several_limits_record_at_the_longest_wait(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_limits_record_at_the_longest_wait_memory() {
    let _heavy = support::heavy().await;
    several_limits_record_at_the_longest_wait(StoreKind::Memory).await;
}
