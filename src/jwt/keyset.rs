//! The keys a verifier checks signatures with, read from the files its `jwt:` entry names:
//! a JWK set (RFC 7517: RSA, P-256 EC, Ed25519 OKP and HS256 `oct` keys), PEM public keys
//! (`PUBLIC KEY`, SubjectPublicKeyInfo) or an HS256 secret. Each key carries its algorithm,
//! fixed here by the policy, never by a token (RFC 8725 §3.1). Errors name the file and what
//! is wrong with it.

use std::path::Path;
use std::time::Duration;

use ring::hmac;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::SubjectPublicKeyInfoDer;
use serde_json::Value;

use super::Verifier;
use crate::config::{ConfigError, JwtAlgorithm, JwtConfig, JwtKeyConfig, Position, Spanned};

/// Fewest bytes of an HS256 secret: the hash's own length (RFC 7518 §3.2).
pub const MIN_SECRET_BYTES: usize = 32;
/// Fewest bits of an RSA modulus ring verifies with.
const MIN_RSA_BITS: usize = 2048;

/// The material a signature is checked with.
pub enum Material {
    /// RS256 from a JWK's modulus and exponent (big-endian, no leading zeros).
    RsaParts {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// RS256 (PKCS#1 `RSAPublicKey` DER), ES256 (an uncompressed P-256 point) or EdDSA (32
    /// bytes), as ring's `UnparsedPublicKey` takes them.
    Public(Vec<u8>),
    Hmac(hmac::Key),
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret is never printed.
        f.write_str(match self {
            Material::RsaParts { .. } => "RsaParts",
            Material::Public(_) => "Public",
            Material::Hmac(_) => "Hmac",
        })
    }
}

/// One key: its `kid` (if any), the only algorithm it verifies, and its material.
#[derive(Debug)]
pub struct Key {
    pub kid: Option<String>,
    pub algorithm: JwtAlgorithm,
    pub material: Material,
}

/// Builds the verifier of `config`, reading its files (relative to `file`). The keys of a
/// `jwks_url` come from `fetched`, which the caller gives (the fetcher, `super::jwks`, reads
/// JWK sets with this module's parser: this module does not name it back).
pub fn verifier(
    config: &JwtConfig,
    file: &Path,
    field: &str,
    fetched: impl FnOnce(&Spanned<String>) -> Result<super::KeySource, ConfigError>,
) -> Result<Verifier, ConfigError> {
    let invalid = |position: Position, name: &str, message: String| {
        ConfigError::invalid(file, position, format!("{field}.{name}"), message)
    };
    check_claims(config, file, field)?;
    let clock_skew = config
        .clock_skew
        .map_or(Duration::from_secs(30), |skew| skew.0);
    let token_cache = config
        .token_cache
        .map_or(super::DEFAULT_TOKEN_CACHE, |n| n as usize);
    let verifier = |keys: super::KeySource| {
        Verifier::new(
            config.name.value.clone(),
            config.issuer.clone(),
            config.audiences.value.clone(),
            keys,
            config.from.clone(),
            clock_skew,
            token_cache,
        )
    };
    if let Some(url) = &config.jwks_url {
        if config.jwks_file.is_some() || !config.keys.is_empty() {
            return Err(invalid(
                Position::from(url),
                "jwks_url",
                "`jwks_url` is exclusive with `jwks_file` and `keys`: a verifier's keys come \
                 from one place"
                    .to_owned(),
            ));
        }
        return Ok(verifier(fetched(url)?));
    }
    refuse_fetch_settings(config, file, field)?;
    let keys = fixed_keys(config, file, field)?;
    Ok(verifier(super::KeySource::Fixed(std::sync::Arc::new(
        super::KeySet {
            keys,
            generation: 0,
        },
    ))))
}

/// Refuses a verifier without an issuer or an audience.
fn check_claims(config: &JwtConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    let invalid = |position: Position, name: &str, message: String| {
        ConfigError::invalid(file, position, format!("{field}.{name}"), message)
    };
    let at = Position::from(&config.name);
    if config.issuer.is_empty() {
        return Err(invalid(
            at,
            "issuer",
            "the issuer cannot be empty".to_owned(),
        ));
    }
    if config.audiences.value.is_empty() || config.audiences.value.iter().any(String::is_empty) {
        return Err(invalid(
            Position::from(&config.audiences),
            "audiences",
            "list at least one audience, none empty".to_owned(),
        ));
    }
    Ok(())
}

