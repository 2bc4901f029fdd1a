//! Logging that cannot block a request or flood the disk.
//!
//! - `writer`: every line goes through a bounded queue written to standard error by a thread
//!   of its own; a full queue drops the line and counts it (`sluice_log_lines_dropped_total`).
//! - `summary`: rejections are logged once per identity, then counted and summarised in one
//!   line per [`REPORT_INTERVAL`].
//! - `budget`: every other per-request line (the access log, "upstream failed", "store
//!   failed") has a rate budget; what it suppresses is counted and reported once an interval.
//!
//! So log volume under attack is bounded by time, and the metrics keep the exact counts.

mod budget;
mod summary;
mod writer;

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

pub use self::budget::LineBudget;
pub use self::summary::{Rejections, Subject, MAX_FOLLOWED, MAX_TRACKED};
use self::writer::DropCount;
pub use self::writer::Flusher;

/// A short hash of a store key, to name the identity it counts in a log line without writing
/// it: API keys and cookies are secrets, and addresses are personal data.
pub fn key_hash(key: &str) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write as _;
    let digest = Sha256::digest(key.as_bytes());
    let mut hex = String::with_capacity(16);
    for byte in &digest[..8] {
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// How each line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// For people: one line of text per event.
    Text,
    /// For log pipelines: one JSON object per line.
    Json,
}

/// Lines the queue holds while standard error is slow; past that they are dropped. A line is
/// a few hundred bytes, so the queue holds at most a few MB.
pub const QUEUE_LINES: usize = 8192;
/// The environment variable that sets another queue size (at least 1 line).
pub const QUEUE_LINES_ENV: &str = "SLUICE_LOG_QUEUE_LINES";
/// How often rejection summaries and counts of suppressed lines are written.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(10);
/// The most a shutdown waits for the queue to be written out.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// The drop count of the queue in use, once `init` has set it up.
static DROPPED: OnceLock<DropCount> = OnceLock::new();

/// Lines dropped since logging started: the queue was full, or standard error refused them.
pub fn lines_dropped() -> u64 {
    DROPPED.get().map_or(0, DropCount::get)
}

/// Logs to standard error through the queue, at the level `RUST_LOG` sets (default `info`).
/// The returned `Flusher` writes out what is queued, within a bound, before the process ends.
pub fn init(format: Format) -> std::io::Result<Flusher> {
    let capacity = std::env::var(QUEUE_LINES_ENV)
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok())
        .unwrap_or(QUEUE_LINES);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (queue, flusher, dropped) = writer::start(capacity, std::io::stderr())?;
    let _ = DROPPED.set(dropped);
    install(format, queue, ansi);
    Ok(flusher)
}

/// Logs straight to standard error: for the short commands (`check`, `explain`), which serve
/// no requests and whose lines must come out in order with their answer.
pub fn init_direct(format: Format) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    install(format, std::io::stderr, ansi);
}

fn install<W>(format: Format, writer: W, ansi: bool)
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        Format::Text => builder.with_ansi(ansi).init(),
        Format::Json => builder.json().init(),
    }
}

/// The per-request lines' bounds: rejections summarised, the others rate-limited. Shared by
/// the gateway's requests and a reporter thread that writes the summaries.
pub struct RequestLog {
    pub rejections: Rejections,
    /// `sluice::access` at debug: 1000 lines a second, 1000 at once (all of a small service's
    /// traffic; about 200 kB/s at most under a flood).
    pub access: LineBudget,
    /// "upstream failed" at warn: 10 lines a second, 20 at once.
    pub upstream_failed: LineBudget,
    /// "store failed" at debug: 10 lines a second, 20 at once.
    pub store_failed: LineBudget,
}

impl RequestLog {
    /// A new log with its reporter thread, which writes a report every [`REPORT_INTERVAL`]
    /// and ends once the log is dropped.
    pub fn start() -> Arc<RequestLog> {
        let log = Arc::new(RequestLog {
            rejections: Rejections::new(),
            access: LineBudget::new(1000, 1000),
            upstream_failed: LineBudget::new(10, 20),
            store_failed: LineBudget::new(10, 20),
        });
        let weak = Arc::downgrade(&log);
        let spawned = std::thread::Builder::new()
            .name("sluice-log-report".to_owned())
            .spawn(move || report_every_interval(&weak));
        if let Err(err) = spawned {
            tracing::warn!(error = %err, "cannot start the log reporter: rejection summaries are written only at shutdown");
        }
        log
    }

    /// Writes the lines due now: each followed identity's repeated rejections, the other
    /// identities' together, and how many lines each budget suppressed. Also called at
    /// shutdown, so no count is lost.
    pub fn report(&self) {
        let report = self.rejections.report();
        for repeats in &report.repeats {
            tracing::info!(
                target: "sluice::rejected",
                route = %repeats.subject.route,
                limit = %repeats.subject.limit,
                identity = %repeats.subject.identity,
                count = repeats.count,
                seconds = repeats.period.as_secs(),
                "rejected again"
            );
        }
        if let Some(others) = report.others {
            tracing::info!(
                target: "sluice::rejected",
                identities = others.identities,
                requests = others.requests,
                untracked_requests = others.untracked_requests,
                "… and {} more identities rejected ({} requests)",
                others.identities,
                others.requests
            );
        }
        let seconds = REPORT_INTERVAL.as_secs();
        let suppressed = self.access.take_suppressed();
        if suppressed > 0 {
            tracing::debug!(target: "sluice::access", suppressed, seconds, "access log lines suppressed");
        }
        let suppressed = self.upstream_failed.take_suppressed();
        if suppressed > 0 {
            tracing::warn!(target: "sluice::proxy", suppressed, seconds, "more \"upstream failed\" lines suppressed");
        }
        let suppressed = self.store_failed.take_suppressed();
        if suppressed > 0 {
            tracing::debug!(target: "sluice::proxy", suppressed, seconds, "more \"store failed\" lines suppressed");
        }
    }
}

fn report_every_interval(log: &Weak<RequestLog>) {
    loop {
        std::thread::sleep(REPORT_INTERVAL);
        match log.upgrade() {
            Some(log) => log.report(),
            None => return,
        }
    }
}
