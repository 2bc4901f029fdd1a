//! The Redis store: every limit of a request, of any mix of algorithms, decided by one call of
//! one script: `scripts/decide.lua`, after each algorithm's check and record functions.
//!
//! Decisions travel over a few long-lived multiplexed connections: concurrent requests share
//! them, and their commands leave in pipelined writes instead of one round trip per pooled
//! connection. A connection that breaks is re-established in the background by the `redis`
//! crate's `ConnectionManager`; no command is spent checking a connection before use.
//!
//! The script is loaded at start-up and run with EVALSHA only; when Redis has lost it (restart,
//! failover, `SCRIPT FLUSH`) `run` loads it again and retries once, so callers never see
//! NOSCRIPT. Each call, including a wait for a reconnection, is bounded by the configured
//! timeout. On a Redis Cluster (`cluster`) every call goes to the master owning its keys' slot,
//! and the limits of a request in several slots are decided per slot.
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

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::RedisFuture;
use redis::{
    Client, Cmd, ConnectionAddr, ErrorKind, FromRedisValue, IntoConnectionInfo,
    RedisConnectionInfo, RedisError, RedisResult, Script, ServerErrorKind,
};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::cluster::{self, ClusterLink, ClusterSettings};
use super::sentinel::{watch_failovers, MasterAddr, SentinelSettings, Sentinels};
use super::{Admission, Check, Decision, LimitState, Peek, StoreError};

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

