//! The sections of the policy file as serde reads them (listeners, server, store, upstreams,
//! routes, limits), with their defaults and the bounds checked while a value is read.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::types::{self, OnExceed, StatusMatch};
use super::{
    schema, AdminConfig, AlgorithmConfig, ByteSize, ConfigDuration, FieldName, ForwardedHeader,
    HostPort, IpNet, KeyPart, LogFormat, MethodName, Name, OnStoreError, PathPrefix, Positive,
    RedisUrl, ResponseHeaders, Spanned, Status, UpstreamUrl,
};
use crate::limiter::Topology;

/// Default most requests of one route held at once by `on_exceed: delay` limits.
pub const DEFAULT_MAX_DELAYED: u32 = 1024;
/// Longest `max_delay` accepted: a held request keeps its connection open.
pub const MAX_MAX_DELAY_MS: u64 = 60_000;
/// Default `should_retry_within`: OpenAI's Python SDK raises rather than wait longer.
pub const DEFAULT_SHOULD_RETRY_WITHIN: std::time::Duration = std::time::Duration::from_secs(120);
/// Default `lease` of a concurrency limit: an instance that dies has its places taken back
/// within this.
pub const DEFAULT_LEASE: std::time::Duration = std::time::Duration::from_secs(10);
/// Shortest and longest `lease`: renewed every quarter of it, by one store call per period.
pub const MIN_LEASE_MS: u64 = 1_000;
pub const MAX_LEASE_MS: u64 = 3_600_000;

/// Default `admin_listen`: loopback only, the port every example uses.
pub const DEFAULT_ADMIN_LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    9090,
));

/// `admin_listen` when the file leaves it out: at no position in the file.
fn default_admin_listen() -> Spanned<SocketAddr> {
    let nowhere = serde_saphyr::Location::UNKNOWN;
    Spanned::new(DEFAULT_ADMIN_LISTEN, nowhere, nowhere)
}

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
/// Default most bytes of request bodies held whole at once, across the process: token routes
/// read a body before deciding, and this is what a crowd of bodies that never end can pin.
pub const DEFAULT_TOKEN_BODY_BUDGET: u64 = 64 * 1024 * 1024;
/// Default most streams of one HTTP/2 connection reading a body whole at once.
pub const DEFAULT_TOKEN_BODIES_PER_CONNECTION: u32 = 32;
/// Default time requests in flight get to finish once the listeners have closed.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 10_000;
/// Default time a changed config file must read the same before it is applied: two polls.
pub const DEFAULT_RELOAD_SETTLE_MS: u64 = 500;
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
    /// `/metrics`, `/healthz`, `/readyz` and the admin API; by default loopback only
    /// (`127.0.0.1:9090`), so a minimal policy is `listen` and routes.
    #[schemars(with = "SocketAddr")]
    #[serde(default = "default_admin_listen")]
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
    /// The longest wait a refused client should sleep through before retrying (120s by
    /// default, OpenAI's SDK's own bound): a 429 with a longer `Retry-After` says
    /// `x-should-retry: false`, so SDKs that obey it (OpenAI's, Anthropic's) raise at once
    /// instead of sleeping for hours; unless a route says otherwise.
    pub should_retry_within: Option<ConfigDuration>,
    /// How a changed config file is applied (hot reload).
    #[serde(default)]
    pub reload: ReloadConfig,
    /// `text` or `json` lines on standard error (applied at start; a reload cannot change it).
    #[serde(default)]
    pub log_format: LogFormat,
    #[serde(default)]
    pub upstreams: BTreeMap<Name, UpstreamConfig>,
    /// Verifiers of JSON Web Tokens, by name: routes name one in their `jwt:`.
    #[serde(default)]
    pub jwt: Vec<JwtConfig>,
    /// Facts about LLM models that token and money budgets need and a body cannot say,
    /// matched in order against the body's `model`; a model none matches gets safe defaults.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    pub routes: Vec<RouteConfig>,
    /// Where threshold notifications (a limit's `notify`) are POSTed, signed with a shared
    /// secret (applied at start); absent: no limit may say `notify`.
    pub webhook: Option<super::WebhookConfig>,
    /// Envoy's rate limit service on a listener of its own (`crate::rls`); absent: off.
    #[schemars(with = "Option<super::rls::RlsConfig>")]
    pub rls: Option<Spanned<super::rls::RlsConfig>>,
}

