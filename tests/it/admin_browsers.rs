//! A web page cannot use the admin API (issue 27, hole 2), through the real binary on a
//! loopback admin listener with no token, as the example configs run it: a request a browser
//! sends after DNS rebinding (a foreign `Host`) gets `421`; one from a page of another origin
//! (a foreign `Origin`), or a state-changing call without `X-Sluice-Admin` (a cross-site
//! `text/plain` post), gets `403`; none of them changes anything. The listener's own names
//! and addresses, with the right port, are served; `/metrics`, `/healthz` and `/readyz`
//! answer whatever the `Host` (scrapes and probes name the listener as they reach it).
//! Requests are written byte for byte, so the `Host` is exactly the one under test; over
//! HTTP/2 the `:authority` is checked the same way.

use crate::support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::{metric_sum, parse_metrics, Limit, Node, Policy, Route, Sluice, SLUICE_BIN};

/// One limited route, `/api`, that answers itself.
fn routes() -> Policy {
    Policy::new().route(
        Route::new("api", "/api")
            .respond(200, "ok\n")
            .limit(Limit::requests("per-key", 1, "1d").key(["header:x-api-key"])),
    )
}

/// The admin API answers only these hosts.
fn with_admin_hosts(policy: Policy) -> Policy {
    policy.set(
        "admin",
        Node::map([(
            "hosts",
            Node::from(["sluice-admin.internal", "localhost:19090"]),
        )]),
    )
}

