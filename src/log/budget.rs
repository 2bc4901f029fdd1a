//! A rate budget for one kind of per-request log line (the access log, "upstream failed"):
//! lines pass at a steady rate with a burst, and the rest are counted as suppressed, so that
//! the volume of such lines is bounded by time, never by traffic. A summary of what was
//! suppressed is logged by the reporter (`super::RequestLog::report`).
//!
//! The bucket is kept as one number in one atomic (the theoretical arrival time of the next
//! line, as the limiter's token bucket keeps it), so
//! taking a line is a load and a compare-and-swap: no lock on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct LineBudget {
    epoch: Instant,
    /// When the bucket is empty again if no more lines pass, in µs since `epoch`.
    tat_micros: AtomicU64,
    /// Time one line costs, µs.
    interval_micros: u64,
    /// How far ahead of now `tat_micros` may run: the burst, µs.
    tolerance_micros: u64,
    suppressed: AtomicU64,
}

impl LineBudget {
    /// `per_second` lines a second on average, `burst` at once (both at least 1).
    pub fn new(per_second: u32, burst: u32) -> LineBudget {
        let interval_micros = 1_000_000 / u64::from(per_second.max(1));
        LineBudget {
            epoch: Instant::now(),
            tat_micros: AtomicU64::new(0),
            interval_micros,
            tolerance_micros: interval_micros * u64::from(burst.max(1)),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be written now; if not, it is counted as suppressed.
    pub fn allow(&self) -> bool {
        self.allow_at(self.epoch.elapsed())
    }

    fn allow_at(&self, now: Duration) -> bool {
        let now = u64::try_from(now.as_micros()).unwrap_or(u64::MAX);
        let mut tat = self.tat_micros.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now) + self.interval_micros;
            if next - now > self.tolerance_micros {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            match self.tat_micros.compare_exchange_weak(
                tat,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(current) => tat = current,
            }
        }
    }

    /// Lines suppressed since the last call.
    pub fn take_suppressed(&self) -> u64 {
        self.suppressed.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(budget: &LineBudget, at_ms: u64, tries: u32) -> u32 {
        (0..tries)
            .filter(|_| budget.allow_at(Duration::from_millis(at_ms)))
            .count() as u32
    }

    #[test]
    fn the_burst_passes_then_the_rate() {
        let budget = LineBudget::new(10, 20);
        assert_eq!(allowed(&budget, 1000, 1000), 20);
        assert_eq!(budget.take_suppressed(), 980);
        // 10 a second: half a second later, 5 more; the counter was reset by the take.
        assert_eq!(allowed(&budget, 1500, 1000), 5);
        assert_eq!(budget.take_suppressed(), 995);
        // Ten quiet seconds refill the burst, not more.
        assert_eq!(allowed(&budget, 11_500, 1000), 20);
    }

    #[test]
    fn lines_over_a_long_flood_are_bounded_by_time() {
        let budget = LineBudget::new(10, 20);
        let mut passed = 0;
        for ms in 0..60_000u64 {
            passed += allowed(&budget, ms, 10);
        }
        // 60 s at 10 a second, plus the burst.
        assert!((600..=620).contains(&passed), "{passed}");
        assert_eq!(u64::from(passed) + budget.take_suppressed(), 600_000);
    }
}
