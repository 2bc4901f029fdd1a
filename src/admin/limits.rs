//! `/admin/v1/limits/{route}/{limit}?...`: one identity's quota, read without consuming
//! anything (`GET`) or reset (`DELETE`).
//!
//! The identity is named the way an operator sees it, in one of two forms:
//! - `key=`: the identity as `sluice explain` prints it in a store key — the text between
//!   `{` and `}` (`key=ip=203.0.113.9`, `key=h:x-api-key=k1`), that text with its braces, or
//!   the whole store key. It is checked against the limit's key parts, then used as is.
//! - one query parameter per key part, the raw values a request would carry: `client_ip=`,
//!   `header.NAME=`, `query.NAME=`, `cookie.NAME=`, `method=`, `host=`, `path=` (which also
//!   gives `param:NAME` parts). They are put into a request, and the gateway's own key
//!   builder (`request::store_key::build`) turns it into the key, escaping and hashing included: a
//!   long or binary API key finds the same hashed key a live request does. A part the
//!   request lacks counts the client IP, as live: then `client_ip=` names that bucket.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

use http::header::{HeaderName, HeaderValue, COOKIE, HOST};
use http::{HeaderMap, Method, Uri};

use crate::config::KeyPart;
use crate::policy::{Limit, Policy, Route};
use crate::request::fields::percent_decode;
use crate::request::store_key::{self, RequestParts};

/// Most bytes of an admin query string: a key part's value is hashed past 64 bytes, but an
/// operator may paste a long raw value to be hashed.
const MAX_QUERY: usize = 16 * 1024;

/// The identity an operator named in the query, decoded: a `key=` or per-part values.
#[derive(Default)]
struct NamedIdentity {
    key: Option<String>,
    client_ip: Option<IpAddr>,
    /// Key parts with their values, in the order given.
    parts: Vec<(KeyPart, Vec<u8>)>,
}

impl NamedIdentity {
    fn parse(query: &str) -> Result<NamedIdentity, String> {
        if query.len() > MAX_QUERY {
            return Err(format!("the query is longer than {MAX_QUERY} bytes"));
        }
        let mut named = NamedIdentity::default();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name = String::from_utf8(percent_decode(name))
                .map_err(|_| "a parameter name is not UTF-8".to_owned())?;
            let value = percent_decode(value);
            let text =
                || String::from_utf8(value.clone()).map_err(|_| format!("`{name}` is not UTF-8"));
            let suffix_of = |prefix: &str| {
                name.strip_prefix(prefix)
                    .map(|rest| rest.strip_prefix(['.', ':']).unwrap_or(rest))
                    .filter(|rest| !rest.is_empty())
                    .map(str::to_owned)
            };
            match name.as_str() {
                "key" => named.key = Some(text()?),
                "client_ip" => {
                    let ip: IpAddr = text()?.parse().map_err(|_| {
                        format!(
                            "client_ip: `{}` is not an IP address",
                            text().unwrap_or_default()
                        )
                    })?;
                    named.client_ip = Some(ip.to_canonical());
                }
                "method" => named.parts.push((KeyPart::Method, value)),
                "host" => named.parts.push((KeyPart::Host, value)),
                "path" => named.parts.push((KeyPart::Path, value)),
                "model" => named.parts.push((KeyPart::Model, value)),
                _ => {
                    let part = if let Some(header) = suffix_of("header") {
                        let header = HeaderName::from_bytes(header.as_bytes())
                            .map_err(|_| format!("`{name}`: `{header}` is not a header name"))?;
                        KeyPart::Header(header)
                    } else if let Some(query) = suffix_of("query") {
                        KeyPart::Query(query)
                    } else if let Some(cookie) = suffix_of("cookie") {
                        KeyPart::Cookie(cookie)
                    } else if let Some(claim) = suffix_of("jwt") {
                        KeyPart::Jwt(claim)
                    } else if suffix_of("param").is_some() {
                        return Err(format!(
                            "`{name}`: give the request's path instead (path=/...): path \
                             parameters are read from it as the route matches it"
                        ));
                    } else {
                        return Err(format!(
                            "unknown parameter `{name}`: use key=, or client_ip=, header.NAME=, \
                             query.NAME=, cookie.NAME=, jwt.CLAIM=, method=, host=, path=, model="
                        ));
                    };
                    named.parts.push((part, value));
                }
            }
        }
        Ok(named)
    }
}

