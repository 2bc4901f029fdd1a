//! Each phase's decisions, in process and without a socket: the gateway runs on a request body
//! of this module's own (`Full<Bytes>`), whose "upstream" answers what the request carries in
//! its extensions (`Answer`), so the act phase, the token settlement after it and the client
//! leaving mid-answer can all be driven from here. The store is the in-process one (or a Redis
//! nobody listens on, for the fallbacks), and what a phase kept or gave back is read from the
//! store itself (`counted_now`), not from sluice's answers.
//!
//! Phases covered: route (first match, methods, a declared body over `max_body`, a field
//! sent twice), identify (a missing, a valid and an invalid token), decide (which limit
//! rejects, a rejection records nothing, a shadow limit), the store's fallback (`allow`),
//! hold (a delay, `max_delayed`, a held client leaving), settle (per limit by `count:`), the
//! token keep/give-back rules (reserve, settle down, overrun, no figure, connect error, client
//! gone mid-answer) and finish/stop (the problem+json of every stop, `Retry-After`).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};

use super::{body_of, counted, gateway, unreachable_redis, PEER};
use crate::proxy::*;

/// What the test upstream answers a forwarded request: carried in the request's extensions,
/// so each request says its own.
#[derive(Clone)]
enum Answer {
    /// This status and body, whole, with these headers.
    Whole {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: &'static str,
    },
    /// A 200 whose body sends `first` and then never ends: an answer the client leaves.
    Hanging { first: &'static str },
    /// The upstream cannot be reached.
    Unreachable,
}

/// A body that sends one frame and then waits forever.
struct HangingBody(Option<Bytes>);

impl Body for HangingBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut().0.take() {
            Some(first) => Poll::Ready(Some(Ok(Frame::data(first)))),
            None => Poll::Pending,
        }
    }
}

impl ForwardBody for Full<Bytes> {
    async fn forward<'a>(
        _: &'a Upstream,
        _: &'a UpstreamClient,
        request: Request<ClientBody<Self>>,
        _: std::net::SocketAddr,
        _: &'a Route,
        _: &'a Arc<BodyRefusals>,
    ) -> (Forwarded, unread_body::Connection) {
        let answer = request.extensions().get::<Answer>().cloned();
        let forwarded = match answer {
            None => Err(ForwardError::Other("the test gave no answer".to_owned())),
            Some(Answer::Unreachable) => Err(ForwardError::Connect("refused".to_owned())),
            Some(Answer::Hanging { first }) => Ok(Response::new(ProxyBody::stream(HangingBody(
                Some(Bytes::from_static(first.as_bytes())),
            )))),
            Some(Answer::Whole {
                status,
                headers,
                body,
            }) => {
                let mut response =
                    Response::new(ProxyBody::full(Bytes::from_static(body.as_bytes())));
                *response.status_mut() = StatusCode::from_u16(status).expect("a status");
                for (name, value) in headers {
                    response
                        .headers_mut()
                        .insert(name, value.parse().expect("a header value"));
                }
                Ok(response)
            }
        };
        // An in-process request has no client connection to keep or close.
        (forwarded, unread_body::Connection::Kept)
    }

    async fn read_whole(
        self,
        limit: u64,
        _: BodyPace,
        _: Arc<BodyRefusals>,
        _: &mut body_budget::Held,
    ) -> Result<Bytes, ReadError> {
        let bytes = self.collect().await.expect("a full body").to_bytes();
        if bytes.len() as u64 > limit {
            return Err(ReadError::Body(BodyFault::TooLarge));
        }
        Ok(bytes)
    }
}

fn request(method: Method, path: &str, body: &str, answer: Answer) -> Request<Full<Bytes>> {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("a request");
    request.extensions_mut().insert(answer);
    request
}

fn ok() -> Answer {
    Answer::Whole {
        status: 200,
        headers: Vec::new(),
        body: "ok",
    }
}

fn get(path: &str) -> Request<Full<Bytes>> {
    request(Method::GET, path, "", ok())
}

