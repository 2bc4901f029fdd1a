//! Structured logs and request ids: JSON lines when asked, rejections that name the identity
//! only by a hash, and an `x-request-id` kept or made, passed to the upstream and returned to
//! the client. And logging that cannot block or flood: a standard error nobody reads never
//! slows a request or stops a shutdown (the dropped lines are counted), and a flood of
//! rejections writes a first line per identity and then exact counts, once per report
//! interval (10 s).

use crate::support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use support::{metric_sum, parse_metrics, Limit, Policy, Route, Sluice, Upstream};

/// sluice's report interval (`sluice::log::REPORT_INTERVAL`), plus room for a loaded machine.
const REPORT_WAIT: Duration = Duration::from_secs(25);

/// One route that answers 200 itself, `requests` an hour per `x-api-key`.
fn per_key_per_hour(requests: u32) -> Policy {
    Policy::new().route(
        Route::new("api", "/")
            .respond_status(200)
            .limit(Limit::requests("per-key", requests, "1h").key(["header:x-api-key"])),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_request_ids_and_rejections_without_identities() {
    let upstream = Upstream::start().await;
    let policy = Policy::new()
        .set("log_format", "json")
        .upstream("api", upstream.url())
        .route(
            Route::new("api", "/")
                .upstream("api")
                .limit(Limit::requests("per-key", 1, "1m").key(["header:x-api-key"])),
        );
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    const SECRET: &str = "sk-live-very-secret-0001";
    let send = |id: Option<&str>| {
        let mut request = client
            .get(format!("{}/x", sluice.url()))
            .header("x-api-key", SECRET);
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send()
    };

    // A client-given id is kept: the upstream gets it, and the client gets it back.
    let first = send(Some("req-0001")).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(support::header(&first, "x-request-id"), "req-0001");
    let echoed: serde_json::Value = first.json().await.unwrap();
    assert_eq!(echoed["headers"]["x-request-id"][0], "req-0001");

    // Without one, sluice makes one; a rejection carries it too.
    let rejected = send(None).await.unwrap();
    assert_eq!(rejected.status(), 429);
    let made = support::header(&rejected, "x-request-id").to_owned();
    assert_eq!(made.len(), 32, "{made}");
    assert!(made.bytes().all(|b| b.is_ascii_hexdigit()));

    // The log: JSON lines, one of them for the rejection, naming route, limit, the
    // identity's hash, the wait and the request id, and never the API key.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let line = loop {
        let log = sluice.log();
        if let Some(line) = log.lines().find(|l| l.contains("sluice::rejected")) {
            break line.to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no rejection line:\n{log}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let event: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    let fields = &event["fields"];
    assert_eq!(fields["route"], "api", "{line}");
    assert_eq!(fields["limit"], "per-key", "{line}");
    assert_eq!(fields["retry_after"], 60, "{line}");
    assert_eq!(fields["request_id"], made.as_str(), "{line}");
    let identity = fields["identity"].as_str().expect("an identity hash");
    assert_eq!(identity.len(), 16);

    // The same identity's next rejections are not logged one by one: one JSON line at the
    // end of the interval states how many, as a number.
    for _ in 0..40 {
        assert_eq!(send(None).await.unwrap().status(), 429);
    }
    let mut summary = serde_json::Value::Null;
    support::wait_for(REPORT_WAIT, "the summary line", || {
        let found = sluice
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|event| event["fields"]["message"] == "rejected again");
        let ready = found.is_some();
        if let Some(event) = found {
            summary = event;
        }
        async move { ready }
    })
    .await;
    let fields = &summary["fields"];
    assert_eq!(summary["target"], "sluice::rejected", "{summary}");
    assert_eq!(fields["count"], serde_json::json!(40), "{summary}");
    assert!(fields["count"].is_u64(), "{summary}");
    assert_eq!(fields["identity"], identity, "{summary}");
    assert_eq!(fields["route"], "api", "{summary}");
    assert_eq!(fields["limit"], "per-key", "{summary}");
    let log = sluice.log();
    assert_eq!(
        log.matches("\"message\":\"rejected\"").count(),
        1,
        "one line for the first rejection only:\n{log}"
    );
    assert!(!log.contains(SECRET), "the API key reached the log");
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not a JSON line: {line}"
        );
    }
}

/// `total` requests, `in_flight` at a time, each built by `request(i)` and bounded by a
/// 10 s timeout; the number of answers with each status. The first request with no answer
/// fails the test at once.
async fn flood(
    total: usize,
    in_flight: usize,
    request: impl Fn(usize) -> reqwest::RequestBuilder,
) -> BTreeMap<u16, usize> {
    let mut answers = futures_util::stream::iter(0..total)
        .map(|i| request(i).timeout(Duration::from_secs(10)).send())
        .buffer_unordered(in_flight);
    let mut statuses = BTreeMap::new();
    while let Some(answer) = answers.next().await {
        match answer {
            Ok(response) => *statuses.entry(response.status().as_u16()).or_insert(0) += 1,
            Err(err) => panic!("a request of the flood got no answer: {err}"),
        }
    }
    statuses
}

