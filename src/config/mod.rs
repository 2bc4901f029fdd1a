//! The policy file: its serde schema, and reading it with errors that point at the file, line,
//! column and field a person has to fix.
//!
//! Values are parsed into their real types while the YAML is read (durations, key parts, URLs,
//! methods, names), so a wrong value is reported at its own position. Checks that relate one
//! part of the file to another (unknown upstream, duplicate names) happen in `policy`, using
//! the positions kept here with `Spanned`.
//!
//! Every type of the file also describes itself as JSON Schema (`schemars::JsonSchema`: derived
//! on the structs, written by hand in `schema` for values parsed from text; a `Spanned<T>`
//! field says `#[schemars(with = "T")]`). After changing a field, regenerate
//! `config/sluice.schema.json` with `SLUICE_UPDATE_SCHEMA=1 cargo test --test it schema::`.

mod admin;
mod duration;
mod schema;
mod types;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
pub use serde_saphyr::Spanned;

use sha2::{Digest, Sha256};

use crate::limiter::{ClusterSettings, SentinelSettings, Topology};

pub use admin::{AdminConfig, EnvName};
pub use duration::ConfigDuration;
pub use schema::json_schema;
pub use types::{
    AlgorithmConfig, ByteSize, FieldName, ForwardedHeader, HostPort, IpNet, KeyPart, LogFormat,
    MethodName, Name, OnStoreError, PathPrefix, Positive, RedisUrl, ResponseHeaders, Status,
    UpstreamUrl,
};
pub use types::{OnExceed, StatusMatch, HOP_BY_HOP};

/// Default most requests of one route held at once by `on_exceed: delay` limits.
pub const DEFAULT_MAX_DELAYED: u32 = 1024;
/// Longest `max_delay` accepted: a held request keeps its connection open.
pub const MAX_MAX_DELAY_MS: u64 = 60_000;

/// Default timeout of one store call, including waiting for a pooled connection.
pub const DEFAULT_STORE_TIMEOUT_MS: u64 = 50;
/// Default number of multiplexed Redis connections (few suffice: each carries many decisions).
pub const DEFAULT_POOL_SIZE: u32 = 4;
/// Default prefix of every key sluice writes to the store.
pub const DEFAULT_KEY_PREFIX: &str = "sluice";
/// Default longest request line (method, target and version) accepted; longer gets 414.
pub const DEFAULT_MAX_REQUEST_LINE: u64 = 8 * 1024;
/// Default most bytes of header fields (names, values and their separators); more gets 431.
pub const DEFAULT_MAX_HEADER_BYTES: u64 = 32 * 1024;
/// Default most header fields in one request; more gets 431.
pub const DEFAULT_MAX_HEADERS: u32 = 100;
/// Default most client connections open at once; past it, new ones wait in the backlog.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10_000;
/// Default time a client has to send its request headers.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default prefix length IPv6 client addresses are grouped by in a limit's key: one /64 is
/// what a single subscriber is usually given (RFC 6177), so one client, one bucket.
pub const DEFAULT_IPV6_PREFIX: u32 = 64;
/// Default prefix length IPv4 client addresses are grouped by: each address apart.
pub const DEFAULT_IPV4_PREFIX: u32 = 32;
/// Default time a connection may go without sending or receiving a byte.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default time the whole of a request body gets to arrive, from when sluice starts reading it.
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 60_000;
/// Default least average rate of a request body after the grace, in bytes a second.
pub const DEFAULT_BODY_MIN_RATE: u64 = 1024;
/// Default time a request body may arrive at any rate before `body_min_rate` applies.
pub const DEFAULT_BODY_RATE_GRACE_MS: u64 = 10_000;
/// Default time requests in flight get to finish once the listeners have closed.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 10_000;
/// Default most keys the in-process store tracks; past it, the least recently used goes.
pub const DEFAULT_LOCAL_MAX_KEYS: u32 = 100_000;
/// Default time allowed to open a TCP connection to an upstream.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default time allowed for an upstream to answer with its response headers.
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 30_000;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    #[schemars(with = "SocketAddr")]
    pub admin_listen: Spanned<SocketAddr>,
    /// Who may use the admin API on `admin_listen` (applied at start).
    #[serde(default)]
    pub admin: AdminConfig,
    /// TLS on `listen` (the gateway listener); absent: cleartext HTTP/1.1 and h2c.
    #[schemars(with = "Option<ListenerTlsConfig>")]
    pub tls: Option<Spanned<ListenerTlsConfig>>,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    /// Peers whose forwarded-for header is believed when finding the client's address.
    #[serde(default)]
    pub trusted_proxies: Vec<IpNet>,
    /// The header those proxies set.
    #[serde(default)]
    pub forwarded_header: ForwardedHeader,
    /// Which rate-limit fields responses carry, unless a route says otherwise.
    #[serde(default)]
    pub response_headers: ResponseHeaders,
    /// `text` or `json` lines on standard error (applied at start; a reload cannot change it).
    #[serde(default)]
    pub log_format: LogFormat,
    #[serde(default)]
    pub upstreams: BTreeMap<Name, UpstreamConfig>,
    pub routes: Vec<RouteConfig>,
}

