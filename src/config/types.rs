//! Typed values of the policy file. Each is checked once, when the YAML is read, so the rest of
//! sluice never handles a raw string where one of these belongs.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::OnceLock;

use http::header::HeaderName;
use http::uri::{Authority, Scheme};
use http::{Method, StatusCode, Uri};
use serde::de::value::StrDeserializer;
use serde::de::{Deserialize, Deserializer, Error as _, IntoDeserializer};

use crate::limiter::{Algorithm, ALGORITHMS};

/// Implements `Deserialize` for a type through its `FromStr`, so the parse error becomes the
/// message reported at the value's position.
macro_rules! deserialize_via_from_str {
    ($($ty:ty),* $(,)?) => {$(
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                text.parse().map_err(D::Error::custom)
            }
        }
    )*};
}

deserialize_via_from_str!(
    Name,
    KeyPart,
    MethodName,
    PathPrefix,
    UpstreamUrl,
    RedisUrl,
    HostPort,
    IpNet,
    FieldName,
    TokenFrom
);

/// Where a JWT verifier finds the token: `header:authorization` (`Bearer TOKEN`, the
/// default), another header, or a cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFrom {
    Header(HeaderName),
    Cookie(String),
}

impl Default for TokenFrom {
    fn default() -> Self {
        TokenFrom::Header(http::header::AUTHORIZATION)
    }
}

impl fmt::Display for TokenFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenFrom::Header(name) => write!(f, "header:{name}"),
            TokenFrom::Cookie(name) => write!(f, "cookie:{name}"),
        }
    }
}

impl FromStr for TokenFrom {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if let Some(name) = text.strip_prefix("header:") {
            return end_to_end_header(name).map(TokenFrom::Header);
        }
        if let Some(name) = text.strip_prefix("cookie:") {
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !matches!(b, b'=' | b';' | b','));
            if valid {
                return Ok(TokenFrom::Cookie(name.to_owned()));
            }
        }
        Err(format!(
            "expected where the token is: `header:NAME` or `cookie:NAME`, got `{text}`"
        ))
    }
}

/// A header field name, as a condition names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldName(pub HeaderName);

impl FromStr for FieldName {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        end_to_end_header(text).map(FieldName)
    }
}

/// The hop-by-hop fields (RFC 9110 §7.6.1) a proxy removes before forwarding; sluice's proxy
/// removes these (and whatever `Connection` names) in both directions.
pub const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A header a key part or condition may read: a valid name of a field the upstream receives
/// too. A limit keyed on a hop-by-hop field would count a value the upstream never sees.
fn end_to_end_header(text: &str) -> Result<HeaderName, String> {
    let name = HeaderName::from_bytes(text.as_bytes())
        .map_err(|_| format!("`{text}` is not a valid header name"))?;
    if HOP_BY_HOP.contains(&name.as_str()) {
        return Err(format!(
            "`{text}` is a hop-by-hop field: sluice removes it before forwarding, so a limit \
             reading it would count what the upstream never gets"
        ));
    }
    Ok(name)
}

/// The name of a route, limit, upstream or key prefix. Names appear in Redis keys, metric
/// labels and the `RateLimit-Policy` field, so they are kept to characters that are safe in
/// all three without quoting.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(String);

impl Name {
    pub const MAX_LEN: usize = 64;

    pub(crate) fn new_unchecked(name: &str) -> Name {
        Name(name.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Name {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if text.is_empty() || text.len() > Name::MAX_LEN || !text.chars().all(valid_char) {
            return Err(format!(
                "a name is 1 to {} characters of A-Z, a-z, 0-9, `-`, `_`, `.`; got `{text}`",
                Name::MAX_LEN
            ));
        }
        Ok(Name(text.to_owned()))
    }
}

/// One part of a limit's key: where in the request the identity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// The client's address: the TCP peer, or the address a trusted proxy forwarded for.
    ClientIp,
    /// The value of a request header; absent → the limit falls back to the client IP.
    Header(HeaderName),
    /// A query parameter, percent-decoded; absent → the client IP.
    Query(String),
    /// A cookie; absent → the client IP.
    Cookie(String),
    /// The request method.
    Method,
    /// The `Host` (or `:authority`), lower-cased.
    Host,
    /// The canonical path without its `;` parameters (lower-cased on case-insensitive routes).
    Path,
    /// The value of a `{NAME}` segment of the route's path prefix.
    Param(String),
    /// A claim of the request's verified JWT (the route's `jwt:` verifier); absent, or the
    /// token missing or invalid on an `on_invalid: anonymous` route → the client IP.
    Jwt(String),
    /// The `model` the JSON request body names, normalised (`crate::model`): only on a
    /// token limit, whose body is read before the decision anyway; absent → the client IP.
    Model,
}

/// As written in the policy file (`FromStr` reads it back).
impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::ClientIp => f.write_str("client_ip"),
            KeyPart::Header(name) => write!(f, "header:{name}"),
            KeyPart::Query(name) => write!(f, "query:{name}"),
            KeyPart::Cookie(name) => write!(f, "cookie:{name}"),
            KeyPart::Method => f.write_str("method"),
            KeyPart::Host => f.write_str("host"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::Param(name) => write!(f, "param:{name}"),
            KeyPart::Jwt(claim) => write!(f, "jwt:{claim}"),
            KeyPart::Model => f.write_str("model"),
        }
    }
}

