//! The concurrency leases this instance holds: the guard a request keeps while it is in
//! flight ([`Lease`]: dropped, the lease is released, whatever way the request ended), and,
//! with Redis, the renewal that keeps them alive (`renew`).
//!
//! Every lease is registered here under its key. Every `RENEW_TICK`, each key whose last
//! renewal is a quarter of its lease period old is renewed by one call for all such keys
//! (`leases.lua`), so Redis's work per period grows with the keys in use, not with the
//! requests. A key the store no longer knows this instance under (Redis restarted empty, a
//! failover to a replica that had not seen the lease) gets its leases back at once, sent
//! whole. A key this instance cannot renew before its deadline in Redis (a partition, Redis
//! down) is *lost*: the store will reclaim its leases, so the requests holding them are cut
//! (their answers end) before that deadline, never left running beside the requests other
//! instances then admit in their place.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntGauge};
use tokio::sync::watch;

use super::redis::{limit_of, RedisStore};
use super::{Admission, Algorithm, Check, Spec, Store};

/// How often the renewal looks at the keys held (and at the leases it may have to cut).
const RENEW_TICK: Duration = Duration::from_millis(100);

/// An acquire leaves an instance's deadline alone while it is more than a period less an
/// eighth of one away (`concurrency.lua`'s record, which spells the same eighth).
const ACQUIRE_SLACK: u32 = 8;

/// The counters of lease events (`sluice_concurrency_leases_total`).
#[derive(Clone)]
pub struct LeaseCounters {
    pub reclaimed: IntCounter,
    pub gone: IntCounter,
    pub restored: IntCounter,
    pub lost: IntCounter,
    pub wait_timeout: IntCounter,
}

/// The keys this instance holds leases under, with Redis.
#[derive(Default)]
pub struct Held {
    keys: Mutex<HashMap<String, HeldKey>>,
    /// Leases of requests that ended whose release failed, tried again every tick: a renewal
    /// keeps this instance alive under their keys, so they would never be reclaimed. At most
    /// the leases held when the store began to fail (no new one is taken in Redis meanwhile).
    orphans: Mutex<Vec<(Vec<Check>, Admission)>>,
    /// Per limit (its keys' common prefix, before the identity's `{`), how long its leases
    /// ended here were held, a moving average in microseconds: sent with each renewal as the
    /// key's retry hint. Bounded by the policy's concurrency limits.
    holds: Mutex<HashMap<String, u64>>,
    /// Raised to odd when a restore's leases are read and to even once its clean-up has
    /// landed: a release that overlapped one cannot tell a lease the store forgot from one the
    /// clean-up deleted, so it does not count it `gone` (`Lease::take_release`).
    restores: AtomicU64,
}

struct HeldKey {
    window: Duration,
    /// When the last renewal that landed under the key was sent (for a key held anew, its
    /// acquire's call less an eighth of the period): the deadline in Redis is at least this
    /// plus the period.
    renewed: Instant,
    /// Lease id → the signal that cuts its request.
    leases: HashMap<String, watch::Sender<bool>>,
    /// Leases whose release is on its way: still renewed, never restored (a restore landing
    /// after the release would write back a lease that ended, held for ever).
    ending: std::collections::HashSet<String>,
}

impl Held {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, HeldKey>> {
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers the lease `id` under each of `checks`, taken by a call sent at `sent`; the
    /// receiver says when it is lost.
    fn register(&self, checks: &[Check], id: &str, sent: Instant) -> watch::Receiver<bool> {
        let (lost, receiver) = watch::channel(false);
        let mut keys = self.lock();
        for check in checks {
            // An acquire moves this instance's deadline in Redis only when it is less than
            // 7/8 of a period away (concurrency.lua): a key held already keeps the time of the
            // last renewal; one held anew counts on 7/8 of a period from the call.
            let held = keys.entry(check.key.clone()).or_insert_with(|| HeldKey {
                window: check.spec.window,
                renewed: sent
                    .checked_sub(check.spec.window / ACQUIRE_SLACK)
                    .unwrap_or(sent),
                leases: HashMap::new(),
                ending: std::collections::HashSet::new(),
            });
            held.window = check.spec.window;
            held.leases.insert(id.to_owned(), lost.clone());
        }
        receiver
    }

    fn unregister(&self, checks: &[Check], id: &str) {
        let mut keys = self.lock();
        for check in checks {
            if let Some(held) = keys.get_mut(&check.key) {
                held.leases.remove(id);
                held.ending.remove(id);
                if held.leases.is_empty() {
                    keys.remove(&check.key);
                }
            }
        }
    }