/// What the listeners accept: sizes of the request head and body, connections, timeouts.
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    #[serde(default = "default_max_request_line")]
    #[serde(deserialize_with = "bytes_within::<256, 65_534, _>")]
    #[schemars(schema_with = "schema::bytes_within::<256, 65_534>")]
    pub max_request_line: ByteSize,
    #[serde(default = "default_max_header_bytes")]
    #[serde(deserialize_with = "bytes_within::<1_024, 1_048_576, _>")]
    #[schemars(schema_with = "schema::bytes_within::<1_024, 1_048_576>")]
    pub max_header_bytes: ByteSize,
    #[serde(default = "default_max_headers")]
    #[serde(deserialize_with = "count_within::<1, 10_000, _>")]
    #[schemars(schema_with = "schema::count_within::<1, 10_000>")]
    pub max_headers: Positive,
    /// The default `max_body` of routes that set none; `None`: unlimited.
    pub max_body: Option<ByteSize>,
    #[serde(default = "default_max_connections")]
    #[serde(deserialize_with = "count_within::<1, 1_000_000, _>")]
    #[schemars(schema_with = "schema::count_within::<1, 1_000_000>")]
    pub max_connections: Positive,
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout: ConfigDuration,
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout: ConfigDuration,
    /// The whole request body must arrive within this, counted from when sluice starts
    /// reading it; routes may set their own.
    #[serde(default = "default_body_timeout")]
    pub body_timeout: ConfigDuration,
    /// After `body_rate_grace`, a request body must keep up an average of at least this many
    /// bytes a second (`0`: no minimum); routes may set their own.
    #[serde(default = "default_body_min_rate")]
    pub body_min_rate: ByteSize,
    /// How long a request body may arrive at any rate before `body_min_rate` applies.
    #[serde(default = "default_body_rate_grace")]
    pub body_rate_grace: ConfigDuration,
    /// After SIGTERM, how long `/readyz` answers 503 while the listeners still accept, so
    /// load balancers stop sending first; absent: close at once.
    pub shutdown_delay: Option<ConfigDuration>,
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace: ConfigDuration,
    /// How many threads serve the gateway, each with its own runtime, listener and upstream
    /// connections: `auto` (the default) is one per available core.
    #[serde(default)]
    pub workers: Workers,
}

/// `server.workers`: `auto` or a count from 1 to [`Workers::MAX`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Workers {
    #[default]
    Auto,
    Count(u32),
}

impl Workers {
    pub const MAX: u32 = 1024;

    /// The number of workers to start: `auto` asks the OS how many cores this process may use.
    pub fn resolve(self) -> usize {
        match self {
            Workers::Count(count) => count as usize,
            Workers::Auto => std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Workers, D::Error> {
        struct Visitor;
        const EXPECTED: &str = "`auto` or a number of workers from 1 to 1024";
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Workers;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, count: u64) -> Result<Workers, E> {
                match u32::try_from(count) {
                    Ok(count) if (1..=Workers::MAX).contains(&count) => Ok(Workers::Count(count)),
                    _ => Err(E::custom(format!("must be {EXPECTED}, got {count}"))),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, count: i64) -> Result<Workers, E> {
                match u64::try_from(count) {
                    Ok(count) => self.visit_u64(count),
                    Err(_) => Err(E::custom(format!("must be {EXPECTED}, got {count}"))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Workers, E> {
                if text == "auto" {
                    Ok(Workers::Auto)
                } else {
                    Err(E::custom(format!("must be {EXPECTED}, got {text:?}")))
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_request_line: default_max_request_line(),
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            max_body: None,
            max_connections: default_max_connections(),
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            body_timeout: default_body_timeout(),
            body_min_rate: default_body_min_rate(),
            body_rate_grace: default_body_rate_grace(),
            shutdown_delay: None,
            shutdown_grace: default_shutdown_grace(),
            workers: Workers::Auto,
        }
    }
}

#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    #[schemars(with = "Option<RedisConfig>")]
    pub redis: Option<Spanned<RedisConfig>>,
    #[serde(default)]
    pub local: LocalConfig,
    /// What limited routes do when Redis cannot decide, unless a route says otherwise.
    #[serde(default = "default_on_store_error")]
    pub on_store_error: OnStoreError,
    #[serde(default = "default_key_prefix")]
    pub key_prefix: Name,
    /// Where Redis is, made from `redis` by `parse` (which refuses a `store.redis` without
    /// exactly one of `url`, `sentinel` and `cluster`); `None`: the in-process store.
    #[serde(skip)]
    #[schemars(skip)]
    pub topology: Option<Topology>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            redis: None,
            topology: None,
            local: LocalConfig::default(),
            on_store_error: default_on_store_error(),
            key_prefix: default_key_prefix(),
        }
    }
}

/// The in-process store, used when no Redis is configured.
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LocalConfig {
    #[serde(default = "default_local_max_keys")]
    #[serde(deserialize_with = "count_within::<1_024, 100_000_000, _>")]
    #[schemars(schema_with = "schema::count_within::<1_024, 100_000_000>")]
    pub max_keys: Positive,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            max_keys: default_local_max_keys(),
        }
    }
}

impl StoreConfig {
    /// Where Redis is (`None`: no Redis, the in-process store). Refuses a `store.redis` that
    /// gives more than one of `url`, `sentinel` and `cluster`, or none, at the position of the
    /// offending field.
    fn read_topology(&self, file: &Path) -> Result<Option<Topology>, ConfigError> {
        let Some(redis) = &self.redis else {
            return Ok(None);
        };
        const ONE_OF: &str = "`url` (one Redis), `sentinel` (a master found through Redis \
                              Sentinel) or `cluster` (a Redis Cluster)";
        let config = &redis.value;
        let mut topologies = Vec::with_capacity(1);
        if let Some(url) = &config.url {
            topologies.push((
                Position::from(url),
                "store.redis.url",
                Topology::Single {
                    url: url.value.0.clone(),
                },
            ));
        }
        if let Some(sentinel) = &config.sentinel {
            nodes_listed(
                file,
                &sentinel.value.nodes,
                "store.redis.sentinel.nodes",
                "sentinel",
            )?;
            topologies.push((
                Position::from(sentinel),
                "store.redis.sentinel",
                Topology::Sentinel(sentinel.value.settings()),
            ));
        }
        if let Some(cluster) = &config.cluster {
            nodes_listed(
                file,
                &cluster.value.nodes,
                "store.redis.cluster.nodes",
                "cluster node",
            )?;
            topologies.push((
                Position::from(cluster),
                "store.redis.cluster",
                Topology::Cluster(cluster.value.settings()),
            ));
        }
        match topologies.len() {
            0 => Err(ConfigError::invalid(
                file,
                Position::from(redis),
                "store.redis",
                format!("needs {ONE_OF}"),
            )),
            1 => Ok(topologies.pop().map(|(_, _, topology)| topology)),
            _ => {
                let (position, field, _) = &topologies[1];
                Err(ConfigError::invalid(
                    file,
                    *position,
                    *field,
                    format!("give exactly one of {ONE_OF}"),
                ))
            }
        }
    }

