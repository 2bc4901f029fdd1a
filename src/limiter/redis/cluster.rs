//! Redis Cluster: the connection that routes each script call to the master owning its
//! keys' slot, and the decision of a request whose limits live in different slots.
//!
//! Every key carries its identity as a hash tag (`…:{identity}`), so all entries of one
//! (limit, identity) live in one slot, and the limits of a request that share an identity
//! share a slot: such a request is still decided by one atomic script call. Limits with
//! different identities (a per-client limit next to a global cap) usually fall into different
//! slots, often on different masters; Redis cannot run one script across them. Those requests
//! are decided per slot, all slots at once, and when any slot rejects, what the other slots
//! admitted is given back (`Store::release`'s script). So:
//!
//! - per (limit, identity), every guarantee of the single-node store holds: the log is exact
//!   and atomic in its slot, across every sluice instance;
//! - a rejected request consumes nothing once its give-back has run; between its admission in
//!   one slot and the give-back (one round trip) it holds a place there, so a concurrent
//!   request may be refused that would otherwise have had room (never the other way round:
//!   no limit ever admits more than it allows);
//! - if the give-back itself fails (the master of that slot became unreachable in between),
//!   the place stays taken until the window expires: the limit under-admits, it never
//!   over-admits;
//! - a request spanning slots is never delayed (`on_exceed: delay`): the slots' masters have
//!   their own clocks, so no single future instant can be agreed on in one round trip. Its
//!   delay limits answer as if they rejected.
//!
//! Slot migrations are followed here (`call`), not by the `redis` crate's own retries: its
//! ASK redirection sends `ASKING` and the command as two separate writes on a connection that
//! other requests share, so under load another request's command takes the `ASKING` flag and
//! the redirected call bounces between the two nodes until it fails. Here an ASK redirection
//! is one pipelined write (`ASKING` then the command), which nothing can come between; a
//! MOVED reply goes to the named node at once (the crate refreshes its slot map in the
//! background), and a TRYAGAIN (a multi-key call while its keys are split between two nodes)
//! is tried again after a short wait. Each call stays bounded by the store's timeout.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::ConnectionLike;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Client;
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, RedisResult,
    ServerErrorKind, Value,
};
use tokio::task::JoinHandle;

use super::super::{Check, Decision, StoreError};

/// How often a cluster that could not be reached at start is tried again.
const CONNECT_RETRY: Duration = Duration::from_millis(250);

/// Redirections and TRYAGAIN waits one call may follow; the store's timeout bounds them all.
const MAX_REDIRECTS: u32 = 16;
/// The first wait after TRYAGAIN, doubled each time up to `MAX_TRY_AGAIN_WAIT`.
const TRY_AGAIN_WAIT: Duration = Duration::from_millis(2);
const MAX_TRY_AGAIN_WAIT: Duration = Duration::from_millis(50);

/// Where the cluster is: nodes to learn the slot map from, and the credentials of every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSettings {
    pub nodes: Vec<(String, u16)>,
    pub username: Option<String>,
    pub password: Option<String>,
}

/// A client of each seed node of `settings`, with its credentials: the event channel
/// subscribes through one (a Cluster delivers what is published on any node to every node's
/// subscribers).
pub(super) fn node_clients(settings: &ClusterSettings) -> Result<Vec<Client>, StoreError> {
    settings
        .nodes
        .iter()
        .map(|(host, port)| {
            let mut info = ConnectionAddr::Tcp(host.clone(), *port)
                .into_connection_info()
                .map_err(|e| StoreError::Connection(e.to_string()))?;
            let mut redis = info.redis_settings().clone();
            if let Some(username) = &settings.username {
                redis = redis.set_username(username);
            }
            if let Some(password) = &settings.password {
                redis = redis.set_password(password);
            }
            info = info
                .set_redis_settings(redis)
                .set_tcp_settings(super::socket::tcp_settings());
            Client::open(info).map_err(|e| StoreError::Connection(e.to_string()))
        })
        .collect()
}

/// The cluster connection, opened in the background: sluice starts (and serves its
/// unlimited routes) while the cluster is still unreachable.
pub(super) struct ClusterLink {
    connection: Arc<ArcSwapOption<ClusterConnection>>,
    /// The background connection attempts, when the first one failed.
    connecting: Option<JoinHandle<()>>,
}

impl Drop for ClusterLink {
    fn drop(&mut self) {
        if let Some(task) = &self.connecting {
            task.abort();
        }
    }
}

