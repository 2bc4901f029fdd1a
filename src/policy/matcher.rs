//! Which requests a route takes: a path prefix (whole segments, ASCII case-insensitive unless
//! the route asks otherwise) and, optionally, methods. Paths reach the matcher canonical (see
//! `crate::path`) and without `;` parameters.
//!
//! A prefix may have parameter segments, `/users/{id}/orders`: `{id}` takes any one non-empty
//! segment, whose value a limit can key on (`param:id`).
//!
//! [`RouteIndex`] finds the first route, in file order, whose matcher takes a request, in time
//! that grows with the path's segments and not with the number of routes: a trie of the
//! prefixes' segments, walked along the path.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};

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

/// Which routes can match a path: a trie of the routes' prefixes, one edge per segment
/// (ASCII lower-cased, as prefixes are compared case-insensitively unless a route asks
/// otherwise), with a parameter segment as one wildcard edge per node. A prefix matches whole
/// segments, so a route whose prefix is `/a/b` can only take a path whose first segments are
/// `a` and `b` (ASCII case aside), and it sits on the node that walking `a`, `b` reaches.
/// Walking a path visits at most one literal child and one wildcard child per segment, and
/// each visited node's routes are checked with their full [`Matcher`] (case, trailing `/`,
/// methods), so the index only narrows which routes are tried; the answer is the lowest route
/// number that matches, which is the first route in file order, as a scan of every route
/// would find. Before it (issue 29), the routes were indexed by their first segment only, and
/// routes sharing one (`/api/v1/...` ×N) were scanned one by one.
pub struct RouteIndex {
    nodes: Vec<Node>,
    /// Keys the segment hashes: a client cannot choose segments that collide.
    hasher: RandomState,
}

#[derive(Default)]
struct Node {
    /// The routes whose prefix ends at this node, in file order.
    routes: Vec<usize>,
    /// Literal segments, by the hash of their lower-cased bytes (several only when hashes
    /// collide).
    children: HashMap<u64, Vec<Edge>>,
    /// The node after a parameter segment, which takes any one non-empty segment.
    param: Option<usize>,
}

/// A literal segment, lower-cased, and the node it leads to.
type Edge = (Box<[u8]>, usize);