/// How a change of the config file (or of a JWT key file it names) is applied.
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReloadConfig {
    /// A changed file is applied only once it has read the same (contents, size and
    /// modification time) for this long, over at least two polls: a file still being written
    /// is never applied half-way. Applies from the next change after the file that sets it.
    #[serde(default = "default_reload_settle")]
    pub settle: ConfigDuration,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        ReloadConfig {
            settle: default_reload_settle(),
        }
    }
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
    /// The most bytes of request bodies held whole at once across the process (a route with a
    /// token budget reads its body before deciding); past it, a request is refused with 503.
    #[serde(default = "default_token_body_budget")]
    #[serde(deserialize_with = "bytes_within::<65_536, 68_719_476_736, _>")]
    #[schemars(schema_with = "schema::bytes_within::<65_536, 68_719_476_736>")]
    pub token_body_budget: ByteSize,
    /// The most streams of one HTTP/2 connection reading a body whole at once; past it, the
    /// stream is refused with 503.
    #[serde(default = "default_token_bodies_per_connection")]
    #[serde(deserialize_with = "count_within::<1, 10_000, _>")]
    #[schemars(schema_with = "schema::count_within::<1, 10_000>")]
    pub token_bodies_per_connection: Positive,
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
            token_body_budget: default_token_body_budget(),
            token_bodies_per_connection: default_token_bodies_per_connection(),
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
    /// With Redis, most identities of `report: true` limits each instance notes between two
    /// flushes of the usage index (once a second); one more is not noted, and counted in
    /// `sluice_usage_index_dropped_total`.
    #[serde(default = "default_max_reported")]
    #[serde(deserialize_with = "count_within::<1, 10_000_000, _>")]
    #[schemars(schema_with = "schema::count_within::<1, 10_000_000>")]
    pub max_reported: Positive,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            max_keys: default_local_max_keys(),
            max_reported: default_max_reported(),
        }
    }
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

