//! `sluice check`: the file checked as `run` would, summed up in one line.

use std::path::Path;

use crate::config::ConfigError;
use crate::version::{load, ListenerFiles};

/// `sluice check`: the file checked as `run` would, summed up in one line.
pub fn check(file: &Path) -> Result<String, ConfigError> {
    let loaded = load(file, ListenerFiles::Read)?;
    let config = &loaded.source.config;
    let rls = loaded.rls.as_ref().map_or(String::new(), |rls| {
        let (domains, rules) = rls.rules.count();
        format!(", rls: {domains} domains, {rules} rules")
    });
    Ok(format!(
        "{}: ok ({} routes, {} upstreams, store: {}{}{rls})",
        file.display(),
        loaded.policy.routes.len(),
        config.upstreams.len(),
        if config.store.redis.is_some() {
            "redis"
        } else {
            "in-process"
        },
        if loaded.listener_tls.is_some() {
            ", tls"
        } else {
            ""
        }
    ))
}
