//! Whether Redis forgot a concurrency limit's leases (restarted without persistence, or failed
//! over to a replica that had not seen them): the flag each concurrency check carries in its
//! `burst` slot, which `concurrency.lua` reads.
//!
//! Beside a limit's keys, its `epoch` key says since when the store has known the limit. A
//! store that comes back empty has lost it with the leases, so the first admission after that
//! writes it as "now plus the time within which every live instance renews, and so writes
//! back, its leases" and the limit admits nothing until then: the leases still held by live
//! requests count before any new one is admitted. A process that uses a limit for the first
//! time cannot tell a store that forgot from one that never knew the limit (a fresh
//! deployment), so its checks only mark the limit as known until one of them has been answered
//! (checks sent at once may reach Redis in any order: one that holds back must follow a mark
//! already done); on a Cluster there is no
//! epoch (a script may touch only its own slot's keys), and a failover's forgotten leases
//! count again at the holders' next renewal. See docs/src/guides/concurrency.md.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};

use super::super::{Algorithm, Check};

/// No epoch: a cluster, or not a concurrency check.
const NONE: u64 = 0;
/// Hold the limit back when its epoch is missing.
const HOLD_BACK: u64 = 1;
/// Before this process has had an answer for the limit: mark it known if it is not.
const MARK: u64 = 2;

/// Most limits remembered; past it the memory starts again (each limit's next check only
/// marks it known, as at start). Bounded by the policies' limits in practice.
const MAX_LIMITS: usize = 4096;

/// The concurrency limits this process has had a decision of from Redis.
pub(super) struct Epochs {
    kept: bool,
    answered: Mutex<HashSet<String>>,
}

impl Epochs {
    /// `kept`: whether the store keeps epochs (not on a cluster).
    pub(super) fn new(kept: bool) -> Epochs {
        Epochs {
            kept,
            answered: Mutex::new(HashSet::new()),
        }
    }

    /// What `check` sends in its `burst` slot.
    pub(super) fn flag(&self, check: &Check) -> u64 {
        if check.spec.algorithm != Algorithm::Concurrency {
            return u64::from(check.spec.burst);
        }
        if !self.kept {
            return NONE;
        }
        let answered = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
        if answered.contains(limit_of(&check.key)) {
            HOLD_BACK
        } else {
            MARK
        }
    }

    /// Notes that Redis answered a decision of `checks`: their limits' epochs exist now.
    pub(super) fn answered<'a>(&self, checks: impl Iterator<Item = &'a Check>) {
        if !self.kept {
            return;
        }
        // Locked only for a concurrency check: every decision passes here.
        for check in checks.filter(|check| check.spec.algorithm == Algorithm::Concurrency) {
            let mut answered = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
            let limit = limit_of(&check.key);
            if !answered.contains(limit) {
                if answered.len() >= MAX_LIMITS {
                    answered.clear();
                }
                answered.insert(limit.to_owned());
            }
        }
    }
}

/// The part of a concurrency key that names its limit: all before the identity's `{`
/// (`crate::request::store_key`); the epoch key is this and `epoch`.
pub(in crate::limiter) fn limit_of(key: &str) -> &str {
    key.find('{').map_or(key, |brace| &key[..brace])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Spec;

    fn check(key: &str, algorithm: Algorithm) -> Check {
        Check {
            key: key.to_owned(),
            spec: Spec {
                algorithm,
                burst: 7,
                ..Spec::default()
            },
        }
    }

    #[test]
    fn a_limit_is_marked_until_answered_then_held_back() {
        let epochs = Epochs::new(true);
        let a = check("p:r:l:concurrency:{h:k=1}", Algorithm::Concurrency);
        let b = check("p:r:l:concurrency:{h:k=2}", Algorithm::Concurrency);
        assert_eq!(epochs.flag(&a), MARK);
        assert_eq!(epochs.flag(&a), MARK, "not answered yet: still a mark");
        epochs.answered(std::iter::once(&a));
        assert_eq!(
            epochs.flag(&b),
            HOLD_BACK,
            "one epoch per limit, not per identity"
        );
        assert_eq!(epochs.flag(&a), HOLD_BACK);
        let other = check("p:r:other:concurrency:{h:k=1}", Algorithm::Concurrency);
        assert_eq!(epochs.flag(&other), MARK);
    }

    #[test]
    fn other_algorithms_keep_their_burst_and_a_cluster_has_no_epoch() {
        let epochs = Epochs::new(true);
        assert_eq!(epochs.flag(&check("p:r:l:gcra:{x}", Algorithm::Gcra)), 7);
        let cluster = Epochs::new(false);
        let a = check("p:r:l:concurrency:{x}", Algorithm::Concurrency);
        assert_eq!(cluster.flag(&a), NONE);
        cluster.answered(std::iter::once(&a));
        assert_eq!(cluster.flag(&a), NONE);
    }

    #[test]
    fn the_limit_is_what_comes_before_the_identity() {
        assert_eq!(
            limit_of("p:r:l:concurrency:{ip=1.2.3.4}"),
            "p:r:l:concurrency:"
        );
        assert_eq!(limit_of("no-brace"), "no-brace");
    }
}
