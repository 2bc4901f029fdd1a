//! Test harness for sluice's integration tests.
//!
//! Everything here is real: a `redis-server` child process, in-process hyper
//! upstream servers on 127.0.0.1, and the `sluice` binary itself spawned as a
//! child process with a YAML config written to a temporary file.
//!
//! Each test file includes this module with `mod support;` and uses only the
//! parts it needs, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod certs;
pub mod grpc;
pub mod websocket;
pub mod wire;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// Path of the sluice binary under test.
pub const SLUICE_BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// Pick a free loopback TCP port (bind to :0, read the port, drop the socket).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// A port on which nothing listens (bound once, then released).
pub fn closed_port() -> u16 {
    free_port()
}

/// A reqwest client for talking to loopback servers: never goes through a
/// proxy from the environment, generous timeout.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build()
        .expect("build reqwest client")
}

/// Like [`client`], but every connection leaves from `ip` (any 127.x.y.z
/// works on Linux loopback), so sluice sees that client address.
pub fn client_from(ip: &str) -> reqwest::Client {
    let ip: std::net::IpAddr = ip.parse().expect("IP address");
    reqwest::Client::builder()
        .no_proxy()
        .local_address(ip)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("build reqwest client")
}

// ---------------------------------------------------------------------------
// Redis
// ---------------------------------------------------------------------------

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Locate `redis-server`, or panic with installation instructions. The suite
/// never skips silently when Redis is missing.
pub fn redis_server_path() -> PathBuf {
    find_on_path("redis-server").unwrap_or_else(|| {
        panic!(
            "redis-server not found on PATH: install it with \
             `sudo apt-get install redis-server` or run `bash scripts/test.sh`, \
             which installs it"
        )
    })
}

/// A real `redis-server` child process on a free loopback port.
pub struct Redis {
    child: Option<Child>,
    port: u16,
    /// Extra command-line settings, e.g. `["--replicaof", "127.0.0.1", "6379"]`.
    args: Vec<String>,
    /// The `--requirepass` among `args`, used by this harness's own commands.
    password: Option<String>,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// Spawn redis-server and wait (up to 10 s) until it answers PING. A port picked free
    /// can be taken by another test before redis-server binds it, so an early exit is retried
    /// on a new port, twice at most.
    pub async fn start() -> Redis {
        Redis::start_with(&[]).await
    }

    /// Like [`Redis::start`], with extra command-line settings for redis-server.
    pub async fn start_with(args: &[&str]) -> Redis {
        for attempt in 1..=3 {
            match Redis::try_start(args).await {
                Ok(redis) => return redis,
                Err(why) if attempt < 3 => eprintln!("{why}; retrying on another port"),
                Err(why) => panic!("{why}"),
            }
        }
        unreachable!("the last attempt panics")
    }

    async fn try_start(args: &[&str]) -> Result<Redis, String> {
        let dir = tempfile::tempdir().expect("tempdir for redis");
        let mut redis = Redis {
            child: None,
            port: free_port(),
            args: args.iter().map(|a| a.to_string()).collect(),
            password: args
                .iter()
                .position(|a| *a == "--requirepass")
                .and_then(|i| args.get(i + 1))
                .map(|p| p.to_string()),
            _dir: dir,
        };
        redis.spawn().await?;
        Ok(redis)
    }