/// `total` raw HTTP/1.1 requests, the `i`th written by `request(i)`, pipelined 100 at a time on
/// 8 kept-alive connections (far less client work per request than a full HTTP client, so
/// that 100 000 requests take seconds, not minutes, on a loaded machine); the number of
/// answers with each status. Every request must be answered within 10 s.
async fn pipelined_flood(
    addr: std::net::SocketAddr,
    total: usize,
    request: impl Fn(usize) -> String,
) -> BTreeMap<u16, usize> {
    const CONNECTIONS: usize = 8;
    const DEPTH: usize = 100;
    let mut tasks = Vec::new();
    for connection in 0..CONNECTIONS {
        // Connection c sends requests c, c + 8, c + 16, ... in batches of DEPTH.
        let batches: Vec<(Vec<u8>, usize)> = (connection..total)
            .step_by(CONNECTIONS)
            .collect::<Vec<_>>()
            .chunks(DEPTH)
            .map(|chunk| {
                let bytes: String = chunk.iter().map(|&i| request(i)).collect();
                (bytes.into_bytes(), chunk.len())
            })
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut wire = support::wire::Wire::connect(addr).await;
            let mut statuses = BTreeMap::new();
            for (bytes, depth) in batches {
                wire.send(&bytes).await.expect("send a batch");
                for _ in 0..depth {
                    let response = wire.response(Duration::from_secs(10)).await;
                    *statuses.entry(response.status).or_insert(0) += 1;
                }
            }
            statuses
        }));
    }
    let mut statuses = BTreeMap::new();
    for task in tasks {
        for (status, count) in task.await.expect("a flood connection") {
            *statuses.entry(status).or_insert(0) += count;
        }
    }
    statuses
}

/// A keep-alive client with room for every connection of a flood.
fn flood_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(256)
        .build()
        .expect("client")
}

/// The number after `name=` in a text log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// `sluice_limit_decisions_total{decision="rejected"}`, exact.
async fn rejected(sluice_metrics: &str) -> u64 {
    let all = parse_metrics(sluice_metrics);
    metric_sum(
        &all,
        "sluice_limit_decisions_total",
        &[("decision", "rejected")],
    ) as u64
}

/// How the log accounts for the rejections so far: lines for a first rejection, the counts
/// of the "rejected again" lines, and the identities and requests of the "… and N more"
/// lines.
#[derive(Debug, Default)]
struct Accounted {
    first_lines: u64,
    repeats: u64,
    more_identities: u64,
    more_requests: u64,
    rejection_lines: u64,
}

impl Accounted {
    fn of(log: &str) -> Accounted {
        let mut accounted = Accounted::default();
        for line in log.lines().filter(|l| l.contains("sluice::rejected")) {
            accounted.rejection_lines += 1;
            if line.contains("sluice::rejected: rejected again") {
                accounted.repeats += field(line, "count").expect("a count");
            } else if line.contains("sluice::rejected: rejected ") {
                accounted.first_lines += 1;
            } else if line.contains("more identities rejected") {
                accounted.more_identities += field(line, "identities").expect("identities");
                accounted.more_requests += field(line, "requests").expect("requests");
            } else {
                panic!("an unexpected rejection line: {line}");
            }
        }
        accounted
    }

    fn requests(&self) -> u64 {
        self.first_lines + self.repeats + self.more_requests
    }
}

/// (b) 100 000 rejections of one key: a first line, then "rejected again" lines whose counts
/// add up to exactly what the metrics counted, in well under 64 KiB of log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_one_key_writes_a_few_lines_with_the_exact_count() {
    let _heavy = support::heavy().await;
    const FLOOD: usize = 100_000;
    let sluice = Sluice::start(&per_key_per_hour(10)).await;
    let started = Instant::now();
    let statuses = pipelined_flood(sluice.addr(), FLOOD, |_| {
        "GET /x HTTP/1.1\r\nhost: sluice\r\nx-api-key: k1\r\n\r\n".to_owned()
    })
    .await;
    let took = started.elapsed();
    assert_eq!(statuses.get(&200), Some(&10), "{statuses:?}");
    assert_eq!(statuses.get(&429), Some(&(FLOOD - 10)), "{statuses:?}");
    let counted = rejected(&sluice.metrics().await).await;
    assert_eq!(counted, (FLOOD - 10) as u64);

    support::wait_for(
        REPORT_WAIT,
        "the log to account for every rejection",
        || {
            let accounted = Accounted::of(&sluice.log());
            async move { accounted.requests() >= counted }
        },
    )
    .await;
    let log = sluice.log();
    let accounted = Accounted::of(&log);
    assert_eq!(accounted.first_lines, 1, "{log}");
    assert_eq!(accounted.requests(), counted, "{accounted:?}\n{log}");
    assert_eq!(accounted.more_requests, 0, "{log}");
    assert!(
        log.len() < 64 * 1024,
        "{} bytes of log for {FLOOD} rejections (flood took {took:?})",
        log.len()
    );
    eprintln!(
        "{FLOOD} requests in {took:?}: {} bytes of log, {} rejection lines",
        log.len(),
        accounted.rejection_lines
    );
}

