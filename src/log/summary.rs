//! Rejections summarised instead of logged one by one, so that a flood writes a handful of
//! lines and the metrics keep the exact counts.
//!
//! The rule, per (route, limit, identity) — one store key: its first rejection is logged at
//! once; the rejections after it are counted, and every report (every
//! [`REPORT_INTERVAL`](super::REPORT_INTERVAL)) writes one line with the exact count of those
//! since its previous line. An identity with no rejection during a whole interval is
//! forgotten, so its next rejection is logged at once again.
//!
//! Bounds: at most [`MAX_FOLLOWED`] identities are followed by name at a time; the others
//! rejected in an interval are reported together in one line ("… and N more identities
//! rejected (M requests)"). The map that tells identities apart holds at most
//! [`MAX_TRACKED`] of them; past that, rejections are still counted in that line, as
//! requests of identities that could not be told apart. So a report writes at most
//! `2 × MAX_FOLLOWED + 1` lines, however many clients are rejected.
//!
//! The request path takes one of [`SHARDS`] locks, chosen by the key's hash, for a lookup and
//! an increment: a flood of many identities spreads over the shards, and a flood of one
//! identity holds its shard's lock for a few dozen nanoseconds per rejection.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Identities followed by name at a time (each: a first line, then a line per report).
pub const MAX_FOLLOWED: usize = 100;
/// Shards of the map of identities; a power of two.
const SHARDS: usize = 16;
/// Identities the map tells apart at a time, over all shards.
pub const MAX_TRACKED: usize = SHARDS * 1024;

/// Who an identity followed by name is, as its lines show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub route: String,
    pub limit: String,
    /// The identity's hash (`keys::identity_hash`), never the identity.
    pub identity: String,
}

struct Followed {
    subject: Subject,
    /// When its previous line was written.
    since: Instant,
}

#[derive(Default)]
struct Shard {
    /// By the hash of the store key. `None`: rejected this interval, not followed by name.
    entries: HashMap<u64, Entry>,
    /// Rejections of identities not followed by name, this interval.
    unnamed_requests: u64,
    /// Of those, rejections of identities the full map could not tell apart.
    untracked_requests: u64,
}

struct Entry {
    /// Rejections since the identity's previous line.
    count: u64,
    followed: Option<Box<Followed>>,
}

/// One identity's repeated rejections since its previous line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repeats {
    pub subject: Subject,
    pub count: u64,
    /// Since the identity's previous line.
    pub period: Duration,
}

/// The identities not followed by name, rejected during one interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Others {
    /// Distinct identities the map told apart.
    pub identities: u64,
    /// All their rejections, those of identities not told apart included.
    pub requests: u64,
    /// Rejections of identities not told apart (the map was full): `identities` is then a
    /// lower bound.
    pub untracked_requests: u64,
}

/// What one report writes.
#[derive(Debug, Default)]
pub struct Report {
    pub repeats: Vec<Repeats>,
    /// `None` when no identity beyond the followed ones was rejected.
    pub others: Option<Others>,
}

pub struct Rejections {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    followed: AtomicUsize,
}

impl Default for Rejections {
    fn default() -> Self {
        Rejections::new()
    }
}

impl Rejections {
    pub fn new() -> Rejections {
        Rejections {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            followed: AtomicUsize::new(0),
        }
    }

    /// Counts one rejection of the store key `key`. True when it is to be logged now: the
    /// identity's first (`subject` is then called, to name it in later lines).
    pub fn record(&self, key: &str, subject: impl FnOnce() -> Subject) -> bool {
        self.record_at(key, Instant::now, subject)
    }

