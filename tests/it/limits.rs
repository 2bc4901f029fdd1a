//! Rate limiting: exact sliding-window counts, independent keys, no boundary
//! bursts, exact Retry-After, and the syntax of the RateLimit headers and the
//! problem+json rejection body.
//!
//! Every case runs twice: against a real Redis store and against the
//! in-process store (config without `store:`).

use crate::support;

use std::ops::RangeInclusive;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{
    header, parse_limit_field, Limit, Policy, Route, Sluice, Store, StoreKind, Upstream,
    UpstreamSpec,
};

/// Config with a limited catch-all route `default` (per-key, `requests` per
/// `window`) and a route `multi` with two limits.
fn config(store: &Store, upstream: &str, requests: u32, window: &str) -> Policy {
    let per_ip = |requests, window| Limit::requests("per-ip", requests, window);
    let per_key =
        |requests, window| Limit::requests("per-key", requests, window).key(["header:x-api-key"]);
    Policy::new()
        .store(store)
        .upstream(
            "api",
            UpstreamSpec::new(upstream)
                .connect_timeout("2s")
                .timeout("10s"),
        )
        .route(
            Route::new("multi", "/multi")
                .upstream("api")
                .limit(per_ip(4, "1m"))
                .limit(per_key(2, "1m")),
        )
        .route(
            Route::new("ip", "/ip")
                .upstream("api")
                .limit(per_ip(2, "30s")),
        )
        .route(
            Route::new("combo", "/combo").upstream("api").limit(
                Limit::requests("ip-and-key", 2, "30s").key(["client_ip", "header:x-api-key"]),
            ),
        )
        .route(
            Route::new("demo", "/demo")
                .respond(200, "hello\n")
                .limit(per_ip(3, "10s")),
        )
        .route(
            Route::new("default", "/")
                .upstream("api")
                .limit(per_key(requests, window)),
        )
}

/// Starts the store, an upstream and sluice with `config(.., requests, window)`. The store is
/// returned so it lives as long as the test.
async fn start(kind: StoreKind, requests: u32, window: &str) -> (Store, Upstream, Sluice) {
    let store = Store::start(kind).await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&store, &up.url(), requests, window)).await;
    (store, up, sluice)
}

