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
//!
//! By job: `tree` holds the sections of the file and their defaults, `types`, `duration` and
//! `admin` the values parsed from text, `topology` turns `store.redis` into a `Topology`, `webhook` is where threshold
//! notifications go,
//! `error` is `ConfigError` and its positions, `restart` says which fields only a restart
//! applies, `load` reads a file (the parser's options and
//! field paths as written), and `schema` describes it all as JSON Schema. Everything is
//! re-exported here: the rest of sluice names `config::X`, never the file it lives in.

mod admin;
mod duration;
mod error;
mod load;
mod recover;
mod restart;
mod rls;
mod schema;
mod suggest;
mod topology;
mod tree;
mod types;
mod webhook;

pub use serde_saphyr::Spanned;

pub use admin::{split_host_port, AdminConfig, AdminHost, EnvName};
pub use duration::ConfigDuration;
pub use error::{ConfigError, Position};
pub use load::{from_bytes, load, parse, parse_as, read_bytes, read_error, to_json, Source};
pub use rls::RlsConfig;
pub use schema::json_schema;
pub use suggest::{closest, did_you_mean};
pub use tree::{
    ClusterConfig, ConditionConfig, Config, CountConfig, JwtAlgorithm, JwtConfig, JwtKeyConfig,
    LimitConfig, ListenerTlsConfig, LocalConfig, MatchConfig, OnInvalid, QuotaPeriod, RedisConfig,
    ReloadConfig, RespondConfig, RouteConfig, RouteJwtConfig, SentinelConfig, ServerConfig,
    StoreConfig, UpstreamConfig, Workers,
};
pub use tree::{
    ContextWord, ModelConfig, PerImageConfig, PricesConfig, ReserveConfig, SettleConfig,
    SettleFrom, StoredStateConfig, DEFAULT_RESERVE_MAX_BODY, DEFAULT_RESERVE_MAX_OUTPUT,
};
pub use tree::{
    DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_RATE_GRACE_MS, DEFAULT_BODY_TIMEOUT_MS,
    DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_IPV4_PREFIX, DEFAULT_IPV6_PREFIX, DEFAULT_KEY_PREFIX, DEFAULT_LEASE,
    DEFAULT_LOCAL_MAX_KEYS, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_DELAYED, DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_REQUEST_LINE, DEFAULT_POOL_SIZE,
    DEFAULT_RELOAD_SETTLE_MS, DEFAULT_SHOULD_RETRY_WITHIN, DEFAULT_SHUTDOWN_GRACE_MS,
    DEFAULT_STORE_TIMEOUT_MS, DEFAULT_TOKEN_BODIES_PER_CONNECTION, DEFAULT_TOKEN_BODY_BUDGET,
    DEFAULT_UPSTREAM_TIMEOUT_MS, MAX_LEASE_MS, MAX_MAX_DELAY_MS, MIN_LEASE_MS,
};
pub use types::TokenFrom;
pub use types::{
    AlgorithmConfig, ByteSize, FieldName, ForwardedHeader, HostPort, IpNet, KeyPart, LogFormat,
    MethodName, Name, OnStoreError, PathPrefix, Positive, RedisUrl, ResponseHeaders, RlsAlgorithm,
    Status, UpstreamUrl,
};
pub use types::{OnExceed, StatusMatch, HOP_BY_HOP};
pub use webhook::{
    NotifyConfig, WebhookConfig, WebhookUrl, DEFAULT_WEBHOOK_BACKOFF_MS, DEFAULT_WEBHOOK_QUEUE,
    DEFAULT_WEBHOOK_RETRIES, DEFAULT_WEBHOOK_TIMEOUT_MS,
};
