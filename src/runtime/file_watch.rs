//! Watching files for a new version by reading them: the one poll loop behind the config
//! reload (`reload`) and the listener certificate's rotation (`tls::listener`). Editors and
//! certificate tools replace a file by writing a new one and renaming it over the path, so
//! the path is read again at each look rather than an inode watched; the files are a few
//! kilobytes, so reading and hashing them four times a second costs nothing and needs no
//! watcher dependency. The config reload also waits for a new version to settle
//! (`FileWatch::settled`): a file written in several steps can be valid YAML half-way
//! (a route cut before its limits), so a version is applied only once it has read the same
//! for a while.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};

/// How often the watched files are looked at. A change takes effect within this interval
/// plus the time to check the new version.
pub const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// A file that could not be read, other than one briefly missing.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {}: {source}", path.display())]
pub struct Unreadable {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// A set of files read together (a certificate and its key; a config file) and the digest
/// of the bytes last seen, so that each version is handled once.
pub struct FileWatch {
    paths: Vec<PathBuf>,
    last_seen: [u8; 32],
    /// A new version read but not yet settled (`settled` only).
    pending: Option<Pending>,
}

/// A version read at `since` and the same at every look since: its digest, and each file's
/// size and modification time (a rewrite with the same bytes starts the wait again).
struct Pending {
    digest: [u8; 32],
    stamps: Vec<(u64, Option<SystemTime>)>,
    since: Instant,
}

/// What one look at settling files found.
#[derive(Debug, PartialEq, Eq)]
pub struct Look {
    /// The new version, once it has read the same for the settle period: apply it.
    pub settled: Option<Vec<Vec<u8>>>,
    /// A version read at an earlier look changed before it settled: it is never applied.
    pub skipped: bool,
}

impl FileWatch {
    /// Watches `paths`, whose current version is `seen` (the bytes of each, in order):
    /// those bytes are not a change.
    pub fn new(paths: Vec<PathBuf>, seen: &[&[u8]]) -> FileWatch {
        FileWatch {
            paths,
            last_seen: digest(seen),
            pending: None,
        }
    }

    /// A tick of `POLL_INTERVAL` for the caller's loop; a late tick is not made up for.
    pub fn ticker() -> tokio::time::Interval {
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll
    }

    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Reads every file: their bytes when they differ from the version last seen (which they
    /// then become), `None` when they do not. A file that does not exist is not a new
    /// version either: a tool that deletes and then writes leaves it missing briefly, and the
    /// next look sees what it became. The reads block the thread briefly: local files of a
    /// few kilobytes, no worse than a page-cache hit.
    pub fn changed(&mut self) -> Result<Option<Vec<Vec<u8>>>, Unreadable> {
        let mut files = Vec::with_capacity(self.paths.len());
        for path in &self.paths {
            match std::fs::read(path) {
                Ok(bytes) => files.push(bytes),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(source) => {
                    return Err(Unreadable {
                        path: path.clone(),
                        source,
                    })
                }
            }
        }
        let read: Vec<&[u8]> = files.iter().map(Vec::as_slice).collect();
        if !self.saw(&read) {
            return Ok(None);
        }
        Ok(Some(files))
    }

    /// Reads every file, as `changed` does, but gives a new version only once it has read
    /// the same — bytes, sizes and modification times — at looks `settle` apart or more (so
    /// at two looks at least). A version that changes again before that is reported as
    /// skipped and never given.
    pub fn settled(&mut self, settle: Duration, now: Instant) -> Result<Look, Unreadable> {
        let mut files = Vec::with_capacity(self.paths.len());
        let mut stamps = Vec::with_capacity(self.paths.len());
        for path in &self.paths {
            let read = std::fs::read(path).and_then(|bytes| {
                let meta = std::fs::metadata(path)?;
                Ok((bytes, (meta.len(), meta.modified().ok())))
            });
            match read {
                Ok((bytes, stamp)) => {
                    files.push(bytes);
                    stamps.push(stamp);
                }
                // Briefly missing (deleted, then written): the next look sees what it became.
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    return Ok(Look {
                        settled: None,
                        skipped: false,
                    })
                }
                Err(source) => {
                    return Err(Unreadable {
                        path: path.clone(),
                        source,
                    })
                }
            }
        }
        let read: Vec<&[u8]> = files.iter().map(Vec::as_slice).collect();
        let seen = digest(&read);
        let earlier = self.pending.take();
        let skipped = earlier.as_ref().is_some_and(|p| p.digest != seen);
        if seen == self.last_seen {
            return Ok(Look {
                settled: None,
                skipped,
            });
        }
        let pending = match earlier {
            Some(p) if p.digest == seen && p.stamps == stamps => p,
            _ => Pending {
                digest: seen,
                stamps,
                since: now,
            },
        };
        if now.saturating_duration_since(pending.since) >= settle && pending.since != now {
            self.last_seen = seen;
            return Ok(Look {
                settled: Some(files),
                skipped,
            });
        }
        self.pending = Some(pending);
        Ok(Look {
            settled: None,
            skipped,
        })
    }

