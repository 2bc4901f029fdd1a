//! The request fields a policy reads, found once when it is compiled, so the request path can
//! make sure the limiter and the upstream read the same request: a field a route's limits
//! read may appear only once (see `keys::repeated_field`), and a `Connection` option may not
//! name a field the policy reads (it would be removed before forwarding, after the limiter
//! read it).

use std::fmt;

use http::header::{HeaderName, COOKIE, HOST};

use super::{Condition, Limit, Route};
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
pub fn read_by(limits: &[Limit]) -> Vec<Field> {
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
                KeyPart::ClientIp | KeyPart::Method | KeyPart::Path | KeyPart::Param(_) => {}
            }
        }
        for condition in &limit.when {
            match condition {
                Condition::Header { name, .. } => add(Field::Header(name.clone())),
                Condition::Host(_) => add(Field::Header(HOST)),
                Condition::Method(_) => {}
            }
        }
    }
    fields
}

/// The header fields a `Connection` option may not name: every header some route's limits
/// read, `Cookie` when some limit reads a cookie, `Host` (the upstream learns the client's
/// host from it, in `X-Forwarded-Host`), and the forwarded-for header when proxies are
/// trusted (the client address is read from it).
pub fn connection_guarded(
    routes: &[Route],
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
