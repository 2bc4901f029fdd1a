//! The gateway listener's TLS: an acceptor offering ALPN `h2` and `http/1.1`, whose
//! certificate is swapped in place when its files change. The rustls config stays the same;
//! only the certificate it resolves for each new handshake changes, so open connections (which
//! finished their handshake with the old one) go on undisturbed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus::IntCounterVec;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
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

/// The listener's TLS, loaded and checked.
pub struct ListenerTls {
    acceptor: TlsAcceptor,
    current: Arc<Rotating>,
    cert: PathBuf,
    key: PathBuf,
    /// The certificate and key files, with the version last tried, loaded or refused: a
    /// refused pair is reported once, and tried again when either file changes.
    files: FileWatch,
    /// Whether the last poll could not read the files: reported once, not at every poll.
    unreadable: bool,
}

impl ListenerTls {
    /// Reads the files `tls:` names (relative to `file`, the config) and builds the acceptor;
    /// an error points at the `tls.cert` or `tls.key` field to fix.
    pub fn load(tls: &Spanned<ListenerTlsConfig>, file: &Path) -> Result<ListenerTls, ConfigError> {
        let cert = super::resolve(file, &tls.value.cert.value);
        let key = super::resolve(file, &tls.value.key.value);
        let at_field = |err: TlsFileError| {
            let (field, position) = match &err {
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
            };
            ConfigError::invalid(file, position, field, err.to_string())
        };
        let bytes = PairBytes::read(&cert, &key).map_err(at_field)?;
        let certified = files::certified_key(&cert, &key, &bytes).map_err(at_field)?;
        let current = Arc::new(Rotating(ArcSwap::new(certified)));
        let mut config = ServerConfig::builder_with_provider(super::provider())
            .with_safe_default_protocol_versions()
            .map_err(|err| ConfigError::invalid(file, Position::from(tls), "tls", err.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(&current) as Arc<dyn ResolvesServerCert>);
        // h2 first: a client that speaks both gets HTTP/2.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(ListenerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            current,
            files: FileWatch::new(vec![cert.clone(), key.clone()], &[&bytes.cert, &bytes.key]),
            unreadable: false,
            cert,
            key,
        })
    }

    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.clone()
    }

    /// Watches the certificate and key files until `stopping` turns true. A valid new pair
    /// serves every handshake from then on; an unreadable, unparsable or mismatched one is
    /// logged and counted in `reloads` (`sluice_tls_cert_reloads_total`) and the old pair
    /// keeps serving.
    pub async fn watch(mut self, reloads: IntCounterVec, mut stopping: watch::Receiver<bool>) {
        let mut poll = FileWatch::ticker();
        loop {
            tokio::select! {
                _ = poll.tick() => self.poll(&reloads),
                _ = stopping.changed() => return,
            }
        }
    }

    /// Loads the pair if its bytes changed.
    fn poll(&mut self, reloads: &IntCounterVec) {
        let bytes = match self.files.changed() {
            // Two paths watched, so two files read.
            Ok(Some(files)) => match <[Vec<u8>; 2]>::try_from(files) {
                Ok([cert, key]) => PairBytes { cert, key },
                Err(_) => return,
            },
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
        match files::certified_key(&self.cert, &self.key, &bytes) {
            Ok(certified) => {
                self.current.0.store(certified);
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
