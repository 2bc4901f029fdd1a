//! Verified JSON Web Tokens: the `jwt:` verifiers of the policy, the token a
//! request carries, and the claims a key part or a `when:` condition may read once the token
//! has passed every check (signature, algorithm pinned by the key, `exp`/`nbf`/`iat`, issuer,
//! audience). A claim of an unverified token is client input and is never read.
//!
//! The key files are read when a policy is loaded (`Verifiers::load`, called by `app`), so a
//! reload picks up a rotated key. A verifier with `jwks_url` gets its keys from the identity
//! provider instead, fetched in the background (`jwks`), never on a request's path. A
//! verified token is remembered (`Verifier::verify`, by the SHA-256 of the token) until its
//! `exp` or until the key set changes, whichever comes first, so a client sending the same
//! token again costs a hash instead of a signature check.

mod base64url;
pub mod jwks;
mod keyset;
mod token;

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, AUTHORIZATION, COOKIE};
use lru::LruCache;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::config::{ConfigError, JwtConfig, Name, Position, TokenFrom};

pub use self::jwks::Jwks;
pub use self::keyset::{Key, Material};
pub use self::token::MAX_TOKEN_BYTES;
pub use crate::config::{JwtAlgorithm, OnInvalid};

/// Why a request's token is not taken: the `reason` label of
/// `sluice_jwt_invalid_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    /// No token where the verifier looks for one.
    Missing,
    /// Not three base64url parts of JSON, larger than [`MAX_TOKEN_BYTES`], or without `exp`.
    Malformed,
    /// The signature does not verify with the key.
    Signature,
    /// `exp` (plus the clock skew) has passed.
    Expired,
    /// `nbf` or `iat` is later than now plus the clock skew.
    NotYetValid,
    /// `iss` is not the verifier's issuer.
    Issuer,
    /// No `aud` is one of the verifier's audiences.
    Audience,
    /// The header's `alg` is not the algorithm of the key it names (`none` included).
    Algorithm,
    /// The header's `kid` names no key (or names none while there are several).
    UnknownKey,
}

impl Invalid {
    pub const ALL: [Invalid; 9] = [
        Invalid::Missing,
        Invalid::Malformed,
        Invalid::Signature,
        Invalid::Expired,
        Invalid::NotYetValid,
        Invalid::Issuer,
        Invalid::Audience,
        Invalid::Algorithm,
        Invalid::UnknownKey,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Invalid::Missing => "missing",
            Invalid::Malformed => "malformed",
            Invalid::Signature => "signature",
            Invalid::Expired => "expired",
            Invalid::NotYetValid => "not_yet_valid",
            Invalid::Issuer => "issuer",
            Invalid::Audience => "audience",
            Invalid::Algorithm => "algorithm",
            Invalid::UnknownKey => "unknown_key",
        }
    }

    /// The problem body's `detail` and the `error_description` of `WWW-Authenticate`: says
    /// what failed, never a claim's value.
    pub fn detail(self) -> &'static str {
        match self {
            Invalid::Missing => "this route needs a bearer token and the request has none",
            Invalid::Malformed => "the bearer token is not a well-formed JWT (three base64url parts of JSON, an `exp` claim, at most 24576 bytes)",
            Invalid::Signature => "the bearer token's signature does not verify",
            Invalid::Expired => "the bearer token has expired",
            Invalid::NotYetValid => "the bearer token is not valid yet (nbf or iat is in the future)",
            Invalid::Issuer => "the bearer token was issued by another issuer",
            Invalid::Audience => "the bearer token is meant for another audience",
            Invalid::Algorithm => "the bearer token's algorithm is not the one of its key",
            Invalid::UnknownKey => "the bearer token names no known key",
        }
    }
}

/// The claims of a token that passed every check; shared, so that a cached token's claims
/// are handed out without a copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claims(Arc<Map<String, Value>>);

/// A claim's value as a key part or a condition reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimText<'a> {
    Text(&'a str),
    /// A number, as its decimal text (`42`, `1.5`).
    Number(String),
}

impl ClaimText<'_> {
    pub fn as_str(&self) -> &str {
        match self {
            ClaimText::Text(text) => text,
            ClaimText::Number(number) => number,
        }
    }
}

impl Claims {
    pub fn new(claims: Map<String, Value>) -> Claims {
        Claims(Arc::new(claims))
    }

