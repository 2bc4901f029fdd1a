//! Finding the Redis master through Redis Sentinel.
//!
//! The sentinels are asked in the configured order with `SENTINEL get-master-addr-by-name`;
//! the first that names the master answers for all of them. One that cannot be reached, or
//! does not know the master, is skipped, and one that answers moves to the front, so a dead
//! sentinel costs its timeout once rather than on every lookup. The sentinels' answer is not
//! trusted blindly: `RedisStore` checks with `ROLE` that the node really is a master before
//! it sends decisions there (a sentinel may briefly name a demoted master during a failover).
//!
//! Each sentinel is also listened to for `+selected-slave`, which the sentinel leading a
//! failover announces just before it promotes the replica. From the promotion on, whatever the
//! old master accepts is lost (the replica no longer follows it, and Sentinel demotes it only
//! seconds later), so `RedisStore` stops deciding there as soon as it hears that.

use std::time::Duration;

use futures_util::StreamExt as _;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo,
};

use super::super::StoreError;

/// Where the sentinels are and what to ask them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelSettings {
    /// The name the sentinels monitor the master under.
    pub master_name: String,
    /// `(host, port)` of each sentinel, in the order they are asked.
    pub nodes: Vec<(String, u16)>,
    /// Password of the master and replicas.
    pub password: Option<String>,
    /// Password of the sentinels.
    pub sentinel_password: Option<String>,
}

/// A master's address as the sentinels name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddr {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for MasterAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// The sentinels, with a connection kept to each one that answered.
pub struct Sentinels {
    master_name: String,
    nodes: Vec<Node>,
    config: AsyncConnectionConfig,
}

struct Node {
    name: String,
    client: Client,
    connection: Option<MultiplexedConnection>,
}

impl Sentinels {
    /// `timeout` bounds connecting to one sentinel and each of its answers.
    pub fn new(settings: &SentinelSettings, timeout: Duration) -> Result<Sentinels, StoreError> {
        let mut redis = RedisConnectionInfo::default();
        if let Some(password) = &settings.sentinel_password {
            redis = redis.set_password(password);
        }
        let nodes = settings
            .nodes
            .iter()
            .map(|(host, port)| {
                let info = ConnectionAddr::Tcp(host.clone(), *port)
                    .into_connection_info()
                    .map_err(|e| StoreError::Connection(e.to_string()))?
                    .set_redis_settings(redis.clone());
                let client =
                    Client::open(info).map_err(|e| StoreError::Connection(e.to_string()))?;
                Ok(Node {
                    name: format!("{host}:{port}"),
                    client,
                    connection: None,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Sentinels {
            master_name: settings.master_name.clone(),
            nodes,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
        })
    }

    /// The master's address according to the first sentinel that knows it.
    pub async fn master(&mut self) -> Result<MasterAddr, StoreError> {
        let mut reasons = Vec::new();
        for index in 0..self.nodes.len() {
            let node = &mut self.nodes[index];
            match node.ask(&self.master_name, &self.config).await {
                Ok(Some(addr)) => {
                    self.nodes[..=index].rotate_right(1);
                    return Ok(addr);
                }
                Ok(None) => reasons.push(format!(
                    "{} does not know master `{}`",
                    node.name, self.master_name
                )),
                Err(err) => {
                    node.connection = None;
                    reasons.push(format!("{}: {err}", node.name));
                }
            }
        }
        Err(StoreError::Connection(format!(
            "no sentinel named the master: {}",
            reasons.join("; ")
        )))
    }
}

impl Sentinels {
    /// A client of each sentinel, to listen to its announcements.
    pub fn clients(&self) -> Vec<Client> {
        self.nodes.iter().map(|n| n.client.clone()).collect()
    }
}

/// Time between attempts to listen to a sentinel that cannot be reached. Missing an
/// announcement costs exactness during that failover, not the failover itself: the lookups
/// still follow it.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// Calls `replaced` with the master's address whenever the sentinel `client` announces a
/// failover of `master_name`, until the task is dropped. Subscribing is bounded by `timeout`;
/// a lost subscription is made again after `RESUBSCRIBE_AFTER`.
pub async fn watch_failovers(
    client: Client,
    master_name: String,
    timeout: Duration,
    replaced: impl Fn(MasterAddr) + Send,
) {
    loop {
        if let Err(err) = watch_once(&client, &master_name, timeout, &replaced).await {
            tracing::debug!(error = %err, "lost a sentinel's announcements");
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}

async fn watch_once(
    client: &Client,
    master_name: &str,
    timeout: Duration,
    replaced: &impl Fn(MasterAddr),
) -> Result<(), redis::RedisError> {
    let subscribe = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe("+selected-slave").await?;
        Ok::<_, redis::RedisError>(pubsub)
    };
    let mut pubsub = tokio::time::timeout(timeout, subscribe)
        .await
        .map_err(|_| {
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
        })??;
    let mut messages = pubsub.on_message();
    while let Some(message) = messages.next().await {
        let payload: String = message.get_payload()?;
        if let Some(master) = replaced_master(&payload, master_name) {
            replaced(master);
        }
    }
    Ok(())
}

/// The master in a `+selected-slave` payload,
/// `slave <ip>:<port> <ip> <port> @ <master-name> <master-ip> <master-port>`, if it is ours.
fn replaced_master(payload: &str, master_name: &str) -> Option<MasterAddr> {
    let (_, master) = payload.split_once(" @ ")?;
    let mut parts = master.split(' ');
    let (name, host, port) = (parts.next()?, parts.next()?, parts.next()?);
    if name != master_name {
        return None;
    }
    Some(MasterAddr {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

impl Node {
    async fn ask(
        &mut self,
        master_name: &str,
        config: &AsyncConnectionConfig,
    ) -> Result<Option<MasterAddr>, redis::RedisError> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => self.connection.insert(
                self.client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
            ),
        };
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(master_name)
            .query_async(connection)
            .await?;
        Ok(addr.map(|(host, port)| MasterAddr { host, port }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_replaced_master() {
        let payload = "slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379";
        assert_eq!(
            replaced_master(payload, "mymaster"),
            Some(MasterAddr {
                host: "127.0.0.1".to_owned(),
                port: 6379
            })
        );
        assert_eq!(replaced_master(payload, "other"), None);
        assert_eq!(replaced_master("slave x @ mymaster h", "mymaster"), None);
    }
}