    /// Starts redis-server on this `Redis`'s port and waits until it answers PING.
    async fn spawn(&mut self) -> Result<(), String> {
        let bin = redis_server_path();
        let port = self.port;
        let child = Command::new(&bin)
            .arg("--port")
            .arg(port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg("no")
            .arg("--dir")
            .arg(self._dir.path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("failed to spawn {}: {e}", bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.ping().await {
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return Err(format!(
                    "redis-server on port {port} exited early with {status}"
                ));
            }
            if Instant::now() > deadline {
                panic!("redis-server on port {port} did not answer PING within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a stopped redis-server again on the same port, empty (no persistence).
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn()
            .await
            .unwrap_or_else(|why| panic!("restarting redis-server: {why}"));
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/0` (`redis://:PASSWORD@…` when it has one)
    pub fn url(&self) -> String {
        match &self.password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    async fn ping(&self) -> bool {
        let fut = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .ok()?;
            s.write_all(b"*1\r\n$4\r\nPING\r\n").await.ok()?;
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).await.ok()?;
            // With a password, an unauthenticated PING is refused, which shows it is up too.
            Some(buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"))
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(1), fut).await,
            Ok(Some(true))
        )
    }

    /// Run one Redis command, e.g. `redis.cmd(&["SCRIPT", "FLUSH"])`.
    pub async fn cmd(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(self.url()).expect("redis client");
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to test redis");
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query_async::<redis::Value>(&mut con)
            .await
            .unwrap_or_else(|e| panic!("redis command {args:?} failed: {e}"))
    }

    /// Calls of one command since start or the last `CONFIG RESETSTAT`, from
    /// `INFO commandstats` (e.g. `commandstat("evalsha")`).
    pub async fn commandstat(&self, command: &str) -> u64 {
        self.try_commandstat(command)
            .await
            .unwrap_or_else(|e| panic!("INFO commandstats failed: {e}"))
    }

    /// [`Redis::commandstat`], or the error, for polling a node that may drop its clients
    /// (a replica being promoted: Sentinel disconnects its clients).
    pub async fn try_commandstat(&self, command: &str) -> Result<u64, String> {
        let value = command_with_password(
            self.port,
            self.password.as_deref(),
            &["INFO", "commandstats"],
        )
        .await
        .map_err(|e| e.to_string())?;
        let info = match value {
            redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            other => return Err(format!("INFO answered {other:?}")),
        };
        let prefix = format!("cmdstat_{command}:calls=");
        Ok(info
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse().expect("a call count")))
    }

    /// Starts watching every command clients send to this server (`MONITOR`), until
    /// [`Monitor::commands`]. Unlike per-command statistics, it sees commands no test thought
    /// to name, and unlike `total_commands_processed`, it tells a client's command from the
    /// ones a script ran inside (`[0 lua]`).
    pub async fn monitor(&self) -> Monitor {
        let mut stream = self
            .raw_connection()
            .await
            .unwrap_or_else(|e| panic!("connect to redis for MONITOR: {e}"));
        stream
            .write_all(b"*1\r\n$7\r\nMONITOR\r\n")
            .await
            .expect("send MONITOR");
        let mut lines = tokio::io::BufReader::new(stream);
        let mut line = String::new();
        tokio::time::timeout(Duration::from_secs(5), async {
            while !line.starts_with("+OK") {
                line.clear();
                let n = tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line)
                    .await
                    .expect("read MONITOR's answer");
                assert!(n > 0, "redis closed the MONITOR connection");
            }
        })
        .await
        .expect("MONITOR answered within 5 s");
        let marker = format!("sluice-test-monitor-end-{}", free_port());
        let end = format!("\"ECHO\" \"{marker}\"");
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut line = String::new();
            loop {
                line.clear();
                let n = tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line)
                    .await
                    .expect("read from MONITOR");
                assert!(n > 0, "redis closed the MONITOR connection");
                if line.contains(&end) {
                    return seen;
                }
                // `+1700000000.123456 [0 127.0.0.1:54321] "EVALSHA" "…"`; `[0 lua]` for a
                // command a script ran.
                let Some((source, command)) = line.split_once("] ") else {
                    continue;
                };
                if !source.ends_with(" lua") {
                    let name = command.split('"').nth(1).unwrap_or_default();
                    seen.push(name.to_ascii_uppercase());
                }
            }
        });
        Monitor {
            redis_port: self.port,
            password: self.password.clone(),
            marker,
            task,
        }
    }

    /// A plain socket to this server, authenticated when it has a password: no client
    /// library, whose connection would send commands of its own (`CLIENT SETINFO`).
    async fn raw_connection(&self) -> std::io::Result<tokio::net::TcpStream> {
        raw_redis_connection(self.port, self.password.as_deref()).await
    }

    /// All keys in db 0 (KEYS *).
    pub async fn keys(&self) -> Vec<String> {
        let client = redis::Client::open(self.url()).expect("redis client");
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to test redis");
        redis::cmd("KEYS")
            .arg("*")
            .query_async::<Vec<String>>(&mut con)
            .await
            .expect("KEYS *")
    }

    /// Kill redis-server now (for tests that need the store gone).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running `MONITOR` on one Redis (see [`Redis::monitor`]).
pub struct Monitor {
    redis_port: u16,
    password: Option<String>,
    marker: String,
    task: JoinHandle<Vec<String>>,
}

impl Monitor {
    /// Ends the watch: the names of the commands clients sent since it started, in order
    /// (upper case), without those scripts ran inside. A marker command sent last tells the
    /// end, so nothing sent before this call is missed.
    pub async fn commands(self) -> Vec<String> {
        let mut stream = raw_redis_connection(self.redis_port, self.password.as_deref())
            .await
            .expect("connect to redis to end MONITOR");
        let echo = format!(
            "*2\r\n$4\r\nECHO\r\n${}\r\n{}\r\n",
            self.marker.len(),
            self.marker
        );
        stream.write_all(echo.as_bytes()).await.expect("send ECHO");
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("MONITOR saw its end marker within 10 s")
            .expect("MONITOR reader")
    }
}

/// A plain socket to the Redis on `port`, with `AUTH` first when there is a password.
async fn raw_redis_connection(
    port: u16,
    password: Option<&str>,
) -> std::io::Result<tokio::net::TcpStream> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    if let Some(password) = password {
        let auth = format!("*2\r\n$4\r\nAUTH\r\n${}\r\n{password}\r\n", password.len());
        stream.write_all(auth.as_bytes()).await?;
        let mut answer = [0u8; 5];
        stream.read_exact(&mut answer).await?;
        if &answer != b"+OK\r\n" {
            return Err(std::io::Error::other("AUTH refused"));
        }
    }
    Ok(stream)
}