    /// Whether a new version is waiting to settle.
    pub fn settling(&self) -> bool {
        self.pending.is_some()
    }

    /// Records `files` as the version last seen, however it was read (a reload asked for
    /// by SIGHUP reads the file itself); `false` if it was already. A version waiting to
    /// settle with the same bytes waits no more.
    pub fn saw(&mut self, files: &[&[u8]]) -> bool {
        let seen = digest(files);
        let new = seen != self.last_seen;
        self.last_seen = seen;
        if self.pending.as_ref().is_some_and(|p| p.digest == seen) {
            self.pending = None;
        }
        new
    }
}

/// The SHA-256 of the files' bytes, each preceded by its length so that bytes moving from
/// one file to the next are a change.
fn digest(files: &[&[u8]]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for bytes in files {
        hash.update((bytes.len() as u64).to_be_bytes());
        hash.update(bytes);
    }
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_new_once_and_a_missing_file_is_no_version() {
        let dir = std::env::temp_dir().join(format!("sluice-file-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, b"one").expect("write");
        std::fs::write(&b, b"two").expect("write");
        let mut watch = FileWatch::new(vec![a.clone(), b.clone()], &[b"one", b"two"]);
        assert_eq!(watch.changed().expect("readable"), None);
        // The same bytes split differently between the files are a new version.
        std::fs::write(&a, b"onet").expect("write");
        std::fs::write(&b, b"wo").expect("write");
        assert_eq!(
            watch.changed().expect("readable"),
            Some(vec![b"onet".to_vec(), b"wo".to_vec()])
        );
        assert_eq!(watch.changed().expect("readable"), None);
        std::fs::remove_file(&b).expect("remove");
        assert_eq!(watch.changed().expect("missing is no version"), None);
        std::fs::write(&b, b"wo").expect("write");
        assert_eq!(watch.changed().expect("readable"), None, "back as it was");
        assert!(watch.saw(&[b"x", b"y"]));
        assert!(!watch.saw(&[b"x", b"y"]));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_version_is_given_once_it_has_read_the_same_for_the_settle_period() {
        let dir = std::env::temp_dir().join(format!("sluice-settle-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let file = dir.join("policy.yaml");
        std::fs::write(&file, b"old").expect("write");
        let mut watch = FileWatch::new(vec![file.clone()], &[b"old"]);
        let settle = Duration::from_millis(500);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let nothing = Look {
            settled: None,
            skipped: false,
        };
        assert_eq!(watch.settled(settle, at(0)).expect("readable"), nothing);
        std::fs::write(&file, b"half").expect("write");
        assert_eq!(watch.settled(settle, at(250)).expect("readable"), nothing);
        // Written on before it settled: the half version is skipped, the wait starts again.
        std::fs::write(&file, b"half and the rest").expect("write");
        let look = watch.settled(settle, at(500)).expect("readable");
        assert_eq!((look.settled, look.skipped), (None, true));
        assert_eq!(watch.settled(settle, at(750)).expect("readable"), nothing);
        let look = watch.settled(settle, at(1000)).expect("readable");
        assert_eq!(look.settled, Some(vec![b"half and the rest".to_vec()]));
        assert_eq!(watch.settled(settle, at(1250)).expect("readable"), nothing);
        // A settle shorter than the poll still needs a second look.
        std::fs::write(&file, b"next").expect("write");
        let short = Duration::from_millis(1);
        assert_eq!(watch.settled(short, at(1500)).expect("readable"), nothing);
        let look = watch.settled(short, at(1750)).expect("readable");
        assert_eq!(look.settled, Some(vec![b"next".to_vec()]));
        // Written and put back before it settled: skipped, nothing to apply.
        std::fs::write(&file, b"oops").expect("write");
        assert_eq!(watch.settled(settle, at(2000)).expect("readable"), nothing);
        std::fs::write(&file, b"next").expect("write");
        let look = watch.settled(settle, at(2250)).expect("readable");
        assert_eq!((look.settled, look.skipped), (None, true));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
