//! The decide script's numbers to the microsecond, through a real Redis. An admission's reply
//! carries Redis's own clock (`decided_us`), from which every limit's remaining and reset
//! follow exactly: here they are computed from those times alone (GCRA's TAT, the logs'
//! oldest entry, the sliding window's weighted count) and compared, for requests with one
//! limit, with several limits of different algorithms, and decided together in one batch.
//! The other tests read the RateLimit header, which rounds to whole seconds and would not
//! see the script's arithmetic drift by a few microseconds.

use crate::support;

use std::time::Duration;

use futures_util::future::join_all;
use sluice::limiter::{Algorithm, Check, Decision, RedisStore, Spec, Store};
use sluice::metrics::Metrics;
use support::Redis;

const WINDOW_US: u64 = 60_000_000;
/// The stores' timeout, which is also their lateness bound: the logs count each admission
/// that much past its window (`decide.lua`'s ARGV[2]).
const TIMEOUT: Duration = Duration::from_secs(2);
const LATENESS_US: u64 = 2_000_000;

fn spec(algorithm: Algorithm, requests: u32, burst: u32, cost: u32) -> Spec {
    Spec {
        algorithm,
        requests,
        window: Duration::from_micros(WINDOW_US),
        burst,
        cost,
        ..Spec::default()
    }
}

/// The limits under test: GCRA (T = 6 s, bursts of 3), the log, the sliding window and the
/// weighted log (each request 7 units of 100).
fn specs() -> Vec<(&'static str, Spec)> {
    vec![
        ("gcra", spec(Algorithm::Gcra, 10, 3, 1)),
        ("log", spec(Algorithm::SlidingLog, 5, 5, 1)),
        ("approx", spec(Algorithm::SlidingWindow, 5, 5, 1)),
        ("weighted", spec(Algorithm::WeightedLog, 100, 100, 7)),
    ]
}

/// `(remaining, reset_us)` right after admissions at `times` (all admitted, none delayed,
/// none left the window), the last one being now.
fn expected(spec: &Spec, times: &[u64]) -> (u32, u64) {
    let now = *times.last().expect("an admission");
    let requests = u64::from(spec.requests);
    let admitted = times.len() as u64;
    match spec.algorithm {
        Algorithm::Gcra => {
            let t = WINDOW_US.div_ceil(requests);
            let tat = times.iter().fold(0, |tat: u64, &at| tat.max(at) + t);
            let ahead = tat - now;
            let burst = u64::from(spec.burst);
            let remaining = (burst * t).saturating_sub(ahead) / t;
            (remaining as u32, ahead - (burst - remaining - 1) * t)
        }
        // Room for one more once the oldest entry has left (the logs are not full).
        Algorithm::SlidingLog => (
            (requests - admitted) as u32,
            times[0] + WINDOW_US + LATENESS_US - now,
        ),
        Algorithm::WeightedLog => (
            (requests - admitted * u64::from(spec.cost)) as u32,
            times[0] + WINDOW_US + LATENESS_US - now,
        ),
        Algorithm::SlidingWindow => {
            // The counts as the script keeps them: the current fixed window's and the
            // previous one's.
            let (mut w, mut cur, mut prev) = (None::<u64>, 0.0_f64, 0.0_f64);
            for &at in times {
                let index = at / WINDOW_US;
                if w == Some(index.wrapping_sub(1)) {
                    prev = cur;
                    cur = 0.0;
                } else if w != Some(index) {
                    prev = 0.0;
                    cur = 0.0;
                }
                cur += f64::from(spec.cost);
                w = Some(index);
            }
            let window = WINDOW_US as f64;
            let elapsed = (now - now / WINDOW_US * WINDOW_US) as f64;
            let count = cur + prev * (1.0 - elapsed / window);
            let remaining = (requests as f64 - count).floor().max(0.0);
            // Time until the weighted count falls to one less than now counted.
            let target = (requests as f64 - remaining - 1.0).max(0.0);
            let reset = if count <= target {
                0.0
            } else if cur <= target {
                (window * (1.0 - (target - cur) / prev) - elapsed).ceil()
            } else {
                ((window - elapsed) + window * (1.0 - target / cur)).ceil()
            };
            (remaining as u32, reset as u64)
        }
        other => panic!("no exact figures for {other:?}"),
    }
}

fn assert_exact(decision: &Decision, index: usize, spec: &Spec, times: &[u64], at: &str) {
    let state = decision.limits[index].unwrap_or_else(|| panic!("{at}: no state"));
    let (remaining, reset) = expected(spec, times);
    assert_eq!(state.remaining, remaining, "{at}: remaining");
    assert_eq!(state.reset, Duration::from_micros(reset), "{at}: reset");
    assert!(!decision.rejecting[index], "{at}: rejecting");
}

