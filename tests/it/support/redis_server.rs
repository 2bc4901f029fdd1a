//! A real standalone `redis-server` child process on a free loopback port, the commands the
//! tests send it, `MONITOR` to see every command sluice sends, and the two stores (Redis or
//! in-process) a limit test runs against.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

use super::{find_on_path, free_port};

/// How long a concurrency limit's epoch key lives after its last admission (ms).
const EPOCH_TTL_MS: i64 = 86_400_000;

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

    /// Every command Redis ran since start or the last `CONFIG RESETSTAT`, those run inside
    /// scripts included (`INFO commandstats`, all commands), less the `INFO` and `CONFIG`
    /// calls a test makes to read and reset them.
    pub async fn commands_total(&self) -> u64 {
        let value = command_with_password(
            self.port,
            self.password.as_deref(),
            &["INFO", "commandstats"],
        )
        .await
        .unwrap_or_else(|e| panic!("INFO commandstats failed: {e}"));
        let info = match value {
            redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            other => panic!("INFO answered {other:?}"),
        };
        info.lines()
            .filter_map(|line| line.strip_prefix("cmdstat_"))
            .filter(|line| !line.starts_with("info:") && !line.starts_with("config|"))
            .filter_map(|line| line.split_once(":calls="))
            .map(|(_, rest)| {
                rest.split(',')
                    .next()
                    .and_then(|calls| calls.parse::<u64>().ok())
                    .expect("a call count")
            })
            .sum()
    }

    /// Starts watching every command clients send to this server (`MONITOR`), until
    /// [`Monitor::commands`]. Unlike per-command statistics, it sees commands no test thought
    /// to name, and unlike `total_commands_processed`, it tells a client's command from the
    /// ones a script ran inside (`[0 lua]`).
    pub async fn monitor(&self) -> Monitor {
        // The store event channel's subscribers (src/limiter/redis/events.rs) ping every
        // 500 ms: not decisions, so their commands are left out.
        let subscribers = self.subscriber_addresses().await;
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
                let subscriber = subscribers
                    .iter()
                    .any(|addr| source.ends_with(addr.as_str()));
                if !source.ends_with(" lua") && !subscriber {
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

    /// The addresses of the clients subscribed to a channel now (`CLIENT LIST`, flag `P`).
    pub async fn subscriber_addresses(&self) -> Vec<String> {
        let list = match self.cmd(&["CLIENT", "LIST"]).await {
            redis::Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            other => panic!("CLIENT LIST answered {other:?}"),
        };
        list.lines()
            .filter(|line| {
                line.split(' ')
                    .any(|field| field.starts_with("flags=") && field.contains('P'))
            })
            .filter_map(|line| {
                line.split(' ')
                    .find_map(|field| field.strip_prefix("addr="))
            })
            .map(str::to_owned)
            .collect()
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

    /// Asserts that every key in db 0 (read with `SCAN`, so none is missed) expires on its
    /// own: `PTTL` above 0 and at most `longest` (the longest window or period the test's
    /// limits keep a key for, with its margin) and the harness's lateness bound
    /// ([`REDIS_TIMEOUT`]: the exact logs keep an entry that much past its window). Returns
    /// how many keys it checked, so that a test can also assert it looked at something.
    pub async fn assert_every_key_expires(&self, longest: Duration) -> usize {
        let ttls = self.key_ttls().await;
        let most = i64::try_from((longest + REDIS_TIMEOUT).as_millis()).unwrap_or(i64::MAX);
        let wrong: Vec<String> = ttls
            .iter()
            // -2: the key expired between SCAN and PTTL, which is what the check wants.
            .filter(|(key, pttl)| {
                // A concurrency limit's epoch (one per limit) is kept a day
                // (src/limiter/redis/epochs.rs).
                let most = if key.ends_with(":concurrency:epoch") {
                    EPOCH_TTL_MS
                } else {
                    most
                };
                *pttl != -2 && !(1..=most).contains(pttl)
            })
            .map(|(key, pttl)| format!("{key}: PTTL {pttl} ms"))
            .collect();
        assert!(
            wrong.is_empty(),
            "redis on port {}: {} of {} keys do not expire within {longest:?}: {wrong:?}",
            self.port,
            wrong.len(),
            ttls.len()
        );
        ttls.len()
    }

    /// Every key in db 0, read with `SCAN` to its end, with its `PTTL` in milliseconds (-1:
    /// no expiry; -2: gone since the scan).
    pub async fn key_ttls(&self) -> Vec<(String, i64)> {
        let client = redis::Client::open(self.url()).expect("redis client");
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to test redis");
        let mut cursor: u64 = 0;
        let mut keys: Vec<String> = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut con)
                .await
                .expect("SCAN");
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        // SCAN may return a key twice.
        keys.sort();
        keys.dedup();
        let mut ttls = Vec::with_capacity(keys.len());
        for key in keys {
            let pttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut con)
                .await
                .expect("PTTL");
            ttls.push((key, pttl));
        }
        ttls
    }

    /// Kill redis-server now (for tests that need the store gone).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Redis {
    /// The keys of db 0 that have no expiry (`PTTL` -1), read with a blocking connection;
    /// empty when the server is not running or does not answer.
    fn keys_without_expiry(&self) -> Vec<String> {
        if self.child.is_none() {
            return Vec::new();
        }
        let Ok(client) = redis::Client::open(self.url()) else {
            return Vec::new();
        };
        let Ok(mut con) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
            return Vec::new();
        };
        let _ = con.set_read_timeout(Some(Duration::from_secs(2)));
        let mut cursor: u64 = 0;
        let mut immortal = Vec::new();
        loop {
            let Ok((next, batch)) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query::<(u64, Vec<String>)>(&mut con)
            else {
                return immortal;
            };
            for key in batch {
                if redis::cmd("PTTL").arg(&key).query::<i64>(&mut con) == Ok(-1) {
                    immortal.push(key);
                }
            }
            if next == 0 {
                return immortal;
            }
            cursor = next;
        }
    }
}

/// Every test that used a Redis ends with the check that no key sluice wrote outlives its
/// window: a key without an expiry fails the test that left it (unless it already failed).
impl Drop for Redis {
    fn drop(&mut self) {
        let immortal = if std::thread::panicking() {
            Vec::new()
        } else {
            self.keys_without_expiry()
        };
        self.stop();
        assert!(
            immortal.is_empty(),
            "redis on port {}: keys left without an expiry: {immortal:?}",
            self.port
        );
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

/// The text of an `INFO` answer.
pub(super) fn info_text(answer: redis::RedisResult<redis::Value>) -> Option<String> {
    match answer.ok()? {
        redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(&bytes).into_owned()),
        redis::Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

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

/// The harness's Redis timeout ([`redis_store_yaml`], [`super::Policy::store_redis`]). It is
/// also the store's lateness bound: the exact logs (sliding_log, weighted_log) count an
/// admission this much past the time it is forwarded at (`decide.lua`'s ARGV[2]), so their
/// waits and resets are this much longer than the window alone.
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(500);

impl Store {
    /// How much later than its window an exact log forgets an admission: the Redis timeout,
    /// nothing in process (which forwards as it decides).
    pub fn lateness(&self) -> Duration {
        match self.redis {
            Some(_) => REDIS_TIMEOUT,
            None => Duration::ZERO,
        }
    }

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
        "store:\n  redis:\n    url: {url}\n    timeout: {}ms\n    pool_size: 8\n  key_prefix: sluice-test\n",
        REDIS_TIMEOUT.as_millis()
    )
}
