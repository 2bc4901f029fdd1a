//! The Redis store: every limit of a request, of any mix of algorithms, decided by one call of
//! one script: `scripts/decide.lua`, after each algorithm's check and record functions.
//!
//! Decisions travel over a few long-lived multiplexed connections: concurrent requests share
//! them, and their commands leave in pipelined writes instead of one round trip per pooled
//! connection. A connection that breaks is re-established in the background by the `redis`
//! crate's `ConnectionManager`; no command is spent checking a connection before use.
//!
//! The script is loaded at start-up and run with EVALSHA only; when Redis has lost it (restart,
//! failover, `SCRIPT FLUSH`) the `redis` crate's `Script` loads it again and retries once, so
//! callers never see NOSCRIPT. Each call, including a wait for a reconnection, is bounded by
//! the configured timeout.
//!
//! With Redis Sentinel the master is not a fixed address. A background task (`follow`) asks
//! the sentinels for it at start, every `SENTINEL_POLL`, and at once when a decision fails in
//! a way a failover explains (connection lost or refused, timeout, READONLY from a demoted
//! master); when the sentinels name a different node and it answers `ROLE` as a master, a new
//! set of connections replaces the old one, and requests take the new set from then on.
//! Requests never wait for this: the ones that fail meanwhile get the usual store error.
//!
//! When a sentinel announces that it is about to promote a replica, decisions stop at once
//! (a *fence*): the old master would accept them, but they would be lost, and a limit could
//! then admit more than it allows. Until the sentinels name the new master, limited requests
//! get the store error; the fence lifts by itself after `FENCE_LIMIT` if they never do.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisError, Script};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::sentinel::{watch_failovers, MasterAddr, SentinelSettings, Sentinels};
use super::{Admission, Check, Decision, LimitState, StoreError};

/// The script Redis runs: each algorithm's functions, then the driver that calls them. One
/// script for all algorithms, so a request with limits of several algorithms is still decided
/// in one atomic call.
const DECIDE: &str = concat!(
    include_str!("scripts/sliding_log.lua"),
    include_str!("scripts/sliding_window.lua"),
    include_str!("scripts/fixed_window.lua"),
    include_str!("scripts/gcra.lua"),
    include_str!("scripts/decide.lua"),
);

/// Gives back what an admitted request recorded (`Store::release`): a script of its own.
const RELEASE: &str = include_str!("scripts/release.lua");

/// How often the sentinels are asked for the master when nothing has failed. A failover
/// promotes the replica some time before the old master is demoted (Sentinel waits several
/// seconds before reconfiguring it), and decisions written to the old master in between are
/// lost; polling bounds that time, where waiting for an error would not.
const SENTINEL_POLL: Duration = Duration::from_millis(500);
/// Least time between two lookups, so a burst of failing requests costs one lookup.
const LOOKUP_GAP: Duration = Duration::from_millis(100);
/// Longest time decisions stay off a master a sentinel announced it is replacing, in case
/// the failover fails without the sentinels ever naming another master.
const FENCE_LIMIT: Duration = Duration::from_secs(10);
/// Least time allowed for one sentinel's answer. Lookups run in the background, so they can
/// afford more than a decision's `timeout`; a bound that tight could fail every lookup on a
/// busy network.
const MIN_SENTINEL_TIMEOUT: Duration = Duration::from_millis(250);

pub struct RedisStore {
    shared: Arc<Shared>,
    /// Present when the master is found through Sentinel.
    follower: Option<Follower>,
    next: AtomicUsize,
    /// Random per process, so members written by different instances never collide.
    instance: u64,
    sequence: AtomicU64,
}

/// What requests and the follower task both use.
struct Shared {
    master: RwLock<Arc<Master>>,
    /// A master being failed over, not to be used again until this instant.
    fence: Mutex<Option<(MasterAddr, Instant)>>,
    script: Script,
    release: Script,
    timeout: Duration,
}

/// The connections to one Redis node: the master as last known.
struct Master {
    /// `None` for a fixed URL, or before the sentinels have named a master.
    addr: Option<MasterAddr>,
    connections: Vec<ConnectionManager>,
}

/// The tasks that follow the master named by the sentinels.
struct Follower {
    /// Asks the task to look the master up now.
    wake: Arc<Notify>,
    /// The lookup task and one listener per sentinel.
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        for task in self.follower.iter().flat_map(|f| &f.tasks) {
            task.abort();
        }
    }
}

