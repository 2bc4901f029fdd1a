//! A real scrape: a real Prometheus server (Debian's `prometheus` package) scrapes a running
//! sluice's admin listener every second and evaluates `deploy/prometheus/alerts.yml`; the test
//! sends admitted, rejected and failing requests through sluice (Redis store) and reads the
//! results back through Prometheus's HTTP API. Then every query of
//! `deploy/grafana/sluice-dashboard.json` and every rule of `alerts.yml`, read from the repo's
//! files, must run against that Prometheus and return series, and every rule must evaluate
//! without error.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use support::{
    client, closed_port, free_port, wait_for, Limit, Policy, Redis, Route, Sluice, Upstream,
    UpstreamSpec,
};

/// Requests a client may make on the limited route per window.
const ALLOWED: usize = 5;
/// Requests sent to the limited route: `ALLOWED` admitted, the rest answered 429.
const SENT: usize = 12;
/// Requests sent to the route whose upstream refuses connections.
const DEAD: usize = 3;
/// Longest wait for Prometheus to start, scrape, or evaluate its rules.
const WAIT: Duration = Duration::from_secs(40);

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Where the `prometheus` binary is: `$PROMETHEUS`, or on `PATH`.
fn prometheus_path() -> PathBuf {
    if let Some(path) = std::env::var_os("PROMETHEUS") {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("prometheus"))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "prometheus not found on PATH: install Debian's `prometheus` package \
             (apt-get install prometheus; scripts/test.sh does it) or set PROMETHEUS=/path/to/it"
        )
    })
}

