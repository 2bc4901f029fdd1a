//! Watching files for a new version by reading them: the one poll loop behind the config
//! reload (`reload`) and the listener certificate's rotation (`tls::listener`). Editors and
//! certificate tools replace a file by writing a new one and renaming it over the path, so
//! the path is read again at each look rather than an inode watched; the files are a few
//! kilobytes, so reading and hashing them four times a second costs nothing and needs no
//! watcher dependency.

use std::path::PathBuf;
use std::time::Duration;

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
}

impl FileWatch {
    /// Watches `paths`, whose current version is `seen` (the bytes of each, in order):
    /// those bytes are not a change.
    pub fn new(paths: Vec<PathBuf>, seen: &[&[u8]]) -> FileWatch {
        FileWatch {
            paths,
            last_seen: digest(seen),
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

    /// Records `files` as the version last seen, however it was read (a reload asked for
    /// by SIGHUP reads the file itself); `false` if it was already.
    pub fn saw(&mut self, files: &[&[u8]]) -> bool {
        let seen = digest(files);
        let new = seen != self.last_seen;
        self.last_seen = seen;
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
}
