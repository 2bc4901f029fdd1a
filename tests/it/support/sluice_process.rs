//! The sluice binary under test: `sluice run` as a child process with its config written to a
//! temporary file (ports picked free, retried when taken), its log, its metrics, its memory,
//! and the store guard its `Drop` runs; and `sluice check` / other commands run to completion.

use std::fs::File;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{client, free_port, metric_sum, parse_metrics, samples, Policy};

/// Path of the sluice binary under test.
pub const SLUICE_BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// A running `sluice run --config FILE` child process.
pub struct Sluice {
    child: Child,
    port: u16,
    admin_port: u16,
    dir: tempfile::TempDir,
    config_path: PathBuf,
    log_path: PathBuf,
    /// The config names a Redis store (standalone, Sentinel or Cluster): when the test ends,
    /// the guard in `Drop` checks that Redis decided every request (see `check_store_decided`).
    redis_store: bool,
    /// Set by `expect_store_faults`: the test makes the store fail on purpose.
    store_faults_expected: std::sync::atomic::AtomicBool,
}

impl Sluice {
    /// Write `listen` + `admin_listen` (two free ports) + `yaml_rest` to a
    /// config file, start sluice and wait (up to 15 s) for `/healthz` = 200.
    /// A port picked free can be taken by another test before sluice binds it;
    /// when sluice says it cannot listen, it is started again on new ports.
    /// `config` is a [`Policy`] (built, it says whether it uses Redis) or a raw YAML string.
    pub async fn start(config: impl Into<SluiceConfig>) -> Sluice {
        Sluice::start_with_env(config, &[]).await
    }

