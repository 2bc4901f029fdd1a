//! Proxying: hop-by-hop headers stripped both ways, X-Forwarded-* set, path
//! and query preserved, routing (order, segment-aware prefixes, methods),
//! direct responses, and the 502 / 504 / 404 problem+json answers.

use crate::support;

use std::time::{Duration, Instant};

use support::{metric_sum, parse_metrics, raw_http, Policy, Route, Sluice, Upstream, UpstreamSpec};

fn config(up: &str, closed_port: u16) -> Policy {
    Policy::new()
        .upstream(
            "main",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("10s"),
        )
        .upstream(
            "dead",
            UpstreamSpec::new(&format!("http://127.0.0.1:{closed_port}"))
                .connect_timeout("1s")
                .timeout("5s"),
        )
        .upstream(
            "slowup",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("300ms"),
        )
        .route(
            Route::new("login", "/login")
                .methods(["POST"])
                .respond(201, "login\n"),
        )
        .route(Route::new("status", "/status").respond(200, "ok\n"))
        .route(Route::new("dead", "/dead").upstream("dead"))
        .route(Route::new("slow", "/slow").upstream("slowup"))
        .route(Route::new("hop", "/hop-response").upstream("main"))
        .route(Route::new("api", "/api").upstream("main"))
}

async fn setup() -> (Upstream, Sluice) {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url(), support::closed_port())).await;
    (up, sluice)
}

/// The upstream's view of one request: header name -> values.
fn upstream_headers(echo: &serde_json::Value) -> &serde_json::Map<String, serde_json::Value> {
    echo["headers"].as_object().expect("echo has headers")
}

