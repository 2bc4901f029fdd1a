//! Hot reload: sluice watches its config file (`file_watch`) and the JWT key files it names
//! (an edit of a JWKS file alone reloads it), applying a change once it has stopped changing
//! (`reload.settle`; a version overwritten before that is counted and logged, never applied),
//! and also reloads on SIGHUP and on the admin API's request, at once. A new file is loaded completely, by the same function as at
//! start-up, before its policy replaces the running one in one atomic step; a file that is
//! invalid, or that changes what only a restart can apply (`Config::restart_change`: the
//! listeners, the `server:` section, where the store is), is refused whole, logged with its position, counted, and the old
//! policy keeps serving. How a version is loaded and put in force is the composition root's
//! (`app`, through `Versions`): this module knows when, not what serves.

use arc_swap::ArcSwap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

use crate::config::{self, Config, Source};
use crate::metrics::{Metrics, ReloadResult};
use crate::runtime::file_watch::FileWatch;

/// Why a new config file was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("{}: {change}: a restart is needed to apply it; nothing of this file was applied", file.display())]
    NeedsRestart { file: PathBuf, change: String },
}

/// The value of `sluice_config_hash`: the first 52 bits of the file's SHA-256, so that it is
/// exact in the float64 Prometheus stores, and equal to the first 13 hex digits of
/// `sha256sum FILE`.
pub fn hash_value(digest: &[u8; 32]) -> i64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(first) >> 12) as i64
}

/// The config file in force: what `/admin/v1/config` shows.
pub struct Serving {
    pub file: PathBuf,
    pub text: Arc<str>,
    pub digest: [u8; 32],
}

impl Serving {
    /// The SHA-256 of the file in force, as `sha256sum` prints it.
    pub fn sha256(&self) -> String {
        self.digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A reload that put a new file in force: the file's SHA-256, its hash gauge value and its
/// number of routes.
#[derive(Debug, Clone)]
pub struct Reloaded {
    pub sha256: String,
    pub config_hash: i64,
    pub routes: usize,
}

type Reply = oneshot::Sender<Result<Reloaded, ReloadError>>;

/// Asks the reloader to reload now, as SIGHUP does, and waits for the outcome (the admin
/// API's `POST /admin/v1/reload`).
#[derive(Clone)]
pub struct ReloadHandle {
    requests: mpsc::Sender<Reply>,
    serving: Arc<ArcSwap<Serving>>,
}

impl ReloadHandle {
    /// Reloads the file now; `None` when the reloader has stopped (shutting down).
    pub async fn reload(&self) -> Option<Result<Reloaded, ReloadError>> {
        let (reply, outcome) = oneshot::channel();
        self.requests.send(reply).await.ok()?;
        outcome.await.ok()
    }

    /// The config file in force now.
    pub fn serving(&self) -> Arc<Serving> {
        self.serving.load_full()
    }
}

/// How a version of the config file is loaded and put in force (`app` provides it).
pub trait Versions: Send + 'static {
    /// A version loaded whole, not yet in force.
    type Version: Send;

    /// Loads the version in `bytes`, the contents of `file`, completely: everything that can
    /// refuse it happens here, and it leaves nothing behind when refused.
    fn load(&mut self, bytes: &[u8], file: &Path) -> Result<Self::Version, config::ConfigError>;

    /// The parsed file of `version`.
    fn source(version: &Self::Version) -> &Source;

    /// Puts `version` in force for every request that starts from now on; gives back its
    /// parsed file and number of routes.
    fn put_in_force(&mut self, version: Self::Version) -> (Source, usize);
}

/// Watches the config file and puts each valid new version in force.
pub struct Reloader<V: Versions> {
    file: PathBuf,
    versions: V,
    metrics: Arc<Metrics>,
    /// The config the process started with: what only a restart can apply
    /// (`Config::restart_change`) is as it says.
    started: Config,
    /// The file, with the version last tried, applied or refused: a refused file is reported
    /// once, not at every poll, and is tried again only when it changes (or on SIGHUP).
    watched: FileWatch,
    /// The JWT key files the file in force names: a new version of one reloads the file.
    key_files: FileWatch,
    /// How long a changed file must read the same before it is applied (`reload.settle` of
    /// the file in force).
    settle: Duration,
    #[cfg(unix)]
    hangup: Option<tokio::signal::unix::Signal>,
    serving: Arc<ArcSwap<Serving>>,
    /// Taken by `run`.
    requests: Option<mpsc::Receiver<Reply>>,
    /// Kept to hand out `ReloadHandle`s.
    sender: mpsc::Sender<Reply>,
}

impl<V: Versions> Reloader<V> {
    /// `started` is the config the process runs with. Installs the SIGHUP handler now, so
    /// that a SIGHUP from this point on reloads instead of ending the process.
    pub fn new(file: &Path, started: Source, versions: V, metrics: Arc<Metrics>) -> Reloader<V> {
        metrics.config.config_hash.set(hash_value(&started.digest));
        let watched = FileWatch::new(vec![file.to_owned()], &[started.text.as_bytes()]);
        let key_files = key_watch(file, &started.config);
        let serving = Arc::new(ArcSwap::from_pointee(Serving {
            file: file.to_owned(),
            text: started.text,
            digest: started.digest,
        }));
        // Reloads asked for over the admin API wait their turn; a few queued is plenty.
        let (sender, requests) = mpsc::channel(4);
        let config = started.config;
        let settle = config.reload.settle.0;
        #[cfg(unix)]
        let hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(signal) => Some(signal),
            Err(err) => {
                tracing::warn!(error = %err, "cannot handle SIGHUP; the config file is still watched");
                None
            }
        };
        Reloader {
            file: file.to_owned(),
            versions,
            metrics,
            started: config,
            watched,
            key_files,
            settle,
            #[cfg(unix)]
            hangup,
            serving,
            requests: Some(requests),
            sender,
        }
    }