    /// Whether `other` reaches the same Redis the same way: the same topology, timeout and
    /// pool, wherever they stand in the file (the derived `==` also compares positions).
    pub fn same_redis(&self, other: &StoreConfig) -> bool {
        let tuning = |c: &StoreConfig| {
            c.redis
                .as_ref()
                .map(|r| (r.value.timeout, r.value.pool_size))
        };
        self.topology == other.topology && tuning(self) == tuning(other)
    }
}

/// Refuses an empty list of nodes to start from.
fn nodes_listed(
    file: &Path,
    nodes: &Spanned<Vec<HostPort>>,
    field: &str,
    what: &str,
) -> Result<(), ConfigError> {
    if nodes.value.is_empty() {
        return Err(ConfigError::invalid(
            file,
            Position::from(nodes),
            field,
            format!("list at least one {what} (host:port); three or more is usual"),
        ));
    }
    Ok(())
}

/// `store.redis` as the file spells it: where Redis is (exactly one of `url`, `sentinel` and
/// `cluster`, made into a `Topology` by `parse`) and how each decision uses it.
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    #[schemars(with = "Option<RedisUrl>")]
    pub url: Option<Spanned<RedisUrl>>,
    #[schemars(with = "Option<SentinelConfig>")]
    pub sentinel: Option<Spanned<SentinelConfig>>,
    #[schemars(with = "Option<ClusterConfig>")]
    pub cluster: Option<Spanned<ClusterConfig>>,
    #[serde(default = "default_store_timeout")]
    pub timeout: ConfigDuration,
    #[serde(default = "default_pool_size")]
    pub pool_size: types::PoolSize,
}

/// A Redis master found and followed through Redis Sentinel.
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SentinelConfig {
    /// The name the sentinels monitor the master under (`sentinel monitor NAME ...`).
    pub master_name: Name,
    /// Sentinels asked in turn for the master's address.
    #[schemars(with = "Vec<HostPort>")]
    pub nodes: Spanned<Vec<HostPort>>,
    /// Password of the Redis master and replicas (`requirepass`).
    pub password: Option<String>,
    /// Password of the sentinels themselves (their `requirepass`), when they have one.
    pub sentinel_password: Option<String>,
}

/// A Redis Cluster: the nodes to learn the slot map from (any of its masters or replicas;
/// the rest of the cluster is discovered from them).
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    #[schemars(with = "Vec<HostPort>")]
    pub nodes: Spanned<Vec<HostPort>>,
    /// ACL user of every node, when not `default`.
    pub username: Option<String>,
    /// Password of every node (`requirepass`, or the ACL user's).
    pub password: Option<String>,
}

impl SentinelConfig {
    fn settings(&self) -> SentinelSettings {
        SentinelSettings {
            master_name: self.master_name.to_string(),
            nodes: host_ports(&self.nodes.value),
            password: self.password.clone(),
            sentinel_password: self.sentinel_password.clone(),
        }
    }
}

impl ClusterConfig {
    fn settings(&self) -> ClusterSettings {
        ClusterSettings {
            nodes: host_ports(&self.nodes.value),
            username: self.username.clone(),
            password: self.password.clone(),
        }
    }
}

fn host_ports(nodes: &[HostPort]) -> Vec<(String, u16)> {
    nodes
        .iter()
        .map(|node| (node.host.clone(), node.port))
        .collect()
}