impl FromStr for KeyPart {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let named = |kind: &str, name: &str| -> Result<String, String> {
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !matches!(b, b'=' | b';' | b'&' | b','));
            if valid {
                Ok(name.to_owned())
            } else {
                Err(format!("`{name}` is not a valid {kind} name"))
            }
        };
        match text {
            "client_ip" => return Ok(KeyPart::ClientIp),
            "method" => return Ok(KeyPart::Method),
            "host" => return Ok(KeyPart::Host),
            "path" => return Ok(KeyPart::Path),
            "model" => return Ok(KeyPart::Model),
            _ => {}
        }
        if let Some(name) = text.strip_prefix("header:") {
            return end_to_end_header(name).map(KeyPart::Header);
        }
        if let Some(name) = text.strip_prefix("query:") {
            return named("query parameter", name).map(KeyPart::Query);
        }
        if let Some(name) = text.strip_prefix("cookie:") {
            return named("cookie", name).map(KeyPart::Cookie);
        }
        if let Some(name) = text.strip_prefix("param:") {
            return named("path parameter", name).map(KeyPart::Param);
        }
        if let Some(name) = text.strip_prefix("jwt:") {
            return named("claim", name).map(KeyPart::Jwt);
        }
        // "Did you mean": a plain part, or a prefixed one with its name kept.
        let hint = match text.split_once(':') {
            Some((prefix, name)) => {
                super::closest(prefix, ["header", "query", "cookie", "param", "jwt"])
                    .map(|prefix| format!("; did you mean `{prefix}:{name}`?"))
                    .unwrap_or_default()
            }
            None => super::did_you_mean(text, ["client_ip", "method", "host", "path", "model"]),
        };
        Err(format!(
            "expected a key part `client_ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, `param:NAME`, `jwt:CLAIM`, `method`, `host`, `path` or `model`, got `{text}`{hint}"
        ))
    }
}

/// An IP network (`10.0.0.0/8`, `2001:db8::/32`, or one address): a range of trusted proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Whether `ip` is inside this network (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for IpNet {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed =
            || format!("expected an address or a CIDR range like 10.0.0.0/8, got `{text}`");
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| malformed())?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) => prefix.parse::<u8>().map_err(|_| malformed())?,
            None => bits,
        };
        if prefix > bits {
            return Err(format!(
                "`{text}`: a prefix of /{prefix} is longer than the address"
            ));
        }
        Ok(IpNet { addr, prefix })
    }
}

/// Which header trusted proxies put the client's address in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`.
    Forwarded,
}

/// How log lines are written to standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// For people: one line of text per event.
    #[default]
    Text,
    /// For log pipelines: one JSON object per line.
    Json,
}

impl From<LogFormat> for crate::log::Format {
    fn from(format: LogFormat) -> crate::log::Format {
        match format {
            LogFormat::Text => crate::log::Format::Text,
            LogFormat::Json => crate::log::Format::Json,
        }
    }
}

// The file's spelling of the limiter's `Algorithm`, which knows nothing of YAML; named
// `Algorithm` in the schema, which users see.
/// How a limit counts. Every algorithm runs in both stores with the same results: one Lua file
/// each under `scripts/`, one pure Rust module each for the in-process store. `sliding_log` by
/// default, `weighted_log` for a token or money budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "Algorithm")]
pub enum AlgorithmConfig {
    /// Exact: every admission's time is kept for one window.
    #[default]
    SlidingLog,
    /// Two fixed-window counters, the previous one weighted: O(1), approximate.
    SlidingWindow,
    /// One counter per window that starts at the first hit: O(1), up to twice the limit
    /// across a boundary.
    FixedWindow,
    /// A token bucket kept as one timestamp: O(1), exact, with bursts of `burst`.
    Gcra,
    /// Exact like `sliding_log`, one entry per request weighted by its cost: the default of
    /// a token budget, whose requests cost thousands of tokens each.
    WeightedLog,
}