impl ClusterLink {
    /// Connects to the cluster, trying the first time before returning so that a reachable
    /// cluster is ready for the first request. Must be called on a Tokio runtime.
    pub(super) async fn connect(
        settings: &ClusterSettings,
        timeout: Duration,
    ) -> Result<ClusterLink, StoreError> {
        let nodes = settings
            .nodes
            .iter()
            .map(|(host, port)| ConnectionAddr::Tcp(host.clone(), *port).into_connection_info())
            .collect::<RedisResult<Vec<ConnectionInfo>>>()
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        // No retries in the crate: `call` follows redirections itself, and a failed call is
        // the store's to count. The crate still refreshes its slot map on MOVED.
        let mut builder = ClusterClientBuilder::new(nodes)
            .connection_timeout(timeout)
            .tcp_settings(super::socket::tcp_settings())
            .retries(0);
        if let Some(username) = &settings.username {
            builder = builder.username(username);
        }
        if let Some(password) = &settings.password {
            builder = builder.password(password);
        }
        let client = builder
            .build()
            .map_err(|e| StoreError::Connection(e.to_string()))?;
        let connection = Arc::new(ArcSwapOption::empty());
        let first =
            tokio::time::timeout(timeout.max(CONNECT_RETRY), client.get_async_connection()).await;
        let connecting = match first {
            Ok(Ok(established)) => {
                connection.store(Some(Arc::new(established)));
                None
            }
            failed => {
                let reason = match failed {
                    Ok(Err(err)) => err.to_string(),
                    _ => format!("no answer within {:?}", timeout.max(CONNECT_RETRY)),
                };
                tracing::warn!(error = %reason, "cannot reach the Redis Cluster yet; retrying in the background");
                let slot = Arc::clone(&connection);
                Some(tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(CONNECT_RETRY).await;
                        if let Ok(established) = client.get_async_connection().await {
                            tracing::info!("connected to the Redis Cluster");
                            slot.store(Some(Arc::new(established)));
                            return;
                        }
                    }
                }))
            }
        };
        Ok(ClusterLink {
            connection,
            connecting,
        })
    }

    /// A handle to the cluster connection (cheap: the connection is shared).
    pub(super) fn connection(&self) -> Result<ClusterConnection, StoreError> {
        self.connection
            .load()
            .as_deref()
            .cloned()
            .ok_or_else(|| StoreError::Connection("the Redis Cluster is not reachable yet".into()))
    }
}

/// Where a reply sent the call next.
enum Redirect {
    /// The slot map changed: the named node owns the slot now.
    Moved(String, u16),
    /// The slot is moving and its keys are no longer on the node asked: ask the importing
    /// node, this once.
    Ask(String, u16),
}

impl Redirect {
    fn of(err: &RedisError) -> Option<Redirect> {
        let (addr, _slot) = err.redirect_node()?;
        let (host, port) = addr.rsplit_once(':')?;
        let (host, port) = (host.to_owned(), port.parse().ok()?);
        match err.kind() {
            ErrorKind::Server(ServerErrorKind::Ask) => Some(Redirect::Ask(host, port)),
            _ => Some(Redirect::Moved(host, port)),
        }
    }
}

/// Runs `cmd` (its keys in one slot) on the master owning that slot, following MOVED and ASK
/// redirections and TRYAGAIN replies (see the module comment).
pub(super) async fn call(conn: &mut ClusterConnection, cmd: &Cmd) -> RedisResult<Value> {
    let mut redirect = None;
    let mut wait = TRY_AGAIN_WAIT;
    let mut attempt = 0;
    loop {
        let result = match &redirect {
            None => conn.req_packed_command(cmd).await,
            Some(Redirect::Moved(host, port)) => {
                let node = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                conn.route_command(cmd.clone(), RoutingInfo::SingleNode(node))
                    .await
            }
            Some(Redirect::Ask(host, port)) => {
                let node = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                let mut asking = redis::pipe();
                asking.cmd("ASKING").add_command(cmd.clone());
                conn.route_pipeline(asking, 1, 1, node)
                    .await
                    .and_then(|mut replies| replies.pop().unwrap_or(Value::Nil).extract_error())
            }
        };
        attempt += 1;
        let err = match result {
            Ok(value) => return Ok(value),
            Err(err) if attempt >= MAX_REDIRECTS => return Err(err),
            Err(err) => err,
        };
        match err.kind() {
            ErrorKind::Server(ServerErrorKind::Ask | ServerErrorKind::Moved) => {
                redirect = Some(Redirect::of(&err).ok_or(err)?);
            }
            ErrorKind::Server(ServerErrorKind::TryAgain) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_TRY_AGAIN_WAIT);
            }
            _ => return Err(err),
        }
    }
}

/// The cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag — the part between the
/// first `{` and the next `}`, when not empty — or of the whole key, modulo 16384.
pub fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16_xmodem(tagged.unwrap_or(bytes)) % 16384
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The request's checks grouped by hash slot, each group the indices of its checks in
/// order; `None` when they all share one slot (the common case, decided in one call).
pub(in crate::limiter) fn slot_groups(checks: &[Check]) -> Option<Vec<Vec<usize>>> {
    let first = slot_of(&checks.first()?.key);
    if checks[1..].iter().all(|check| slot_of(&check.key) == first) {
        return None;
    }
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (index, check) in checks.iter().enumerate() {
        let slot = slot_of(&check.key);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(index),
            None => groups.push((slot, vec![index])),
        }
    }
    Some(groups.into_iter().map(|(_, members)| members).collect())
}