/// `tls:` of the gateway listener: a PEM certificate chain (leaf first) and its private key
/// (PKCS#8, PKCS#1 RSA or SEC1 EC). Relative paths are relative to the config file's
/// directory. The files are watched: a valid new pair serves new handshakes.
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    #[schemars(with = "PathBuf")]
    pub cert: Spanned<PathBuf>,
    #[schemars(with = "PathBuf")]
    pub key: Spanned<PathBuf>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub url: UpstreamUrl,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: ConfigDuration,
    #[serde(default = "default_upstream_timeout")]
    pub timeout: ConfigDuration,
    /// https upstreams: a PEM bundle of the CAs to trust instead of the built-in roots.
    #[schemars(with = "Option<PathBuf>")]
    pub ca_file: Option<Spanned<PathBuf>>,
    /// https upstreams: the PEM certificate chain sluice presents (mTLS); needs `client_key`.
    #[schemars(with = "Option<PathBuf>")]
    pub client_cert: Option<Spanned<PathBuf>>,
    /// https upstreams: the private key of `client_cert`.
    #[schemars(with = "Option<PathBuf>")]
    pub client_key: Option<Spanned<PathBuf>>,
    /// Speak HTTP/2 with prior knowledge (h2c) to this upstream, as gRPC servers expect.
    #[serde(default)]
    pub http2: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[schemars(with = "Name")]
    pub name: Spanned<Name>,
    #[serde(rename = "match")]
    pub matcher: MatchConfig,
    #[schemars(with = "Option<Name>")]
    pub upstream: Option<Spanned<Name>>,
    #[schemars(with = "Option<RespondConfig>")]
    pub respond: Option<Spanned<RespondConfig>>,
    /// Largest request body forwarded; overrides `server.max_body`.
    pub max_body: Option<ByteSize>,
    /// Overrides `server.body_timeout` for this route.
    pub body_timeout: Option<ConfigDuration>,
    /// Overrides `server.body_min_rate` for this route (`0`: no minimum).
    pub body_min_rate: Option<ByteSize>,
    /// Overrides `store.on_store_error` for this route.
    pub on_store_error: Option<OnStoreError>,
    /// Overrides the top-level `response_headers` for this route.
    pub response_headers: Option<ResponseHeaders>,
    #[serde(default)]
    pub limits: Vec<LimitConfig>,
    /// With a limit of `on_exceed: delay`: most requests of this route held at once.
    #[schemars(with = "Option<Positive>")]
    pub max_delayed: Option<Spanned<Positive>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    pub path_prefix: PathPrefix,
    /// The methods this route takes; every method when empty. A list naming `GET` also takes
    /// `HEAD`, for which upstreams run the GET handler.
    #[serde(default)]
    pub methods: Vec<MethodName>,
    /// Match the path prefix case-sensitively. Off by default: many upstreams route
    /// `/LOGIN` to `/login`, and a limit that misses it is a way around the limit.
    #[serde(default)]
    pub case_sensitive: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RespondConfig {
    pub status: Status,
    #[serde(default)]
    pub body: String,
    #[serde(default = "default_content_type")]
    pub content_type: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    #[schemars(with = "Name")]
    pub name: Spanned<Name>,
    #[schemars(with = "Vec<KeyPart>")]
    pub key: Spanned<Vec<KeyPart>>,
    #[schemars(with = "Positive")]
    pub requests: Spanned<Positive>,
    pub window: ConfigDuration,
    /// How the limit counts; `sliding_log` (exact) by default.
    #[serde(default)]
    pub algorithm: AlgorithmConfig,
    /// GCRA only: how many requests may arrive at once; `requests` by default, so a fresh
    /// key admits as many at once as under the other algorithms.
    #[schemars(with = "Option<Positive>")]
    pub burst: Option<Spanned<Positive>>,
    /// How many requests one request counts as; 1 by default.
    #[schemars(with = "Option<Positive>")]
    pub cost: Option<Spanned<Positive>>,
    /// Evaluate and count, but never reject (to try a limit on live traffic).
    #[serde(default)]
    pub shadow: bool,
    /// Conditions on the request, all of which must hold for this limit to apply.
    #[serde(default)]
    #[schemars(with = "Vec<ConditionConfig>")]
    pub when: Vec<Spanned<ConditionConfig>>,
    /// `reject` (429, the default) or `delay` (hold the request up to `max_delay`).
    #[schemars(with = "Option<OnExceed>")]
    pub on_exceed: Option<Spanned<OnExceed>>,
    /// With `on_exceed: delay`: the longest a request is held.
    #[schemars(with = "Option<ConfigDuration>")]
    pub max_delay: Option<Spanned<ConfigDuration>>,
    /// Count only the requests whose response status matches; the others are given back.
    #[schemars(with = "Option<CountConfig>")]
    pub count: Option<Spanned<CountConfig>>,
    /// The client address counts by its network of this many bits when it is IPv6 (1 to
    /// 128; 64 by default), in a `client_ip` key part and the client-IP fallback alike.
    #[serde(default)]
    #[schemars(schema_with = "schema::prefix_within::<1, 128>")]
    pub ipv6_prefix: Option<Spanned<u32>>,
    /// The same for IPv4 addresses, IPv4-mapped IPv6 ones included (1 to 32; 32 by default).
    #[serde(default)]
    #[schemars(schema_with = "schema::prefix_within::<1, 32>")]
    pub ipv4_prefix: Option<Spanned<u32>>,
}

impl LimitConfig {
    /// The algorithm this limit counts with, as the limiter names it.
    pub fn algorithm(&self) -> crate::limiter::Algorithm {
        self.algorithm.into()
    }
}

/// A limit's `count:`: which outcomes it counts.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountConfig {
    pub status: Vec<StatusMatch>,
}