// ---------------------------------------------------------------------------
// Redis Sentinel
// ---------------------------------------------------------------------------

/// Locate `redis-sentinel`, or panic with installation instructions.
pub fn redis_sentinel_path() -> PathBuf {
    find_on_path("redis-sentinel").unwrap_or_else(|| {
        panic!(
            "redis-sentinel not found on PATH: install it with \
             `sudo apt-get install redis-sentinel` (Homebrew's `redis` has it) or run \
             `bash scripts/test.sh`, which installs it"
        )
    })
}

/// Runs one command against the Redis or Sentinel on `port`, each step bounded by 5 s.
pub async fn command_at(port: u16, args: &[&str]) -> redis::RedisResult<redis::Value> {
    command_with_password(port, None, args).await
}

/// [`command_at`], authenticated with `password` when there is one.
pub async fn command_with_password(
    port: u16,
    password: Option<&str>,
    args: &[&str],
) -> redis::RedisResult<redis::Value> {
    let auth = password.map(|p| format!(":{p}@")).unwrap_or_default();
    let client = redis::Client::open(format!("redis://{auth}127.0.0.1:{port}/0"))?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(5)));
    let mut con = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async::<redis::Value>(&mut con).await
}

/// One `redis-sentinel` child process with its generated `sentinel.conf`.
pub struct SentinelProcess {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl SentinelProcess {
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sentinel.log")).unwrap_or_default()
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real master, one replica (`--replicaof`) and three `redis-sentinel` processes watching
/// them as `mymaster` with quorum 2, all on free loopback ports.
pub struct SentinelCluster {
    /// The master at start (after a failover, a replica or stopped).
    pub first_master: Redis,
    /// The replica at start (after a failover, the master).
    pub first_replica: Redis,
    pub sentinels: Vec<SentinelProcess>,
    /// `requirepass` of the sentinels, if any.
    sentinel_password: Option<String>,
}

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "mymaster";

impl SentinelCluster {
    /// Starts everything and waits (up to 30 s) until the replica is in sync and every
    /// sentinel knows the master, the replica and the two other sentinels.
    pub async fn start() -> SentinelCluster {
        SentinelCluster::start_with_passwords(None, None).await
    }

    /// Like [`SentinelCluster::start`], with `requirepass` on the master and replica
    /// (`password`) and on the sentinels (`sentinel_password`).
    pub async fn start_with_passwords(
        password: Option<&str>,
        sentinel_password: Option<&str>,
    ) -> SentinelCluster {
        let sentinel_bin = redis_sentinel_path();
        let auth: Vec<&str> = match password {
            Some(p) => vec!["--requirepass", p, "--masterauth", p],
            None => Vec::new(),
        };
        let first_master = Redis::start_with(&auth).await;
        let master_port = first_master.port().to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &master_port];
        replica_args.extend(&auth);
        let first_replica = Redis::start_with(&replica_args).await;
        let replica_port = first_replica.port();
        wait_for(
            Duration::from_secs(30),
            "the replica to sync with the master",
            || async move {
                let info = command_with_password(replica_port, password, &["INFO", "replication"]);
                info_text(info.await).is_some_and(|t| t.contains("master_link_status:up"))
            },
        )
        .await;
        let sentinels = (0..3)
            .map(|_| {
                spawn_sentinel(
                    &sentinel_bin,
                    first_master.port(),
                    password,
                    sentinel_password,
                )
            })
            .collect();
        let cluster = SentinelCluster {
            first_master,
            first_replica,
            sentinels,
            sentinel_password: sentinel_password.map(str::to_owned),
        };
        for sentinel in &cluster.sentinels {
            let port = sentinel.port;
            wait_for(
                Duration::from_secs(30),
                "a sentinel to know the whole group",
                || async move {
                    let replicas = sentinel_list(port, sentinel_password, "replicas").await;
                    let others = sentinel_list(port, sentinel_password, "sentinels").await;
                    let replica_known = replicas.iter().any(|r| {
                        r.get("port") == Some(&replica_port.to_string())
                            && !r.get("flags").is_some_and(|f| f.contains("down"))
                    });
                    replica_known && others.len() == 2
                },
            )
            .await;
        }
        cluster
    }

    /// `host:port` of every sentinel, for sluice's `nodes`.
    pub fn nodes(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect()
    }

    /// The master's port according to the first sentinel that answers.
    pub async fn master_port(&self) -> Option<u16> {
        for sentinel in &self.sentinels {
            let answer = command_with_password(
                sentinel.port,
                self.sentinel_password.as_deref(),
                &["SENTINEL", "get-master-addr-by-name", MASTER_NAME],
            )
            .await;
            if let Ok(value) = answer {
                if let Ok(Some((_, port))) = redis::from_redis_value::<Option<(String, u16)>>(value)
                {
                    return Some(port);
                }
            }
        }
        None
    }