/// Puts the decisions of each slot group back together as one decision over all `checks`:
/// admitted only if every group admitted. The groups that admitted a rejected request are
/// the caller's to give back.
///
/// An admitted request keeps the first group's admission for a later give-back (`count:`):
/// every group recorded the same member, and no group delayed it (delays are off across
/// slots), so only the decision time differs between the groups' masters — by their clock
/// skew, which only the weighted counter's give-back reads (to pick the window it counted
/// in).
pub(super) fn merge(checks: usize, groups: &[Vec<usize>], decisions: &[Decision]) -> Decision {
    let admitted = decisions.iter().all(|d| d.admitted);
    let mut merged = Decision {
        admitted,
        retry_after: Duration::ZERO,
        limits: vec![None; checks],
        rejecting: vec![false; checks],
        admission: if admitted {
            decisions.first().and_then(|d| d.admission.clone())
        } else {
            None
        },
        // A threshold crossed in a slot whose part is given back (another slot refused) stays
        // marked but unsent: at most once, never twice (the book's "Budget alerts, exactly once").
        crossed: if admitted && decisions.iter().any(|d| !d.crossed.is_empty()) {
            vec![0; checks]
        } else {
            Vec::new()
        },
    };
    for (members, decision) in groups.iter().zip(decisions) {
        if !decision.admitted {
            merged.retry_after = merged.retry_after.max(decision.retry_after);
        }
        for (position, &index) in members.iter().enumerate() {
            merged.limits[index] = decision.limits.get(position).copied().flatten();
            merged.rejecting[index] = decision.rejecting.get(position).copied().unwrap_or(false);
            if let (Some(slot), Some(&bits)) = (
                merged.crossed.get_mut(index),
                decision.crossed.get(position),
            ) {
                *slot = bits;
            }
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Algorithm, LimitState, Spec};

    fn check(key: &str) -> Check {
        Check {
            key: key.to_owned(),
            spec: Spec {
                algorithm: Algorithm::SlidingLog,
                requests: 1,
                window: Duration::from_secs(1),
                burst: 1,
                cost: 1,
                ..Spec::default()
            },
        }
    }

    #[test]
    fn slots_as_redis_computes_them() {
        // CLUSTER KEYSLOT answers, from Redis 7.0.
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(slot_of("123456789"), 12739);
        assert_eq!(slot_of("{a}"), 15495);
        assert_eq!(slot_of("x:{a}:y"), 15495);
        assert_eq!(slot_of("{b}"), 3300);
        // An empty tag does not count: the whole key is hashed.
        assert_eq!(slot_of("{}foo"), slot_of_whole("{}foo"));
        assert_eq!(slot_of("foo{}{bar}"), slot_of_whole("foo{}{bar}"));
        // Only the first tag counts.
        assert_eq!(slot_of("{user1000}.following{x}"), slot_of("user1000"));
    }

    fn slot_of_whole(key: &str) -> u16 {
        crc16_xmodem(key.as_bytes()) % 16384
    }

    #[test]
    fn one_identity_is_one_slot() {
        let checks = [check("s:r:a:{ip=1.2.3.4}"), check("s:r:b:{ip=1.2.3.4}")];
        assert_eq!(slot_groups(&checks), None);
    }

    #[test]
    fn groups_by_slot_in_order() {
        // `{a}` and `{b}` hash to different slots (15495 and 3300).
        let checks = [check("x:{a}"), check("y:{b}"), check("z:{a}")];
        assert_eq!(slot_groups(&checks), Some(vec![vec![0, 2], vec![1]]));
    }

    #[test]
    fn merges_a_rejection_in_one_slot() {
        let state = |remaining| LimitState {
            remaining,
            reset: Duration::from_secs(1),
            overridden: None,
        };
        let groups = vec![vec![0, 2], vec![1]];
        let decisions = [
            Decision {
                admitted: true,
                retry_after: Duration::ZERO,
                limits: vec![Some(state(4)), Some(state(6))],
                rejecting: vec![false, false],
                admission: None,
                crossed: Vec::new(),
            },
            Decision {
                admitted: false,
                retry_after: Duration::from_millis(300),
                limits: vec![Some(state(0))],
                rejecting: vec![true],
                admission: None,
                crossed: Vec::new(),
            },
        ];
        let merged = merge(3, &groups, &decisions);
        assert!(!merged.admitted);
        assert_eq!(merged.retry_after, Duration::from_millis(300));
        assert_eq!(merged.rejecting, [false, true, false]);
        assert_eq!(merged.limits[2], Some(state(6)));
        assert_eq!(merged.limits[1], Some(state(0)));
    }
}
