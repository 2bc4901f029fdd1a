//! JWT keys from a `jwks_url`, through the real sluice, against an HTTPS server of this
//! harness (an rcgen CA sluice trusts through `jwks_ca_file`) that serves a JWK set, rotates
//! it, fails with 500, stalls (never answers), serves garbage, a set with a repeated kid and
//! an oversize body. Asserted from the server's own record of requests and from sluice's
//! answers: no keys → 503; rotation picked up through an unknown kid within a bounded time;
//! the unknown-kid refetch rate-limited; the last good set serving through every failure;
//! each failure counted by outcome; no request waiting on a fetch. And the verified-token
//! cache: a cached token past its `exp` is refused, and one whose key a rotation removed.

use crate::jwt_identities::{claims, now, with, Signer, AUDIENCE, ISSUER};
use crate::support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

use support::certs::Ca;
use support::{metric_sum, parse_metrics, Jwt, Policy, Route, Sluice};

/// What the JWKS server answers now.
#[derive(Clone)]
enum Mode {
    /// 200 with this body and `Cache-Control` value.
    Serve(String, &'static str),
    /// 500.
    Fail,
    /// Reads the request and never answers.
    Stall,
    /// 200 with a body that is not a JWK set.
    Garbage,
    /// 200 with a body of 2 MiB (a valid JSON string) in 64 KiB chunks, no `Content-Length`.
    Oversize,
    /// The same body with its `Content-Length`.
    OversizeDeclared,
}

/// An HTTPS server of JWK sets, with a count of the requests it received.
struct JwksServer {
    port: u16,
    mode: Arc<Mutex<Mode>>,
    hits: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
    ca_path: std::path::PathBuf,
}

fn set(signers: &[&Signer]) -> String {
    json!({"keys": signers.iter().map(|s| s.jwk()).collect::<Vec<_>>()}).to_string()
}

impl JwksServer {
    async fn start(mode: Mode) -> JwksServer {
        let ca = Ca::new("jwks test CA");
        let acceptor = ca.server("localhost").acceptor(&[b"http/1.1"]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let mode = Arc::new(Mutex::new(mode));
        let hits = Arc::new(AtomicUsize::new(0));
        let (m, h) = (Arc::clone(&mode), Arc::clone(&hits));
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, mode, hits) = (acceptor.clone(), Arc::clone(&m), Arc::clone(&h));
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = service_fn(move |_: Request<Incoming>| {
                        let (mode, hits) = (Arc::clone(&mode), Arc::clone(&hits));
                        async move {
                            hits.fetch_add(1, Ordering::SeqCst);
                            let mode = mode.lock().unwrap().clone();
                            let (status, body, cache) = match mode {
                                Mode::Serve(body, cache) => (200, body, cache),
                                Mode::Fail => (500, "oops".to_owned(), "no-store"),
                                Mode::Stall => {
                                    std::future::pending::<()>().await;
                                    unreachable!()
                                }
                                Mode::Garbage => (200, "<html>not json".to_owned(), "max-age=5"),
                                Mode::OversizeDeclared => {
                                    (200, format!("\"{}\"", "a".repeat(2 << 20)), "max-age=5")
                                }
                                Mode::Oversize => {
                                    let chunks = (0..32).map(|_| {
                                        Ok::<_, Infallible>(Frame::data(Bytes::from(vec![
                                            b' ';
                                            64 << 10
                                        ])))
                                    });
                                    let body = StreamBody::new(futures_util::stream::iter(chunks));
                                    return Ok::<_, Infallible>(
                                        Response::builder()
                                            .status(200)
                                            .body(BodyExt::boxed(body))
                                            .unwrap(),
                                    );
                                }
                            };
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .header("content-type", "application/json")
                                    .header("cache-control", cache)
                                    .body(BodyExt::boxed(Full::new(Bytes::from(body))))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, ca.pem()).expect("write CA");
        JwksServer {
            port,
            mode,
            hits,
            _dir: dir,
            ca_path,
        }
    }

    fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// The `jwt:` section (its verifier's `refresh` bounds: `min_refresh`, `max_refresh`)
    /// and one route `/api` (401 on an invalid token, no limits).
    fn policy(&self, refresh: &[(&str, &str)]) -> Policy {
        let url = format!("https://localhost:{}/.well-known/jwks.json", self.port);
        let verifier = refresh.iter().fold(
            Jwt::new("auth", ISSUER, [AUDIENCE])
                .jwks_url(&url, Some(&self.ca_path))
                .set("fetch_timeout", "1s"),
            |verifier, (field, value)| verifier.set(field, *value),
        );
        Policy::new().jwt(verifier).route(api_route())
    }
}

/// `/api`, answering 200 to a request with a valid token of the verifier `auth`.
fn api_route() -> Route {
    Route::new("api", "/api")
        .respond(200, "ok")
        .jwt("auth", false)
}

/// The status of `GET /api` with `token`, and how long the answer took.
async fn timed(sluice: &Sluice, token: &str) -> (u16, Duration) {
    let started = Instant::now();
    let response = support::client()
        .get(format!("{}/api", sluice.url()))
        .header("authorization", format!("Bearer {token}"))
        .send()
        .await
        .expect("an answer");
    (response.status().as_u16(), started.elapsed())
}

async fn status(sluice: &Sluice, token: &str) -> u16 {
    timed(sluice, token).await.0
}

async fn fetches(sluice: &Sluice, outcome: &str) -> f64 {
    metric_sum(
        &parse_metrics(&sluice.metrics().await),
        "sluice_jwks_fetches_total",
        &[("verifier", "auth"), ("outcome", outcome)],
    )
}

/// A request may take this long at most while a fetch stalls or fails: far above a
/// request's own time on a loaded machine, far below the 1 s fetch timeout it must not wait
/// for.
const REQUEST_BOUND: Duration = Duration::from_millis(600);

/// No keys yet → 503; keys in → 200; a rotation reaches sluice through an unknown kid; the
/// old key's cached token is refused after it; outage, garbage, a repeated kid, oversize and
/// a stall each leave the last good keys serving, are counted, and slow no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_url_verifier_follows_rotation_and_keeps_its_keys_through_failures() {
    let (k1, k2, k3) = (Signer::rsa("k1", 1), Signer::rsa("k2", 2), Signer::ec("k3"));
    let server = JwksServer::start(Mode::Stall).await;
    let sluice =
        Sluice::start(&server.policy(&[("min_refresh", "1s"), ("max_refresh", "1h")])).await;
    let t1 = k1.token(&claims(json!("alice")));
    let t2 = k2.token(&claims(json!("bob")));
    let t3 = k3.token(&claims(json!("carol")));

    // 1. The first fetch stalls: the route answers 503 problem+json, at once.
    let response = support::client()
        .get(format!("{}/api", sluice.url()))
        .header("authorization", format!("Bearer {t1}"))
        .send()
        .await
        .expect("an answer");
    assert_eq!(response.status().as_u16(), 503, "no keys yet");
    assert_eq!(
        support::header(&response, "content-type"),
        "application/problem+json"
    );
    let body: Value = response.json().await.expect("problem+json");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("keys not yet available")),
        "{body}"
    );
    for _ in 0..5 {
        let (code, took) = timed(&sluice, &t1).await;
        assert_eq!(code, 503);
        assert!(
            took < REQUEST_BOUND,
            "a request waited {took:?} on the first fetch"
        );
    }

