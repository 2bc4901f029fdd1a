//! A circuit breaker in front of Redis, so that a dead or hung Redis costs no request its
//! timeout.
//!
//! Closed: decisions go to Redis; consecutive failures are counted, and a success resets the
//! count. After `FAILURES_TO_OPEN` in a row, spread over at least the store timeout, the
//! breaker opens (a burst of timeouts at one instant is one connection stalled behind a lost
//! segment, whose calls all time out together while the other connections answer: not a
//! store that is gone): decisions fail at once, without
//! touching Redis, and the caller applies the route's `on_store_error`. While open, one
//! background probe pings Redis every `PROBE_EVERY`; the first answer closes the breaker, so
//! decisions return to Redis within about that interval (plus one timeout) of it answering.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use prometheus::{IntCounter, IntGauge};

/// Consecutive failed calls that open the breaker.
pub const FAILURES_TO_OPEN: u32 = 5;
/// How often an open breaker asks Redis whether it answers again.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// What the breaker reports to the metrics.
pub struct BreakerMetrics {
    /// `sluice_store_fallback_active`: 1 while open.
    pub open: IntGauge,
    /// `sluice_store_breaker_transitions_total{to="open"}`.
    pub opened: IntCounter,
    /// `sluice_store_breaker_transitions_total{to="closed"}`.
    pub closed: IntCounter,
}

pub struct Breaker {
    open: AtomicBool,
    failures: AtomicU32,
    /// When the current run of failures began (microseconds since `origin`).
    streak_began: AtomicU64,
    /// How long a run of failures must last to open the breaker: the store timeout.
    spread: Duration,
    origin: Instant,
    metrics: BreakerMetrics,
}

impl Breaker {
    /// A breaker that opens after failures spread over at least `spread` (the store timeout).
    pub fn new(metrics: BreakerMetrics, spread: Duration) -> Breaker {
        Breaker {
            open: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            streak_began: AtomicU64::new(0),
            spread,
            origin: Instant::now(),
            metrics,
        }
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether calls must not go to the store now.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Counts a failed call; returns true when this failure opened the breaker (the caller
    /// then starts the probe).
    pub fn record_failure(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let now = self.now_us();
        if failures == 1 {
            self.streak_began.store(now, Ordering::Relaxed);
        }
        let lasted = now.saturating_sub(self.streak_began.load(Ordering::Relaxed));
        if failures < FAILURES_TO_OPEN
            || lasted < u64::try_from(self.spread.as_micros()).unwrap_or(u64::MAX)
        {
            return false;
        }
        let opened = self
            .open
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if opened {
            self.metrics.open.set(1);
            self.metrics.opened.inc();
            tracing::warn!(
                failures,
                "the store failed {FAILURES_TO_OPEN} times in a row or more, for at least its timeout: deciding without it until it answers again"
            );
        }
        opened
    }

    fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self
            .open
            .compare_exchange(true, false, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.metrics.open.set(0);
            self.metrics.closed.inc();
            tracing::info!("the store answers again: deciding with it");
        }
    }

    /// Probes with `ping` every `PROBE_EVERY` until it succeeds, then closes the breaker.
    pub async fn probe<F, Fut>(self: Arc<Self>, ping: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            if ping().await {
                self.close();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Arc<Breaker> {
        breaker_spread(Duration::ZERO)
    }

    fn breaker_spread(spread: Duration) -> Arc<Breaker> {
        Arc::new(Breaker::new(
            BreakerMetrics {
                open: IntGauge::new("open", "open").unwrap(),
                opened: IntCounter::new("opened", "opened").unwrap(),
                closed: IntCounter::new("closed", "closed").unwrap(),
            },
            spread,
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_failures_at_one_instant_does_not_open_it() {
        let b = breaker_spread(Duration::from_millis(50));
        for _ in 0..3 * FAILURES_TO_OPEN {
            assert!(!b.record_failure(), "one stalled connection's calls");
        }
        tokio::time::advance(Duration::from_millis(30)).await;
        assert!(!b.record_failure(), "30 ms of failures: not yet");
        tokio::time::advance(Duration::from_millis(20)).await;
        assert!(b.record_failure(), "failing for the whole timeout: gone");
        b.close();
        tokio::time::advance(Duration::from_millis(100)).await;
        for _ in 0..FAILURES_TO_OPEN - 1 {
            assert!(!b.record_failure());
        }
        b.record_success();
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(!b.record_failure(), "a success began a new run");
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_only() {
        let b = breaker();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            assert!(!b.record_failure());
        }
        b.record_success();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            assert!(!b.record_failure());
        }
        assert!(!b.is_open());
        assert!(b.record_failure(), "the fifth in a row opens it");
        assert!(b.is_open());
        assert!(!b.record_failure(), "opened once");
        assert_eq!(b.metrics.open.get(), 1);
        assert_eq!(b.metrics.opened.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_probe_closes_it_when_the_store_answers() {
        let b = breaker();
        for _ in 0..FAILURES_TO_OPEN {
            b.record_failure();
        }
        let answers = Arc::new(AtomicU32::new(0));
        let probe = {
            let answers = Arc::clone(&answers);
            tokio::spawn(Arc::clone(&b).probe(move || {
                let answers = Arc::clone(&answers);
                async move { answers.fetch_add(1, Ordering::Relaxed) >= 2 }
            }))
        };
        probe.await.unwrap();
        assert!(!b.is_open());
        assert_eq!(
            answers.load(Ordering::Relaxed),
            3,
            "closed at the first answer"
        );
        assert_eq!(b.metrics.closed.get(), 1);
        assert_eq!(b.metrics.open.get(), 0);
    }
}