async fn send(c: &reqwest::Client, url: &str, key: Option<&str>) -> reqwest::Response {
    let mut rb = c.get(url);
    if let Some(k) = key {
        rb = rb.header("x-api-key", k);
    }
    rb.send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// Check an admitted response of the single-limit route: 200, policy
/// `"per-key";q=Q;w=W`, ratelimit `"per-key";r=R;t=T` with 1 <= T <= W + `late` (the store's
/// lateness bound, for which the log counts an admission past its window), rounded up.
/// Returns T.
fn assert_admitted(
    resp: &reqwest::Response,
    (q, w, late): (i64, i64, Duration),
    remaining: i64,
) -> i64 {
    assert_eq!(
        resp.status(),
        200,
        "expected admission, headers {:?}",
        resp.headers()
    );
    let policy = header(resp, "ratelimit-policy");
    assert_eq!(
        policy,
        format!("\"per-key\";q={q};w={w}"),
        "ratelimit-policy"
    );
    let rl = parse_limit_field(header(resp, "ratelimit"));
    assert_eq!(rl.len(), 1, "one ratelimit item expected: {rl:?}");
    assert_eq!(rl[0].name, "per-key");
    assert_eq!(rl[0].param("r"), remaining, "remaining in ratelimit {rl:?}");
    let t = rl[0].param("t");
    let most = ceil_secs(Duration::from_secs(w as u64) + late);
    assert!((1..=most).contains(&t), "ratelimit t={t} not in 1..={most}");
    t
}

/// Whole seconds, rounded up.
fn ceil_secs(d: Duration) -> i64 {
    d.as_nanos().div_ceil(1_000_000_000) as i64
}

/// Check a 429 from limit `limit` of route `route`: headers, problem+json
/// body. Returns the Retry-After seconds.
async fn assert_rejected(resp: reqwest::Response, route: &str, limit: &str) -> i64 {
    assert_eq!(
        resp.status(),
        429,
        "expected rejection, headers {:?}",
        resp.headers()
    );
    let retry_after: i64 = header(&resp, "retry-after")
        .parse()
        .expect("retry-after must be whole seconds");
    assert!(retry_after >= 1, "retry-after {retry_after} must be >= 1");
    assert!(
        header(&resp, "content-type").starts_with("application/problem+json"),
        "content-type {:?}",
        header(&resp, "content-type")
    );
    let policy = parse_limit_field(header(&resp, "ratelimit-policy"));
    assert!(
        policy.iter().any(|i| i.name == limit),
        "ratelimit-policy {policy:?} lacks {limit}"
    );
    let rl = parse_limit_field(header(&resp, "ratelimit"));
    let item = rl
        .iter()
        .find(|i| i.name == limit)
        .unwrap_or_else(|| panic!("ratelimit {rl:?} lacks {limit}"));
    assert_eq!(item.param("r"), 0, "exhausted limit must show r=0: {rl:?}");
    assert_eq!(
        item.param("t"),
        retry_after,
        "ratelimit t of the exhausted limit must equal retry-after"
    );
    let body: serde_json::Value = resp.json().await.expect("problem+json body");
    assert!(body["type"].is_string(), "type in {body}");
    assert_eq!(body["title"], "Too Many Requests", "title in {body}");
    assert_eq!(body["status"], 429, "status in {body}");
    assert!(body["detail"].is_string(), "detail in {body}");
    assert_eq!(body["route"], route, "route in {body}");
    assert_eq!(body["limit"], limit, "limit in {body}");
    assert_eq!(
        body["retry_after"].as_i64(),
        Some(retry_after),
        "retry_after in body must be the number in the header: {body}"
    );
    retry_after
}

/// The whole seconds, rounded up, that a server answering between `asked` and `answered` can
/// state are left of a `window` opened by an admission between `opened_after` and
/// `opened_by`. The bounds come from the measured times, so the check needs no timing luck.
fn seconds_left(
    window: Duration,
    (opened_after, opened_by): (Instant, Instant),
    (asked, answered): (Instant, Instant),
) -> RangeInclusive<i64> {
    let ceil = ceil_secs;
    let least = window.saturating_sub(answered.saturating_duration_since(opened_after));
    let most = window.saturating_sub(asked.saturating_duration_since(opened_by));
    ceil(least)..=ceil(most)
}

/// Sends one request and returns it with the instants it was sent and answered.
async fn timed_send(
    c: &reqwest::Client,
    url: &str,
    key: Option<&str>,
) -> (reqwest::Response, (Instant, Instant)) {
    let asked = Instant::now();
    let r = send(c, url, key).await;
    (r, (asked, Instant::now()))
}

// ---------------------------------------------------------------------------

/// 5 per 10 s: exactly 5 admitted per key, 6th and later rejected; keys are
/// independent; no x-api-key falls back to a per-IP key.
async fn exact_count_and_independent_keys(kind: StoreKind) {
    let (store, up, sluice) = start(kind, 5, "10s").await;
    let c = support::client();
    let url = format!("{}/things", sluice.url());

    let late = store.lateness();
    let limit = (5, 10, late);
    // The first entry leaves the log the lateness bound after its window.
    let window = Duration::from_secs(10) + late;
    let (r, first) = timed_send(&c, &url, Some("alpha")).await;
    let t = assert_admitted(&r, limit, 4);
    assert_eq!(
        t,
        ceil_secs(window),
        "t = whole seconds (rounded up) until the first entry leaves"
    );
    for i in 2..=5 {
        let (r, now) = timed_send(&c, &url, Some("alpha")).await;
        let t = assert_admitted(&r, limit, 5 - i);
        let expected = seconds_left(window, first, now);
        assert!(
            expected.contains(&t),
            "request {i}: t={t}, but the first entry leaves in {expected:?} s (rounded up)"
        );
    }
    for _ in 0..2 {
        let (r, now) = timed_send(&c, &url, Some("alpha")).await;
        let ra = assert_rejected(r, "default", "per-key").await;
        let expected = seconds_left(window, first, now);
        assert!(
            expected.contains(&ra),
            "retry-after {ra}, but the first entry leaves in {expected:?} s (rounded up)"
        );
    }

    // Another key has its own budget.
    for i in 1..=5 {
        let r = send(&c, &url, Some("beta")).await;
        assert_admitted(&r, limit, 5 - i);
    }
    assert_rejected(send(&c, &url, Some("beta")).await, "default", "per-key").await;

    // No x-api-key: limited per client IP, also exactly 5.
    for i in 1..=5 {
        let r = send(&c, &url, None).await;
        assert_admitted(&r, limit, 5 - i);
    }
    assert_rejected(send(&c, &url, None).await, "default", "per-key").await;

    // The first key is still exhausted.
    assert_rejected(send(&c, &url, Some("alpha")).await, "default", "per-key").await;

    // A limit of the same name on another route is a different limit.
    let r = send(&c, &format!("{}/multi/1", sluice.url()), Some("alpha")).await;
    assert_eq!(
        r.status(),
        200,
        "route multi's per-key is not route default's"
    );

    assert_eq!(up.hits(), 16, "only admitted requests reach the upstream");
}

/// `client_ip` keys count each client address separately (clients bound to
/// 127.0.0.1 and 127.0.0.2), and key parts combine.
async fn client_ip_and_combined_keys(kind: StoreKind) {
    let (_store, up, sluice) = start(kind, 5, "10s").await;
    let a = support::client_from("127.0.0.1");
    let b = support::client_from("127.0.0.2");
    let ip = format!("{}/ip", sluice.url());
    let combo = format!("{}/combo", sluice.url());

    for (name, c) in [("127.0.0.1", &a), ("127.0.0.2", &b)] {
        for i in 1..=2 {
            let r = send(c, &ip, Some("same-key")).await;
            assert_eq!(r.status(), 200, "client {name}, request {i} on /ip");
        }
        assert_rejected(send(c, &ip, Some("same-key")).await, "ip", "per-ip").await;
    }

    for _ in 0..2 {
        assert_eq!(send(&a, &combo, Some("k1")).await.status(), 200);
    }
    assert_rejected(send(&a, &combo, Some("k1")).await, "combo", "ip-and-key").await;
    assert_eq!(
        send(&a, &combo, Some("k2")).await.status(),
        200,
        "same IP, other key: another identity"
    );
    assert_eq!(
        send(&b, &combo, Some("k1")).await.status(),
        200,
        "same key, other IP: another identity"
    );
    assert_eq!(up.hits(), 2 + 2 + 2 + 1 + 1);
}

/// A limited `respond` route: limited like any other, never touches the
/// upstream.
async fn limited_respond_route(kind: StoreKind) {
    let (_store, up, sluice) = start(kind, 5, "10s").await;
    let c = support::client();
    let url = format!("{}/demo", sluice.url());
    for i in 1..=3 {
        let r = send(&c, &url, None).await;
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(header(&r, "ratelimit-policy"), "\"per-ip\";q=3;w=10");
        let rl = parse_limit_field(header(&r, "ratelimit"));
        assert_eq!(rl[0].param("r"), 3 - i);
        assert_eq!(r.text().await.unwrap(), "hello\n");
    }
    assert_rejected(send(&c, &url, None).await, "demo", "per-ip").await;
    assert_eq!(up.hits(), 0);
}

/// Two limits on one route: the policy header lists both in config order; a
/// request rejected by one limit is not recorded in the other.
async fn rejections_are_not_recorded(kind: StoreKind) {
    let (store, up, sluice) = start(kind, 5, "10s").await;
    let c = support::client();
    let url = format!("{}/multi/x", sluice.url());
    let most = ceil_secs(Duration::from_secs(60) + store.lateness());
    let policy = "\"per-ip\";q=4;w=60, \"per-key\";q=2;w=60";

    // key X: 2 admitted (per-ip 2/4 used, per-key 2/2).
    for i in 1..=2 {
        let r = send(&c, &url, Some("X")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "ratelimit-policy"), policy);
        let rl = parse_limit_field(header(&r, "ratelimit"));
        assert_eq!(rl.len(), 2, "one item per limit: {rl:?}");
        assert_eq!(rl[0].name, "per-ip");
        assert_eq!(rl[0].param("r"), 4 - i);
        assert_eq!(rl[1].name, "per-key");
        assert_eq!(rl[1].param("r"), 2 - i);
        for item in &rl {
            assert!((59..=most).contains(&item.param("t")), "t in {rl:?}");
        }
    }
    // key X again: rejected by per-key. Must not consume per-ip.
    let r = send(&c, &url, Some("X")).await;
    assert_eq!(header(&r, "ratelimit-policy"), policy);
    assert_rejected(r, "multi", "per-key").await;

    // key Y: 2 admitted, bringing per-ip to exactly 4/4.
    for _ in 1..=2 {
        let r = send(&c, &url, Some("Y")).await;
        assert_eq!(
            r.status(),
            200,
            "per-ip must have 2 left: the rejected request may not be recorded"
        );
    }
    // key Z: fresh per-key, but per-ip is exhausted.
    let r = send(&c, &url, Some("Z")).await;
    assert_rejected(r, "multi", "per-ip").await;
    assert_eq!(up.hits(), 4);
}

