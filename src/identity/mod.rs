//! Identities from verified JSON Web Tokens: the `jwt:` verifiers of the policy, the token a
//! request carries, and the claims a key part or a `when:` condition may read once the token
//! has passed every check (signature, algorithm pinned by the key, `exp`/`nbf`/`iat`, issuer,
//! audience). A claim of an unverified token is client input and is never read.
//!
//! The key files are read when a policy is loaded (`Verifiers::load`, called by `app`), so a
//! reload picks up a rotated key; verifying is a pure function of the token, the verifier and
//! the time.

mod base64url;
mod jwt;
mod keys;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, AUTHORIZATION, COOKIE};
use serde_json::{Map, Value};

use crate::config::{ConfigError, JwtConfig, Name, Position, TokenFrom};

pub use self::jwt::{verify, MAX_TOKEN_BYTES};
pub use self::keys::{Key, Material};
pub use crate::config::{JwtAlgorithm, OnInvalid};

/// Why a request's token gives it no identity: the `reason` label of
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

/// The claims of a token that passed every check.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claims(Map<String, Value>);

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
        Claims(claims)
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

/// One verifier of the policy, its keys read from their files.
#[derive(Debug)]
pub struct Verifier {
    pub name: Name,
    pub issuer: String,
    pub audiences: Vec<String>,
    pub keys: Vec<Key>,
    pub from: TokenFrom,
    pub clock_skew: Duration,
}

impl Verifier {
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
    /// them; an error names the file and the field.
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
            let verifier = keys::verifier(config, file, &field)?;
            by_name.insert(config.name.value.clone(), Arc::new(verifier));
        }
        Ok(Verifiers { by_name })
    }

    pub fn get(&self, name: &Name) -> Option<&Arc<Verifier>> {
        self.by_name.get(name)
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
