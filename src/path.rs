//! One canonical spelling of a request path, so that sluice and the upstream always agree on
//! which route a request belongs to.
//!
//! A limit on `/login` protects nothing if `/%6Cogin` or `//login` reach the same handler
//! upstream by another route. So before routing, sluice rewrites the path the way permissive
//! servers read it, and forwards the rewritten path:
//!
//! - percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded (RFC 3986
//!   §6.2.2.2); the hex digits of every other escape are upper-cased (§6.2.2.1);
//! - repeated slashes are merged into one (nginx's `merge_slashes`);
//!
//! and refuses what has no single meaning across upstreams:
//!
//! - `.` and `..` segments, also when encoded (`%2E`) or followed by path parameters
//!   (`..;x`, which Tomcat reads as `..`);
//! - encoded slashes and backslashes (`%2F`, `%5C`) and raw backslashes: some servers decode
//!   them into separators, others do not;
//! - malformed escapes and an encoded NUL (`%00`).
//!
//! `;` path parameters stay in the forwarded path, but routes are matched on the path without
//! them (`/login;jsessionid=x` matches `/login`), as Java servers map it: see
//! [`without_parameters`].

use std::borrow::Cow;

/// Why a request path has no single meaning and is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path must start with `/`")]
    NotAbsolute,
    #[error("the path has a `%` that is not followed by two hex digits")]
    MalformedEscape,
    #[error("the path has `.` or `..` segments; send the resolved path")]
    DotSegment,
    #[error("the path has an encoded slash or backslash (`%2F`, `%5C`) or a raw backslash, which upstreams read differently")]
    AmbiguousSeparator,
    #[error("the path has an encoded NUL (`%00`)")]
    EncodedNul,
}

fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

/// The canonical form of `path` (without its query), or why it is refused. Borrows when the
/// path is already canonical, which is the common case, so most requests allocate nothing.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathError> {
    let input = path.as_bytes();
    if input.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    let mut writer = Writer { input, out: None };
    let mut index = 0;
    while index < input.len() {
        match input[index] {
            b'%' => {
                let (high, low) = escape_at(input, index)?;
                let decoded = high << 4 | low;
                match decoded {
                    b'/' | b'\\' => return Err(PathError::AmbiguousSeparator),
                    0 => return Err(PathError::EncodedNul),
                    _ if is_unreserved(decoded) => writer.replace(index, &[decoded]),
                    _ => {
                        let upper = [
                            b'%',
                            HEX_UPPER[usize::from(high)],
                            HEX_UPPER[usize::from(low)],
                        ];
                        if input[index..index + 3] == upper {
                            writer.keep(index, 3);
                        } else {
                            writer.replace(index, &upper);
                        }
                    }
                }
                index += 3;
            }
            b'\\' => return Err(PathError::AmbiguousSeparator),
            b'/' if writer.last(index) == Some(b'/') => {
                writer.replace(index, &[]);
                index += 1;
            }
            _ => {
                writer.keep(index, 1);
                index += 1;
            }
        }
    }
    let canonical = match writer.out {
        None => Cow::Borrowed(path),
        // Only ASCII is ever written (escapes kept as `%XX`, decoded bytes unreserved), but
        // the conversion is checked rather than assumed.
        Some(out) => Cow::Owned(String::from_utf8(out).map_err(|_| PathError::MalformedEscape)?),
    };
    if has_dot_segment(&canonical) {
        return Err(PathError::DotSegment);
    }
    Ok(canonical)
}

/// The two hex digits after the `%` at `index`.
fn escape_at(input: &[u8], index: usize) -> Result<(u8, u8), PathError> {
    let digit = |offset| input.get(index + offset).copied().and_then(hex_value);
    match (digit(1), digit(2)) {
        (Some(high), Some(low)) => Ok((high, low)),
        _ => Err(PathError::MalformedEscape),
    }
}

/// The output of `normalize`: nothing is copied until the first byte that changes.
struct Writer<'a> {
    input: &'a [u8],
    out: Option<Vec<u8>>,
}

impl Writer<'_> {
    /// Keeps `len` input bytes at `index` as they are.
    fn keep(&mut self, index: usize, len: usize) {
        if let Some(out) = &mut self.out {
            out.extend_from_slice(&self.input[index..index + len]);
        }
    }

    /// Writes `bytes` in place of the input at `index`.
    fn replace(&mut self, index: usize, bytes: &[u8]) {
        let input = self.input;
        self.out
            .get_or_insert_with(|| {
                let mut out = Vec::with_capacity(input.len());
                out.extend_from_slice(&input[..index]);
                out
            })
            .extend_from_slice(bytes);
    }

    /// The last byte written before the input at `index`.
    fn last(&self, index: usize) -> Option<u8> {
        match &self.out {
            Some(out) => out.last().copied(),
            None => index.checked_sub(1).map(|i| self.input[i]),
        }
    }
}

