//! The connections a Redis store decides over: several multiplexed connections to one node
//! (the master as last known), or one cluster connection that routes each call by slot.

use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, RedisFuture, RedisResult, Script};

use super::super::StoreError;
use super::batch::{Lane, Writer};
use super::cluster;
use super::sentinel::MasterAddr;

/// What requests and the follower task both use.
pub(super) struct Shared {
    pub(super) master: RwLock<Arc<Master>>,
    /// A master being failed over, not to be used again until this instant.
    pub(super) fence: Mutex<Option<(MasterAddr, Instant)>>,
    pub(super) script: Script,
    pub(super) release: Script,
    /// The admin API's: loaded into Redis on first use (NOSCRIPT, then SCRIPT LOAD), so it
    /// costs the request path nothing.
    pub(super) peek: Script,
    /// The renewal of this instance's concurrency leases (`leases.lua`), once per period.
    pub(super) leases: Script,
    pub(super) timeout: Duration,
    /// What each connection's batch writer runs: the decide script, bounded by `timeout`.
    pub(super) writer: Writer,
}

/// The connections to one Redis node: the master as last known.
pub(super) struct Master {
    /// `None` for a fixed URL, or before the sentinels have named a master.
    pub(super) addr: Option<MasterAddr>,
    pub(super) connections: Vec<Lane>,
    /// What the connections were opened with: the event channel subscribes through it.
    pub(super) client: Option<Client>,
}

impl Shared {
    pub(super) fn current(&self) -> Arc<Master> {
        self.master
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn replace(&self, master: Master) {
        *self.master.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(master);
    }
}

/// A connection to one node (standalone or the sentinels' master) or to a cluster, which
/// routes each call by its keys' slot.
pub(super) enum Connection {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Sends one command; on a cluster, to the master owning its keys' slot, following
    /// redirections.
    pub(super) async fn send(&mut self, cmd: &Cmd) -> RedisResult<redis::Value> {
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

/// `connections` lazily opened connection managers to the Redis `client` points at, each with
/// its (not yet started) batch writer.
pub(super) fn open_connections(
    client: &Client,
    connections: usize,
    timeout: Duration,
) -> Result<Vec<Lane>, StoreError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        // The call's own timeout bounds every wait. A broken connection is reconnected
        // once, at once, and a refused reconnection fails the calls waiting on it at once
        // rather than holding them for their timeout; the next call tries again.
        .set_response_timeout(None)
        .set_number_of_retries(0);
    (0..connections.max(1))
        .map(|_| {
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).map(Lane::new)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::Connection(e.to_string()))
}
