//! Threshold notifications (`notify` on a limit, `webhook:` at the top): exactly one signed
//! POST per identity, threshold and window or period, whichever instance admits the request
//! that crosses it, retried through a receiver that fails, and sent again only once the
//! marker has expired. The receiver is a real HTTP server written here: it records every POST
//! and verifies its HMAC signature and timestamp.

use crate::support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use support::{Limit, Node, Policy, Redis, Route, Sluice, Upstream};

const SECRET: &str = "notify-test-secret";
const SECRET_ENV: &str = "SLUICE_TEST_WEBHOOK_SECRET";

/// A webhook receiver: every try it is sent (`tries`), and the POSTs it accepted, each checked
/// for a valid signature over its timestamp and body.
struct Receiver {
    url: String,
    tries: Arc<AtomicUsize>,
    accepted: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Answers 503 to the first `failing` tries, then 200.
    async fn start(failing: usize) -> Receiver {
        Receiver::serve(failing, None).await
    }

    /// The same over TLS (`https://localhost:port/...`), with the certificate `tls` presents.
    async fn serve(failing: usize, tls: Option<tokio_rustls::TlsAcceptor>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let url = match tls {
            Some(_) => format!("https://localhost:{port}/hooks/sluice"),
            None => format!("http://127.0.0.1:{port}/hooks/sluice"),
        };
        let tries = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let (t, a) = (Arc::clone(&tries), Arc::clone(&accepted));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (tries, accepted) = (Arc::clone(&t), Arc::clone(&a));
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let (tries, accepted) = (Arc::clone(&tries), Arc::clone(&accepted));
                        async move {
                            let status = receive(request, &tries, &accepted, failing).await;
                            let mut response = hyper::Response::new(Full::new(Bytes::new()));
                            *response.status_mut() = status;
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let builder = hyper::server::conn::http1::Builder::new();
                    match &tls {
                        None => {
                            let _ = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                        Some(acceptor) => {
                            // A client that does not speak TLS, or does not trust us, is
                            // not a try that reached the receiver.
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = builder
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                            }
                        }
                    }
                });
            }
        });
        Receiver {
            url,
            tries,
            accepted,
            task,
        }
    }

    fn accepted(&self) -> Vec<Value> {
        self.accepted.lock().expect("lock").clone()
    }

    /// Waits until `n` POSTs were accepted (at most 10 s), then `settle` more for any that
    /// should not come; the POSTs accepted.
    async fn wait_for(&self, n: usize, settle: Duration) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.accepted().len() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(settle).await;
        self.accepted()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One try: 503 while failing, 401 when the signature does not verify, else recorded.
async fn receive(
    request: hyper::Request<hyper::body::Incoming>,
    tries: &AtomicUsize,
    accepted: &Mutex<Vec<Value>>,
    failing: usize,
) -> hyper::StatusCode {
    let try_number = tries.fetch_add(1, Ordering::SeqCst);
    let signature = request
        .headers()
        .get("sluice-signature")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return hyper::StatusCode::BAD_REQUEST,
    };
    if try_number < failing {
        return hyper::StatusCode::SERVICE_UNAVAILABLE;
    }
    if !verifies(&signature, &body) {
        return hyper::StatusCode::UNAUTHORIZED;
    }
    match serde_json::from_slice(&body) {
        Ok(value) => {
            accepted.lock().expect("lock").push(value);
            hyper::StatusCode::OK
        }
        Err(_) => hyper::StatusCode::BAD_REQUEST,
    }
}

