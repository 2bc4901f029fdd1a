//! Envoy's rate limit service: sluice answers `ShouldRateLimit` for Envoy, Istio and Envoy
//! Gateway from envoyproxy/ratelimit's own configuration files, with sluice's limiter.
//!
//! `file` reads those files as they are, `rules` compiles them into a tree per domain and
//! finds a descriptor's rule, `key` builds a descriptor's store key and window, `decide`
//! turns one call into checks decided in one store call and maps the decision to Envoy's
//! answer, `service` is the gRPC listener with its health service (`tls` its TLS accept
//! loop), `metrics` the counters (sluice's and
//! envoyproxy/ratelimit's names). The rules are compiled with the rest of the config file
//! (`version::version`), so `check`, `run` and a reload accept and refuse the same files;
//! `explain` shows what one call would do (`sluice explain-rls`).

mod decide;
pub mod explain;
mod file;
mod key;
mod metrics;
mod rules;
mod service;
mod tls;

use std::path::{Path, PathBuf};

use crate::config::{Config, ConfigError};

pub use decide::{answer, plan_call, Applies, PlannedCall, Settings};
pub use metrics::RlsMetrics;
pub use rules::{RlsRule, RuleLimit, Rules};
pub use service::{serve, Service};

/// One version of the service's rules and settings, compiled from the config file.
#[derive(Debug)]
pub struct Compiled {
    pub rules: Rules,
    pub settings: Settings,
}

impl Compiled {
    /// The service `config` (the contents of `file`) describes, its rule files read now;
    /// `None` without an `rls:` section.
    pub fn load(config: &Config, file: &Path) -> Result<Option<Compiled>, ConfigError> {
        let Some(rls) = &config.rls else {
            return Ok(None);
        };
        let rls = &rls.value;
        let rules = Rules::load(&rls.config, rls.algorithm, file)?;
        let settings = Settings {
            shadow_mode: rls.shadow_mode,
            algorithm: rls.algorithm,
            on_store_error: rls.on_store_error.unwrap_or(config.store.on_store_error),
            key_prefix: config.store.key_prefix.as_str().to_owned(),
        };
        Ok(Some(Compiled { rules, settings }))
    }
}

/// The rule files the `rls:` section of `config` names as they are now (for the reload's
/// watch); empty without one, or when they cannot be listed (the reload then reports why).
pub fn files(config: &Config, file: &Path) -> Vec<PathBuf> {
    config
        .rls
        .as_ref()
        .and_then(|rls| file::paths(&rls.value.config, file, "rls.config").ok())
        .unwrap_or_default()
}
