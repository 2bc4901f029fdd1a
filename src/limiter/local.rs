//! The in-process store: every algorithm's state in this process's memory, for a single
//! instance (no Redis configured) and for local fallback. Same semantics as the Redis script
//! (each algorithm's arithmetic lives in its own pure module); the clock is this process's
//! monotonic clock.
//!
//! Memory is bounded by `store.local.max_keys`, counted over the whole store (one atomic
//! count of the keys held, beside the shards). A key is held from its first admission until
//! its state has emptied and the sweeper (every `SWEEP_EVERY`) drops it. Only when a new key
//! would pass `max_keys` does one go: the least recently used key of the new key's shard
//! (another shard's when that one is empty). If its log has emptied, nothing is lost; if
//! not, its admissions are forgotten (counted in `sluice_local_store_evictions_total`), so
//! that identity may be admitted up to its limit again within the window. So an identity's
//! state is forgotten only when more than `max_keys` keys are held: more than `max_keys`
//! identities admitted within the longest window (plus up to `SWEEP_EVERY` for emptied ones
//! the sweeper has not dropped yet). Under that pressure the victim is the LRU of one shard,
//! not of the whole store.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::time::{Duration, Instant};

use lru::LruCache;
use prometheus::{IntCounter, IntGauge};
use smallvec::SmallVec;

use super::{calendar, concurrency, fixed_window, gcra, sliding_log, sliding_window, weighted_log};
use super::{Admission, Algorithm, Check, Decision, LimitState, Peek, Room, Spec};

/// How often logs that have emptied are dropped, so memory follows live keys only.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The logs are split into shards, each behind its own lock, so the sweeper never holds up
/// requests for longer than one shard takes, and requests for different keys rarely wait on
/// each other.
const SHARDS: usize = 64;

/// Checks of one decision held on the stack: a route rarely has more limits than this, and a
/// decision then allocates nothing of its own beyond the answer it returns.
type PerCheck<T> = SmallVec<[T; 4]>;

/// One limit's state, of the kind its algorithm keeps.
enum Cell {
    Log(VecDeque<u64>),
    Weighted(weighted_log::Log),
    Window(sliding_window::Counts),
    Counter(fixed_window::Counter),
    Tat(Option<u64>),
    Quota(calendar::Counter),
    Leases(concurrency::Leases),
}

impl Cell {
    fn new(algorithm: Algorithm) -> Cell {
        match algorithm {
            Algorithm::SlidingLog => Cell::Log(VecDeque::new()),
            Algorithm::WeightedLog => Cell::Weighted(weighted_log::Log::default()),
            Algorithm::SlidingWindow => Cell::Window(sliding_window::Counts::default()),
            Algorithm::FixedWindow => Cell::Counter(fixed_window::Counter::default()),
            Algorithm::Gcra => Cell::Tat(None),
            Algorithm::Calendar => Cell::Quota(calendar::Counter::default()),
            Algorithm::Concurrency => Cell::Leases(concurrency::Leases::default()),
        }
    }

    fn algorithm(&self) -> Algorithm {
        match self {
            Cell::Log(_) => Algorithm::SlidingLog,
            Cell::Weighted(_) => Algorithm::WeightedLog,
            Cell::Window(_) => Algorithm::SlidingWindow,
            Cell::Counter(_) => Algorithm::FixedWindow,
            Cell::Tat(_) => Algorithm::Gcra,
            Cell::Quota(_) => Algorithm::Calendar,
            Cell::Leases(_) => Algorithm::Concurrency,
        }
    }

    /// Brings the state to `now` (drops what time has expired).
    fn advance(&mut self, window_us: u64, now: u64) {
        match self {
            Cell::Log(times) => sliding_log::prune(times, window_us, now),
            Cell::Weighted(log) => log.prune(window_us, now),
            Cell::Window(counts) => *counts = counts.at(window_us, now),
            Cell::Counter(counter) => *counter = counter.at(now),
            Cell::Tat(tat) => *tat = tat.filter(|&tat| tat > now),
            Cell::Quota(counter) => *counter = counter.at(now),
            // A lease ends with its request, never with time.
            Cell::Leases(_) => {}
        }
    }

    /// Whether the state holds nothing at `now`, so dropping it loses nothing.
    fn is_empty(&mut self, window_us: u64, now: u64) -> bool {
        self.advance(window_us, now);
        match self {
            Cell::Log(times) => times.is_empty(),
            Cell::Weighted(log) => log.is_empty(),
            Cell::Window(counts) => counts.is_empty(window_us, now),
            Cell::Counter(counter) => counter.count == 0,
            Cell::Tat(tat) => tat.is_none(),
            Cell::Quota(counter) => counter.count == 0,
            Cell::Leases(leases) => leases.is_empty(),
        }
    }

