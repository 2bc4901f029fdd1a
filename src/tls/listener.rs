//! A listener's TLS (the gateway's `tls:` and `rls.tls`): an acceptor offering ALPN `h2` and
//! `http/1.1`, whose certificate — and, with `client_ca` (mutual TLS), the CAs that client
//! certificates are verified against — are swapped in place when their files change. The
//! rustls config stays the same; only the certificate it resolves and the verifier it asks
//! for each new handshake change, so open connections (which finished their handshake with
//! the old ones) go on undisturbed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus::IntCounterVec;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use super::files::{self, PairBytes, TlsFileError};
use crate::config::{ConfigError, ListenerTlsConfig, Position, Spanned};
use crate::runtime::file_watch::FileWatch;

/// The certificate new handshakes get.
#[derive(Debug)]
struct Rotating(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Rotating {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// The verifier of client certificates new handshakes get (mutual TLS): one built from the
/// `client_ca` bundle in force, swapped when the bundle changes.
#[derive(Debug)]
struct RotatingClientCa(ArcSwap<Arc<dyn ClientCertVerifier>>);

impl ClientCertVerifier for RotatingClientCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    /// No names of acceptable CAs in the certificate request: they would have to outlive a
    /// swap of the bundle. The list is advisory (RFC 8446 §4.2.4); clients send the
    /// certificate they are configured with, and it is verified against the bundle in force.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0
            .load()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.load().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.load().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.load().supported_verify_schemes()
    }
}

/// A verifier requiring a client certificate that chains to a CA of the `client_ca` bundle
/// at `path` (its bytes `pem`).
fn client_verifier(path: &Path, pem: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, TlsFileError> {
    let roots = files::roots(path, pem)?;
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), super::provider())
        .build()
        .map_err(|err| TlsFileError::Unusable {
            path: path.to_owned(),
            detail: format!("cannot verify client certificates with these CAs: {err}"),
        })
}

/// The listener's TLS, loaded and checked.
pub struct ListenerTls {
    acceptor: TlsAcceptor,
    current: Arc<Rotating>,
    cert: PathBuf,
    key: PathBuf,
    /// With `client_ca`: its file and the verifier new handshakes get.
    client_ca: Option<(PathBuf, Arc<RotatingClientCa>)>,
    /// The certificate and key files (and the client CA bundle), with the version last
    /// tried, loaded or refused: a refused version is reported once, and tried again when
    /// any of them changes.
    files: FileWatch,
    /// Whether the last poll could not read the files: reported once, not at every poll.
    unreadable: bool,
}