impl From<AlgorithmConfig> for Algorithm {
    fn from(spelled: AlgorithmConfig) -> Algorithm {
        match spelled {
            AlgorithmConfig::SlidingLog => Algorithm::SlidingLog,
            AlgorithmConfig::SlidingWindow => Algorithm::SlidingWindow,
            AlgorithmConfig::FixedWindow => Algorithm::FixedWindow,
            AlgorithmConfig::Gcra => Algorithm::Gcra,
            AlgorithmConfig::WeightedLog => Algorithm::WeightedLog,
        }
    }
}

/// How a rule of the rate limit service counts its unit: `exact`, `fixed_window_epoch`, or
/// any `algorithm` a policy's limit may name, rolling over one unit (a month is 30 days, a
/// year 365; `burst`, where the algorithm takes one, is `requests_per_unit`).
// Deserialized by hand (below): serde's untagged variant would answer a misspelling with "did
// not match any variant" instead of the names. The schema still reads these attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RlsAlgorithm {
    /// sluice's exact choices: a limit's default algorithm for `second`, `minute` and `hour`
    /// (an exact log: never more than `requests_per_unit` in any window of one unit), and
    /// calendar periods in UTC for `day`, `week` (ISO, from Monday), `month` and `year` (real
    /// months and years).
    #[default]
    Exact,
    /// envoyproxy/ratelimit's own windows: fixed, aligned to the Unix epoch, a month of 30
    /// days and a year of 365, so counts match it during a migration (counted as calendar
    /// periods whose key names the window).
    #[serde(rename = "fixed_window_epoch")]
    EpochAligned,
    /// A policy limit's `algorithm`, rolling over one unit.
    #[serde(untagged)]
    Rolling(AlgorithmConfig),
}

impl<'de> Deserialize<'de> for RlsAlgorithm {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        match name.as_str() {
            "exact" => Ok(RlsAlgorithm::Exact),
            "fixed_window_epoch" => Ok(RlsAlgorithm::EpochAligned),
            other => policy_algorithm(other)
                .map(RlsAlgorithm::Rolling)
                .ok_or_else(|| D::Error::unknown_variant(other, names())),
        }
    }
}

/// `name` as a policy limit's `algorithm` spells it.
fn policy_algorithm(name: &str) -> Option<AlgorithmConfig> {
    let name: StrDeserializer<'_, serde::de::value::Error> = name.into_deserializer();
    AlgorithmConfig::deserialize(name).ok()
}

/// Every name `RlsAlgorithm` takes, for the message about one it does not: its own, then the
/// table's labels a limit's `algorithm` takes.
fn names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let policy = ALGORITHMS
            .iter()
            .map(|traits| traits.label)
            .filter(|label| policy_algorithm(label).is_some());
        ["exact", "fixed_window_epoch"]
            .into_iter()
            .chain(policy)
            .collect()
    })
}

/// Which rate-limit fields responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseHeaders {
    /// `RateLimit-Policy` and `RateLimit` (IETF httpapi draft).
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    Legacy,
    Both,
    None,
}

/// What a limited route does when the store cannot decide (Redis down, slow, or its breaker
/// open).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Decide with this instance's in-process store, same algorithm.
    Local,
    /// Admit without deciding.
    Allow,
    /// Refuse with 503.
    Deny,
}

impl OnStoreError {
    pub fn label(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::Allow => "allow",
            OnStoreError::Deny => "deny",
        }
    }
}

/// An HTTP method a route matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodName(pub Method);

impl FromStr for MethodName {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        // Methods are case-sensitive (RFC 9110 §9.1); `post` is not `POST`, so say so.
        if text.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(format!(
                "methods are case-sensitive: write `{}`, not `{text}`",
                text.to_ascii_uppercase()
            ));
        }
        Method::from_bytes(text.as_bytes())
            .map(MethodName)
            .map_err(|_| format!("`{text}` is not a valid HTTP method"))
    }
}

