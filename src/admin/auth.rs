//! The admin API's bearer token: read once from the environment variable the config names,
//! and compared in constant time, so the time of a refusal says nothing about the token.

use http::header::HeaderValue;
use sha2::{Digest, Sha256};

use crate::config::AdminConfig;

/// Why the token could not be read at start.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("admin.token_env names the environment variable `{0}`, which is not set: set it to the admin API's bearer token")]
    Unset(String),
    #[error("admin.token_env names the environment variable `{0}`, which is empty: set it to the admin API's bearer token")]
    Empty(String),
    #[error("the environment variable `{0}` (admin.token_env) is not valid UTF-8")]
    NotUnicode(String),
}

/// The token, kept only as its SHA-256: comparing two digests of equal length in constant
/// time hides both the token's bytes and its length.
pub struct Token([u8; 32]);

impl Token {
    pub fn new(secret: &str) -> Token {
        Token(Sha256::digest(secret.as_bytes()).into())
    }

    /// Reads the token `admin.token_env` names; `None` when none is named.
    pub fn from_env(config: &AdminConfig) -> Result<Option<Token>, TokenError> {
        let Some(name) = &config.token_env else {
            return Ok(None);
        };
        let name = name.value.as_str();
        match std::env::var(name) {
            Ok(value) if value.trim().is_empty() => Err(TokenError::Empty(name.to_owned())),
            Ok(value) => Ok(Some(Token::new(&value))),
            Err(std::env::VarError::NotPresent) => Err(TokenError::Unset(name.to_owned())),
            Err(std::env::VarError::NotUnicode(_)) => Err(TokenError::NotUnicode(name.to_owned())),
        }
    }

    /// Whether an `Authorization` field carries this token as `Bearer <token>`.
    pub fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(given) = authorization.and_then(|value| bearer(value.as_bytes())) else {
            return false;
        };
        let given: [u8; 32] = Sha256::digest(given).into();
        // Every byte is compared whatever the first difference.
        let difference = given
            .iter()
            .zip(&self.0)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(difference) == 0
    }
}

/// The credentials of a `Bearer` authorization (the scheme is case-insensitive, RFC 9110).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.starts_with(b" ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_token_is_admitted() {
        let token = Token::new("s3cret");
        let admits = |v: &str| token.admits(Some(&HeaderValue::from_str(v).unwrap()));
        assert!(admits("Bearer s3cret"));
        assert!(admits("bearer  s3cret"));
        assert!(!admits("Bearer s3cre"));
        assert!(!admits("Bearer s3cret2"));
        assert!(!admits("Basic s3cret"));
        assert!(!admits("Bearers3cret"));
        assert!(!admits("Bearer "));
        assert!(!admits("s3cret"));
        assert!(!token.admits(None));
    }
}
