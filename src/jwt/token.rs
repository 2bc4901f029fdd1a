//! Verifying one compact JWS token (RFC 7515/7519) against a verifier: size, shape, the key
//! its header names, the algorithm that key is pinned to, the signature, then the time
//! claims, the issuer and the audience. Only a token that passed all of them yields claims.

use std::time::{SystemTime, UNIX_EPOCH};

use ring::{hmac, signature};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::base64url::base64url;
use super::keyset::{Key, Material};
use super::{Claims, Invalid, Verifier};
use crate::config::JwtAlgorithm;

/// Longest token verified, in bytes: longer ones are `malformed` before any decoding or
/// crypto. Above the 16 KB that large claim sets reach, below the default
/// `server.max_header_bytes` (32 KiB), so a token that fits the head is judged by its
/// content and never by this cap alone.
pub const MAX_TOKEN_BYTES: usize = 24 * 1024;

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
}

/// The claims of `token` once every check passed with `keys`, at time `now`.
pub fn verify(
    verifier: &Verifier,
    keys: &[Key],
    token: &str,
    now: SystemTime,
) -> Result<Claims, Invalid> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(Invalid::Malformed);
    }
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Invalid::Malformed);
    };
    let header: Header = base64url(header.as_bytes())
        .and_then(|json| serde_json::from_slice(&json).ok())
        .ok_or(Invalid::Malformed)?;
    let key = select_key(keys, header.kid.as_deref())?;
    // The key fixes the algorithm: `none`, or HS256 "signed" with a public key, never reach
    // a verification.
    if header.alg != key.algorithm.name() {
        return Err(Invalid::Algorithm);
    }
    let signature = base64url(signature.as_bytes()).ok_or(Invalid::Malformed)?;
    let signed = &token[..header_and_payload_len(token)];
    check_signature(key, signed.as_bytes(), &signature)?;
    let claims: Map<String, Value> = base64url(payload.as_bytes())
        .and_then(|json| serde_json::from_slice(&json).ok())
        .ok_or(Invalid::Malformed)?;
    check_claims(verifier, &claims, now)?;
    Ok(Claims::new(claims))
}

/// The length of `header.payload`, the signed part.
fn header_and_payload_len(token: &str) -> usize {
    token.rfind('.').unwrap_or(0)
}

fn select_key<'k>(keys: &'k [Key], kid: Option<&str>) -> Result<&'k Key, Invalid> {
    match kid {
        Some(kid) => keys
            .iter()
            .find(|key| key.kid.as_deref() == Some(kid))
            .ok_or(Invalid::UnknownKey),
        None => match keys {
            [only] => Ok(only),
            _ => Err(Invalid::UnknownKey),
        },
    }
}

fn check_signature(key: &Key, signed: &[u8], sig: &[u8]) -> Result<(), Invalid> {
    let verified = match (&key.material, key.algorithm) {
        (Material::Hmac(secret), JwtAlgorithm::HS256) => hmac::verify(secret, signed, sig).is_ok(),
        (Material::RsaParts { n, e }, JwtAlgorithm::RS256) => signature::RsaPublicKeyComponents {
            n: n.as_slice(),
            e: e.as_slice(),
        }
        .verify(&signature::RSA_PKCS1_2048_8192_SHA256, signed, sig)
        .is_ok(),
        (Material::Public(public), algorithm) => {
            let algorithm: &dyn signature::VerificationAlgorithm = match algorithm {
                JwtAlgorithm::RS256 => &signature::RSA_PKCS1_2048_8192_SHA256,
                JwtAlgorithm::ES256 => &signature::ECDSA_P256_SHA256_FIXED,
                JwtAlgorithm::EdDSA => &signature::ED25519,
                JwtAlgorithm::HS256 => return Err(Invalid::Algorithm),
            };
            signature::UnparsedPublicKey::new(algorithm, public)
                .verify(signed, sig)
                .is_ok()
        }
        // Material and algorithm are paired when the key is read; anything else is refused.
        _ => false,
    };
    if verified {
        Ok(())
    } else {
        Err(Invalid::Signature)
    }
}

/// `exp` (required), `nbf` and `iat` against `now` with the verifier's skew; `iss` equal to
/// the issuer; `aud` (a string or an array) naming one of the audiences.
fn check_claims(
    verifier: &Verifier,
    claims: &Map<String, Value>,
    now: SystemTime,
) -> Result<(), Invalid> {
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64());
    let skew = verifier.clock_skew.as_secs_f64();
    let time = |name: &str| -> Result<Option<f64>, Invalid> {
        match claims.get(name) {
            None => Ok(None),
            Some(value) => value.as_f64().map(Some).ok_or(Invalid::Malformed),
        }
    };
    let exp = time("exp")?.ok_or(Invalid::Malformed)?;
    if now > exp + skew {
        return Err(Invalid::Expired);
    }
    for name in ["nbf", "iat"] {
        if time(name)?.is_some_and(|at| at > now + skew) {
            return Err(Invalid::NotYetValid);
        }
    }
    if claims.get("iss").and_then(Value::as_str) != Some(verifier.issuer.as_str()) {
        return Err(Invalid::Issuer);
    }
    let wanted = |aud: &str| verifier.audiences.iter().any(|a| a == aud);
    let audience = match claims.get("aud") {
        Some(Value::String(aud)) => wanted(aud),
        Some(Value::Array(auds)) => auds.iter().filter_map(Value::as_str).any(wanted),
        _ => false,
    };
    if !audience {
        return Err(Invalid::Audience);
    }
    Ok(())
}
