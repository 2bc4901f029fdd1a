//! The store's calls: decide, release, peek and reset, each one script call (on a cluster,
//! one per slot the request's limits live in).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::super::overrides::{self, Override};
use super::super::{Admission, Algorithm, Check, Decision, Peek, StoreError};
use super::batch::{self, Pending};
use super::cluster;
use super::scripts::decision_from_reply;
use super::{Link, RedisStore};

impl RedisStore {
    pub async fn decide(&self, checks: &[Check]) -> Result<Decision, StoreError> {
        let member = format!(
            "{:016x}-{}",
            self.instance,
            self.sequence.fetch_add(1, Ordering::Relaxed)
        );
        if matches!(self.link, Link::Cluster(_)) {
            if let Some(groups) = cluster::slot_groups(checks) {
                return self.decide_across_slots(checks, &groups, &member).await;
            }
        }
        self.decide_in_one_call(checks.iter(), member, true).await
    }

    /// One decision of `checks`, whose keys must share a slot on a cluster; without
    /// `may_delay`, delay limits reject instead. On a node it joins the batch of its
    /// connection (`batch`); on a cluster it is a call of its own.
    async fn decide_in_one_call<'a>(
        &self,
        checks: impl ExactSizeIterator<Item = &'a Check> + Clone,
        member: String,
        may_delay: bool,
    ) -> Result<Decision, StoreError> {
        let count = checks.len();
        let (pending, answer) =
            Pending::new(checks.clone(), member.clone(), may_delay, &self.epochs);
        let reply = if matches!(self.link, Link::Cluster(_)) {
            let cmd = batch::command(
                &self.shared.script,
                std::slice::from_ref(&pending),
                self.shared.timeout,
            );
            self.run::<Vec<i64>>(&cmd, Some(&self.shared.script))
                .await?
        } else {
            self.batched(pending, answer).await?
        };
        self.epochs.answered(checks);
        decision_from_reply(&reply, count, member)
    }

    /// Queues `pending` on its connection's batch and waits for its part of the reply,
    /// bounded by the timeout.
    async fn batched(
        &self,
        pending: Pending,
        answer: tokio::sync::oneshot::Receiver<Result<Vec<i64>, StoreError>>,
    ) -> Result<Vec<i64>, StoreError> {
        self.enqueue(pending)?;
        let result = self
            .bounded(async {
                answer.await.unwrap_or_else(|_| {
                    Err(StoreError::Connection(
                        "the connection's writer stopped".to_owned(),
                    ))
                })
            })
            .await;
        if let Err(StoreError::Connection(_) | StoreError::Timeout(_)) = &result {
            // A failover would explain it (`failed`).
            self.rediscover();
        }
        result
    }

    /// A request whose limits live in several cluster slots: each slot decided by its own
    /// call, all at once; when any rejects, the others' admissions are given back (see
    /// `cluster` for what this guarantees).
    async fn decide_across_slots(
        &self,
        checks: &[Check],
        groups: &[Vec<usize>],
        member: &str,
    ) -> Result<Decision, StoreError> {
        // No delay across slots: their masters' clocks cannot agree on one future instant.
        let calls = groups.iter().map(|members| {
            self.decide_in_one_call(
                members.iter().map(|&index| &checks[index]),
                member.to_owned(),
                false,
            )
        });
        let results = futures_util::future::join_all(calls).await;
        let mut decisions = Vec::with_capacity(results.len());
        let mut failure = None;
        for result in results {
            match result {
                Ok(decision) => decisions.push(Some(decision)),
                Err(err) => {
                    decisions.push(None);
                    failure = Some(err);
                }
            }
        }
        let rejected = failure.is_some() || decisions.iter().flatten().any(|d| !d.admitted);
        if rejected {
            // Give back what the slots that admitted recorded: the request is not forwarded.
            let admitted = groups
                .iter()
                .zip(&decisions)
                .filter_map(|(members, d)| Some((members, d.as_ref()?.admission.as_ref()?)));
            let releases = admitted.map(|(members, admission)| {
                self.release_in_one_call(members.iter().map(|&index| &checks[index]), admission, 0)
            });
            for result in futures_util::future::join_all(releases).await {
                if let Err(err) = result {
                    tracing::warn!(error = %err, "cannot give back a cluster slot's admission of a rejected request; it expires with its window");
                }
            }
        }
        if let Some(err) = failure {
            return Err(err);
        }
        let decisions: Vec<Decision> = decisions.into_iter().flatten().collect();
        Ok(cluster::merge(checks.len(), groups, &decisions))
    }

    /// Settles what the request of `admission` recorded under `checks` to `keep` units of
    /// each: gives back the rest, or charges an overrun when `keep` is above a check's cost
    /// (`release.lua`); on a cluster, one call per slot the checks live in.
    pub async fn release(
        &self,
        checks: &[Check],
        admission: &Admission,
        keep: u32,
    ) -> Result<usize, StoreError> {
        // A request's concurrency leases given back whole: an `HDEL` each, no script call.
        if keep == 0
            && checks
                .iter()
                .all(|check| check.spec.algorithm == Algorithm::Concurrency)
        {
            return self.end_lease(checks, &admission.member).await;
        }
        let groups = match &self.link {
            Link::Cluster(_) => cluster::slot_groups(checks),
            Link::Single | Link::Sentinel(_) => None,
        };
        let Some(groups) = groups else {
            return self
                .release_in_one_call(checks.iter(), admission, keep)
                .await;
        };
        let calls = groups.iter().map(|members| {
            self.release_in_one_call(members.iter().map(|&index| &checks[index]), admission, keep)
        });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .sum()
    }

    /// One call of the release script over `checks`, whose keys must share a slot on a
    /// cluster; how many held something to settle.
    async fn release_in_one_call<'a>(
        &self,
        checks: impl ExactSizeIterator<Item = &'a Check> + Clone,
        admission: &Admission,
        keep: u32,
    ) -> Result<usize, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.shared.release.get_hash()).arg(checks.len());
        for check in checks.clone() {
            cmd.arg(&check.key);
        }
        cmd.arg(&admission.member)
            .arg(admission.at_us)
            .arg(admission.decided_us);
        for check in checks {
            let spec = check.spec;
            cmd.arg(spec.algorithm.label())
                .arg(spec.requests)
                .arg(spec.window_us())
                .arg(spec.cost)
                .arg(keep);
        }
        let released: i64 = self.run(&cmd, Some(&self.shared.release)).await?;
        Ok(usize::try_from(released).unwrap_or(0))
    }

    /// Renews this instance's leases under `keys` (concurrency keys, all with the lease
    /// period `window_us`), or restores them when `restore` gives each key's lease ids
    /// (`leases.lua`); on a cluster, one call per slot. Per key, in order: whether the store
    /// still knew this instance there, the leases it reclaimed from dead instances, and the
    /// leases a restore wrote back.
    pub async fn renew(
        &self,
        keys: &[Check],
        window_us: u64,
        holds_us: &[u64],
        restore: Option<&[Vec<String>]>,
    ) -> Result<Vec<Renewed>, StoreError> {
        let groups = match &self.link {
            Link::Cluster(_) => cluster::slot_groups(keys),
            Link::Single | Link::Sentinel(_) => None,
        }
        .unwrap_or_else(|| vec![(0..keys.len()).collect()]);
        let mut answers = vec![Renewed::default(); keys.len()];
        for members in groups {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(self.shared.leases.get_hash()).arg(members.len());
            for &index in &members {
                cmd.arg(&keys[index].key);
            }
            cmd.arg(format!("{:016x}", self.instance))
                .arg(window_us)
                .arg(u8::from(restore.is_some()));
            for &index in &members {
                cmd.arg(holds_us.get(index).copied().unwrap_or(0));
            }
            if let Some(leases) = restore {
                for &index in &members {
                    let ids = leases.get(index).map_or(&[][..], Vec::as_slice);
                    cmd.arg(ids.len());
                    for id in ids {
                        cmd.arg(id);
                    }
                }
            }
            let reply: Vec<i64> = self.run(&cmd, Some(&self.shared.leases)).await?;
            if reply.len() != 3 * members.len() {
                return Err(StoreError::Script(format!(
                    "unexpected lease renewal reply {reply:?}"
                )));
            }
            for (three, &index) in reply.chunks_exact(3).zip(&members) {
                answers[index] = Renewed {
                    known: three[0] == 1,
                    reclaimed: u64::try_from(three[1]).unwrap_or(0),
                    restored: u64::try_from(three[2]).unwrap_or(0),
                };
            }
        }
        Ok(answers)
    }

    /// Ends the concurrency lease `member` under each of `checks` (its own id only: `HDEL`,
    /// idempotent); how many were still there. On a node, in the decide script's next batched
    /// call on the connection (a call of its own per end cost Redis as much again as the
    /// decision, bench/HISTORY.md, "Concurrency limits, the ends batched"); on a cluster, a plain `HDEL` to each key's master.
    async fn end_lease(&self, checks: &[Check], member: &str) -> Result<usize, StoreError> {
        if !matches!(self.link, Link::Cluster(_)) {
            // In the next call of the connection's batch (`batch`): no call of its own.
            let (pending, answer) = Pending::end(checks.iter(), member.to_owned());
            let reply = self.batched(pending, answer).await?;
            return Ok(reply.iter().filter(|&&was| was == 1).count());
        }
        let calls = checks.iter().map(|check| async move {
            let mut cmd = redis::cmd("HDEL");
            cmd.arg(&check.key).arg(member);
            self.run::<i64>(&cmd, None).await
        });
        let mut ended = 0;
        for result in futures_util::future::join_all(calls).await {
            ended += usize::from(result? == 1);
        }
        Ok(ended)
    }

    /// Deletes the leases `ids` of the concurrency key `key` (at exit).
    pub async fn end_leases(&self, key: &str, ids: &[String]) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(key).arg(ids);
        let _: i64 = self.run(&cmd, None).await?;
        Ok(())
    }

    /// The holders of the concurrency key `key`: lease id → when it was taken (store-clock
    /// microseconds), and the time now on that clock.
    pub async fn holders(&self, key: &str) -> Result<(Vec<(String, u64)>, u64), StoreError> {
        let held: Vec<(String, u64)> = self.run(redis::cmd("HGETALL").arg(key), None).await?;
        let time: (u64, u64) = self.run(&redis::cmd("TIME"), None).await?;
        Ok((held, time.0 * 1_000_000 + time.1))
    }
}