    /// A handle to ask for reloads and read the config in force.
    pub fn handle(&self) -> ReloadHandle {
        ReloadHandle {
            requests: self.sender.clone(),
            serving: Arc::clone(&self.serving),
        }
    }

    /// Polls the file and waits for SIGHUP until `stopping` turns true.
    pub async fn run(mut self, mut stopping: watch::Receiver<bool>) {
        let Some(mut requests) = self.requests.take() else {
            return;
        };
        let mut poll = FileWatch::ticker();
        loop {
            tokio::select! {
                _ = poll.tick() => self.poll(),
                () = self.hangup() => {
                    tracing::info!(file = %self.file.display(), "SIGHUP: reloading the config file");
                    let _ = self.reload_file();
                }
                Some(reply) = requests.recv() => {
                    tracing::info!(file = %self.file.display(), "admin API: reloading the config file");
                    let _ = reply.send(self.reload_file());
                }
                _ = stopping.changed() => return,
            }
        }
    }

    /// Reloads once the file's bytes differ from the ones last tried and have stopped
    /// changing (`reload.settle`).
    fn poll(&mut self) {
        let now = Instant::now();
        match self.watched.settled(self.settle, now) {
            Ok(look) => {
                if look.skipped {
                    self.skipped("the config file");
                }
                match look.settled.as_ref().and_then(|files| files.first()) {
                    Some(bytes) => {
                        let _ = self.reload(bytes);
                    }
                    // A key file's change reloads the config file as it is: not while
                    // that is being written.
                    None if !self.watched.settling() => self.poll_key_files(now),
                    None => {}
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "cannot read the config file");
            }
        }
    }

    /// Reloads the config file when a key file it names has a new version that has settled.
    fn poll_key_files(&mut self, now: Instant) {
        match self.key_files.settled(self.settle, now) {
            Ok(look) => {
                if look.skipped {
                    self.skipped("a JWT key or rate limit rule file");
                }
                if look.settled.is_some() {
                    tracing::info!(file = %self.file.display(), "a JWT key or rate limit rule file changed: reloading the config file");
                    let _ = self.reload_file();
                }
            }
            Err(err) => {
                tracing::debug!(error = %err, "cannot read a JWT key or rate limit rule file");
            }
        }
    }