impl RedisStore {
    /// Sets up `connections` multiplexed connections to the Redis at `url`; none is opened
    /// until `load_script` or the first request. Must be called on a Tokio runtime.
    pub fn new(url: &str, connections: usize, timeout: Duration) -> Result<RedisStore, StoreError> {
        let client = Client::open(url).map_err(|e| StoreError::Connection(e.to_string()))?;
        let master = Master {
            addr: None,
            connections: open_connections(&client, connections, timeout)?,
        };
        Ok(RedisStore::with_master(master, timeout))
    }

    /// A store on the master the sentinels name, followed through failovers. Looks the
    /// master up once before returning (each sentinel bounded by its timeout); if none
    /// answers, the store starts without a master and keeps asking in the background.
    pub async fn with_sentinels(
        settings: &SentinelSettings,
        connections: usize,
        timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let mut sentinels = Sentinels::new(settings, timeout.max(MIN_SENTINEL_TIMEOUT))?;
        let mut node = RedisConnectionInfo::default();
        if let Some(password) = &settings.password {
            node = node.set_password(password);
        }
        let empty = Master {
            addr: None,
            connections: Vec::new(),
        };
        let mut store = RedisStore::with_master(empty, timeout);
        let nodes = NodeSettings {
            redis: node,
            connections,
        };
        if let Err(err) = follow_once(&mut sentinels, &store.shared, &nodes).await {
            tracing::warn!(error = %err, "cannot find the Redis master yet; retrying in the background");
        }
        let wake = Arc::new(Notify::new());
        let mut tasks: Vec<JoinHandle<()>> = sentinels
            .clients()
            .into_iter()
            .map(|client| {
                let (shared, wake) = (store.shared.clone(), wake.clone());
                let replaced = move |master: MasterAddr| shared.fence(master, &wake);
                tokio::spawn(watch_failovers(
                    client,
                    settings.master_name.clone(),
                    timeout.max(MIN_SENTINEL_TIMEOUT),
                    replaced,
                ))
            })
            .collect();
        tasks.push(tokio::spawn(follow(
            sentinels,
            store.shared.clone(),
            nodes,
            wake.clone(),
        )));
        store.follower = Some(Follower { wake, tasks });
        Ok(store)
    }

    fn with_master(master: Master, timeout: Duration) -> RedisStore {
        RedisStore {
            shared: Arc::new(Shared {
                master: RwLock::new(Arc::new(master)),
                fence: Mutex::new(None),
                script: Script::new(DECIDE),
                release: Script::new(RELEASE),
                timeout,
            }),
            follower: None,
            next: AtomicUsize::new(0),
            instance: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            sequence: AtomicU64::new(0),
        }
    }

    /// Loads the script into Redis's script cache, so the first requests need no reload.
    pub async fn load_script(&self) -> Result<(), StoreError> {
        let mut conn = self.connection()?;
        self.bounded(async {
            self.shared
                .script
                .load_async(&mut conn)
                .await
                .map_err(|e| self.failed(e))?;
            self.shared
                .release
                .load_async(&mut conn)
                .await
                .map_err(|e| self.failed(e))?;
            Ok(())
        })
        .await
    }

    pub async fn decide(&self, checks: &[Check]) -> Result<Decision, StoreError> {
        let member = format!(
            "{:016x}-{}",
            self.instance,
            self.sequence.fetch_add(1, Ordering::Relaxed)
        );
        let mut invocation = self.shared.script.prepare_invoke();
        for check in checks {
            invocation.key(&check.key);
        }
        invocation.arg(&member);
        for check in checks {
            let params = check.params();
            invocation
                .arg(params.algorithm.label())
                .arg(params.requests)
                .arg(params.window_us)
                .arg(params.burst)
                .arg(params.cost)
                .arg(u8::from(params.shadow))
                .arg(params.max_delay_us);
        }
        let mut conn = self.connection()?;
        let reply: Vec<i64> = self
            .bounded(async {
                invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| self.failed(e))
            })
            .await?;
        decision_from_reply(&reply, checks.len(), member)
    }

    /// Gives back what the request of `admission` recorded under `checks` (`release.lua`).
    pub async fn release(&self, checks: &[Check], admission: &Admission) -> Result<(), StoreError> {
        let mut invocation = self.shared.release.prepare_invoke();
        for check in checks {
            invocation.key(&check.key);
        }
        invocation
            .arg(&admission.member)
            .arg(admission.at_us)
            .arg(admission.decided_us);
        for check in checks {
            let params = check.params();
            invocation
                .arg(params.algorithm.label())
                .arg(params.requests)
                .arg(params.window_us)
                .arg(params.cost);
        }
        let mut conn = self.connection()?;
        let _released: i64 = self
            .bounded(async {
                invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| self.failed(e))
            })
            .await?;
        Ok(())
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.connection()?;
        self.bounded(async {
            redis::cmd("PING")
                .query_async::<String>(&mut conn)
                .await
                .map_err(|e| self.failed(e))?;
            Ok(())
        })
        .await
    }

    /// The next connection to the current master, round robin. A clone is a handle to the
    /// same connection.
    fn connection(&self) -> Result<ConnectionManager, StoreError> {
        let master = self.shared.current();
        if master.connections.is_empty() {
            self.rediscover();
            return Err(StoreError::Connection(
                "no Redis master: the sentinels have not named one yet, or a failover is under way"
                    .to_owned(),
            ));
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % master.connections.len();
        Ok(master.connections[index].clone())
    }

    /// Classifies a failed call, and asks for a new lookup of the master when a failover
    /// would explain the failure.
    fn failed(&self, err: RedisError) -> StoreError {
        let err = script_error(err);
        if matches!(err, StoreError::Connection(_)) {
            self.rediscover();
        }
        err
    }

    fn rediscover(&self) {
        if let Some(follower) = &self.follower {
            follower.wake.notify_one();
        }
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.shared.timeout;
        tokio::time::timeout(timeout, call)
            .await
            .unwrap_or_else(|_| {
                // A master that stopped answering without closing its connections (a host
                // down, a partition) shows up only as timeouts.
                self.rediscover();
                Err(StoreError::Timeout(timeout))
            })
    }
}

