//! envoyproxy/ratelimit's configuration files as they are written: one `domain` and its nested
//! `descriptors` per file, read with the same parser, limits and file:line:column errors as
//! sluice's own file. The shapes here are the serde model only; `rules` compiles them.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer};

use crate::config::{self, ConfigError, Position, Spanned};

/// One envoyproxy/ratelimit file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainFile {
    pub domain: Spanned<String>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorRule>,
}

/// One level of a descriptor tree: an entry `key` (and `value`, exact or ending in `*`) and
/// what applies when a request's descriptor ends here or goes deeper.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorRule {
    pub key: Spanned<String>,
    pub value: Option<Spanned<String>>,
    pub rate_limit: Option<Spanned<RateLimitRule>>,
    #[serde(default)]
    pub descriptors: Vec<DescriptorRule>,
    /// Over-limit answers of this rule are reported but the descriptor's code stays OK.
    #[serde(default)]
    pub shadow_mode: bool,
    /// Every value this wildcard `value` matches counts in one count (the pattern's), not one
    /// each.
    #[serde(default)]
    pub share_threshold: bool,
    /// envoyproxy/ratelimit labels its stats with the request's values instead of the rule's:
    /// accepted so existing files load; sluice labels by rule either way (bounded series).
    #[serde(default, rename = "detailed_metric")]
    pub _detailed_metric: bool,
}

/// `rate_limit:` of a descriptor rule.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitRule {
    pub unit: Option<Spanned<UnitName>>,
    pub requests_per_unit: Option<Spanned<u32>>,
    #[serde(default)]
    pub unlimited: bool,
    pub name: Option<Spanned<String>>,
    #[serde(default)]
    pub replaces: Vec<Replaces>,
    /// sluice's extension: how this rule counts, instead of `rls.algorithm`.
    pub algorithm: Option<config::RlsAlgorithm>,
}

/// `replaces: [{name: ...}]`: the named rules do not apply to a request this rule applies to.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    pub name: String,
}

/// The unit of a rate limit, as Envoy's proto names it (`second` .. `year`, any case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnitName {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl<'de> Deserialize<'de> for UnitName {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<UnitName, D::Error> {
        let text = String::deserialize(de)?;
        UnitName::parse(&text).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown unit `{text}`: expected second, minute, hour, day, week, month or year"
            ))
        })
    }
}

impl UnitName {
    pub fn parse(text: &str) -> Option<UnitName> {
        Some(match text.to_ascii_lowercase().as_str() {
            "second" => UnitName::Second,
            "minute" => UnitName::Minute,
            "hour" => UnitName::Hour,
            "day" => UnitName::Day,
            "week" => UnitName::Week,
            "month" => UnitName::Month,
            "year" => UnitName::Year,
            _ => return None,
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            UnitName::Second => "second",
            UnitName::Minute => "minute",
            UnitName::Hour => "hour",
            UnitName::Day => "day",
            UnitName::Week => "week",
            UnitName::Month => "month",
            UnitName::Year => "year",
        }
    }

    /// The unit's fixed length, as envoyproxy/ratelimit counts it (a month is 30 days, a
    /// year 365): the window of the rolling algorithms and of epoch-aligned windows.
    pub fn seconds(self) -> u64 {
        const DAY: u64 = 86_400;
        match self {
            UnitName::Second => 1,
            UnitName::Minute => 60,
            UnitName::Hour => 3_600,
            UnitName::Day => DAY,
            UnitName::Week => 7 * DAY,
            UnitName::Month => 30 * DAY,
            UnitName::Year => 365 * DAY,
        }
    }
}

/// The files `rls.config` names, relative to `file` (the sluice config): each path as given,
/// or a directory's `*.yaml` and `*.yml` files in name order. `Err` for a path that cannot be
/// read, named at its place in `file`.
pub fn paths(
    entries: &[Spanned<PathBuf>],
    file: &Path,
    field: &str,
) -> Result<Vec<PathBuf>, ConfigError> {
    let base = file.parent().unwrap_or(Path::new("."));
    let mut out = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let path = base.join(&entry.value);
        let refuse = |message: String| {
            ConfigError::invalid(
                file,
                Position::from(entry),
                format!("{field}[{index}]"),
                message,
            )
        };
        let metadata = std::fs::metadata(&path)
            .map_err(|err| refuse(format!("cannot read {}: {err}", path.display())))?;
        if !metadata.is_dir() {
            out.push(path);
            continue;
        }
        let listing = std::fs::read_dir(&path)
            .map_err(|err| refuse(format!("cannot list {}: {err}", path.display())))?;
        let mut found: Vec<PathBuf> = listing
            .filter_map(|item| item.ok().map(|item| item.path()))
            .filter(|p| {
                p.is_file()
                    && p.extension()
                        .is_some_and(|ext| ext == "yaml" || ext == "yml")
            })
            .collect();
        found.sort();
        out.extend(found);
    }
    Ok(out)
}

/// Reads and parses one envoyproxy/ratelimit file.
pub fn read(path: &Path) -> Result<DomainFile, ConfigError> {
    let bytes = std::fs::read(path).map_err(|err| config::read_error(path, err))?;
    let text = std::str::from_utf8(&bytes).map_err(|err| {
        config::read_error(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, err),
        )
    })?;
    config::parse_as(text, path)
}
