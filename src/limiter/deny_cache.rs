//! The exact deny cache: a rejection remembered locally, so a flood on one key costs Redis one
//! call per wait instead of one per request.
//!
//! Why it is exact: when Redis rejects a key because its limit is full, it also says when
//! room comes back. For an algorithm whose row in the table says `room_grows_with_time_only`,
//! a key's room only shrinks through admissions and only grows with time, and that wait is the
//! exact time it grows back enough for the request's cost. Until then no instance can admit
//! that key, so answering "rejected" from memory until then is what Redis would answer. The
//! wait is counted from when the call was *sent* (Redis read its clock later), so the cache
//! never outlasts the truth. Each algorithm's module says why its room grows only with time
//! and its wait is exact (its "The deny cache" paragraph). An algorithm whose room can come
//! back at any moment (a released lease) is never remembered. For a row with
//! `window_per_request` (a calendar period's time left), the window, which differs per
//! request, is not compared (`same_limit`).
//!
//! When a denial expires under a flood, the requests waiting on that key would all miss at
//! once and all ask Redis, though only the first can be admitted (room comes back one
//! request at a time for the exact algorithms). So the misses are coalesced: the first
//! request after the expiry asks the store (`Lookup::Ask`), and the others wait for its
//! answer (`Lookup::Wait`, at most the store timeout), then look again: a new denial answers
//! them from memory. When the asker was admitted and left its limit full, the key stays
//! coalesced and the next waiter asks; when it left room, or failed, the waiters do what they
//! did before, each asking the store. Only a denial that expired within `COALESCE_FOR` is
//! coalesced, so a key quiet for a while is never held back.
//!
//! Entries are keyed by the store key *and* every parameter that changes a decision
//! (algorithm, `requests`, `window`, `burst`, `cost`), so a changed limit never reuses a stale
//! denial (envoy ratelimit's cache is wrong there, their #1077).
//! A reset or an override made through another instance can end a denial early, so denials
//! are remembered only while the store's events are heard (`redis::events`): each event
//! forgets the denials under the keys it names, and a subscription lost forgets them all and
//! stops remembering until it is back.
//! The cache is bounded; when a shard is full, expired entries are dropped, and if none has
//! expired the new denial is simply not remembered (Redis decides it next time).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Check, Decision, LimitState, Spec};

const SHARDS: usize = 16;

/// Most denials remembered at once, over all shards.
pub const MAX_ENTRIES: usize = 65_536;

/// How long after its expiry a denial's key is still coalesced: a flood keeps asking within
/// this time; a key quiet for longer is decided as any other.
const COALESCE_FOR: Duration = Duration::from_secs(1);

struct Denial {
    spec: Spec,
    /// Denied until then; after it, the key is coalesced for `COALESCE_FOR`.
    until: Instant,
    /// Some request is asking the store for this key: its answer wakes this (the asker's
    /// sender is dropped).
    asking: Option<watch::Receiver<()>>,
}

/// What the cache says about a request's checks.
pub enum Lookup {
    /// A remembered denial answers it.
    Denied(Decision),
    /// Nothing is known: ask the store.
    Miss,
    /// A denial of one of its keys has just expired: ask the store, and tell the cache the
    /// answer (`DenyCache::asked`), which the requests waiting on this key then read.
    Ask(Asking),
    /// Another request is asking the store for one of its keys: wait until `changed()` ends
    /// (its answer, or its failure), then look again.
    Wait(watch::Receiver<()>),
}

/// The request that asks the store for a key whose denial has expired. Dropping it wakes the
/// requests waiting on that key.
pub struct Asking {
    key: String,
    waiters: watch::Sender<()>,
}

pub struct DenyCache {
    shards: Vec<Mutex<HashMap<String, Denial>>>,
    hasher: RandomState,
    /// Whether this instance hears the store's events (`redis::events`): a denial is
    /// remembered only while it does, since a reset or an override elsewhere could end it.
    listening: AtomicBool,
}