/// Refuses the settings of a `jwks_url` on a verifier whose keys are fixed.
fn refuse_fetch_settings(config: &JwtConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    let invalid = |position: Position, name: &str, message: String| {
        ConfigError::invalid(file, position, format!("{field}.{name}"), message)
    };
    let at = Position::from(&config.name);
    for (name, set) in [
        ("jwks_ca_file", config.jwks_ca_file.is_some()),
        ("min_refresh", config.min_refresh.is_some()),
        ("max_refresh", config.max_refresh.is_some()),
        ("fetch_timeout", config.fetch_timeout.is_some()),
    ] {
        if set {
            return Err(invalid(
                at,
                name,
                format!("`{name}` is a setting of `jwks_url`, which this verifier does not have"),
            ));
        }
    }
    Ok(())
}

/// The fixed keys of a verifier without `jwks_url`: its `jwks_file`'s and its `keys`, each
/// `kid` once, at least one, and with several, each with a `kid`.
fn fixed_keys(config: &JwtConfig, file: &Path, field: &str) -> Result<Vec<Key>, ConfigError> {
    let invalid = |position: Position, name: &str, message: String| {
        ConfigError::invalid(file, position, format!("{field}.{name}"), message)
    };
    let at = Position::from(&config.name);
    let mut keys = Vec::new();
    if let Some(jwks) = &config.jwks_file {
        keys.extend(jwks_file(jwks, file, &format!("{field}.jwks_file"))?);
    }
    for (index, key) in config.keys.iter().enumerate() {
        let read = key_file(key, file, &format!("{field}.keys[{index}]"))?;
        if let Some(kid) = read.kid.as_deref().filter(|kid| kid_taken(&keys, kid)) {
            return Err(invalid(
                Position::from(key),
                &format!("keys[{index}].kid"),
                format!(
                    "the `kid` `{kid}` is already the kid of another key of this verifier \
                     (in `jwks_file` or an earlier `keys` entry): a token naming it could be \
                     checked against either; give each key its own kid"
                ),
            ));
        }
        keys.push(read);
    }
    if keys.is_empty() {
        return Err(invalid(
            at,
            "jwks_file",
            "a verifier needs keys: `jwks_url`, `jwks_file` (with at least one usable key) or `keys`"
                .to_owned(),
        ));
    }
    if keys.len() > 1 && keys.iter().any(|key| key.kid.is_none()) {
        return Err(invalid(
            at,
            "keys",
            "with several keys, each needs a `kid` (a token names the key it was signed with)"
                .to_owned(),
        ));
    }
    Ok(keys)
}

fn read(
    path: &Spanned<std::path::PathBuf>,
    file: &Path,
    field: &str,
) -> Result<Vec<u8>, ConfigError> {
    let resolved = crate::tls::resolve(file, &path.value);
    std::fs::read(&resolved).map_err(|err| {
        ConfigError::invalid(
            file,
            Position::from(path),
            field,
            format!("cannot read {}: {err}", resolved.display()),
        )
    })
}

/// Whether one of `keys` already has the kid `kid`.
fn kid_taken(keys: &[Key], kid: &str) -> bool {
    keys.iter().any(|key| key.kid.as_deref() == Some(kid))
}

/// A PEM public key or an HS256 secret, pinned to its configured algorithm.
fn key_file(key: &Spanned<JwtKeyConfig>, file: &Path, field: &str) -> Result<Key, ConfigError> {
    let config = &key.value;
    let (path, name) = match (&config.pem_file, &config.secret_file) {
        (Some(pem), None) => (pem, "pem_file"),
        (None, Some(secret)) => (secret, "secret_file"),
        _ => return Err(ConfigError::invalid(
            file,
            Position::from(key),
            field,
            "a key names exactly one of `pem_file` (RS256, ES256, EdDSA) or `secret_file` (HS256)",
        )),
    };
    let field = format!("{field}.{name}");
    let bytes = read(path, file, &field)?;
    let resolved = crate::tls::resolve(file, &path.value);
    let unusable = |message: String| {
        ConfigError::invalid(
            file,
            Position::from(path),
            &field,
            format!("{}: {message}", resolved.display()),
        )
    };
    let material = match (name, config.algorithm) {
        ("secret_file", JwtAlgorithm::HS256) => secret_file(&bytes).map_err(unusable)?,
        ("secret_file", other) => {
            return Err(unusable(format!(
                "a secret is for HS256, not {}",
                other.name()
            )))
        }
        (_, JwtAlgorithm::HS256) => {
            return Err(unusable(
                "HS256 takes a `secret_file`, not a PEM public key".to_owned(),
            ))
        }
        (_, algorithm) => pem_public_key(&bytes, algorithm).map_err(unusable)?,
    };
    Ok(Key {
        kid: config.kid.clone(),
        algorithm: config.algorithm,
        material,
    })
}