/// What the store counts now in each limit a `GET path` with `headers` would be checked
/// against (the route's limits in order): requests, or tokens for a token budget.
async fn counted_now(gateway: &Gateway, path: &str, headers: &[(&str, &str)]) -> Vec<u64> {
    counted_for(gateway, Method::GET, path, headers).await
}

/// As `counted_now`, for a request with `method`.
async fn counted_for(
    gateway: &Gateway,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Vec<u64> {
    let mut builder = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let (head, ()) = builder.body(()).expect("a request").into_parts();
    let policy = gateway.policy();
    let route = policy
        .route(&head.method, head.uri.path())
        .expect("a route");
    let plan = crate::request::checks::from_head(
        &policy,
        route,
        &head,
        PEER.ip(),
        None,
        crate::request::Now::read().calendar,
    );
    let mut counts = Vec::new();
    for check in plan.limits.checks() {
        let (peek, _) = gateway
            .store()
            .peek(check)
            .await
            .expect("the store answers");
        counts.push(peek.count);
    }
    counts
}

fn local_gateway(prefix: &str, routes: &str) -> (Gateway, Metrics) {
    let metrics = Metrics::new().expect("metrics");
    let store = crate::limiter::Store::local(1000, &metrics);
    (gateway(prefix, routes, &metrics, store), metrics)
}

// ---------------------------------------------------------------------------------------
// route

#[tokio::test]
async fn route_takes_the_first_match_by_method_and_refuses_before_deciding() {
    let routes = "  - name: put-only\n    match: { path_prefix: /up, methods: [PUT] }\n    respond: { status: 201 }\n    max_body: 8\n    limits:\n      - { name: one, key: [], requests: 1, window: 1m }\n  - name: by-key\n    match: { path_prefix: /k }\n    respond: { status: 200 }\n    limits:\n      - { name: per-key, key: [\"header:x-api-key\"], requests: 5, window: 1m }\n  - name: rest\n    match: { path_prefix: /up }\n    respond: { status: 202 }\n";
    let (gateway, metrics) = local_gateway("", routes);
    // The method picks the route: a GET on /up falls through to `rest`.
    let got = gateway.handle(get("/up/x"), PEER).await;
    assert_eq!(got.status(), StatusCode::ACCEPTED);
    // A declared body over `max_body` is a 413 before any decision: the limit stays empty.
    let put = request(Method::PUT, "/up/x", "nine bytes", ok());
    let refused = gateway.handle(put, PEER).await;
    assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = body_of(refused).await;
    assert_eq!(body["status"], 413);
    assert_eq!(
        counted_for(&gateway, Method::PUT, "/up/x", &[]).await,
        vec![0]
    );
    let put = request(Method::PUT, "/up/x", "eight b.", ok());
    assert_eq!(
        gateway.handle(put, PEER).await.status(),
        StatusCode::CREATED
    );
    let labels = "outcome=\"responded\",route=\"put-only\"";
    assert_eq!(counted(&metrics, "sluice_requests_total", labels), 1.0);
    // A field a limit reads, sent twice, has no one reading: 400, and nothing is counted.
    let mut twice = get("/k");
    twice
        .headers_mut()
        .append("x-api-key", "a".parse().unwrap());
    twice
        .headers_mut()
        .append("x-api-key", "b".parse().unwrap());
    let refused = gateway.handle(twice, PEER).await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        counted_now(&gateway, "/k", &[("x-api-key", "a")]).await,
        vec![0]
    );
    // No route: 404, a problem.
    let none = Metrics::new().expect("metrics");
    let only_k = "  - name: k\n    match: { path_prefix: /k }\n    respond: { status: 200 }\n";
    let gateway = gateway_with(only_k, &none);
    let missing = gateway.handle(get("/nowhere"), PEER).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert_eq!(missing.headers()[CONTENT_TYPE], "application/problem+json");
}

fn gateway_with(routes: &str, metrics: &Metrics) -> Gateway {
    gateway(
        "",
        routes,
        metrics,
        crate::limiter::Store::local(1000, metrics),
    )
}

