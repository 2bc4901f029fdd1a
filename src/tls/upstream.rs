//! Client TLS for `https://` upstreams: which CAs are trusted (the Mozilla roots built into
//! sluice, or the upstream's `ca_file`), and the client certificate presented for mTLS. The
//! host name of the upstream URL is sent as SNI and must be in the upstream's certificate.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};
use sha2::{Digest, Sha256};

use super::files::{self, PairBytes, TlsFileError};
use crate::config::{ConfigError, Name, Position, Spanned, UpstreamConfig};

/// The TLS client settings of one https upstream, built from its files when a config version
/// is loaded, before its policy is compiled (so `sluice check` and a reload refuse a bad
/// file before anything serves).
pub struct UpstreamTls {
    pub config: Arc<ClientConfig>,
    /// The SHA-256 of the settings and file contents: the client registry builds a new client
    /// (and pool) when it changes, and keeps the old one when it does not.
    pub fingerprint: [u8; 32],
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("alpn", &self.config.alpn_protocols)
            .finish_non_exhaustive()
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        self.fingerprint == other.fingerprint
    }
}

impl Eq for UpstreamTls {}

/// The TLS settings of every https upstream of one config, by upstream name: what compiling
/// its policy needs from the files the config names.
#[derive(Debug, Default)]
pub struct UpstreamTlsSet(HashMap<Name, Arc<UpstreamTls>>);

impl UpstreamTlsSet {
    /// Reads and checks the files of every upstream (relative to `file`, the config); the
    /// first error points at the field to fix.
    pub fn load(
        upstreams: &BTreeMap<Name, UpstreamConfig>,
        file: &Path,
    ) -> Result<UpstreamTlsSet, ConfigError> {
        let mut set = HashMap::new();
        for (name, upstream) in upstreams {
            if let Some(tls) = UpstreamTls::from_config(name, upstream, file)? {
                set.insert(name.clone(), Arc::new(tls));
            }
        }
        Ok(UpstreamTlsSet(set))
    }

    /// The settings of upstream `name`; `None` for an `http://` one.
    pub fn get(&self, name: &Name) -> Option<Arc<UpstreamTls>> {
        self.0.get(name).cloned()
    }
}

impl UpstreamTls {
    /// The TLS settings of upstream `name`: `None` for an `http://` one (which may then set
    /// none of `ca_file`, `client_cert`, `client_key`). Errors point at the field to fix.
    pub fn from_config(
        name: &Name,
        upstream: &UpstreamConfig,
        file: &Path,
    ) -> Result<Option<UpstreamTls>, ConfigError> {
        let field = |key: &str| format!("upstreams.{name}.{key}");
        let invalid = |key: &str, at: &Spanned<std::path::PathBuf>, message: String| {
            ConfigError::invalid(file, Position::from(at), field(key), message)
        };
        let named = [
            ("ca_file", &upstream.ca_file),
            ("client_cert", &upstream.client_cert),
            ("client_key", &upstream.client_key),
        ];
        if !upstream.url.https {
            if let Some((key, Some(at))) = named.iter().find(|(_, v)| v.is_some()) {
                return Err(invalid(
                    key,
                    at,
                    "only an https:// upstream uses TLS settings; this upstream's url is http://"
                        .to_owned(),
                ));
            }
            return Ok(None);
        }
        let mut fingerprint = Sha256::new();
        let roots = roots(upstream.ca_file.as_ref(), file, &mut fingerprint)
            .map_err(|(at, message)| invalid("ca_file", at, message))?;
        let builder = ClientConfig::builder_with_provider(super::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| {
                ConfigError::invalid(file, Position::default(), field("url"), e.to_string())
            })?
            .with_root_certificates(roots);
        let config = match (&upstream.client_cert, &upstream.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let (cert_path, key_path) = (
                    super::resolve(file, &cert.value),
                    super::resolve(file, &key.value),
                );
                let bytes = PairBytes::read(&cert_path, &key_path).map_err(|e| match &e {
                    TlsFileError::Read { path, .. } if *path == key_path => {
                        invalid("client_key", key, e.to_string())
                    }
                    _ => invalid("client_cert", cert, e.to_string()),
                })?;
                // Checked here, with the same reading as the listener's pair, so a mismatch
                // is reported at the config rather than as a failed handshake later.
                files::certified_key(&cert_path, &key_path, &bytes).map_err(|e| match &e {
                    TlsFileError::NoKey { .. } | TlsFileError::KeyMismatch { .. } => {
                        invalid("client_key", key, e.to_string())
                    }
                    TlsFileError::Pem { path, .. } | TlsFileError::Unusable { path, .. }
                        if *path == key_path =>
                    {
                        invalid("client_key", key, e.to_string())
                    }
                    _ => invalid("client_cert", cert, e.to_string()),
                })?;
                fingerprint.update(b"client");
                fingerprint.update(Sha256::digest(&bytes.cert));
                fingerprint.update(Sha256::digest(&bytes.key));
                let chain = files::certificates(&cert_path, &bytes.cert)
                    .map_err(|e| invalid("client_cert", cert, e.to_string()))?;
                let private = files::private_key(&key_path, &bytes.key)
                    .map_err(|e| invalid("client_key", key, e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| invalid("client_key", key, e.to_string()))?
            }
            (Some(cert), None) => {
                return Err(invalid(
                    "client_cert",
                    cert,
                    "`client_cert` needs `client_key`, the certificate's private key".to_owned(),
                ))
            }
            (None, Some(key)) => {
                return Err(invalid(
                    "client_key",
                    key,
                    "`client_key` needs `client_cert`, the certificate it belongs to".to_owned(),
                ))
            }
        };
        Ok(Some(UpstreamTls {
            config: Arc::new(config),
            fingerprint: fingerprint.finalize().into(),
        }))
    }
}

