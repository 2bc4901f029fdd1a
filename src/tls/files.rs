//! Reading certificates and keys from PEM files, with errors that say which file and what is
//! wrong with it in words an operator can act on.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

/// Why a certificate, key or CA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not valid PEM: {detail}", path.display())]
    Pem { path: PathBuf, detail: String },
    #[error("{}: no PEM `CERTIFICATE` section", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{}: no PEM private key (`PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`)", path.display())]
    NoKey { path: PathBuf },
    #[error("{}: {detail}", path.display())]
    Unusable { path: PathBuf, detail: String },
    #[error("the key in {} does not belong to the certificate in {}", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
}

/// A certificate chain and its key, as bytes read from their files (kept to notice changes).
pub struct PairBytes {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
}

pub fn read(path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError::Read {
        path: path.to_owned(),
        source,
    })
}

impl PairBytes {
    pub fn read(cert: &Path, key: &Path) -> Result<PairBytes, TlsFileError> {
        Ok(PairBytes {
            cert: read(cert)?,
            key: read(key)?,
        })
    }
}

/// Every `CERTIFICATE` section of `pem`, in file order; at least one.
pub fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| TlsFileError::Pem {
            path: path.to_owned(),
            detail: err.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsFileError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The first private key of `pem`: PKCS#8, PKCS#1 (RSA) or SEC1 (EC).
pub fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsFileError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|err| match err {
        rustls::pki_types::pem::Error::NoItemsFound => TlsFileError::NoKey {
            path: path.to_owned(),
        },
        err => TlsFileError::Pem {
            path: path.to_owned(),
            detail: err.to_string(),
        },
    })
}

/// A chain and its key, checked to belong together, ready to sign handshakes.
pub fn certified_key(
    cert_path: &Path,
    key_path: &Path,
    bytes: &PairBytes,
) -> Result<Arc<CertifiedKey>, TlsFileError> {
    let chain = certificates(cert_path, &bytes.cert)?;
    let key = private_key(key_path, &bytes.key)?;
    let provider = super::provider();
    let signing =
        provider
            .key_provider
            .load_private_key(key)
            .map_err(|err| TlsFileError::Unusable {
                path: key_path.to_owned(),
                detail: format!("unusable private key: {err}"),
            })?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) => Ok(Arc::new(certified)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(TlsFileError::KeyMismatch {
                cert: cert_path.to_owned(),
                key: key_path.to_owned(),
            })
        }
        // A key whose public half the provider cannot show (none of ring's): nothing to compare.
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok(Arc::new(certified))
        }
        Err(err) => Err(TlsFileError::Unusable {
            path: cert_path.to_owned(),
            detail: format!("the first certificate cannot be parsed: {err}"),
        }),
    }
}

/// The CAs of a PEM bundle; each must parse.
pub fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsFileError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path, pem)? {
        store.add(cert).map_err(|err| TlsFileError::Unusable {
            path: path.to_owned(),
            detail: format!("a CA certificate cannot be used: {err}"),
        })?;
    }
    Ok(store)
}
