//! The gateway listener's TLS: an acceptor offering ALPN `h2` and `http/1.1`, whose
//! certificate is swapped in place when its files change. The rustls config stays the same;
//! only the certificate it resolves for each new handshake changes, so open connections (which
//! finished their handshake with the old one) go on undisturbed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus::IntCounterVec;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use super::files::{self, PairBytes, TlsFileError};
use crate::config::{ConfigError, ListenerTlsConfig, Position, Spanned};

/// How often the certificate and key files are looked at: as often as the config file (see
/// `reload::POLL_INTERVAL`), for the same reasons (renames over the path, no watcher needed).
pub const POLL_INTERVAL: Duration = crate::reload::POLL_INTERVAL;

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
    /// The SHA-256 of the certificate and key bytes last tried, loaded or refused: a refused
    /// pair is reported once, and tried again when either file changes.
    last_seen: [u8; 32],
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
            last_seen: digest(&bytes),
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
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = poll.tick() => self.poll(&reloads),
                _ = stopping.changed() => return,
            }
        }
    }

    /// Loads the pair if its bytes changed. The reads block the thread briefly, as the config
    /// poll's do: two local files of a few kilobytes.
    fn poll(&mut self, reloads: &IntCounterVec) {
        let bytes = match PairBytes::read(&self.cert, &self.key) {
            Ok(bytes) => bytes,
            // Briefly missing while a tool replaces the files: not a new version yet.
            Err(TlsFileError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return
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
        let seen = digest(&bytes);
        if seen == self.last_seen {
            return;
        }
        self.last_seen = seen;
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

fn digest(bytes: &PairBytes) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update((bytes.cert.len() as u64).to_be_bytes());
    hash.update(&bytes.cert);
    hash.update(&bytes.key);
    hash.finalize().into()
}
