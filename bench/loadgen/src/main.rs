//! An open-loop HTTP/1.1 load generator for sluice's benchmark (the *latency* scenario).
//!
//! wrk is closed-loop: each connection sends its next request only when the previous answer
//! has arrived, so a slow server is sent less and its slow moments are under-counted
//! ("coordinated omission"). This generator sends at a fixed rate whatever the server does:
//! request `i` is due at `start + i / rate`, and its latency is measured from that due time to
//! the end of its response body. A request that waits for a free connection, or is sent late
//! because the server holds every connection, is charged that wait.
//!
//! A dedicated OS thread keeps the schedule (nanosleep is precise to tens of microseconds,
//! where tokio's timer wheel has a 1 ms tick) and hands each due time to a single-threaded
//! tokio runtime, which sends the request over a pool of kept-alive connections. Each request
//! carries an `x-api-key` drawn at random from `--keys` keys (`k1` .. `kN`, the names of wrk's
//! *admit* scenario), so a limiting proxy decides every request and admits it.
//!
//! Output: one line of JSON on stdout (see `Report::json`). Usage:
//!
//! ```text
//! sluice-loadgen --url http://127.0.0.1:8080/ --rate 5000 --duration 5 [--connections 32]
//!                [--keys 10000] [--timeout 2]
//! ```

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};

/// Requests allowed to wait for a connection at once; past it the server is hopelessly
/// saturated and further requests are counted as `dropped` instead of queued.
const MAX_WAITING: usize = 100_000;

type Sender = SendRequest<Empty<Bytes>>;

mod stream;

