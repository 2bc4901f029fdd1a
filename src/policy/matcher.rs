//! Which requests a route takes: a path prefix (whole segments, ASCII case-insensitive unless
//! the route asks otherwise) and, optionally, methods. Paths reach the matcher canonical (see
//! `crate::path`) and without `;` parameters.

use http::Method;

use crate::config::MatchConfig;

#[derive(Debug, Clone)]
pub struct Matcher {
    path_prefix: String,
    case_sensitive: bool,
    /// Empty: every method.
    methods: Vec<Method>,
}

impl Matcher {
    pub fn new(config: &MatchConfig) -> Matcher {
        Matcher {
            path_prefix: config.path_prefix.0.clone(),
            case_sensitive: config.case_sensitive,
            methods: config.methods.iter().map(|m| m.0.clone()).collect(),
        }
    }

    /// Whether the prefix is compared case-sensitively.
    pub fn case_sensitive(&self) -> bool {
        self.case_sensitive
    }

    /// The first segment of the prefix, which a request's path must start with for this route
    /// to match; `None` when the prefix is `/` and takes every path.
    pub fn first_segment(&self) -> Option<&str> {
        let rest = self.path_prefix.strip_prefix('/')?;
        let segment = rest.split('/').next().unwrap_or(rest);
        (!segment.is_empty()).then_some(segment)
    }

    pub fn matches(&self, method: &Method, path: &str) -> bool {
        (self.methods.is_empty() || self.methods.contains(method)) && self.matches_path(path)
    }

    /// `/login` takes `/login` and `/login/...`, but not `/loginx`: a prefix ends at a segment
    /// boundary, so a limit on one endpoint never silently covers its neighbours.
    fn matches_path(&self, path: &str) -> bool {
        let prefix = self.path_prefix.as_bytes();
        let Some((head, rest)) = path.as_bytes().split_at_checked(prefix.len()) else {
            return false;
        };
        let same = if self.case_sensitive {
            head == prefix
        } else {
            head.eq_ignore_ascii_case(prefix)
        };
        same && (rest.is_empty() || prefix.ends_with(b"/") || rest.starts_with(b"/"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MethodName, PathPrefix};

    fn matcher(prefix: &str, methods: &[Method]) -> Matcher {
        Matcher::new(&MatchConfig {
            path_prefix: PathPrefix(prefix.to_owned()),
            methods: methods.iter().cloned().map(MethodName).collect(),
            case_sensitive: false,
        })
    }

    #[test]
    fn case_is_ignored_unless_asked_for() {
        let login = matcher("/login", &[]);
        assert!(login.matches(&Method::GET, "/LOGIN"));
        assert!(login.matches(&Method::GET, "/Login/otp"));
        assert!(!login.matches(&Method::GET, "/LOGINX"));
        let exact = Matcher {
            case_sensitive: true,
            ..login
        };
        assert!(exact.matches(&Method::GET, "/login"));
        assert!(!exact.matches(&Method::GET, "/LOGIN"));
    }

    #[test]
    fn prefixes_end_at_segment_boundaries() {
        let login = matcher("/login", &[]);
        assert!(login.matches(&Method::GET, "/login"));
        assert!(login.matches(&Method::GET, "/login/"));
        assert!(login.matches(&Method::GET, "/login/otp"));
        assert!(!login.matches(&Method::GET, "/loginx"));
        assert!(!login.matches(&Method::GET, "/"));
        let api = matcher("/api/", &[]);
        assert!(api.matches(&Method::GET, "/api/x"));
        assert!(!api.matches(&Method::GET, "/api"));
        let root = matcher("/", &[]);
        assert!(root.matches(&Method::GET, "/anything/at/all"));
    }

    #[test]
    fn methods_restrict() {
        let login = matcher("/login", &[Method::POST]);
        assert!(login.matches(&Method::POST, "/login"));
        assert!(!login.matches(&Method::GET, "/login"));
    }
}