    /// As `start`, with these environment variables set for sluice.
    pub async fn start_with_env(config: impl Into<SluiceConfig>, env: &[(&str, &str)]) -> Sluice {
        let config = config.into();
        for attempt in 1..=3 {
            match Sluice::try_start(&config, env).await {
                Ok(sluice) => return sluice,
                Err(log) if attempt < 3 && log.contains("cannot listen on") => {
                    eprintln!("sluice could not listen; retrying on other ports:\n{log}");
                }
                Err(log) => panic!("sluice exited during startup\nlog:\n{log}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    /// Starts sluice; `Err(log)` if it exits during startup.
    async fn try_start(start: &SluiceConfig, env: &[(&str, &str)]) -> Result<Sluice, String> {
        let yaml_rest = &start.yaml;
        let dir = tempfile::tempdir().expect("tempdir for sluice");
        let port = free_port();
        let mut admin_port = free_port();
        while admin_port == port {
            admin_port = free_port();
        }
        let config =
            format!("listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\n{yaml_rest}");
        let config_path = dir.path().join("sluice.yaml");
        std::fs::write(&config_path, &config).expect("write config");
        let log_path = dir.path().join("sluice.log");
        let log = File::create(&log_path).expect("create log file");
        let child = Command::new(SLUICE_BIN)
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("failed to spawn {SLUICE_BIN}: {e}"));
        let mut s = Sluice {
            child,
            port,
            admin_port,
            dir,
            config_path,
            log_path,
            redis_store: start.redis_store,
            store_faults_expected: std::sync::atomic::AtomicBool::new(false),
        };
        let c = client();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = c
                .get(format!("{}/healthz", s.admin_url()))
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                if r.status() == 200 {
                    return Ok(s);
                }
            }
            if let Some(status) = s.child.try_wait().unwrap() {
                return Err(format!(
                    "exit status {status}\nconfig:\n{config}\n{}",
                    s.log()
                ));
            }
            if Instant::now() > deadline {
                panic!(
                    "sluice /healthz did not answer 200 within 15 s\nconfig:\n{config}\nlog:\n{}",
                    s.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Proxy base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Admin base URL, `http://127.0.0.1:ADMIN_PORT`.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Everything sluice wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The text of `/metrics`.
    pub async fn metrics(&self) -> String {
        let r = client()
            .get(format!("{}/metrics", self.admin_url()))
            .send()
            .await
            .expect("GET /metrics");
        assert_eq!(r.status(), 200, "GET /metrics status");
        r.text().await.expect("/metrics body")
    }

    /// Sends SIGTERM, as Kubernetes and Docker do to stop a container.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {}", self.pid());
    }

    /// Waits up to `timeout` for the process to exit; its exit status, or `None` if it is
    /// still running.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait on sluice") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Peak resident set size (VmHWM) of the sluice process, in kB.
    pub fn peak_rss_kb(&self) -> u64 {
        proc_status_kb(self.pid(), "VmHWM")
    }

    /// Current resident set size (VmRSS), in kB.
    pub fn rss_kb(&self) -> u64 {
        proc_status_kb(self.pid(), "VmRSS")
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let guard = if std::thread::panicking() {
            Ok(())
        } else {
            self.check_store_decided()
        };
        // Stopped before the guard's verdict panics, or the process would outlive the test.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Err(why) = guard {
            panic!("{why}");
        }
        if std::thread::panicking() {
            eprintln!(
                "---- sluice log (listen {}, admin {}) ----\n{}\n---- end of sluice log ----",
                self.port,
                self.admin_port,
                self.log()
            );
        }
    }
}

impl Sluice {
    /// Declares that this test makes the store fail on purpose (a stopped Redis, a failover,
    /// a flushed script cache), so the end-of-test guard accepts store errors and decisions
    /// made without the store.
    pub fn expect_store_faults(&self) {
        self.store_faults_expected
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The harness's guard for every test with a Redis store: with `on_store_error: local`
    /// (the default) a failing Redis call is decided in process with the same arithmetic, so
    /// statuses and headers alone cannot show that Redis decided. When the test ends, sluice's
    /// own counters must say that no store call failed and nothing was decided without the
    /// store, unless the test declared `expect_store_faults`.
    fn check_store_decided(&mut self) -> Result<(), String> {
        if !self.redis_store
            || self
                .store_faults_expected
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(());
        }
        // A test that stopped sluice itself (SIGTERM) has no metrics left to read.
        if !matches!(self.child.try_wait(), Ok(None)) {
            return Ok(());
        }
        let text = blocking_get(self.admin_port, "/metrics").map_err(|e| {
            format!(
                "store guard: GET /metrics failed: {e}\nlog:\n{}",
                self.log()
            )
        })?;
        let all = parse_metrics(&text);
        for (name, labels) in [
            ("sluice_store_errors_total", &[][..]),
            ("sluice_store_fallback_decisions_total", &[][..]),
            (
                "sluice_store_breaker_transitions_total",
                &[("to", "open")][..],
            ),
        ] {
            let value = metric_sum(&all, name, labels);
            if value == 0.0 {
                continue;
            }
            return Err(format!(
                "store guard: {name}{labels:?} = {value}: a request was not decided by Redis. \
                 A test that makes the store fail on purpose calls `sluice.expect_store_faults()`.\n\
                 metrics:\n{}\nlog:\n{}",
                samples(&all, name, &[])
                    .iter()
                    .map(|s| format!("{s:?}"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                self.log()
            ));
        }
        Ok(())
    }
}

/// What `Sluice::start` runs: a policy file's text (without `listen` and `admin_listen`) and
/// whether its store is Redis, for the end-of-test guard.
pub struct SluiceConfig {
    yaml: String,
    redis_store: bool,
}

impl From<&Policy> for SluiceConfig {
    fn from(policy: &Policy) -> SluiceConfig {
        SluiceConfig {
            yaml: policy.to_yaml(),
            redis_store: policy.uses_redis(),
        }
    }
}

impl From<Policy> for SluiceConfig {
    fn from(policy: Policy) -> SluiceConfig {
        SluiceConfig::from(&policy)
    }
}

/// A raw YAML string, for the tests that remain written that way: whether it uses Redis is
/// read from its `store:` section.
impl From<&str> for SluiceConfig {
    fn from(yaml: &str) -> SluiceConfig {
        SluiceConfig {
            yaml: yaml.to_owned(),
            redis_store: names_redis_store(yaml),
        }
    }
}

impl From<&String> for SluiceConfig {
    fn from(yaml: &String) -> SluiceConfig {
        SluiceConfig::from(yaml.as_str())
    }
}

impl From<String> for SluiceConfig {
    fn from(yaml: String) -> SluiceConfig {
        SluiceConfig::from(yaml.as_str())
    }
}

/// Whether a raw config's store is Redis (standalone, Sentinel or Cluster): the file is
/// parsed, so `store: { redis: … }` in flow form counts as well as the block form. A `store`
/// without a `redis` entry (or `redis: null`) is the in-process store. A file that is not
/// YAML is refused here: sluice would refuse it too, and the guard must not guess.
fn names_redis_store(yaml: &str) -> bool {
    let config: serde_json::Value = serde_saphyr::from_str(yaml)
        .unwrap_or_else(|e| panic!("store guard: the config is not YAML: {e}\n{yaml}"));
    !config
        .get("store")
        .and_then(|store| store.get("redis"))
        .is_none_or(serde_json::Value::is_null)
}

/// A blocking `GET path` on 127.0.0.1:`port` over HTTP/1.1 (for `Drop`, which cannot await):
/// the body of a 200 answer.
fn blocking_get(port: u16, path: &str) -> Result<String, String> {
    let mut stream =
        std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no end of head in {text:?}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("answered {head}"));
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_owned())
}

/// The payload of a chunked body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

fn proc_status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/status: {e}"));
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix(field) {
            let rest = rest.trim_start_matches(':').trim();
            let num = rest.split_whitespace().next().unwrap();
            return num.parse().unwrap();
        }
    }
    panic!("{field} not found in /proc/{pid}/status")
}

/// Result of running the sluice binary to completion.
pub struct CliOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Run sluice with `args`, killing it (and panicking) if it has not exited
/// within `timeout`. The address space is capped at 4 GiB so that a runaway
/// (e.g. a YAML alias bomb) cannot take the machine down.
pub fn run_sluice(args: &[&str], timeout: Duration) -> CliOutput {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("stdout");
    let err_path = dir.path().join("stderr");
    let start = Instant::now();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 2>/dev/null; exec \"$0\" \"$@\"")
        .arg(SLUICE_BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap())
        .spawn()
        .expect("spawn sluice");
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`sluice {}` did not exit within {timeout:?} (killed)\nstderr so far:\n{}",
                args.join(" "),
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let mut stdout = String::new();
    File::open(&out_path)
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let stderr = String::from_utf8_lossy(&std::fs::read(&err_path).unwrap()).into_owned();
    CliOutput {
        status,
        stdout,
        stderr,
        elapsed,
    }
}