/// The next multiple of `window` on the wall clock (the clock Redis `TIME` reads, and the one a
/// fixed-window counter aligns its windows to) that is at least `lead` away, as an `Instant`.
fn next_wall_clock_boundary(window: Duration, lead: Duration) -> Instant {
    let now = Instant::now();
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros();
    let window = window.as_micros();
    let mut boundary = (since_epoch / window + 1) * window;
    while boundary - since_epoch < lead.as_micros() {
        boundary += window;
    }
    now + Duration::from_micros((boundary - since_epoch) as u64)
}

/// 5 per 2 s, filled 600 ms before a wall-clock multiple of 2 s and hit again 50 ms after it.
/// A fixed-window counter starts afresh at that multiple and would admit the second burst; the
/// sliding log rejects all of it (Retry-After: until the first admission is 2 s old), and
/// admits 5 again once the first five have left their window.
async fn boundary_burst_is_impossible(kind: StoreKind) {
    let (store, up, sluice) = start(kind, 5, "2s").await;
    let c = support::client();
    let url = format!("{}/burst", sluice.url());
    let window = Duration::from_secs(2);
    let late = store.lateness();
    let limit = (5, 2, late);
    let lead = Duration::from_millis(600);

    // Warm up connections/scripts with an unrelated key.
    assert_eq!(send(&c, &url, Some("warmup")).await.status(), 200);

    // A request stalled across the boundary spoils the setup (not the result); then it is
    // done again at the next boundary with a fresh key.
    let mut attempt = 0;
    let (key, first, boundary) = loop {
        attempt += 1;
        let key = format!("k{attempt}");
        let boundary = next_wall_clock_boundary(window, lead + Duration::from_millis(100));
        tokio::time::sleep_until((boundary - lead).into()).await;
        let (r, first) = timed_send(&c, &url, Some(&key)).await;
        assert_admitted(&r, limit, 4);
        for i in 2..=5 {
            assert_admitted(&send(&c, &url, Some(&key)).await, limit, 5 - i);
        }
        let filled = Instant::now();
        if filled < boundary {
            break (key, first, boundary);
        }
        assert!(
            attempt < 3,
            "filling 5 took past the boundary 600 ms later in 3 tries, the last {:?}",
            filled - first.0
        );
    };

    tokio::time::sleep_until((boundary + Duration::from_millis(50)).into()).await;
    for i in 1..=5 {
        let (r, now) = timed_send(&c, &url, Some(&key)).await;
        assert!(
            now.1 < first.0 + window,
            "precondition: burst request {i} was answered {:?} after the first admission",
            now.1 - first.0
        );
        assert_eq!(
            r.status(),
            429,
            "burst request {i}, sent {:?} after the wall-clock boundary, was not rejected: \
             the window must not restart at the boundary",
            now.0 - boundary
        );
        let ra = assert_rejected(r, "default", "per-key").await;
        let expected = seconds_left(window + late, first, now);
        assert!(
            expected.contains(&ra),
            "burst request {i} after the boundary: retry-after {ra}, expected {expected:?}"
        );
    }

    // After the window of the first five has passed (and the lateness bound), the key is
    // free again: rejected requests were not recorded.
    tokio::time::sleep_until((boundary + window + late).into()).await;
    for i in 1..=5 {
        let r = send(&c, &url, Some(&key)).await;
        assert_admitted(&r, limit, 5 - i);
    }
    assert_rejected(send(&c, &url, Some(&key)).await, "default", "per-key").await;
    assert_eq!(up.hits(), 1 + 5 * attempt + 5);
}