/// The admin API's read-only script: each algorithm's functions, then `peek.lua`, which calls
/// one check function and records nothing.
const PEEK: &str = concat!(
    include_str!("scripts/sliding_log.lua"),
    include_str!("scripts/sliding_window.lua"),
    include_str!("scripts/fixed_window.lua"),
    include_str!("scripts/gcra.lua"),
    include_str!("scripts/peek.lua"),
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
    /// Present for a Redis Cluster, which replaces `shared.master`.
    cluster: Option<ClusterLink>,
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
    /// The admin API's: loaded into Redis on first use (NOSCRIPT, then SCRIPT LOAD), so it
    /// costs the request path nothing.
    peek: Script,
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

    /// A store on a Redis Cluster, connected once before returning; if the cluster does not
    /// answer, the store starts without it and keeps trying in the background.
    pub async fn with_cluster(
        settings: &ClusterSettings,
        timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        let empty = Master {
            addr: None,
            connections: Vec::new(),
        };
        let mut store = RedisStore::with_master(empty, timeout);
        store.cluster = Some(ClusterLink::connect(settings, timeout).await?);
        Ok(store)
    }

    fn with_master(master: Master, timeout: Duration) -> RedisStore {
        RedisStore {
            shared: Arc::new(Shared {
                master: RwLock::new(Arc::new(master)),
                fence: Mutex::new(None),
                script: Script::new(DECIDE),
                release: Script::new(RELEASE),
                peek: Script::new(PEEK),
                timeout,
            }),
            follower: None,
            cluster: None,
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
        if self.cluster.is_some() {
            if let Some(groups) = cluster::slot_groups(checks) {
                return self.decide_across_slots(checks, &groups, &member).await;
            }
        }
        self.decide_in_one_call(checks.iter(), member, true).await
    }

    /// One call of the decide script over `checks`, whose keys must share a slot on a cluster;
    /// without `may_delay`, delay limits reject instead.
    async fn decide_in_one_call<'a>(
        &self,
        checks: impl ExactSizeIterator<Item = &'a Check> + Clone,
        member: String,
        may_delay: bool,
    ) -> Result<Decision, StoreError> {
        let count = checks.len();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.shared.script.get_hash()).arg(count);
        for check in checks.clone() {
            cmd.arg(&check.key);
        }
        cmd.arg(&member);
        for check in checks {
            let spec = check.spec;
            cmd.arg(spec.algorithm.label())
                .arg(spec.requests)
                .arg(spec.window_us())
                .arg(spec.burst)
                .arg(spec.cost)
                .arg(u8::from(spec.shadow))
                .arg(if may_delay { spec.max_delay_us() } else { 0 });
        }
        let reply: Vec<i64> = self.run(&cmd, Some(&self.shared.script)).await?;
        decision_from_reply(&reply, count, member)
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
                self.release_in_one_call(members.iter().map(|&index| &checks[index]), admission)
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

    /// Runs `cmd` bounded by the timeout (on a cluster, on the master owning its keys). For
    /// an EVALSHA of `script`, loads the script and tries again once when Redis has lost it
    /// (restart, failover, `SCRIPT FLUSH`), so callers never see NOSCRIPT.
    async fn run<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        script: Option<&Script>,
    ) -> Result<T, StoreError> {
        let mut conn = self.connection()?;
        self.bounded(async {
            let value = match (conn.send(cmd).await, script) {
                (Err(err), Some(script))
                    if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
                {
                    // On a cluster, SCRIPT LOAD goes to every master.
                    script
                        .load_async(&mut conn)
                        .await
                        .map_err(|e| self.failed(e))?;
                    conn.send(cmd).await
                }
                (result, _) => result,
            }
            .map_err(|e| self.failed(e))?;
            T::from_redis_value(value).map_err(|e| StoreError::Script(e.to_string()))
        })
        .await
    }

    /// Gives back what the request of `admission` recorded under `checks` (`release.lua`);
    /// on a cluster, one call per slot the checks live in.
    pub async fn release(&self, checks: &[Check], admission: &Admission) -> Result<(), StoreError> {
        let groups = match &self.cluster {
            Some(_) => cluster::slot_groups(checks),
            None => None,
        };
        let Some(groups) = groups else {
            return self.release_in_one_call(checks.iter(), admission).await;
        };
        let calls = groups.iter().map(|members| {
            self.release_in_one_call(members.iter().map(|&index| &checks[index]), admission)
        });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .collect()
    }

    /// One call of the release script over `checks`, whose keys must share a slot on a
    /// cluster.
    async fn release_in_one_call<'a>(
        &self,
        checks: impl ExactSizeIterator<Item = &'a Check> + Clone,
        admission: &Admission,
    ) -> Result<(), StoreError> {
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
                .arg(spec.cost);
        }
        let _released: i64 = self.run(&cmd, Some(&self.shared.release)).await?;
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
    fn connection(&self) -> Result<Connection, StoreError> {
        if let Some(cluster) = &self.cluster {
            return cluster.connection().map(Connection::Cluster);
        }
        let master = self.shared.current();
        if master.connections.is_empty() {
            self.rediscover();
            return Err(StoreError::Connection(
                "no Redis master: the sentinels have not named one yet, or a failover is under way"
                    .to_owned(),
            ));
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % master.connections.len();
        Ok(Connection::Node(master.connections[index].clone()))
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

/// A connection to one node (standalone or the sentinels' master) or to a cluster, which
/// routes each call by its keys' slot.
enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Sends one command; on a cluster, to the master owning its keys' slot, following
    /// redirections.
    async fn send(&mut self, cmd: &Cmd) -> RedisResult<redis::Value> {
        match self {
            Connection::Node(conn) => conn.req_packed_command(cmd).await,
            Connection::Cluster(conn) => cluster::call(conn, cmd).await,
        }
        .and_then(redis::Value::extract_error)
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, redis::Value> {
        match self {
            Connection::Node(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Connection::Node(conn) => conn.req_packed_commands(cmd, offset, count),
            Connection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Node(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
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
        // A cluster that is failing over or resharding beyond the retries.
        || err.is_cluster_error()
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
            .arg(spec.burst);
        let reply: Vec<i64> = self.run(&cmd, Some(&self.shared.peek)).await?;
        let [count, remaining, reset] = reply[..] else {
            return Err(StoreError::Script(format!(
                "unexpected peek reply {reply:?}"
            )));
        };
        Ok(Peek {
            count: u64::try_from(count).unwrap_or(0),
            remaining: u32::try_from(remaining).unwrap_or(0),
            reset: Duration::from_micros(u64::try_from(reset).unwrap_or(0)),
        })
    }

    /// Deletes `key`; whether it existed.
    pub async fn reset(&self, key: &str) -> Result<bool, StoreError> {
        let deleted: u64 = self.run(redis::cmd("DEL").arg(key), None).await?;
        Ok(deleted > 0)
    }
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