    /// Logs of every sentinel, for a failure message.
    pub fn logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| format!("---- sentinel {} ----\n{}", s.port, s.log()))
            .collect()
    }
}

fn spawn_sentinel(
    bin: &Path,
    master_port: u16,
    password: Option<&str>,
    sentinel_password: Option<&str>,
) -> SentinelProcess {
    let dir = tempfile::tempdir().expect("tempdir for sentinel");
    let port = free_port();
    // Fast but reliable on a busy 2-core machine: down after 1 s without an answer, a
    // failover attempt may be retried after 3 s.
    let conf = format!(
        "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {dir}\nlogfile {dir}/sentinel.log\n\
         sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
         sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
         sentinel failover-timeout {MASTER_NAME} 3000\n\
         sentinel parallel-syncs {MASTER_NAME} 1\n",
        dir = dir.path().display()
    );
    let mut conf = conf;
    if let Some(p) = password {
        conf.push_str(&format!("sentinel auth-pass {MASTER_NAME} {p}\n"));
    }
    if let Some(p) = sentinel_password {
        // Sentinels authenticate to each other with `sentinel-pass`.
        conf.push_str(&format!("requirepass {p}\nsentinel sentinel-pass {p}\n"));
    }
    let conf_path = dir.path().join("sentinel.conf");
    std::fs::write(&conf_path, conf).expect("write sentinel.conf");
    let child = Command::new(bin)
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("failed to spawn {}: {e}", bin.display()));
    SentinelProcess { child, port, dir }
}

/// `SENTINEL <what> mymaster` (replicas or sentinels) as a list of field maps; empty when the
/// sentinel does not answer yet.
async fn sentinel_list(
    port: u16,
    password: Option<&str>,
    what: &str,
) -> Vec<BTreeMap<String, String>> {
    match command_with_password(port, password, &["SENTINEL", what, MASTER_NAME]).await {
        Ok(value) => redis::from_redis_value(value).unwrap_or_default(),
        Err(_) => Vec::new(),
    }
}

/// The text of an `INFO` answer.
fn info_text(answer: redis::RedisResult<redis::Value>) -> Option<String> {
    match answer.ok()? {
        redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(&bytes).into_owned()),
        redis::Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

/// Polls `ready` every 100 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_for<F, Fut>(limit: Duration, what: &str, mut ready: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !ready().await {
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// Upstream
// ---------------------------------------------------------------------------

type UpBody = BoxBody<Bytes, Infallible>;

/// Size of one download chunk. It is a multiple of 251 so every chunk holds
/// the same repeating pattern `byte[k] = k % 251`.
pub const PATTERN_CHUNK: usize = 251 * 261;

/// The byte expected at absolute offset `k` of a download / upload body.
pub fn pattern_byte(k: u64) -> u8 {
    (k % 251) as u8
}

/// One chunk of the repeating pattern (starts at an offset multiple of 251).
pub fn pattern_chunk() -> Bytes {
    Bytes::from(
        (0..PATTERN_CHUNK as u64)
            .map(pattern_byte)
            .collect::<Vec<u8>>(),
    )
}

/// Whether `data`, found at absolute offset `offset` of a body, follows the
/// pattern (fast: compares slices, not bytes one by one).
pub fn pattern_matches(offset: u64, data: &[u8]) -> bool {
    static PATTERN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pat = PATTERN.get_or_init(|| (0..PATTERN_CHUNK as u64 + 251).map(pattern_byte).collect());
    let step = PATTERN_CHUNK;
    let mut at = offset;
    for piece in data.chunks(step) {
        let off = (at % 251) as usize;
        if piece != &pat[off..off + piece.len()] {
            return false;
        }
        at += piece.len() as u64;
    }
    true
}

#[derive(Default)]
struct UpState {
    arrivals: Mutex<Vec<Instant>>,
    /// The path and query of each request, in arrival order.
    paths: Mutex<Vec<String>>,
    /// How each `/upload` body ended, in the order they ended.
    uploads: Mutex<Vec<UploadSeen>>,
}

/// How the upstream's `/upload` handler saw one request body end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadSeen {
    /// The body ended cleanly after this many bytes.
    Complete(u64),
    /// The body broke off with an error after this many bytes.
    Broken(u64),
}