/// `.`, `..`, and the same followed by `;` parameters (`..;x=1`), which Java servers resolve
/// as `..` after stripping the parameters.
fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(|segment| {
        let name = segment.split(';').next().unwrap_or(segment);
        name == "." || name == ".."
    })
}

/// The path as routes see it: `;` parameters removed from every segment, and segments left
/// empty by that removal merged away (`/;x/login` → `/login`). Tomcat and Spring map a
/// request this way; an upstream that keeps the parameters sees a path no route of its own
/// takes, so matching the stripped path is never more permissive than the upstream.
pub fn without_parameters(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut stripped = String::with_capacity(path.len());
    for segment in path.split('/').skip(1) {
        let name = segment.split(';').next().unwrap_or(segment);
        if name.is_empty() && segment.contains(';') {
            continue;
        }
        stripped.push('/');
        stripped.push_str(name);
    }
    if stripped.is_empty() {
        stripped.push('/');
    }
    Cow::Owned(stripped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(path: &str) -> Result<String, PathError> {
        normalize(path).map(Cow::into_owned)
    }

    #[test]
    fn decodes_unreserved_and_uppercases_other_escapes() {
        assert_eq!(canonical("/%6Cogin").unwrap(), "/login");
        assert_eq!(canonical("/logi%6e").unwrap(), "/login");
        assert_eq!(canonical("/%7Eu%2D%5F%2e").unwrap(), "/~u-_.");
        assert_eq!(canonical("/a%3fb%c3%a9").unwrap(), "/a%3Fb%C3%A9");
        assert_eq!(canonical("/a%25b").unwrap(), "/a%25b");
    }

    #[test]
    fn merges_slashes() {
        assert_eq!(canonical("//login").unwrap(), "/login");
        assert_eq!(canonical("/api///v1//x/").unwrap(), "/api/v1/x/");
        assert_eq!(canonical("/").unwrap(), "/");
        assert_eq!(canonical("//").unwrap(), "/");
    }

    #[test]
    fn borrows_a_canonical_path() {
        assert!(matches!(normalize("/users/7/orders"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a%3Fb"), Ok(Cow::Borrowed(_))));
    }

    #[test]
    fn refuses_what_upstreams_read_differently() {
        for (path, error) in [
            ("login", PathError::NotAbsolute),
            ("/a/../login", PathError::DotSegment),
            ("/a/%2E%2e/login", PathError::DotSegment),
            ("/a/.%2E;x=1/login", PathError::DotSegment),
            ("/./login", PathError::DotSegment),
            ("/a/..", PathError::DotSegment),
            ("/a%2Flogin", PathError::AmbiguousSeparator),
            ("/a%5clogin", PathError::AmbiguousSeparator),
            ("/a\\login", PathError::AmbiguousSeparator),
            ("/a%2", PathError::MalformedEscape),
            ("/a%zz", PathError::MalformedEscape),
            ("/a%00", PathError::EncodedNul),
        ] {
            assert_eq!(canonical(path), Err(error), "{path}");
        }
        assert_eq!(canonical("/a/b.c/..d/...").unwrap(), "/a/b.c/..d/...");
    }

    #[test]
    fn parameters_are_ignored_for_routing() {
        assert_eq!(without_parameters("/login;jsessionid=1"), "/login");
        assert_eq!(without_parameters("/;x/login"), "/login");
        assert_eq!(without_parameters("/a;x=1/b;y"), "/a/b");
        assert_eq!(without_parameters("/;x"), "/");
        assert_eq!(without_parameters("/login/"), "/login/");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn normalizing_never_panics_and_is_idempotent(path in "/[a-zA-Z0-9%/.;~_\\-]{0,40}") {
            if let Ok(once) = normalize(&path) {
                let twice = normalize(&once).expect("a canonical path is accepted");
                prop_assert_eq!(&once, &twice);
                prop_assert!(!once.contains("//"));
                prop_assert!(!has_dot_segment(&once));
                prop_assert!(once.starts_with('/'));
            }
        }

        #[test]
        fn any_bytes_are_an_answer_not_a_panic(path in "\\PC{0,64}") {
            let _ = normalize(&path);
            let _ = without_parameters(&path);
        }

        #[test]
        fn a_plain_path_is_unchanged(segments in proptest::collection::vec("[a-z0-9_-]{1,8}", 0..6)) {
            let path = format!("/{}", segments.join("/"));
            prop_assert_eq!(normalize(&path).unwrap(), Cow::Borrowed(path.as_str()));
        }

        #[test]
        fn encoding_unreserved_characters_changes_nothing(
            segments in proptest::collection::vec("[a-z0-9_-]{1,8}", 1..5),
            mask in any::<u64>(),
        ) {
            let path = format!("/{}", segments.join("/"));
            let encoded: String = path
                .bytes()
                .enumerate()
                .map(|(i, b)| {
                    if b != b'/' && mask >> (i % 64) & 1 == 1 {
                        format!("%{b:02x}")
                    } else {
                        char::from(b).to_string()
                    }
                })
                .collect();
            prop_assert_eq!(normalize(&encoded).unwrap(), path);
        }
    }
}
