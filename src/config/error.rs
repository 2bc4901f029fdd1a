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
    /// Every mistake found in one reading (two or more), in the file's order.
    #[error("{}", Listed(errors))]
    Several { errors: Vec<ConfigError> },
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

impl ConfigError {
    /// `errors` as one error: the only one, or all of them in the file's order (an error at
    /// no position first, as the file's), nested lists flattened. `errors` must not be empty.
    pub fn all(errors: Vec<ConfigError>) -> ConfigError {
        let mut flat: Vec<ConfigError> = errors.into_iter().flat_map(ConfigError::list).collect();
        flat.sort_by_key(|err| match err {
            ConfigError::Invalid { position, .. } => (position.line, position.column),
            _ => (0, 0),
        });
        if flat.len() == 1 {
            flat.swap_remove(0)
        } else {
            ConfigError::Several { errors: flat }
        }
    }

    /// The `mistakes` found while reading a file past them, and those the checks after the
    /// reading found (`later`) in parts of the file that read without one: a later check of
    /// a part whose value was patched (`recover`) would judge the patch, not what was written.
    pub fn with_later(mut mistakes: Vec<ConfigError>, later: Option<ConfigError>) -> ConfigError {
        let read: Vec<&str> = mistakes.iter().filter_map(ConfigError::part).collect();
        let later: Vec<ConfigError> = later
            .map(ConfigError::list)
            .unwrap_or_default()
            .into_iter()
            .filter(|err| err.part().is_none_or(|part| !read.contains(&part)))
            .collect();
        mistakes.extend(later);
        ConfigError::all(mistakes)
    }

    /// The part of the file a mistake is in: a route's field or limit (`routes[0].upstream`,
    /// `routes[0].limits[1]`), an upstream (`upstreams.api`), or a top-level field (with its
    /// list: `trusted_proxies`).
    fn part(&self) -> Option<&str> {
        let ConfigError::Invalid { field, .. } = self else {
            return None;
        };
        let segments = if field.starts_with("routes[") || field.starts_with("upstreams.") {
            2
        } else {
            1
        };
        let end = field
            .match_indices('.')
            .nth(segments - 1)
            .map_or(field.len(), |(at, _)| at);
        let part = &field[..end];
        Some(if segments == 1 {
            part.split('[').next().unwrap_or(part)
        } else {
            part
        })
    }

    /// The mistakes this error stands for, one by one.
    pub fn list(self) -> Vec<ConfigError> {
        match self {
            ConfigError::Several { errors } => errors,
            one => vec![one],
        }
    }

    /// Every mistake, each with its line of `text` (the file's contents, when it could be
    /// read) and a caret, then how many: what `sluice check` prints after `error: `.
    pub fn report(self, text: Option<&str>) -> String {
        let errors = self.list();
        let mut out = String::new();
        for (index, err) in errors.iter().enumerate() {
            if index > 0 {
                out.push_str("\nerror: ");
            }
            out.push_str(&err.to_string());
            // A file that cannot be read says why (the error's source).
            let mut source = std::error::Error::source(err);
            while let Some(cause) = source {
                out.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            if let Some(excerpt) = text.and_then(|text| err.excerpt(text)) {
                out.push('\n');
                out.push_str(excerpt.trim_end());
            }
        }
        if errors.len() > 1 {
            out.push_str(&format!("\n{} errors", errors.len()));
        }
        out
    }

    /// The line of `text` (the file's contents) the error points at, with a caret under what
    /// is wrong, the way compilers show it; nothing for an error at no position.
    pub fn excerpt(&self, text: &str) -> Option<String> {
        let ConfigError::Invalid { position, .. } = self else {
            return None;
        };
        let index = usize::try_from(position.line).ok()?.checked_sub(1)?;
        let line = text.lines().nth(index)?;
        let column = usize::try_from(position.column).ok()?.max(1);
        let width = scalar_at(text, *position).map_or(1, |s| s.chars().count().max(1));
        let number = position.line.to_string();
        let gutter = " ".repeat(number.len());
        let pad: String = line
            .chars()
            .take(column - 1)
            .map(|c| if c == '\t' { '\t' } else { ' ' })
            .collect();
        Some(format!(
            "{gutter} |\n{number} | {line}\n{gutter} | {pad}{}\n",
            "^".repeat(width)
        ))
    }
}

/// The scalar written at `position` (up to the end of its line, or a flow collection's `,`,
/// `}` or `]`, a comment, or the `: ` after a key), without quotes: what a message says it
/// got.
pub(super) fn scalar_at(text: &str, position: Position) -> Option<&str> {
    let line = text
        .lines()
        .nth(usize::try_from(position.line).ok()?.checked_sub(1)?)?;
    let range = scalar_range(line, position.column)?;
    let value = line[range].trim_matches(['"', '\'']);
    (!value.is_empty()).then_some(value)
}

/// The bytes of `line` holding the scalar that starts at `column` (1-based, in characters),
/// quotes included, as [`scalar_at`] reads it.
pub(super) fn scalar_range(line: &str, column: u64) -> Option<std::ops::Range<usize>> {
    let start = line
        .char_indices()
        .nth(usize::try_from(column).ok()?.checked_sub(1)?)?
        .0;
    let rest = &line[start..];
    // A key ends at its `: ` (a URL's or an IPv6 address's colon is not followed by a space).
    let key_end = rest
        .find(": ")
        .or_else(|| rest.strip_suffix(':').map(str::len));
    let end = rest
        .find([',', '}', ']', '#'])
        .into_iter()
        .chain(key_end)
        .min()
        .unwrap_or(rest.len());
    let value = rest[..end].trim_end();
    (!value.is_empty()).then_some(start..start + value.len())
}

/// One error per line, then how many.
struct Listed<'a>(&'a [ConfigError]);

impl fmt::Display for Listed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for err in self.0 {
            writeln!(f, "{err}")?;
        }
        write!(f, "{} errors", self.0.len())
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