    fn record_at(
        &self,
        key: &str,
        now: impl FnOnce() -> Instant,
        subject: impl FnOnce() -> Subject,
    ) -> bool {
        let hash = self.hasher.hash_one(key);
        let mut shard = lock(&self.shards[hash as usize % SHARDS]);
        if let Some(entry) = shard.entries.get_mut(&hash) {
            entry.count += 1;
            if entry.followed.is_none() {
                shard.unnamed_requests += 1;
            }
            return false;
        }
        if shard.entries.len() >= MAX_TRACKED / SHARDS {
            shard.unnamed_requests += 1;
            shard.untracked_requests += 1;
            return false;
        }
        let follow = self
            .followed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < MAX_FOLLOWED).then_some(n + 1)
            })
            .is_ok();
        let followed = follow.then(|| {
            Box::new(Followed {
                subject: subject(),
                since: now(),
            })
        });
        if !follow {
            shard.unnamed_requests += 1;
        }
        shard.entries.insert(
            hash,
            Entry {
                count: u64::from(!follow),
                followed,
            },
        );
        follow
    }

    /// Ends an interval: the followed identities' counts since their previous line, and the
    /// others'. Followed identities with no rejection since are forgotten, and the others
    /// always are.
    pub fn report(&self) -> Report {
        self.report_at(Instant::now())
    }

    fn report_at(&self, now: Instant) -> Report {
        let mut report = Report::default();
        let mut others = Others::default();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            others.requests += std::mem::take(&mut shard.unnamed_requests);
            others.untracked_requests += std::mem::take(&mut shard.untracked_requests);
            let mut forgotten = 0;
            shard.entries.retain(|_, entry| match &mut entry.followed {
                Some(followed) if entry.count > 0 => {
                    report.repeats.push(Repeats {
                        subject: followed.subject.clone(),
                        count: std::mem::take(&mut entry.count),
                        period: now.saturating_duration_since(followed.since),
                    });
                    followed.since = now;
                    true
                }
                Some(_) => {
                    forgotten += 1;
                    false
                }
                None => {
                    others.identities += 1;
                    false
                }
            });
            self.followed.fetch_sub(forgotten, Ordering::Relaxed);
        }
        if others.requests > 0 {
            report.others = Some(others);
        }
        report
    }
}

/// A shard's lock; a panic while it was held leaves counts that are still counts.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject(identity: &str) -> Subject {
        Subject {
            route: "api".to_owned(),
            limit: "per-key".to_owned(),
            identity: identity.to_owned(),
        }
    }

    fn record(rejections: &Rejections, key: &str) -> bool {
        rejections.record(key, || subject(key))
    }

    #[test]
    fn a_flood_of_one_identity_is_one_line_then_one_count_per_report() {
        let rejections = Rejections::new();
        assert!(record(&rejections, "k1"));
        for _ in 0..99_999 {
            assert!(!record(&rejections, "k1"));
        }
        let report = rejections.report();
        assert_eq!(report.repeats.len(), 1);
        assert_eq!(report.repeats[0].subject, subject("k1"));
        assert_eq!(report.repeats[0].count, 99_999);
        assert_eq!(report.others, None);
        // Still flooding: counted again, not logged again.
        assert!(!record(&rejections, "k1"));
        assert_eq!(rejections.report().repeats[0].count, 1);
        // A quiet interval: no line, and the identity is forgotten...
        let quiet = rejections.report();
        assert!(quiet.repeats.is_empty() && quiet.others.is_none());
        // ...so its next rejection is logged at once.
        assert!(record(&rejections, "k1"));
    }

    #[test]
    fn the_period_is_the_time_since_the_previous_line() {
        let rejections = Rejections::new();
        let start = Instant::now();
        assert!(rejections.record_at("k", || start, || subject("k")));
        assert!(!record(&rejections, "k"));
        let report = rejections.report_at(start + Duration::from_secs(7));
        assert_eq!(report.repeats[0].period, Duration::from_secs(7));
    }

    #[test]
    fn many_identities_are_named_up_to_the_cap_then_counted_together() {
        let rejections = Rejections::new();
        let mut first_lines = 0;
        for i in 0..10_000 {
            first_lines += usize::from(record(&rejections, &format!("key-{i}")));
        }
        // Twice each for the second half: the same identities, no more of them.
        for i in 5_000..10_000 {
            first_lines += usize::from(record(&rejections, &format!("key-{i}")));
        }
        assert_eq!(first_lines, MAX_FOLLOWED);
        let report = rejections.report();
        // The followed identities were rejected once each: no repeats to report.
        assert!(report.repeats.is_empty());
        let others = report.others.expect("a line for the others");
        assert_eq!(others.identities, 10_000 - MAX_FOLLOWED as u64);
        assert_eq!(others.requests, 15_000 - MAX_FOLLOWED as u64);
        assert_eq!(others.untracked_requests, 0);
        // The followed ones were forgotten (no repeats): new identities get their lines.
        assert!(record(&rejections, "new"));
    }

    #[test]
    fn the_map_is_bounded_and_what_overflows_is_still_counted() {
        let rejections = Rejections::new();
        let total = 2 * MAX_TRACKED as u64;
        let mut first_lines = 0;
        for i in 0..total {
            first_lines += u64::from(record(&rejections, &format!("key-{i}")));
        }
        let tracked: usize = rejections
            .shards
            .iter()
            .map(|shard| lock(shard).entries.len())
            .sum();
        assert!(tracked <= MAX_TRACKED, "{tracked}");
        let others = rejections.report().others.expect("a line for the others");
        assert_eq!(first_lines + others.requests, total);
        assert!(others.untracked_requests >= total - MAX_TRACKED as u64);
        assert_eq!(
            others.identities + first_lines + others.untracked_requests,
            total
        );
    }
}