/// `sluice check --config PATH`, returning (exit status, stdout, stderr).
pub fn sluice_check(path: &Path) -> (ExitStatus, String, String) {
    let out = run_sluice(
        &["check", "--config", path.to_str().unwrap()],
        Duration::from_secs(20),
    );
    (out.status, out.stdout, out.stderr)
}

/// Writes `contents` to `path` through a rename, as deploy tools replace files: a reader
/// (sluice's reload poll) sees the old file or the new one, never half of one.
pub fn replace_file(path: &Path, contents: &str) {
    let staging = path.with_extension("staged");
    std::fs::write(&staging, contents)
        .unwrap_or_else(|e| panic!("write {}: {e}", staging.display()));
    std::fs::rename(&staging, path)
        .unwrap_or_else(|e| panic!("rename {} to {}: {e}", staging.display(), path.display()));
}

/// Write `contents` to a fresh `.yaml` temp file and return it (keep it alive).
pub fn write_config(contents: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .prefix("sluice-check-")
        .suffix(".yaml")
        .tempfile()
        .unwrap();
    f.write_all(contents.as_bytes()).unwrap();
    f.flush().unwrap();
    f
}

#[cfg(test)]
mod tests {
    use super::names_redis_store;

    #[test]
    fn the_redis_guard_reads_the_store_in_block_and_flow_form() {
        assert!(names_redis_store(
            "store:\n  redis:\n    url: redis://127.0.0.1:1/0\nroutes: []\n"
        ));
        assert!(names_redis_store(
            "store: { redis: { url: \"redis://127.0.0.1:1/0\" } }\nroutes: []\n"
        ));
        assert!(names_redis_store(
            "store: { key_prefix: p, redis: { cluster: { nodes: [\"h:1\"] } } }\nroutes: []\n"
        ));
        assert!(!names_redis_store("routes: []\n"));
        assert!(!names_redis_store(
            "store: { key_prefix: p, local: { max_keys: 2048 } }\nroutes: []\n"
        ));
        // Not the store's: a route or upstream named redis, a comment.
        assert!(!names_redis_store(
            "store:\n  # redis: later\n  key_prefix: p\nupstreams:\n  redis: { url: \"http://127.0.0.1:1\" }\nroutes: []\n"
        ));
    }
}