// ---------------------------------------------------------------------------------------
// identify

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// An HS256 token signed with `secret` for subject `sub`.
fn token(secret: &[u8], sub: &str) -> String {
    let exp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        + 3600;
    let header = base64url(br#"{"alg":"HS256","typ":"JWT"}"#);
    let claims =
        serde_json::json!({"iss": "https://issuer.test", "aud": "api", "sub": sub, "exp": exp});
    let payload = base64url(claims.to_string().as_bytes());
    let signed = format!("{header}.{payload}");
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let signature = base64url(ring::hmac::sign(&key, signed.as_bytes()).as_ref());
    format!("{signed}.{signature}")
}

#[tokio::test]
async fn identify_rejects_a_missing_token_and_keys_a_valid_one_by_its_claim() {
    let secret = b"0123456789abcdef0123456789abcdef-test-secret";
    let dir = tempfile::tempdir().expect("a directory");
    let secret_path = dir.path().join("secret");
    std::fs::write(&secret_path, secret).expect("write the secret");
    let jwt = format!(
        "jwt:\n  - name: users\n    issuer: https://issuer.test\n    audiences: [api]\n    keys:\n      - {{ secret_file: \"{}\", algorithm: HS256 }}\n",
        secret_path.display()
    );
    let routes = "  - name: strict\n    match: { path_prefix: /strict }\n    jwt: { verifier: users }\n    respond: { status: 200 }\n    limits:\n      - { name: per-user, key: [\"jwt:sub\"], requests: 1, window: 1m }\n  - name: lenient\n    match: { path_prefix: /lenient }\n    jwt: { verifier: users, on_invalid: anonymous }\n    respond: { status: 200 }\n    limits:\n      - { name: per-user, key: [\"jwt:sub\"], requests: 1, window: 1m }\n";
    let yaml = format!("listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{jwt}routes:\n{routes}");
    let file = std::path::Path::new("t.yaml");
    let config = crate::config::parse(&yaml, file).expect("a valid config");
    // The verifiers' keys are read from their files by the caller of `compile_with`.
    let verifiers = crate::jwt::Verifiers::load(&config.jwt, file).expect("the keys");
    let metrics = Metrics::new().expect("metrics");
    let tls = crate::tls::UpstreamTlsSet::default();
    let policy = Policy::compile(&config, file, &tls, &verifiers)
        .expect("a valid policy")
        .metered(&metrics);
    let store = crate::limiter::Store::local(1000, &metrics);
    let gateway = Gateway::new(policy, store, &config.server, &metrics);
    let bearer = |path: &str, token: &str| {
        let mut request = get(path);
        let value = format!("Bearer {token}").parse().expect("a value");
        request.headers_mut().insert("authorization", value);
        request
    };
    // No token on a `reject` route: 401 with the challenge, counted by reason.
    let missing = gateway.handle(get("/strict"), PEER).await;
    assert_eq!(missing.status(), StatusCode::UNAUTHORIZED);
    let challenge = missing.headers()[WWW_AUTHENTICATE].to_str().expect("ASCII");
    assert!(challenge.starts_with("Bearer"), "{challenge}");
    let labels = "reason=\"missing\",route=\"strict\"";
    assert_eq!(counted(&metrics, "sluice_jwt_invalid_total", labels), 1.0);
    // Valid tokens: each subject has its own place.
    let alice = token(secret, "alice");
    let bob = token(secret, "bob");
    assert_eq!(
        gateway
            .handle(bearer("/strict", &alice), PEER)
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        gateway.handle(bearer("/strict", &bob), PEER).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        gateway
            .handle(bearer("/strict", &alice), PEER)
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // A forged token on an `anonymous` route: counted as bad, then limited as the client's
    // address (its one place taken by the first, so the second is refused), not as `alice`.
    let forged = token(b"another secret, another secret, another", "alice");
    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let got = gateway.handle(bearer("/lenient", &forged), PEER).await;
        assert_eq!(got.status(), expected);
    }
    let labels = "reason=\"signature\",route=\"lenient\"";
    assert_eq!(counted(&metrics, "sluice_jwt_invalid_total", labels), 2.0);
    assert_eq!(
        gateway
            .handle(bearer("/lenient", &alice), PEER)
            .await
            .status(),
        StatusCode::OK,
        "alice's place on `lenient` is her own, not the anonymous client's"
    );
}

// ---------------------------------------------------------------------------------------
// decide and the store's fallback

#[tokio::test]
async fn decide_rejects_on_the_limit_without_room_and_records_nothing() {
    let routes = "  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: wide, key: [], requests: 5, window: 1m }\n      - { name: narrow, key: [], requests: 1, window: 1m }\n      - { name: watch, key: [], requests: 1, window: 1m, shadow: true }\n";
    let (gateway, metrics) = local_gateway("", routes);
    assert_eq!(
        gateway.handle(get("/x"), PEER).await.status(),
        StatusCode::OK
    );
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![1, 1, 1]);
    let refused = gateway.handle(get("/x"), PEER).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = refused.headers()[RETRY_AFTER]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let body = body_of(refused).await;
    assert_eq!(body["limit"], "narrow", "the limit without room is named");
    // A rejected request is recorded in no limit, the wide one included.
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![1, 1, 1]);
    let decisions = |decision: &str, limit: &str| {
        let labels = format!("decision=\"{decision}\",limit=\"{limit}\",route=\"api\"");
        counted(&metrics, "sluice_limit_decisions_total", &labels)
    };
    assert_eq!(decisions("rejected", "narrow"), 1.0);
    assert_eq!(decisions("admitted", "wide"), 1.0);
    assert_eq!(decisions("rejected", "wide"), 0.0);
    // The shadow limit also had no room the second time; it refuses nothing, it is counted.
    assert_eq!(decisions("shadow_rejected", "watch"), 1.0);
}

