//! A version of the config file sluice could serve: the file parsed (past its mistakes, to
//! report them all), the TLS and JWT key files it names read, its policy and rate limit
//! service rules compiled. `run`, `check`, a reload and `explain` all take their version from
//! [`version`], so none of them can accept a file another would refuse.

use std::path::Path;

use crate::config::{self, ConfigError, Source};
use crate::jwt::Verifiers;
use crate::policy::Compiled;
use crate::tls::{ListenerTls, UpstreamTlsSet};

/// One version of the config file, ready to be put in force: parsed, its policy compiled,
/// the TLS files it names read and checked.
pub struct Version {
    pub source: Source,
    /// Without its metric handles: attached by whoever puts it in force.
    pub policy: Compiled,
    /// The listener's certificate and key, when `tls:` names them and they were asked for.
    pub listener_tls: Option<ListenerTls>,
    /// The JWT verifiers the policy's routes hold: kept to start the `jwks_url` fetches of
    /// the version put in force (`check` and `explain` fetch nothing).
    pub verifiers: Verifiers,
    /// The rate limit service's rules (`rls:`), read with the version.
    pub rls: Option<crate::rls::Compiled>,
    /// `rls.tls`'s certificate and key, read when the listener's are.
    pub rls_tls: Option<ListenerTls>,
}

/// Whether a version reads the listener's certificate files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerFiles {
    /// `run` and `check`: the listener is made from this version.
    Read,
    /// A reload (the listener's files are fixed at start and rotated by their own watch) and
    /// `explain` (it serves nothing).
    Skip,
}

/// The version in the file at `file`, read now.
pub fn load(file: &Path, listener: ListenerFiles) -> Result<Version, ConfigError> {
    let bytes = std::fs::read(file).map_err(|err| config::read_error(file, err))?;
    version(&bytes, file, listener)
}

/// The version in `bytes`, the contents of `file` (which names it in errors and anchors the
/// relative paths it holds). Creates no metric series and no client: a refused file leaves
/// nothing behind.
pub fn version(bytes: &[u8], file: &Path, listener: ListenerFiles) -> Result<Version, ConfigError> {
    // Read past its mistakes and checked on, so that one reading reports every one; then
    // refused whole if it has any.
    let (source, mistakes) = config::read_bytes(bytes, file)?;
    let checked = checked_version(source, file, listener);
    if mistakes.is_empty() {
        return checked;
    }
    Err(ConfigError::with_later(mistakes, checked.err()))
}

/// The checks and files of a version after its policy file has been read.
fn checked_version(
    source: config::Source,
    file: &Path,
    listener: ListenerFiles,
) -> Result<Version, ConfigError> {
    let upstream_tls = UpstreamTlsSet::load(&source.config.upstreams, file)?;
    // The JWT key files are read with the policy: a reload picks up a rotated key, and a
    // key file that cannot be used refuses the version whole.
    let verifiers = Verifiers::load(&source.config.jwt, file)?;
    let policy = Compiled::compile(&source.config, file, &upstream_tls, &verifiers)?;
    let rls = crate::rls::Compiled::load(&source.config, file)?;
    let rls_tls = match (&source.config.rls, listener) {
        (Some(section), ListenerFiles::Read) => match &section.value.tls {
            Some(tls) => Some(ListenerTls::load(tls, file).map_err(rls_tls_field)?),
            None => None,
        },
        _ => None,
    };
    let listener_tls = match (&source.config.tls, listener) {
        (Some(tls), ListenerFiles::Read) => Some(ListenerTls::load(tls, file)?),
        _ => None,
    };
    Ok(Version {
        source,
        policy,
        listener_tls,
        verifiers,
        rls,
        rls_tls,
    })
}

/// An error of `rls.tls`'s files, named as the field it is (`ListenerTls` names `tls.*`).
fn rls_tls_field(err: ConfigError) -> ConfigError {
    match err {
        ConfigError::Invalid {
            file,
            position,
            field,
            message,
        } => ConfigError::Invalid {
            file,
            position,
            field: format!("rls.{field}"),
            message,
        },
        other => other,
    }
}