/// The roots `ca` names (a PEM file relative to `file`), or the built-in ones; their
/// contents added to `fingerprint`. An error: the field's position and what is wrong.
fn roots<'a>(
    ca: Option<&'a Spanned<std::path::PathBuf>>,
    file: &Path,
    fingerprint: &mut Sha256,
) -> Result<RootCertStore, (&'a Spanned<std::path::PathBuf>, String)> {
    match ca {
        Some(ca) => {
            let path = super::resolve(file, &ca.value);
            let pem = files::read(&path).map_err(|e| (ca, e.to_string()))?;
            fingerprint.update(b"ca");
            fingerprint.update(Sha256::digest(&pem));
            files::roots(&path, &pem).map_err(|e| (ca, e.to_string()))
        }
        None => {
            fingerprint.update(b"builtin");
            Ok(builtin_roots())
        }
    }
}

/// The client config of a fetch sluice makes itself (a verifier's `jwks_url`): the same
/// trust as an upstream's (`ca_file`, else the built-in Mozilla roots), no client
/// certificate, HTTP/1.1 through ALPN; and its fingerprint. `field` names the CA setting in
/// errors.
pub fn fetch_client(
    ca: Option<&Spanned<std::path::PathBuf>>,
    file: &Path,
    field: &str,
) -> Result<(Arc<ClientConfig>, [u8; 32]), ConfigError> {
    let mut fingerprint = Sha256::new();
    let roots = roots(ca, file, &mut fingerprint)
        .map_err(|(at, message)| ConfigError::invalid(file, Position::from(at), field, message))?;
    let mut config = ClientConfig::builder_with_provider(super::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::invalid(file, Position::default(), field, e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(config), fingerprint.finalize().into()))
}

/// The Mozilla root CAs compiled into sluice (webpki-roots): the same set wherever sluice
/// runs, with or without a CA bundle in the image.
fn builtin_roots() -> RootCertStore {
    RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

/// The client config of one https upstream's connections: its own (roots, client
/// certificate) with the one protocol sluice speaks to it offered through ALPN, `h2` for an
/// `http2: true` upstream, `http/1.1` otherwise. Built once per upstream client.
pub fn client_config(tls: &UpstreamTls, http2: bool) -> Arc<ClientConfig> {
    let mut config = (*tls.config).clone();
    config.alpn_protocols = vec![if http2 {
        b"h2".to_vec()
    } else {
        b"http/1.1".to_vec()
    }];
    Arc::new(config)
}

/// Whether `err` is, or was caused by, a TLS failure. Under TLS 1.3 a server checks the client
/// certificate after the client has finished its side of the handshake, so a refused (or
/// missing) client certificate arrives as an alert on the first read of the response rather
/// than from the connector; it is still the handshake that failed.
pub fn is_tls_failure(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(err) = current {
        if err.is::<rustls::Error>() {
            return true;
        }
        // `io::Error::source` skips the error it wraps; `get_ref` is the way to it.
        let wrapped = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref());
        if wrapped.is_some_and(|inner| inner.is::<rustls::Error>()) {
            return true;
        }
        current = err.source();
    }
    false
}