fn decided_us(decision: &Decision, at: &str) -> u64 {
    assert!(decision.admitted, "{at}: admitted");
    let admission = decision.admission.as_ref().expect("an admission");
    assert_eq!(admission.at_us, admission.decided_us, "{at}: not delayed");
    admission.decided_us
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admission_is_exact_to_the_microsecond() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = RedisStore::new(&redis.url(), 1, TIMEOUT).expect("a store");
    store.load_script().await.expect("scripts load");
    let store = Store::redis(store, 1000, &metrics);
    let check = |key: String, spec: &Spec| Check { key, spec: *spec };

    // One limit per request: three admissions each.
    for (name, spec) in specs() {
        let key = format!("sluice-test:exact:one:{name}");
        let mut times = Vec::new();
        for step in 0..3 {
            let at = format!("{name} alone, step {step}");
            let decision = store.decide(&[check(key.clone(), &spec)]).await.unwrap();
            times.push(decided_us(&decision, &at));
            assert_exact(&decision, 0, &spec, &times, &at);
        }
    }

    // All four in one request, three times.
    let checks: Vec<Check> = specs()
        .iter()
        .map(|(name, spec)| check(format!("sluice-test:exact:all:{name}"), spec))
        .collect();
    let mut times = Vec::new();
    for step in 0..3 {
        let at = format!("all four, step {step}");
        let decision = store.decide(&checks).await.unwrap();
        times.push(decided_us(&decision, &at));
        for (index, (name, spec)) in specs().iter().enumerate() {
            assert_exact(&decision, index, spec, &times, &format!("{at}, {name}"));
        }
    }

    // Sixteen fresh keys at once: decided together (a batch), each as if alone.
    let fresh: Vec<Check> = (0..16)
        .map(|i| {
            let (name, spec) = &specs()[i % 4];
            check(format!("sluice-test:exact:batch:{name}:{i}"), spec)
        })
        .collect();
    let decisions = join_all(
        fresh
            .iter()
            .map(|one| store.decide(std::slice::from_ref(one))),
    )
    .await;
    for (one, decision) in fresh.iter().zip(decisions) {
        let decision = decision.unwrap();
        let now = decided_us(&decision, &one.key);
        assert_exact(&decision, 0, &one.spec, &[now], &one.key);
    }
}

/// A log's key lives until its newest entry leaves the window, even when that entry lies
/// further in the future than the one just recorded: a request another limit delays is
/// recorded late in every limit, and a later request the log admits at once must not cut
/// the key's life short (`log_expire` in `sliding_log.lua`: with a delay limit in the
/// request, it reads the newest entry). Otherwise the key would expire, and its late entry
/// with it, while that entry still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_lives_until_its_newest_entry_leaves_the_window() {
    let redis = Redis::start().await;
    let metrics = Metrics::new().unwrap();
    let store = RedisStore::new(&redis.url(), 1, TIMEOUT).expect("a store");
    store.load_script().await.expect("scripts load");
    let store = Store::redis(store, 1000, &metrics);
    let window = Duration::from_secs(10);
    let delaying = |requests: u32, window: Duration| Spec {
        algorithm: Algorithm::SlidingLog,
        requests,
        window,
        burst: requests,
        cost: 1,
        max_delay: Duration::from_secs(60),
        ..Spec::default()
    };
    let logs = [
        ("sliding_log", delaying(3, window)),
        (
            "weighted_log",
            Spec {
                algorithm: Algorithm::WeightedLog,
                requests: 300,
                window,
                burst: 300,
                cost: 100,
                ..Spec::default()
            },
        ),
    ];
    for (name, spec) in logs {
        let key = format!("sluice-test:newest:{name}");
        let log = |key: &str| Check {
            key: key.to_string(),
            spec,
        };
        // One request per 20 s, so the second request waits 20 s for it.
        let slow = Check {
            key: format!("sluice-test:newest:{name}:slow"),
            spec: delaying(1, Duration::from_secs(20)),
        };
        let first = store.decide(&[log(&key), slow.clone()]).await.unwrap();
        assert!(first.admitted, "{name}: the first request is admitted");
        let second = store.decide(&[log(&key), slow.clone()]).await.unwrap();
        let late = second
            .admission
            .as_ref()
            .expect("the second is admitted, late");
        let ahead = late.at_us - late.decided_us;
        assert!(
            (19_000_000 + LATENESS_US..=20_000_000 + LATENESS_US).contains(&ahead),
            "{name}: the second request is held ~20 s and the lateness bound ({ahead} us)"
        );
        // The third has room in the log at once; its other limit, a fresh one, may delay.
        let fresh = Check {
            key: format!("sluice-test:newest:{name}:fresh"),
            spec: delaying(1, window),
        };
        let third = store.decide(&[log(&key), fresh]).await.unwrap();
        let now = third.admission.as_ref().expect("the third is admitted");
        assert_eq!(
            now.at_us, now.decided_us,
            "{name}: the third is not delayed"
        );
        // The late entry leaves the window ~34 s from now (held 22 s, counted the lateness
        // bound more, then the 10 s window); the third's own, in 12 s.
        let redis::Value::Int(ttl) = redis.cmd(&["PTTL", &key]).await else {
            panic!("{name}: PTTL is not an integer");
        };
        assert!(
            (29_000..=34_100).contains(&ttl),
            "{name}: the log lives until its newest entry leaves the window: PTTL {ttl} ms, \
             expected about 34,000"
        );
    }
}