impl Shared {
    fn current(&self) -> Arc<Master> {
        self.master
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn replace(&self, master: Master) {
        *self.master.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(master);
    }

    /// Stops deciding on `master`, which a sentinel is replacing, and asks for a lookup.
    fn fence(&self, master: MasterAddr, wake: &Notify) {
        if self.current().addr.as_ref() == Some(&master) {
            tracing::warn!(%master, "a sentinel is failing the Redis master over; decisions wait for the new one");
            self.replace(Master {
                addr: None,
                connections: Vec::new(),
            });
        }
        *self.fence.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((master, Instant::now() + FENCE_LIMIT));
        wake.notify_one();
    }

    /// Whether `addr` is a master being failed over; forgets a fence that has expired or
    /// that the sentinels have moved past.
    fn fenced(&self, addr: &MasterAddr) -> bool {
        let mut fence = self.fence.lock().unwrap_or_else(PoisonError::into_inner);
        match &*fence {
            Some((fenced, until)) if fenced == addr && Instant::now() < *until => true,
            Some(_) => {
                *fence = None;
                false
            }
            None => false,
        }
    }
}

/// How connections to a master the sentinels name are made.
struct NodeSettings {
    redis: RedisConnectionInfo,
    connections: usize,
}

/// `connections` lazily opened connection managers to the Redis `client` points at.
fn open_connections(
    client: &Client,
    connections: usize,
    timeout: Duration,
) -> Result<Vec<ConnectionManager>, StoreError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        // The call's own timeout bounds every wait. A broken connection is reconnected
        // once, at once, and a refused reconnection fails the calls waiting on it at once
        // rather than holding them for their timeout; the next call tries again.
        .set_response_timeout(None)
        .set_number_of_retries(0);
    (0..connections.max(1))
        .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::Connection(e.to_string()))
}

/// Follows the master the sentinels name, until the store is dropped.
async fn follow(
    mut sentinels: Sentinels,
    shared: Arc<Shared>,
    nodes: NodeSettings,
    wake: Arc<Notify>,
) {
    // While no master can be found, lookups repeat every LOOKUP_GAP: say so once per
    // distinct reason, not ten times a second.
    let mut last_error = String::new();
    loop {
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(SENTINEL_POLL) => {}
        }
        match follow_once(&mut sentinels, &shared, &nodes).await {
            Ok(()) => last_error.clear(),
            Err(err) => {
                let text = err.to_string();
                if text != last_error {
                    tracing::warn!(error = %text, "cannot follow the Redis master");
                    last_error = text;
                }
            }
        }
        tokio::time::sleep(LOOKUP_GAP).await;
        if shared.current().connections.is_empty() {
            // No master (at start, or during a failover): keep asking, every LOOKUP_GAP.
            wake.notify_one();
        }
    }
}