    // 2. The server answers: the keys come in (first retries 1 s apart plus the 1 s stall).
    server.set_mode(Mode::Serve(set(&[&k1]), "max-age=3600"));
    support::wait_for(Duration::from_secs(10), "the first good fetch", || async {
        status(&sluice, &t1).await == 200
    })
    .await;
    assert!(
        fetches(&sluice, "timeout").await >= 1.0,
        "the stall counted"
    );
    assert_eq!(status(&sluice, &t1).await, 200, "now cached");
    assert_eq!(status(&sluice, &t2).await, 401, "k2 is not published yet");

    // 3. Rotation: k2 replaces k1. max-age is an hour, so only the unknown kid brings the
    // refetch; it is rate-limited to one per min_refresh (1 s) however many tokens ask.
    server.set_mode(Mode::Serve(set(&[&k2]), "max-age=3600"));
    let before = server.hits();
    let started = Instant::now();
    let mut accepted = None;
    while started.elapsed() < Duration::from_secs(5) {
        let (code, took) = timed(&sluice, &t2).await;
        assert!(
            took < REQUEST_BOUND,
            "a request waited {took:?} on a refetch"
        );
        if code == 200 {
            accepted = Some(started.elapsed());
            break;
        }
        assert_eq!(code, 401, "the keys at hand answer meanwhile");
    }
    let accepted = accepted.expect("a token of the rotated-in key accepted within 5 s");
    let refetches = server.hits() - before;
    assert!(
        (1..=3).contains(&refetches),
        "{refetches} fetches for an unknown kid over {accepted:?}: at most one per second"
    );
    assert_eq!(
        status(&sluice, &t1).await,
        401,
        "k1's token was verified and cached before the rotation removed k1"
    );
    // Tokens naming a kid nobody publishes, 25 over about 1.2 s: at most 2 fetches.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = server.hits();
    for _ in 0..25 {
        assert_eq!(status(&sluice, &t3).await, 401);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let asked = server.hits() - before;
    assert!(
        (1..=2).contains(&asked),
        "{asked} fetches for 25 unknown-kid tokens in ~1.2 s: one per min_refresh (1 s)"
    );

    // 4. Outage, garbage, a repeated kid, oversize, a stall: each refused and counted; k2
    // keeps serving, and no request waits. An unknown kid (t3) asks for each refetch.
    let repeated = {
        let mut k2_again = k2.jwk();
        k2_again["n"] = k1.jwk()["n"].clone();
        json!({"keys": [k2.jwk(), k2_again]}).to_string()
    };
    let only_enc = {
        let mut enc = k2.jwk();
        enc["use"] = json!("enc");
        json!({"keys": [enc]}).to_string()
    };
    for (mode, outcome) in [
        (Mode::Fail, "status"),
        (Mode::Garbage, "bad_set"),
        (Mode::Serve(repeated, "max-age=5"), "bad_set"),
        (Mode::Serve(only_enc, "max-age=5"), "bad_set"),
        (Mode::Oversize, "too_large"),
        (Mode::OversizeDeclared, "too_large"),
        (Mode::Stall, "timeout"),
    ] {
        let counted = fetches(&sluice, outcome).await;
        server.set_mode(mode);
        let started = Instant::now();
        let mut worst = Duration::ZERO;
        while fetches(&sluice, outcome).await < counted + 1.0 {
            assert!(
                started.elapsed() < Duration::from_secs(8),
                "no `{outcome}` fetch counted in 8 s"
            );
            let (code3, took3) = timed(&sluice, &t3).await;
            let (code2, took2) = timed(&sluice, &t2).await;
            assert_eq!(code3, 401, "k3 was never published");
            assert_eq!(code2, 200, "the last good keys serve through `{outcome}`");
            worst = worst.max(took2).max(took3);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            worst < REQUEST_BOUND,
            "a request took {worst:?} during `{outcome}`"
        );
        // A fresh token of k2, not cached: verified with the last good keys.
        let fresh = k2.token(&with(claims(json!("dave")), "jti", json!(outcome)));
        assert_eq!(status(&sluice, &fresh).await, 200, "after `{outcome}`");
    }
    assert!(
        sluice.log().contains("cannot fetch the JWK set"),
        "failures are logged"
    );

    // 5. Recovery: k3 is published; its token gets in.
    server.set_mode(Mode::Serve(set(&[&k2, &k3]), "max-age=3600"));
    support::wait_for(Duration::from_secs(8), "k3 published", || async {
        status(&sluice, &t3).await == 200
    })
    .await;
    let metrics = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(
            &metrics,
            "sluice_jwks_keys_age_seconds",
            &[("verifier", "auth")]
        ) < 5.0,
        "the keys' age gauge"
    );
}