/// An in-process hyper HTTP server on 127.0.0.1 standing in for a backend.
///
/// Routes:
/// - `/download/<n>`: 200, streams n bytes of the pattern in chunks
/// - `/upload`: consumes the body chunk by chunk, answers the byte count as
///   text, and `x-pattern-ok: true|false` (whether the bytes followed the pattern)
/// - `/slow/<ms>`: sleeps, then 200 "slow"
/// - `/login?password=right`: 200 "welcome"; `/login` with any other query: 401
/// - `/hop-response`: like the echo, but also sends hop-by-hop response headers
///   (`connection: x-hop`, `x-hop: 1`, `keep-alive: timeout=5`,
///   `proxy-connection: keep-alive`) and an ordinary `x-normal-resp: yes`
/// - anything else: 200 JSON `{"method","path","headers":{name:[values]}}`
pub struct Upstream {
    addr: SocketAddr,
    state: Arc<UpState>,
    task: JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpState::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(x) => x,
                    Err(_) => continue,
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, st.clone()));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream { addr, state, task }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Number of requests received so far.
    pub fn hits(&self) -> usize {
        self.state.arrivals.lock().unwrap().len()
    }

    /// The instant each request arrived, in arrival order.
    pub fn arrivals(&self) -> Vec<Instant> {
        self.state.arrivals.lock().unwrap().clone()
    }

    /// The path and query of each request received, in arrival order.
    pub fn paths(&self) -> Vec<String> {
        self.state.paths.lock().unwrap().clone()
    }

    /// How each `/upload` body ended so far (complete or broken, with its byte count).
    pub fn uploads(&self) -> Vec<UploadSeen> {
        self.state.uploads.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn full(b: impl Into<Bytes>) -> UpBody {
    Full::new(b.into()).boxed()
}

fn echo_json(req: &Request<Incoming>) -> serde_json::Value {
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in req.headers() {
        headers
            .entry(name.as_str().to_string())
            .or_default()
            .push(String::from_utf8_lossy(value.as_bytes()).into_owned());
    }
    let path = req
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    serde_json::json!({
        "method": req.method().as_str(),
        "path": path,
        "headers": headers,
    })
}

async fn handle(req: Request<Incoming>, st: Arc<UpState>) -> Result<Response<UpBody>, Infallible> {
    st.arrivals.lock().unwrap().push(Instant::now());
    let path = req.uri().path().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), |pq| pq.as_str().to_string());
    st.paths.lock().unwrap().push(path_and_query);

    if let Some(n) = path.strip_prefix("/download/") {
        let total: u64 = n.parse().unwrap_or(0);
        let chunk = pattern_chunk();
        let stream = futures_util::stream::unfold(0u64, move |sent| {
            let chunk = chunk.clone();
            async move {
                if sent >= total {
                    return None;
                }
                let len = std::cmp::min(chunk.len() as u64, total - sent) as usize;
                Some((
                    Ok::<_, Infallible>(Frame::data(chunk.slice(..len))),
                    sent + len as u64,
                ))
            }
        });
        let resp = Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/octet-stream")
            .body(StreamBody::new(stream).boxed())
            .unwrap();
        return Ok(resp);
    }

    if path == "/upload" {
        let mut body = req.into_body();
        let mut count: u64 = 0;
        let mut ok = true;
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    st.uploads.lock().unwrap().push(UploadSeen::Broken(count));
                    return Ok(Response::builder()
                        .status(StatusCode::BAD_REQUEST)
                        .body(full(format!("body error after {count} bytes: {e}")))
                        .unwrap());
                }
            };
            if let Some(data) = frame.data_ref() {
                if ok {
                    ok = pattern_matches(count, data);
                }
                count += data.len() as u64;
            }
        }
        st.uploads.lock().unwrap().push(UploadSeen::Complete(count));
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/plain")
            .header("x-pattern-ok", if ok { "true" } else { "false" })
            .body(full(count.to_string()))
            .unwrap());
    }

    if path == "/login" {
        // A login form: 200 for the right password, 401 for any other.
        let right = req.uri().query() == Some("password=right");
        let (status, body) = if right {
            (StatusCode::OK, "welcome")
        } else {
            (StatusCode::UNAUTHORIZED, "wrong password")
        };
        return Ok(Response::builder().status(status).body(full(body)).unwrap());
    }

    if let Some(ms) = path.strip_prefix("/slow/") {
        let ms: u64 = ms.parse().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .body(full("slow"))
            .unwrap());
    }

    let json = echo_json(&req);
    let mut b = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json");
    if path == "/hop-response" {
        b = b
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-connection", "keep-alive")
            .header("x-normal-resp", "yes");
    }
    Ok(b.body(full(json.to_string())).unwrap())
}

