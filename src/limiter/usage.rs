//! The index of who used a limit, for the admin API's usage reports (`report: true`).
//!
//! A report must not read the keyspace (`KEYS`, or a `SCAN` of it, grows with every identity
//! of every limit), and the decision's script cannot write the index: the index is one key of
//! the limit, in its own Redis Cluster slot, while the decision touches only the identity's
//! slot. So each instance notes its admissions in a bounded map in memory ([`UsageIndex`],
//! no store call on the request path), and a task flushes the map once a second
//! ([`FLUSH_EVERY`]): one pipeline per limit and time bucket, one `ZINCRBY` per identity it
//! saw plus one `PEXPIRE`, into a sorted set `{limit's prefix}usage:{bucket}` ([`index_key`])
//! that expires on its own a few windows after its last write ([`index_ttl`]).
//!
//! The index only names candidates: its score is what the instances admitted (for a token
//! or money budget, what they reserved, before the settlement gives back the unused part).
//! A report reads the top few times N of the current buckets, then each candidate's exact
//! state from the store (the admin API's peek), and sorts by that. It can miss an identity
//! whose use is not flushed yet (at most the last [`FLUSH_EVERY`]), one an instance dropped
//! because its map was full (counted), and one whose index score ranks below the candidates
//! read although its exact use (after a settlement) ranks above them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus::IntCounter;

/// How often each instance adds what it noted to the store's index.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// The bound on the map between two flushes unless the config sets one
/// (`store.local.max_reported`'s default).
pub const DEFAULT_MAX_PENDING: usize = 100_000;

/// The width of one index bucket for a limit with window `window`: the window itself (at
/// least a second, the index's clock).
fn bucket_width(window: Duration) -> u64 {
    window.as_secs().max(1)
}

/// The bucket `unix_secs` falls in, for a limit with window `window`.
pub fn bucket_of(window: Duration, unix_secs: u64) -> u64 {
    unix_secs / bucket_width(window)
}

/// The index key of the limit whose store keys are `key`'s, for `bucket`: the limit's prefix
/// (the key up to its identity's `{`), then `usage:{bucket}`. It holds no hash tag, so in a
/// cluster it lives in its own slot, apart from the identities'.
pub fn index_key(key: &str, bucket: u64) -> String {
    let limit = key.find('{').map_or(key, |brace| &key[..brace]);
    format!("{limit}usage:{bucket}")
}

/// How long an index bucket lives after its last write: long enough for reports to read it
/// as the previous buckets ([`buckets_to_read`]), then it goes.
pub fn index_ttl(window: Duration) -> Duration {
    Duration::from_secs(bucket_width(window) * 3 + 60)
}

/// The buckets a report reads, newest first: the current one and the one before, which
/// together cover a whole window however far into the current bucket `unix_secs` is; one
/// more for a calendar quota (`calendar`), whose period may be longer than its nominal window
/// (a 31-day month, a 25-hour day).
pub fn buckets_to_read(window: Duration, unix_secs: u64, calendar: bool) -> Vec<u64> {
    let current = bucket_of(window, unix_secs);
    let back = if calendar { 3 } else { 2 };
    (0..back).filter_map(|n| current.checked_sub(n)).collect()
}

/// The identity of a store key: the text between its braces.
pub fn identity_of(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = open + key[open..].find('}')?;
    Some(&key[open + 1..close])
}

/// What one instance admitted since its last flush: per limit (its keys' prefix) and time
/// bucket, per identity, the units. Keyed by the prefix and the bucket apart so that noting
/// a known identity allocates nothing (a `&str` finds a `String` key).
#[derive(Default)]
pub struct Pending {
    by_limit: HashMap<String, HashMap<u64, IndexPending>>,
    entries: usize,
}

impl Pending {
    /// Each index key (`index_key`) with what is to be added to it.
    pub fn indexes(&self) -> impl Iterator<Item = (String, &IndexPending)> {
        self.by_limit.iter().flat_map(|(prefix, buckets)| {
            buckets
                .iter()
                .map(move |(bucket, one)| (index_key(prefix, *bucket), one))
        })
    }
}