/// One condition of a limit's `when:`: exactly one of `header` (with one of `equals`,
/// `one_of`, `present`), `method` or `host`. Checked, with its position, in `policy`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConditionConfig {
    pub header: Option<FieldName>,
    pub equals: Option<String>,
    pub one_of: Option<Vec<String>>,
    pub present: Option<bool>,
    /// The request method is one of these; a list naming `GET` also takes `HEAD`.
    pub method: Option<Vec<MethodName>>,
    pub host: Option<Vec<String>>,
}

fn default_max_request_line() -> ByteSize {
    ByteSize(DEFAULT_MAX_REQUEST_LINE)
}
fn default_max_header_bytes() -> ByteSize {
    ByteSize(DEFAULT_MAX_HEADER_BYTES)
}
fn default_max_headers() -> Positive {
    Positive(DEFAULT_MAX_HEADERS)
}
fn default_max_connections() -> Positive {
    Positive(DEFAULT_MAX_CONNECTIONS)
}
fn default_header_read_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(
        DEFAULT_HEADER_READ_TIMEOUT_MS,
    ))
}
fn default_idle_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_IDLE_TIMEOUT_MS))
}
fn default_body_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_BODY_TIMEOUT_MS))
}
fn default_body_min_rate() -> ByteSize {
    ByteSize(DEFAULT_BODY_MIN_RATE)
}
fn default_body_rate_grace() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_BODY_RATE_GRACE_MS))
}
fn default_shutdown_grace() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_SHUTDOWN_GRACE_MS))
}
fn default_local_max_keys() -> Positive {
    Positive(DEFAULT_LOCAL_MAX_KEYS)
}

/// A size checked against bounds as it is read, so the error points at the value.
fn bytes_within<'de, const MIN: u64, const MAX: u64, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<ByteSize, D::Error> {
    let size = ByteSize::deserialize(deserializer)?;
    if !(MIN..=MAX).contains(&size.0) {
        return Err(serde::de::Error::custom(format!(
            "must be from {MIN} to {MAX} bytes, got {}",
            size.0
        )));
    }
    Ok(size)
}

/// A count checked against bounds as it is read, so the error points at the value.
fn count_within<'de, const MIN: u32, const MAX: u32, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Positive, D::Error> {
    let count = u32::deserialize(deserializer)?;
    if !(MIN..=MAX).contains(&count) {
        return Err(serde::de::Error::custom(format!(
            "must be from {MIN} to {MAX}, got {count}"
        )));
    }
    Ok(Positive(count))
}

/// `local`: a Redis outage neither turns into an API outage (`deny`) nor lifts every limit
/// (`allow`); each instance keeps enforcing the limits on its own.
fn default_on_store_error() -> OnStoreError {
    OnStoreError::Local
}

fn default_key_prefix() -> Name {
    Name::new_unchecked(DEFAULT_KEY_PREFIX)
}
fn default_store_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_STORE_TIMEOUT_MS))
}
fn default_pool_size() -> types::PoolSize {
    types::PoolSize(DEFAULT_POOL_SIZE)
}
fn default_connect_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_CONNECT_TIMEOUT_MS))
}
fn default_upstream_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(
        DEFAULT_UPSTREAM_TIMEOUT_MS,
    ))
}
fn default_content_type() -> String {
    "text/plain; charset=utf-8".to_owned()
}

/// A position in the policy file (1-based line and column; 0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    pub line: u64,
    pub column: u64,
}

impl<T> From<&Spanned<T>> for Position {
    fn from(spanned: &Spanned<T>) -> Self {
        Position {
            line: spanned.referenced.line(),
            column: spanned.referenced.column(),
        }
    }
}

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read the file", file.display())]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", Located { file, position, field })]
    Invalid {
        file: PathBuf,
        position: Position,
        field: String,
        message: String,
    },
}

impl ConfigError {
    pub fn invalid(
        file: &Path,
        position: Position,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            file: file.to_owned(),
            position,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Renders `file:line:column: field` the way compilers do, so editors can jump to it.
struct Located<'a> {
    file: &'a Path,
    position: &'a Position,
    field: &'a str,
}

impl fmt::Display for Located<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.position.line > 0 {
            write!(f, ":{}:{}", self.position.line, self.position.column)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        Ok(())
    }
}

/// A policy file as read: its contents, and the SHA-256 of the bytes they were parsed from
/// (which version of the file serves, see `sluice_config_hash`).
pub struct Source {
    pub config: Config,
    pub digest: [u8; 32],
    /// The text it was parsed from (for `/admin/v1/config`).
    pub text: std::sync::Arc<str>,
}

/// Reads and parses the policy file at `file`.
pub fn load(file: &Path) -> Result<Source, ConfigError> {
    let bytes = std::fs::read(file).map_err(|source| read_error(file, source))?;
    from_bytes(&bytes, file)
}

/// Parses the bytes of a policy file; `file` is only used to name the source in errors.
pub fn from_bytes(bytes: &[u8], file: &Path) -> Result<Source, ConfigError> {
    let digest = Sha256::digest(bytes).into();
    let text = std::str::from_utf8(bytes).map_err(|err| {
        read_error(
            file,
            std::io::Error::new(std::io::ErrorKind::InvalidData, err),
        )
    })?;
    let config = parse(text, file)?;
    Ok(Source {
        config,
        digest,
        text: std::sync::Arc::from(text),
    })
}