fn values(echo: &serde_json::Value, name: &str) -> Vec<String> {
    upstream_headers(echo)
        .get(name)
        .map(|v| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

async fn assert_problem(resp: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(
        resp.status().as_u16(),
        status,
        "headers {:?}",
        resp.headers()
    );
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    assert!(
        ct.starts_with("application/problem+json"),
        "content-type {ct:?} for {status}"
    );
    let body: serde_json::Value = resp.json().await.expect("problem+json body");
    assert_eq!(body["status"], status, "status in body {body}");
    assert!(body["title"].is_string(), "title in body {body}");
    body
}

#[tokio::test]
async fn hop_by_hop_request_headers_are_removed_and_forwarded_headers_set() {
    let (up, sluice) = setup().await;
    let req = "GET /api/echo?x=1&y=two%20words HTTP/1.1\r\n\
               Host: front.example:8443\r\n\
               Connection: x-secret-hop\r\n\
               X-Secret-Hop: 1\r\n\
               Keep-Alive: timeout=5, max=917\r\n\
               TE: trailers\r\n\
               Trailer: x-checksum\r\n\
               Proxy-Connection: keep-alive\r\n\
               Upgrade: foo\r\n\
               X-Ordinary: yes\r\n\
               X-Forwarded-For: 203.0.113.9\r\n\
               \r\n";
    let resp = raw_http(sluice.addr(), req).await;
    assert_eq!(resp.status, 200, "{resp:?}");
    let echo: serde_json::Value = serde_json::from_slice(&resp.body).expect("echo JSON");
    assert_eq!(up.hits(), 1);

    assert_eq!(echo["method"], "GET");
    assert_eq!(
        echo["path"], "/api/echo?x=1&y=two%20words",
        "path and query"
    );
    assert_eq!(values(&echo, "x-ordinary"), vec!["yes"], "ordinary header");
    for hop in [
        "x-secret-hop",
        "keep-alive",
        "te",
        "trailer",
        "proxy-connection",
        "upgrade",
    ] {
        assert!(
            values(&echo, hop).is_empty(),
            "hop-by-hop header {hop} reached the upstream: {echo}"
        );
    }
    // Not under another name, nor rewritten: the distinctive value appears nowhere.
    for (name, v) in upstream_headers(&echo) {
        assert!(
            !v.to_string().contains("max=917"),
            "the client's Keep-Alive value reached the upstream as {name}: {v}"
        );
    }
    // The proxy's own client may set its own Connection header, but the
    // client's value must not be forwarded.
    for v in values(&echo, "connection") {
        assert!(
            !v.to_ascii_lowercase().contains("x-secret-hop"),
            "client's Connection header forwarded: {v:?}"
        );
    }
    assert_eq!(
        values(&echo, "x-forwarded-for").join(", "),
        "203.0.113.9, 127.0.0.1",
        "peer address appended to X-Forwarded-For"
    );
    assert_eq!(values(&echo, "x-forwarded-proto"), vec!["http"]);
    assert_eq!(
        values(&echo, "x-forwarded-host"),
        vec!["front.example:8443"]
    );
}

#[tokio::test]
async fn forwarded_headers_without_incoming_ones() {
    let (up, sluice) = setup().await;
    // From another loopback address, so the appended peer is really the peer.
    let c = support::client_from("127.0.0.2");
    let r = c
        .put(format!("{}/api/items/7?v=1", sluice.url()))
        .header("x-ordinary", "yes")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let echo: serde_json::Value = r.json().await.unwrap();
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["path"], "/api/items/7?v=1");
    assert_eq!(values(&echo, "x-forwarded-for"), vec!["127.0.0.2"]);
    assert_eq!(values(&echo, "x-forwarded-proto"), vec!["http"]);
    let host = format!("127.0.0.1:{}", sluice.addr().port());
    assert_eq!(values(&echo, "x-forwarded-host"), vec![host]);
    assert_eq!(values(&echo, "x-ordinary"), vec!["yes"]);
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn hop_by_hop_response_headers_are_removed() {
    let (up, sluice) = setup().await;
    let req = "GET /hop-response HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n";

    // Sanity: the upstream really sends them.
    let direct = raw_http(up.addr(), req).await;
    assert_eq!(direct.status, 200);
    assert_eq!(direct.header("x-hop"), Some("1"), "{direct:?}");
    assert_eq!(direct.header("keep-alive"), Some("timeout=5"), "{direct:?}");
    assert_eq!(direct.header("proxy-connection"), Some("keep-alive"));

    let via = raw_http(sluice.addr(), req).await;
    assert_eq!(via.status, 200, "{via:?}");
    assert_eq!(
        via.header("x-normal-resp"),
        Some("yes"),
        "ordinary header kept"
    );
    assert!(
        !via.has_header("x-hop"),
        "x-hop (named by Connection) leaked: {via:?}"
    );
    assert!(
        !via.has_header("keep-alive"),
        "a Keep-Alive field reached the client: {via:?}"
    );
    assert!(
        !via.has_header("proxy-connection"),
        "proxy-connection leaked: {via:?}"
    );
    for (n, v) in &via.headers {
        if n == "connection" {
            assert!(
                !v.to_ascii_lowercase().contains("x-hop"),
                "upstream's Connection header leaked: {v:?}"
            );
        }
    }
    let echo: serde_json::Value = serde_json::from_slice(&via.body).unwrap();
    assert_eq!(echo["path"], "/hop-response");
}

#[tokio::test]
async fn upstream_refused_is_502() {
    let (up, sluice) = setup().await;
    let r = support::client()
        .get(format!("{}/dead/x", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_problem(r, 502).await;
    assert_eq!(up.hits(), 0);
    let m = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(
            &m,
            "sluice_upstream_errors_total",
            &[("upstream", "dead"), ("kind", "connect")]
        ) >= 1.0,
        "sluice_upstream_errors_total{{upstream=dead,kind=connect}} missing"
    );
    assert!(
        metric_sum(
            &m,
            "sluice_requests_total",
            &[("route", "dead"), ("outcome", "upstream_error")]
        ) >= 1.0
    );
}

#[tokio::test]
async fn upstream_too_slow_is_504() {
    let (up, sluice) = setup().await;
    let started = Instant::now();
    let r = support::client()
        .get(format!("{}/slow/2000", sluice.url()))
        .send()
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert_problem(r, 504).await;
    assert!(
        elapsed >= Duration::from_millis(250) && elapsed < Duration::from_millis(1500),
        "504 should come after the 300ms upstream timeout, came after {elapsed:?}"
    );
    assert_eq!(up.hits(), 1, "the request did reach the upstream");
    let m = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(
            &m,
            "sluice_upstream_errors_total",
            &[("upstream", "slowup"), ("kind", "timeout")]
        ) >= 1.0,
        "sluice_upstream_errors_total{{upstream=slowup,kind=timeout}} missing"
    );

    // A response within the timeout passes.
    let r = support::client()
        .get(format!("{}/slow/10", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "slow");
}

#[tokio::test]
async fn no_route_is_404() {
    let (up, sluice) = setup().await;
    let c = support::client();
    for path in ["/nothing-here", "/apix", "/statusx/1", "/"] {
        let r = c
            .get(format!("{}{path}", sluice.url()))
            .send()
            .await
            .unwrap();
        assert_problem(r, 404).await;
    }
    assert_eq!(up.hits(), 0);
    let m = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(&m, "sluice_requests_total", &[("outcome", "no_route")]) >= 4.0,
        "no_route outcome counted"
    );
}

#[tokio::test]
async fn respond_route_answers_without_upstream() {
    let (up, sluice) = setup().await;
    let c = support::client();
    for path in ["/status", "/status/deep/path?q=1"] {
        let r = c
            .get(format!("{}{path}", sluice.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.text().await.unwrap(), "ok\n", "{path}");
    }
    assert_eq!(up.hits(), 0, "a respond route never touches the upstream");
    let m = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(
            &m,
            "sluice_requests_total",
            &[("route", "status"), ("outcome", "responded")]
        ) >= 2.0
    );
}

/// Overlapping routes, most specific first and a catch-all last: the first match in file order
/// takes the request, prefixes end at segment boundaries, and a method-restricted route lets
/// other methods fall through to the routes after it.
fn overlapping_routes(up: &str) -> Policy {
    Policy::new()
        .upstream("main", up)
        .route(
            Route::new("login", "/login")
                .methods(["POST"])
                .respond(201, "login\n"),
        )
        .route(Route::new("admin", "/api/admin").respond(200, "admin\n"))
        .route(Route::new("api", "/api").upstream("main"))
        .route(Route::new("fallback", "/").respond(200, "fallback\n"))
}

#[tokio::test]
async fn routing_is_ordered_segment_aware_and_method_aware() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&overlapping_routes(&up.url())).await;
    let c = support::client();
    let base = sluice.url();
    let answer = |method: http::Method, path: &'static str| {
        let request = c.request(method.clone(), format!("{base}{path}"));
        async move {
            let r = request.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap(), format!("{method} {path}"))
        }
    };

    // `/api/admin` comes before `/api` and `/`, which match too: it wins.
    for path in ["/api/admin", "/api/admin/users"] {
        let (status, body, what) = answer(http::Method::GET, path).await;
        assert_eq!((status, body.as_str()), (200, "admin\n"), "{what}");
    }
    // POST /login and below match the login route, before the catch-all.
    for path in ["/login", "/login/", "/login/step2"] {
        let (status, body, what) = answer(http::Method::POST, path).await;
        assert_eq!((status, body.as_str()), (201, "login\n"), "{what}");
    }
    // Not a segment match, or not the right method: on to the catch-all.
    for (method, path) in [
        (http::Method::POST, "/loginx"),
        (http::Method::GET, "/login"),
        (http::Method::GET, "/other"),
    ] {
        let (status, body, what) = answer(method, path).await;
        assert_eq!((status, body.as_str()), (200, "fallback\n"), "{what}");
    }
    assert_eq!(up.hits(), 0, "nothing so far is the upstream's");

    // `/api` and below, except `/api/admin...`, go to the upstream; `/api/adminx` is not
    // below `/api/admin`.
    for path in ["/api", "/api/x/y", "/api/adminx"] {
        let (status, body, what) = answer(http::Method::GET, path).await;
        assert_eq!(status, 200, "{what}");
        let echo: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{what}: the upstream's echo, not {body:?}: {e}"));
        assert_eq!(echo["path"], path);
    }
    assert_eq!(up.hits(), 3);
}

