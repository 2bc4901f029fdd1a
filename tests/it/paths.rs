//! No spelling of a path gets around its limit.
//!
//! The upstream here routes the way permissive frameworks do: it decodes every escape, strips
//! `;` parameters (Tomcat, Spring), merges slashes (nginx), resolves dot segments and compares
//! case-insensitively (Express, ASP.NET). `/login` is limited to 2 per minute per client; once
//! that is spent, every spelling that upstream would treat as `/login` must be stopped by
//! sluice, either with 429 (it matched the limited route) or 400 (sluice refused a path with
//! no single meaning), and the upstream's login handler must have run exactly twice.

use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};

use support::{raw_http, Limit, Policy, Route, Sluice, StoreKind};

/// An upstream with one handler worth protecting, reached the permissive way.
struct PermissiveUpstream {
    addr: SocketAddr,
    logins: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl PermissiveUpstream {
    async fn start() -> PermissiveUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let logins = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&logins);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let counter = Arc::clone(&counter);
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let counter = Arc::clone(&counter);
                        async move {
                            let route = permissive_route(request.uri().path());
                            if route == "/login" {
                                counter.fetch_add(1, Ordering::SeqCst);
                            }
                            // The path as received, for the forwarding assertions.
                            let seen = request
                                .uri()
                                .path_and_query()
                                .map_or("", |pq| pq.as_str())
                                .to_owned();
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
                                "{route} {seen}"
                            )))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        PermissiveUpstream { addr, logins, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn logins(&self) -> usize {
        self.logins.load(Ordering::SeqCst)
    }
}

impl Drop for PermissiveUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How a permissive framework maps a raw path to a handler: every escape decoded (`%2F` and
/// `%5C` included), backslashes as slashes, `;` parameters stripped, empty and `.` segments
/// dropped, `..` resolved, lower-cased, trailing slash ignored, cut at a NUL.
fn permissive_route(raw: &str) -> String {
    let mut decoded = Vec::new();
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(v) = u8::from_str_radix(&raw[i + 1..i + 3], 16) {
                decoded.push(v);
                i += 3;
                continue;
            }
        }
        decoded.push(bytes[i]);
        i += 1;
    }
    // C-string servers stop at a NUL.
    if let Some(nul) = decoded.iter().position(|&b| b == 0) {
        decoded.truncate(nul);
    }
    let text = String::from_utf8_lossy(&decoded).replace('\\', "/");
    let mut segments: Vec<String> = Vec::new();
    for segment in text.split('/') {
        let name = segment.split(';').next().unwrap_or("").to_ascii_lowercase();
        match name.as_str() {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(name),
        }
    }
    format!("/{}", segments.join("/"))
}

/// `/login` limited to two requests per client address, everything else open; `login` is the
/// login route's prefix as written in the policy.
fn config(upstream: &str, store: Policy, login: &str) -> Policy {
    store
        .upstream("app", upstream)
        .route(
            Route::new("login", login)
                .upstream("app")
                .limit(Limit::requests("per-ip", 2, "1m")),
        )
        .route(Route::new("default", "/").upstream("app"))
}

async fn get(sluice: &Sluice, path: &str) -> support::RawResponse {
    raw_http(
        sluice.addr(),
        &format!("GET {path} HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n"),
    )
    .await
}

/// Every spelling of `/login` an upstream like this one would route to its login handler.
const SPELLINGS: &[(&str, u16)] = &[
    ("/login", 429),
    ("/%6Cogin", 429),
    ("/logi%6E", 429),
    ("/%6c%6F%67%69%6e", 429),
    ("//login", 429),
    ("///login//", 429),
    ("/LOGIN", 429),
    ("/LoGiN/", 429),
    ("/%4C%4fGIN", 429),
    ("/login;jsessionid=abc", 429),
    ("/login;x=1/", 429),
    ("/;x=1/login", 429),
    ("/login?next=/home", 429),
    ("/login/", 429),
    ("/api/../login", 400),
    ("/api/%2e%2E/login", 400),
    ("/api/..;/login", 400),
    ("/./login", 400),
    ("/%2Flogin", 400),
    ("/%2flogin", 400),
    ("/api%2F..%2Flogin", 400),
    ("/%5Clogin", 400),
    ("/\\login", 400),
    ("/log%69n%00", 400),
];