/// `tls:` of the gateway listener: a PEM certificate chain (leaf first) and its private key
/// (PKCS#8, PKCS#1 RSA or SEC1 EC). Relative paths are relative to the config file's
/// directory. The files are watched: a valid new pair (and CA) serves new handshakes.
#[derive(Debug, Clone, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    #[schemars(with = "PathBuf")]
    pub cert: Spanned<PathBuf>,
    #[schemars(with = "PathBuf")]
    pub key: Spanned<PathBuf>,
    /// Mutual TLS: a PEM bundle of the CAs client certificates must chain to. With it, every
    /// client must present a certificate from one of them, or its handshake fails
    /// (envoyproxy/ratelimit's `GRPC_SERVER_TLS_CA_CERT` / `GRPC_CLIENT_TLS_CACERT` on
    /// `rls.tls`). Watched with the certificate: a valid new bundle verifies new handshakes.
    #[schemars(with = "Option<PathBuf>")]
    pub client_ca: Option<Spanned<PathBuf>>,
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
    /// Overrides the top-level `should_retry_within` for this route.
    pub should_retry_within: Option<ConfigDuration>,
    #[serde(default)]
    pub limits: Vec<LimitConfig>,
    /// With a limit of `on_exceed: delay`: most requests of this route held at once.
    #[schemars(with = "Option<Positive>")]
    pub max_delayed: Option<Spanned<Positive>>,
    /// Verify the request's JWT with this verifier: `jwt:` key parts and conditions read
    /// its claims.
    #[schemars(with = "Option<RouteJwtConfig>")]
    pub jwt: Option<Spanned<RouteJwtConfig>>,
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
    /// The limit in requests; a token budget says `tokens:` instead (exactly one of the two).
    #[schemars(with = "Option<Positive>")]
    pub requests: Option<Spanned<Positive>>,
    /// The limit in LLM tokens instead of requests: each request reserves an upper bound of
    /// what it can consume (`reserve:`) and is settled to what it did (`settle:`).
    #[schemars(with = "Option<Positive>")]
    pub tokens: Option<Spanned<Positive>>,
    /// The limit in money instead of requests or tokens (an amount of `currency`, up to 6
    /// decimals): a token budget whose reservation and settlement are priced at the model's
    /// `prices` from `models:`.
    #[schemars(with = "Option<f64>")]
    pub money: Option<Spanned<f64>>,
    /// With `money:`: the currency its amount and the models' prices are in (`USD`).
    #[schemars(with = "Option<String>")]
    pub currency: Option<Spanned<String>>,
    /// A concurrency limit instead of a rate: how many requests of one key may be in flight
    /// at once, across every instance on the store. A request holds its place from admission
    /// until its answer's last byte (a stream's end, a WebSocket's close).
    #[schemars(with = "Option<Positive>")]
    pub concurrent: Option<Spanned<Positive>>,
    /// With `concurrent:`: how long an instance's leases outlive its last renewal, so the
    /// places of an instance that died are taken back within this (renewed every quarter of
    /// it); 10s by default.
    #[schemars(with = "Option<ConfigDuration>")]
    pub lease: Option<Spanned<ConfigDuration>>,
    /// The length of a rolling window; a limit has either this or a calendar `quota`.
    pub window: Option<ConfigDuration>,
    /// A calendar quota instead of a `window`: `requests` per `day`, `week` (ISO, from
    /// Monday 00:00) or `month`, reset when the period starts in `time_zone`.
    #[schemars(with = "Option<QuotaPeriod>")]
    pub quota: Option<Spanned<QuotaPeriod>>,
    /// With `quota`: the IANA time zone its periods follow (`Europe/Berlin`); `UTC` by
    /// default.
    #[schemars(with = "Option<String>")]
    pub time_zone: Option<Spanned<String>>,
    /// How the limit counts, and so what it can do (`burst`, `on_exceed: delay`, a token
    /// budget): see each choice, and which is the default, under `Algorithm`.
    #[schemars(with = "Option<AlgorithmConfig>")]
    pub algorithm: Option<Spanned<AlgorithmConfig>>,
    /// Only for an `algorithm` that takes a burst (its description says so): how many
    /// requests may arrive at once; `requests` by default, so a fresh key admits as many at
    /// once as under the other algorithms.
    #[schemars(with = "Option<Positive>")]
    pub burst: Option<Spanned<Positive>>,
    /// How many requests one request counts as; 1 by default.
    #[schemars(with = "Option<Positive>")]
    pub cost: Option<Spanned<Positive>>,
    /// Evaluate and count, but never reject (to try a limit on live traffic).
    #[serde(default)]
    pub shadow: bool,
    /// Let the admin API override this limit's number for one identity at run time (a
    /// customer's contract, a trial's budget); each decision reads the identity's override
    /// in the store. Off by default: an override costs one more read per decision.
    #[serde(default)]
    pub overrides: bool,
    /// Keep an index of who used this limit, for the admin API's usage reports (`GET
    /// /admin/v1/limits/{route}/{limit}/usage?top=N`, `sluice usage`). Off by default: with
    /// Redis each instance adds its identities' use to a sorted set once a second.
    #[serde(default)]
    pub report: bool,
    /// POST to `webhook:` when an identity's use crosses these fractions of the limit in
    /// force, once per identity, threshold and window or period, whichever instance admits
    /// the crossing request.
    #[schemars(with = "Option<super::NotifyConfig>")]
    pub notify: Option<Spanned<super::NotifyConfig>>,
    /// Conditions on the request, all of which must hold for this limit to apply.
    #[serde(default)]
    #[schemars(with = "Vec<ConditionConfig>")]
    pub when: Vec<Spanned<ConditionConfig>>,
    /// `reject` (429, the default), `delay` (hold the request up to `max_delay`), or
    /// `{ switch_model: MODEL }` (a token or money limit: send the request to a cheaper model).
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
    /// With `tokens:`: how a request's reservation is bounded from its body.
    #[schemars(with = "Option<ReserveConfig>")]
    pub reserve: Option<Spanned<ReserveConfig>>,
    /// With `tokens:`: where the real count is read from the response.
    #[schemars(with = "Option<SettleConfig>")]
    pub settle: Option<Spanned<SettleConfig>>,
}

