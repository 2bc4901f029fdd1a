//! Which requests a route takes: a path prefix (whole segments, ASCII case-insensitive unless
//! the route asks otherwise) and, optionally, methods. Paths reach the matcher canonical (see
//! `crate::path`) and without `;` parameters.
//!
//! A prefix may have parameter segments, `/users/{id}/orders`: `{id}` takes any one non-empty
//! segment, whose value a limit can key on (`param:id`).

use http::Method;

use crate::config::MatchConfig;

/// `methods`, with `HEAD` added when `GET` is among them. HEAD is GET without the body
/// (RFC 9110 §9.3.2), and Flask, Express, Rails, Go's mux and Spring all run the GET handler
/// for it: a route or limit on GET that let HEAD through would let the same handler run
/// uncounted. There is no way to list GET without HEAD; a route for `methods: [HEAD]` placed
/// before it takes HEAD elsewhere (the first matching route wins).
pub fn with_head(methods: impl Iterator<Item = Method>) -> Vec<Method> {
    let mut methods: Vec<Method> = methods.collect();
    if methods.contains(&Method::GET) && !methods.contains(&Method::HEAD) {
        methods.push(Method::HEAD);
    }
    methods
}

#[derive(Debug, Clone)]
pub struct Matcher {
    path_prefix: String,
    /// The prefix's segments when it has parameters; empty for a plain prefix, compared whole.
    pattern: Vec<Segment>,
    case_sensitive: bool,
    /// Empty: every method.
    methods: Vec<Method>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
}

impl Matcher {
    pub fn new(config: &MatchConfig) -> Matcher {
        let prefix = &config.path_prefix.0;
        let segments: Vec<Segment> = prefix
            .split('/')
            .filter(|segment| !segment.is_empty())
            .map(|segment| match param_name(segment) {
                Some(name) => Segment::Param(name.to_owned()),
                None => Segment::Literal(segment.to_owned()),
            })
            .collect();
        let has_params = segments.iter().any(|s| matches!(s, Segment::Param(_)));
        Matcher {
            path_prefix: prefix.clone(),
            pattern: if has_params { segments } else { Vec::new() },
            case_sensitive: config.case_sensitive,
            methods: with_head(config.methods.iter().map(|m| m.0.clone())),
        }
    }

    /// Whether the prefix is compared case-sensitively.
    pub fn case_sensitive(&self) -> bool {
        self.case_sensitive
    }

    /// The first segment of the prefix, which a request's path must start with for this route
    /// to match; `None` when the prefix is `/` or starts with a parameter (any first segment).
    pub fn first_segment(&self) -> Option<&str> {
        let rest = self.path_prefix.strip_prefix('/')?;
        let segment = rest.split('/').next().unwrap_or(rest);
        (!segment.is_empty() && param_name(segment).is_none()).then_some(segment)
    }

    /// The names of the prefix's parameters.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.pattern.iter().filter_map(|segment| match segment {
            Segment::Param(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// The value of parameter `name` in `path`, a path this matcher matches.
    pub fn param<'p>(&self, path: &'p str, name: &str) -> Option<&'p str> {
        let index = self
            .pattern
            .iter()
            .position(|segment| *segment == Segment::Param(name.to_owned()))?;
        path.split('/').filter(|s| !s.is_empty()).nth(index)
    }

    pub fn matches(&self, method: &Method, path: &str) -> bool {
        (self.methods.is_empty() || self.methods.contains(method)) && self.matches_path(path)
    }

    /// `/login` takes `/login` and `/login/...`, but not `/loginx`: a prefix ends at a segment
    /// boundary, so a limit on one endpoint never silently covers its neighbours.
    fn matches_path(&self, path: &str) -> bool {
        if !self.pattern.is_empty() {
            return self.matches_pattern(path);
        }
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

    /// Segment by segment: literals compared as a plain prefix is, parameters taking any
    /// non-empty segment; then the path ends, or goes on with `/`.
    fn matches_pattern(&self, path: &str) -> bool {
        let mut rest = path;
        for segment in &self.pattern {
            let Some(after_slash) = rest.strip_prefix('/') else {
                return false;
            };
            let end = after_slash.find('/').unwrap_or(after_slash.len());
            let (value, tail) = after_slash.split_at(end);
            let matched = match segment {
                Segment::Param(_) => !value.is_empty(),
                Segment::Literal(literal) if self.case_sensitive => value == literal,
                Segment::Literal(literal) => value.eq_ignore_ascii_case(literal),
            };
            if !matched {
                return false;
            }
            rest = tail;
        }
        if self.path_prefix.ends_with('/') {
            rest.starts_with('/')
        } else {
            rest.is_empty() || rest.starts_with('/')
        }
    }
}

/// `{id}` → `id`.
fn param_name(segment: &str) -> Option<&str> {
    segment.strip_prefix('{')?.strip_suffix('}')
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
    fn a_route_on_get_takes_head_and_only_get_brings_it() {
        let read = matcher("/items", &[Method::GET]);
        assert!(read.matches(&Method::HEAD, "/items"));
        assert!(!read.matches(&Method::POST, "/items"));
        let write = matcher("/items", &[Method::POST]);
        assert!(!write.matches(&Method::HEAD, "/items"));
        let head = matcher("/items", &[Method::HEAD]);
        assert!(
            !head.matches(&Method::GET, "/items"),
            "HEAD does not bring GET"
        );
    }

    #[test]
    fn parameter_segments() {
        let orders = matcher("/users/{id}/orders", &[]);
        assert!(orders.matches(&Method::GET, "/users/42/orders"));
        assert!(orders.matches(&Method::GET, "/USERS/abc/orders/7"));
        assert!(!orders.matches(&Method::GET, "/users/orders"));
        assert!(!orders.matches(&Method::GET, "/users/42/ordersx"));
        assert!(!orders.matches(&Method::GET, "/users/42"));
        assert_eq!(orders.param("/users/42/orders/7", "id"), Some("42"));
        assert_eq!(orders.param("/users/42/orders", "other"), None);
        assert_eq!(orders.params().collect::<Vec<_>>(), ["id"]);
        assert_eq!(orders.first_segment(), Some("users"));
        let any = matcher("/{tenant}/api", &[]);
        assert_eq!(any.first_segment(), None);
        assert!(any.matches(&Method::GET, "/acme/api/x"));
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