// ---------------------------------------------------------------------------
// Sluice
// ---------------------------------------------------------------------------

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
    pub async fn start(yaml_rest: &str) -> Sluice {
        Sluice::start_with_env(yaml_rest, &[]).await
    }

    /// As `start`, with these environment variables set for sluice.
    pub async fn start_with_env(yaml_rest: &str, env: &[(&str, &str)]) -> Sluice {
        for attempt in 1..=3 {
            match Sluice::try_start(yaml_rest, env).await {
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
    async fn try_start(yaml_rest: &str, env: &[(&str, &str)]) -> Result<Sluice, String> {
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
            redis_store: names_redis_store(yaml_rest),
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

/// Whether a config's `store:` section names Redis (`redis:` standalone, Sentinel or Cluster).
fn names_redis_store(yaml: &str) -> bool {
    let mut in_store = false;
    for line in yaml.lines() {
        if !line.starts_with(' ') && !line.trim().is_empty() {
            in_store = line.starts_with("store:");
        }
        if in_store && line.trim_start().starts_with("redis:") {
            return true;
        }
    }
    false
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

// ---------------------------------------------------------------------------
// Store variants for running the same limit tests twice
// ---------------------------------------------------------------------------

/// Which limit store a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    Redis,
    Memory,
}

/// A store for a test: the Redis process (if any) and the `store:` YAML.
pub struct Store {
    pub redis: Option<Redis>,
    pub yaml: String,
}

impl Store {
    pub async fn start(kind: StoreKind) -> Store {
        match kind {
            StoreKind::Memory => Store {
                redis: None,
                yaml: String::new(),
            },
            StoreKind::Redis => {
                let r = Redis::start().await;
                let yaml = redis_store_yaml(&r.url());
                Store {
                    redis: Some(r),
                    yaml,
                }
            }
        }
    }
}

/// The `store:` section for a Redis at `url`, with a generous timeout.
pub fn redis_store_yaml(url: &str) -> String {
    format!(
        "store:\n  redis:\n    url: {url}\n    timeout: 500ms\n    pool_size: 8\n  key_prefix: sluice-test\n"
    )
}

// ---------------------------------------------------------------------------
// sluice check / other CLI runs
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Raw HTTP/1.1 over TcpStream (for exact control of headers)
// ---------------------------------------------------------------------------

/// A parsed HTTP/1.1 response read from a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header (lowercased name, value), in wire order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == &name.to_ascii_lowercase())
            .map(|(_, v)| v.as_str())
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}

/// Send `request` verbatim to `addr` and read one response (Content-Length,
/// chunked, or until EOF). Times out after 10 s.
pub async fn raw_http(addr: SocketAddr, request: &str) -> RawResponse {
    tokio::time::timeout(Duration::from_secs(10), raw_http_inner(addr, request))
        .await
        .unwrap_or_else(|_| panic!("raw HTTP request to {addr} timed out:\n{request}"))
}

async fn raw_http_inner(addr: SocketAddr, request: &str) -> RawResponse {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 8192];
    // Read the head.
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let n = s.read(&mut tmp).await.unwrap();
        assert!(
            n > 0,
            "connection closed before response head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&tmp[..n]);
    };
    let (status, headers) = parse_head(&buf[..head_end]);
    let mut rest = buf[head_end + 4..].to_vec();
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let body = if let Some(len) = get("content-length") {
        let len: usize = len.parse().unwrap();
        while rest.len() < len {
            let n = s.read(&mut tmp).await.unwrap();
            assert!(n > 0, "connection closed mid-body");
            rest.extend_from_slice(&tmp[..n]);
        }
        rest.truncate(len);
        rest
    } else if get("transfer-encoding")
        .map(|v| v.to_ascii_lowercase().contains("chunked"))
        .unwrap_or(false)
    {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&rest, b"\r\n") {
                    break i;
                }
                let n = s.read(&mut tmp).await.unwrap();
                assert!(n > 0, "connection closed in chunk size");
                rest.extend_from_slice(&tmp[..n]);
            };
            let size_str = String::from_utf8_lossy(&rest[..line_end]).into_owned();
            let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16)
                .unwrap_or_else(|_| panic!("bad chunk size {size_str:?}"));
            rest.drain(..line_end + 2);
            if size == 0 {
                break;
            }
            while rest.len() < size + 2 {
                let n = s.read(&mut tmp).await.unwrap();
                assert!(n > 0, "connection closed mid-chunk");
                rest.extend_from_slice(&tmp[..n]);
            }
            body.extend_from_slice(&rest[..size]);
            rest.drain(..size + 2);
        }
        body
    } else if status == 204 || status == 304 {
        Vec::new()
    } else {
        loop {
            let n = s.read(&mut tmp).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            rest.extend_from_slice(&tmp[..n]);
        }
        rest
    };
    RawResponse {
        status,
        headers,
        body,
    }
}