/// A path prefix a route matches, in the canonical form request paths are normalized to (see
/// `crate::path`), so `//login` or `/%6Cogin` in the file mean `/login`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPrefix(pub String);

impl FromStr for PathPrefix {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let plain = |c: char| c.is_ascii_graphic() && !matches!(c, '?' | '#' | ';');
        if !text.starts_with('/') || !text.chars().all(plain) {
            return Err(format!(
                "a path prefix starts with `/` and has only printable ASCII, without a query, \
                 fragment, `;` parameters or spaces (percent-encode the rest); got `{text}`"
            ));
        }
        // Braces only as a whole `{name}` segment: a path parameter.
        for segment in text.split('/') {
            let braced = segment.contains(['{', '}']);
            let param = segment
                .strip_prefix('{')
                .and_then(|s| s.strip_suffix('}'))
                .filter(|name| {
                    !name.is_empty()
                        && name
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
                });
            if braced && param.is_none() {
                return Err(format!(
                    "`{text}`: a path parameter is a whole segment `{{name}}` (letters, digits, `_`, `-`)"
                ));
            }
        }
        crate::path::normalize(text)
            .map(|canonical| PathPrefix(canonical.into_owned()))
            .map_err(|e| format!("`{text}`: {e}"))
    }
}

/// A size in bytes: a bare number of bytes, or with a unit `KiB`, `MiB`, `GiB` (powers of
/// 1024) or `KB`, `MB`, `GB` (powers of 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || format!("expected a size like 64KiB or 10MB, got `{text}`");
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let value: u64 = number.parse().map_err(|_| malformed())?;
        let multiplier: u64 = match unit.trim_start() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "KB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            _ => return Err(malformed()),
        };
        value
            .checked_mul(multiplier)
            .map(ByteSize)
            .ok_or_else(|| format!("size `{text}` is too large"))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size like 64KiB or 10MB")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative, got {v}")))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A count that must be at least one (a limit's `requests`, a pool size). Checked here rather
/// than with `NonZeroU32`, whose error the parser reports at the key instead of the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Positive(pub u32);

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match u32::deserialize(deserializer)? {
            0 => Err(D::Error::custom("must be at least 1, got 0")),
            count => Ok(Positive(count)),
        }
    }
}

/// The number of pooled Redis connections, 1 to `PoolSize::MAX`. The pool reserves room for
/// all of them when it is built, so a slip like `pool_size: 3200000000` must fail `check`
/// rather than ask for gigabytes at `run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSize(pub u32);

impl PoolSize {
    pub const MAX: u32 = 1024;
}

impl<'de> Deserialize<'de> for PoolSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Positive::deserialize(deserializer)? {
            Positive(size) if size > PoolSize::MAX => Err(D::Error::custom(format!(
                "at most {} connections, got {size}",
                PoolSize::MAX
            ))),
            Positive(size) => Ok(PoolSize(size)),
        }
    }
}

/// The status of a direct response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub StatusCode);

impl<'de> Deserialize<'de> for Status {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let code = u16::deserialize(deserializer)?;
        StatusCode::from_u16(code)
            .ok()
            .filter(|s| s.as_u16() >= 200)
            .map(Status)
            .ok_or_else(|| {
                D::Error::custom(format!("expected a status from 200 to 999, got {code}"))
            })
    }
}

/// Where an upstream lives: `http://host:port` or `https://host:port` with an optional base
/// path that is put in front of every forwarded path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamUrl {
    /// `https://`: the upstream is reached over TLS, its host name sent as SNI and verified.
    pub https: bool,
    pub authority: Authority,
    /// Empty, or a path starting with `/` and not ending with one.
    pub base_path: String,
}

impl FromStr for UpstreamUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let uri: Uri = text
            .parse()
            .map_err(|e| format!("`{text}` is not a URL: {e}"))?;
        let https = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP => false,
            Some(s) if *s == Scheme::HTTPS => true,
            _ => {
                return Err(format!(
                "expected a URL like http://127.0.0.1:3000 or https://api.internal, got `{text}`"
            ))
            }
        };
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("`{text}` has no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!(
                "`{text}`: credentials in upstream URLs are not supported"
            ));
        }
        if uri.query().is_some() {
            return Err(format!("`{text}`: an upstream URL cannot have a query"));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        Ok(UpstreamUrl {
            https,
            authority,
            base_path,
        })
    }
}

/// A Redis URL (`redis://[user:password@]host:port/db`), checked but kept as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);