/// An HS256 secret file's bytes, a final line break taken off (editors add one).
fn secret_file(bytes: &[u8]) -> Result<Material, String> {
    let trimmed = bytes
        .strip_suffix(b"\n")
        .map(|s| s.strip_suffix(b"\r").unwrap_or(s))
        .unwrap_or(bytes);
    secret(trimmed)
}

/// An HS256 secret, at least as long as the hash.
fn secret(secret: &[u8]) -> Result<Material, String> {
    if secret.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "an HS256 secret needs at least {MIN_SECRET_BYTES} bytes, this one has {}",
            secret.len()
        ));
    }
    Ok(Material::Hmac(hmac::Key::new(hmac::HMAC_SHA256, secret)))
}

const OID_RSA: &[u8] = &[
    0x06, 0x09, 0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x01, 0x01,
];
const OID_EC: &[u8] = &[0x06, 0x07, 0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x02, 0x01];
const OID_P256: &[u8] = &[0x06, 0x08, 0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x03, 0x01, 0x07];
const OID_ED25519: &[u8] = &[0x06, 0x03, 0x2B, 0x65, 0x70];

/// A `PUBLIC KEY` PEM section whose key type is the one `algorithm` needs.
fn pem_public_key(pem: &[u8], algorithm: JwtAlgorithm) -> Result<Material, String> {
    let spki = SubjectPublicKeyInfoDer::from_pem_slice(pem)
        .map_err(|err| format!("no PEM `PUBLIC KEY` section ({err})"))?;
    let (algorithm_id, key) = split_spki(spki.as_ref())
        .ok_or_else(|| "the `PUBLIC KEY` section is not a SubjectPublicKeyInfo".to_owned())?;
    let has = |oid: &[u8]| algorithm_id.windows(oid.len()).any(|w| w == oid);
    let (fits, kind) = match algorithm {
        JwtAlgorithm::RS256 => (has(OID_RSA), "an RSA key"),
        JwtAlgorithm::ES256 => (has(OID_EC) && has(OID_P256), "a P-256 EC key"),
        JwtAlgorithm::EdDSA => (has(OID_ED25519), "an Ed25519 key"),
        JwtAlgorithm::HS256 => (false, "a secret"),
    };
    if !fits {
        return Err(format!(
            "{} needs {kind}; this is another kind of key",
            algorithm.name()
        ));
    }
    check_public(algorithm, key)?;
    Ok(Material::Public(key.to_vec()))
}

/// The algorithm identifier and the subject public key's bytes of a SubjectPublicKeyInfo:
/// `SEQUENCE { SEQUENCE algorithm, BIT STRING key }` (DER, the key's unused bits 0).
fn split_spki(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let (body, rest) = der_element(der, 0x30)?;
    if !rest.is_empty() {
        return None;
    }
    let (algorithm, rest) = der_element(body, 0x30)?;
    let (bits, rest) = der_element(rest, 0x03)?;
    if !rest.is_empty() {
        return None;
    }
    let (&unused, key) = bits.split_first()?;
    (unused == 0).then_some((algorithm, key))
}