/// Default largest output cap a request may name.
pub const DEFAULT_RESERVE_MAX_OUTPUT: u32 = 4096;
/// Default largest request body read to reserve for it.
pub const DEFAULT_RESERVE_MAX_BODY: u64 = 1024 * 1024;

/// A token limit's `reserve:`: the upper bound a request reserves before it is forwarded.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveConfig {
    /// Output cap written into the forwarded body and reserved when the request names none
    /// (`max_tokens`, `max_completion_tokens`, `max_output_tokens`); by default the model's
    /// `max_output` (from `models:`), within `max_output` below.
    pub default_output: Option<Positive>,
    /// A request naming a larger output cap is refused (413); 4096 by default.
    #[serde(default = "default_reserve_max_output")]
    pub max_output: Positive,
    /// Charged for each file, audio, video or document part when larger than the model's
    /// `per_non_text_part`; by default the model's.
    pub per_non_text_part: Option<u32>,
    /// Added once per request to the model's `per_request`, for what this route's upstream
    /// adds that is not in the body; 0 by default.
    #[serde(default)]
    pub per_request: u32,
    /// Largest request body read to reserve for it (the body is read whole before the
    /// decision); 1MiB by default. A larger body gets 413.
    #[serde(default = "default_reserve_max_body")]
    pub max_body: ByteSize,
    /// What a reference to state the provider holds (`previous_response_id`, `conversation`,
    /// a stored `prompt`, `item_reference` items) is charged: `context` (the model's context
    /// window) or a number of tokens. Absent: such a request is refused (422).
    #[schemars(with = "Option<StoredStateConfig>")]
    pub stored_state: Option<Spanned<StoredStateConfig>>,
    /// Tokens charged for each tool the provider runs itself (Responses `web_search`,
    /// `file_search`, `mcp` …; Anthropic `web_search_*`, `code_execution_*` …). Absent: such
    /// a request is refused (422).
    pub server_tool: Option<u32>,
}

/// `reserve.stored_state`: the model's context window, or a figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum StoredStateConfig {
    Tokens(u32),
    Word(ContextWord),
}

/// The word `context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextWord {
    Context,
}

/// One entry of `models:`: facts about the models whose name `match` matches (`*` matches
/// any run of characters). Each fact left out takes the default for an unknown model (the
/// book's "Models", in `docs/src/guides/token-bound.md`).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A model name, or a pattern with `*`.
    #[serde(rename = "match")]
    #[schemars(with = "String")]
    pub pattern: Spanned<String>,
    /// Tokens one image part costs, by detail (`low`; `high` for any other).
    pub per_image: Option<PerImageConfig>,
    /// Tokens one file, audio, video or document part costs at most.
    pub per_non_text_part: Option<u32>,
    /// Tokens the provider adds to every request.
    pub per_request: Option<u32>,
    /// Tokens the provider adds when the request gives `tools` (its tool-use system prompt).
    pub tool_prompt: Option<u32>,
    /// The context window, in tokens.
    pub context: Option<Positive>,
    /// The most the model outputs when the request names no cap.
    pub max_output: Option<Positive>,
    /// Prices per million tokens, for money limits.
    #[schemars(with = "Option<PricesConfig>")]
    pub prices: Option<Spanned<PricesConfig>>,
}

/// `models[].per_image`.
#[derive(Debug, Clone, Copy, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PerImageConfig {
    pub low: u32,
    pub high: u32,
}

/// `models[].prices`: per million tokens, in `currency`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PricesConfig {
    pub currency: String,
    pub input: f64,
    /// Input read from the provider's cache; the input price by default.
    pub cached_input: Option<f64>,
    /// Input written to the provider's cache (Anthropic's `cache_creation_input_tokens`);
    /// twice the input price by default (Anthropic's 1-hour cache write).
    pub cache_write: Option<f64>,
    pub output: f64,
}

