//! Two sluice instances sharing one Redis enforce one exact limit together.
//!
//! 60 concurrent clients hammer a single key, alternating between the two
//! instances, for ~3.5 s. The upstream records when each admitted request
//! arrived: no window may contain more than the limit.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{redis_store_yaml, Redis, Sluice, Upstream};

const LIMIT: usize = 20;
const WINDOW: Duration = Duration::from_secs(1);
const CLIENTS: usize = 60;
const RUN_FOR: Duration = Duration::from_millis(3500);
const MAX_PER_CLIENT: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_one_exact_limit() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let yaml = format!(
        r#"{store}upstreams:
  api:
    url: "{up}"
    connect_timeout: 2s
    timeout: 10s
routes:
  - name: default
    match:
      path_prefix: /
    upstream: api
    limits:
      - name: per-key
        key: ["header:x-api-key"]
        requests: {LIMIT}
        window: 1s
"#,
        store = redis_store_yaml(&redis.url()),
        up = up.url(),
    );
    let a = Sluice::start(&yaml).await;
    let b = Sluice::start(&yaml).await;
    let urls = Arc::new([format!("{}/shared", a.url()), format!("{}/shared", b.url())]);
    let client = support::client();

    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let client = client.clone();
        let urls = urls.clone();
        tasks.push(tokio::spawn(async move {
            // (status, instance) of every response
            let mut seen: Vec<(u16, usize)> = Vec::new();
            let mut n = 0usize;
            while start.elapsed() < RUN_FOR && n < MAX_PER_CLIENT {
                let inst = (i + n) % 2;
                let r = client
                    .get(&urls[inst])
                    .header("x-api-key", "one-shared-key")
                    .send()
                    .await;
                match r {
                    Ok(r) => seen.push((r.status().as_u16(), inst)),
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

    let ok = all.iter().filter(|(s, _)| *s == 200).count();
    let limited = all.iter().filter(|(s, _)| *s == 429).count();
    let other: Vec<_> = all.iter().filter(|(s, _)| *s != 200 && *s != 429).collect();
    let per_instance = [0, 1].map(|i| all.iter().filter(|(_, inst)| *inst == i).count());
    println!(
        "{} requests in {elapsed:?}: {ok} admitted, {limited} limited, per instance {per_instance:?}",
        all.len()
    );
    assert!(
        other.is_empty(),
        "every response must be 200 or 429; got {} others, e.g. {:?}",
        other.len(),
        &other[..other.len().min(5)]
    );
    assert!(per_instance[0] > 0 && per_instance[1] > 0);
    assert!(limited > 0, "the load must exceed the limit");
    assert!(ok >= LIMIT, "at least {LIMIT} must be admitted, got {ok}");
    assert_eq!(
        up.hits(),
        ok,
        "the upstream must receive exactly the admitted requests"
    );

    // No window (with 100 ms slack for forwarding jitter) holds more than
    // LIMIT arrivals: arrival i and arrival i+LIMIT are >= window apart.
    let mut arr = up.arrivals();
    arr.sort();
    let slack = WINDOW - Duration::from_millis(100);
    for i in 0..arr.len().saturating_sub(LIMIT) {
        let gap = arr[i + LIMIT] - arr[i];
        assert!(
            gap >= slack,
            "{} requests arrived within {gap:?} (arrivals #{i}..=#{}), limit is {LIMIT} per {WINDOW:?}",
            LIMIT + 1,
            i + LIMIT
        );
    }
    // Sanity on the other side: a sliding log with this much pressure admits
    // about LIMIT per WINDOW, so over 3.5 s well over one window's worth.
    assert!(
        ok >= 2 * LIMIT,
        "only {ok} admitted in {elapsed:?} under constant pressure (limit {LIMIT}/s)"
    );
}