/// What a receiver does (the book's guide): `t=<unix>,v1=<hex>`, the HMAC-SHA256 of
/// `<unix>.<body>` with the shared secret, compared in constant time, `t` within 5 minutes.
fn verifies(header: &str, body: &[u8]) -> bool {
    let mut t = None;
    let mut v1 = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("t", value)) => t = value.parse::<u64>().ok(),
            Some(("v1", value)) => v1 = Some(value.to_owned()),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else {
        return false;
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    if now.abs_diff(t) > 300 {
        return false;
    }
    let Some(tag) = (0..v1.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(v1.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
    else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes());
    let mut signed = format!("{t}.").into_bytes();
    signed.extend_from_slice(body);
    ring::hmac::verify(&key, &signed, &tag).is_ok()
}

fn notify(fractions: &[f64]) -> Node {
    Node::map([(
        "at",
        Node::Seq(fractions.iter().map(|&f| Node::Float(f)).collect()),
    )])
}

fn webhook(receiver: &Receiver) -> Node {
    Node::map([
        ("url", Node::from(receiver.url.as_str())),
        ("secret_env", Node::from(SECRET_ENV)),
        ("timeout", Node::from("2s")),
        ("retries", Node::from(3u32)),
        ("backoff", Node::from("100ms")),
    ])
}

/// A route whose `limit`, keyed by `x-api-key`, notifies at `fractions`, with this webhook.
fn policy(up: &Upstream, receiver: &Receiver, limit: Limit, fractions: &[f64]) -> Policy {
    Policy::new()
        .set("webhook", webhook(receiver))
        .upstream("api", up.url())
        .route(
            Route::new("api", "/").upstream("api").limit(
                limit
                    .key(["header:x-api-key"])
                    .set("notify", notify(fractions)),
            ),
        )
}

async fn start(policy: &Policy) -> Sluice {
    Sluice::start_with_env(policy, &[(SECRET_ENV, SECRET)]).await
}

async fn hit(client: &reqwest::Client, sluice: &Sluice, key: &str) -> u16 {
    client
        .get(format!("{}/x", sluice.url()))
        .header("x-api-key", key)
        .send()
        .await
        .expect("a response")
        .status()
        .as_u16()
}

/// `n` requests of `key` at once, spread over `instances`; how many were admitted.
async fn burst(instances: &Arc<Vec<Sluice>>, key: &'static str, n: usize) -> usize {
    let client = support::client();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, instances) = (client.clone(), Arc::clone(instances));
            tokio::spawn(async move { hit(&client, &instances[i % instances.len()], key).await })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        if task.await.expect("task") == 200 {
            admitted += 1;
        }
    }
    admitted
}