/// A token limit's `settle:`: where the real count comes from.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SettleConfig {
    /// `usage` (the JSON body's `usage`, or the usage events of a streamed answer; the
    /// default) or `header` (a response header naming the tokens used).
    #[serde(default)]
    pub from: SettleFrom,
    /// With `from: header`: the header's name.
    pub header: Option<FieldName>,
}

/// Where a token limit's real count is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SettleFrom {
    #[default]
    Usage,
    Header,
}

fn default_reserve_max_output() -> Positive {
    Positive(DEFAULT_RESERVE_MAX_OUTPUT)
}
fn default_reserve_max_body() -> ByteSize {
    ByteSize(DEFAULT_RESERVE_MAX_BODY)
}

impl LimitConfig {
    /// The model `on_exceed: { switch_model: ... }` names, where it is written, if the limit
    /// says so.
    pub fn switch_model(&self) -> Option<(&Spanned<OnExceed>, &str)> {
        let on_exceed = self.on_exceed.as_ref()?;
        match &on_exceed.value {
            OnExceed::SwitchModel(model) => Some((on_exceed, model.as_str())),
            _ => None,
        }
    }

    /// `on_exceed: delay`, where it is written, if the limit says so.
    pub fn delay(&self) -> Option<&Spanned<OnExceed>> {
        self.on_exceed
            .as_ref()
            .filter(|o| o.value == OnExceed::Delay)
    }

    /// The algorithm this limit counts with, as the limiter names it.
    pub fn algorithm(&self) -> crate::limiter::Algorithm {
        if self.concurrent.is_some() {
            return crate::limiter::Algorithm::Concurrency;
        }
        let budget = self.tokens.is_some() || self.money.is_some();
        match (&self.quota, &self.algorithm, budget) {
            (Some(_), _, _) => crate::limiter::Algorithm::Calendar,
            (None, Some(algorithm), _) => algorithm.value.into(),
            (None, None, true) => crate::limiter::Algorithm::FOR_BUDGETS,
            (None, None, false) => crate::limiter::Algorithm::default(),
        }
    }
}

/// A calendar quota's period, as the policy file spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuotaPeriod {
    Day,
    /// An ISO 8601 week, from Monday 00:00.
    Week,
    Month,
}

impl From<QuotaPeriod> for crate::limiter::calendar::Period {
    fn from(spelled: QuotaPeriod) -> Self {
        match spelled {
            QuotaPeriod::Day => Self::Day,
            QuotaPeriod::Week => Self::Week,
            QuotaPeriod::Month => Self::Month,
        }
    }
}

/// A limit's `count:`: which outcomes it counts.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountConfig {
    pub status: Vec<StatusMatch>,
}

/// One condition of a limit's `when:`: exactly one of `header` or `jwt` (with one of
/// `equals`, `one_of`, `present`), `method`, `host` or `model`. Checked, with its position,
/// in `policy`.
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
    /// A claim of the route's verified JWT (with `equals`, `one_of` or `present`); never
    /// holds without a valid token.
    pub jwt: Option<String>,
    /// The `model` the JSON request body names is one of these (an exact name, or a prefix
    /// ending in `*`), compared after both are normalised (`crate::model`); only on a token
    /// limit.
    pub model: Option<Vec<String>>,
}