impl ListenerTls {
    /// Reads the files `tls:` names (relative to `file`, the config) and builds the acceptor;
    /// an error points at the `tls.cert`, `tls.key` or `tls.client_ca` field to fix.
    pub fn load(tls: &Spanned<ListenerTlsConfig>, file: &Path) -> Result<ListenerTls, ConfigError> {
        let cert = super::resolve(file, &tls.value.cert.value);
        let key = super::resolve(file, &tls.value.key.value);
        let client_ca = tls.value.client_ca.as_ref();
        let ca_path = client_ca.map(|ca| super::resolve(file, &ca.value));
        let at_field = |err: TlsFileError| {
            let (field, position) = match (&err, client_ca) {
                (
                    TlsFileError::Read { path, .. }
                    | TlsFileError::Pem { path, .. }
                    | TlsFileError::NoCertificate { path }
                    | TlsFileError::Unusable { path, .. },
                    Some(ca),
                ) if Some(path) == ca_path.as_ref() => ("tls.client_ca", Position::from(ca)),
                _ => match &err {
                    TlsFileError::Read { path, .. }
                    | TlsFileError::Pem { path, .. }
                    | TlsFileError::NoKey { path }
                    | TlsFileError::Unusable { path, .. }
                        if *path == key && key != cert =>
                    {
                        ("tls.key", Position::from(&tls.value.key))
                    }
                    TlsFileError::KeyMismatch { .. } => ("tls.key", Position::from(&tls.value.key)),
                    _ => ("tls.cert", Position::from(&tls.value.cert)),
                },
            };
            ConfigError::invalid(file, position, field, err.to_string())
        };
        let bytes = PairBytes::read(&cert, &key).map_err(at_field)?;
        let certified = files::certified_key(&cert, &key, &bytes).map_err(at_field)?;
        let current = Arc::new(Rotating(ArcSwap::new(certified)));
        let mut paths = vec![cert.clone(), key.clone()];
        let mut seen = vec![bytes.cert.as_slice(), bytes.key.as_slice()];
        let ca_bytes;
        let builder = ServerConfig::builder_with_provider(super::provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| {
                ConfigError::invalid(file, Position::from(tls), "tls", err.to_string())
            })?;
        let (builder, client_ca) = match ca_path.clone() {
            None => (builder.with_no_client_auth(), None),
            Some(path) => {
                ca_bytes = files::read(&path).map_err(at_field)?;
                let verifier = client_verifier(&path, &ca_bytes).map_err(at_field)?;
                let rotating = Arc::new(RotatingClientCa(ArcSwap::from_pointee(verifier)));
                paths.push(path.clone());
                seen.push(&ca_bytes);
                let builder =
                    builder.with_client_cert_verifier(
                        Arc::clone(&rotating) as Arc<dyn ClientCertVerifier>
                    );
                (builder, Some((path, rotating)))
            }
        };
        let mut config =
            builder.with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        // h2 first: a client that speaks both gets HTTP/2.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(ListenerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            files: FileWatch::new(paths, &seen),
            client_ca,
            unreadable: false,
            cert,
            key,
        })
    }

    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// Watches the certificate, key and client CA files until `stopping` turns true. A valid
    /// new version serves every handshake from then on; an unreadable, unparsable or
    /// mismatched one is logged and counted in `reloads` (`sluice_tls_cert_reloads_total`)
    /// and the old one keeps serving, certificate and CA together.
    pub async fn watch(mut self, reloads: IntCounterVec, mut stopping: watch::Receiver<bool>) {
        let mut poll = FileWatch::ticker();
        loop {
            tokio::select! {
                _ = poll.tick() => self.poll(&reloads),
                _ = stopping.changed() => return,
            }
        }
    }

    /// Loads the pair (and the client CA bundle) if their bytes changed.
    fn poll(&mut self, reloads: &IntCounterVec) {
        let (bytes, ca) = match self.files.changed() {
            // The paths watched, so as many files read: cert, key, and the CA with one.
            Ok(Some(mut files)) => {
                let ca = match (&self.client_ca, files.len()) {
                    (Some(_), 3) => files.pop(),
                    (None, 2) => None,
                    _ => return,
                };
                let (Some(key), Some(cert)) = (files.pop(), files.pop()) else {
                    return;
                };
                (PairBytes { cert, key }, ca)
            }
            Ok(None) => {
                self.unreadable = false;
                return;
            }
            Err(err) => {
                if !self.unreadable {
                    tracing::warn!(error = %err, "cannot read the TLS certificate; the old one keeps serving");
                }
                self.unreadable = true;
                return;
            }
        };
        self.unreadable = false;
        let verifier = match (&self.client_ca, &ca) {
            (Some((path, _)), Some(pem)) => client_verifier(path, pem).map(Some),
            _ => Ok(None),
        };
        match verifier.and_then(|verifier| {
            files::certified_key(&self.cert, &self.key, &bytes).map(|key| (key, verifier))
        }) {
            Ok((certified, verifier)) => {
                self.current.0.store(certified);
                if let (Some((_, rotating)), Some(verifier)) = (&self.client_ca, verifier) {
                    rotating.0.store(Arc::new(verifier));
                }
                reloads.with_label_values(&["ok"]).inc();
                tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded; new handshakes use it");
            }
            Err(err) => {
                reloads.with_label_values(&["error"]).inc();
                tracing::error!(error = %err, "new TLS certificate refused; the old one keeps serving");
            }
        }
    }
}