#[tokio::test]
async fn a_store_that_cannot_answer_lets_an_allow_route_through_undecided() {
    let metrics = Metrics::new().expect("metrics");
    let store = unreachable_redis(&metrics).await;
    let routes = "  - name: open\n    match: { path_prefix: / }\n    on_store_error: allow\n    respond: { status: 200 }\n    limits:\n      - { name: one, key: [], requests: 1, window: 1m }\n";
    let gateway = gateway("", routes, &metrics, store);
    for _ in 0..3 {
        let response = gateway.handle(get("/x"), PEER).await;
        assert_eq!(response.status(), StatusCode::OK);
        // Undecided: no limit's state to report.
        assert!(!response.headers().contains_key("ratelimit"));
    }
    let labels = "action=\"allow\",route=\"open\"";
    assert_eq!(
        counted(&metrics, "sluice_store_fallback_decisions_total", labels),
        3.0
    );
}

// ---------------------------------------------------------------------------------------
// hold

/// One request a second; an over-limit one is held up to `max_delay`, one at a time.
fn delayed(max_delay: &str) -> String {
    format!("  - name: paced\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    max_delayed: 1\n    limits:\n      - {{ name: one, key: [], requests: 1, window: 1s, on_exceed: delay, max_delay: {max_delay} }}\n")
}

#[tokio::test]
async fn hold_delays_an_over_limit_request_until_its_place_and_bounds_the_held() {
    let (gateway, metrics) = local_gateway("", &delayed("3s"));
    let started = Instant::now();
    assert_eq!(
        gateway.handle(get("/x"), PEER).await.status(),
        StatusCode::OK
    );
    // The second waits for the first's place to leave the 1 s window; the third, admitted
    // for 2 s later (within `max_delay`), finds the route's one held place taken: 429, with
    // the delay it would have had as its Retry-After, and its place given back.
    let (second, third) = tokio::join!(gateway.handle(get("/x"), PEER), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        gateway.handle(get("/x"), PEER).await
    });
    let waited = started.elapsed();
    assert_eq!(second.status(), StatusCode::OK);
    assert!(
        waited >= Duration::from_millis(900),
        "held for only {waited:?}"
    );
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()[RETRY_AFTER], "2");
    let body = body_of(third).await;
    assert_eq!(body["status"], 429);
    let detail = body["detail"].as_str().expect("a detail");
    assert!(detail.contains("max_delayed"), "{detail}");
    // By now the first has left the window; the second is counted, the third was given back.
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![1]);
    let labels = "decision=\"delayed\",limit=\"one\",route=\"paced\"";
    assert_eq!(
        counted(&metrics, "sluice_limit_decisions_total", labels),
        2.0
    );
}