    /// `exp` as seconds since the epoch (verified tokens always have one).
    fn exp(&self) -> f64 {
        self.0.get("exp").and_then(Value::as_f64).unwrap_or(0.0)
    }

    /// The claim `name` when it is a string or a number; an object, an array, a boolean or
    /// null reads as absent (a key part then falls back to the client address, a condition
    /// does not hold), so no claim is ever written into a key as JSON.
    pub fn text(&self, name: &str) -> Option<ClaimText<'_>> {
        match self.0.get(name)? {
            Value::String(text) => Some(ClaimText::Text(text)),
            Value::Number(number) => Some(ClaimText::Number(number.to_string())),
            _ => None,
        }
    }
}

/// Why a token could not be judged, or was judged invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Invalid(Invalid),
    /// A `jwks_url` verifier has no keys yet (no fetch has succeeded since start): the
    /// token can be neither accepted nor refused (503).
    NoKeys,
}

/// One version of a verifier's keys. `generation` changes whenever the keys do (a fetch
/// that returned another set), so a cached verification never outlives the keys it was
/// made with.
#[derive(Debug)]
pub struct KeySet {
    pub keys: Vec<Key>,
    pub generation: u64,
}

/// Where a verifier's keys come from.
#[derive(Debug)]
pub enum KeySource {
    /// Read from files with the policy: fixed for the life of this policy version.
    Fixed(Arc<KeySet>),
    /// Fetched from `jwks_url`, replaced in the background.
    Fetched(Arc<Jwks>),
}

/// A verified token remembered: its claims and the key set it was verified with.
struct Cached {
    claims: Claims,
    generation: u64,
}

/// One verifier of the policy, its keys read from their files or fetched from its URL.
pub struct Verifier {
    pub name: Name,
    pub issuer: String,
    pub audiences: Vec<String>,
    pub keys: KeySource,
    pub from: TokenFrom,
    pub clock_skew: Duration,
    /// Verified tokens by the SHA-256 of the token; `None` with `token_cache: 0`.
    cache: Option<Mutex<LruCache<[u8; 32], Cached>>>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("name", &self.name)
            .field("issuer", &self.issuer)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// Tokens remembered per verifier unless `token_cache` says otherwise.
pub const DEFAULT_TOKEN_CACHE: usize = 10_000;

impl Verifier {
    /// A verifier; `token_cache`: most verified tokens remembered (0: none).
    pub fn new(
        name: Name,
        issuer: String,
        audiences: Vec<String>,
        keys: KeySource,
        from: TokenFrom,
        clock_skew: Duration,
        token_cache: usize,
    ) -> Verifier {
        Verifier {
            name,
            issuer,
            audiences,
            keys,
            from,
            clock_skew,
            cache: NonZeroUsize::new(token_cache).map(|n| Mutex::new(LruCache::new(n))),
        }
    }

    /// The keys at hand: `None` while a `jwks_url` verifier has fetched none yet.
    pub fn key_set(&self) -> Option<Arc<KeySet>> {
        match &self.keys {
            KeySource::Fixed(set) => Some(Arc::clone(set)),
            KeySource::Fetched(jwks) => jwks.current(),
        }
    }