/// The contents of the DER element of tag `tag` at the start of `der`, and what follows it.
fn der_element(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = der.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7F);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let len = rest[..count]
            .iter()
            .fold(0usize, |len, &b| (len << 8) | usize::from(b));
        (len, &rest[count..])
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// The shape checks ring would otherwise make only at the first token.
fn check_public(algorithm: JwtAlgorithm, key: &[u8]) -> Result<(), String> {
    match algorithm {
        JwtAlgorithm::RS256 => {
            // RSAPublicKey ::= SEQUENCE { modulus INTEGER, publicExponent INTEGER }
            let modulus = der_element(key, 0x30)
                .and_then(|(body, _)| der_element(body, 0x02))
                .map(|(n, _)| n)
                .ok_or_else(|| "not an RSA public key".to_owned())?;
            rsa_size(modulus)
        }
        JwtAlgorithm::ES256 if key.len() != 65 || key[0] != 0x04 => {
            Err("not an uncompressed P-256 point".to_owned())
        }
        JwtAlgorithm::EdDSA if key.len() != 32 => Err("not a 32-byte Ed25519 key".to_owned()),
        _ => Ok(()),
    }
}

fn rsa_size(modulus: &[u8]) -> Result<(), String> {
    let significant = modulus.iter().skip_while(|&&b| b == 0).count();
    if significant * 8 < MIN_RSA_BITS {
        return Err(format!(
            "an RSA key needs at least {MIN_RSA_BITS} bits, this one has about {}",
            significant * 8
        ));
    }
    Ok(())
}

/// Every key of a JWK set file. A key of another type, curve or use is refused, not skipped:
/// an operator who rotates in a key sluice cannot use hears it at once.
fn jwks_file(
    path: &Spanned<std::path::PathBuf>,
    file: &Path,
    field: &str,
) -> Result<Vec<Key>, ConfigError> {
    let bytes = read(path, file, field)?;
    let resolved = crate::tls::resolve(file, &path.value);
    let unusable = |message: String| {
        ConfigError::invalid(
            file,
            Position::from(path),
            field,
            format!("{}: {message}", resolved.display()),
        )
    };
    parse_jwk_set(&bytes, Unusable::Refuse)
        .map(|(keys, _)| keys)
        .map_err(unusable)
}

/// What a JWK set does with a key sluice cannot verify with (another `use`, type, curve or
/// `alg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// A file's set is refused whole: its operator rotated in a key sluice cannot use and
    /// hears it at once.
    Refuse,
    /// A URL's set is the identity provider's, published for every client: an encryption
    /// key (Keycloak publishes an `RSA-OAEP` one beside its signing keys) or a type sluice
    /// does not verify is left out, and the set is refused only if no key is left.
    Skip,
}

/// Every key of the JWK set in `bytes`, and the keys left out (`Unusable::Skip`: their
/// index and why), or what is wrong with it: not JSON, no `keys`, a key sluice cannot use
/// (`Unusable::Refuse`), two keys of one kid, no usable key. The same reading for a file
/// and for a set fetched from a URL.
pub fn parse_jwk_set(bytes: &[u8], unusable: Unusable) -> Result<(Vec<Key>, Vec<String>), String> {
    let set: Value =
        serde_json::from_slice(bytes).map_err(|err| format!("not a JSON JWK set: {err}"))?;
    let keys = set
        .get("keys")
        .and_then(Value::as_array)
        .ok_or_else(|| "a JWK set is an object with a `keys` array".to_owned())?;
    let mut parsed: Vec<Key> = Vec::with_capacity(keys.len());
    let mut skipped = Vec::new();
    // The index in `keys` of each parsed key, for the message of a repeated kid.
    let mut indices: Vec<usize> = Vec::with_capacity(keys.len());
    for (index, jwk) in keys.iter().enumerate() {
        let key = match (jwk_key(jwk), unusable) {
            (Ok(key), _) => key,
            (Err(message), Unusable::Skip) => {
                skipped.push(format!("keys[{index}]: {message}"));
                continue;
            }
            (Err(message), Unusable::Refuse) => return Err(format!("keys[{index}]: {message}")),
        };
        // Two keys of one kid: a rotation that reused the kid would leave the first (usually
        // the old) key verifying every token that names it, the new one never.
        if let Some(kid) = key.kid.as_deref() {
            if let Some(first) = parsed.iter().position(|k| k.kid.as_deref() == Some(kid)) {
                return Err(format!(
                    "keys[{}] and keys[{index}] both have the `kid` `{kid}`: a token naming \
                     it could be checked against either; give each key its own kid (the last \
                     good keys keep serving)",
                    indices[first]
                ));
            }
        }
        indices.push(index);
        parsed.push(key);
    }
    if parsed.is_empty() {
        return Err(match skipped.as_slice() {
            [] => "the JWK set has no keys".to_owned(),
            _ => format!(
                "the JWK set has no key sluice can verify with ({})",
                skipped.join("; ")
            ),
        });
    }
    if parsed.len() > 1 && parsed.iter().any(|key| key.kid.is_none()) {
        return Err(
            "with several keys, each needs a `kid` (a token names the key it was signed with)"
                .to_owned(),
        );
    }
    Ok((parsed, skipped))
}

