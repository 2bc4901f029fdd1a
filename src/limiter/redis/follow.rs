//! Following the Redis master through Sentinel: looking it up, switching decisions to a new
//! one, and fencing a master a sentinel announced it is replacing.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use redis::{Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo, RedisError};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::super::StoreError;
use super::connection::{open_connections, Master, Shared};
use super::scripts::script_error;
use super::sentinel::{watch_failovers, MasterAddr, SentinelSettings, Sentinels};
use super::{Link, RedisStore};

/// How often the sentinels are asked for the master when nothing has failed. A failover
/// promotes the replica some time before the old master is demoted (Sentinel waits several
/// seconds before reconfiguring it), and decisions written to the old master in between are
/// lost; polling bounds that time, where waiting for an error would not.
pub(super) const SENTINEL_POLL: Duration = Duration::from_millis(500);
/// Least time between two lookups, so a burst of failing requests costs one lookup.
pub(super) const LOOKUP_GAP: Duration = Duration::from_millis(100);
/// Longest time decisions stay off a master a sentinel announced it is replacing, in case
/// the failover fails without the sentinels ever naming another master.
pub(super) const FENCE_LIMIT: Duration = Duration::from_secs(10);
/// Least time allowed for one sentinel's answer. Lookups run in the background, so they can
/// afford more than a decision's `timeout`; a bound that tight could fail every lookup on a
/// busy network.
pub(super) const MIN_SENTINEL_TIMEOUT: Duration = Duration::from_millis(250);

/// The tasks that follow the master named by the sentinels.
pub(super) struct Follower {
    /// Asks the task to look the master up now.
    pub(super) wake: Arc<Notify>,
    /// The lookup task and one listener per sentinel.
    pub(super) tasks: Vec<JoinHandle<()>>,
}

impl Follower {
    /// Asks for a lookup of the master now.
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    pub(super) fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl RedisStore {
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
            client: None,
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
        store.link = Link::Sentinel(Follower { wake, tasks });
        Ok(store)
    }
}

impl Shared {
    /// Stops deciding on `master`, which a sentinel is replacing, and asks for a lookup.
    pub(super) fn fence(&self, master: MasterAddr, wake: &Notify) {
        if self.current().addr.as_ref() == Some(&master) {
            tracing::warn!(%master, "a sentinel is failing the Redis master over; decisions wait for the new one");
            self.replace(Master {
                addr: None,
                connections: Vec::new(),
                client: None,
            });
        }
        *self.fence.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((master, Instant::now() + FENCE_LIMIT));
        wake.notify_one();
    }

    /// Whether `addr` is a master being failed over; forgets a fence that has expired or
    /// that the sentinels have moved past.
    pub(super) fn fenced(&self, addr: &MasterAddr) -> bool {
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
pub(super) struct NodeSettings {
    pub(super) redis: RedisConnectionInfo,
    pub(super) connections: usize,
}

/// Follows the master the sentinels name, until the store is dropped.
pub(super) async fn follow(
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
pub(super) async fn follow_once(
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
        .set_redis_settings(nodes.redis.clone())
        .set_tcp_settings(super::socket::tcp_settings());
    let client = Client::open(info).map_err(|e| StoreError::Connection(e.to_string()))?;
    let connections = open_connections(&client, nodes.connections, shared.timeout)?;
    let mut first = connections
        .first()
        .map(|lane| lane.conn.clone())
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
        client: Some(client),
    });
    Ok(())
}