/// Clients may speak cleartext HTTP/2 with prior knowledge (h2c); the upstream still gets
/// HTTP/1.1, with X-Forwarded-Host taken from the :authority.
#[tokio::test]
async fn h2c_clients_are_proxied() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let (up, sluice) = setup().await;
    let stream = tokio::net::TcpStream::connect(sluice.addr()).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2c handshake with sluice");
    tokio::spawn(connection);
    let request = http::Request::get("http://h2.example/api/over-h2?q=1")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.expect("h2 request");
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["path"], "/api/over-h2?q=1");
    assert_eq!(values(&echo, "x-forwarded-host"), ["h2.example"]);
    assert_eq!(up.hits(), 1);
}

/// `/api/../login` would match `/api` here and reach `/login` after the upstream normalizes
/// it; such paths are refused before routing, encoded dots included.
#[tokio::test]
async fn dot_segments_are_refused() {
    let (up, sluice) = setup().await;
    for path in ["/api/../login", "/api/%2e%2E/login", "/api/./x"] {
        let response = raw_http(
            sluice.addr(),
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(response.status, 400, "{path}: {response:?}");
        assert!(
            response
                .header("content-type")
                .is_some_and(|ct| ct.starts_with("application/problem+json")),
            "{path}: {response:?}"
        );
    }
    assert_eq!(up.hits(), 0, "nothing reaches the upstream");
}