/// The server's `Cache-Control: max-age` sets the refresh, held within the bounds: max-age=1
/// with min_refresh 1s refetches about every second; max-age=3600 with max_refresh 2s every
/// two seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refresh_follows_max_age_within_the_bounds() {
    let key = Signer::rsa("k1", 1);
    for (cache, bounds, low, high) in [
        (
            "max-age=1",
            [("min_refresh", "1s"), ("max_refresh", "1h")],
            3,
            6,
        ),
        (
            "max-age=3600",
            [("min_refresh", "1s"), ("max_refresh", "2s")],
            2,
            4,
        ),
        (
            "max-age=0",
            [("min_refresh", "3s"), ("max_refresh", "1h")],
            1,
            3,
        ),
    ] {
        let server = JwksServer::start(Mode::Serve(set(&[&key]), cache)).await;
        let sluice = Sluice::start(&server.policy(&bounds)).await;
        let token = key.token(&claims(json!("alice")));
        support::wait_for(Duration::from_secs(5), "the first fetch", || async {
            status(&sluice, &token).await == 200
        })
        .await;
        let first = server.hits();
        tokio::time::sleep(Duration::from_millis(4500)).await;
        let more = server.hits() - first;
        assert!(
            (low..=high).contains(&more),
            "{cache} with {bounds:?}: {more} fetches in 4.5 s, expected {low}..={high}"
        );
    }
}