#[tokio::test]
async fn a_held_client_that_leaves_gives_its_place_back() {
    let (gateway, _metrics) = local_gateway("", &delayed("1500ms"));
    assert_eq!(
        gateway.handle(get("/x"), PEER).await.status(),
        StatusCode::OK
    );
    // Held for about a second, then the client leaves: its future is dropped.
    let left = tokio::time::timeout(Duration::from_millis(100), gateway.handle(get("/x"), PEER));
    assert!(left.await.is_err(), "the held request was still waiting");
    // The give-back runs in a task of its own.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![1]);
    // So the next one waits for the first's place only (about 1 s, within 1.5 s); had the
    // leaver's place been kept it would need 2 s, beyond `max_delay`, and get a 429.
    assert_eq!(
        gateway.handle(get("/x"), PEER).await.status(),
        StatusCode::OK
    );
}

// ---------------------------------------------------------------------------------------
// settle (count by outcome)

#[tokio::test]
async fn settle_gives_back_only_in_the_limits_that_do_not_count_the_status() {
    let routes = "  - name: api\n    match: { path_prefix: / }\n    upstream: app\n    limits:\n      - { name: all, key: [], requests: 10, window: 1m }\n      - { name: failures, key: [], requests: 10, window: 1m, count: { status: [5xx] } }\n      - { name: successes, key: [], requests: 10, window: 1m, count: { status: [200] } }\n";
    let (gateway, metrics) = local_gateway(
        "upstreams:\n  app: { url: \"http://127.0.0.1:1\" }\n",
        routes,
    );
    let answer = |status| Answer::Whole {
        status,
        headers: Vec::new(),
        body: "",
    };
    let got = gateway
        .handle(request(Method::GET, "/x", "", answer(503)), PEER)
        .await;
    assert_eq!(got.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![1, 1, 0]);
    let got = gateway
        .handle(request(Method::GET, "/x", "", answer(200)), PEER)
        .await;
    assert_eq!(got.status(), StatusCode::OK);
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![2, 1, 1]);
    // An upstream that cannot be reached is sluice's 502: counted by `5xx` too.
    let got = gateway
        .handle(request(Method::GET, "/x", "", Answer::Unreachable), PEER)
        .await;
    assert_eq!(got.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(counted_now(&gateway, "/x", &[]).await, vec![3, 2, 1]);
    let labels = "decision=\"released\",limit=\"successes\",route=\"api\"";
    assert_eq!(
        counted(&metrics, "sluice_limit_decisions_total", labels),
        2.0
    );
}

// ---------------------------------------------------------------------------------------
// tokens: reserve, settle, keep

const TOKENS: &str = "  - name: chat\n    match: { path_prefix: /v1/ }\n    upstream: llm\n    limits:\n      - { name: tpm, key: [], tokens: 100000, window: 1m, reserve: { default_output: 256, max_output: 4096, max_body: 16KiB } }\n";
const LLM: &str = "upstreams:\n  llm: { url: \"http://127.0.0.1:1\" }\n";
const CHAT: &str = "/v1/chat/completions";

fn chat(max_tokens: u32) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
    })
    .to_string()
}

fn usage_answer(total: u64) -> Answer {
    let body = serde_json::json!({
        "id": "x",
        "usage": {"prompt_tokens": total / 2, "completion_tokens": total - total / 2, "total_tokens": total},
    })
    .to_string();
    Answer::Whole {
        status: 200,
        headers: vec![("content-type", "application/json".to_owned())],
        body: Box::leak(body.into_boxed_str()),
    }
}

async fn tokens_counted(gateway: &Gateway) -> u64 {
    counted_now(gateway, CHAT, &[]).await[0]
}

