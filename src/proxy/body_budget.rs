//! The bound on memory pinned by request bodies read whole. A route with a token budget reads
//! its body before deciding, and a client that sends most of a body and never finishes holds
//! those bytes until `body_timeout`: two HTTP/2 connections of 150 such streams each held
//! 300 MiB. Two bounds close that: one process-wide budget of bytes held (`server.
//! token_body_budget`), taken as bytes arrive (or up front, for a declared length), given back
//! when the bytes are dropped or forwarded; and a bound on how many streams of one HTTP/2
//! connection read a body whole at once (`server.token_bodies_per_connection`). Either one
//! exhausted refuses the request with 503 and `Retry-After`, counted by reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes held by bodies read whole, across the process, and the most that may be.
pub struct BodyBudget {
    held: AtomicU64,
    limit: u64,
    per_connection: usize,
}

impl BodyBudget {
    pub fn new(limit: u64, per_connection: u32) -> Arc<BodyBudget> {
        Arc::new(BodyBudget {
            held: AtomicU64::new(0),
            limit,
            per_connection: per_connection as usize,
        })
    }

    /// The most bytes held at once.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The most streams of one connection reading a body whole at once.
    pub fn per_connection(&self) -> usize {
        self.per_connection
    }

    /// An empty share of the budget, grown as a body's bytes arrive.
    pub fn share(self: &Arc<Self>) -> Held {
        Held {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }

    /// Takes `bytes` more if they fit under the limit.
    fn take(&self, bytes: u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }
}

/// One body's share of the budget: given back when dropped (the body's bytes forwarded, or
/// the request refused).
pub struct Held {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl Held {
    /// Grows this share to `total` bytes; false, leaving it as it was, when the budget has no
    /// room for the difference.
    pub fn grow_to(&mut self, total: u64) -> bool {
        let more = total.saturating_sub(self.bytes);
        if more == 0 {
            return true;
        }
        if !self.budget.take(more) {
            return false;
        }
        self.bytes = total;
        true
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_bounded_and_given_back() {
        let budget = BodyBudget::new(100, 2);
        let mut a = budget.share();
        assert!(a.grow_to(60));
        let mut b = budget.share();
        assert!(!b.grow_to(41), "60 + 41 is over 100");
        assert!(b.grow_to(40));
        assert!(a.grow_to(60), "no more asked");
        drop(a);
        assert!(b.grow_to(100), "a's 60 came back");
        drop(b);
        assert_eq!(budget.held.load(Ordering::Acquire), 0);
    }
}