/// The verified-token cache never outlives `exp`: a token accepted (and cached) a moment
/// before its `exp` is refused once it has passed (with clock_skew 1s). File keys here: the
/// cache is the same for both sources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_token_past_its_exp_is_refused() {
    let key = Signer::rsa("k1", 1);
    let dir = tempfile::tempdir().expect("tempdir");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, set(&[&key])).expect("write");
    let policy = Policy::new()
        .jwt(
            Jwt::new("auth", ISSUER, [AUDIENCE])
                .jwks_file(&jwks)
                .clock_skew("1s"),
        )
        .route(api_route());
    let sluice = Sluice::start(&policy).await;
    let exp = now() + 2;
    let token = key.token(&with(claims(json!("alice")), "exp", json!(exp)));
    assert_eq!(status(&sluice, &token).await, 200);
    assert_eq!(status(&sluice, &token).await, 200, "from the cache");
    while now() <= exp + 1 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        status(&sluice, &token).await,
        401,
        "cached, but past its exp"
    );
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "sluice_jwt_invalid_total",
            &[("route", "api"), ("reason", "expired")]
        ),
        1.0
    );
}

/// `sluice check` accepts a `jwks_url` verifier without fetching it (the URL points at a
/// closed port) and names the field of each mistake.
#[test]
fn check_takes_a_jwks_url_without_fetching_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new("check CA");
    let ca_path = dir.path().join("ca.pem");
    std::fs::write(&ca_path, ca.pem()).expect("write");
    std::fs::write(dir.path().join("jwks.json"), set(&[&Signer::rsa("k1", 1)])).expect("write");
    let good = format!(
        r#"listen: 127.0.0.1:1
admin_listen: 127.0.0.1:2
jwt:
  - name: auth
    issuer: "{ISSUER}"
    audiences: [{AUDIENCE}]
    jwks_url: "https://127.0.0.1:{port}/jwks"
    jwks_ca_file: {ca}
    min_refresh: 2s
routes:
  - name: api
    match: {{ path_prefix: /api }}
    respond: {{ status: 200, body: ok }}
    jwt: {{ verifier: auth }}
"#,
        port = support::closed_port(),
        ca = ca_path.display()
    );
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, &good).expect("write");
    let (status, stdout, stderr) = support::sluice_check(&path);
    assert!(status.success(), "{stdout}{stderr}");
    let cases: Vec<(String, &str, &str)> = vec![
        (
            good.replace("https://127", "http://127"),
            "jwt[0].jwks_url",
            "https://",
        ),
        (
            good.replace(
                "    min_refresh: 2s\n",
                "    min_refresh: 2s\n    jwks_file: jwks.json\n",
            ),
            "jwt[0].jwks_url",
            "exclusive",
        ),
        (
            good.replace("min_refresh: 2s", "min_refresh: 2s\n    max_refresh: 1s"),
            "jwt[0].min_refresh",
            "at most max_refresh",
        ),
        (
            good.replace("ca.pem", "missing.pem"),
            "jwt[0].jwks_ca_file",
            "missing.pem",
        ),
        (
            good.replace(
                "    jwks_url: \"https://127.0.0.1",
                "    jwks_file: jwks.json\n    #",
            ),
            "jwt[0].jwks_ca_file",
            "a setting of `jwks_url`",
        ),
    ];
    for (yaml, field, message) in cases {
        assert_ne!(yaml, good, "the case changed nothing: {field}");
        std::fs::write(&path, &yaml).expect("write");
        let (status, _, stderr) = support::sluice_check(&path);
        assert!(!status.success(), "{field}: accepted");
        assert!(stderr.contains(field), "{field}: {stderr}");
        assert!(stderr.contains(message), "{message}: {stderr}");
        assert!(stderr.contains("policy.yaml:"), "names the file: {stderr}");
    }
}