/// The store key the operator's query names for `limit` of `route`; `Err` is a message for a
/// 400 answer.
pub fn store_key(
    policy: &Policy,
    route: &Route,
    limit: &Limit,
    query: &str,
) -> Result<String, String> {
    let named = NamedIdentity::parse(query)?;
    let parts: Vec<String> = limit.key.iter().map(KeyPart::to_string).collect();
    let shape = format!("the limit's key is [{}]", parts.join(", "));
    match (
        &named.key,
        named.parts.is_empty() && named.client_ip.is_none(),
    ) {
        (Some(_), false) => Err("give either key= or per-part values, not both".to_owned()),
        (Some(key), true) => from_key(policy, route, limit, key, &shape),
        (None, false) => from_parts(policy, route, limit, named, &shape),
        (None, true) => Err(format!(
            "name the identity: key= (as `sluice explain` prints it in the store key, e.g. \
             key=ip=203.0.113.9), or one value per key part (client_ip=, header.NAME=, ...); \
             {shape}"
        )),
    }
}

fn from_key(
    policy: &Policy,
    route: &Route,
    limit: &Limit,
    key: &str,
    shape: &str,
) -> Result<String, String> {
    let identity = store_key::identity_of(policy, route, limit, key);
    if !store_key::identity_fits(limit, identity) {
        return Err(format!(
            "key=`{key}` is not an identity of this limit: {shape}; give the text between \
             `{{` and `}}` of the store key `sluice explain` prints (or the whole key)"
        ));
    }
    Ok(store_key::from_identity(policy, route, limit, identity))
}

fn from_parts(
    policy: &Policy,
    route: &Route,
    limit: &Limit,
    named: NamedIdentity,
    shape: &str,
) -> Result<String, String> {
    let sketch = Sketch::of(limit, &named, shape)?;
    check_needed(route, limit, &named, &sketch.path, shape)?;
    let Sketch {
        headers,
        query,
        method,
        path,
        claims,
        model,
    } = sketch;
    let target = if query.is_empty() {
        path.clone()
    } else {
        format!("{path}?{query}")
    };
    let uri: Uri = target
        .parse()
        .map_err(|_| format!("cannot build a request for `{target}`"))?;
    let request = RequestParts {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: named.client_ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        claims: Some(&claims),
        model: model.as_deref(),
    };
    if named.client_ip.is_none() {
        if let Some(missing) = store_key::missing_part(limit, &request) {
            return Err(format!(
                "{shape}: no value for {0}; give it, or client_ip= for the bucket of requests \
                 without {0} (they count the client ip)",
                missing
            ));
        }
    }
    Ok(store_key::build(policy, route, limit, &request))
}

/// The parts of a request the key builder reads, made from the values an identity names.
struct Sketch {
    headers: HeaderMap,
    query: String,
    method: Method,
    path: String,
    /// A verified token's claims, as the operator names them: the key the gateway would
    /// build for a request whose token carries them.
    claims: crate::jwt::Claims,
    model: Option<String>,
}