/// The status and the (lower-cased name, value) header fields of a response head, without
/// its final blank line.
fn parse_head(head: &[u8]) -> (u16, Vec<(String, String)>) {
    let head = String::from_utf8_lossy(head);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, v) = l.split_once(':').expect("header line");
            (n.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    (status, headers)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

// ---------------------------------------------------------------------------
// Prometheus text parsing
// ---------------------------------------------------------------------------

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parse the Prometheus text format (no escapes beyond `\"`, `\\`, `\n`).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = if let Some(brace) = line.find('{') {
            let name = &line[..brace];
            let mut labels = BTreeMap::new();
            let bytes: Vec<char> = line[brace + 1..].chars().collect();
            let mut i = 0;
            loop {
                while i < bytes.len() && (bytes[i] == ',' || bytes[i] == ' ') {
                    i += 1;
                }
                if i >= bytes.len() {
                    panic!("unterminated labels in metrics line {line:?}");
                }
                if bytes[i] == '}' {
                    i += 1;
                    break;
                }
                let start = i;
                while bytes[i] != '=' {
                    i += 1;
                }
                let key: String = bytes[start..i].iter().collect();
                i += 1; // '='
                assert_eq!(bytes[i], '"', "label value must be quoted in {line:?}");
                i += 1;
                let mut val = String::new();
                while bytes[i] != '"' {
                    if bytes[i] == '\\' {
                        i += 1;
                        val.push(match bytes[i] {
                            'n' => '\n',
                            c => c,
                        });
                    } else {
                        val.push(bytes[i]);
                    }
                    i += 1;
                }
                i += 1; // closing quote
                labels.insert(key.trim().to_string(), val);
            }
            let rest: String = bytes[i..].iter().collect();
            (name.to_string(), labels, rest)
        } else {
            let mut parts = line.splitn(2, ' ');
            let name = parts.next().unwrap().to_string();
            (
                name,
                BTreeMap::new(),
                parts.next().unwrap_or("").to_string(),
            )
        };
        let value_str = rest.split_whitespace().next().unwrap_or("");
        let value = match value_str {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad sample value in metrics line {line:?}")),
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// Samples named `name` whose labels include all of `labels`.
pub fn samples<'a>(all: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    all.iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(|x| x == v).unwrap_or(false))
        })
        .collect()
}

/// Sum of the values of the samples named `name` matching `labels` (0 if none).
pub fn metric_sum(all: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(all, name, labels).iter().map(|s| s.value).sum()
}

// ---------------------------------------------------------------------------
// Rate-limit header parsing
// ---------------------------------------------------------------------------

/// One item of a `ratelimit-policy` or `ratelimit` structured field:
/// `"name";k=v;k=v`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitItem {
    pub name: String,
    pub params: BTreeMap<String, i64>,
}

impl LimitItem {
    pub fn param(&self, k: &str) -> i64 {
        *self
            .params
            .get(k)
            .unwrap_or_else(|| panic!("parameter {k} missing in {self:?}"))
    }
}

/// Parse a structured-field list like `"per-ip";q=5;w=60, "per-key";q=3;w=1`.
/// Panics (failing the test) on anything that is not this exact syntax.
pub fn parse_limit_field(value: &str) -> Vec<LimitItem> {
    value
        .split(", ")
        .map(|item| {
            let mut parts = item.split(';');
            let name = parts.next().unwrap();
            assert!(
                name.len() >= 2 && name.starts_with('"') && name.ends_with('"'),
                "limit name must be a quoted string in {value:?}"
            );
            let name = name[1..name.len() - 1].to_string();
            let params = parts
                .map(|p| {
                    let (k, v) = p
                        .split_once('=')
                        .unwrap_or_else(|| panic!("bad parameter {p:?} in {value:?}"));
                    let v: i64 = v
                        .parse()
                        .unwrap_or_else(|_| panic!("parameter {k} not an integer in {value:?}"));
                    (k.to_string(), v)
                })
                .collect();
            LimitItem { name, params }
        })
        .collect()
}

/// Header value as &str, panicking with a clear message if absent.
pub fn header<'a>(resp: &'a reqwest::Response, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| {
            panic!(
                "response {} lacks header {name}; headers: {:?}",
                resp.status(),
                resp.headers()
            )
        })
        .to_str()
        .unwrap()
}

// ---------------------------------------------------------------------------
// Redis Cluster
// ---------------------------------------------------------------------------

/// Locate `redis-cli` (Debian's `redis-tools`, installed with `redis-server`), or panic with
/// installation instructions.
pub fn redis_cli_path() -> PathBuf {
    find_on_path("redis-cli").unwrap_or_else(|| {
        panic!(
            "redis-cli not found on PATH: install it with `sudo apt-get install redis-tools` \
             (Homebrew's `redis` has it) or run `bash scripts/test.sh`, which installs it"
        )
    })
}