async fn no_spelling_reaches_login(kind: StoreKind) {
    let upstream = PermissiveUpstream::start().await;
    let store = support::Store::start(kind).await;
    let sluice = Sluice::start(&config(
        &upstream.url(),
        Policy::new().store(&store),
        "/login",
    ))
    .await;

    for _ in 0..2 {
        assert_eq!(get(&sluice, "/login").await.status, 200);
    }
    assert_eq!(upstream.logins(), 2);
    for (path, expected) in SPELLINGS {
        assert_eq!(
            permissive_route(path.split('?').next().unwrap_or(path)),
            "/login",
            "test premise: the upstream routes {path} to /login"
        );
        let response = get(&sluice, path).await;
        assert_eq!(
            response.status,
            *expected,
            "{path}: {}",
            String::from_utf8_lossy(&response.body)
        );
        if *expected == 400 {
            assert_eq!(
                response.header("content-type"),
                Some("application/problem+json"),
                "{path}"
            );
        }
    }
    assert_eq!(
        upstream.logins(),
        2,
        "a spelling of /login reached the upstream's login handler"
    );
    // Other paths still pass, and the refusals were counted.
    assert_eq!(get(&sluice, "/loginx").await.status, 200);
    let metrics = support::parse_metrics(&sluice.metrics().await);
    let refused_paths = support::metric_sum(
        &metrics,
        "sluice_refused_requests_total",
        &[("reason", "path")],
    );
    let expected_refusals = SPELLINGS.iter().filter(|(_, s)| *s == 400).count();
    assert_eq!(refused_paths, expected_refusals as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_spelling_of_a_limited_path_reaches_the_upstream_memory() {
    no_spelling_reaches_login(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_spelling_of_a_limited_path_reaches_the_upstream_redis() {
    no_spelling_reaches_login(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_receives_the_canonical_path_and_the_query_as_sent() {
    let upstream = PermissiveUpstream::start().await;
    let sluice = Sluice::start(&config(&upstream.url(), Policy::new(), "/login")).await;
    for (sent, forwarded) in [
        (
            "//%6Cogin?next=%2e%2E/%2F&a=%41",
            "/login?next=%2e%2E/%2F&a=%41",
        ),
        ("/a%3fb//c%c3%a9", "/a%3Fb/c%C3%A9"),
        ("/REPORTS", "/REPORTS"),
        ("/reports;jsessionid=1", "/reports;jsessionid=1"),
        ("/users/%7Eann", "/users/~ann"),
    ] {
        let response = get(&sluice, sent).await;
        assert_eq!(response.status, 200, "{sent}");
        let body = String::from_utf8_lossy(&response.body).into_owned();
        let seen = body.split_once(' ').map_or("", |(_, seen)| seen);
        assert_eq!(seen, forwarded, "{sent}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_case_sensitive_route_matches_only_its_own_case() {
    let upstream = PermissiveUpstream::start().await;
    let yaml = Policy::new()
        .upstream("app", upstream.url())
        .route(
            Route::new("exact", "/Reports")
                .matching("case_sensitive", true)
                .respond(200, "exact"),
        )
        .route(Route::new("default", "/").respond(200, "default"));
    let sluice = Sluice::start(&yaml).await;
    assert_eq!(get(&sluice, "/Reports/1").await.body, b"exact");
    assert_eq!(get(&sluice, "/%52eports").await.body, b"exact");
    assert_eq!(get(&sluice, "/reports/1").await.body, b"default");
    assert_eq!(get(&sluice, "/REPORTS").await.body, b"default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_the_config_is_read_in_canonical_form() {
    let upstream = PermissiveUpstream::start().await;
    let sluice = Sluice::start(&config(&upstream.url(), Policy::new(), "//%6Cogin")).await;
    for _ in 0..2 {
        assert_eq!(get(&sluice, "/login").await.status, 200);
    }
    assert_eq!(get(&sluice, "/Login").await.status, 429);
}
