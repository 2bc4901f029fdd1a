//! The request fields a policy reads, found once when it is compiled, so the request path can
//! make sure the limiter and the upstream read the same request: a field a route's limits
//! read may appear only once (see `request::fields::repeated_field`), and a `Connection`
//! option may not name a field the policy reads (it would be removed before forwarding, after
//! the limiter read it).

use std::fmt;

use http::header::{HeaderName, COOKIE, HOST};

use super::{Condition, Limit, Metering, Route};
use crate::config::{ForwardedHeader, KeyPart};

/// A field of the request that a route's limits read, through a key part or a `when:`
/// condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    Header(HeaderName),
    /// A query parameter, by its percent-decoded name.
    Query(String),
    Cookie(String),
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::Header(name) => write!(f, "the header {name}"),
            Field::Query(name) => write!(f, "the query parameter {name}"),
            Field::Cookie(name) => write!(f, "the cookie {name}"),
        }
    }
}

/// The fields `limits` read, each once, in the order they are first read.
pub fn read_by<M: Metering>(limits: &[Limit<M>]) -> Vec<Field> {
    let mut fields = Vec::new();
    let mut add = |field: Field| {
        if !fields.contains(&field) {
            fields.push(field);
        }
    };
    for limit in limits {
        for part in &limit.key {
            match part {
                KeyPart::Header(name) => add(Field::Header(name.clone())),
                KeyPart::Query(name) => add(Field::Query(name.clone())),
                KeyPart::Cookie(name) => add(Field::Cookie(name.clone())),
                KeyPart::Host => add(Field::Header(HOST)),
                // The token's field is the route's, added with its verifier.
                KeyPart::ClientIp
                | KeyPart::Method
                | KeyPart::Path
                | KeyPart::Param(_)
                | KeyPart::Jwt(_)
                // The body's, read once (`crate::model`).
                | KeyPart::Model => {}
            }
        }
        for condition in &limit.when {
            match condition {
                Condition::Header { name, .. } => add(Field::Header(name.clone())),
                Condition::Host(_) => add(Field::Header(HOST)),
                Condition::Method(_) | Condition::Claim { .. } | Condition::Model(_) => {}
            }
        }
    }
    fields
}

/// The header fields a `Connection` option may not name: every header some route's limits
/// read, `Cookie` when some limit reads a cookie, `Host` (the upstream learns the client's
/// host from it, in `X-Forwarded-Host`), and the forwarded-for header when proxies are
/// trusted (the client address is read from it).
pub fn connection_guarded<M: Metering>(
    routes: &[Route<M>],
    trusts_proxies: bool,
    forwarded: ForwardedHeader,
) -> Vec<HeaderName> {
    let mut guarded = vec![HOST];
    if trusts_proxies {
        guarded.push(HeaderName::from_static(match forwarded {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        }));
    }
    for field in routes.iter().flat_map(|route| &route.fields) {
        let name = match field {
            Field::Header(name) => name.clone(),
            Field::Cookie(_) => COOKIE,
            Field::Query(_) => continue,
        };
        if !guarded.contains(&name) {
            guarded.push(name);
        }
    }
    guarded
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::policy::Compiled;
    use crate::tls::UpstreamTlsSet;

    fn compile(head: &str, limits: &str) -> Compiled {
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{head}routes:\n  - name: r\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n{limits}  - name: open\n    match: {{ path_prefix: /open }}\n    respond: {{ status: 200 }}\n"
        );
        let config = crate::config::parse(&yaml, Path::new("t.yaml")).expect("valid");
        Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .expect("valid")
    }

    #[test]
    fn keys_and_conditions_name_the_fields_once() {
        let policy = compile(
            "",
            r#"      - { name: a, key: ["header:x-api-key", "query:k", host], requests: 1, window: 1s }
      - name: b
        key: ["cookie:s", "header:x-api-key", client_ip]
        requests: 1
        window: 1s
        when: [{ header: x-plan, equals: free }, { host: [api.example] }, { method: [GET] }]
"#,
        );
        let api_key = HeaderName::from_static("x-api-key");
        assert_eq!(
            policy.routes[0].fields,
            [
                Field::Header(api_key.clone()),
                Field::Query("k".to_owned()),
                Field::Header(HOST),
                Field::Cookie("s".to_owned()),
                Field::Header(HeaderName::from_static("x-plan")),
            ]
        );
        assert!(policy.routes[1].fields.is_empty());
        let get = Condition::Method(vec![http::Method::GET, http::Method::HEAD]);
        assert!(
            policy.routes[0].limits[1].when.contains(&get),
            "GET brings HEAD"
        );
        assert_eq!(
            policy.connection_guarded,
            [HOST, api_key, COOKIE, HeaderName::from_static("x-plan")]
        );
        assert_eq!(
            Field::Query("k".to_owned()).to_string(),
            "the query parameter k"
        );
    }

    #[test]
    fn the_forwarded_header_is_guarded_only_when_proxies_are_trusted() {
        let limits = "      - { name: a, key: [client_ip], requests: 1, window: 1s }\n";
        assert_eq!(compile("", limits).connection_guarded, [HOST]);
        let trusted = compile("trusted_proxies: [10.0.0.0/8]\n", limits);
        assert_eq!(
            trusted.connection_guarded,
            [HOST, HeaderName::from_static("x-forwarded-for")]
        );
        let forwarded = compile(
            "trusted_proxies: [10.0.0.0/8]\nforwarded_header: forwarded\n",
            limits,
        );
        assert_eq!(
            forwarded.connection_guarded,
            [HOST, HeaderName::from_static("forwarded")]
        );
    }
}