    /// Marks the lease `id` as ending: its release is on its way.
    fn ending(&self, checks: &[Check], id: &str) {
        let mut keys = self.lock();
        for check in checks {
            if let Some(held) = keys.get_mut(&check.key) {
                held.ending.insert(id.to_owned());
            }
        }
    }

    /// Folds one lease's hold, `held`, into the average of each of `checks`' limits.
    fn held_for(&self, checks: &[Check], held: Duration) {
        let held = u64::try_from(held.as_micros()).unwrap_or(u64::MAX).max(1);
        let mut holds = self
            .holds
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for check in checks {
            let limit = limit_of(&check.key);
            match holds.get_mut(limit) {
                // An eighth of each new hold, as the in-process store's average.
                Some(hold) => *hold = (*hold * 7 + held) / 8,
                None => {
                    holds.insert(limit.to_owned(), held);
                }
            }
        }
    }

    /// The average hold of `key`'s limit (microseconds), 0 before any lease of it ended here.
    fn hold_of(&self, key: &str) -> u64 {
        self.holds
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(limit_of(key))
            .copied()
            .unwrap_or(0)
    }

    fn orphan(&self, checks: Vec<Check>, admission: Admission) {
        self.orphans
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push((checks, admission));
    }

    fn take_orphans(&self) -> Vec<(Vec<Check>, Admission)> {
        std::mem::take(
            &mut *self
                .orphans
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    /// The keys due for renewal at `now`, grouped by lease period.
    fn due(&self, now: Instant) -> HashMap<Duration, Vec<String>> {
        let mut due: HashMap<Duration, Vec<String>> = HashMap::new();
        for (key, held) in self.lock().iter() {
            if now.saturating_duration_since(held.renewed) >= held.window / 4 {
                due.entry(held.window).or_default().push(key.clone());
            }
        }
        due
    }

    fn renewed(&self, key: &str, sent: Instant) {
        if let Some(held) = self.lock().get_mut(key) {
            held.renewed = held.renewed.max(sent);
        }
    }

    /// The lease ids held under `key` whose release has not begun.
    fn ids(&self, key: &str) -> Vec<String> {
        self.lock()
            .get(key)
            .map(|held| {
                held.leases
                    .keys()
                    .filter(|id| !held.ending.contains(*id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Where the restores stand (see `restores`).
    fn restores(&self) -> u64 {
        self.restores.load(Ordering::Acquire)
    }

    /// Every key with the lease ids registered under it, forgotten here.
    fn take_all(&self) -> Vec<(String, Vec<String>)> {
        self.lock()
            .drain()
            .map(|(key, held)| (key, held.leases.into_keys().collect()))
            .collect()
    }

    /// Cuts the requests of every key whose deadline in Redis may pass before the next
    /// renewal could land (`margin` before it), and forgets those keys; how many leases.
    fn cut_expiring(&self, now: Instant, margin: Duration) -> usize {
        let mut cut = 0;
        self.lock().retain(|_, held| {
            let deadline = held.renewed + held.window;
            if now + margin < deadline {
                return true;
            }
            for lost in held.leases.values() {
                let _ = lost.send(true);
            }
            cut += held.leases.len();
            false
        });
        cut
    }
}

/// Renews the leases of `held` in `store` until `held` is dropped (see the module's comment).
pub(super) async fn renew(held: Weak<Held>, store: Arc<RedisStore>, counters: LeaseCounters) {
    let mut ticks = tokio::time::interval(RENEW_TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A lease is cut when its deadline in Redis is nearer than one more look and a little
    // slack: `renewed` is when the last renewal that landed was sent, so the deadline is at
    // least that plus the period. With the shortest lease (1 s), renewed every 250 ms, a
    // key is cut after 850 ms without a renewal landing.
    let margin = RENEW_TICK + Duration::from_millis(50);
    loop {
        ticks.tick().await;
        let Some(held) = held.upgrade() else {
            return;
        };
        for (window, keys) in held.due(Instant::now()) {
            renew_keys(&held, &store, &counters, window, keys).await;
        }
        for (checks, admission) in held.take_orphans() {
            match store.release(&checks, &admission, 0).await {
                Ok(released) => {
                    counters
                        .gone
                        .inc_by(checks.len().saturating_sub(released) as u64);
                    held.unregister(&checks, &admission.member);
                }
                Err(_) => held.orphan(checks, admission),
            }
        }
        let cut = held.cut_expiring(Instant::now(), margin);
        if cut > 0 {
            counters.lost.inc_by(cut as u64);
            tracing::warn!(
                leases = cut,
                "cannot renew concurrency leases before their deadline: their requests are cut, since the store will give their places to others"
            );
        }
    }
}

/// Releases every lease still registered (at exit: requests cut by the drain, releases that
/// had not landed), one call per key; how many.
pub(super) async fn end_all(held: &Held, store: &RedisStore) -> usize {
    let mut ended = 0;
    for (key, ids) in held.take_all() {
        if store.end_leases(&key, &ids).await.is_ok() {
            ended += ids.len();
        }
    }
    ended
}

/// One renewal call for `keys` (lease period `window`), and one restoring those the store
/// forgot: it writes back the leases still held here that the store lacks (a key this
/// instance renews for the first time has them all: nothing is added).
async fn renew_keys(
    held: &Held,
    store: &RedisStore,
    counters: &LeaseCounters,
    window: Duration,
    keys: Vec<String>,
) {
    let window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
    let checks: Vec<Check> = keys
        .into_iter()
        .map(|key| lease_check(key, window))
        .collect();
    let holds: Vec<u64> = checks.iter().map(|c| held.hold_of(&c.key)).collect();
    let sent = Instant::now();
    let answers = match store.renew(&checks, window_us, &holds, None).await {
        Ok(answers) => answers,
        Err(err) => {
            tracing::debug!(error = %err, "cannot renew concurrency leases; trying again");
            return;
        }
    };
    let mut unknown = Vec::new();
    let mut unknown_holds = Vec::new();
    for ((check, answer), hold) in checks.into_iter().zip(answers).zip(holds) {
        counters.reclaimed.inc_by(answer.reclaimed);
        if answer.known {
            held.renewed(&check.key, sent);
        } else {
            unknown.push(check);
            unknown_holds.push(hold);
        }
    }
    if unknown.is_empty() {
        return;
    }
    held.restores.fetch_add(1, Ordering::AcqRel);
    restore(held, store, counters, window_us, &unknown, &unknown_holds).await;
    held.restores.fetch_add(1, Ordering::AcqRel);
}

/// Writes back the leases of `unknown` still held here (none whose release has begun), then
/// deletes again those whose release began meanwhile: a release that landed before the restore
/// would otherwise leave its lease written back, held for ever.
async fn restore(
    held: &Held,
    store: &RedisStore,
    counters: &LeaseCounters,
    window_us: u64,
    unknown: &[Check],
    unknown_holds: &[u64],
) {
    let ids: Vec<Vec<String>> = unknown.iter().map(|c| held.ids(&c.key)).collect();
    let sent = Instant::now();
    let answers = match store
        .renew(unknown, window_us, unknown_holds, Some(&ids))
        .await
    {
        Ok(answers) => answers,
        Err(err) => {
            tracing::debug!(error = %err, "cannot restore concurrency leases; trying again");
            return;
        }
    };
    let restored: u64 = answers.iter().map(|a| a.restored).sum();
    counters.restored.inc_by(restored);
    if restored > 0 {
        tracing::warn!(
            leases = restored,
            "the store had forgotten concurrency leases of requests still in flight (restarted empty, or failed over): restored"
        );
    }
    for (check, sent_ids) in unknown.iter().zip(ids) {
        held.renewed(&check.key, sent);
        // Ended or ending now, though sent: deleted again, whichever lands first.
        let now_held = held.ids(&check.key);
        let ended: Vec<String> = sent_ids
            .into_iter()
            .filter(|id| !now_held.contains(id))
            .collect();
        if !ended.is_empty() {
            let _ = store.end_leases(&check.key, &ended).await;
        }
    }
}

fn lease_check(key: String, window: Duration) -> Check {
    Check {
        key,
        spec: Spec {
            algorithm: Algorithm::Concurrency,
            window,
            ..Spec::default()
        },
    }
}

/// A lease shared by the answer and, for a WebSocket, its tunnel (which takes it from the
/// request's extensions); released when the last holder goes.
#[derive(Clone)]
pub struct LeaseHold(pub Arc<Lease>);

/// A request's leases in the concurrency limits that admitted it. Held while the request is
/// in flight; dropped, its leases are released (in a task of their own: a drop cannot wait).
pub struct Lease {
    store: Arc<Store>,
    checks: Vec<Check>,
    admission: Admission,
    /// `sluice_concurrency_in_flight` of each limit, raised while this lives.
    gauges: Vec<IntGauge>,
    lost: Option<watch::Receiver<bool>>,
    /// When the call that took it was sent: its hold, at the end, feeds the retry hint.
    taken: Instant,
    /// Released already (`end`), so a drop does nothing more.
    ended: AtomicBool,
}

impl Lease {
    /// Holds the leases `admission` took under `checks` (the request's concurrency checks),
    /// decided by a call sent at `sent`.
    pub fn hold(
        store: &Arc<Store>,
        checks: Vec<Check>,
        admission: Admission,
        gauges: Vec<IntGauge>,
        sent: Instant,
    ) -> Lease {
        for gauge in &gauges {
            gauge.inc();
        }
        // Only Redis's leases are renewed (and can be lost): an in-process one lives as long
        // as its holder, this process.
        let lost = match store.held_leases() {
            Some(held) if !admission.local => Some(held.register(&checks, &admission.member, sent)),
            _ => None,
        };
        Lease {
            store: Arc::clone(store),
            checks,
            admission,
            gauges,
            lost,
            taken: sent,
            ended: AtomicBool::new(false),
        }
    }

    /// Ends when the lease is lost (it could not be renewed before its deadline); never for a
    /// lease that cannot be.
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let lost = self.lost.clone();
        async move {
            if let Some(mut lost) = lost {
                if lost.wait_for(|lost| *lost).await.is_ok() {
                    return;
                }
            }
            std::future::pending::<()>().await;
        }
    }
}

impl Lease {
    /// Releases the leases now, to be awaited (the answer's last frame waits for it, so a
    /// client that sends its next request the moment it has the answer finds its place
    /// free); a later drop does nothing more.
    ///
    /// The release runs in a task of its own, which this future only waits for: a client
    /// that goes away while it is on its way drops the wait, never the release (dropped
    /// half-way, a lease would stay registered, renewed for ever, and held in the store).
    pub fn end(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let running = self.take_release().and_then(|release| {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            Some(runtime.spawn(release))
        });
        async move {
            if let Some(running) = running {
                let _ = running.await;
            }
        }
    }

    /// The release, the first time it is asked for: the gauges and the renewal let go of
    /// the leases at once, the store call is the future's.
    fn take_release(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        if self.ended.swap(true, Ordering::AcqRel) {
            return None;
        }
        for gauge in &self.gauges {
            gauge.dec();
        }
        let store = Arc::clone(&self.store);
        let checks = self.checks.clone();
        let admission = self.admission.clone();
        // Still registered until the store has it back: renewed meanwhile, and released at
        // exit (`Store::end_leases`) if the process stops first.
        let registered = self.lost.is_some();
        if let (Some(held), true) = (self.store.held_leases(), registered) {
            held.held_for(&self.checks, self.taken.elapsed());
            held.ending(&self.checks, &self.admission.member);
        }
        // Read as the lease is marked ending, not when the release's task first runs: a
        // restore whose clean-up deleted the lease in between must count as overlapping.
        let restores = store.held_leases().map(|held| held.restores());
        Some(async move {
            match store.release(&checks, &admission).await {
                Ok(released) => {
                    // A restore that overlapped the release may have deleted the lease first.
                    let overlapped = restores.is_some_and(|before| {
                        before % 2 == 1 || store.held_leases().map(|h| h.restores()) != Some(before)
                    });
                    if !overlapped {
                        store.count_gone(checks.len().saturating_sub(released));
                    }
                    if let (Some(held), true) = (store.held_leases(), registered) {
                        held.unregister(&checks, &admission.member);
                    }
                }
                Err(err) => {
                    tracing::debug!(store = store.name(), error = %err, "cannot release a concurrency lease; trying again");
                    if let (Some(held), true) = (store.held_leases(), registered) {
                        held.orphan(checks, admission);
                    }
                }
            }
        })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(release) = self.take_release() else {
            return;
        };
        // A drop cannot wait: the release goes on in a task of its own.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(key: &str) -> Check {
        lease_check(key.to_owned(), Duration::from_secs(10))
    }

    #[test]
    fn the_hold_hint_is_an_average_per_limit() {
        let held = Held::default();
        let (a, b) = (
            check("p:r:l:concurrency:{1}"),
            check("p:r:l:concurrency:{2}"),
        );
        assert_eq!(held.hold_of(&a.key), 0, "nothing ended yet: no hint sent");
        held.held_for(std::slice::from_ref(&a), Duration::from_millis(800));
        assert_eq!(held.hold_of(&b.key), 800_000, "one limit, every identity");
        held.held_for(std::slice::from_ref(&b), Duration::from_millis(1600));
        assert_eq!(held.hold_of(&a.key), 900_000, "an eighth of the new hold");
        assert_eq!(held.hold_of("p:r:other:concurrency:{1}"), 0);
    }
}