/// What one key's renewal found (`leases.lua`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Renewed {
    /// The store still held this instance's leases there.
    pub known: bool,
    /// Leases the key took back from dead instances since the last renewal.
    pub reclaimed: u64,
    /// Leases a restore wrote back (the store had forgotten them).
    pub restored: u64,
}

/// Read and reset for the admin API, over the same connections and timeout as decisions.
impl RedisStore {
    /// Where `check.key` stands for one more request of cost 1, recording nothing.
    pub async fn peek(&self, check: &Check) -> Result<Peek, StoreError> {
        let spec = check.spec;
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.shared.peek.get_hash())
            .arg(1)
            .arg(&check.key)
            .arg(spec.algorithm.label())
            .arg(spec.requests)
            .arg(spec.window_us())
            .arg(spec.burst)
            .arg(spec.cost.max(1))
            .arg(if spec.overridable { 2 } else { 0 });
        let reply: Vec<i64> = self.run(&cmd, Some(&self.shared.peek)).await?;
        let [count, remaining, reset, wait, overridden] = reply[..] else {
            return Err(StoreError::Script(format!(
                "unexpected peek reply {reply:?}"
            )));
        };
        Ok(Peek {
            count: u64::try_from(count).unwrap_or(0),
            remaining: u32::try_from(remaining).unwrap_or(0),
            reset: Duration::from_micros(u64::try_from(reset).unwrap_or(0)),
            wait: Duration::from_micros(u64::try_from(wait).unwrap_or(0)),
            overridden: u32::try_from(overridden).ok().filter(|&n| n > 0),
        })
    }

    /// Sets the override at `key` (`overrides::key_of`) to `requests` for `ttl`, its limit
    /// noted in `registry` (`overrides::registry_of`); the override it replaced, if any.
    pub async fn set_override(
        &self,
        key: &str,
        requests: u32,
        ttl: Duration,
        registry: &str,
    ) -> Result<Option<u32>, StoreError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(requests).arg("PX").arg(ttl_ms).arg("GET");
        let old = self.run(&cmd, None).await?;
        // The list's index, in its own slot on a Cluster: a second call, after the override is
        // in force (a failure here leaves it unlisted, never unapplied).
        let index = overrides::index_of(key);
        let now_ms = unix_ms();
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(&index).arg(now_ms.saturating_add(ttl_ms)).arg(key);
        let _: i64 = self.run(&zadd, None).await?;
        let mut prune = redis::cmd("ZREMRANGEBYSCORE");
        prune.arg(&index).arg("-inf").arg(now_ms);
        let _: i64 = self.run(&prune, None).await?;
        let max_ms = u64::try_from(overrides::MAX_TTL.as_millis()).unwrap_or(u64::MAX);
        let _: i64 = self
            .run(redis::cmd("PEXPIRE").arg(&index).arg(max_ms), None)
            .await?;
        // The limit among those holding overrides, until its latest override expires.
        let mut note = redis::cmd("ZADD");
        note.arg(registry)
            .arg("GT")
            .arg(now_ms.saturating_add(ttl_ms))
            .arg(&index);
        let _: i64 = self.run(&note, None).await?;
        let _: i64 = self
            .run(redis::cmd("PEXPIRE").arg(registry).arg(max_ms), None)
            .await?;
        Ok(old)
    }

    /// The limits noted in `registry` that hold overrides in force, at most `most`, each
    /// with how many (one `ZCOUNT` of its index each).
    pub async fn overridden_limits(
        &self,
        registry: &str,
        most: usize,
    ) -> Result<Vec<overrides::Holder>, StoreError> {
        let now_ms = unix_ms();
        let mut range = redis::cmd("ZRANGEBYSCORE");
        range
            .arg(registry)
            .arg(format!("({now_ms}"))
            .arg("+inf")
            .arg("LIMIT")
            .arg(0)
            .arg(most);
        let indexes: Vec<String> = self.run(&range, None).await?;
        let mut holders = Vec::with_capacity(indexes.len());
        for index in indexes {
            let mut count = redis::cmd("ZCOUNT");
            count.arg(&index).arg(format!("({now_ms}")).arg("+inf");
            let overrides: u64 = self.run(&count, None).await?;
            if overrides > 0 {
                holders.push(overrides::Holder { index, overrides });
            }
        }
        Ok(holders)
    }

    /// The overrides of the limit whose keys start as `key`'s, at most `most`, soonest to
    /// expire first: from the index, each read again (one that expired or was deleted since
    /// is left out).
    pub async fn list_overrides(
        &self,
        key: &str,
        most: usize,
    ) -> Result<Vec<overrides::Listed>, StoreError> {
        let mut range = redis::cmd("ZRANGEBYSCORE");
        range
            .arg(overrides::index_of(key))
            .arg(format!("({}", unix_ms()))
            .arg("+inf")
            .arg("LIMIT")
            .arg(0)
            .arg(most);
        let keys: Vec<String> = self.run(&range, None).await?;
        let mut listed = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(found) = self.get_override(&key).await? {
                listed.push(overrides::Listed {
                    key,
                    requests: found.requests,
                    expires_in: found.expires_in,
                });
            }
        }
        Ok(listed)
    }

    /// The override stored at `key` and the time left until it expires.
    pub async fn get_override(&self, key: &str) -> Result<Option<Override>, StoreError> {
        let requests: Option<u32> = self.run(redis::cmd("GET").arg(key), None).await?;
        let Some(requests) = requests else {
            return Ok(None);
        };
        // -2: gone since the GET (-1, no expiry, is never written).
        let ttl: i64 = self.run(redis::cmd("PTTL").arg(key), None).await?;
        let Ok(ttl) = u64::try_from(ttl) else {
            return Ok(None);
        };
        Ok(Some(Override {
            requests,
            expires_in: Duration::from_millis(ttl),
        }))
    }

    /// Deletes the override stored at `key`; the one it was, if any.
    pub async fn delete_override(&self, key: &str) -> Result<Option<u32>, StoreError> {
        let old = self.run(redis::cmd("GETDEL").arg(key), None).await?;
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(overrides::index_of(key)).arg(key);
        let _: i64 = self.run(&zrem, None).await?;
        Ok(old)
    }

    /// Deletes `key` (and a concurrency key's instances beside it); whether it existed.
    pub async fn reset(&self, key: &str) -> Result<bool, StoreError> {
        let beside = format!("{key}:i");
        let deleted: u64 = self
            .run(redis::cmd("DEL").arg(key).arg(&beside), None)
            .await?;
        Ok(deleted > 0)
    }
}

/// Milliseconds since the Unix epoch, by this host's clock: the scores of the overrides'
/// index, which only orders and prunes the list (each entry is read again from its own key).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}
