//! The phases of the request path, run in process on requests that never touched a socket:
//! a 429 completed by `finish`, the store's fallback, and `settle` giving places back. The
//! integration tests run the same paths through a real sluice, Redis and upstream. `phases`
//! drives each phase's decisions one by one, with an upstream the request itself scripts.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};

use super::*;
use crate::limiter::RedisStore;
use crate::tls::UpstreamTlsSet;

/// A body with no upstream to go to: the routes of these tests answer themselves.
impl ForwardBody for Empty<Bytes> {
    async fn forward<'a>(
        _: &'a Upstream,
        _: &'a UpstreamClient,
        _: Request<ClientBody<Self>>,
        _: SocketAddr,
        _: &'a Route,
        _: &'a Arc<BodyRefusals>,
    ) -> (Forwarded, unread_body::Connection) {
        let error = ForwardError::Other("no upstream in an in-process test".to_owned());
        (Err(error), unread_body::Connection::Kept)
    }

    async fn read_whole(
        self,
        _: u64,
        _: BodyPace,
        _: Arc<BodyRefusals>,
        _: &mut body_budget::Held,
    ) -> Result<Bytes, ReadError> {
        Ok(Bytes::new())
    }
}

const PEER: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 40000);

fn gateway(store_yaml: &str, routes_yaml: &str, metrics: &Metrics, store: Store) -> Gateway {
    let yaml = format!(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{store_yaml}routes:\n{routes_yaml}"
    );
    let config = crate::config::parse(&yaml, Path::new("t.yaml")).expect("a valid config");
    let policy =
        Policy::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .expect("a valid policy")
            .metered(metrics);
    Gateway::new(policy, store, &config.server, metrics)
}

fn get(path: &str) -> Request<Empty<Bytes>> {
    Request::get(path).body(Empty::new()).expect("a request")
}

async fn body_of(response: Response<ProxyBody>) -> serde_json::Value {
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a body")
        .to_bytes();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

fn counted(metrics: &Metrics, name: &str, labels: &str) -> f64 {
    let text = String::from_utf8(metrics.render()).expect("UTF-8");
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0.0, |value| value.parse().expect("a number"))
}

#[tokio::test]
async fn a_rejection_is_a_429_completed_once_by_finish() {
    let metrics = Metrics::new().expect("metrics");
    let store = Store::local(1000, &metrics);
    let routes = "  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: two, key: [], requests: 2, window: 1m }\n";
    let gateway = gateway("", routes, &metrics, store);
    for _ in 0..2 {
        let response = gateway.handle(get("/x"), PEER).await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    let mut grpc = get("/x");
    grpc.headers_mut()
        .insert(CONTENT_TYPE, "application/grpc".parse().expect("a value"));
    let response = gateway.handle(grpc, PEER).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let headers = response.headers();
    let retry_after: u64 = headers[RETRY_AFTER]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(headers["ratelimit-policy"], "\"two\";q=2;w=60");
    assert_eq!(
        headers["ratelimit"].to_str().expect("ASCII"),
        format!("\"two\";r=0;t={retry_after}")
    );
    assert_eq!(headers["grpc-status"], "14");
    assert!(headers.contains_key("x-request-id"));
    assert_eq!(headers[CONTENT_TYPE], "application/problem+json");
    let body = body_of(response).await;
    assert_eq!(body["limit"], "two");
    assert_eq!(body["route"], "api");
    assert_eq!(body["retry_after"], retry_after);
    assert_eq!(body["instance"], "/x");
    let labels = "outcome=\"limited\",route=\"api\"";
    assert_eq!(counted(&metrics, "sluice_requests_total", labels), 1.0);
    let labels = "outcome=\"responded\",route=\"api\"";
    assert_eq!(counted(&metrics, "sluice_requests_total", labels), 2.0);
}

/// A Redis that cannot be reached: nothing listens on port 1.
async fn unreachable_redis(metrics: &Metrics) -> Store {
    let redis = RedisStore::new("redis://127.0.0.1:1", 1, Duration::from_millis(300))
        .expect("valid settings");
    Store::redis(redis, 1000, metrics)
}

#[tokio::test]
async fn a_store_that_cannot_answer_falls_back_as_the_route_says() {
    let metrics = Metrics::new().expect("metrics");
    let store = unreachable_redis(&metrics).await;
    let routes = "  - name: local\n    match: { path_prefix: /local }\n    on_store_error: local\n    respond: { status: 200 }\n    limits:\n      - { name: one, key: [], requests: 1, window: 1m }\n  - name: deny\n    match: { path_prefix: /deny }\n    on_store_error: deny\n    respond: { status: 200 }\n    limits:\n      - { name: one, key: [], requests: 1, window: 1m }\n";
    let gateway = gateway("", routes, &metrics, store);
    // Decided in process: the first is admitted, the second is over the limit.
    assert_eq!(
        gateway.handle(get("/local"), PEER).await.status(),
        StatusCode::OK
    );
    let second = gateway.handle(get("/local"), PEER).await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let labels = "action=\"local\",route=\"local\"";
    assert_eq!(
        counted(&metrics, "sluice_store_fallback_decisions_total", labels),
        2.0
    );
    // Refused without the store: 503, with a short Retry-After and no RateLimit fields.
    let denied = gateway.handle(get("/deny"), PEER).await;
    assert_eq!(denied.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(denied.headers()[RETRY_AFTER], "1");
    assert!(!denied.headers().contains_key("ratelimit"));
    let body = body_of(denied).await;
    assert_eq!(body["status"], 503);
}

#[tokio::test]
async fn settle_gives_back_what_count_does_not_keep() {
    let metrics = Metrics::new().expect("metrics");
    let store = Store::local(1000, &metrics);
    let routes = "  - name: failing\n    match: { path_prefix: /failing }\n    respond: { status: 500 }\n    limits:\n      - { name: ok-only, key: [], requests: 1, window: 1m, count: { status: [200] } }\n  - name: fine\n    match: { path_prefix: /fine }\n    respond: { status: 200 }\n    limits:\n      - { name: ok-only, key: [], requests: 1, window: 1m, count: { status: [200] } }\n";
    let gateway = gateway("", routes, &metrics, store);
    // Every 500 is given back, so the limit of one never fills.
    for _ in 0..3 {
        let response = gateway.handle(get("/failing"), PEER).await;
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(response.headers()["ratelimit"], "\"ok-only\";r=0;t=60");
    }
    let labels = "decision=\"released\",limit=\"ok-only\",route=\"failing\"";
    assert_eq!(
        counted(&metrics, "sluice_limit_decisions_total", labels),
        3.0
    );
    // A 200 is kept: the next request finds no room.
    assert_eq!(
        gateway.handle(get("/fine"), PEER).await.status(),
        StatusCode::OK
    );
    let kept = gateway.handle(get("/fine"), PEER).await;
    assert_eq!(kept.status(), StatusCode::TOO_MANY_REQUESTS);
}

mod phases;