    /// The state must be advanced to `now`.
    fn check(&self, spec: &Spec, now: u64) -> Room {
        match self {
            Cell::Log(times) => sliding_log::check(times, spec, now),
            Cell::Weighted(log) => log.check(spec, now),
            Cell::Window(counts) => sliding_window::check(*counts, spec, now),
            Cell::Counter(counter) => fixed_window::check(*counter, spec, now),
            Cell::Tat(tat) => gcra::check(*tat, spec, now),
            Cell::Quota(counter) => calendar::check(*counter, spec, now),
            Cell::Leases(leases) => leases.check(spec),
        }
    }

    /// Records an admitted request: the exact algorithms at `at` (its forwarding time), the
    /// counters at `now` (they keep no time finer than their windows).
    fn record(&mut self, spec: &Spec, now: u64, at: u64, member: &str) -> LimitState {
        // A fresh state starts at time zero: bring it to `now` first, or a sliding window
        // would count the request in a window long gone.
        self.advance(spec.window_us(), now);
        match self {
            Cell::Log(times) => sliding_log::record(times, spec, now, at),
            Cell::Weighted(log) => log.record(spec, now, at),
            Cell::Window(counts) => sliding_window::record(counts, spec, now),
            Cell::Counter(counter) => fixed_window::record(counter, spec, now),
            Cell::Tat(tat) => {
                let (new, state) = gcra::record(*tat, spec, now, at);
                *tat = Some(new);
                state
            }
            Cell::Quota(counter) => calendar::record(counter, spec, now),
            Cell::Leases(leases) => leases.record(spec, member, now),
        }
    }

    /// Gives back an admitted request (see `Store::release`); whether a lease was there (the
    /// other algorithms: true).
    fn release(&mut self, spec: &Spec, admission: &Admission, now: u64) -> bool {
        self.advance(spec.window_us(), now);
        match self {
            Cell::Leases(leases) => return leases.release(&admission.member, now),
            Cell::Log(times) => sliding_log::release(times, spec.cost, admission.at_us),
            Cell::Weighted(log) => log.release(spec.cost, admission.at_us),
            Cell::Window(counts) => {
                *counts = sliding_window::release(*counts, spec, now, admission.decided_us)
            }
            Cell::Counter(counter) => *counter = fixed_window::release(*counter, spec, now),
            Cell::Tat(tat) => *tat = gcra::release(*tat, spec, now),
            Cell::Quota(counter) => *counter = calendar::release(*counter, spec.cost, now),
        }
        true
    }
}

impl Cell {
    /// Charges `extra` units more to an admitted request that used more than it reserved
    /// (see `Store::keep`), where it is still recorded; the algorithms a token budget does
    /// not run on charge nothing (as in `release.lua`).
    fn charge(&mut self, spec: &Spec, extra: u32, admission: &Admission, now: u64) {
        self.advance(spec.window_us(), now);
        match self {
            Cell::Log(times) => sliding_log::charge(times, spec, extra, admission.at_us),
            Cell::Weighted(log) => log.charge(extra, admission.at_us),
            Cell::Quota(counter) => *counter = calendar::charge(*counter, extra, now),
            Cell::Window(_) | Cell::Counter(_) | Cell::Tat(_) | Cell::Leases(_) => {}
        }
    }
}

struct Log {
    cell: Cell,
    window_us: u64,
}

/// One shard's logs, least recently used first. Unbounded as a cache: `Shards` enforces the
/// bound over all shards together.
type Logs = LruCache<String, Log>;

struct Shards {
    shards: Vec<Mutex<Logs>>,
    hasher: RandomState,
    /// Most keys in all shards together.
    max_keys: usize,
    /// Keys in all shards together: raised before a key is inserted, lowered when one goes.
    held: AtomicUsize,
    keys: IntGauge,
    evictions: IntCounter,
}

impl Shards {
    fn index(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) % SHARDS as u64) as usize
    }

    /// Counts a key about to be inserted into shard `shard` (whose guard is `logs`) and, if
    /// that takes the store past `max_keys`, drops one: the least recently used log of this
    /// shard, or of another when this one holds none. Each insert claims its own excess
    /// (never two inserts evicting for one), so the count ends at most `max_keys`.
    fn add_key(&self, logs: &mut Logs, shard: usize, now: u64) {
        self.held.fetch_add(1, Ordering::AcqRel);
        self.keys.inc();
        let max = self.max_keys;
        while self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n > max).then(|| n - 1)
            })
            .is_ok()
        {
            match self.pop_victim(logs, shard) {
                Some(mut log) => {
                    self.keys.dec();
                    if !log.cell.is_empty(log.window_us, now) {
                        self.evictions.inc();
                    }
                }
                None => {
                    // Every other shard is busy: held past the bound until the next insert.
                    self.held.fetch_add(1, Ordering::AcqRel);
                    return;
                }
            }
        }
    }

    /// The least recently used log of shard `shard` (held by the caller as `logs`), or of the
    /// next shard that is free to lock and holds one. Never waits for a lock: the caller
    /// holds some already.
    fn pop_victim(&self, logs: &mut Logs, shard: usize) -> Option<Log> {
        if let Some((_, log)) = logs.pop_lru() {
            return Some(log);
        }
        (1..SHARDS).find_map(|step| {
            let mut other = match self.shards[(shard + step) % SHARDS].try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => return None,
            };
            other.pop_lru().map(|(_, log)| log)
        })
    }

    /// A key left the store (swept or forgotten).
    fn remove_keys(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
        self.keys.sub(n as i64);
    }
}