fn main() -> ExitCode {
    let mut argv = std::env::args().skip(1).peekable();
    if let Some(mode) = argv
        .peek()
        .filter(|m| *m == "serve-sse" || *m == "stream")
        .cloned()
    {
        argv.next();
        return streamed(&mode, argv);
    }
    let args = match Args::parse(argv) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("sluice-loadgen: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(args)) {
        Ok(report) => {
            println!("{}", report.json());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("sluice-loadgen: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The streamed-token scenario's two modes (see `stream`).
fn streamed(mode: &str, mut args: impl Iterator<Item = String>) -> ExitCode {
    let mut flags = BTreeMap::new();
    while let Some(flag) = args.next() {
        match args.next() {
            Some(value) => {
                flags.insert(flag, value);
            }
            None => {
                eprintln!("sluice-loadgen: {flag} needs a value");
                return ExitCode::from(2);
            }
        }
    }
    let get = |name: &str, default: u64| -> Result<u64, String> {
        flags.get(name).map_or(Ok(default), |v| number(name, v))
    };
    let result = (|| -> Result<Option<String>, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        if mode == "serve-sse" {
            let settings = stream::Serve {
                port: u16::try_from(get("--port", 0)?).map_err(|e| e.to_string())?,
                events: get("--events", 200)? as u32,
                event_bytes: get("--event-bytes", 64)? as usize,
                interval: Duration::from_micros(get("--interval-us", 1000)?),
                usage: get("--usage", 300)?,
            };
            runtime.block_on(stream::serve(settings))?;
            return Ok(None);
        }
        let url = flags.get("--url").ok_or("--url is required")?;
        let rest = url
            .strip_prefix("http://")
            .ok_or("--url must start with http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
            None => (rest.to_string(), "/".to_string()),
        };
        let client = stream::Client {
            authority,
            path,
            streams: get("--streams", 100)? as u32,
            concurrency: get("--concurrency", 10)?.max(1) as u32,
            max_tokens: get("--max-tokens", 1000)? as u32,
        };
        runtime.block_on(stream::run(client)).map(Some)
    })();
    match result {
        Ok(Some(line)) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("sluice-loadgen: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The command line, checked.
struct Args {
    /// `host:port` to connect to, also sent as `Host`.
    authority: String,
    path: String,
    rate: f64,
    duration: Duration,
    connections: usize,
    keys: u32,
    timeout: Duration,
}

impl Args {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut url = None;
        let (mut rate, mut duration, mut connections, mut keys, mut timeout) =
            (None, 5.0, 32usize, 10_000u32, 2.0);
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--url" => url = Some(value()?),
                "--rate" => rate = Some(number(&flag, &value()?)?),
                "--duration" => duration = number(&flag, &value()?)?,
                "--connections" => connections = number::<usize>(&flag, &value()?)?,
                "--keys" => keys = number(&flag, &value()?)?,
                "--timeout" => timeout = number(&flag, &value()?)?,
                _ => return Err(format!("unknown argument `{flag}`")),
            }
        }
        let url = url.ok_or("--url is required")?;
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("--url must start with http://, got `{url}`"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
            None => (rest.to_string(), "/".to_string()),
        };
        let rate: f64 = rate.ok_or("--rate is required")?;
        if !(rate > 0.0 && duration > 0.0 && timeout > 0.0 && connections > 0 && keys > 0) {
            return Err("--rate, --duration, --timeout, --connections, --keys must be > 0".into());
        }
        Ok(Args {
            authority,
            path,
            rate,
            duration: Duration::from_secs_f64(duration),
            connections,
            keys,
            timeout: Duration::from_secs_f64(timeout),
        })
    }
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: expected a number, got `{value}`"))
}

/// What was measured, merged from every request.
#[derive(Default)]
struct Report {
    scheduled: u64,
    dropped: u64,
    errors: u64,
    unfinished: u64,
    statuses: BTreeMap<u16, u64>,
    /// Latency of each completed request from its due time, in microseconds.
    latencies_us: Vec<u32>,
    /// How late the generator itself handed each request over, in microseconds: a health
    /// check of the generator, not a property of the server.
    lag_us: Vec<u32>,
    elapsed: Duration,
}

impl Report {
    fn json(mut self) -> String {
        self.latencies_us.sort_unstable();
        self.lag_us.sort_unstable();
        let completed = self.latencies_us.len() as u64;
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .map(|(status, n)| format!("\"{status}\":{n}"))
            .collect();
        let l = &self.latencies_us;
        format!(
            concat!(
                "{{\"scheduled\":{},\"completed\":{},\"errors\":{},\"unfinished\":{},",
                "\"dropped\":{},\"elapsed_s\":{:.3},\"rate\":{:.1},\"statuses\":{{{}}},",
                "\"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},",
                "\"lag_p50_us\":{},\"lag_p99_us\":{}}}"
            ),
            self.scheduled,
            completed,
            self.errors,
            self.unfinished,
            self.dropped,
            self.elapsed.as_secs_f64(),
            completed as f64 / self.elapsed.as_secs_f64().max(1e-9),
            statuses.join(","),
            percentile(l, 50.0),
            percentile(l, 90.0),
            percentile(l, 99.0),
            percentile(l, 99.9),
            l.last().copied().unwrap_or(0),
            percentile(&self.lag_us, 50.0),
            percentile(&self.lag_us, 99.0),
        )
    }
}

/// Nearest-rank percentile of sorted values; 0 when there are none.
fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Kept-alive connections shared by the request tasks. The semaphore (FIFO) hands out the
/// right to use one in due-time order; a slot holds `None` after its connection failed, and
/// the next user opens a new one.
struct Pool {
    authority: String,
    permits: Semaphore,
    idle: Mutex<Vec<Option<Sender>>>,
}

impl Pool {
    async fn connect(&self) -> Result<Sender, String> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.authority))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        Ok(sender)
    }
}

/// Per-run state the request tasks write into.
struct Shared {
    args: Args,
    pool: Pool,
    report: Mutex<Report>,
    in_flight: AtomicUsize,
}