/// 10 000 identities rejected once each: at most MAX_FOLLOWED first lines per report
/// interval, the rest in "… and N more identities rejected (M requests)" lines, and the
/// identities and requests add up exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_identities_write_bounded_output() {
    let _heavy = support::heavy().await;
    const IDENTITIES: usize = 10_000;
    let sluice = Sluice::start(&per_key_per_hour(1)).await;
    let started = Instant::now();
    // Each identity twice: admitted, then rejected.
    let statuses = pipelined_flood(sluice.addr(), 2 * IDENTITIES, |i| {
        format!(
            "GET /x HTTP/1.1\r\nhost: sluice\r\nx-api-key: key-{}\r\n\r\n",
            i % IDENTITIES
        )
    })
    .await;
    let took = started.elapsed();
    assert_eq!(statuses.get(&429), Some(&IDENTITIES), "{statuses:?}");
    let counted = rejected(&sluice.metrics().await).await;
    assert_eq!(counted, IDENTITIES as u64);

    support::wait_for(
        REPORT_WAIT,
        "the log to account for every rejection",
        || {
            let accounted = Accounted::of(&sluice.log());
            async move { accounted.requests() >= counted }
        },
    )
    .await;
    let log = sluice.log();
    let accounted = Accounted::of(&log);
    assert_eq!(accounted.requests(), counted, "{accounted:?}");
    assert_eq!(accounted.repeats, 0, "each identity was rejected once");
    assert_eq!(
        accounted.first_lines + accounted.more_identities,
        IDENTITIES as u64,
        "{accounted:?}"
    );
    // 100 identities named per interval; the flood spans a few intervals at most.
    let intervals = took.as_secs() / 10 + 2;
    assert!(
        accounted.first_lines <= 100 * intervals,
        "{accounted:?} in {took:?}"
    );
    assert!(accounted.more_identities > 0, "no \"… and N more\" line");
    assert!(
        accounted.rejection_lines <= 101 * intervals + 1,
        "{accounted:?} in {took:?}"
    );
    assert!(
        log.len() < 128 * 1024,
        "{} bytes of log for {IDENTITIES} identities",
        log.len()
    );
}

/// During an upstream outage "upstream failed" is written at 10 lines a second (20 at once),
/// and the rest is counted in one line per interval: lines + suppressed = the errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_logged_by_rate_not_by_traffic() {
    let _heavy = support::heavy().await;
    const REQUESTS: usize = 2_000;
    let policy = Policy::new()
        .upstream(
            "down",
            format!("http://127.0.0.1:{}", support::closed_port()),
        )
        .route(Route::new("api", "/").upstream("down"));
    let sluice = Sluice::start(&policy).await;
    let client = flood_client();
    let url = format!("{}/x", sluice.url());
    let started = Instant::now();
    let statuses = flood(REQUESTS, 32, |_| client.get(&url)).await;
    let took = started.elapsed();
    assert_eq!(statuses.get(&502), Some(&REQUESTS), "{statuses:?}");
    let failures = |log: &str| {
        let lines = log.matches("sluice::proxy: upstream failed").count() as u64;
        let suppressed: u64 = log
            .lines()
            .filter(|l| l.contains("lines suppressed"))
            .filter_map(|l| field(l, "suppressed"))
            .sum();
        (lines, suppressed)
    };
    support::wait_for(REPORT_WAIT, "the count of suppressed lines", || {
        let (lines, suppressed) = failures(&sluice.log());
        async move { lines + suppressed >= REQUESTS as u64 }
    })
    .await;
    let (lines, suppressed) = failures(&sluice.log());
    assert_eq!(lines + suppressed, REQUESTS as u64);
    let allowed = 20 + 10 * (took.as_secs() + 1);
    assert!(
        lines <= allowed,
        "{lines} \"upstream failed\" lines in {took:?}"
    );
}

