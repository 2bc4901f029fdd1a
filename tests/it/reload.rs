//! Hot reload: sluice picks up a valid edit of its config file within a second (in place, by
//! rename, or on SIGHUP), refuses an invalid one or one that changes what needs a restart
//! while the old policy keeps serving, keeps upstream connection pools across reloads, and
//! says which file version runs with `sluice_config_hash`.

use crate::support;

use std::convert::Infallible;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sha2::{Digest, Sha256};

use support::{client, free_port, header, metric_sum, parse_limit_field, parse_metrics, Sluice};

/// One route answered by sluice itself, limited per client IP.
fn limited(requests: u32, window: &str) -> String {
    format!(
        r#"routes:
  - name: api
    match:
      path_prefix: /api
    respond:
      status: 200
      body: "ok\n"
    limits:
      - name: per-ip
        key: [client_ip]
        requests: {requests}
        window: {window}
"#
    )
}

/// The `listen` and `admin_listen` lines `Sluice::start` wrote, kept when a test rewrites
/// the rest of the file.
fn head(sluice: &Sluice) -> String {
    let text = std::fs::read_to_string(sluice.config_path()).expect("read the config");
    text.lines().take(2).map(|l| format!("{l}\n")).collect()
}

/// Replaces the config file through a rename: the reload poll never reads half of it.
fn rewrite(sluice: &Sluice, rest: &str) -> String {
    let text = format!("{}{rest}", head(sluice));
    support::replace_file(sluice.config_path(), &text);
    text
}

/// Rewrites the config file in place (same inode), as `echo >` does.
fn rewrite_in_place(sluice: &Sluice, rest: &str) -> String {
    let text = format!("{}{rest}", head(sluice));
    std::fs::write(sluice.config_path(), &text).expect("write the config");
    text
}

/// `POST /admin/v1/reload`, from a browser-proof client (`x-sluice-admin`).
async fn admin_reload(c: &reqwest::Client, sluice: &Sluice) -> reqwest::Response {
    c.post(format!("{}/admin/v1/reload", sluice.admin_url()))
        .header("x-sluice-admin", "1")
        .send()
        .await
        .unwrap()
}

/// The `q` of the `per-ip` item of the RateLimit-Policy of `GET /api`.
async fn policy_q(c: &reqwest::Client, sluice: &Sluice) -> i64 {
    let r = c
        .get(format!("{}/api", sluice.url()))
        .send()
        .await
        .expect("GET /api");
    let items = parse_limit_field(header(&r, "ratelimit-policy"));
    assert_eq!(items.len(), 1, "{items:?}");
    items[0].param("q")
}

async fn metric(sluice: &Sluice, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_sum(&parse_metrics(&sluice.metrics().await), name, labels)
}

async fn reloads(sluice: &Sluice, result: &str) -> f64 {
    metric(sluice, "sluice_config_reloads_total", &[("result", result)]).await
}