/// A real three-master Redis Cluster on loopback, created with `redis-cli --cluster create`
/// (no replicas: the tests move slots, they do not fail nodes over).
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts three cluster-enabled redis-servers, joins them and waits (up to 20 s) until
    /// every node reports `cluster_state:ok`.
    pub async fn start() -> RedisCluster {
        RedisCluster::start_with_replicas(0).await
    }

    /// Three masters with `replicas` replicas each (`--cluster-replicas`).
    pub async fn start_with_replicas(replicas: usize) -> RedisCluster {
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            nodes.push(
                Redis::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
                .await,
            );
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = Command::new(redis_cli_path())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        for node in &cluster.nodes {
            let port = node.port();
            wait_for(Duration::from_secs(20), "cluster_state:ok", || async move {
                let info = match command_at(port, &["CLUSTER", "INFO"]).await {
                    Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                    Ok(redis::Value::VerbatimString { text, .. }) => text,
                    _ => String::new(),
                };
                info.contains("cluster_state:ok")
            })
            .await;
        }
        cluster
    }

    /// `host:port` of every node, for `store.redis.cluster.nodes`.
    pub fn addrs(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect()
    }

    /// The `store:` section for this cluster.
    pub fn store_yaml(&self) -> String {
        let nodes: Vec<String> = self.addrs().iter().map(|a| format!("\"{a}\"")).collect();
        format!(
            "store:\n  redis:\n    cluster:\n      nodes: [{}]\n    timeout: 1s\n  key_prefix: sluice-test\n",
            nodes.join(", ")
        )
    }

    /// The hash slot of `key`, as the cluster computes it.
    pub async fn slot_of(&self, key: &str) -> u16 {
        match self.nodes[0].cmd(&["CLUSTER", "KEYSLOT", key]).await {
            redis::Value::Int(slot) => slot as u16,
            other => panic!("CLUSTER KEYSLOT answered {other:?}"),
        }
    }

    /// The node id (`CLUSTER MYID`) of node `index`.
    pub async fn node_id(&self, index: usize) -> String {
        match self.nodes[index].cmd(&["CLUSTER", "MYID"]).await {
            redis::Value::BulkString(id) => String::from_utf8(id).expect("a node id"),
            other => panic!("CLUSTER MYID answered {other:?}"),
        }
    }

    /// The index of the node that owns `slot` (the one that answers `CLUSTER COUNTKEYSINSLOT`
    /// without redirecting is not enough: each node knows the whole map, so this asks node 0
    /// for `CLUSTER SLOTS` and matches ports).
    pub async fn owner_of(&self, slot: u16) -> usize {
        let redis::Value::Array(ranges) = self.nodes[0].cmd(&["CLUSTER", "SLOTS"]).await else {
            panic!("CLUSTER SLOTS did not answer an array");
        };
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                continue;
            };
            let (Some(redis::Value::Int(from)), Some(redis::Value::Int(to))) =
                (fields.first(), fields.get(1))
            else {
                continue;
            };
            if (*from..=*to).contains(&i64::from(slot)) {
                if let Some(redis::Value::Array(master)) = fields.get(2) {
                    if let Some(redis::Value::Int(port)) = master.get(1) {
                        return self
                            .nodes
                            .iter()
                            .position(|n| i64::from(n.port()) == *port)
                            .expect("a node of this cluster");
                    }
                }
            }
        }
        panic!("no node owns slot {slot}");
    }

    /// The index of a replica of the master at `master` (`CLUSTER REPLICAS`) whose link to
    /// it is up, waiting up to 15 s for one: a new cluster's replicas take a moment to be
    /// known and to sync.
    pub async fn replica_of(&self, master: usize) -> usize {
        let id = self.node_id(master).await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(index) = self.synced_replica(&id).await {
                return index;
            }
            assert!(
                Instant::now() < deadline,
                "master {master} has no synced replica"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn synced_replica(&self, master_id: &str) -> Option<usize> {
        for (index, node) in self.nodes.iter().enumerate() {
            let info = match command_at(node.port(), &["INFO", "replication"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                Ok(redis::Value::VerbatimString { text, .. }) => text,
                _ => continue,
            };
            if !info.contains("role:slave") || !info.contains("master_link_status:up") {
                continue;
            }
            let nodes = match command_at(node.port(), &["CLUSTER", "MYID"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                _ => continue,
            };
            let line = match command_at(node.port(), &["CLUSTER", "NODES"]).await {
                Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
                Ok(redis::Value::VerbatimString { text, .. }) => text,
                _ => continue,
            };
            // This node's own line: `<id> <addr> myself,slave <master id> ...`
            let mine = line.lines().find(|l| l.starts_with(nodes.as_str()));
            if mine.and_then(|l| l.split_whitespace().nth(3)) == Some(master_id) {
                return Some(index);
            }
        }
        None
    }

    /// Number of keys node `index` holds in `slot`.
    pub async fn keys_in_slot(&self, index: usize, slot: u16) -> i64 {
        match self.nodes[index]
            .cmd(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .await
        {
            redis::Value::Int(n) => n,
            other => panic!("CLUSTER COUNTKEYSINSLOT answered {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// Exactness from the client's side
// ---------------------------------------------------------------------------

/// The shortest time that surely holds the decisions of `n` admissions, each known only to
/// have been decided between its request's sending and its answer: over every choice of `n`,
/// the latest answer less the earliest sending. `None` with fewer than `n`.
pub fn tightest_admissions(admissions: &[(Instant, Instant)], n: usize) -> Option<Duration> {
    admissions
        .iter()
        .filter_map(|&(first_sent, _)| {
            // With the earliest sending fixed, the best choice is the `n` earliest answers
            // among the requests sent no earlier.
            let mut answers: Vec<Instant> = admissions
                .iter()
                .filter(|&&(sent, _)| sent >= first_sent)
                .map(|&(_, answered)| answered)
                .collect();
            answers.sort();
            answers.get(n - 1).map(|&last| last - first_sent)
        })
        .min()
}