impl Sketch {
    /// The request `named`'s parts describe, each part one of `limit`'s key (`shape`: the
    /// key's parts, for errors).
    fn of(limit: &Limit, named: &NamedIdentity, shape: &str) -> Result<Sketch, String> {
        let mut headers = HeaderMap::new();
        let mut query = String::new();
        let (mut method, mut path) = (Method::GET, String::from("/"));
        let mut claims = serde_json::Map::new();
        let mut model = None;
        for (part, value) in &named.parts {
            if !limit.key.contains(part) {
                return Err(format!("{shape}: it has no {}", part));
            }
            let header_value = || {
                HeaderValue::from_bytes(value)
                    .map_err(|_| format!("{}: not a valid header value", part))
            };
            match part {
                KeyPart::Header(name) => {
                    headers.append(name.clone(), header_value()?);
                }
                KeyPart::Cookie(name) => {
                    let mut field = name.clone().into_bytes();
                    field.push(b'=');
                    field.extend_from_slice(value);
                    let field = HeaderValue::from_bytes(&field)
                        .map_err(|_| format!("cookie:{name}: not a valid cookie value"))?;
                    headers.append(COOKIE, field);
                }
                KeyPart::Host => {
                    headers.insert(HOST, header_value()?);
                }
                KeyPart::Query(name) => {
                    if !query.is_empty() {
                        query.push('&');
                    }
                    encode_into(&mut query, name.as_bytes());
                    query.push('=');
                    encode_into(&mut query, value);
                }
                KeyPart::Method => {
                    method = Method::from_bytes(value)
                        .map_err(|_| "method: not an HTTP method".to_owned())?;
                }
                KeyPart::Path => {
                    let text =
                        std::str::from_utf8(value).map_err(|_| "path: not UTF-8".to_owned())?;
                    path = crate::path::normalize(text)
                        .map_err(|err| format!("path: {err}"))?
                        .into_owned();
                }
                KeyPart::Jwt(claim) => {
                    let text = std::str::from_utf8(value)
                        .map_err(|_| format!("jwt:{claim}: not UTF-8"))?;
                    claims.insert(claim.clone(), serde_json::Value::from(text));
                }
                KeyPart::Model => {
                    let text =
                        std::str::from_utf8(value).map_err(|_| "model: not UTF-8".to_owned())?;
                    model = Some(crate::model::normalise(text));
                }
                KeyPart::ClientIp | KeyPart::Param(_) => {}
            }
        }
        Ok(Sketch {
            headers,
            query,
            method,
            path,
            claims: crate::jwt::Claims::new(claims),
            model,
        })
    }
}

/// Refuses an identity that leaves out a part of `limit`'s key the request cannot do
/// without (its client ip, method, host or path), or whose `path` does not give a `param:`
/// the key reads.
fn check_needed(
    route: &Route,
    limit: &Limit,
    named: &NamedIdentity,
    path: &str,
    shape: &str,
) -> Result<(), String> {
    let given_path = named.parts.iter().any(|(p, _)| *p == KeyPart::Path);
    for part in &limit.key {
        let needed = match part {
            KeyPart::ClientIp => named.client_ip.is_none().then_some("client_ip="),
            KeyPart::Method => (!named.parts.iter().any(|(p, _)| p == part)).then_some("method="),
            KeyPart::Host => (!named.parts.iter().any(|(p, _)| p == part)).then_some("host="),
            KeyPart::Path | KeyPart::Param(_) => (!given_path).then_some("path="),
            _ => None,
        };
        if let Some(needed) = needed {
            return Err(format!("{shape}: give {needed} for its {}", part));
        }
        if let KeyPart::Param(name) = part {
            let bare = crate::path::without_parameters(path);
            if route.matcher.param(&bare, name).is_none() {
                return Err(format!(
                    "path=`{path}` does not give param:{name}: give a path route `{}` matches",
                    route.name
                ));
            }
        }
    }
    Ok(())
}

/// Percent-encodes every byte but the unreserved ones, so the key builder decodes exactly
/// `bytes` back.
pub(super) fn encode_into(out: &mut String, bytes: &[u8]) {
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encoded_query_value_decodes_to_the_same_bytes() {
        // `+`, `%`, `&`, `=` and non-ASCII bytes included: the key builder must read back
        // exactly what the operator gave.
        let bytes: Vec<u8> = (0u8..=255).collect();
        let mut text = String::new();
        encode_into(&mut text, &bytes);
        assert_eq!(percent_decode(&text), bytes);
        assert!(!text.contains(['+', '&', '=']), "{text}");
    }
}
