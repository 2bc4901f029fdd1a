//! `rls:`, the section that turns on Envoy's rate limit service (see `crate::rls`): where it
//! listens, which envoyproxy/ratelimit configuration files it serves, and the choices those
//! files cannot express (the algorithm of a unit, the global shadow switch, what a failing
//! store means for an answer).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::{OnStoreError, RlsAlgorithm, Spanned};

/// Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`), served over
/// gRPC on a listener of its own, from envoyproxy/ratelimit's YAML files as they are.
#[derive(Debug, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RlsConfig {
    /// The gRPC listener: HTTP/2 without TLS (h2c), or with `tls`.
    pub listen: SocketAddr,
    /// TLS on `listen`, with the same fields, checks and rotation as the gateway's `tls:`
    /// (`client_ca`: mutual TLS, as Envoy Gateway's Deployment asks). Which files is read at
    /// start; their contents are watched.
    #[schemars(with = "Option<super::ListenerTlsConfig>")]
    pub tls: Option<Spanned<super::ListenerTlsConfig>>,
    /// envoyproxy/ratelimit configuration files, or directories whose `*.yaml` / `*.yml` files
    /// are read (not recursively), relative to this file. One `domain` per file; a domain may
    /// appear in one file only. Reloaded with this file.
    #[schemars(with = "Vec<PathBuf>")]
    pub config: Vec<Spanned<PathBuf>>,
    /// Every rule in shadow mode (envoyproxy/ratelimit's `SHADOW_MODE`): decisions are counted
    /// and reported per descriptor, but the overall answer is always OK.
    #[serde(default)]
    pub shadow_mode: bool,
    /// How rules count unless a rule's `rate_limit.algorithm` says otherwise.
    #[serde(default)]
    pub algorithm: RlsAlgorithm,
    /// What an answer is when the store cannot decide; `store.on_store_error` when absent.
    /// `allow` answers OK, `deny` OVER_LIMIT, `local` decides in this instance's memory.
    pub on_store_error: Option<OnStoreError>,
}