#[tokio::test]
async fn tokens_reserve_the_bound_then_settle_to_the_usage_when_the_answer_ends() {
    let (gateway, metrics) = local_gateway(LLM, TOKENS);
    let body = chat(1000);
    let reservation = body.len() as u64 + 1000;
    let response = gateway
        .handle(request(Method::POST, CHAT, &body, usage_answer(120)), PEER)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    // Until the client has read the answer, the whole reservation is counted...
    assert_eq!(tokens_counted(&gateway).await, reservation);
    let labels = "limit=\"tpm\",route=\"chat\",unit=\"tokens\"";
    assert_eq!(
        counted(&metrics, "sluice_tokens_reserved_total", labels),
        reservation as f64
    );
    // ...and once it has, only what the answer says was used.
    response.into_body().collect().await.expect("the answer");
    assert_eq!(tokens_counted(&gateway).await, 120);
    assert_eq!(
        counted(&metrics, "sluice_tokens_returned_total", labels),
        (reservation - 120) as f64
    );
}

#[tokio::test]
async fn tokens_used_beyond_the_reservation_are_charged_as_an_overrun() {
    let (gateway, metrics) = local_gateway(LLM, TOKENS);
    let body = chat(100);
    let reservation = body.len() as u64 + 100;
    let used = reservation + 500;
    let response = gateway
        .handle(request(Method::POST, CHAT, &body, usage_answer(used)), PEER)
        .await;
    response.into_body().collect().await.expect("the answer");
    assert_eq!(tokens_counted(&gateway).await, used);
    let labels = "limit=\"tpm\",route=\"chat\",unit=\"tokens\"";
    assert_eq!(
        counted(&metrics, "sluice_token_overruns_total", labels),
        1.0
    );
}

#[tokio::test]
async fn tokens_are_kept_without_a_figure_and_given_back_when_nothing_was_asked() {
    let (gateway, _metrics) = local_gateway(LLM, TOKENS);
    let body = chat(1000);
    let reservation = body.len() as u64 + 1000;
    // The upstream could not be reached: it spent nothing, all is given back.
    let response = gateway
        .handle(
            request(Method::POST, CHAT, &body, Answer::Unreachable),
            PEER,
        )
        .await;
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(tokens_counted(&gateway).await, 0);
    // It answered without a usage figure: it may have spent it all, all is kept.
    let silent = Answer::Whole {
        status: 200,
        headers: vec![("content-type", "application/json".to_owned())],
        body: "{\"id\":\"x\"}",
    };
    let response = gateway
        .handle(request(Method::POST, CHAT, &body, silent), PEER)
        .await;
    response.into_body().collect().await.expect("the answer");
    assert_eq!(tokens_counted(&gateway).await, reservation);
}

#[tokio::test]
async fn a_client_that_leaves_mid_answer_keeps_the_whole_reservation() {
    let (gateway, _metrics) = local_gateway(LLM, TOKENS);
    let body = chat(1000);
    let reservation = body.len() as u64 + 1000;
    let hanging = Answer::Hanging {
        first: "{\"id\":\"x\",",
    };
    let response = gateway
        .handle(request(Method::POST, CHAT, &body, hanging), PEER)
        .await;
    let mut answer = response.into_body();
    let first = answer.frame().await.expect("a frame").expect("no error");
    assert!(first.is_data());
    // The client leaves: the body is dropped before its end.
    drop(answer);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(tokens_counted(&gateway).await, reservation);
}

#[tokio::test]
async fn a_reservation_that_can_never_fit_is_a_413_that_reserves_nothing() {
    let routes = TOKENS.replace("tokens: 100000", "tokens: 500");
    let (gateway, _metrics) = local_gateway(LLM, &routes);
    let response = gateway
        .handle(request(Method::POST, CHAT, &chat(1000), ok()), PEER)
        .await;
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = body_of(response).await;
    let detail = body["detail"].as_str().expect("a detail");
    assert!(detail.contains("can never fit"), "{detail}");
    assert_eq!(tokens_counted(&gateway).await, 0);
}

// ---------------------------------------------------------------------------------------
// finish and stop

