//! The route index: which routes can match a path, found by its first segment.

use std::collections::HashMap;

use http::Method;

use super::{Metering, Policy, Route};

/// Which routes can match a path, by its first segment, so that routing costs a hash lookup
/// and a few comparisons however many routes there are. Prefixes match whole segments, so a
/// route whose prefix starts with segment `api` can only match a path whose first segment is
/// `api` (ASCII case aside); a prefix of `/` can match any path.
pub(super) struct RouteIndex {
    /// By the ASCII lower-cased first segment: the routes starting with it and the routes
    /// matching any path, in file order.
    by_segment: HashMap<Vec<u8>, Vec<usize>>,
    /// The routes matching any path, for every other first segment.
    any_path: Vec<usize>,
}

/// First segments up to this length are looked up without allocating; longer ones (rare)
/// are matched against every route.
const INDEXED_SEGMENT_LEN: usize = 64;

impl RouteIndex {
    pub(super) fn new<M: Metering>(routes: &[Route<M>]) -> RouteIndex {
        let any_path: Vec<usize> = (0..routes.len())
            .filter(|&i| routes[i].matcher.first_segment().is_none())
            .collect();
        let mut by_segment: HashMap<Vec<u8>, Vec<usize>> = HashMap::new();
        for route in routes {
            if let Some(segment) = route.matcher.first_segment() {
                by_segment
                    .entry(segment.to_ascii_lowercase().into_bytes())
                    .or_default();
            }
        }
        for (segment, candidates) in &mut by_segment {
            candidates.extend((0..routes.len()).filter(
                |&i| match routes[i].matcher.first_segment() {
                    None => true,
                    Some(first) => first.as_bytes().eq_ignore_ascii_case(segment),
                },
            ));
        }
        RouteIndex {
            by_segment,
            any_path,
        }
    }

    /// The routes to try for `path`, in file order; `None`: try every route.
    fn candidates(&self, path: &str) -> Option<&[usize]> {
        let rest = path.strip_prefix('/').unwrap_or(path);
        let segment = rest.split('/').next().unwrap_or(rest).as_bytes();
        if segment.len() > INDEXED_SEGMENT_LEN {
            return None;
        }
        let mut lower = [0u8; INDEXED_SEGMENT_LEN];
        let lower = &mut lower[..segment.len()];
        lower.copy_from_slice(segment);
        lower.make_ascii_lowercase();
        Some(self.by_segment.get(&*lower).unwrap_or(&self.any_path))
    }
}

impl<M: Metering> Policy<M> {
    /// The first route, in file order, that matches the request. `path` is canonical (see
    /// `crate::path::normalize`); its `;` parameters are ignored here.
    pub fn route(&self, method: &Method, path: &str) -> Option<&Route<M>> {
        let path = crate::path::without_parameters(path);
        let matches = |route: &&Route<M>| route.matcher.matches(method, &path);
        match self.index.candidates(&path) {
            Some(candidates) => candidates.iter().map(|&i| &self.routes[i]).find(matches),
            None => self.routes.iter().find(matches),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::policy::Compiled;
    use crate::tls::UpstreamTlsSet;

    use proptest::prelude::*;

    fn segment() -> impl Strategy<Value = String> {
        proptest::sample::select(vec!["a", "A", "b", "api", "Api", "x;p", "%C3%A9"])
            .prop_map(str::to_owned)
    }

    fn path() -> impl Strategy<Value = String> {
        (proptest::collection::vec(segment(), 0..4), any::<bool>()).prop_map(|(segments, slash)| {
            let mut path = format!("/{}", segments.join("/"));
            if slash && !segments.is_empty() {
                path.push('/');
            }
            path
        })
    }

    fn policy(routes: &[(String, bool, bool)]) -> Compiled {
        let mut yaml = String::from("listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n");
        for (n, (prefix, case_sensitive, post_only)) in routes.iter().enumerate() {
            let prefix = prefix.replace(";p", "");
            let methods = if *post_only { "[POST]" } else { "[]" };
            yaml.push_str(&format!(
                "  - name: r{n}\n    match: {{ path_prefix: \"{prefix}\", case_sensitive: {case_sensitive}, methods: {methods} }}\n    respond: {{ status: 200 }}\n"
            ));
        }
        let config = crate::config::parse(&yaml, Path::new("t.yaml")).expect("valid");
        Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .expect("valid")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The first-segment index never changes which route matches: it is the first
        /// route in file order, as a scan of every route finds it.
        #[test]
        fn the_index_finds_what_a_scan_finds(
            routes in proptest::collection::vec((path(), any::<bool>(), any::<bool>()), 1..8),
            paths in proptest::collection::vec(path(), 1..8),
            post in any::<bool>(),
        ) {
            let policy = policy(&routes);
            let method = if post { Method::POST } else { Method::GET };
            for path in &paths {
                let stripped = crate::path::without_parameters(path);
                let scanned = policy.routes.iter().find(|r| r.matcher.matches(&method, &stripped));
                let indexed = policy.route(&method, path);
                prop_assert_eq!(
                    indexed.map(|r| r.name.as_str()),
                    scanned.map(|r| r.name.as_str()),
                    "{}", path
                );
            }
        }
    }
}