/// One verifier of JSON Web Tokens: whose tokens (`issuer`), for whom (`audiences`), and
/// the keys their signatures are checked with, each pinned to one algorithm.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    #[schemars(with = "Name")]
    pub name: Spanned<Name>,
    /// The `iss` a token must carry, exactly.
    pub issuer: String,
    /// A token's `aud` must name one of these.
    #[schemars(with = "Vec<String>")]
    pub audiences: Spanned<Vec<String>>,
    /// A JWK set (RSA, EC P-256, OKP Ed25519, oct): re-read on every reload, and watched.
    #[schemars(with = "Option<PathBuf>")]
    pub jwks_file: Option<Spanned<PathBuf>>,
    /// An `https://` URL publishing the JWK set (an identity provider's `jwks_uri`): fetched
    /// in the background from start, refreshed on the server's cache headers within
    /// `min_refresh`..`max_refresh`, refetched (at most once per `min_refresh`) when a token
    /// names an unknown kid. Exclusive with `jwks_file` and `keys`.
    #[schemars(with = "Option<String>")]
    pub jwks_url: Option<Spanned<String>>,
    /// CA certificates (PEM) the `jwks_url` server's certificate must chain to; the Mozilla
    /// roots built into sluice by default, as for upstreams.
    #[schemars(with = "Option<PathBuf>")]
    pub jwks_ca_file: Option<Spanned<PathBuf>>,
    /// Shortest time between two fetches of `jwks_url` (whatever the cache headers say, and
    /// for the refetch an unknown kid triggers); 30s by default.
    pub min_refresh: Option<ConfigDuration>,
    /// Longest time between two fetches of `jwks_url`, and the interval when the server
    /// sends no `Cache-Control: max-age` or `Expires`; 10m by default.
    pub max_refresh: Option<ConfigDuration>,
    /// How long one fetch of `jwks_url` may take, connecting to the last byte; 5s by default.
    pub fetch_timeout: Option<ConfigDuration>,
    /// PEM public keys or HS256 secrets, each with its algorithm.
    #[serde(default)]
    #[schemars(with = "Vec<JwtKeyConfig>")]
    pub keys: Vec<Spanned<JwtKeyConfig>>,
    /// Verified tokens remembered (by the SHA-256 of the token, until its `exp`, least
    /// recently used out first) so that a token seen again skips the signature check;
    /// 10000 by default, 0 turns the cache off.
    pub token_cache: Option<u32>,
    /// Where the token is; `header:authorization` (`Bearer TOKEN`) by default.
    #[serde(default)]
    pub from: super::TokenFrom,
    /// Leeway for `exp`, `nbf` and `iat` against sluice's clock; 30s by default.
    pub clock_skew: Option<ConfigDuration>,
}

/// A key of a verifier from its own file: a PEM public key or an HS256 secret.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtKeyConfig {
    /// A PEM `PUBLIC KEY` (RS256, ES256, EdDSA).
    #[schemars(with = "Option<PathBuf>")]
    pub pem_file: Option<Spanned<PathBuf>>,
    /// An HS256 secret of at least 32 bytes (a final line break is not part of it).
    #[schemars(with = "Option<PathBuf>")]
    pub secret_file: Option<Spanned<PathBuf>>,
    /// The one algorithm this key verifies, whatever a token's header says.
    pub algorithm: JwtAlgorithm,
    /// The `kid` a token's header names this key by; needed when a verifier has several.
    pub kid: Option<String>,
}

/// The algorithms a JWT key can be pinned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
pub enum JwtAlgorithm {
    RS256,
    ES256,
    EdDSA,
    HS256,
}

impl JwtAlgorithm {
    /// As a token's header spells it.
    pub fn name(self) -> &'static str {
        match self {
            JwtAlgorithm::RS256 => "RS256",
            JwtAlgorithm::ES256 => "ES256",
            JwtAlgorithm::EdDSA => "EdDSA",
            JwtAlgorithm::HS256 => "HS256",
        }
    }
}

/// A route's `jwt:`: which verifier, and what a missing or invalid token gets.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteJwtConfig {
    #[schemars(with = "Name")]
    pub verifier: Spanned<Name>,
    #[serde(default)]
    pub on_invalid: OnInvalid,
}

/// What a request without a valid token gets on a route with `jwt:`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnInvalid {
    /// 401 problem+json with `WWW-Authenticate: Bearer error="invalid_token"`.
    #[default]
    Reject,
    /// The limits of an anonymous client: `jwt:` key parts count the client address,
    /// `jwt:` conditions do not hold.
    Anonymous,
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
fn default_reload_settle() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_RELOAD_SETTLE_MS))
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
fn default_token_body_budget() -> ByteSize {
    ByteSize(DEFAULT_TOKEN_BODY_BUDGET)
}
fn default_token_bodies_per_connection() -> Positive {
    Positive(DEFAULT_TOKEN_BODIES_PER_CONNECTION)
}
fn default_shutdown_grace() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_SHUTDOWN_GRACE_MS))
}
fn default_local_max_keys() -> Positive {
    Positive(DEFAULT_LOCAL_MAX_KEYS)
}

fn default_max_reported() -> Positive {
    Positive(100_000)
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
