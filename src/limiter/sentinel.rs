//! Finding the Redis master through Redis Sentinel.
//!
//! The sentinels are asked in the configured order with `SENTINEL get-master-addr-by-name`;
//! the first that names the master answers for all of them. One that cannot be reached, or
//! does not know the master, is skipped, and one that answers moves to the front, so a dead
//! sentinel costs its timeout once rather than on every lookup. The sentinels' answer is not
//! trusted blindly: `RedisStore` checks with `ROLE` that the node really is a master before
//! it sends decisions there (a sentinel may briefly name a demoted master during a failover).

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo,
};

use super::StoreError;

/// Where the sentinels are and what to ask them.
#[derive(Debug, Clone)]
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