/// The error for a policy file that cannot be read (or is not UTF-8).
pub fn read_error(file: &Path, source: std::io::Error) -> ConfigError {
    ConfigError::Read {
        file: file.to_owned(),
        source,
    }
}

/// Parses policy text; `file` is only used to name the source in errors.
pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
    let mut failed_at = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(text, options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|err| {
            failed_at = err.path().to_string();
            err.into_inner()
        })
    });
    let config: Config = result.map_err(|err| {
        let position = err
            .location()
            .map(|l| Position {
                line: l.line(),
                column: l.column(),
            })
            .unwrap_or_default();
        ConfigError::invalid(
            file,
            position,
            field_of(&failed_at, &err),
            plain_message(&err),
        )
    })?;
    let mut config = config;
    config.store.topology = config.store.read_topology(file)?;
    admin::check(&config.admin_listen, &config.admin, file)?;
    Ok(config)
}

/// Policy text as a JSON value (aliases resolved), read with the same limits as `parse`: for
/// showing the file in force, not for checking it.
pub fn to_json(text: &str) -> Result<serde_json::Value, serde_saphyr::Error> {
    serde_saphyr::from_str_with_options(text, options())
}

/// Limits that keep a hostile or broken file (deep nesting, alias bombs) from using much time
/// or memory; a real policy is far below every one of them.
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        with_snippet: false,
        budget: serde_saphyr::budget! {
            max_reader_input_bytes: Some(16 * 1024 * 1024),
            max_events: 200_000,
            max_aliases: 1_000,
            max_anchors: 1_000,
            max_depth: 32,
            max_nodes: 100_000,
            max_total_scalar_bytes: 16 * 1024 * 1024,
            max_recorded_anchor_events: 50_000,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 50_000,
        },
    }
}

/// The key given twice, when the error is a duplicate key.
fn duplicate_key(err: &serde_saphyr::Error) -> Option<&str> {
    match err.without_snippet() {
        serde_saphyr::Error::DuplicateMappingKey { key, .. } => key.as_deref(),
        _ => None,
    }
}

/// The field path of an error, as the user wrote it. serde_path_to_error writes `.` for the
/// document root and `?` for a mapping key it has not read (as with a duplicate key, which the
/// parser names), and sees a `Spanned` field as a struct holding the value in a field `value`,
/// a segment that is not in the file. (Right under `upstreams`, `value` is an upstream's name.)
fn field_of(failed_at: &str, err: &serde_saphyr::Error) -> String {
    if failed_at == "." {
        return String::new();
    }
    let mut path = String::new();
    for segment in failed_at.split('.') {
        let spanned_value = segment
            .strip_prefix("value")
            .filter(|rest| rest.is_empty() || rest.starts_with('['));
        match (spanned_value, duplicate_key(err)) {
            (Some(index), _) if !path.is_empty() && path != "upstreams" => {
                path.push_str(index);
                continue;
            }
            (_, Some(key)) if segment == "?" => segment_into(&mut path, key),
            _ => segment_into(&mut path, segment),
        }
    }
    path
}

fn segment_into(path: &mut String, segment: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(segment);
}

