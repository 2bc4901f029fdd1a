//! Which requests a route takes: a path prefix (whole segments) and, optionally, methods.

use http::Method;

use crate::config::MatchConfig;

#[derive(Debug, Clone)]
pub struct Matcher {
    path_prefix: String,
    /// Empty: every method.
    methods: Vec<Method>,
}

impl Matcher {
    pub fn new(config: &MatchConfig) -> Matcher {
        Matcher {
            path_prefix: config.path_prefix.0.clone(),
            methods: config.methods.iter().map(|m| m.0.clone()).collect(),
        }
    }

    pub fn matches(&self, method: &Method, path: &str) -> bool {
        (self.methods.is_empty() || self.methods.contains(method)) && self.matches_path(path)
    }

    /// `/login` takes `/login` and `/login/...`, but not `/loginx`: a prefix ends at a segment
    /// boundary, so a limit on one endpoint never silently covers its neighbours.
    fn matches_path(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix(self.path_prefix.as_str()) else {
            return false;
        };
        rest.is_empty() || self.path_prefix.ends_with('/') || rest.starts_with('/')
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
        })
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