/// Asks the sentinels for the master; if they name a new one that confirms it is a master,
/// switches decisions to it.
async fn follow_once(
    sentinels: &mut Sentinels,
    shared: &Shared,
    nodes: &NodeSettings,
) -> Result<(), StoreError> {
    let addr = sentinels.master().await?;
    if shared.current().addr.as_ref() == Some(&addr) {
        return Ok(());
    }
    if shared.fenced(&addr) {
        return Err(StoreError::Connection(format!(
            "the sentinels still name {addr}, which is being failed over"
        )));
    }
    let info = ConnectionAddr::Tcp(addr.host.clone(), addr.port)
        .into_connection_info()
        .map_err(|e| StoreError::Connection(e.to_string()))?
        .set_redis_settings(nodes.redis.clone());
    let client = Client::open(info).map_err(|e| StoreError::Connection(e.to_string()))?;
    let connections = open_connections(&client, nodes.connections, shared.timeout)?;
    let mut first = connections
        .first()
        .cloned()
        .ok_or_else(|| StoreError::Connection("no connections configured".to_owned()))?;
    let check = async {
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut first).await?;
        // Loading the scripts now saves the first calls on the new master a NOSCRIPT.
        shared.script.load_async(&mut first).await?;
        shared.release.load_async(&mut first).await?;
        Ok::<_, RedisError>(role)
    };
    let role = tokio::time::timeout(shared.timeout.max(MIN_SENTINEL_TIMEOUT), check)
        .await
        .map_err(|_| StoreError::Timeout(shared.timeout.max(MIN_SENTINEL_TIMEOUT)))?
        .map_err(script_error)?;
    let is_master = matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master");
    if !is_master {
        return Err(StoreError::Connection(format!(
            "the sentinels name {addr} as master, but it is not one (yet)"
        )));
    }
    if shared.fenced(&addr) {
        // A sentinel announced the failover while this lookup was under way.
        return Err(StoreError::Connection(format!(
            "{addr} is being failed over"
        )));
    }
    let previous = shared.current().addr.clone();
    tracing::info!(
        master = %addr,
        previous = previous.map(|a| a.to_string()).unwrap_or_default(),
        "deciding on the Redis master named by the sentinels"
    );
    shared.replace(Master {
        addr: Some(addr),
        connections,
    });
    Ok(())
}

/// A failover shows as a connection that drops or is refused, or as a demoted master
/// refusing writes (READONLY, also when it comes wrapped in a script error): all of them
/// are the store being unreachable, not a wrong script.
fn script_error(err: RedisError) -> StoreError {
    if err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_io_error()
        || err.code() == Some("READONLY")
        // Older servers wrap it in the script's own error.
        || err.to_string().contains("READONLY")
    {
        StoreError::Connection(err.to_string())
    } else {
        StoreError::Script(err.to_string())
    }
}

/// Reads the script's reply: `{admitted, retry_after_us, now_us, at_us, (remaining, reset_us,
/// rejecting) per check}`; `member` is the request's member prefix, kept for a release.
fn decision_from_reply(
    reply: &[i64],
    checks: usize,
    member: String,
) -> Result<Decision, StoreError> {
    let malformed = || StoreError::Script(format!("unexpected script reply {reply:?}"));
    let [admitted, retry_after, now, at, per_limit @ ..] = reply else {
        return Err(malformed());
    };
    if per_limit.len() != 3 * checks {
        return Err(malformed());
    }
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let limits = per_limit
        .chunks_exact(3)
        .map(|triple| {
            Some(LimitState {
                remaining: u32::try_from(triple[0]).unwrap_or(0),
                reset: micros(triple[1]),
            })
        })
        .collect();
    let rejecting = per_limit.chunks_exact(3).map(|t| t[2] == 1).collect();
    let admitted = *admitted == 1;
    let time = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(Decision {
        admitted,
        retry_after: micros(*retry_after),
        limits,
        rejecting,
        admission: admitted.then(|| Admission {
            member,
            decided_us: time(*now),
            // Never before the decision, whatever the reply says.
            at_us: time(*at).max(time(*now)),
            local: false,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_reply() {
        let d = decision_from_reply(
            &[0, 1_500_000, 9, 9, 0, 1_500_000, 1, 7, 200, 0],
            2,
            String::new(),
        )
        .unwrap();
        assert!(!d.admitted);
        assert_eq!(d.retry_after, Duration::from_millis(1500));
        assert_eq!(d.limits[1].unwrap().remaining, 7);
        assert_eq!(d.limits[1].unwrap().reset, Duration::from_micros(200));
        assert_eq!(d.rejecting, [true, false]);
        assert_eq!(d.admission, None);
        let d = decision_from_reply(&[1, 0, 100, 350, 0, 0, 1], 1, "m".to_owned()).unwrap();
        assert_eq!(d.delay(), Duration::from_micros(250));
        assert_eq!(d.admission.unwrap().member, "m");
    }

    #[test]
    fn refuses_a_short_reply() {
        assert!(decision_from_reply(&[1, 0, 0, 0, 3], 1, String::new()).is_err());
        assert!(decision_from_reply(&[], 0, String::new()).is_err());
    }
}
