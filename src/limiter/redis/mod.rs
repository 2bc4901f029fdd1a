//! The Redis store: every limit of a request, of any mix of algorithms, decided by one call of
//! one script: `scripts/decide.lua`, after each algorithm's check and record functions.
//!
//! Decisions travel over a few long-lived multiplexed connections, and the decisions waiting
//! on one leave together as one call of the decide script (`batch`); on a cluster each
//! decision is a call of its own. A connection that breaks is re-established in the background by the `redis`
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
//!
//! The files, by job: `connection` (the connections to a node or a cluster, and the master
//! as last known), `batch` (each connection's queue and the writer that drains it), `follow` (finding and following the master through Sentinel), `scripts`
//! (the Lua sources and reading their replies), `calls` (decide, release, peek, reset and
//! the lease renewal, each one script call or one per cluster slot; a concurrency lease's
//! end rides in its connection's batch), `epochs` (whether Redis forgot a concurrency limit's
//! leases: the flag its checks carry), `socket` (the TCP settings that get a connection out
//! of a silent partition), `usage` (the usage index's flush and read).

mod batch;
mod calls;
pub(super) mod cluster;
mod connection;
mod epochs;
mod events;
mod follow;
mod scripts;
mod sentinel;
mod socket;
mod usage;

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use redis::{Client, Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind};

use self::batch::{Lane, Pending, Writer};
use self::cluster::ClusterLink;
pub use self::cluster::{slot_of, ClusterSettings};
use self::connection::{open_connections, Connection, Master, Shared};
pub(super) use self::epochs::limit_of;
use self::epochs::Epochs;
pub use self::events::{listen, Event};
use self::follow::Follower;
use self::scripts::script_error;
use self::scripts::{DECIDE, LEASES, PEEK, RELEASE};
pub use self::sentinel::SentinelSettings;
use super::StoreError;

/// Where Redis is: exactly one of a fixed address, a master found through Sentinel, or a
/// Cluster. The config file's `store.redis` becomes one of these when it is parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One Redis at a fixed URL.
    Single { url: String },
    /// The master the sentinels name, followed through failovers.
    Sentinel(SentinelSettings),
    /// A Redis Cluster: every call goes to the master owning its keys' slot.
    Cluster(ClusterSettings),
}

pub struct RedisStore {
    shared: Arc<Shared>,
    link: Link,
    next: AtomicUsize,
    /// Random per process, so members written by different instances never collide.
    instance: u64,
    sequence: AtomicU64,
    /// The concurrency limits this process has checked, for their epoch flag (`epochs`).
    epochs: Epochs,
    /// A Cluster's seed nodes, one client each (the event channel subscribes through one).
    nodes: Vec<Client>,
}

/// How this store reaches Redis, by topology.
enum Link {
    /// One node at a fixed URL: the connections in `shared.master`.
    Single,
    /// The master the sentinels name: `shared.master`, replaced by the follower's tasks.
    Sentinel(Follower),
    /// A Redis Cluster, which routes each call by slot (`shared.master` stays empty).
    Cluster(ClusterLink),
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        if let Link::Sentinel(follower) = &self.link {
            follower.stop();
        }
    }
}

impl RedisStore {
    /// A store on `topology`, with `connections` multiplexed connections to a node (a
    /// cluster makes its own) and every call bounded by `timeout`. Must be called on a Tokio
    /// runtime.
    pub async fn connect(
        topology: &Topology,
        connections: usize,
        timeout: Duration,
    ) -> Result<RedisStore, StoreError> {
        match topology {
            Topology::Single { url } => RedisStore::new(url, connections, timeout),
            Topology::Sentinel(settings) => {
                RedisStore::with_sentinels(settings, connections, timeout).await
            }
            Topology::Cluster(settings) => RedisStore::with_cluster(settings, timeout).await,
        }
    }

    /// Sets up `connections` multiplexed connections to the Redis at `url`; none is opened
    /// until `load_script` or the first request. Must be called on a Tokio runtime.
    pub fn new(url: &str, connections: usize, timeout: Duration) -> Result<RedisStore, StoreError> {
        let info = redis::IntoConnectionInfo::into_connection_info(url)
            .map_err(|e| StoreError::Connection(e.to_string()))?
            .set_tcp_settings(socket::tcp_settings());
        let client = Client::open(info).map_err(|e| StoreError::Connection(e.to_string()))?;
        let master = Master {
            addr: None,
            connections: open_connections(&client, connections, timeout)?,
            client: Some(client),
        };
        Ok(RedisStore::with_master(master, timeout))
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
            client: None,
        };
        let mut store = RedisStore::with_master(empty, timeout);
        store.link = Link::Cluster(ClusterLink::connect(settings, timeout).await?);
        store.nodes = cluster::node_clients(settings)?;
        store.epochs = Epochs::new(false);
        Ok(store)
    }

    fn with_master(master: Master, timeout: Duration) -> RedisStore {
        RedisStore {
            shared: Arc::new(Shared {
                master: RwLock::new(Arc::new(master)),
                fence: Mutex::new(None),
                script: Script::new(&DECIDE),
                release: Script::new(&RELEASE),
                peek: Script::new(&PEEK),
                leases: Script::new(&LEASES),
                timeout,
                writer: Writer {
                    script: Script::new(&DECIDE),
                    timeout,
                },
            }),
            link: Link::Single,
            next: AtomicUsize::new(0),
            instance: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            sequence: AtomicU64::new(0),
            epochs: Epochs::new(true),
            nodes: Vec::new(),
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
            self.shared
                .leases
                .load_async(&mut conn)
                .await
                .map_err(|e| self.failed(e))?;
            Ok(())
        })
        .await
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

    /// The bound on every call, and on a decision's wait in its connection's queue.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
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

    /// The next connection to the current master, round robin among the current worker's
    /// share (`worker::share`), so that each connection is opened and driven by the one
    /// worker that uses it. A clone is a handle to the same connection.
    fn connection(&self) -> Result<Connection, StoreError> {
        if let Link::Cluster(cluster) = &self.link {
            return cluster.connection().map(Connection::Cluster);
        }
        Ok(Connection::Node(self.lane()?.conn))
    }

    /// The next connection to the current master, round robin among the current worker's
    /// share, with its batch queue (not for a cluster, whose `shared.master` is empty).
    fn lane(&self) -> Result<Lane, StoreError> {
        let master = self.master()?;
        let mine = crate::runtime::worker::share(master.connections.len());
        let index = mine.start + self.next.fetch_add(1, Ordering::Relaxed) % mine.len();
        Ok(master.connections[index].clone())
    }

    /// Queues a decision on the first connection of the current worker's share whose queue
    /// has room (see `batch`); `StoreError::Busy` when none has.
    fn enqueue(&self, mut pending: Pending) -> Result<(), StoreError> {
        let master = self.master()?;
        for lane in &master.connections[crate::runtime::worker::share(master.connections.len())] {
            match lane.enqueue(pending, &self.shared.writer) {
                Ok(()) => return Ok(()),
                Err(refused) => pending = refused,
            }
        }
        Err(StoreError::Busy)
    }

    /// The master as last known, if it has connections.
    fn master(&self) -> Result<Arc<Master>, StoreError> {
        let master = self.shared.current();
        if master.connections.is_empty() {
            self.rediscover();
            return Err(StoreError::Connection(
                "no Redis master: the sentinels have not named one yet, or a failover is under way"
                    .to_owned(),
            ));
        }
        Ok(master)
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
        if let Link::Sentinel(follower) = &self.link {
            follower.wake();
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