impl Shards {
    /// Drops the emptied logs of one shard.
    fn sweep(&self, index: usize, now: u64) {
        let mut logs = lock(&self.shards[index]);
        let before = logs.len();
        logs.retain(|_, log| !log.cell.is_empty(log.window_us, now));
        self.remove_keys(before - logs.len());
    }
}

/// What the in-process store reports to the metrics.
pub struct LocalMetrics {
    pub keys: IntGauge,
    pub evictions: IntCounter,
}

pub struct LocalStore {
    shards: Arc<Shards>,
    epoch: Instant,
    /// Numbers the leases of concurrency limits (an admission's member).
    sequence: AtomicU64,
    /// The identities' overrides (`super::overrides`), by override key: the number and when
    /// it expires (micros since `epoch`). At most `max_keys` of them.
    overrides: Mutex<HashMap<String, (u32, u64)>>,
    /// The thresholds crossed (`Spec::notify`), as `decide.lua`'s markers: `key:nP` → when the
    /// marker expires (micros since `epoch`). At most `max_keys`; when that many live, a
    /// crossing is neither marked nor reported (at most once, never twice).
    markers: Mutex<HashMap<String, u64>>,
}

impl LocalStore {
    /// Creates the store, holding at most `max_keys` keys, and starts its sweeper on
    /// the current Tokio runtime.
    pub fn new(max_keys: usize, metrics: LocalMetrics) -> LocalStore {
        let shards = Arc::new(Shards {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::unbounded()))
                .collect(),
            hasher: RandomState::new(),
            max_keys: max_keys.max(1),
            held: AtomicUsize::new(0),
            keys: metrics.keys,
            evictions: metrics.evictions,
        });
        let epoch = Instant::now();
        tokio::spawn(sweep(Arc::downgrade(&shards), epoch));
        LocalStore {
            shards,
            epoch,
            sequence: AtomicU64::new(0),
            overrides: Mutex::new(HashMap::new()),
            markers: Mutex::new(HashMap::new()),
        }
    }

    /// Locks every shard the checks touch, in ascending order (so two requests can never wait
    /// on each other in a cycle), for one whole step over all of them, as in the Redis
    /// script. Returns the guards and, per check, the index of its shard's guard.
    fn lock_all(&self, checks: &[Check]) -> (PerCheck<MutexGuard<'_, Logs>>, PerCheck<usize>) {
        let shard_of: PerCheck<usize> = checks.iter().map(|c| self.shards.index(&c.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        // Where each check's shard guard sits in `guards` (always found: `order` holds them all).
        let slot: PerCheck<usize> = shard_of
            .iter()
            .map(|shard| order.binary_search(shard).unwrap_or_default())
            .collect();
        let guards = order
            .iter()
            .map(|&index| lock(&self.shards.shards[index]))
            .collect();
        (guards, slot)
    }

    pub fn decide(&self, checks: &[Check]) -> Decision {
        let (mut guards, slot) = self.lock_all(checks);
        // Read under the locks, so the times recorded under one key never go backwards.
        let now = micros_since(self.epoch);

        let mut admitted = true;
        let mut retry_after = 0;
        // The longest wait among the limits that delay the request instead of rejecting it.
        let mut delay = 0;
        // The answer's own vectors, filled in place (the only allocations of a decision).
        let mut states: Vec<Option<LimitState>> = Vec::with_capacity(checks.len());
        let mut rejecting = Vec::with_capacity(checks.len());
        for (check, &slot) in checks.iter().zip(&slot) {
            let (spec, overridden) = self.in_force(check, now);
            let room = match guards[slot].get_mut(&check.key) {
                // A key last used by another algorithm (after a reload) starts afresh.
                Some(log) if log.cell.algorithm() == spec.algorithm => {
                    log.window_us = spec.window_us();
                    log.cell.advance(spec.window_us(), now);
                    log.cell.check(&spec, now)
                }
                _ => Cell::new(spec.algorithm).check(&spec, now),
            };
            // A shadow limit without room is only reported: it neither rejects nor records.
            if !room.admits && !check.spec.shadow {
                if room.wait <= spec.max_delay_us() {
                    delay = delay.max(room.wait);
                } else {
                    admitted = false;
                }
                retry_after = retry_after.max(room.wait);
            }
            rejecting.push(!room.admits);
            states.push(Some(LimitState {
                overridden,
                ..room.state
            }));
        }
        let at = now + delay;
        // A lease needs an id; no other algorithm reads one.
        let member = if admitted
            && checks
                .iter()
                .any(|c| c.spec.algorithm == Algorithm::Concurrency)
        {
            self.sequence.fetch_add(1, Ordering::Relaxed).to_string()
        } else {
            String::new()
        };
        let mut crossed = Vec::new();
        if admitted {
            for (index, (((check, &slot), state), &rejects)) in checks
                .iter()
                .zip(&slot)
                .zip(states.iter_mut())
                .zip(&rejecting)
                .enumerate()
            {
                // Recorded: every limit with room, and every limit that delays it.
                if !rejects || !check.spec.shadow {
                    let (spec, overridden) = self.in_force(check, now);
                    let before = state.map_or(0, |s| s.remaining);
                    let recorded = self.record(&mut guards[slot], check, &spec, now, at, &member);
                    if !spec.notify.is_empty() {
                        let bits = self.crossed(check, &spec, before, recorded.remaining, now);
                        if bits != 0 {
                            crossed.resize(checks.len(), 0);
                            crossed[index] = bits;
                        }
                    }
                    *state = Some(LimitState {
                        overridden,
                        ..recorded
                    });
                }
            }
        }
        // A rejection records nothing, not even an empty state.
        Decision {
            admitted,
            retry_after: Duration::from_micros(if admitted { 0 } else { retry_after }),
            limits: states,
            rejecting,
            admission: admitted.then_some(Admission {
                member,
                at_us: at,
                decided_us: now,
                local: true,
            }),
            crossed,
        }
    }

    /// The thresholds of `spec` (the limit in force) an admission that took the remaining
    /// room from `before` to `after` crossed, each marked now for the window (or the period's
    /// time left) unless it was marked already: as `decide.lua`'s `crossed`, under the locks of
    /// the decision.
    fn crossed(&self, check: &Check, spec: &Spec, before: u32, after: u32, now: u64) -> u8 {
        let requests = u64::from(spec.requests);
        let used = |remaining: u32| requests.saturating_sub(u64::from(remaining));
        let bits = spec
            .notify
            .crossing(spec.requests, used(before), used(after));
        if bits == 0 {
            return 0;
        }
        let expires = now.saturating_add(spec.window_us().max(1));
        let mut markers = lock(&self.markers);
        let mut marked = 0;
        for (index, permille) in spec.notify.permille().enumerate() {
            if bits & 1 << index == 0 {
                continue;
            }
            let marker = format!("{}:n{permille}", check.key);
            if markers.get(&marker).is_some_and(|&until| until > now) {
                continue;
            }
            if markers.len() >= self.shards.max_keys {
                markers.retain(|_, &mut until| until > now);
                if markers.len() >= self.shards.max_keys {
                    continue;
                }
            }
            markers.insert(marker, expires);
            marked |= 1 << index;
        }
        marked
    }

    /// Settles what an admitted request recorded under `checks` to `keep` units of each:
    /// gives back the rest, or charges the excess when `keep` is above a check's cost (see
    /// `Store::keep`; `Store::release` keeps none). Returns how many checks held something
    /// to settle (for a concurrency limit: its lease).
    pub fn release(&self, checks: &[Check], admission: &Admission, keep: u32) -> usize {
        let (mut guards, slot) = self.lock_all(checks);
        let now = micros_since(self.epoch);
        let mut held = 0;
        for (check, &slot) in checks.iter().zip(&slot) {
            let cost = check.spec.cost;
            if keep == cost {
                continue;
            }
            let Some(log) = guards[slot].peek_mut(check.key.as_str()) else {
                continue;
            };
            if log.cell.algorithm() != check.spec.algorithm {
                continue;
            }
            if keep > cost {
                log.cell.charge(&check.spec, keep - cost, admission, now);
            } else {
                // The algorithms give back a whole cost: what is not kept is the part given
                // back.
                let spec = Spec {
                    cost: cost - keep,
                    ..check.spec
                };
                if log.cell.release(&spec, admission, now) {
                    held += 1;
                }
            }
        }
        held
    }

    /// Records an admitted request under `check.key` with the limit in force `spec`, creating
    /// its state if needed.
    fn record(
        &self,
        logs: &mut Logs,
        check: &Check,
        spec: &Spec,
        now: u64,
        at: u64,
        member: &str,
    ) -> LimitState {
        let spec = *spec;
        // One lookup for a key already held under this algorithm (the usual case).
        if let Some(log) = logs.peek_mut(check.key.as_str()) {
            if log.cell.algorithm() == spec.algorithm {
                return log.cell.record(&spec, now, at, member);
            }
        }
        // New, or last used by another algorithm (after a reload): it starts afresh.
        if logs.pop(check.key.as_str()).is_none() {
            let shard = self.shards.index(&check.key);
            self.shards.add_key(logs, shard, now);
        }
        logs.push(
            check.key.clone(),
            Log {
                cell: Cell::new(spec.algorithm),
                window_us: spec.window_us(),
            },
        );
        match logs.peek_mut(check.key.as_str()) {
            Some(log) => log.cell.record(&spec, now, at, member),
            None => Cell::new(spec.algorithm).record(&spec, now, at, member),
        }
    }
}

/// Read and reset for the admin API: neither records an admission.
impl LocalStore {
    /// Where `check.key` stands now for one more request (its `wait` for the check's cost),
    /// with the same arithmetic as a decision; drops what time has expired, records nothing,
    /// and leaves the key's place in the LRU order alone.
    pub fn peek(&self, check: &Check) -> Peek {
        let now = micros_since(self.epoch);
        let (spec, overridden) = self.in_force(check, now);
        let spec = Spec {
            cost: check.spec.cost.max(1),
            ..spec
        };
        let mut logs = lock(&self.shards.shards[self.shards.index(&check.key)]);
        let room = match logs.peek_mut(check.key.as_str()) {
            Some(log) if log.cell.algorithm() == spec.algorithm => {
                log.cell.advance(spec.window_us(), now);
                let room = log.cell.check(&spec, now);
                return Peek {
                    count: log.cell.count(&spec, &room),
                    remaining: room.state.remaining,
                    reset: room.state.reset,
                    wait: Duration::from_micros(room.wait),
                    overridden,
                };
            }
            _ => Cell::new(spec.algorithm).check(&spec, now),
        };
        Peek {
            count: 0,
            remaining: room.state.remaining,
            reset: room.state.reset,
            wait: Duration::from_micros(room.wait),
            overridden,
        }
    }

    /// The limit of `check` in force at `now`: its spec with the identity's override, if the
    /// limit takes one and one is set (a burst equal to `requests`, GCRA's default, follows
    /// it, as in `prelude.lua`), and that override.
    fn in_force(&self, check: &Check, now: u64) -> (Spec, Option<u32>) {
        let spec = check.spec;
        if !spec.overridable {
            return (spec, None);
        }
        let Some(key) = super::overrides::key_of(&check.key) else {
            return (spec, None);
        };
        let overrides = lock(&self.overrides);
        match overrides.get(&key) {
            Some(&(requests, expires)) if expires > now => {
                let burst = if spec.burst == spec.requests {
                    requests
                } else {
                    spec.burst
                };
                (
                    Spec {
                        requests,
                        burst,
                        ..spec
                    },
                    Some(requests),
                )
            }
            _ => (spec, None),
        }
    }

    /// Sets the override at `key` (an override key) to `requests` for `ttl`; the one it
    /// replaced; refused when `max_keys` overrides are held.
    pub fn set_override(
        &self,
        key: &str,
        requests: u32,
        ttl: Duration,
    ) -> Result<Option<u32>, super::overrides::OverrideError> {
        let now = micros_since(self.epoch);
        let mut overrides = lock(&self.overrides);
        overrides.retain(|_, &mut (_, expires)| expires > now);
        if overrides.len() >= self.shards.max_keys && !overrides.contains_key(key) {
            return Err(super::overrides::OverrideError::Full(self.shards.max_keys));
        }
        let expires = now.saturating_add(u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX));
        Ok(overrides
            .insert(key.to_owned(), (requests, expires))
            .map(|(old, _)| old))
    }

    /// The override at `key` and the time left until it expires.
    pub fn get_override(&self, key: &str) -> Option<super::overrides::Override> {
        let now = micros_since(self.epoch);
        let overrides = lock(&self.overrides);
        let &(requests, expires) = overrides.get(key)?;
        if expires <= now {
            return None;
        }
        Some(super::overrides::Override {
            requests,
            expires_in: Duration::from_micros(expires - now),
        })
    }

    /// The overrides under the override keys starting as `key`'s limit's, at most `most`,
    /// soonest to expire first.
    pub fn list_overrides(&self, key: &str, most: usize) -> Vec<super::overrides::Listed> {
        let now = micros_since(self.epoch);
        let limit = key.find('{').map_or(key, |brace| &key[..brace]);
        let overrides = lock(&self.overrides);
        let mut listed: Vec<_> = overrides
            .iter()
            .filter(|(found, &(_, expires))| found.starts_with(limit) && expires > now)
            .map(|(found, &(requests, expires))| super::overrides::Listed {
                key: found.clone(),
                requests,
                expires_in: Duration::from_micros(expires - now),
            })
            .collect();
        listed.sort_by_key(|entry| entry.expires_in);
        listed.truncate(most);
        listed
    }

    /// The limits holding overrides in force, at most `most`, each with how many.
    pub fn overridden_limits(&self, most: usize) -> Vec<super::overrides::Holder> {
        let now = micros_since(self.epoch);
        let overrides = lock(&self.overrides);
        let mut counts = std::collections::BTreeMap::<String, u64>::new();
        for (key, _) in overrides.iter().filter(|(_, &(_, expires))| expires > now) {
            *counts.entry(super::overrides::index_of(key)).or_default() += 1;
        }
        counts
            .into_iter()
            .take(most)
            .map(|(index, overrides)| super::overrides::Holder { index, overrides })
            .collect()
    }

    /// Deletes the override at `key`; the one it was.
    pub fn delete_override(&self, key: &str) -> Option<u32> {
        let now = micros_since(self.epoch);
        lock(&self.overrides)
            .remove(key)
            .filter(|&(_, expires)| expires > now)
            .map(|(requests, _)| requests)
    }

    /// The leases held under the concurrency key `key`.
    pub fn holders(&self, key: &str) -> Vec<super::Holder> {
        let now = micros_since(self.epoch);
        let logs = lock(&self.shards.shards[self.shards.index(key)]);
        match logs.peek(key).map(|log| &log.cell) {
            Some(Cell::Leases(leases)) => leases
                .held()
                .map(|(lease, taken)| super::Holder {
                    lease: lease.to_owned(),
                    instance: "local".to_owned(),
                    age: Duration::from_micros(now.saturating_sub(taken)),
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The identities holding a key that starts with `prefix` (one limit's keys), each once:
    /// what a usage report of the in-process store reads. One pass over the keys held, at
    /// most `store.local.max_keys`, one shard locked at a time.
    pub fn identities_under(&self, prefix: &str) -> Vec<String> {
        let mut found = std::collections::HashSet::new();
        for shard in &self.shards.shards {
            let logs = lock(shard);
            for (key, _) in logs.iter() {
                if let Some(rest) = key
                    .strip_prefix(prefix)
                    .filter(|rest| rest.starts_with('{'))
                {
                    if let Some(identity) = super::usage::identity_of(rest) {
                        found.insert(identity.to_owned());
                    }
                }
            }
        }
        found.into_iter().collect()
    }

    /// Forgets everything recorded under `key`; whether there was anything.
    pub fn forget(&self, key: &str) -> bool {
        let mut logs = lock(&self.shards.shards[self.shards.index(key)]);
        let found = logs.pop(key).is_some();
        if found {
            self.shards.remove_keys(1);
        }
        found
    }
}

impl Cell {
    /// Requests counted against the limit now (the state advanced to now): entries or the
    /// counter where the algorithm keeps them; for the sliding-window counter (a weighted
    /// sum) and GCRA (a timestamp), the room used, capacity minus remaining.
    fn count(&self, spec: &Spec, room: &Room) -> u64 {
        let remaining = u64::from(room.state.remaining);
        match self {
            Cell::Log(times) => times.len() as u64,
            Cell::Weighted(log) => log.total(),
            Cell::Counter(counter) => counter.count,
            Cell::Window(_) => u64::from(spec.requests).saturating_sub(remaining),
            Cell::Tat(_) => u64::from(spec.burst).saturating_sub(remaining),
            Cell::Quota(counter) => counter.count,
            Cell::Leases(leases) => leases.len() as u64,
        }
    }
}

fn micros_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// A panic elsewhere while holding the lock leaves the logs consistent (every change is a
/// single push or pop), so a poisoned lock is still safe to use.
fn lock<T>(locked: &Mutex<T>) -> MutexGuard<'_, T> {
    locked
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Drops emptied logs one shard at a time, letting requests in between shards.
async fn sweep(shards: Weak<Shards>, epoch: Instant) {
    let mut ticks = tokio::time::interval(SWEEP_EVERY);
    loop {
        ticks.tick().await;
        for index in 0..SHARDS {
            let Some(shards) = shards.upgrade() else {
                return;
            };
            shards.sweep(index, micros_since(epoch));
            drop(shards);
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    impl LocalStore {
        /// How many admissions the log of `key` holds, if it exists.
        fn times_of(&self, key: &str) -> Option<usize> {
            let shard = lock(&self.shards.shards[self.shards.index(key)]);
            shard.peek(key).map(|log| match &log.cell {
                Cell::Log(times) => times.len(),
                _ => 1,
            })
        }

        fn unbounded() -> LocalStore {
            LocalStore::new(1 << 20, test_metrics())
        }
    }

    fn test_metrics() -> LocalMetrics {
        LocalMetrics {
            keys: IntGauge::new("keys", "keys").unwrap(),
            evictions: IntCounter::new("evictions", "evictions").unwrap(),
        }
    }

    #[tokio::test]
    async fn a_full_store_drops_emptied_logs_first_then_the_least_recently_used() {
        let metrics = test_metrics();
        let (keys, evictions) = (metrics.keys.clone(), metrics.evictions.clone());
        let store = LocalStore::new(4, metrics);
        let short = Duration::from_millis(30);
        // Four short-lived keys in one shard, then let them empty.
        let shard_keys: Vec<String> = (0..10_000)
            .map(|i| format!("k{i}"))
            .filter(|k| store.shards.index(k) == 0)
            .take(12)
            .collect();
        for key in &shard_keys[..4] {
            assert!(store.decide(&[check(key, 1, short)]).admitted);
        }
        std::thread::sleep(Duration::from_millis(40));
        let long = Duration::from_secs(60);
        for key in &shard_keys[4..8] {
            assert!(store.decide(&[check(key, 1, long)]).admitted);
        }
        assert_eq!(
            evictions.get(),
            0,
            "emptied logs make room without an eviction"
        );
        // Touch the oldest live key, so the next insert evicts the second oldest.
        assert!(!store.decide(&[check(&shard_keys[4], 1, long)]).admitted);
        assert!(store.decide(&[check(&shard_keys[8], 1, long)]).admitted);
        assert_eq!(evictions.get(), 1);
        assert_eq!(store.times_of(&shard_keys[5]), None, "the LRU key went");
        assert_eq!(
            store.times_of(&shard_keys[4]),
            Some(1),
            "the touched key stayed"
        );
        assert_eq!(keys.get(), 4);
        // The evicted identity starts afresh: this is the documented loss of exactness.
        assert!(store.decide(&[check(&shard_keys[5], 1, long)]).admitted);
    }

    /// The bound is over the whole store, not per shard: `max_keys` identities spread over
    /// the shards all stay (however unevenly the shards fill), and each one past it evicts
    /// exactly one.
    #[tokio::test]
    async fn the_bound_is_global() {
        for max_keys in [1, 64, 1000] {
            let metrics = test_metrics();
            let (keys, evictions) = (metrics.keys.clone(), metrics.evictions.clone());
            let store = LocalStore::new(max_keys, metrics);
            let long = Duration::from_secs(60);
            for n in 0..max_keys {
                assert!(store.decide(&[check(&format!("k{n}"), 1, long)]).admitted);
            }
            assert_eq!(evictions.get(), 0, "{max_keys}");
            assert_eq!(keys.get() as usize, max_keys);
            for n in 0..max_keys {
                let again = store.decide(&[check(&format!("k{n}"), 1, long)]);
                assert!(!again.admitted, "{max_keys}: k{n} forgotten");
            }
            for extra in 1..=3 {
                let key = format!("extra{extra}");
                assert!(store.decide(&[check(&key, 1, long)]).admitted);
                assert_eq!(evictions.get(), extra, "{max_keys}");
                assert_eq!(keys.get() as usize, max_keys);
            }
        }
    }

    fn check(key: &str, requests: u32, window: Duration) -> Check {
        Check {
            key: key.to_owned(),
            spec: Spec {
                requests,
                window,
                algorithm: Algorithm::SlidingLog,
                burst: requests,
                cost: 1,
                ..Spec::default()
            },
        }
    }

    #[tokio::test]
    async fn every_algorithm_counts_a_new_key_in_the_current_window() {
        let store = LocalStore::unbounded();
        // Several windows after the store's epoch, so a state left at time zero would be stale.
        std::thread::sleep(Duration::from_millis(70));
        for algorithm in [
            Algorithm::SlidingLog,
            Algorithm::SlidingWindow,
            Algorithm::FixedWindow,
            Algorithm::Gcra,
        ] {
            let mut one = check(algorithm.label(), 1, Duration::from_millis(30));
            one.spec.algorithm = algorithm;
            assert!(store.decide(std::slice::from_ref(&one)).admitted);
            assert!(
                !store.decide(std::slice::from_ref(&one)).admitted,
                "{algorithm:?}"
            );
        }
    }

    #[tokio::test]
    async fn admits_exactly_the_limit_and_records_no_rejection() {
        let store = LocalStore::unbounded();
        let checks = [check("k", 3, Duration::from_secs(60))];
        let remaining: Vec<u32> = (0..3)
            .map(|_| {
                let d = store.decide(&checks);
                assert!(d.admitted);
                d.limits[0].unwrap().remaining
            })
            .collect();
        assert_eq!(remaining, [2, 1, 0]);
        for _ in 0..5 {
            let d = store.decide(&checks);
            assert!(!d.admitted);
            assert!(d.retry_after > Duration::from_secs(59));
        }
        assert_eq!(store.times_of("k"), Some(3));
    }

    #[tokio::test]
    async fn a_full_limit_blocks_the_others_without_draining_them() {
        let store = LocalStore::unbounded();
        let tight = check("tight", 1, Duration::from_secs(60));
        let loose = check("loose", 10, Duration::from_secs(60));
        assert!(store.decide(&[tight.clone(), loose.clone()]).admitted);
        let d = store.decide(&[tight, loose.clone()]);
        assert!(!d.admitted);
        assert_eq!(
            d.limits[1].unwrap().remaining,
            9,
            "a rejected request must not count"
        );
        assert_eq!(store.decide(&[loose]).limits[0].unwrap().remaining, 8);
    }

    #[tokio::test]
    async fn a_rejection_creates_no_log() {
        let store = LocalStore::unbounded();
        let full = check("full", 1, Duration::from_secs(60));
        assert!(store.decide(std::slice::from_ref(&full)).admitted);
        let d = store.decide(&[full, check("fresh", 5, Duration::from_secs(60))]);
        assert!(!d.admitted);
        assert_eq!(d.limits[1].unwrap().remaining, 5);
        assert_eq!(store.times_of("fresh"), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_requests_admit_exactly_the_limit_without_deadlock() {
        let store = Arc::new(LocalStore::unbounded());
        let a = check("a", 100, Duration::from_secs(60));
        let b = check("b", 1_000, Duration::from_secs(60));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let store = Arc::clone(&store);
                // Half the threads name the keys in the other order.
                let checks = if t % 2 == 0 {
                    [a.clone(), b.clone()]
                } else {
                    [b.clone(), a.clone()]
                };
                std::thread::spawn(move || {
                    (0..500).filter(|_| store.decide(&checks).admitted).count()
                })
            })
            .collect();
        let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(admitted, 100);
        assert_eq!(store.times_of("a"), Some(100));
        assert_eq!(
            store.times_of("b"),
            Some(100),
            "rejections are not recorded"
        );
    }

    /// Resident memory of this process, in KiB: (now, peak). Panics where `/proc` cannot
    /// tell: a bound measured as 0 would pass without measuring anything.
    fn rss_kib() -> (u64, u64) {
        rss_kib_from(Path::new("/proc/self/status"))
    }

    fn rss_kib_from(path: &Path) -> (u64, u64) {
        let status = std::fs::read_to_string(path).unwrap_or_else(|err| {
            panic!(
                "cannot measure memory: reading {} failed: {err}",
                path.display()
            )
        });
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse().ok())
                .unwrap_or_else(|| panic!("cannot measure memory: no {name} in {}", path.display()))
        };
        let (now, peak) = (field("VmRSS:"), field("VmHWM:"));
        assert!(
            now > 0 && peak > 0,
            "cannot measure memory: {path:?} reads 0"
        );
        (now, peak)
    }

    /// Without `/proc` (another OS, a sandbox), the memory test fails instead of passing
    /// with a growth of 0.
    #[test]
    #[should_panic(expected = "cannot measure memory")]
    fn memory_cannot_be_measured_without_proc() {
        rss_kib_from(Path::new("/nonexistent/proc/self/status"));
    }

    const MEMORY_CHILD: &str = "SLUICE_LOCAL_STORE_MEMORY_CHILD";

    /// A flood of a million distinct identities against the default `max_keys` (100,000):
    /// the store holds at most that many keys, and memory stays under the bound the README
    /// documents. Run in a child process, so the figure is this store's alone.
    #[test]
    fn a_million_identities_stay_within_the_documented_memory_bound() {
        if std::env::var_os(MEMORY_CHILD).is_some() {
            return flood_a_million_identities();
        }
        let exe = std::env::current_exe().expect("the test binary");
        let output = std::process::Command::new(exe)
            .args([
                "--exact",
                "limiter::local::tests::a_million_identities_stay_within_the_documented_memory_bound",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MEMORY_CHILD, "1")
            .output()
            .expect("run the flood in a child process");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let grown_kib: u64 = stdout
            .lines()
            .find_map(|line| line.split_once("grown_kib=").map(|(_, n)| n))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("the child printed no figure: {stdout}"));
        // README: about 250 bytes per tracked key with one admission (measured 24.9 MB for
        // 100,000 keys), documented as under 40 MiB for the default bound.
        assert!(
            grown_kib < 40 * 1024,
            "resident memory grew by {grown_kib} KiB"
        );
    }

    fn flood_a_million_identities() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let _guard = runtime.enter();
        let metrics = test_metrics();
        let (keys, evictions) = (metrics.keys.clone(), metrics.evictions.clone());
        let max_keys = crate::config::DEFAULT_LOCAL_MAX_KEYS as usize;
        let store = LocalStore::new(max_keys, metrics);
        let (before, _) = rss_kib();
        let mut check = check("", 100, Duration::from_secs(60));
        for n in 0u32..1_000_000 {
            let [_, b, c, d] = n.to_be_bytes();
            check.key.clear();
            let _ = std::fmt::Write::write_fmt(
                &mut check.key,
                format_args!("sluice:api:per-ip:{{ip=10.{b}.{c}.{d}}}"),
            );
            assert!(store.decide(std::slice::from_ref(&check)).admitted);
        }
        let (_, peak) = rss_kib();
        let tracked = keys.get() as usize;
        assert!(tracked <= max_keys, "{tracked} keys tracked");
        assert!(tracked > max_keys * 9 / 10, "{tracked} keys tracked");
        assert_eq!(evictions.get() as usize, 1_000_000 - tracked);
        println!("grown_kib={}", peak.saturating_sub(before));
    }
}