/// Keys of the published set sluice cannot verify with are left out, not refused. A reload
/// that keeps the verifier's URL and settings keeps its fetcher and its keys: the
/// server stalls from then on, and tokens are still accepted at once after the reload (no
/// 503 while a new fetcher would wait for its first keys). A reload that changes a fetch
/// setting starts a new fetcher, whose routes answer 503 until it has keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_keys_are_left_out_and_a_reload_keeps_the_fetched_keys() {
    let key = Signer::rsa("k1", 1);
    // As Keycloak publishes: an encryption key beside the signing one, and here a curve
    // sluice does not verify: both left out, the signing key used.
    let mut enc = Signer::rsa("enc1", 2).jwk();
    enc["use"] = json!("enc");
    enc["alg"] = json!("RSA-OAEP");
    let p384 = json!({"kty": "EC", "crv": "P-384", "kid": "p384", "x": "AA", "y": "AA"});
    let published = json!({"keys": [enc, key.jwk(), p384]}).to_string();
    let server = JwksServer::start(Mode::Serve(published, "max-age=3600")).await;
    let sluice = Sluice::start(&server.policy(&[("min_refresh", "1s")])).await;
    let token = key.token(&claims(json!("alice")));
    support::wait_for(Duration::from_secs(5), "the first fetch", || async {
        status(&sluice, &token).await == 200
    })
    .await;
    server.set_mode(Mode::Stall);
    let text = std::fs::read_to_string(sluice.config_path()).expect("read the config");
    let listen: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
    let other = Route::new("other", "/other").respond_status(204);
    let added = server.policy(&[("min_refresh", "1s")]).route(other.clone());
    support::replace_file(
        sluice.config_path(),
        &format!("{listen}{}", added.to_yaml()),
    );
    support::wait_for(Duration::from_secs(10), "the reload", || async {
        reloads_ok(&sluice).await >= 1.0
    })
    .await;
    assert_eq!(status(&sluice, &token).await, 200, "the keys were kept");
    let fresh = key.token(&with(claims(json!("bob")), "jti", json!("after")));
    assert_eq!(
        status(&sluice, &fresh).await,
        200,
        "verified with the kept keys"
    );

    let changed = server.policy(&[("min_refresh", "2s")]).route(other);
    support::replace_file(
        sluice.config_path(),
        &format!("{listen}{}", changed.to_yaml()),
    );
    support::wait_for(Duration::from_secs(10), "the second reload", || async {
        reloads_ok(&sluice).await >= 2.0
    })
    .await;
    assert_eq!(
        status(&sluice, &token).await,
        503,
        "a new fetcher (min_refresh changed) has no keys while the server stalls"
    );
}

async fn reloads_ok(sluice: &Sluice) -> f64 {
    metric_sum(
        &parse_metrics(&sluice.metrics().await),
        "sluice_config_reloads_total",
        &[("result", "ok")],
    )
}