impl DenyCache {
    pub fn new() -> DenyCache {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            listening: AtomicBool::new(false),
        }
    }

    /// Whether the store's events are heard from now on. Either way every denial is forgotten:
    /// one remembered before a subscription came up may have missed an event, and none is to
    /// be answered while they are not heard.
    pub fn listening(&self, listening: bool) {
        self.listening.store(listening, Ordering::Release);
        self.forget_prefix("");
    }

    /// Forgets every denial under a store key starting with `prefix`; how many.
    pub fn forget_prefix(&self, prefix: &str) -> usize {
        let mut forgotten = 0;
        for shard in &self.shards {
            let mut shard = shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let before = shard.len();
            shard.retain(|key, _| !key.starts_with(prefix));
            forgotten += before - shard.len();
        }
        forgotten
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Denial>> {
        let index = (self.hasher.hash_one(key) % SHARDS as u64) as usize;
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What to do with a request of `checks` at `now`: answer a remembered denial, wait for
    /// another request asking about one of its keys, ask the store on their behalf, or ask it
    /// as usual.
    pub fn lookup(&self, checks: &[Check], now: Instant) -> Lookup {
        if let Some(decision) = self.answer(checks, now) {
            return Lookup::Denied(decision);
        }
        let mut open = None;
        for check in checks {
            let mut shard = self.shard(&check.key);
            let Some(denial) = shard.get_mut(&check.key) else {
                continue;
            };
            if !same_limit(&denial.spec, &check.spec) || denial.until + COALESCE_FOR <= now {
                continue;
            }
            match &denial.asking {
                // An asker that went away without an answer (its request was cancelled) wakes
                // its waiters as it goes; the key is open again.
                Some(asking) if asking.has_changed().is_ok() => {
                    return Lookup::Wait(asking.clone());
                }
                _ if open.is_none() => {
                    let (waiters, asking) = watch::channel(());
                    denial.asking = Some(asking);
                    open = Some(Asking {
                        key: check.key.clone(),
                        waiters,
                    });
                }
                _ => {}
            }
        }
        open.map_or(Lookup::Miss, Lookup::Ask)
    }

    /// Records what the store answered the request that was `asking` (after `remember`, for
    /// a decision), then wakes the requests waiting on its key. A new denial has replaced
    /// the entry already. An admission that left the key's limit full keeps the key
    /// coalesced (the next request asks while the others wait); room left, or a failed
    /// call, ends it: the waiters ask the store as usual.
    pub fn asked(&self, asking: Asking, checks: &[Check], result: Option<&Decision>) {
        let full = result.is_some_and(|decision| {
            checks.iter().zip(&decision.limits).any(|(check, state)| {
                check.key == asking.key && state.is_some_and(|s| s.remaining == 0)
            })
        });
        let mut shard = self.shard(&asking.key);
        if let Some(denial) = shard.get_mut(&asking.key) {
            let ours = denial
                .asking
                .as_ref()
                .is_some_and(|rx| rx.same_channel(&asking.waiters.subscribe()));
            if ours {
                if full && result.is_some_and(|decision| decision.admitted) {
                    denial.asking = None;
                    denial.until = Instant::now();
                } else {
                    shard.remove(&asking.key);
                }
            }
        }
        drop(shard);
        drop(asking);
    }

    /// The rejection for `checks` if any of them is remembered as denied at `now`: exhausted
    /// limits known from the cache, the others unknown (`None`).
    pub fn answer(&self, checks: &[Check], now: Instant) -> Option<Decision> {
        let mut limits = Vec::new();
        let mut retry_after = Duration::ZERO;
        for (index, check) in checks.iter().enumerate() {
            let until = self.denied_until(check, now);
            if let Some(until) = until {
                if limits.is_empty() {
                    limits = vec![None; checks.len()];
                }
                let wait = until - now;
                retry_after = retry_after.max(wait);
                limits[index] = Some(LimitState {
                    remaining: 0,
                    reset: wait,
                    overridden: None,
                });
            }
        }
        let rejecting = limits.iter().map(Option::is_some).collect();
        (!limits.is_empty()).then_some(Decision {
            admitted: false,
            retry_after,
            limits,
            rejecting,
            admission: None,
            crossed: Vec::new(),
        })
    }

    fn denied_until(&self, check: &Check, now: Instant) -> Option<Instant> {
        let shard = self.shard(&check.key);
        let denial = shard.get(&check.key)?;
        let same_limit = same_limit(&denial.spec, &check.spec);
        (same_limit && denial.until > now && denial.asking.is_none()).then_some(denial.until)
    }

    /// Forgets the denials of these keys: their room grew other than with time (a release).
    pub fn forget_checks(&self, checks: &[Check]) {
        for check in checks {
            self.forget(&check.key);
        }
    }

    /// Remembers every exhausted limit of a rejection decided by a store call sent at `sent`.
    pub fn remember(&self, checks: &[Check], decision: &Decision, sent: Instant) {
        if decision.admitted || !self.listening.load(Ordering::Acquire) {
            return;
        }
        // A shadow limit's "rejection" rejected nothing: it is never remembered as a denial.
        let rejecting = checks
            .iter()
            .zip(&decision.limits)
            .zip(&decision.rejecting)
            .filter(|&((check, _), &rejects)| {
                rejects
                    && !check.spec.shadow
                    && !check.spec.returnable
                    && check.spec.algorithm.traits().room_grows_with_time_only
            })
            .filter_map(|((check, state), _)| Some((check, (*state)?)))
            .filter(|(_, state)| !state.reset.is_zero());
        let alone = rejecting.clone().count() == 1;
        for (check, state) in rejecting {
            // With cost 1 a full limit's reset is exactly its wait. With a larger cost the wait
            // is longer: the request's retry-after when this limit alone rejects it, otherwise
            // the reset, which ends the denial early (a store call), never late.
            let wait = if check.spec.cost > 1 && alone {
                decision.retry_after
            } else {
                state.reset
            };
            // A limit that delays (`on_exceed: delay`) admits again, held, as soon as its wait
            // is within `max_delay`.
            let wait = wait.saturating_sub(check.spec.max_delay);
            if wait.is_zero() {
                continue;
            }
            let denial = Denial {
                spec: check.spec,
                until: sent + wait,
                asking: None,
            };
            let mut shard = self.shard(&check.key);
            if shard.len() >= MAX_ENTRIES / SHARDS && !shard.contains_key(&check.key) {
                let now = Instant::now();
                shard.retain(|_, denial| denial.until + COALESCE_FOR > now);
                if shard.len() >= MAX_ENTRIES / SHARDS {
                    continue;
                }
            }
            shard.insert(check.key.clone(), denial);
        }
    }
}

/// Whether a denial remembered for `remembered` holds for `now`. A calendar quota's window
/// is the time left in its period, different for every request: it changes no decision
/// (the key names the period, so a new period is a new key), so it is left out.
fn same_limit(remembered: &Spec, now: &Spec) -> bool {
    if now.algorithm.traits().window_per_request {
        Spec {
            window: now.window,
            ..*remembered
        } == *now
    } else {
        remembered == now
    }
}

impl DenyCache {
    /// Forgets a remembered denial of `key` (whatever its limit's parameters), so the next
    /// request is decided by Redis; whether there was one. For the admin API's reset.
    pub fn forget(&self, key: &str) -> bool {
        self.shard(key).remove(key).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache whose instance hears the store's events (it remembers denials).
    fn heard() -> DenyCache {
        let cache = DenyCache::new();
        cache.listening(true);
        cache
    }

    fn check(key: &str, requests: u32, window_s: u64) -> Check {
        Check {
            key: key.to_owned(),
            spec: Spec {
                requests,
                algorithm: crate::limiter::Algorithm::SlidingLog,
                window: Duration::from_secs(window_s),
                burst: requests,
                cost: 1,
                ..Spec::default()
            },
        }
    }

    fn rejected(states: Vec<Option<LimitState>>) -> Decision {
        Decision {
            admitted: false,
            retry_after: Duration::from_secs(5),
            rejecting: states
                .iter()
                .map(|s| s.is_some_and(|s| s.remaining == 0))
                .collect(),
            limits: states,
            admission: None,
            crossed: Vec::new(),
        }
    }

    fn full(reset_s: u64) -> Option<LimitState> {
        Some(LimitState {
            remaining: 0,
            reset: Duration::from_secs(reset_s),
            overridden: None,
        })
    }

    #[test]
    fn a_denial_is_answered_until_it_expires_and_only_for_the_same_limit() {
        let cache = heard();
        let sent = Instant::now();
        let checks = [check("a", 5, 60), check("b", 100, 60)];
        let open = Some(LimitState {
            remaining: 40,
            reset: Duration::from_secs(1),
            overridden: None,
        });
        cache.remember(&checks, &rejected(vec![full(5), open]), sent);

        let answer = cache
            .answer(&checks, sent + Duration::from_secs(1))
            .unwrap();
        assert!(!answer.admitted);
        assert_eq!(answer.retry_after, Duration::from_secs(4));
        assert_eq!(answer.limits[0], full(4));
        assert_eq!(
            answer.limits[1], None,
            "a limit with room is not remembered"
        );

        assert!(cache
            .answer(&checks, sent + Duration::from_secs(5))
            .is_none());
        let raised = [check("a", 6, 60)];
        assert!(
            cache
                .answer(&raised, sent + Duration::from_secs(1))
                .is_none(),
            "a changed limit never reuses a denial"
        );
    }

    #[test]
    fn an_admission_remembers_nothing() {
        let cache = heard();
        let checks = [check("a", 1, 60)];
        let admitted = Decision {
            admitted: true,
            retry_after: Duration::ZERO,
            limits: vec![full(60)],
            rejecting: vec![false],
            admission: None,
            crossed: Vec::new(),
        };
        cache.remember(&checks, &admitted, Instant::now());
        assert!(cache.answer(&checks, Instant::now()).is_none());
    }

    #[test]
    fn a_shadow_rejection_is_never_remembered() {
        let cache = heard();
        let mut shadow = check("a", 1, 60);
        shadow.spec.shadow = true;
        let checks = [shadow, check("b", 1, 60)];
        cache.remember(&checks, &rejected(vec![full(60), full(30)]), Instant::now());
        assert!(cache.answer(&checks[..1], Instant::now()).is_none());
        assert!(cache.answer(&checks[1..], Instant::now()).is_some());
    }

    #[test]
    fn a_delay_limit_is_denied_only_until_it_would_hold_the_request() {
        let cache = heard();
        let sent = Instant::now();
        let mut delayed = check("a", 5, 60);
        delayed.spec.max_delay = Duration::from_secs(2);
        let checks = [delayed];
        cache.remember(&checks, &rejected(vec![full(5)]), sent);
        let answer = cache.answer(&checks, sent).expect("remembered");
        assert_eq!(answer.retry_after, Duration::from_secs(3));
        assert!(cache
            .answer(&checks, sent + Duration::from_secs(3))
            .is_none());
        // A wait within max_delay is no denial at all.
        let cache = heard();
        cache.remember(&checks, &rejected(vec![full(2)]), sent);
        assert!(cache.answer(&checks, sent).is_none());
    }

    #[test]
    fn a_returnable_limit_is_never_remembered_and_forget_drops_a_denial() {
        let cache = heard();
        let mut counted = check("a", 1, 60);
        counted.spec.returnable = true;
        let checks = [counted, check("b", 1, 60)];
        cache.remember(&checks, &rejected(vec![full(60), full(30)]), Instant::now());
        assert!(cache.answer(&checks[..1], Instant::now()).is_none());
        assert!(cache.answer(&checks[1..], Instant::now()).is_some());
        cache.forget_checks(&checks[1..]);
        assert!(cache.answer(&checks[1..], Instant::now()).is_none());
    }

    /// Unheard store events: every denial forgotten and none remembered until they are heard
    /// again; an event forgets the denials under its prefix only.
    #[test]
    fn denials_are_remembered_only_while_events_are_heard() {
        let cache = heard();
        let checks = [check("p:{a}", 1, 60), check("p:{ab}", 1, 60)];
        let denial = rejected(vec![full(60), full(60)]);
        cache.remember(&checks, &denial, Instant::now());
        assert_eq!(cache.forget_prefix("p:{a}"), 1);
        assert!(cache.answer(&checks[1..], Instant::now()).is_some());
        cache.listening(false);
        assert!(cache.answer(&checks[1..], Instant::now()).is_none());
        cache.remember(&checks, &denial, Instant::now());
        assert!(cache.answer(&checks[..1], Instant::now()).is_none());
        cache.listening(true);
        cache.remember(&checks, &denial, Instant::now());
        assert!(cache.answer(&checks[..1], Instant::now()).is_some());
    }

    #[test]
    fn a_quota_denial_holds_for_later_requests_of_its_period_until_it_ends() {
        let cache = heard();
        let sent = Instant::now();
        let mut quota = check("q:{a}:2026-11", 5, 100);
        quota.spec.algorithm = crate::limiter::Algorithm::Calendar;
        cache.remember(
            std::slice::from_ref(&quota),
            &rejected(vec![full(100)]),
            sent,
        );
        // A second later the request's window (the time left) is a second shorter.
        let mut later = quota.clone();
        later.spec.window = Duration::from_secs(99);
        let answer = cache
            .answer(std::slice::from_ref(&later), sent + Duration::from_secs(1))
            .expect("still denied");
        assert_eq!(answer.retry_after, Duration::from_secs(99));
        assert!(cache
            .answer(
                std::slice::from_ref(&later),
                sent + Duration::from_secs(100)
            )
            .is_none());
        let mut raised = later.clone();
        raised.spec.requests = 6;
        assert!(cache
            .answer(&[raised], sent + Duration::from_secs(1))
            .is_none());
    }

    #[test]
    fn after_a_denial_expires_one_request_asks_and_the_others_wait_for_its_answer() {
        let cache = heard();
        let sent = Instant::now();
        let checks = [check("a", 5, 60)];
        cache.remember(&checks, &rejected(vec![full(5)]), sent);
        let expired = sent + Duration::from_secs(5);
        let Lookup::Ask(asking) = cache.lookup(&checks, expired) else {
            panic!("the first request after the expiry asks");
        };
        let Lookup::Wait(answered) = cache.lookup(&checks, expired) else {
            panic!("the next one waits");
        };
        // The asker is rejected again: the waiters read the new denial.
        cache.remember(&checks, &rejected(vec![full(3)]), expired);
        cache.asked(asking, &checks, Some(&rejected(vec![full(3)])));
        assert!(answered.has_changed().is_err(), "the waiters are woken");
        assert!(matches!(cache.lookup(&checks, expired), Lookup::Denied(_)));

        // The next asker fails: the waiters ask as usual.
        let later = expired + Duration::from_secs(3);
        let Lookup::Ask(asking) = cache.lookup(&checks, later) else {
            panic!("asks again after the new denial");
        };
        cache.asked(asking, &checks, None);
        assert!(matches!(cache.lookup(&checks, later), Lookup::Miss));
    }

    #[test]
    fn an_asker_that_is_cancelled_leaves_the_key_to_the_next_request() {
        let cache = heard();
        let sent = Instant::now();
        let checks = [check("a", 5, 60)];
        cache.remember(&checks, &rejected(vec![full(1)]), sent);
        let expired = sent + Duration::from_secs(1);
        let Lookup::Ask(asking) = cache.lookup(&checks, expired) else {
            panic!("asks");
        };
        drop(asking);
        assert!(matches!(cache.lookup(&checks, expired), Lookup::Ask(_)));
        // Long after the expiry the key is decided as any other.
        let quiet = expired + COALESCE_FOR + Duration::from_secs(1);
        assert!(matches!(cache.lookup(&checks, quiet), Lookup::Miss));
    }

    #[test]
    fn the_cache_is_bounded() {
        let cache = heard();
        let sent = Instant::now();
        for n in 0..MAX_ENTRIES * 2 {
            let checks = [check(&format!("k{n}"), 1, 60)];
            cache.remember(&checks, &rejected(vec![full(60)]), sent);
        }
        let held: usize = cache.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= MAX_ENTRIES, "{held}");
    }
}