    /// A version of `what` that changed again before it settled: counted and logged, never
    /// applied.
    fn skipped(&self, what: &str) {
        self.metrics.config.config_versions_skipped.inc();
        tracing::warn!(
            file = %self.file.display(),
            settle = ?self.settle,
            "{what} changed again within reload.settle of being read: the version read before \
             was not applied (still being written?). Write a temp file and rename it over the \
             path, so that each version appears whole"
        );
    }

    async fn hangup(&mut self) {
        #[cfg(unix)]
        if let Some(signal) = &mut self.hangup {
            if signal.recv().await.is_some() {
                return;
            }
        }
        std::future::pending::<()>().await;
    }

    /// Reads the file and reloads it whatever its bytes (SIGHUP, the admin API).
    fn reload_file(&mut self) -> Result<Reloaded, ReloadError> {
        match std::fs::read(&self.file) {
            Ok(bytes) => self.reload(&bytes),
            Err(err) => {
                let err = ReloadError::from(config::read_error(&self.file, err));
                self.refused(&err);
                Err(err)
            }
        }
    }

    fn reload(&mut self, bytes: &[u8]) -> Result<Reloaded, ReloadError> {
        match self.put_in_force(bytes) {
            Ok(reloaded) => {
                self.metrics
                    .config
                    .config_reloads
                    .with_label_values(&[ReloadResult::Ok.label()])
                    .inc();
                tracing::info!(file = %self.file.display(), routes = reloaded.routes, "config reloaded");
                Ok(reloaded)
            }
            Err(err) => {
                self.refused(&err);
                Err(err)
            }
        }
    }

    fn refused(&self, err: &ReloadError) {
        self.metrics
            .config
            .config_reloads
            .with_label_values(&[ReloadResult::Error.label()])
            .inc();
        tracing::error!("config reload refused; the old policy keeps serving: {err}");
    }

    /// Loads `bytes` completely, as at start-up, checks that nothing in it needs a restart,
    /// then puts it in force.
    fn put_in_force(&mut self, bytes: &[u8]) -> Result<Reloaded, ReloadError> {
        self.watched.saw(&[bytes]);
        let version = self.versions.load(bytes, &self.file)?;
        if let Some(change) = self.started.restart_change(&V::source(&version).config) {
            return Err(ReloadError::NeedsRestart {
                file: self.file.clone(),
                change,
            });
        }
        let (source, routes) = self.versions.put_in_force(version);
        self.key_files = key_watch(&self.file, &source.config);
        self.settle = source.config.reload.settle.0;
        let config_hash = hash_value(&source.digest);
        self.metrics.config.config_hash.set(config_hash);
        let serving = Serving {
            file: self.file.clone(),
            text: source.text,
            digest: source.digest,
        };
        let sha256 = serving.sha256();
        self.serving.store(Arc::new(serving));
        Ok(Reloaded {
            sha256,
            config_hash,
            routes,
        })
    }
}

/// A watch of the JWT key files `config` (the contents of `file`) names, as they are now.
fn key_watch(file: &Path, config: &Config) -> FileWatch {
    let mut paths = crate::jwt::key_files(&config.jwt, file);
    // The rate limit service's rule files reload the config file the same way.
    paths.extend(crate::rls::files(config, file));
    let bytes: Vec<Vec<u8>> = paths
        .iter()
        .map(|path| std::fs::read(path).unwrap_or_default())
        .collect();
    let seen: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    FileWatch::new(paths, &seen)
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn the_hash_is_the_first_13_hex_digits_of_the_sha256() {
        // sha256("") = e3b0c44298fc1c149afbf4c8996fb924...
        let digest: [u8; 32] = Sha256::digest(b"").into();
        assert_eq!(hash_value(&digest), 0xe3b0c44298fc1);
    }
}