fn jwk_key(jwk: &Value) -> Result<Key, String> {
    let text = |name: &str| jwk.get(name).and_then(Value::as_str);
    let bytes = |name: &str| -> Result<Vec<u8>, String> {
        let value = text(name).ok_or_else(|| format!("no `{name}`"))?;
        super::base64url::base64url(value.as_bytes())
            .ok_or_else(|| format!("`{name}` is not base64url"))
    };
    if text("use").is_some_and(|u| u != "sig") {
        return Err("a key whose `use` is not `sig`".to_owned());
    }
    let (algorithm, material) = match (text("kty"), text("crv")) {
        (Some("RSA"), _) => {
            let n = bytes("n")?;
            rsa_size(&n)?;
            let strip = |v: Vec<u8>| v.into_iter().skip_while(|&b| b == 0).collect::<Vec<u8>>();
            let material = Material::RsaParts {
                n: strip(n),
                e: strip(bytes("e")?),
            };
            (JwtAlgorithm::RS256, material)
        }
        (Some("EC"), Some("P-256")) => {
            let (x, y) = (bytes("x")?, bytes("y")?);
            if x.len() != 32 || y.len() != 32 {
                return Err("a P-256 key's `x` and `y` are 32 bytes each".to_owned());
            }
            let mut point = Vec::with_capacity(65);
            point.push(0x04);
            point.extend_from_slice(&x);
            point.extend_from_slice(&y);
            (JwtAlgorithm::ES256, Material::Public(point))
        }
        (Some("OKP"), Some("Ed25519")) => {
            let x = bytes("x")?;
            check_public(JwtAlgorithm::EdDSA, &x)?;
            (JwtAlgorithm::EdDSA, Material::Public(x))
        }
        (Some("oct"), _) => (JwtAlgorithm::HS256, secret(&bytes("k")?)?),
        (kty, crv) => {
            return Err(format!(
                "unsupported key type {} (RSA, EC P-256, OKP Ed25519 or oct)",
                match (kty, crv) {
                    (Some(kty), Some(crv)) => format!("`{kty}` `{crv}`"),
                    (Some(kty), None) => format!("`{kty}`"),
                    _ => "(no `kty`)".to_owned(),
                }
            ))
        }
    };
    if let Some(alg) = text("alg") {
        if alg != algorithm.name() {
            return Err(format!(
                "`alg` is `{alg}`, but this key verifies {} only (RS256, ES256, EdDSA, HS256)",
                algorithm.name()
            ));
        }
    }
    Ok(Key {
        kid: text("kid").map(str::to_owned),
        algorithm,
        material,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spki_of_an_ed25519_key_splits() {
        // 302a300506032b6570032100 || 32 bytes
        let mut der = vec![
            0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
        ];
        der.extend_from_slice(&[7u8; 32]);
        let (algorithm, key) = split_spki(&der).expect("an SPKI");
        assert!(algorithm
            .windows(OID_ED25519.len())
            .any(|w| w == OID_ED25519));
        assert_eq!(key, &[7u8; 32]);
        assert!(split_spki(&der[..der.len() - 1]).is_none(), "truncated");
    }

    #[test]
    fn short_secrets_and_foreign_keys_are_refused() {
        assert!(secret(&[1u8; 31]).is_err());
        assert!(secret_file(b"0123456789abcdef0123456789abcdef\n").is_ok());
        assert!(secret_file(b"0123456789abcdef0123456789abcde\n").is_err());
        let jwk = serde_json::json!({"kty": "EC", "crv": "P-384", "x": "AA", "y": "AA"});
        assert!(jwk_key(&jwk).unwrap_err().contains("unsupported"));
        let jwk = serde_json::json!({"kty": "oct", "k": "AAAA", "alg": "HS256"});
        assert!(jwk_key(&jwk).unwrap_err().contains("32 bytes"));
    }
}