/// The parser appends " at line L, column C"; we print the position up front instead. Its
/// message for a duplicate key suggests a parser option, which is no help to a user.
fn plain_message(err: &serde_saphyr::Error) -> String {
    if let Some(key) = duplicate_key(err) {
        return format!("`{key}` is given twice; each key may appear once");
    }
    let text = err.to_string();
    match text.rfind(" at line ") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn error_of(yaml: &str) -> String {
        match parse(yaml, Path::new("test.yaml")) {
            Ok(_) => panic!("expected an error for:\n{yaml}"),
            Err(err) => err.to_string(),
        }
    }

    const HEAD: &str = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\n";

    #[test]
    fn a_bad_duration_names_line_column_and_field() {
        let yaml = format!(
            "{HEAD}routes:\n  - name: x\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: a, key: [client_ip], requests: 5, window: thirty }}\n"
        );
        let err = error_of(&yaml);
        assert!(
            err.starts_with("test.yaml:8:59: routes[0].limits[0].window: expected a duration"),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let yaml = format!("{HEAD}routes: []\nstore: {{ redis_url: x }}\n");
        let err = error_of(&yaml);
        assert!(err.contains("test.yaml:4:10"), "{err}");
        assert!(err.contains("unknown field `redis_url`"), "{err}");
    }

    #[test]
    fn field_paths_are_as_written() {
        let route = "routes:\n  - name: \"a b\"\n    match: { path_prefix: / }\n";
        let err = error_of(&format!("{HEAD}{route}"));
        assert!(
            err.starts_with("test.yaml:4:11: routes[0].name: a name"),
            "{err}"
        );
        let limit = "    respond: { status: 200 }\n    limits: [{ name: a, key: [client_ip, \"jwt:sub\"], requests: 1, window: 1s }]\n";
        let err = error_of(&format!("{HEAD}{}{limit}", route.replace("\"a b\"", "r")));
        assert!(
            err.contains(": routes[0].limits[0].key[1]: expected a key part"),
            "{err}"
        );
        let upstream = "upstreams:\n  value: { url: nonsense }\nroutes: []\n";
        let err = error_of(&format!("{HEAD}{upstream}"));
        assert!(
            err.contains(": upstreams.value.url: expected a URL"),
            "{err}"
        );
    }

    #[test]
    fn zero_requests_are_refused() {
        let yaml = format!(
            "{HEAD}routes:\n  - name: x\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits: [{{ name: a, key: [client_ip], requests: 0, window: 1s }}]\n"
        );
        let err = error_of(&yaml);
        assert!(err.contains("routes[0].limits[0].requests"), "{err}");
    }

    #[test]
    fn redis_needs_exactly_one_of_url_sentinel_and_cluster() {
        let sentinel =
            "    sentinel:\n      master_name: mymaster\n      nodes: [\"127.0.0.1:26379\"]\n";
        let url = "    url: redis://127.0.0.1:6379/0\n";
        let cluster = "    cluster:\n      nodes: [\"127.0.0.1:7000\"]\n";
        let both = format!("{HEAD}routes: []\nstore:\n  redis:\n{url}{sentinel}");
        assert_eq!(
            error_of(&both),
            "test.yaml:8:7: store.redis.sentinel: give exactly one of `url` (one Redis), \
             `sentinel` (a master found through Redis Sentinel) or `cluster` (a Redis Cluster)"
        );
        let both = format!("{HEAD}routes: []\nstore:\n  redis:\n{url}{cluster}");
        assert!(
            error_of(&both).starts_with("test.yaml:8:7: store.redis.cluster: give exactly one of"),
            "{}",
            error_of(&both)
        );
        let neither = format!("{HEAD}routes: []\nstore:\n  redis:\n    timeout: 1s\n");
        assert_eq!(
            error_of(&neither),
            "test.yaml:6:5: store.redis: needs `url` (one Redis), `sentinel` (a master found \
             through Redis Sentinel) or `cluster` (a Redis Cluster)"
        );
        let no_nodes =
            format!("{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [] }}\n");
        let err = error_of(&no_nodes);
        assert!(
            err.starts_with(
                "test.yaml:6:23: store.redis.cluster.nodes: list at least one cluster node"
            ),
            "{err}"
        );
        let bad = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [\"h:1\", \"h:0\"] }}\n"
        );
        let err = error_of(&bad);
        assert!(
            err.contains(": store.redis.cluster.nodes[1]: expected host:port"),
            "{err}"
        );
        let unknown = format!("{HEAD}routes: []\nstore:\n  redis:\n    cluster: {{ nodes: [\"h:1\"], replicas: 1 }}\n");
        let err = error_of(&unknown);
        assert!(err.contains("store.redis.cluster"), "{err}");
        let none = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    sentinel: {{ master_name: m, nodes: [] }}\n"
        );
        let err = error_of(&none);
        assert!(
            err.starts_with("test.yaml:6:40: store.redis.sentinel.nodes: list at least one"),
            "{err}"
        );
        let bad = format!("{HEAD}routes: []\nstore:\n  redis:\n    sentinel: {{ master_name: m, nodes: [\"h:1\", nope] }}\n");
        let err = error_of(&bad);
        assert!(
            err.contains(": store.redis.sentinel.nodes[1]: expected host:port"),
            "{err}"
        );
    }

    #[test]
    fn a_sentinel_store_parses() {
        let yaml = format!(
            "{HEAD}routes: []\nstore:\n  redis:\n    sentinel:\n      master_name: mymaster\n      nodes: [\"127.0.0.1:26379\", \"[::1]:26380\"]\n      password: secret\n    timeout: 80ms\n"
        );
        let config = parse(&yaml, Path::new("test.yaml")).expect("parses");
        let Some(Topology::Sentinel(sentinel)) = &config.store.topology else {
            panic!(
                "expected a sentinel topology, got {:?}",
                config.store.topology
            );
        };
        assert_eq!(sentinel.master_name, "mymaster");
        assert_eq!(
            sentinel.nodes,
            [("127.0.0.1".to_owned(), 26379), ("::1".to_owned(), 26380)]
        );
        assert_eq!(sentinel.password.as_deref(), Some("secret"));
        assert_eq!(sentinel.sentinel_password, None);
    }

    #[test]
    fn each_redis_topology_is_made_when_the_file_is_parsed() {
        let store = |redis: &str| {
            let yaml = format!("{HEAD}routes: []\nstore:\n  redis:\n{redis}");
            parse(&yaml, Path::new("test.yaml")).expect("parses").store
        };
        let single = store("    url: redis://127.0.0.1:6379\n");
        assert_eq!(
            single.topology,
            Some(Topology::Single {
                url: "redis://127.0.0.1:6379".to_owned()
            })
        );
        let cluster = store("    cluster:\n      nodes: [\"127.0.0.1:7000\"]\n      username: u\n");
        assert_eq!(
            cluster.topology,
            Some(Topology::Cluster(ClusterSettings {
                nodes: vec![("127.0.0.1".to_owned(), 7000)],
                username: Some("u".to_owned()),
                password: None,
            }))
        );
        assert!(!single.same_redis(&cluster));
        let moved = store("    timeout: 50ms\n    url: redis://127.0.0.1:6379\n");
        assert!(
            single.same_redis(&moved),
            "the same values elsewhere in the file"
        );
        assert!(!single.same_redis(&store("    url: redis://127.0.0.1:6380\n")));
        let local = parse(&format!("{HEAD}routes: []\n"), Path::new("test.yaml")).expect("parses");
        assert_eq!(local.store.topology, None);
    }

    #[test]
    fn alias_bombs_are_refused() {
        let mut yaml = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (name, prev) in ["b", "c", "d", "e", "f", "g", "h", "i"]
            .iter()
            .zip(["a", "b", "c", "d", "e", "f", "g", "h"])
        {
            let refs = vec![format!("*{prev}"); 10].join(", ");
            yaml.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        let started = std::time::Instant::now();
        let result: Result<BTreeMap<String, serde_json::Value>, _> =
            serde_saphyr::from_str_with_options(&yaml, options());
        let err = result
            .expect_err("a billion laughs must not parse")
            .to_string();
        assert!(err.contains("budget") || err.contains("alias"), "{err}");
        // Refused in milliseconds; the bound is generous for a loaded CI machine, and a parser
        // that expanded the 10^9 nodes would take far longer (or run out of memory) first.
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }

    /// A valid file that uses every field, the starting point of the mutations below.
    const VALID: &str = r#"listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
store:
  redis:
    url: redis://127.0.0.1:6379/0
    timeout: 50ms
    pool_size: 32
  key_prefix: sluice
upstreams:
  api:
    url: "http://127.0.0.1:3000/v1"
    connect_timeout: 2s
    timeout: 30s
routes:
  - name: login
    match:
      path_prefix: /login
      methods: [POST]
    upstream: api
    limits:
      - name: per-ip
        key: [client_ip, "header:x-api-key"]
        requests: 5
        window: 1m
  - name: status
    match: { path_prefix: /status }
    respond:
      status: 200
      body: "ok\n"
      content_type: text/plain
"#;

    /// One change to a line-oriented YAML file.
    #[derive(Debug, Clone)]
    enum Edit {
        /// Replace what follows the line's first `:` (or the whole line) with this text.
        Value(prop::sample::Index, String),
        Delete(prop::sample::Index),
        Duplicate(prop::sample::Index),
        /// Add or remove this many leading spaces.
        Indent(prop::sample::Index, i8),
        /// Replace one byte of the file.
        Byte(prop::sample::Index, u8),
    }

    fn edit() -> impl Strategy<Value = Edit> {
        let line = any::<prop::sample::Index>;
        prop_oneof![
            (line(), "\\PC{0,12}").prop_map(|(i, v)| Edit::Value(i, v)),
            (line(), r#"[ -~]{0,12}"#).prop_map(|(i, v)| Edit::Value(i, v)),
            line().prop_map(Edit::Delete),
            line().prop_map(Edit::Duplicate),
            (line(), -4i8..=4).prop_map(|(i, n)| Edit::Indent(i, n)),
            (line(), any::<u8>()).prop_map(|(i, b)| Edit::Byte(i, b)),
        ]
    }

    fn apply(text: &str, edits: &[Edit]) -> String {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        for edit in edits {
            if lines.is_empty() {
                break;
            }
            match edit {
                Edit::Value(i, value) => {
                    let at = i.index(lines.len());
                    let line = &mut lines[at];
                    let keep = line.find(':').map_or(0, |colon| colon + 1);
                    line.truncate(keep);
                    line.push(' ');
                    line.push_str(value);
                }
                Edit::Delete(i) => {
                    lines.remove(i.index(lines.len()));
                }
                Edit::Duplicate(i) => {
                    let at = i.index(lines.len());
                    lines.insert(at, lines[at].clone());
                }
                Edit::Indent(i, n) => {
                    let at = i.index(lines.len());
                    let line = &mut lines[at];
                    if *n >= 0 {
                        line.insert_str(0, &" ".repeat(*n as usize));
                    } else {
                        let spaces = line.len() - line.trim_start_matches(' ').len();
                        line.drain(..spaces.min(n.unsigned_abs() as usize));
                    }
                }
                Edit::Byte(i, byte) => {
                    let mut bytes = lines.join("\n").into_bytes();
                    if !bytes.is_empty() {
                        let at = i.index(bytes.len());
                        bytes[at] = *byte;
                    }
                    let text = String::from_utf8_lossy(&bytes).into_owned();
                    lines = text.lines().map(str::to_owned).collect();
                }
            }
        }
        lines.join("\n") + "\n"
    }

    /// `parse` answers every input with a config or an error that names the file.
    fn parses_or_names_the_file(text: &str) -> Result<(), TestCaseError> {
        if let Err(err) = parse(text, Path::new("fuzz.yaml")) {
            let message = err.to_string();
            prop_assert!(message.starts_with("fuzz.yaml"), "{}", message);
        }
        Ok(())
    }

    #[test]
    fn the_mutations_start_from_a_valid_file() {
        let config = parse(VALID, Path::new("valid.yaml")).expect("VALID parses");
        assert_eq!(config.routes.len(), 2);
        assert_eq!(apply(VALID, &[]), VALID);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn arbitrary_bytes_parse_or_are_refused(
            bytes in prop::collection::vec(any::<u8>(), 0..2048),
        ) {
            parses_or_names_the_file(&String::from_utf8_lossy(&bytes))?;
        }

        #[test]
        fn mutations_of_a_valid_file_parse_or_are_refused(
            edits in prop::collection::vec(edit(), 1..6),
        ) {
            parses_or_names_the_file(&apply(VALID, &edits))?;
        }
    }
}