/// 3 per 3 s: fill at t0, at t0+1.2 s a 429 says retry-after 2; waiting 1 s
/// is not enough (429, retry-after 1), waiting the full 2 s is (200).
async fn retry_after_is_exact(kind: StoreKind) {
    let (store, up, sluice) = start(kind, 3, "3s").await;
    let c = support::client();
    let url = format!("{}/ra", sluice.url());
    let late = store.lateness();

    assert_eq!(send(&c, &url, Some("warmup")).await.status(), 200);

    let t0 = Instant::now();
    assert_eq!(send(&c, &url, Some("k")).await.status(), 200);
    let first = t0.elapsed();
    assert!(
        first < Duration::from_millis(150),
        "precondition: first request took {first:?}, too slow for exact timing"
    );
    for _ in 0..2 {
        assert_eq!(send(&c, &url, Some("k")).await.status(), 200);
    }

    tokio::time::sleep_until((t0 + Duration::from_millis(1200)).into()).await;
    let r = send(&c, &url, Some("k")).await;
    let got = Instant::now();
    let ra = assert_rejected(r, "default", "per-key").await;
    assert_eq!(
        ra,
        ceil_secs(Duration::from_millis(1800) + late),
        "at t0+1.2s the oldest entry (t0) leaves in 1.8 s and the lateness bound {late:?}"
    );

    // retry-after - 1 seconds is not enough.
    tokio::time::sleep_until((got + Duration::from_secs(ra as u64 - 1)).into()).await;
    let r = send(&c, &url, Some("k")).await;
    let ra2 = assert_rejected(r, "default", "per-key").await;
    assert_eq!(
        ra2, 1,
        "one second before, the oldest entry leaves within 1 s"
    );

    // The full retry-after is enough.
    tokio::time::sleep_until(
        (got + Duration::from_secs(ra as u64) + Duration::from_millis(50)).into(),
    )
    .await;
    let r = send(&c, &url, Some("k")).await;
    assert_eq!(
        r.status(),
        200,
        "waiting the full retry-after must be enough, headers {:?}",
        r.headers()
    );
    assert_eq!(up.hits(), 1 + 3 + 1);
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_count_and_independent_keys_redis() {
    exact_count_and_independent_keys(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_count_and_independent_keys_memory() {
    exact_count_and_independent_keys(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_are_not_recorded_redis() {
    rejections_are_not_recorded(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_are_not_recorded_memory() {
    rejections_are_not_recorded(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boundary_burst_is_impossible_redis() {
    boundary_burst_is_impossible(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boundary_burst_is_impossible_memory() {
    boundary_burst_is_impossible(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_exact_redis() {
    retry_after_is_exact(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_exact_memory() {
    retry_after_is_exact(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_and_combined_keys_redis() {
    client_ip_and_combined_keys(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_and_combined_keys_memory() {
    client_ip_and_combined_keys(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_respond_route_redis() {
    limited_respond_route(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_respond_route_memory() {
    limited_respond_route(StoreKind::Memory).await;
}

/// A limit lowered while entries are recorded (sluice restarted on the same Redis with a
/// smaller `requests`): the key stays closed until enough entries have left that fewer than the
/// new limit remain, and Retry-After says exactly when, not when the oldest entry leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_limit_waits_for_enough_entries_to_leave() {
    let store = Store::start(StoreKind::Redis).await;
    let up = Upstream::start().await;
    let c = support::client();
    let t0;
    {
        let sluice = Sluice::start(&config(&store, &up.url(), 5, "4s")).await;
        let url = format!("{}/lowered", sluice.url());
        assert_eq!(send(&c, &url, Some("warmup")).await.status(), 200);
        t0 = Instant::now();
        // Five admissions, 400 ms apart: at t0, t0+0.4, ..., t0+1.6.
        for i in 0..5u32 {
            tokio::time::sleep_until((t0 + Duration::from_millis(400) * i).into()).await;
            assert_eq!(send(&c, &url, Some("k")).await.status(), 200);
        }
    }
    let sluice = Sluice::start(&config(&store, &up.url(), 2, "4s")).await;
    let url = format!("{}/lowered", sluice.url());
    tokio::time::sleep_until((t0 + Duration::from_millis(1800)).into()).await;
    let asked = t0.elapsed();
    let retry_after = assert_rejected(send(&c, &url, Some("k")).await, "default", "per-key").await;
    // Five recorded, limit two: the entry at t0+1.2 s (the fourth) must leave, at t0+5.2 s.
    // Leaving when the oldest does (t0+4 s) would say 3.
    let expected = (Duration::from_millis(5200) - asked).as_secs_f64().ceil() as i64;
    assert!(
        asked < Duration::from_millis(2100),
        "precondition: asked at {asked:?}, too late to tell the entries apart"
    );
    assert_eq!(retry_after, expected, "asked at {asked:?}");
    tokio::time::sleep_until((t0 + Duration::from_millis(4300)).into()).await;
    assert_rejected(send(&c, &url, Some("k")).await, "default", "per-key").await;
}