#[test]
fn every_stop_has_its_status_and_fault() {
    use crate::metrics::Refusal;
    let cases: Vec<(Stop, StatusCode, Fault)> = vec![
        (
            Stop::Refused {
                status: StatusCode::URI_TOO_LONG,
                detail: String::new(),
                reason: Refusal::BodyTooLarge,
            },
            StatusCode::URI_TOO_LONG,
            Fault::Client,
        ),
        (Stop::NoRoute, StatusCode::NOT_FOUND, Fault::Client),
        (
            Stop::Unauthenticated(crate::jwt::Invalid::Missing),
            StatusCode::UNAUTHORIZED,
            Fault::Client,
        ),
        (Stop::Limited, StatusCode::TOO_MANY_REQUESTS, Fault::Limit),
        (
            Stop::TooManyHeld {
                delay: Duration::from_secs(1),
            },
            StatusCode::TOO_MANY_REQUESTS,
            Fault::Limit,
        ),
        (
            Stop::StoreUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
            Fault::Store,
        ),
        (
            Stop::KeysUnavailable,
            StatusCode::SERVICE_UNAVAILABLE,
            Fault::Sluice,
        ),
        (
            Stop::Upstream {
                error: ForwardError::Connect(String::new()),
                upstream: "u".parse().expect("a name"),
            },
            StatusCode::BAD_GATEWAY,
            Fault::Upstream,
        ),
        (
            Stop::Upstream {
                error: ForwardError::Timeout(Duration::from_secs(1)),
                upstream: "u".parse().expect("a name"),
            },
            StatusCode::GATEWAY_TIMEOUT,
            Fault::Upstream,
        ),
        (
            Stop::Internal("x"),
            StatusCode::INTERNAL_SERVER_ERROR,
            Fault::Sluice,
        ),
        (
            Stop::Unreservable {
                status: StatusCode::UNPROCESSABLE_ENTITY,
                detail: String::new(),
            },
            StatusCode::UNPROCESSABLE_ENTITY,
            Fault::Client,
        ),
    ];
    for (stop, status, fault) in cases {
        assert_eq!(stop.status(), status, "{stop:?}");
        assert_eq!(stop.fault(), fault, "{stop:?}");
    }
}

#[tokio::test]
async fn finish_makes_every_stop_a_problem_with_the_request_id_and_its_outcome() {
    let metrics = Metrics::new().expect("metrics");
    let store = unreachable_redis(&metrics).await;
    let routes = "  - name: deny\n    match: { path_prefix: /deny }\n    on_store_error: deny\n    respond: { status: 200 }\n    limits:\n      - { name: one, key: [], requests: 1, window: 1m }\n  - name: app\n    match: { path_prefix: /app }\n    upstream: app\n";
    let gateway = gateway(
        "upstreams:\n  app: { url: \"http://127.0.0.1:1\" }\n",
        routes,
        &metrics,
        store,
    );
    let mut with_id = get("/deny/a?q=1");
    with_id
        .headers_mut()
        .insert("x-request-id", "abc-123".parse().expect("a value"));
    let denied = gateway.handle(with_id, PEER).await;
    assert_eq!(denied.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(denied.headers()[RETRY_AFTER], "1");
    assert_eq!(denied.headers()["x-request-id"], "abc-123");
    assert_eq!(denied.headers()[CONTENT_TYPE], "application/problem+json");
    let body = body_of(denied).await;
    assert_eq!(body["status"], 503);
    assert_eq!(body["title"], "Service Unavailable");
    assert_eq!(body["instance"], "/deny/a");
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
    let failed = gateway
        .handle(request(Method::GET, "/app", "", Answer::Unreachable), PEER)
        .await;
    assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
    assert!(failed.headers().contains_key("x-request-id"));
    let body = body_of(failed).await;
    assert_eq!(body["upstream"], "app");
    // A HEAD gets the status and fields, and no body.
    let head = request(Method::HEAD, "/deny", "", ok());
    let answered = gateway.handle(head, PEER).await;
    assert_eq!(answered.status(), StatusCode::SERVICE_UNAVAILABLE);
    let bytes = answered
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    assert!(bytes.is_empty(), "{bytes:?}");
    for (outcome, route) in [("store_error", "deny"), ("upstream_error", "app")] {
        let labels = format!("outcome=\"{outcome}\",route=\"{route}\"");
        assert!(
            counted(&metrics, "sluice_requests_total", &labels) >= 1.0,
            "{labels}"
        );
    }
}
