//! TLS with rustls: the gateway listener's certificate (rotated when its files change), the
//! client settings of `https://` upstreams (trusted CAs, a client certificate for mTLS), and
//! reading the PEM files both use. One crypto provider, `ring`, is named explicitly everywhere,
//! so no process-wide default has to be installed and no C toolchain beyond cc is needed.

mod files;
pub mod listener;
pub mod stream;
pub mod upstream;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;

pub use files::TlsFileError;
pub use listener::ListenerTls;
pub use upstream::{UpstreamTls, UpstreamTlsSet};

/// Marks a request that arrived over TLS (a request extension set by `server`), so that the
/// upstream is told `X-Forwarded-Proto: https`.
#[derive(Debug, Clone, Copy)]
pub struct ClientTls;

/// The crypto provider of every TLS config sluice builds.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// `path` as written in the config file at `config_file`: a relative path is relative to the
/// file's directory, so a config and its certificates can move together.
pub fn resolve(config_file: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        return path.to_owned();
    }
    match config_file.parent() {
        Some(dir) => dir.join(path),
        None => path.to_owned(),
    }
}