/// Waits (up to 10 s) for `sluice_config_reloads_total{result}` to reach `value`.
async fn wait_reloads(sluice: &Sluice, result: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = reloads(sluice, result).await;
        if now == value {
            return;
        }
        assert!(
            now < value,
            "reloads{{result={result}}} = {now}, beyond {value}"
        );
        assert!(
            Instant::now() < deadline,
            "reloads{{result={result}}} stayed {now}, expected {value}\nlog:\n{}",
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `sluice_config_hash` computed independently: the first 13 hex digits of the SHA-256.
fn expected_hash(text: &str) -> f64 {
    let hex: String = Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    i64::from_str_radix(&hex[..13], 16).unwrap() as f64
}

async fn config_hash(sluice: &Sluice) -> f64 {
    metric(sluice, "sluice_config_hash", &[]).await
}

/// 1-based (line, column) of `token` on the first line of `text` containing it.
fn locate(text: &str, token: &str) -> (usize, usize) {
    for (i, line) in text.lines().enumerate() {
        if let Some(col) = line.find(token) {
            return (i + 1, col + 1);
        }
    }
    panic!("test bug: {token:?} not in the config")
}

/// The log line at error level containing `needle`.
fn error_line(sluice: &Sluice, needle: &str) -> String {
    let log = sluice.log();
    let line = log
        .lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no log line contains {needle:?}\nlog:\n{log}"));
    assert!(line.contains("ERROR"), "logged at error level: {line}");
    line.to_owned()
}

/// (a) An invalid file written under steady load: no request fails, the old limit keeps
/// answering, the refusal is counted once and logged with its line and column. Redis is the
/// store, as in production.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalid_file_is_refused_under_load_and_the_old_policy_keeps_serving() {
    let _heavy = support::heavy().await;
    let redis = support::Redis::start().await;
    let store = support::redis_store_yaml(&redis.url());
    let sluice = Sluice::start(&format!("{store}{}", limited(1_000_000, "1m"))).await;

    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, url) = (Arc::clone(&stop), format!("{}/api", sluice.url()));
        load.push(tokio::spawn(async move {
            let c = client();
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match c.get(&url).send().await {
                    Ok(r) if r.status() == 200 => {
                        let items = parse_limit_field(header(&r, "ratelimit-policy"));
                        if items[0].param("q") == 1_000_000 {
                            ok += 1;
                        } else {
                            failed.push(format!("policy {items:?}"));
                        }
                    }
                    Ok(r) => failed.push(format!("status {}", r.status())),
                    Err(e) => failed.push(format!("error {e}")),
                }
            }
            (ok, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The limit changes too, so a half-applied file would show in the answers.
    let bad = limited(5, "thirty");
    let written = rewrite(&sluice, &format!("{store}{bad}"));
    wait_reloads(&sluice, "error", 1.0).await;
    // Keep the load on past a few more polls: the refused file is not retried.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);

    let (mut ok, mut failed) = (0, Vec::new());
    for task in load {
        let (n, f) = task.await.unwrap();
        ok += n;
        failed.extend(f);
    }
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok >= 100, "the load ran: {ok} requests");
    assert_eq!(policy_q(&client(), &sluice).await, 1_000_000);
    assert_eq!(reloads(&sluice, "error").await, 1.0, "reported once");
    assert_eq!(reloads(&sluice, "ok").await, 0.0);

    let (line, col) = locate(&written, "thirty");
    let path = sluice.config_path().display();
    error_line(
        &sluice,
        &format!("{path}:{line}:{col}: routes[0].limits[0].window"),
    );
}

/// (b) A valid change takes effect within one second: the limit goes from 3 to 6.
#[tokio::test]
async fn a_valid_change_takes_effect_within_a_second() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let c = client();
    assert_eq!(policy_q(&c, &sluice).await, 3);

    rewrite_in_place(&sluice, &limited(6, "1m"));
    let written = Instant::now();
    while policy_q(&c, &sluice).await != 6 {
        assert!(
            written.elapsed() < Duration::from_secs(1),
            "still q=3 after 1 s\nlog:\n{}",
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reloads(&sluice, "ok").await, 1.0);
    assert_eq!(reloads(&sluice, "error").await, 0.0);
    // And it is enforced at 6: a client not seen before gets six answers, then a 429.
    let fresh = support::client_from("127.0.0.2");
    for n in 1..=7 {
        let r = fresh
            .get(format!("{}/api", sluice.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), if n <= 6 { 200 } else { 429 }, "request {n}");
    }
}

/// (c) An editor's save: write a new file beside the old one and rename it over. A route
/// added this way answers within a second.
#[tokio::test]
async fn a_save_by_rename_is_seen() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let c = client();
    let new = || async {
        c.get(format!("{}/new", sluice.url()))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert_eq!(new().await, 404);

    let added =
        "  - name: new\n    match:\n      path_prefix: /new\n    respond:\n      status: 201\n";
    let text = format!("{}{}{added}", head(&sluice), limited(3, "1m"));
    let temporary = sluice.config_path().with_extension("yaml.new");
    std::fs::write(&temporary, &text).unwrap();
    let old_inode = inode(sluice.config_path());
    std::fs::rename(&temporary, sluice.config_path()).unwrap();
    assert_ne!(
        inode(sluice.config_path()),
        old_inode,
        "a new file took the path"
    );

    let renamed = Instant::now();
    while new().await != 201 {
        assert!(
            renamed.elapsed() < Duration::from_secs(1),
            "no /new after 1 s\nlog:\n{}",
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(policy_q(&c, &sluice).await, 3);
    assert_eq!(reloads(&sluice, "ok").await, 1.0);
}

fn inode(path: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}

/// (d) SIGHUP reloads the file even when it did not change; the process keeps serving.
#[tokio::test]
async fn sighup_reloads() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let hash = config_hash(&sluice).await;
    for n in 1..=2 {
        let status = Command::new("kill")
            .args(["-HUP", &sluice.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        wait_reloads(&sluice, "ok", f64::from(n)).await;
    }
    assert_eq!(reloads(&sluice, "error").await, 0.0);
    assert_eq!(config_hash(&sluice).await, hash, "the same file");
    assert_eq!(policy_q(&client(), &sluice).await, 3);
    assert!(sluice.log().contains("SIGHUP: reloading the config file"));
}

/// (e) A new `listen` address (or a `server:` setting) needs a restart: the file is refused
/// whole, with a message naming the field, and the old listener and limit keep serving.
#[tokio::test]
async fn changing_listen_is_refused_whole() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let head = head(&sluice);
    let new_port = free_port();
    let moved = head.replacen(
        &format!("listen: 127.0.0.1:{}", sluice.addr().port()),
        &format!("listen: 127.0.0.1:{new_port}"),
        1,
    );
    assert_ne!(moved, head, "test bug: listen line not found");
    // A route only this file has: refused whole, it must leave no metric series behind.
    let ghost =
        "  - name: ghost\n    match:\n      path_prefix: /ghost\n    respond:\n      status: 200\n";
    support::replace_file(
        sluice.config_path(),
        &format!("{moved}{}{ghost}", limited(6, "1m")),
    );
    wait_reloads(&sluice, "error", 1.0).await;

    error_line(
        &sluice,
        &format!(
            "{}: `listen` changed from {} to 127.0.0.1:{new_port}: a restart is needed to apply it; nothing of this file was applied",
            sluice.config_path().display(),
            sluice.addr()
        ),
    );
    assert_eq!(
        policy_q(&client(), &sluice).await,
        3,
        "the limit was not applied either"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", new_port)).is_err(),
        "nothing listens on the new address"
    );
    let metrics = sluice.metrics().await;
    assert!(
        !metrics.contains("ghost"),
        "no series of a route in a file refused for a restart:\n{metrics}"
    );

    let server = format!("{head}server:\n  idle_timeout: 5s\n{}", limited(6, "1m"));
    support::replace_file(sluice.config_path(), &server);
    wait_reloads(&sluice, "error", 2.0).await;
    error_line(
        &sluice,
        "`server.idle_timeout` changed: a restart is needed to apply it",
    );
    assert_eq!(policy_q(&client(), &sluice).await, 3);
    assert_eq!(reloads(&sluice, "ok").await, 0.0);
}

/// A test upstream that counts the TCP connections it accepts and answers every request 200.
struct CountingUpstream {
    port: u16,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingUpstream {
    async fn start() -> CountingUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = service_fn(|_req| async {
                        Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
                            b"up\n",
                        ))))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        CountingUpstream {
            port,
            accepted,
            task,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for CountingUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn forwarded(port: u16, connect_timeout: &str, requests: u32) -> String {
    format!(
        r#"upstreams:
  api:
    url: "http://127.0.0.1:{port}"
    connect_timeout: {connect_timeout}
    timeout: 10s
routes:
  - name: api
    match:
      path_prefix: /api
    upstream: api
    limits:
      - name: per-ip
        key: [client_ip]
        requests: {requests}
        window: 1m
"#
    )
}

/// Sends `n` requests one after another, each answered by the upstream.
async fn sequential(c: &reqwest::Client, sluice: &Sluice, n: usize) {
    for _ in 0..n {
        let r = c.get(format!("{}/api", sluice.url())).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "up\n");
        // Lets sluice's client put the connection back in its pool before the next request.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// (f) The upstream's keep-alive connection survives a reload that leaves the upstream
/// unchanged; a reload that changes it (its connect_timeout) starts a new pool, which shows
/// that the count would see a rebuilt pool.
#[tokio::test]
async fn the_upstream_pool_survives_a_reload() {
    let upstream = CountingUpstream::start().await;
    let sluice = Sluice::start(&forwarded(upstream.port, "2s", 100)).await;
    let c = client();
    sequential(&c, &sluice, 5).await;
    assert_eq!(
        upstream.accepted(),
        1,
        "one pooled connection carries them all"
    );

    rewrite(&sluice, &forwarded(upstream.port, "2s", 200));
    wait_reloads(&sluice, "ok", 1.0).await;
    sequential(&c, &sluice, 5).await;
    assert_eq!(
        upstream.accepted(),
        1,
        "the same connection after the reload"
    );
    assert_eq!(policy_q(&c, &sluice).await, 200);

    rewrite(&sluice, &forwarded(upstream.port, "3s", 200));
    wait_reloads(&sluice, "ok", 2.0).await;
    sequential(&c, &sluice, 5).await;
    assert_eq!(upstream.accepted(), 2, "a changed upstream gets a new pool");
}

/// (g) `sluice_config_hash` is the file's: it changes with a good reload, not a refused one.
#[tokio::test]
async fn the_hash_gauge_follows_the_file_in_force() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let first = std::fs::read_to_string(sluice.config_path()).unwrap();
    assert_eq!(config_hash(&sluice).await, expected_hash(&first));

    let second = rewrite(&sluice, &limited(6, "1m"));
    wait_reloads(&sluice, "ok", 1.0).await;
    assert_eq!(config_hash(&sluice).await, expected_hash(&second));
    assert_ne!(expected_hash(&second), expected_hash(&first));

    rewrite(&sluice, &limited(0, "1m"));
    wait_reloads(&sluice, "error", 1.0).await;
    assert_eq!(
        config_hash(&sluice).await,
        expected_hash(&second),
        "unchanged when refused"
    );
    error_line(&sluice, "routes[0].limits[0].requests");

    // Refused when the routes are checked against each other: the valid route before the bad
    // one leaves no metric series behind, as it never served.
    let ghost = "  - name: ghost\n    match:\n      path_prefix: /ghost\n    respond:\n      status: 200\n  - name: broken\n    match:\n      path_prefix: /broken\n    upstream: nowhere\n";
    rewrite(&sluice, &format!("{}{ghost}", limited(6, "1m")));
    wait_reloads(&sluice, "error", 2.0).await;
    error_line(&sluice, "routes[2].upstream: unknown upstream `nowhere`");
    assert_eq!(config_hash(&sluice).await, expected_hash(&second));
    let metrics = sluice.metrics().await;
    assert!(
        !metrics.contains("ghost"),
        "no series of a refused route:\n{metrics}"
    );
}

/// A request in flight during a reload finishes under the policy it started with: a slow
/// upstream answer started at q=3 still says q=3 after the file changed to q=6.
#[tokio::test]
async fn a_request_in_flight_keeps_its_policy() {
    let upstream = support::Upstream::start().await;
    let rest = |requests: u32| {
        format!(
            "upstreams:\n  api:\n    url: \"{}\"\n    timeout: 10s\nroutes:\n  - name: api\n    match:\n      path_prefix: /\n    upstream: api\n    limits:\n      - name: per-ip\n        key: [client_ip]\n        requests: {requests}\n        window: 1m\n",
            upstream.url()
        )
    };
    let sluice = Sluice::start(&rest(3)).await;
    let c = client();
    let slow = tokio::spawn({
        let (c, url) = (c.clone(), format!("{}/slow/2000", sluice.url()));
        async move { c.get(url).send().await.unwrap() }
    });
    // The slow request has reached the upstream, so it was routed under q=3.
    let deadline = Instant::now() + Duration::from_secs(10);
    while upstream.hits() == 0 {
        assert!(Instant::now() < deadline, "the slow request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rewrite(&sluice, &rest(6));
    wait_reloads(&sluice, "ok", 1.0).await;
    let fresh = c.get(format!("{}/x", sluice.url())).send().await.unwrap();
    assert_eq!(
        parse_limit_field(header(&fresh, "ratelimit-policy"))[0].param("q"),
        6
    );

    let slow = slow.await.unwrap();
    assert_eq!(slow.status(), 200);
    assert_eq!(
        parse_limit_field(header(&slow, "ratelimit-policy"))[0].param("q"),
        3
    );
}

/// The `q` of the `per-ip` item of a response's RateLimit-Policy; `None` when it has none
/// (the route is not limited).
fn q_of(r: &reqwest::Response) -> Option<i64> {
    let policy = r.headers().get("ratelimit-policy")?.to_str().ok()?;
    parse_limit_field(policy)
        .first()
        .map(|item| item.param("q"))
}

/// (Issue 27, hole 3.) A file written in two steps, with a pause shorter than
/// `reload.settle` between them: the first step alone is a valid policy (the route cut
/// before its limits, which `sluice check` accepts) that would serve the route unlimited.
/// It is never applied — every request during the pause still sees the old limit — and
/// it is counted and logged as skipped; the whole file is applied once it has settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_written_file_is_never_applied() {
    let settle = "reload: { settle: 3s }\n";
    let sluice = Sluice::start(&format!("{settle}{}", limited(1, "1d"))).await;
    let c = client();
    let full = format!("{}{settle}{}", head(&sluice), limited(3, "1d"));
    let (first, rest) = full.split_at(full.find("    limits:").expect("the limits"));
    let alone = support::write_config(first);
    let (status, stdout, stderr) = support::sluice_check(alone.path());
    assert!(
        status.success(),
        "the first part alone is a valid policy: {stdout}{stderr}"
    );

    std::fs::write(sluice.config_path(), first).expect("write the first part");
    let written = Instant::now();
    let mut probes = 0;
    while written.elapsed() < Duration::from_millis(1500) {
        let r = c
            .get(format!("{}/api", sluice.url()))
            .send()
            .await
            .expect("GET /api");
        assert_eq!(
            q_of(&r),
            Some(1),
            "{:?} after the first part was written, the route is not under its old limit \
             (the half-written file was applied)\nlog:\n{}",
            written.elapsed(),
            sluice.log()
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(probes >= 5, "only {probes} requests during the pause");
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(sluice.config_path())
        .expect("open the config to append");
    std::io::Write::write_all(&mut file, rest.as_bytes()).expect("write the rest");
    drop(file);
    support::wait_for(
        Duration::from_secs(15),
        "the whole file to serve",
        || async {
            let r = c.get(format!("{}/api", sluice.url())).send().await;
            r.is_ok_and(|r| q_of(&r) == Some(3))
        },
    )
    .await;
    assert_eq!(
        reloads(&sluice, "ok").await,
        1.0,
        "only the whole file was applied"
    );
    assert_eq!(reloads(&sluice, "error").await, 0.0);
    assert!(
        metric(&sluice, "sluice_config_versions_skipped_total", &[]).await >= 1.0,
        "the first part is counted as skipped"
    );
    assert_eq!(config_hash(&sluice).await, expected_hash(&full));
    let log = sluice.log();
    assert!(
        log.contains("the version read before was not applied"),
        "the skipped version is logged:\n{log}"
    );
}

/// A change a reload makes to one field of the file, and what it says: `Some(change)`, the
/// file is refused naming the field; `None`, it is applied.
struct FieldChange {
    field: &'static str,
    yaml: &'static str,
    refused: Option<&'static str>,
}

/// Every field of the file's top level and of its sections, in the schema the config types
/// generate: a field the types gain fails `every_field_reloads_or_is_refused_naming_it`
/// until it is listed here.
const FIELD_CHANGES: &[FieldChange] = &[
    FieldChange { field: "listen", yaml: "", refused: Some("`listen` changed from") },
    FieldChange { field: "admin_listen", yaml: "", refused: Some("`admin_listen` changed from") },
    FieldChange { field: "admin.token_env", yaml: "admin:\n  token_env: SLUICE_RELOAD_TOKEN\n", refused: Some("`admin.token_env` changed") },
    FieldChange { field: "admin.api", yaml: "admin:\n  api: false\n", refused: Some("`admin.api` changed") },
    FieldChange { field: "admin.hosts", yaml: "admin:\n  hosts: [sluice-admin.internal]\n", refused: Some("`admin.hosts` changed") },
    FieldChange { field: "tls.cert", yaml: "tls:\n  cert: c.pem\n  key: k.pem\n", refused: Some("`tls` changed") },
    FieldChange { field: "tls.key", yaml: "tls:\n  cert: c.pem\n  key: k.pem\n", refused: Some("`tls` changed") },
    FieldChange { field: "tls.client_ca", yaml: "tls:\n  cert: c.pem\n  key: k.pem\n  client_ca: ca.pem\n", refused: Some("`tls` changed") },
    FieldChange { field: "log_format", yaml: "log_format: json\n", refused: Some("`log_format` changed") },
    FieldChange { field: "server.max_request_line", yaml: "server:\n  max_request_line: 1000\n", refused: Some("`server.max_request_line` changed") },
    FieldChange { field: "server.max_header_bytes", yaml: "server:\n  max_header_bytes: 2000\n", refused: Some("`server.max_header_bytes` changed") },
    FieldChange { field: "server.max_headers", yaml: "server:\n  max_headers: 7\n", refused: Some("`server.max_headers` changed") },
    FieldChange { field: "server.max_body", yaml: "server:\n  max_body: 1000\n", refused: Some("`server.max_body` changed") },
    FieldChange { field: "server.max_connections", yaml: "server:\n  max_connections: 77\n", refused: Some("`server.max_connections` changed") },
    FieldChange { field: "server.header_read_timeout", yaml: "server:\n  header_read_timeout: 7s\n", refused: Some("`server.header_read_timeout` changed") },
    FieldChange { field: "server.idle_timeout", yaml: "server:\n  idle_timeout: 7s\n", refused: Some("`server.idle_timeout` changed") },
    FieldChange { field: "server.body_timeout", yaml: "server:\n  body_timeout: 7s\n", refused: Some("`server.body_timeout` changed") },
    FieldChange { field: "server.body_min_rate", yaml: "server:\n  body_min_rate: 7\n", refused: Some("`server.body_min_rate` changed") },
    FieldChange { field: "server.body_rate_grace", yaml: "server:\n  body_rate_grace: 7s\n", refused: Some("`server.body_rate_grace` changed") },
    FieldChange { field: "server.shutdown_delay", yaml: "server:\n  shutdown_delay: 1s\n", refused: Some("`server.shutdown_delay` changed") },
    FieldChange { field: "server.shutdown_grace", yaml: "server:\n  shutdown_grace: 7s\n", refused: Some("`server.shutdown_grace` changed") },
    FieldChange { field: "server.workers", yaml: "server:\n  workers: 3\n", refused: Some("`server.workers` changed") },
    FieldChange { field: "server.token_body_budget", yaml: "server:\n  token_body_budget: 100000\n", refused: Some("`server.token_body_budget` changed") },
    FieldChange { field: "server.token_bodies_per_connection", yaml: "server:\n  token_bodies_per_connection: 7\n", refused: Some("`server.token_bodies_per_connection` changed") },
    FieldChange { field: "store.redis", yaml: "store:\n  redis:\n    url: redis://127.0.0.1:1\n", refused: Some("`store.redis` changed") },
    FieldChange { field: "store.local", yaml: "store:\n  local:\n    max_keys: 5000\n", refused: Some("`store.local` changed") },
    FieldChange { field: "store.key_prefix", yaml: "store:\n  key_prefix: other\n", refused: Some("`store.key_prefix` changed") },
    FieldChange { field: "store.on_store_error", yaml: "store:\n  on_store_error: deny\n", refused: None },
    FieldChange { field: "rls.listen", yaml: "rls:\n  listen: 127.0.0.1:1\n  config: []\n", refused: Some("`rls` changed") },
    FieldChange { field: "rls.tls", yaml: "rls:\n  listen: 127.0.0.1:1\n  tls: { cert: c.pem, key: k.pem }\n  config: []\n", refused: Some("`rls` changed") },
    // Reloaded when the service runs; here, the first `rls:` section, which is refused.
    FieldChange { field: "rls.config", yaml: "rls:\n  listen: 127.0.0.1:1\n  config: []\n", refused: Some("`rls` changed") },
    FieldChange { field: "rls.shadow_mode", yaml: "rls:\n  listen: 127.0.0.1:1\n  config: []\n  shadow_mode: true\n", refused: Some("`rls` changed") },
    FieldChange { field: "rls.algorithm", yaml: "rls:\n  listen: 127.0.0.1:1\n  config: []\n  algorithm: gcra\n", refused: Some("`rls` changed") },
    FieldChange { field: "rls.on_store_error", yaml: "rls:\n  listen: 127.0.0.1:1\n  config: []\n  on_store_error: deny\n", refused: Some("`rls` changed") },
    FieldChange { field: "webhook.url", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.secret_env", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.secret_file", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_file: hs.key\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.timeout", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n  timeout: 1s\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.retries", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n  retries: 1\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.backoff", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n  backoff: 2s\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.ca_file", yaml: "webhook:\n  url: https://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n  ca_file: hooks-ca.pem\n", refused: Some("`webhook` changed") },
    FieldChange { field: "webhook.queue", yaml: "webhook:\n  url: http://127.0.0.1:9/hook\n  secret_env: SLUICE_RELOAD_WEBHOOK\n  queue: 10\n", refused: Some("`webhook` changed") },
    FieldChange { field: "trusted_proxies", yaml: "trusted_proxies: [10.0.0.0/8]\n", refused: None },
    FieldChange { field: "forwarded_header", yaml: "forwarded_header: forwarded\n", refused: None },
    FieldChange { field: "response_headers", yaml: "response_headers: legacy\n", refused: None },
    FieldChange { field: "should_retry_within", yaml: "should_retry_within: 30s\n", refused: None },
    FieldChange { field: "reload.settle", yaml: "reload:\n  settle: 300ms\n", refused: None },
    FieldChange { field: "upstreams", yaml: "upstreams:\n  other: { url: \"http://127.0.0.1:9\" }\n", refused: None },
    FieldChange { field: "jwt", yaml: "jwt:\n  - name: hs\n    issuer: me\n    audiences: [api]\n    keys:\n      - { secret_file: hs.key, algorithm: HS256 }\n", refused: None },
    FieldChange { field: "models", yaml: "models:\n  - match: \"gpt-*\"\n    context: 8000\n", refused: None },
    FieldChange { field: "routes", yaml: "", refused: None },
];

/// The fields of the file as the config types' JSON Schema lists them: each top-level
/// property, and each property of a section that is an object of named fields.
fn schema_fields() -> Vec<String> {
    let schema: serde_json::Value =
        serde_json::from_str(&sluice::config::json_schema()).expect("JSON");
    let definition = |property: &serde_json::Value| {
        let reference = property["$ref"]
            .as_str()
            .or_else(|| property["allOf"][0]["$ref"].as_str())
            .or_else(|| property["anyOf"][0]["$ref"].as_str())?;
        let name = reference.strip_prefix("#/definitions/")?;
        schema["definitions"][name]["properties"].as_object()
    };
    let mut fields = Vec::new();
    for (name, property) in schema["properties"].as_object().expect("properties") {
        match definition(property) {
            Some(section) => fields.extend(section.keys().map(|field| format!("{name}.{field}"))),
            None => fields.push(name.clone()),
        }
    }
    fields
}

/// Each field of the file either reloads or, when only a restart can apply it
/// (`Config::restart_change`), is refused naming it: a 422 from the admin API, the error
/// line in the log, the old policy still serving. Walks every field the config types have.
#[tokio::test]
async fn every_field_reloads_or_is_refused_naming_it() {
    let listed: Vec<&str> = FIELD_CHANGES.iter().map(|change| change.field).collect();
    let schema = schema_fields();
    for field in &schema {
        assert!(
            listed.contains(&field.as_str()),
            "`{field}` is in the config types but not in FIELD_CHANGES: say whether a reload \
             applies it (and put it on that side in `Config::restart_change`)"
        );
    }
    for field in &listed {
        assert!(
            schema.iter().any(|f| f == field),
            "`{field}` is no field of the file"
        );
    }

    // The file poll waits a minute for a change to settle: every reload here is the admin
    // API's, and each is counted exactly.
    let settle = "reload:\n  settle: 1m\n";
    let sluice = Sluice::start(&format!("{settle}{}", limited(3, "1m"))).await;
    let dir = sluice.config_path().parent().expect("a folder");
    std::fs::write(dir.join("hs.key"), "0123456789abcdef0123456789abcdef\n").unwrap();
    let start = std::fs::read_to_string(sluice.config_path()).unwrap();
    let head = head(&sluice);
    let c = client();
    let (mut refused, mut applied) = (0.0, 0.0);
    let mut said_before = std::collections::HashMap::new();
    for change in FIELD_CHANGES {
        let text = match change.field {
            "listen" => start.replacen(
                &format!("listen: 127.0.0.1:{}", sluice.addr().port()),
                &format!("listen: 127.0.0.1:{}", free_port()),
                1,
            ),
            "admin_listen" => {
                start.replacen("admin_listen: 127.0.0.1:", "admin_listen: 127.0.0.2:", 1)
            }
            "routes" => format!("{head}{settle}{}", limited(6, "1m")),
            "reload.settle" => format!("{head}{}{}", change.yaml, limited(3, "1m")),
            _ => format!("{head}{settle}{}{}", change.yaml, limited(3, "1m")),
        };
        assert_ne!(text, start, "test bug: {} unchanged", change.field);
        support::replace_file(sluice.config_path(), &text);
        let answer = admin_reload(&c, &sluice).await;
        let status = answer.status().as_u16();
        let body: serde_json::Value = answer.json().await.unwrap();
        match change.refused {
            Some(message) => {
                refused += 1.0;
                assert_eq!(status, 422, "{}: {body}", change.field);
                let said = body["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    said.starts_with(message)
                        && said.ends_with(": a restart is needed to apply it"),
                    "{}: {body}",
                    change.field
                );
                wait_reloads(&sluice, "error", refused).await;
                *said_before.entry(message).or_insert(0) += 1;
                // The counter moves before the log line is written out: wait a little for it.
                let count = || {
                    sluice
                        .log()
                        .lines()
                        .filter(|line| {
                            line.contains("config reload refused") && line.contains(message)
                        })
                        .count()
                };
                let waited = Instant::now();
                let mut logged = count();
                while logged < said_before[message] && waited.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    logged = count();
                }
                assert_eq!(
                    logged, said_before[message],
                    "{}: logged once",
                    change.field
                );
                error_line(&sluice, message);
                assert_eq!(
                    policy_q(&c, &sluice).await,
                    3,
                    "{}: the old policy serves",
                    change.field
                );
            }
            None => {
                applied += 1.0;
                assert_eq!(status, 200, "{}: {body}", change.field);
                wait_reloads(&sluice, "ok", applied).await;
            }
        }
        // Back to the file the process started with, for the next change.
        support::replace_file(sluice.config_path(), &start);
        let back = admin_reload(&c, &sluice).await;
        assert_eq!(back.status(), 200, "{}: back to the start", change.field);
        applied += 1.0;
    }
}

/// A reload through the admin API of a file with two mistakes is refused naming both (the
/// same reading as `sluice check`): the answer's `error.errors` lists each with its line and
/// field, `error.message` all of them and their count; the old policy keeps serving.
#[tokio::test]
async fn a_refused_reload_names_every_mistake() {
    let sluice = Sluice::start(&limited(3, "1m")).await;
    let c = client();
    let written = rewrite(&sluice, &limited(0, "thirty"));
    let answer = admin_reload(&c, &sluice).await;
    assert_eq!(answer.status().as_u16(), 422);
    let body: serde_json::Value = answer.json().await.unwrap();
    let errors = body["error"]["errors"]
        .as_array()
        .expect("a list of mistakes");
    let fields: Vec<(&str, u64)> = errors
        .iter()
        .map(|e| (e["field"].as_str().unwrap(), e["line"].as_u64().unwrap()))
        .collect();
    let line = |token: &str| locate(&written, token).0 as u64;
    assert_eq!(
        fields,
        [
            ("routes[0].limits[0].requests", line("requests: 0")),
            ("routes[0].limits[0].window", line("thirty")),
        ],
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.ends_with("2 errors"), "{message}");
    assert_eq!(policy_q(&c, &sluice).await, 3, "the old policy serves");
}