    /// The claims of `token` at `now`, from the cache when this token was verified before
    /// with the keys at hand (its `exp` checked again), else from a full verification. An
    /// unknown kid asks a `jwks_url` verifier for a refetch, in the background: this request
    /// is answered from the keys at hand.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Claims, Failure> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Failure::Invalid(Invalid::Malformed));
        }
        let set = self.key_set().ok_or(Failure::NoKeys)?;
        let Some(cache) = &self.cache else {
            return self.verify_with(&set, token, now);
        };
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(claims) = self.cached(cache, &hash, set.generation) {
            let now = now
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |since| since.as_secs_f64());
            if now > claims.exp() + self.clock_skew.as_secs_f64() {
                return Err(Failure::Invalid(Invalid::Expired));
            }
            return Ok(claims);
        }
        let claims = self.verify_with(&set, token, now)?;
        if let Ok(mut cache) = cache.lock() {
            cache.put(
                hash,
                Cached {
                    claims: claims.clone(),
                    generation: set.generation,
                },
            );
        }
        Ok(claims)
    }

    /// The cached claims of the token of hash `hash` if they were verified with the key set
    /// of generation `generation`; an entry of another generation is dropped.
    fn cached(
        &self,
        cache: &Mutex<LruCache<[u8; 32], Cached>>,
        hash: &[u8; 32],
        generation: u64,
    ) -> Option<Claims> {
        let mut cache = cache.lock().ok()?;
        match cache.get(hash) {
            Some(hit) if hit.generation == generation => Some(hit.claims.clone()),
            Some(_) => {
                cache.pop(hash);
                None
            }
            None => None,
        }
    }

    /// A full verification with `set`, no cache.
    pub fn verify_with(
        &self,
        set: &KeySet,
        token: &str,
        now: SystemTime,
    ) -> Result<Claims, Failure> {
        token::verify(self, &set.keys, token, now).map_err(|invalid| {
            if invalid == Invalid::UnknownKey {
                if let KeySource::Fetched(jwks) = &self.keys {
                    jwks.unknown_kid();
                }
            }
            Failure::Invalid(invalid)
        })
    }

    /// The token of the request where this verifier looks: `Authorization: Bearer TOKEN`
    /// (the scheme case-insensitive), another header's value (a `Bearer ` in front is taken
    /// off), or a cookie's value.
    pub fn token<'h>(&self, headers: &'h HeaderMap) -> Option<&'h str> {
        let bearer = |value: &'h str| {
            let value = value.trim();
            match value.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                    Some(token.trim())
                }
                _ => None,
            }
        };
        let token = match &self.from {
            TokenFrom::Header(name) => {
                let value = headers.get(name)?.to_str().ok()?;
                if *name == AUTHORIZATION {
                    bearer(value)?
                } else {
                    bearer(value).unwrap_or(value.trim())
                }
            }
            TokenFrom::Cookie(name) => headers
                .get_all(COOKIE)
                .iter()
                .filter_map(|value| value.to_str().ok())
                .flat_map(|value| value.split(';'))
                .find_map(|pair| {
                    let (key, value) = pair.trim().split_once('=')?;
                    (key.trim() == name).then(|| value.trim().trim_matches('"'))
                })?,
        };
        (!token.is_empty()).then_some(token)
    }
}

/// The verifiers of a policy, by name, loaded with their key files.
#[derive(Debug, Default)]
pub struct Verifiers {
    by_name: HashMap<Name, Arc<Verifier>>,
}

impl Verifiers {
    /// Reads every verifier's key files (paths relative to `file`'s directory) and checks
    /// them; an error names the file and the field. A `jwks_url` is not fetched here (`check`
    /// and `explain` fetch nothing): `start` does, for the version put in force.
    pub fn load(configs: &[JwtConfig], file: &Path) -> Result<Verifiers, ConfigError> {
        let mut by_name = HashMap::new();
        for (index, config) in configs.iter().enumerate() {
            let field = format!("jwt[{index}]");
            if by_name.contains_key(&config.name.value) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(&config.name),
                    format!("{field}.name"),
                    format!("duplicate verifier name `{}`", config.name.value),
                ));
            }
            let verifier = keyset::verifier(config, file, &field, |url| {
                Ok(KeySource::Fetched(jwks::Jwks::from_config(
                    config, url, file, &field,
                )?))
            })?;
            by_name.insert(config.name.value.clone(), Arc::new(verifier));
        }
        Ok(Verifiers { by_name })
    }

    pub fn get(&self, name: &Name) -> Option<&Arc<Verifier>> {
        self.by_name.get(name)
    }

    /// Starts the background fetch of every `jwks_url` verifier (once per URL and settings:
    /// a reload that keeps them keeps the fetcher and its keys), counting into `metrics`.
    /// Needs a tokio runtime.
    pub fn start(&self, metrics: &jwks::JwksMetrics) {
        for verifier in self.by_name.values() {
            if let KeySource::Fetched(jwks) = &verifier.keys {
                jwks.start(metrics);
            }
        }
    }

    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(Name::as_str).collect();
        names.sort_unstable();
        names
    }
}

/// The key files `configs` name, resolved against `file`'s directory: watched so that an
/// edit of one alone reloads the policy.
pub fn key_files(configs: &[JwtConfig], file: &Path) -> Vec<PathBuf> {
    configs
        .iter()
        .flat_map(|config| {
            config
                .jwks_file
                .iter()
                .map(|path| path.value.clone())
                .chain(config.keys.iter().flat_map(|key| {
                    key.value
                        .pem_file
                        .iter()
                        .chain(key.value.secret_file.iter())
                        .map(|path| path.value.clone())
                }))
        })
        .map(|path| crate::tls::resolve(file, &path))
        .collect()
}