/// A sluice whose standard error is a pipe that nobody reads (the read end is kept open, so
/// writes block once the pipe is full, as with a stalled log shipper).
struct StalledSluice {
    child: Child,
    _stderr: ChildStderr,
    port: u16,
    admin_port: u16,
    _dir: tempfile::TempDir,
}

impl StalledSluice {
    /// Starts sluice with the access log on (so that every request writes a line, up to its
    /// budget of 1000 a second) and a queue of 256 lines, so the pipe and the queue fill
    /// within a test's flood.
    async fn start(yaml_rest: &str) -> StalledSluice {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = support::free_port();
        let admin_port = support::free_port();
        let config =
            format!("listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\n{yaml_rest}");
        let path = dir.path().join("sluice.yaml");
        let mut file = std::fs::File::create(&path).expect("config file");
        file.write_all(config.as_bytes()).expect("write config");
        let mut child = Command::new(support::SLUICE_BIN)
            .args(["run", "--config"])
            .arg(&path)
            .env("RUST_LOG", "info,sluice::access=debug")
            .env("SLUICE_LOG_QUEUE_LINES", "256")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sluice");
        let stderr = child.stderr.take().expect("the stderr pipe");
        let sluice = StalledSluice {
            child,
            _stderr: stderr,
            port,
            admin_port,
            _dir: dir,
        };
        let client = support::client();
        let health = format!("http://127.0.0.1:{admin_port}/healthz");
        support::wait_for(Duration::from_secs(15), "sluice's /healthz", || {
            let answer = client.get(&health).timeout(Duration::from_secs(2)).send();
            async move { answer.await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
        sluice
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn lines_dropped(&self) -> f64 {
        let text = support::client()
            .get(format!("http://127.0.0.1:{}/metrics", self.admin_port))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics body");
        let all = parse_metrics(&text);
        assert!(
            !support::samples(&all, "sluice_log_lines_dropped_total", &[]).is_empty(),
            "no sluice_log_lines_dropped_total in /metrics"
        );
        metric_sum(&all, "sluice_log_lines_dropped_total", &[])
    }
}

impl Drop for StalledSluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/flood`: one request an hour per `x-api-key`; everything else answered at once.
fn stalled_policy() -> String {
    Policy::new()
        .server("shutdown_grace", "3s")
        .route(
            Route::new("flood", "/flood")
                .respond_status(200)
                .limit(Limit::requests("per-key", 1, "1h").key(["header:x-api-key"])),
        )
        .route(Route::new("normal", "/").respond(200, "ok"))
        .to_yaml()
}

/// (a) 20 000 rejections with standard error stalled: lines are dropped and counted, and a
/// request on another route is still answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stderr_never_slows_a_request() {
    let _heavy = support::heavy().await;
    let sluice = StalledSluice::start(&stalled_policy()).await;
    let client = flood_client();
    let flood_url = format!("{}/flood", sluice.url());
    let statuses = flood(20_001, 50, |_| {
        client.get(&flood_url).header("x-api-key", "k")
    })
    .await;
    assert_eq!(statuses.get(&429), Some(&20_000), "{statuses:?}");
    let dropped = sluice.lines_dropped().await;
    assert!(dropped > 0.0, "no log line was dropped: {dropped}");

    let normal = format!("{}/normal", sluice.url());
    for i in 0..20 {
        let sent = Instant::now();
        let answer = client
            .get(&normal)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .unwrap_or_else(|err| panic!("normal request {i}: {err}"));
        let took = sent.elapsed();
        assert_eq!(answer.status(), 200);
        assert!(
            took < Duration::from_millis(100),
            "normal request {i} took {took:?} with standard error stalled"
        );
    }
    // Still dropping: the writer is stuck on the full pipe, the requests are not.
    assert!(sluice.lines_dropped().await >= dropped);
}

/// (d) SIGTERM stops a sluice whose standard error is stalled, within `shutdown_grace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_sluice_whose_stderr_is_stalled() {
    let _heavy = support::heavy().await;
    let mut sluice = StalledSluice::start(&stalled_policy()).await;
    let client = flood_client();
    let flood_url = format!("{}/flood", sluice.url());
    flood(3_000, 50, |_| {
        client.get(&flood_url).header("x-api-key", "k")
    })
    .await;
    // Lines dropped: the pipe and the queue are full, the writer thread is stuck in a write.
    assert!(sluice.lines_dropped().await > 0.0);

    let signalled = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &sluice.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let grace = Duration::from_secs(3);
    let exited = loop {
        if let Some(status) = sluice.child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if signalled.elapsed() > grace {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let status = exited.unwrap_or_else(|| panic!("sluice still runs {grace:?} after SIGTERM"));
    assert!(status.success(), "exit status {status}");
}