/// The (identity, threshold, used, remaining) of each POST, sorted.
fn crossings(posts: &[Value]) -> Vec<(String, String, u64, u64)> {
    let mut seen: Vec<_> = posts
        .iter()
        .map(|p| {
            (
                p["identity"].as_str().unwrap_or_default().to_owned(),
                p["threshold"].to_string(),
                p["used"].as_u64().unwrap_or(u64::MAX),
                p["remaining"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    seen.sort();
    seen
}

fn sum(metrics_text: &[String], outcome: &str) -> f64 {
    metrics_text
        .iter()
        .map(|text| {
            support::metric_sum(
                &support::parse_metrics(text),
                "sluice_notifications_total",
                &[("outcome", outcome)],
            )
        })
        .sum()
}

async fn all_metrics(instances: &[Sluice]) -> Vec<String> {
    let mut texts = Vec::new();
    for sluice in instances {
        texts.push(sluice.metrics().await);
    }
    texts
}

fn expected(identity: &str) -> Vec<(String, String, u64, u64)> {
    vec![
        (identity.to_owned(), "0.5".to_owned(), 5, 5),
        (identity.to_owned(), "0.8".to_owned(), 8, 2),
        (identity.to_owned(), "1.0".to_owned(), 10, 0),
    ]
}

/// Three instances on one Redis, a limit of 10 an hour notifying at 50 %, 80 % and 100 %.
/// Two customers each send 25 requests at once across the instances: 10 of each pass, and
/// the receiver gets exactly one signed POST per threshold per customer (used 5, 8, 10), not
/// one per instance; a third customer at 30 % gets none. Then an operator resets customer
/// `a` and it uses 10 again within the hour: nothing more is sent (once per period).
/// Seeded: without NX on the marker, the reset customer's second crossing sent 3 more POSTs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_send_one_post_per_threshold_per_identity() {
    let _heavy = support::heavy().await;
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let receiver = Receiver::start(0).await;
    let yaml = policy(
        &up,
        &receiver,
        Limit::requests("hourly", 10, "1h"),
        &[0.5, 0.8, 1.0],
    )
    .store_redis(&redis);
    let instances = Arc::new(vec![
        start(&yaml).await,
        start(&yaml).await,
        start(&yaml).await,
    ]);
    let (a, b) = tokio::join!(burst(&instances, "a", 25), burst(&instances, "b", 25));
    assert_eq!((a, b), (10, 10));
    assert_eq!(burst(&instances, "small", 3).await, 3);
    let posts = receiver.wait_for(6, Duration::from_millis(1500)).await;
    let mut want = expected("h:x-api-key=a");
    want.extend(expected("h:x-api-key=b"));
    assert_eq!(crossings(&posts), want, "{posts:#?}");
    let post = &posts[0];
    assert_eq!(post["route"], "api", "{post}");
    assert_eq!(post["limit"], "hourly", "{post}");
    assert_eq!(post["quota"], 10, "{post}");
    assert_eq!(post["unit"], "requests", "{post}");
    assert_eq!(post["window_seconds"], 3600, "{post}");
    assert_eq!(sum(&all_metrics(&instances).await, "sent"), 6.0);

    // A reset within the hour: the count starts afresh, the markers stay.
    let response = support::client()
        .delete(format!(
            "{}/admin/v1/limits/api/hourly?key=h:x-api-key=a",
            instances[1].admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    assert_eq!(response.status(), 200);
    assert_eq!(burst(&instances, "a", 12).await, 10);
    let posts = receiver.wait_for(7, Duration::from_millis(1500)).await;
    assert_eq!(posts.len(), 6, "once per period: {posts:#?}");
    assert_eq!(receiver.tries.load(Ordering::SeqCst), 6);
    // Three markers per customer beside the counted keys, each expiring with the hour.
    let markers = redis
        .key_ttls()
        .await
        .into_iter()
        .filter(|(key, _)| key.contains(":n"))
        .count();
    assert_eq!(markers, 6);
    assert!(
        redis
            .assert_every_key_expires(Duration::from_secs(3600))
            .await
            > 6
    );
}

/// A calendar quota's notification names its period, and its marker lives until the period
/// ends (the time left today, UTC), not a nominal day from the crossing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_quota_notifies_once_per_period() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let receiver = Receiver::start(0).await;
    let yaml = policy(&up, &receiver, Limit::quota("daily", 4, "day"), &[1.0]).store_redis(&redis);
    let sluice = start(&yaml).await;
    let client = support::client();
    for _ in 0..6 {
        hit(&client, &sluice, "a").await;
    }
    let posts = receiver.wait_for(1, Duration::from_millis(500)).await;
    assert_eq!(
        crossings(&posts),
        [("h:x-api-key=a".to_owned(), "1.0".to_owned(), 4, 0)]
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let period = posts[0]["period"].as_str().expect("a period").to_owned();
    assert_eq!(period.len(), "2026-11-28".len(), "{}", posts[0]);
    assert!(posts[0].get("window_seconds").is_none(), "{}", posts[0]);
    let left_today_ms = i64::try_from((86_400 - now % 86_400) * 1000).expect("fits");
    let marker = redis
        .key_ttls()
        .await
        .into_iter()
        .find(|(key, _)| key.ends_with(&format!("{period}:n1000")))
        .expect("the period's marker");
    assert!(
        (1..=left_today_ms + 1000).contains(&marker.1),
        "{marker:?}: at most {left_today_ms} ms"
    );
}

/// A request refused by another limit of its route crosses nothing: customer `a` is at 3 of
/// its 4 when a route-wide limit of 3 refuses its fourth, and no 100 % notification is sent
/// for a use that never happened; the first admission that does reach it (after the route's
/// limit is reset) is the one notified. Seeded: marking in the check, before the request
/// was admitted, sent the 100 % notification at the refusal (used 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_crosses_nothing() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let receiver = Receiver::start(0).await;
    let yaml = Policy::new()
        .set("webhook", webhook(&receiver))
        .upstream("api", up.url())
        .route(
            Route::new("api", "/")
                .upstream("api")
                .limit(
                    Limit::requests("per-key", 4, "1h")
                        .key(["header:x-api-key"])
                        .set("notify", notify(&[1.0])),
                )
                .limit(Limit::requests("route", 3, "1h")),
        )
        .store_redis(&redis);
    let sluice = start(&yaml).await;
    let client = support::client();
    for _ in 0..3 {
        assert_eq!(hit(&client, &sluice, "a").await, 200);
    }
    assert_eq!(hit(&client, &sluice, "a").await, 429);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.accepted(), Vec::<Value>::new(), "nothing crossed");
    let response = support::client()
        .delete(format!(
            "{}/admin/v1/limits/api/route?key=ip=127.0.0.1",
            sluice.admin_url()
        ))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .expect("the admin API answers");
    let status = response.status();
    assert_eq!(status, 200, "{}", response.text().await.unwrap_or_default());
    assert_eq!(hit(&client, &sluice, "a").await, 200);
    let posts = receiver.wait_for(1, Duration::from_millis(500)).await;
    assert_eq!(
        crossings(&posts),
        [("h:x-api-key=a".to_owned(), "1.0".to_owned(), 4, 0)]
    );
}

/// A receiver that answers 503 to the first two tries: the notification is delivered once,
/// on the third, after two retries (counted), with the same body signed anew each time.
/// Seeded: a sender that does not retry a 5xx delivered nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_receiver_still_gets_exactly_one() {
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let receiver = Receiver::start(2).await;
    let yaml =
        policy(&up, &receiver, Limit::requests("hourly", 2, "1h"), &[0.5]).store_redis(&redis);
    let sluice = start(&yaml).await;
    let client = support::client();
    assert_eq!(hit(&client, &sluice, "a").await, 200);
    assert_eq!(hit(&client, &sluice, "a").await, 200);
    let posts = receiver.wait_for(1, Duration::from_millis(800)).await;
    assert_eq!(
        crossings(&posts),
        [("h:x-api-key=a".to_owned(), "0.5".to_owned(), 1, 1)]
    );
    assert_eq!(receiver.tries.load(Ordering::SeqCst), 3);
    let metrics = all_metrics(std::slice::from_ref(&sluice)).await;
    assert_eq!(
        (
            sum(&metrics, "sent"),
            sum(&metrics, "retried"),
            sum(&metrics, "failed")
        ),
        (1.0, 2.0, 0.0)
    );
}

/// An `https://` webhook: the POST goes over TLS, the receiver's certificate checked against
/// `webhook.ca_file`; without it (the built-in Mozilla roots, which do not know the test CA)
/// nothing is delivered and every try fails. Seeded: a sender that spoke plain HTTP to the
/// https URL delivered nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_webhook_is_posted_over_tls_to_a_trusted_receiver() {
    let ca = support::certs::Ca::new("webhook test CA");
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("write the CA");
    let leaf = ca.server("hooks");
    let redis = Redis::start().await;
    let up = Upstream::start().await;
    let client = support::client();
    for trusted in [true, false] {
        let receiver = Receiver::serve(0, Some(leaf.acceptor(&[b"http/1.1"]))).await;
        let mut hook = vec![
            ("url", Node::from(receiver.url.as_str())),
            ("secret_env", Node::from(SECRET_ENV)),
            ("retries", Node::from(3u32)),
            ("backoff", Node::from("100ms")),
        ];
        if trusted {
            hook.push(("ca_file", Node::from(ca_file.to_str().expect("utf-8"))));
        }
        let hook = Node::map(hook);
        let yaml = Policy::new()
            .set("webhook", hook)
            .upstream("api", up.url())
            .route(
                Route::new("api", "/").upstream("api").limit(
                    Limit::requests("hourly", 2, "1h")
                        .key(["header:x-api-key"])
                        .set("notify", notify(&[0.5])),
                ),
            )
            .store_redis(&redis);
        let sluice = start(&yaml).await;
        // One identity each: the first one's marker is in the shared Redis.
        let key = if trusted { "a" } else { "b" };
        assert_eq!(hit(&client, &sluice, key).await, 200);
        if trusted {
            let posts = receiver.wait_for(1, Duration::from_millis(300)).await;
            assert_eq!(
                crossings(&posts),
                [("h:x-api-key=a".to_owned(), "0.5".to_owned(), 1, 1)]
            );
        } else {
            // 1 + 3 retries, 100 ms doubling: over within a second.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let posts = receiver.accepted();
            assert_eq!(
                posts,
                Vec::<Value>::new(),
                "an untrusted receiver got a POST"
            );
            let metrics = all_metrics(std::slice::from_ref(&sluice)).await;
            assert_eq!((sum(&metrics, "sent"), sum(&metrics, "failed")), (0.0, 1.0));
        }
    }
}

/// A marker lives as long as the window: a limit of 4 per 2 s notifying at 100 % sends once
/// for a burst, nothing more while the window's marker lives, and once again for a burst in a
/// later window, with Redis and with the in-process store (a concurrent burst there too).
/// Seeded: a marker without expiry (Redis) / never expiring in process sent no second POST.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_window_sends_again_in_redis_and_in_process() {
    let redis = Redis::start().await;
    for redis in [Some(&redis), None] {
        let up = Upstream::start().await;
        let receiver = Receiver::start(0).await;
        let mut yaml = policy(
            &up,
            &receiver,
            Limit::requests("short", 4, "2s").algorithm("fixed_window"),
            &[0.5, 1.0],
        );
        if let Some(redis) = redis {
            yaml = yaml.store_redis(redis);
        }
        let instances = Arc::new(vec![start(&yaml).await]);
        let store = if redis.is_some() { "redis" } else { "local" };
        assert_eq!(burst(&instances, "a", 10).await, 4, "{store}");
        let posts = receiver.wait_for(2, Duration::from_millis(300)).await;
        assert_eq!(posts.len(), 2, "{store}: {posts:#?}");
        // The window and its markers end 2 s after the first request and the crossing.
        tokio::time::sleep(Duration::from_millis(2300)).await;
        assert_eq!(burst(&instances, "a", 10).await, 4, "{store}");
        let posts = receiver.wait_for(4, Duration::from_millis(300)).await;
        let mut want = Vec::new();
        for _ in 0..2 {
            want.push(("h:x-api-key=a".to_owned(), "0.5".to_owned(), 2, 2));
            want.push(("h:x-api-key=a".to_owned(), "1.0".to_owned(), 4, 0));
        }
        want.sort();
        assert_eq!(crossings(&posts), want, "{store}");
    }
}