async fn run(args: Args) -> Result<Report, String> {
    let pool = Pool {
        authority: args.authority.clone(),
        permits: Semaphore::new(args.connections),
        idle: Mutex::new(Vec::with_capacity(args.connections)),
    };
    for _ in 0..args.connections {
        let sender = pool.connect().await?;
        pool.idle.lock().unwrap().push(Some(sender));
    }
    let total = (args.rate * args.duration.as_secs_f64()).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let shared = Arc::new(Shared {
        args,
        pool,
        report: Mutex::new(Report::default()),
        in_flight: AtomicUsize::new(0),
    });

    let start = Instant::now() + Duration::from_millis(20);
    let (due_tx, mut due_rx) = mpsc::unbounded_channel();
    let clock = std::thread::spawn(move || keep_schedule(start, interval, total, due_tx));

    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id()));
    while let Some(due) = due_rx.recv().await {
        let lag = Instant::now().saturating_duration_since(due);
        let mut report = shared.report.lock().unwrap();
        report.scheduled += 1;
        report.lag_us.push(micros(lag));
        if shared.in_flight.load(Ordering::Relaxed) >= MAX_WAITING {
            report.dropped += 1;
            continue;
        }
        drop(report);
        shared.in_flight.fetch_add(1, Ordering::Relaxed);
        let key = 1 + (rng.next() % u64::from(shared.args.keys)) as u32;
        tokio::spawn(send_one(shared.clone(), due, key));
    }
    clock.join().expect("the schedule thread");

    // Let requests still in flight finish, for at most one timeout.
    let drain_until = Instant::now() + shared.args.timeout;
    while shared.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < drain_until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut report = std::mem::take(&mut *shared.report.lock().unwrap());
    report.unfinished = shared.in_flight.load(Ordering::Acquire) as u64;
    // The rate is over the scheduled period, not the drain after it.
    report.elapsed = shared.args.duration;
    Ok(report)
}

/// The schedule: hands request `i` to the runtime at `start + i * interval`, sleeping in
/// between; when it has fallen behind it hands over every overdue request at once.
fn keep_schedule(
    start: Instant,
    interval: Duration,
    total: u64,
    due_tx: mpsc::UnboundedSender<Instant>,
) {
    for index in 0..total {
        let due = start + interval.mul_f64(index as f64);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if due_tx.send(due).is_err() {
            return;
        }
    }
}

/// Sends one request when a connection is free and records its outcome.
async fn send_one(shared: Arc<Shared>, due: Instant, key: u32) {
    let outcome = {
        let _permit = shared.pool.permits.acquire().await.expect("never closed");
        let slot = shared
            .pool
            .idle
            .lock()
            .unwrap()
            .pop()
            .expect("a slot per permit");
        let (outcome, slot) = exchange(&shared, slot, key).await;
        shared.pool.idle.lock().unwrap().push(slot);
        outcome
    };
    let finished = Instant::now();
    {
        let mut report = shared.report.lock().unwrap();
        match outcome {
            Some(status) => {
                *report.statuses.entry(status).or_default() += 1;
                report.latencies_us.push(micros(finished - due));
            }
            None => report.errors += 1,
        }
    }
    shared.in_flight.fetch_sub(1, Ordering::AcqRel);
}

/// One request and its whole response body on the slot's connection (opened first if the
/// slot is empty). Returns the status, or `None` on any failure or timeout, and what the slot
/// holds afterwards: the connection if it can be used again.
async fn exchange(
    shared: &Shared,
    slot: Option<Sender>,
    key: u32,
) -> (Option<u16>, Option<Sender>) {
    let attempt = async {
        // A kept-alive connection the server has closed since is replaced, once.
        let reusable = match slot {
            Some(mut sender) if !sender.is_closed() => sender.ready().await.ok().map(|_| sender),
            _ => None,
        };
        let mut sender = match reusable {
            Some(sender) => sender,
            None => {
                let mut sender = shared.pool.connect().await.ok()?;
                sender.ready().await.ok()?;
                sender
            }
        };
        let request = Request::get(shared.args.path.as_str())
            .header(hyper::header::HOST, shared.args.authority.as_str())
            .header("x-api-key", format!("k{key}"))
            .body(Empty::<Bytes>::new())
            .expect("a valid request");
        let response = sender.send_request(request).await.ok()?;
        let status = response.status().as_u16();
        response.into_body().collect().await.ok()?;
        Some((status, sender))
    };
    match tokio::time::timeout(shared.args.timeout, attempt).await {
        Ok(Some((status, sender))) => (Some(status), Some(sender)),
        _ => (None, None),
    }
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}

/// A small, fast PRNG (xorshift64*) for choosing keys; quality far beyond what spreading
/// requests over keys needs, and no dependency.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}