/// A Prometheus server child process with its storage in a temporary directory.
struct Prometheus {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (host:port of a `/metrics`) every second, with the
    /// repo's alert rules evaluated every second, and waits until it is ready.
    async fn start(target: &str) -> Prometheus {
        let binary = prometheus_path();
        for attempt in 1..=3 {
            let dir = tempfile::tempdir().expect("tempdir for prometheus");
            let rules = repo_file("deploy/prometheus/alerts.yml");
            let config = format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: sluice\n    static_configs:\n      - targets: [\"{target}\"]\n",
                rules = rules.display()
            );
            let config_path = dir.path().join("prometheus.yml");
            std::fs::write(&config_path, config).expect("write prometheus.yml");
            let port = free_port();
            let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
            let child = Command::new(&binary)
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log file"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("failed to start {}: {e}", binary.display()));
            let mut prometheus = Prometheus { child, port, dir };
            match prometheus.wait_ready().await {
                Ok(()) => return prometheus,
                Err(log) if attempt < 3 && log.contains("address already in use") => continue,
                Err(log) => panic!("prometheus did not become ready:\n{log}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + WAIT;
        let c = client();
        loop {
            let ready = c
                .get(format!("{}/-/ready", self.url()))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if matches!(ready, Ok(r) if r.status() == 200) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait().expect("try_wait prometheus") {
                return Err(format!("exited with {status}\n{}", self.log()));
            }
            if Instant::now() > deadline {
                return Err(format!("not ready within {WAIT:?}\n{}", self.log()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/{path}` with `query` parameters: the `data` of a successful answer, or the
    /// error Prometheus gave.
    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, String> {
        let response = client()
            .get(format!("{}/api/v1/{path}", self.url()))
            .query(query)
            .send()
            .await
            .map_err(|e| format!("GET /api/v1/{path}: {e}"))?;
        let body: Value = response
            .json()
            .await
            .map_err(|e| format!("GET /api/v1/{path}: not JSON: {e}"))?;
        if body["status"] == "success" {
            Ok(body["data"].clone())
        } else {
            Err(format!("{}: {}", body["errorType"], body["error"]))
        }
    }

    /// The instant vector `expr` evaluates to now.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self.api("query", &[("query", expr)]).await?;
        match data["result"].as_array() {
            Some(series) if data["resultType"] == "vector" => Ok(series.clone()),
            _ => Err(format!("`{expr}` is not an instant vector: {data}")),
        }
    }

    /// The value of the one series `expr` returns, or `None` if it returns no series.
    async fn value(&self, expr: &str) -> Option<f64> {
        let series = self
            .query(expr)
            .await
            .unwrap_or_else(|e| panic!("query `{expr}`: {e}"));
        assert!(series.len() <= 1, "`{expr}` returned {series:?}");
        let value = series.first()?["value"][1].as_str()?.to_owned();
        Some(value.parse().expect("a sample value"))
    }

    /// Waits until `expr` returns exactly `expected`.
    async fn wait_value(&self, expr: &str, expected: f64) {
        let deadline = Instant::now() + WAIT;
        loop {
            let value = self.value(expr).await;
            if value == Some(expected) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "`{expr}` is {value:?}, not {expected}, after {WAIT:?}\nprometheus log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Deserialize)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
struct Rule {
    alert: Option<String>,
    record: Option<String>,
    expr: String,
}

impl Rule {
    fn name(&self) -> &str {
        self.alert
            .as_deref()
            .or(self.record.as_deref())
            .unwrap_or("?")
    }
}

fn alert_rules() -> RuleFile {
    let path = repo_file("deploy/prometheus/alerts.yml");
    let text = std::fs::read_to_string(&path).expect("read alerts.yml");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `expr` of the dashboard's panels (rows' nested panels included), with Grafana's
/// variables replaced by what they would be in Grafana: every job, a one-minute rate window.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = repo_file("deploy/grafana/sluice-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("read sluice-dashboard.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .collect();
    while let Some(panel) = panels.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            panels.extend(nested);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target's expr");
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$__interval", "1m")
                .replace("$job", ".*");
            assert!(
                !expr.contains('$'),
                "a variable this test does not know in `{expr}`"
            );
            let title = panel["title"].as_str().unwrap_or("?").to_owned();
            queries.push((title, expr));
        }
    }
    queries
}

/// The expression with `bool` after each comparison outside label matchers and strings, so
/// a condition like `ratio > 0.1` returns its series (as 0 or 1) instead of filtering them
/// out: what it returns then shows that every series the condition compares exists.
fn without_filtering(expr: &str) -> String {
    let mut out = String::with_capacity(expr.len() + 32);
    let chars: Vec<char> = expr.chars().collect();
    let (mut braces, mut quote) = (0usize, None::<char>);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        out.push(c);
        i += 1;
        if let Some(q) = quote {
            if c == '\\' && i < chars.len() {
                out.push(chars[i]);
                i += 1;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' | '`' => quote = Some(c),
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            '>' | '<' | '=' | '!' if braces == 0 => {
                let next = chars.get(i).copied();
                let comparison = match c {
                    '=' | '!' => next == Some('='),
                    _ => true,
                };
                if !comparison {
                    continue;
                }
                if next == Some('=') {
                    out.push('=');
                    i += 1;
                }
                out.push_str(" bool");
            }
            _ => {}
        }
    }
    out
}

#[test]
fn comparisons_become_bool_outside_matchers() {
    assert_eq!(
        without_filtering(r#"max(x{a!="b", c=~"d"}) == 1 and y >= 2 * z"#),
        r#"max(x{a!="b", c=~"d"}) == bool 1 and y >= bool 2 * z"#
    );
    assert_eq!(without_filtering("a > 0.1"), "a > bool 0.1");
    assert_eq!(
        without_filtering(r#"a{b="x>y"} < 3"#),
        r#"a{b="x>y"} < bool 3"#
    );
}

fn sluice_config(redis: &Redis, up: &str, dead_port: u16) -> Policy {
    Policy::new()
        .store_redis(redis)
        .upstream("api", up)
        .upstream(
            "dead",
            UpstreamSpec::new(&format!("http://127.0.0.1:{dead_port}"))
                .connect_timeout("1s")
                .timeout("2s"),
        )
        .route(Route::new("status", "/status").respond(200, "ok\n"))
        .route(Route::new("dead", "/dead").upstream("dead"))
        .route(
            Route::new("limited", "/limited")
                .upstream("api")
                .limit(Limit::requests("per-ip", ALLOWED as u32, "1h")),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_sluice_and_the_dashboard_and_alerts_query_real_series() {
    let redis = Redis::start().await;
    let upstream = Upstream::start().await;
    let sluice = Sluice::start(&sluice_config(&redis, &upstream.url(), closed_port())).await;
    let target = sluice.admin_url().trim_start_matches("http://").to_owned();
    let prometheus = Prometheus::start(&target).await;

    // Traffic only after a first scrape, so every counter's first sample is its zero and
    // rates over the whole run are exact.
    prometheus.wait_value(r#"up{job="sluice"}"#, 1.0).await;
    prometheus
        .wait_value(
            r#"sluice_requests_total{route="limited", outcome="limited"}"#,
            0.0,
        )
        .await;

    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..SENT {
        let r = c
            .get(format!("{}/limited/x", sluice.url()))
            .send()
            .await
            .expect("request to /limited");
        statuses.push(r.status().as_u16());
    }
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(
        (admitted, limited),
        (ALLOWED, SENT - ALLOWED),
        "statuses: {statuses:?}"
    );
    for _ in 0..DEAD {
        let r = c
            .get(format!("{}/dead", sluice.url()))
            .send()
            .await
            .expect("request to /dead");
        assert_eq!(r.status(), 502, "a refused upstream connection");
    }
    let r = c
        .get(format!("{}/status", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Exactly what was sent, as Prometheus scraped it.
    let limited_429 = (SENT - ALLOWED) as f64;
    prometheus
        .wait_value(
            r#"sluice_requests_total{job="sluice", route="limited", outcome="limited"}"#,
            limited_429,
        )
        .await;
    let expect = [
        (
            r#"sluice_requests_total{route="limited", outcome="forwarded"}"#,
            ALLOWED as f64,
        ),
        (
            r#"sluice_limit_decisions_total{route="limited", limit="per-ip", decision="rejected"}"#,
            limited_429,
        ),
        (
            r#"sluice_limit_decisions_total{route="limited", limit="per-ip", decision="admitted"}"#,
            ALLOWED as f64,
        ),
        (
            r#"sluice_requests_total{route="dead", outcome="upstream_error"}"#,
            DEAD as f64,
        ),
        (
            r#"sluice_upstream_errors_total{upstream="dead", kind="connect"}"#,
            DEAD as f64,
        ),
        (
            r#"sluice_requests_total{route="status", outcome="responded"}"#,
            1.0,
        ),
        (r#"sluice_store_fallback_active"#, 0.0),
        (r#"sum(sluice_store_errors_total)"#, 0.0),
    ];
    for (expr, value) in expect {
        prometheus.wait_value(expr, value).await;
    }
    // Rejections the deny cache answers make no store call; every other decision makes one.
    let store_calls = prometheus
        .value(r#"sluice_store_call_duration_seconds_count{store="redis"}"#)
        .await
        .expect("store call series");
    let deny_cached = prometheus
        .value("sluice_deny_cache_answers_total")
        .await
        .expect("deny cache series");
    assert_eq!(store_calls + deny_cached, SENT as f64);

    // The recording rule of the 429 ratio: all counters started at zero in the same scrape,
    // so the ratio of their rates is exact.
    prometheus
        .wait_value(
            r#"sluice_route:requests_limited:ratio_rate5m{route="limited"}"#,
            limited_429 / SENT as f64,
        )
        .await;

    // A refused reload, through the counter to the alert.
    support::replace_file(sluice.config_path(), "listen: [not, an, address]\n");
    prometheus
        .wait_value(r#"sluice_config_reloads_total{result="error"}"#, 1.0)
        .await;
    wait_for(WAIT, "SluiceConfigReloadFailed to fire", || async {
        let alerts = prometheus.api("alerts", &[]).await.expect("alerts");
        alerts["alerts"].as_array().into_iter().flatten().any(|a| {
            a["labels"]["alertname"] == "SluiceConfigReloadFailed" && a["state"] == "firing"
        })
    })
    .await;

    // Every dashboard query parses and returns series.
    let queries = dashboard_queries();
    assert!(queries.len() >= 9, "dashboard queries: {queries:?}");
    let mut failures = Vec::new();
    for (panel, expr) in &queries {
        match prometheus.query(expr).await {
            Ok(series) if series.is_empty() => {
                failures.push(format!("{panel}: `{expr}`: no series"))
            }
            Ok(_) => {}
            Err(e) => failures.push(format!("{panel}: `{expr}`: {e}")),
        }
    }
    // The dashboard's 429 ratio panel shows the same exact ratio.
    let (_, ratio) = queries
        .iter()
        .find(|(panel, _)| panel == "429 ratio by route")
        .expect("a 429 ratio panel");
    let series = prometheus
        .query(ratio)
        .await
        .expect("the 429 ratio panel's query");
    let limited_route = series
        .iter()
        .find(|s| s["metric"]["route"] == "limited")
        .unwrap_or_else(|| panic!("no route=\"limited\" in {series:?}"));
    let shown: f64 = limited_route["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .expect("a sample value");
    assert!(
        (shown - limited_429 / SENT as f64).abs() < 1e-9,
        "the 429 ratio panel shows {shown}"
    );

    // Every rule evaluated without error in Prometheus itself.
    let rules = alert_rules();
    let rule_count: usize = rules.groups.iter().map(|g| g.rules.len()).sum();
    wait_for(WAIT, "every rule to be evaluated", || async {
        let data = prometheus.api("rules", &[]).await.expect("rules");
        let evaluated: Vec<&Value> = data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .filter(|r| r["health"] != "unknown")
            .collect();
        evaluated.len() == rule_count
    })
    .await;
    let data = prometheus.api("rules", &[]).await.expect("rules");
    for group in data["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            if rule["health"] != "ok" {
                failures.push(format!(
                    "rule {}: {} {}",
                    rule["name"], rule["health"], rule["lastError"]
                ));
            }
        }
    }

    // Every rule's expression, as written, parses; without its threshold it returns series.
    for group in &rules.groups {
        for rule in &group.rules {
            let name = format!("{}/{}", group.name, rule.name());
            if let Err(e) = prometheus.query(&rule.expr).await {
                failures.push(format!("{name}: `{}`: {e}", rule.expr));
                continue;
            }
            let unfiltered = without_filtering(&rule.expr);
            match prometheus.query(&unfiltered).await {
                Ok(series) if series.is_empty() => {
                    failures.push(format!("{name}: `{unfiltered}`: no series"))
                }
                Ok(_) => {}
                Err(e) => failures.push(format!("{name}: `{unfiltered}`: {e}")),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "queries that failed or returned nothing:\n{}",
        failures.join("\n")
    );
}
