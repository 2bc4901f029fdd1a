//! Why a policy file was refused, and where: `ConfigError` prints `file:line:column: field:
//! message`, the way compilers do, so editors can jump to the place to fix.

use std::fmt;
use std::path::{Path, PathBuf};

use super::Spanned;

/// A position in the policy file (1-based line and column; 0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    pub line: u64,
    pub column: u64,
}

impl<T> From<&Spanned<T>> for Position {
    fn from(spanned: &Spanned<T>) -> Self {
        Position {
            line: spanned.referenced.line(),
            column: spanned.referenced.column(),
        }
    }
}

/// Why a policy file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read the file", file.display())]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", Located { file, position, field })]
    Invalid {
        file: PathBuf,
        position: Position,
        field: String,
        message: String,
    },
}

impl ConfigError {
    pub fn invalid(
        file: &Path,
        position: Position,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            file: file.to_owned(),
            position,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Renders `file:line:column: field` the way compilers do, so editors can jump to it.
struct Located<'a> {
    file: &'a Path,
    position: &'a Position,
    field: &'a str,
}

impl fmt::Display for Located<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if self.position.line > 0 {
            write!(f, ":{}:{}", self.position.line, self.position.column)?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        Ok(())
    }
}