impl FromStr for RedisUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        use redis::IntoConnectionInfo;
        text.into_connection_info()
            .map(|_| RedisUrl(text.to_owned()))
            .map_err(|e| format!("expected a URL like redis://127.0.0.1:6379/0: {e}"))
    }
}

/// A `host:port` of a Redis Sentinel node (`[v6]:port` for an IPv6 address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl FromStr for HostPort {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let expected = || format!("expected host:port like 127.0.0.1:26379, got `{text}`");
        let (host, port) = text.rsplit_once(':').ok_or_else(expected)?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port: u16 = port.parse().map_err(|_| expected())?;
        if host.is_empty() || port == 0 || host.contains(['/', ' ', '@']) {
            return Err(expected());
        }
        Ok(HostPort {
            host: host.to_owned(),
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str) -> Result<RlsAlgorithm, String> {
        serde_saphyr::from_str(name).map_err(|e| e.to_string())
    }

    #[test]
    fn spells_its_own_choices_and_every_policy_algorithm() {
        assert_eq!(parse("exact"), Ok(RlsAlgorithm::Exact));
        assert_eq!(parse("fixed_window_epoch"), Ok(RlsAlgorithm::EpochAligned));
        assert_eq!(
            parse("gcra"),
            Ok(RlsAlgorithm::Rolling(AlgorithmConfig::Gcra))
        );
        assert_eq!(
            parse("weighted_log"),
            Ok(RlsAlgorithm::Rolling(AlgorithmConfig::WeightedLog))
        );
        // Its own names, then the table's labels a limit's `algorithm` takes (not the limit
        // kinds with fields of their own).
        assert_eq!(
            names(),
            [
                "exact",
                "fixed_window_epoch",
                "sliding_log",
                "weighted_log",
                "sliding_window",
                "fixed_window",
                "gcra"
            ]
        );
        let wrong = parse("gcraa").unwrap_err();
        assert!(
            wrong.contains("unknown variant `gcraa`, expected one of exact, fixed_window_epoch"),
            "{wrong}"
        );
    }

    #[test]
    fn host_ports() {
        let hp: HostPort = "127.0.0.1:26379".parse().unwrap();
        assert_eq!((hp.host.as_str(), hp.port), ("127.0.0.1", 26379));
        let hp: HostPort = "[::1]:26380".parse().unwrap();
        assert_eq!((hp.host.as_str(), hp.port), ("::1", 26380));
        assert!("sentinel-0:26379".parse::<HostPort>().is_ok());
        assert!("127.0.0.1".parse::<HostPort>().is_err());
        assert!(":26379".parse::<HostPort>().is_err());
        assert!("host:0".parse::<HostPort>().is_err());
        assert!("host:99999".parse::<HostPort>().is_err());
    }

    #[test]
    fn names_are_restricted() {
        assert!("per-ip".parse::<Name>().is_ok());
        assert!("tenant.v2_x".parse::<Name>().is_ok());
        assert!("".parse::<Name>().is_err());
        assert!("a b".parse::<Name>().is_err());
        assert!("a\"b".parse::<Name>().is_err());
        assert!("x".repeat(65).parse::<Name>().is_err());
    }

    #[test]
    fn key_parts() {
        assert_eq!("client_ip".parse::<KeyPart>(), Ok(KeyPart::ClientIp));
        assert_eq!(
            "header:X-Api-Key".parse::<KeyPart>(),
            Ok(KeyPart::Header(HeaderName::from_static("x-api-key")))
        );
        assert!("header:bad header".parse::<KeyPart>().is_err());
        assert_eq!(
            "cookie:session".parse::<KeyPart>(),
            Ok(KeyPart::Cookie("session".to_owned()))
        );
        assert_eq!(
            "query:api_key".parse::<KeyPart>(),
            Ok(KeyPart::Query("api_key".to_owned()))
        );
        assert!("query:".parse::<KeyPart>().is_err());
        assert!("query:a=b".parse::<KeyPart>().is_err());
        assert!("claim:sub".parse::<KeyPart>().is_err());
        assert_eq!(
            "jwt:sub".parse::<KeyPart>(),
            Ok(KeyPart::Jwt("sub".to_owned()))
        );
    }

    #[test]
    fn ip_networks() {
        let net: IpNet = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(
            net.contains("::ffff:10.1.0.9".parse().unwrap()),
            "IPv4-mapped"
        );
        let one: IpNet = "127.0.0.2".parse().unwrap();
        assert!(one.contains("127.0.0.2".parse().unwrap()));
        assert!(!one.contains("127.0.0.1".parse().unwrap()));
        let all: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        let v6: IpNet = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains("2001:db8:1::1".parse().unwrap()));
        assert!(!v6.contains("10.0.0.1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<IpNet>().is_err());
        assert!("10.0.0/8".parse::<IpNet>().is_err());
    }

    #[test]
    fn path_prefixes_are_canonical() {
        assert_eq!("//%6Cogin".parse::<PathPrefix>().unwrap().0, "/login");
        assert!("/a/../b".parse::<PathPrefix>().is_err());
        assert!("/login;x".parse::<PathPrefix>().is_err());
        assert!("/caf\u{e9}".parse::<PathPrefix>().is_err());
        assert!("login".parse::<PathPrefix>().is_err());
        assert_eq!(
            "/users/{id}/orders".parse::<PathPrefix>().unwrap().0,
            "/users/{id}/orders"
        );
        assert!("/users/x{id}".parse::<PathPrefix>().is_err());
        assert!("/users/{}".parse::<PathPrefix>().is_err());
    }

    #[test]
    fn byte_sizes() {
        assert_eq!("512".parse::<ByteSize>(), Ok(ByteSize(512)));
        assert_eq!("8KiB".parse::<ByteSize>(), Ok(ByteSize(8192)));
        assert_eq!("10MB".parse::<ByteSize>(), Ok(ByteSize(10_000_000)));
        assert_eq!("1 GiB".parse::<ByteSize>(), Ok(ByteSize(1 << 30)));
        assert!("10 parsecs".parse::<ByteSize>().is_err());
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!("99999999999GiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn upstream_urls() {
        let url: UpstreamUrl = "http://127.0.0.1:3000".parse().unwrap();
        assert_eq!(url.authority.as_str(), "127.0.0.1:3000");
        assert_eq!(url.base_path, "");
        let url: UpstreamUrl = "http://api.internal/v1/".parse().unwrap();
        assert_eq!(url.base_path, "/v1");
        let url: UpstreamUrl = "https://api.internal:8443".parse().unwrap();
        assert!(url.https);
        assert!(!"http://x".parse::<UpstreamUrl>().unwrap().https);
        assert!("ftp://x".parse::<UpstreamUrl>().is_err());
        assert!("127.0.0.1:3000".parse::<UpstreamUrl>().is_err());
        assert!("http://x/?a=1".parse::<UpstreamUrl>().is_err());
    }

    #[test]
    fn methods_are_case_sensitive() {
        assert!("POST".parse::<MethodName>().is_ok());
        assert!("post".parse::<MethodName>().is_err());
    }
}

/// What a limit does with a request it has no room for.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnExceed {
    /// Answer 429.
    #[default]
    Reject,
    /// Hold the request until the limit admits it, if that is within `max_delay`; else 429.
    Delay,
    /// `{ switch_model: gpt-4o-mini }`, on a token or money limit that reads the body's
    /// `model`: send the request to this model instead (its body's `model` rewritten, its
    /// checks planned and decided again for it, once); the fallback's own limits still
    /// refuse with 429.
    SwitchModel(String),
}

/// One entry of a limit's `count: { status: [...] }`: a status (`401`) or a class (`5xx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusMatch {
    Exact(u16),
    /// The hundreds digit: `4` for `4xx`.
    Class(u16),
}

impl StatusMatch {
    pub fn matches(self, status: u16) -> bool {
        match self {
            StatusMatch::Exact(code) => status == code,
            StatusMatch::Class(class) => status / 100 == class,
        }
    }
}

impl FromStr for StatusMatch {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wrong = || {
            format!("expected a status from 100 to 599 or a class from 1xx to 5xx, got `{text}`")
        };
        let lower = text.trim().to_ascii_lowercase();
        if let Some(digit) = lower.strip_suffix("xx") {
            return match digit.parse::<u16>() {
                Ok(class @ 1..=5) if digit.len() == 1 => Ok(StatusMatch::Class(class)),
                _ => Err(wrong()),
            };
        }
        match lower.parse::<u16>() {
            Ok(code @ 100..=599) => Ok(StatusMatch::Exact(code)),
            _ => Err(wrong()),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = StatusMatch;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a status like 401 or a class like 5xx")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                v.to_string().parse().map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                v.to_string().parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}
