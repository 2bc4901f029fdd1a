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
//! The request path reads one of [`SHARDS`] maps, chosen by the key's hash, under a shared
//! lock and counts in an atomic, so rejections of one identity never wait for each other;
//! only a new identity, and the report, take a shard's lock exclusively. Profiled under the
//! bench's flood (release build, one key, wrk -c50): hashing the key, the lookup and the
//! level check together take under 1 % of sluice's CPU.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
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
    /// The identity's hash (`crate::log::key_hash`), never the identity.
    pub identity: String,
}

struct Followed {
    subject: Subject,
    /// When its previous line was written.
    since: Instant,
}

#[derive(Default)]
struct Shard {
    /// By the hash of the store key.
    entries: RwLock<HashMap<u64, Entry>>,
    /// Rejections of identities not followed by name, this interval. Counted under the
    /// shared lock, taken under the exclusive one, so a report sees whole intervals.
    unnamed_requests: AtomicU64,
    /// Of those, rejections of identities the full map could not tell apart.
    untracked_requests: AtomicU64,
}

struct Entry {
    /// Rejections since the identity's previous line.
    count: AtomicU64,
    /// `None`: rejected this interval, not followed by name.
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
    shards: Box<[Shard]>,
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
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
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
        let shard = &self.shards[hash as usize % SHARDS];
        if shard.count_again(&read(&shard.entries), hash) {
            return false;
        }
        let mut entries = write(&shard.entries);
        // Another request may have added it between the two locks.
        if shard.count_again(&entries, hash) {
            return false;
        }
        if entries.len() >= MAX_TRACKED / SHARDS {
            shard.unnamed_requests.fetch_add(1, Ordering::Relaxed);
            shard.untracked_requests.fetch_add(1, Ordering::Relaxed);
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
            shard.unnamed_requests.fetch_add(1, Ordering::Relaxed);
        }
        entries.insert(
            hash,
            Entry {
                count: AtomicU64::new(0),
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
            let mut entries = write(&shard.entries);
            others.requests += shard.unnamed_requests.swap(0, Ordering::Relaxed);
            others.untracked_requests += shard.untracked_requests.swap(0, Ordering::Relaxed);
            let mut forgotten = 0;
            entries.retain(|_, entry| {
                let count = std::mem::take(entry.count.get_mut());
                match &mut entry.followed {
                    Some(followed) if count > 0 => {
                        report.repeats.push(Repeats {
                            subject: followed.subject.clone(),
                            count,
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

impl Shard {
    /// Counts a rejection of an identity the shard already holds; false if it holds none.
    fn count_again(&self, entries: &HashMap<u64, Entry>, hash: u64) -> bool {
        let Some(entry) = entries.get(&hash) else {
            return false;
        };
        entry.count.fetch_add(1, Ordering::Relaxed);
        if entry.followed.is_none() {
            self.unnamed_requests.fetch_add(1, Ordering::Relaxed);
        }
        true
    }
}

// A panic while a lock was held leaves counts that are still counts.
fn read(entries: &RwLock<HashMap<u64, Entry>>) -> RwLockReadGuard<'_, HashMap<u64, Entry>> {
    entries
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write(entries: &RwLock<HashMap<u64, Entry>>) -> RwLockWriteGuard<'_, HashMap<u64, Entry>> {
    entries
        .write()
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
            .map(|shard| read(&shard.entries).len())
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