/// Sends `head` (the request line and fields, without the final blank line) to `addr` with
/// `Connection: close`; the status and the body.
async fn raw(addr: SocketAddr, head: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the admin listener");
    let request = format!("{head}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("an answer within 10 s")
        .expect("read the answer");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .get(9..12)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn spend(sluice: &Sluice, key: &str) -> u16 {
    support::client()
        .get(format!("{}/api", sluice.url()))
        .header("x-api-key", key)
        .send()
        .await
        .expect("GET /api")
        .status()
        .as_u16()
}

fn admin_addr(sluice: &Sluice) -> SocketAddr {
    sluice
        .admin_url()
        .trim_start_matches("http://")
        .parse()
        .expect("the admin address")
}

/// A refusal's problem body names what was refused.
fn assert_problem(status: u16, body: &str, want: u16, says: &str, case: &str) {
    assert_eq!(status, want, "{case}: {body}");
    let problem: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{case}: not JSON ({e}): {body}"));
    assert_eq!(problem["status"], want, "{case}: {body}");
    assert!(
        problem["detail"].as_str().is_some_and(|d| d.contains(says)),
        "{case}: the detail should say {says:?}: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_reset_a_quota_or_reload() {
    let sluice = Sluice::start(&with_admin_hosts(routes())).await;
    let admin = admin_addr(&sluice);
    let port = admin.port();
    assert_eq!(spend(&sluice, "k1").await, 200);
    assert_eq!(spend(&sluice, "k1").await, 429, "k1 has spent its limit");
    let reset = "DELETE /admin/v1/limits/api/per-key?header.x-api-key=k1 HTTP/1.1";
    let reload = "POST /admin/v1/reload HTTP/1.1";
    let refused: Vec<(String, u16, &str)> = vec![
        // DNS rebinding: the page's own name, same-origin to the browser.
        (format!("{reset}\r\nHost: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\nX-Sluice-Admin: 1"), 421, "evil.example"),
        (format!("{reset}\r\nHost: evil.example:{port}\r\nX-Sluice-Admin: 1"), 421, "evil.example"),
        (format!("{reload}\r\nHost: evil.example\r\nX-Sluice-Admin: 1"), 421, "evil.example"),
        // A loopback name at another port: not this listener.
        (format!("{reset}\r\nHost: 127.0.0.1:{}\r\nX-Sluice-Admin: 1", port ^ 1), 421, "127.0.0.1"),
        (format!("{reset}\r\nHost: localhost:80\r\nX-Sluice-Admin: 1"), 421, "localhost:80"),
        // A configured name at another port than its entry allows.
        (format!("{reset}\r\nHost: sluice-admin.internal:1\r\nX-Sluice-Admin: 1"), 421, "sluice-admin.internal:1"),
        (format!("{reset}\r\nHost: localhost:{port}\r\nHost: evil.example\r\nX-Sluice-Admin: 1"), 421, "two `Host` fields"),
        // A page of another origin, even one on this machine.
        (format!("{reset}\r\nHost: localhost:{port}\r\nOrigin: http://evil.example\r\nX-Sluice-Admin: 1"), 403, "another origin"),
        (format!("{reset}\r\nHost: localhost:{port}\r\nOrigin: http://localhost:8080\r\nX-Sluice-Admin: 1"), 403, "another origin"),
        (format!("{reset}\r\nHost: localhost:{port}\r\nOrigin: null\r\nX-Sluice-Admin: 1"), 403, "another origin"),
        // The cross-site form post browsers send without a preflight.
        (format!("{reload}\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://evil.example\r\nContent-Type: text/plain"), 403, "another origin"),
        (format!("{reload}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: text/plain"), 403, "X-Sluice-Admin: 1"),
        (format!("{reset}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"), 403, "X-Sluice-Admin: 1"),
        // An absolute-form target names the host too, and wins over the field.
        (format!("POST http://evil.example:{port}/admin/v1/reload HTTP/1.1\r\nHost: localhost:{port}\r\nX-Sluice-Admin: 1"), 421, "evil.example"),
        // A read of the policy by a rebinding page.
        (format!("GET /admin/v1/config HTTP/1.1\r\nHost: evil.example:{port}"), 421, "evil.example"),
    ];
    for (head, want, says) in &refused {
        let (status, body) = raw(admin, head).await;
        assert_problem(status, &body, *want, says, head);
    }
    assert_eq!(
        spend(&sluice, "k1").await,
        429,
        "no refused reset took effect"
    );
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "sluice_config_reloads_total", &[]),
        0.0,
        "no refused reload ran"
    );

    // The listener's own names, with its port or none, and an origin of its own.
    let allowed = [
        format!("{reset}\r\nHost: localhost:{port}\r\nOrigin: http://localhost:{port}\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: 127.0.0.1:{port}\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: localhost\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: [::1]:{port}\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: Sluice-Admin.Internal:{port}\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: sluice-admin.internal\r\nX-Sluice-Admin: 1"),
        format!("{reset}\r\nHost: localhost:19090\r\nOrigin: http://localhost:19090\r\nX-Sluice-Admin: 1"),
    ];
    for head in &allowed {
        let (status, body) = raw(admin, head).await;
        assert_eq!(status, 200, "{head}: {body}");
        assert_eq!(
            spend(&sluice, "k1").await,
            200,
            "{head}: reset, admitted afresh"
        );
        assert_eq!(spend(&sluice, "k1").await, 429, "{head}: spent again");
    }
    let (status, body) = raw(
        admin,
        &format!("{reload}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nX-Sluice-Admin: 1"),
    )
    .await;
    assert_eq!(status, 200, "reload: {body}");
    // A read needs no header.
    let (status, body) = raw(
        admin,
        &format!("GET /admin/v1/config HTTP/1.1\r\nHost: 127.0.0.1:{port}"),
    )
    .await;
    assert_eq!(status, 200, "config: {body}");

    // Probes and scrapes name the listener as they reach it: any Host, no Origin.
    for path in ["/metrics", "/healthz", "/readyz"] {
        for host in ["evil.example", "10.9.8.7:9090", "sluice:9090"] {
            let (status, body) = raw(admin, &format!("GET {path} HTTP/1.1\r\nHost: {host}")).await;
            assert_eq!(status, 200, "{path} with Host {host}: {body}");
        }
        let (status, body) = raw(
            admin,
            &format!(
                "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://evil.example"
            ),
        )
        .await;
        assert_problem(status, &body, 403, "another origin", path);
    }
}

/// On a wildcard `admin_listen` (a container's `0.0.0.0`), the listener's own address is the
/// one the client connected to, as a kubelet probe or a Prometheus pod scrape names it: here
/// 127.0.0.2, which is none of the loopback names. Another address of the same host is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_wildcard_listener_the_address_connected_to_is_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (port, admin_port) = (support::free_port(), support::free_port());
    let config = dir.path().join("sluice.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{port}\nadmin_listen: 0.0.0.0:{admin_port}\n{}",
            routes()
                .set("admin", Node::map([("token_env", "ADMIN_TOKEN_BROWSERS")]))
                .to_yaml()
        ),
    )
    .expect("write the config");
    let log = dir.path().join("sluice.log");
    let mut child = Command::new(SLUICE_BIN)
        .args(["run", "--config"])
        .arg(&config)
        .env("ADMIN_TOKEN_BROWSERS", "tok-browsers-1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn sluice");
    let pod: SocketAddr = format!("127.0.0.2:{admin_port}")
        .parse()
        .expect("an address");
    let deadline = Instant::now() + Duration::from_secs(15);
    while tokio::net::TcpStream::connect(pod).await.is_err() {
        assert!(
            Instant::now() < deadline && child.try_wait().ok().flatten().is_none(),
            "sluice did not listen on {pod}:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let auth = "Authorization: Bearer tok-browsers-1";
    let config_at =
        |host: String| format!("GET /admin/v1/config HTTP/1.1\r\nHost: {host}\r\n{auth}");
    let (status, body) = raw(pod, &config_at(format!("127.0.0.2:{admin_port}"))).await;
    assert_eq!(status, 200, "its own address: {body}");
    let (status, body) = raw(pod, &config_at(format!("127.0.0.3:{admin_port}"))).await;
    assert_problem(status, &body, 421, "127.0.0.3", "another address");
    let (status, body) = raw(
        pod,
        &format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.2:{admin_port}"),
    )
    .await;
    assert_eq!(status, 200, "a kubelet probe: {body}");
    let _ = child.kill();
    let _ = child.wait();
}

/// Over HTTP/2 the host is the `:authority`: a rebinding name there is refused as in `Host`,
/// the listener's own address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http2_the_authority_must_name_the_listener() {
    use http_body_util::{BodyExt, Empty};
    let sluice = Sluice::start(&routes()).await;
    let admin = admin_addr(&sluice);
    let mut h2 = support::grpc::h2c_client(admin).await;
    for (authority, want) in [
        (format!("evil.example:{}", admin.port()), 421),
        (admin.to_string(), 200),
        (format!("localhost:{}", admin.port()), 200),
    ] {
        let request = http::Request::post(format!("http://{authority}/admin/v1/reload"))
            .header("x-sluice-admin", "1")
            .body(Empty::new().map_err(|never| match never {}).boxed_unsync())
            .expect("a request");
        let response = tokio::time::timeout(Duration::from_secs(10), h2.send_request(request))
            .await
            .expect("an answer within 10 s")
            .expect("an h2 answer");
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("the body")
            .to_bytes();
        assert_eq!(
            status,
            want,
            ":authority {authority}: {}",
            String::from_utf8_lossy(&body)
        );
    }
}