impl RouteIndex {
    /// The index of these matchers; route `i` is the `i`-th.
    pub fn new<'m>(matchers: impl IntoIterator<Item = &'m Matcher>) -> RouteIndex {
        let mut index = RouteIndex {
            nodes: vec![Node::default()],
            hasher: RandomState::new(),
        };
        for (route, matcher) in matchers.into_iter().enumerate() {
            let mut node = 0;
            for segment in matcher.path_prefix.split('/').filter(|s| !s.is_empty()) {
                node = match param_name(segment) {
                    Some(_) => index.param_child(node),
                    None => index.literal_child(node, segment.as_bytes()),
                };
            }
            index.nodes[node].routes.push(route);
        }
        index
    }

    fn param_child(&mut self, node: usize) -> usize {
        if let Some(child) = self.nodes[node].param {
            return child;
        }
        let child = self.nodes.len();
        self.nodes.push(Node::default());
        self.nodes[node].param = Some(child);
        child
    }

    fn literal_child(&mut self, node: usize, segment: &[u8]) -> usize {
        if let Some(child) = self.literal(node, segment) {
            return child;
        }
        let child = self.nodes.len();
        let hash = self.fold_hash(segment);
        self.nodes.push(Node::default());
        self.nodes[node]
            .children
            .entry(hash)
            .or_default()
            .push((segment.to_ascii_lowercase().into_boxed_slice(), child));
        child
    }

    /// The child of `node` for literal `segment`, ASCII case aside.
    fn literal(&self, node: usize, segment: &[u8]) -> Option<usize> {
        let same = self.nodes[node].children.get(&self.fold_hash(segment))?;
        same.iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(segment))
            .map(|&(_, child)| child)
    }

    /// The hash of `segment` lower-cased, without allocating: lower-cased through a small
    /// buffer, chunk by chunk.
    fn fold_hash(&self, segment: &[u8]) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        let mut buffer = [0u8; 32];
        for chunk in segment.chunks(buffer.len()) {
            let lower = &mut buffer[..chunk.len()];
            lower.copy_from_slice(chunk);
            lower.make_ascii_lowercase();
            hasher.write(lower);
        }
        hasher.write_usize(segment.len());
        hasher.finish()
    }

    /// The lowest route number for which `matches` holds, among the routes whose prefix's
    /// segments begin `path`'s (canonical, without `;` parameters); `matches(i)` is asked of
    /// those only, and only of numbers below the best found so far.
    pub fn first(&self, path: &str, mut matches: impl FnMut(usize) -> bool) -> Option<usize> {
        let mut best = None;
        self.walk(0, path, &mut matches, &mut best);
        best
    }

    fn walk(
        &self,
        node: usize,
        rest: &str,
        matches: &mut impl FnMut(usize) -> bool,
        best: &mut Option<usize>,
    ) {
        let here = &self.nodes[node];
        for &route in &here.routes {
            if best.is_some_and(|b| route >= b) {
                break;
            }
            if matches(route) {
                *best = Some(route);
                break;
            }
        }
        let rest = rest.trim_start_matches('/');
        if rest.is_empty() {
            return;
        }
        let end = rest.find('/').unwrap_or(rest.len());
        let (segment, rest) = rest.split_at(end);
        if let Some(child) = here.param {
            self.walk(child, rest, matches, best);
        }
        if !here.children.is_empty() {
            if let Some(child) = self.literal(node, segment.as_bytes()) {
                self.walk(child, rest, matches, best);
            }
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
        let any = matcher("/{tenant}/api", &[]);
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

    fn index_first(
        index: &RouteIndex,
        routes: &[Matcher],
        method: &Method,
        path: &str,
    ) -> Option<usize> {
        index.first(path, |i| routes[i].matches(method, path))
    }

    #[test]
    fn the_index_takes_the_first_route_in_file_order() {
        let routes = [
            matcher("/api/v1/items/{id}", &[Method::POST]),
            matcher("/api/v1/items", &[]),
            matcher("/api/{version}/items/{id}", &[]),
            matcher("/API/v1/", &[]),
            matcher("/", &[]),
        ];
        let index = RouteIndex::new(&routes);
        let first = |method: &Method, path: &str| index_first(&index, &routes, method, path);
        assert_eq!(first(&Method::POST, "/api/v1/items/7"), Some(0));
        assert_eq!(
            first(&Method::GET, "/api/v1/items/7"),
            Some(1),
            "longer prefix, later route"
        );
        assert_eq!(first(&Method::GET, "/Api/V2/items/7"), Some(2));
        assert_eq!(first(&Method::GET, "/api/v1/other"), Some(3));
        assert_eq!(
            first(&Method::GET, "/api/v1"),
            Some(4),
            "`/API/v1/` needs more than `/api/v1`"
        );
        assert_eq!(first(&Method::GET, "/elsewhere"), Some(4));
        let none = RouteIndex::new(&routes[..1]);
        assert_eq!(
            index_first(&none, &routes[..1], &Method::GET, "/api/v1/items/7"),
            None
        );
    }

    /// 10,000 routes under one first segment (where the first-segment index of before scanned
    /// them all): a lookup asks the full matcher about the few routes on the path's nodes.
    #[test]
    fn a_lookup_does_not_try_every_route() {
        let mut routes: Vec<Matcher> = (0..10_000)
            .map(|i| matcher(&format!("/api/v1/r{i}"), &[]))
            .collect();
        routes.push(matcher("/api", &[]));
        let index = RouteIndex::new(&routes);
        for (path, expected) in [
            ("/api/v1/r9999/x", 9_999),
            ("/api/v1/r0", 0),
            ("/api/v1/none", 10_000),
        ] {
            let mut asked = 0;
            let found = index.first(path, |i| {
                asked += 1;
                routes[i].matches(&Method::GET, path)
            });
            assert_eq!(found, Some(expected), "{path}");
            assert!(asked <= 2, "{path}: asked about {asked} routes");
        }
    }

    use proptest::prelude::*;

    fn segment() -> impl Strategy<Value = String> {
        proptest::sample::select(vec!["a", "A", "b", "api", "Api", "{id}", "{x}", "%C3%A9"])
            .prop_map(str::to_owned)
    }

    fn prefix() -> impl Strategy<Value = String> {
        (proptest::collection::vec(segment(), 0..4), any::<bool>()).prop_map(|(segments, slash)| {
            let mut path = format!("/{}", segments.join("/"));
            if slash && !segments.is_empty() {
                path.push('/');
            }
            path
        })
    }

    fn path() -> impl Strategy<Value = String> {
        prefix().prop_map(|p| p.replace("{id}", "7").replace("{x}", "B"))
    }

    fn method() -> impl Strategy<Value = Vec<Method>> {
        proptest::sample::select(vec![vec![], vec![Method::GET], vec![Method::POST]])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The trie answers what a scan of every route in file order answers, parameters,
        /// trailing slashes, case and methods included.
        #[test]
        fn the_index_finds_what_a_scan_finds(
            routes in proptest::collection::vec((prefix(), any::<bool>(), method()), 1..12),
            paths in proptest::collection::vec(path(), 1..8),
            post in any::<bool>(),
        ) {
            let routes: Vec<Matcher> = routes
                .iter()
                .map(|(prefix, case_sensitive, methods)| Matcher {
                    case_sensitive: *case_sensitive,
                    ..matcher(prefix, methods)
                })
                .collect();
            let index = RouteIndex::new(&routes);
            let method = if post { Method::POST } else { Method::GET };
            for path in &paths {
                let scanned = routes.iter().position(|m| m.matches(&method, path));
                prop_assert_eq!(index_first(&index, &routes, &method, path), scanned, "{}", path);
            }
        }
    }
}
