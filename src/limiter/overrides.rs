//! Per-identity overrides of a limit's number, set at run time through the admin API: one
//! customer's contract, a trial key's budget, a raise until Friday. A limit takes them only
//! with `overrides: true` (`Spec::overridable`).
//!
//! An override is one number beside the identity's counted key, in the same Redis Cluster
//! slot: the key up to its hash tag's close, then `:o` ([`key_of`]; `prelude.lua`'s
//! `overridden` reads the same key in the decision's own script call, so every instance uses
//! the new number from the moment it is written, and one decision never mixes two). Like
//! every key sluice writes it expires on its own: after the `ttl` it was given, at most
//! [`MAX_TTL`], [`DEFAULT_TTL`] without one (a contract is set again before then, e.g. by a
//! periodic bulk load from the system that owns contracts). A change also tells every instance to forget its
//! remembered denials of the identity (`redis::events`). The in-process store keeps overrides
//! in its own memory, bounded like its keys, and loses them on restart.
//!
//! A window in use keeps what it counted: a raised number admits at once up to the new
//! number, a lowered one admits nothing until the count is below it.

use std::time::Duration;

use super::StoreError;

/// Why an override could not be set.
#[derive(Debug, thiserror::Error)]
pub enum OverrideError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The in-process store's bound on overrides (`store.local.max_keys`) is reached.
    #[error("the in-process store holds {0} overrides, its bound (store.local.max_keys)")]
    Full(usize),
}

/// How long an override set without a `ttl` lasts.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30 * 86_400);

/// The longest `ttl` an override may be given.
pub const MAX_TTL: Duration = Duration::from_secs(366 * 86_400);

/// The override key of the counted key `key`: up to its hash tag's close, then `:o`. `None`
/// for a key without a tag (never built by sluice).
pub fn key_of(key: &str) -> Option<String> {
    let close = key.find('}')?;
    let mut overrides = String::with_capacity(close + 3);
    overrides.push_str(&key[..=close]);
    overrides.push_str(":o");
    Some(overrides)
}

/// The index of a limit's overrides, for listing them: a sorted set beside the limit's keys,
/// `{limit's prefix}overrides`, member the override key, score when it expires (ms since the
/// epoch). Kept for [`MAX_TTL`] after its last write, longer than any entry it holds.
pub fn index_of(key: &str) -> String {
    let limit = key.find('{').map_or(key, |brace| &key[..brace]);
    format!("{limit}overrides")
}

/// The list of the limits that hold overrides, so that those of a limit no longer in the
/// policy are found (the admin API's `GET /admin/v1/overrides`) without reading the keyspace:
/// a sorted set `{key_prefix}:overridden`, member a limit's index ([`index_of`]), score when
/// its last override written expires (ms since the epoch). Kept for [`MAX_TTL`] after its last
/// write. (No counted key has two segments, so it meets none.)
pub fn registry_of(key_prefix: &str) -> String {
    format!("{key_prefix}:overridden")
}

/// One limit that holds overrides: its index ([`index_of`]) and how many are in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub index: String,
    pub overrides: u64,
}

/// The identity an override key is of: the text between its braces.
pub fn identity_of(overrides: &str) -> &str {
    let open = overrides.find('{').map_or(0, |brace| brace + 1);
    let close = overrides.find('}').unwrap_or(overrides.len());
    overrides.get(open..close).unwrap_or_default()
}

/// One override of a limit's list: the override key, its number, the time left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub requests: u32,
    pub expires_in: Duration,
}

/// What the keys of one identity of a limit start with (every period of a calendar quota,
/// its override): what a change tells the deny caches to forget.
pub fn identity_prefix(key: &str) -> &str {
    key.find('}').map_or(key, |close| &key[..=close])
}

/// An override in force: the number, and the time left until it expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub requests: u32,
    pub expires_in: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_override_sits_beside_the_identity_in_its_slot() {
        let key = "sluice:api:daily:calendar:{h:x-api-key=k}:2026-11";
        let overrides = key_of(key).expect("tagged");
        assert_eq!(overrides, "sluice:api:daily:calendar:{h:x-api-key=k}:o");
        assert_eq!(
            super::super::slot_of(key),
            super::super::slot_of(&overrides)
        );
        assert_eq!(
            identity_prefix(key),
            "sluice:api:daily:calendar:{h:x-api-key=k}"
        );
        assert_eq!(key_of("untagged"), None);
        assert_eq!(index_of(key), "sluice:api:daily:calendar:overrides");
        assert_eq!(identity_of(&overrides), "h:x-api-key=k");
    }
}
