//! Finding a request's route: the first route in file order whose matcher takes it, looked
//! up through the trie of the routes' prefixes (`matcher::RouteIndex`), so routing costs the
//! same with 10 routes or 10,000 (bench/RESULTS.md, "How cost grows with the work").

use http::Method;

pub(super) use super::matcher::RouteIndex;
use super::{Metering, Policy, Route};

impl<M: Metering> Policy<M> {
    /// The first route, in file order, that matches the request. `path` is canonical (see
    /// `crate::path::normalize`); its `;` parameters are ignored here.
    pub fn route(&self, method: &Method, path: &str) -> Option<&Route<M>> {
        let path = crate::path::without_parameters(path);
        let first = self
            .index
            .first(&path, |i| self.routes[i].matcher.matches(method, &path))?;
        self.routes.get(first)
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