/// One index key's pending additions and how long the key is to live.
pub struct IndexPending {
    pub ttl: Duration,
    pub identities: HashMap<String, u64>,
}

/// This instance's notes of who used the reported limits, between two flushes. Bounded:
/// `max` (limit, bucket, identity) entries (`store.local.max_reported`), new ones past it
/// dropped and counted (`sluice_usage_index_dropped_total`).
pub struct UsageIndex {
    pending: Mutex<Pending>,
    max: AtomicUsize,
    dropped: IntCounter,
}

impl UsageIndex {
    pub fn new(max: usize, dropped: IntCounter) -> UsageIndex {
        UsageIndex {
            pending: Mutex::new(Pending::default()),
            max: AtomicUsize::new(max),
            dropped,
        }
    }

    /// Notes that the identity of `key` used `units` of its limit (window `window`) at
    /// `unix_secs`. No store call; allocates only for an identity not noted since the last
    /// flush.
    pub fn note(&self, key: &str, window: Duration, units: u64, unix_secs: u64) {
        let (Some(identity), Some(brace)) = (identity_of(key), key.find('{')) else {
            return;
        };
        let (prefix, bucket) = (&key[..brace], bucket_of(window, unix_secs));
        let mut pending = match self.pending.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        let Pending { by_limit, entries } = &mut *pending;
        let full = *entries >= self.max.load(Ordering::Relaxed);
        if !by_limit.contains_key(prefix) {
            if full {
                self.dropped.inc();
                return;
            }
            by_limit.insert(prefix.to_owned(), HashMap::new());
        }
        let Some(buckets) = by_limit.get_mut(prefix) else {
            return;
        };
        let one = buckets.entry(bucket).or_insert_with(|| IndexPending {
            ttl: index_ttl(window),
            identities: HashMap::new(),
        });
        if let Some(units_so_far) = one.identities.get_mut(identity) {
            *units_so_far += units;
        } else if full {
            self.dropped.inc();
        } else {
            one.identities.insert(identity.to_owned(), units);
            *entries += 1;
        }
    }

    /// Sets the bound on entries (`store.local.max_reported`).
    pub fn bound(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Takes everything noted so far, leaving the map empty for the next second.
    pub fn take(&self) -> Pending {
        let mut pending = match self.pending.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        std::mem::take(&mut *pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_is_beside_the_limit_and_outside_every_identity_slot() {
        let key = "sluice:api:per-key:sliding_log:{h:x-api-key=k1}";
        assert_eq!(index_key(key, 7), "sluice:api:per-key:sliding_log:usage:7");
        assert_eq!(identity_of(key), Some("h:x-api-key=k1"));
        assert_eq!(
            identity_of("sluice:api:daily:calendar:{ip=1.2.3.4}:2026-11"),
            Some("ip=1.2.3.4")
        );
        assert_eq!(
            buckets_to_read(Duration::from_secs(60), 600, false),
            [10, 9]
        );
        assert_eq!(
            buckets_to_read(Duration::from_secs(60), 600, true),
            [10, 9, 8]
        );
    }

    #[test]
    fn a_full_map_drops_new_identities_and_keeps_adding_to_known_ones() {
        let dropped = IntCounter::new("d", "d").unwrap();
        let index = UsageIndex::new(2, dropped.clone());
        let window = Duration::from_secs(60);
        for id in ["a", "b", "c"] {
            index.note(&format!("p:{{{id}}}"), window, 1, 0);
        }
        index.note("p:{a}", window, 5, 0);
        assert_eq!(dropped.get(), 1);
        let pending = index.take();
        let indexes: Vec<_> = pending.indexes().collect();
        assert_eq!(indexes.len(), 1);
        let (key, one) = &indexes[0];
        assert_eq!(key, "p:usage:0");
        assert_eq!(one.identities["a"], 6);
        assert!(!one.identities.contains_key("c"));
        assert_eq!(index.take().indexes().count(), 0);
    }
}
