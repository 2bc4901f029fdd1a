//! The one-reading rules: one request for the router, the limiter and the upstream. A limit protects nothing if the
//! limiter counts one reading of a request and the upstream acts on another, so before
//! anything routes on a request or reads an identity from it, this phase makes the request
//! that will be forwarded the only one there is to read, or refuses it (400) where no single
//! reading exists:
//!
//! - a standard method spelled in another case (`post`): the upstream may dispatch it as
//!   `POST` while a route on `POST` does not match it (nginx answers 400 too);
//! - `Cookie` fields sent separately (HTTP/2 "crumbs", RFC 9113 §8.2.3) are joined into one
//!   with `; `, which is what is read and forwarded;
//! - the fields a `Connection` option names are removed here, not only when forwarding, and
//!   a `Connection` naming a field the policy reads is refused: otherwise the limiter would
//!   count a field the upstream never receives;
//! - once routed, a field the route's limits read (key part or `when:`) that appears more
//!   than once is refused: frameworks differ on which copy they read, so no count of one copy
//!   or of their join is the request the upstream acts on.

use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, COOKIE};
use http::request::Parts;
use http::{Method, Uri};

use super::fields;
use crate::config::HOP_BY_HOP;
use crate::metrics::Refusal;
use crate::policy::{Field, Policy};

/// Why a request has no single reading: what to tell the client (always with 400), and the
/// reason it is counted under.
#[derive(Debug)]
pub struct Ambiguous {
    pub detail: String,
    pub reason: Refusal,
}

/// Before routing: refuses a respelled standard method, joins cookie crumbs and removes the
/// fields `Connection` names (refusing one `policy` reads).
pub fn prepare(head: &mut Parts, policy: &Policy) -> Result<(), Ambiguous> {
    check_method(&head.method)?;
    join_cookie_crumbs(&mut head.headers);
    remove_connection_options(&mut head.headers, &policy.connection_guarded)
}

/// The methods of RFC 9110 §9 and PATCH (RFC 5789), as HTTP spells them.
const STANDARD_METHODS: [Method; 9] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::CONNECT,
    Method::OPTIONS,
    Method::TRACE,
    Method::PATCH,
];

/// Methods are case-sensitive (RFC 9110 §9.1), but several frameworks upper-case a method
/// before dispatching it: `post` would reach the POST handler past a route on `POST`. A
/// method that is no standard one in any case (`PURGE`, `purge`) is the upstream's business.
pub fn check_method(method: &Method) -> Result<(), Ambiguous> {
    let sent = method.as_str();
    match STANDARD_METHODS
        .iter()
        .find(|standard| standard.as_str().eq_ignore_ascii_case(sent))
    {
        Some(standard) if standard != method => Err(Ambiguous {
            detail: format!(
                "the method `{sent}` is `{standard}` spelled in another case; methods are \
                 case-sensitive: send `{standard}`"
            ),
            reason: Refusal::MethodSpelling,
        }),
        _ => Ok(()),
    }
}

/// Joins several `Cookie` fields into one, separated by `; ` (RFC 9113 §8.2.3; an HTTP/1.1
/// client sends one, RFC 6265 §5.4), so the cookie key part and the upstream read the same
/// single line. One field or none is left as it is, without allocating.
pub fn join_cookie_crumbs(headers: &mut HeaderMap) {
    let mut values = headers.get_all(COOKIE).iter();
    if values.next().is_none() || values.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    for value in headers.get_all(COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    // Valid field values joined with `; ` are a valid field value.
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(COOKIE, value);
    }
}

/// The `Connection` options the proxy acts on itself when it forwards (see `crate::proxy::upstream`'s header rewriting):
/// the hop-by-hop fields it removes anyway, and `close`. They are kept in `Connection`.
fn kept_option(option: &[u8]) -> Option<&'static str> {
    std::iter::once("close")
        .chain(HOP_BY_HOP)
        .find(|fixed| fixed.as_bytes().eq_ignore_ascii_case(option))
}

/// Removes every field a `Connection` option names (RFC 9110 §7.6.1) and leaves in
/// `Connection` only the options the proxy acts on later, so forwarding removes nothing more
/// than what was read here. An option naming one of `guarded` is refused.
pub fn remove_connection_options(
    headers: &mut HeaderMap,
    guarded: &[HeaderName],
) -> Result<(), Ambiguous> {
    if !headers.contains_key(CONNECTION) {
        return Ok(());
    }
    let mut named: Vec<HeaderName> = Vec::new();
    let mut kept = String::new();
    let options = headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|option| !option.is_empty());
    for option in options {
        if let Some(fixed) = kept_option(option) {
            if !kept.is_empty() {
                kept.push_str(", ");
            }
            kept.push_str(fixed);
            continue;
        }
        // An option that is no field name names nothing there is to remove.
        let Ok(name) = HeaderName::from_bytes(option) else {
            continue;
        };
        if guarded.contains(&name) {
            return Err(Ambiguous {
                detail: format!(
                    "the Connection header names {name}, a field the rate limits or routes \
                     read; it would be removed before forwarding, so the upstream would not \
                     see what was counted"
                ),
                reason: Refusal::ConnectionField,
            });
        }
        named.push(name);
    }
    for name in named {
        headers.remove(name);
    }
    if kept.is_empty() {
        headers.remove(CONNECTION);
    } else if let Ok(value) = HeaderValue::from_str(&kept) {
        headers.insert(CONNECTION, value);
    }
    Ok(())
}

/// Once routed: refuses a request in which one of `fields` (those the route's limits read)
/// appears more than once.
pub fn check_fields(fields: &[Field], uri: &Uri, headers: &HeaderMap) -> Result<(), Ambiguous> {
    match fields::repeated_field(fields, uri, headers) {
        None => Ok(()),
        Some(field) => Err(Ambiguous {
            detail: format!(
                "{field} appears more than once; this route's rate limits read it, and the \
                 upstream could act on another copy than the one counted: send it once"
            ),
            reason: Refusal::RepeatedField,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KeyPart;
    use crate::request::store_key::tests::{key_of, limit};

    #[test]
    fn respelled_standard_methods_are_refused_and_others_pass() {
        for sent in ["post", "Get", "hEAD", "patch", "DeLeTe"] {
            let method = Method::from_bytes(sent.as_bytes()).unwrap();
            let refused = check_method(&method).unwrap_err();
            assert!(matches!(refused.reason, Refusal::MethodSpelling));
            assert!(refused.detail.contains(&format!("`{sent}`")), "{refused:?}");
        }
        for sent in ["GET", "POST", "PURGE", "purge", "PROPFIND"] {
            let method = Method::from_bytes(sent.as_bytes()).unwrap();
            assert!(check_method(&method).is_ok(), "{sent}");
        }
    }

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn crumbs_become_one_cookie_field_in_order() {
        let mut map = headers(&[("cookie", "a=1"), ("x", "y"), ("cookie", "b=2; c=3")]);
        join_cookie_crumbs(&mut map);
        let cookies: Vec<_> = map.get_all(COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1; b=2; c=3"]);
        let mut one = headers(&[("cookie", "a=1")]);
        join_cookie_crumbs(&mut one);
        assert_eq!(one[COOKIE], "a=1");
    }

    #[test]
    fn connection_options_are_removed_and_guarded_ones_refused() {
        let guarded = [HeaderName::from_static("x-api-key"), COOKIE];
        let mut map = headers(&[
            ("connection", "keep-alive, X-Other"),
            ("connection", "Upgrade"),
            ("x-other", "1"),
            ("x-api-key", "k"),
            ("upgrade", "websocket"),
        ]);
        remove_connection_options(&mut map, &guarded).unwrap();
        assert!(!map.contains_key("x-other"));
        assert_eq!(map["x-api-key"], "k");
        assert_eq!(map[CONNECTION], "keep-alive, upgrade");
        assert_eq!(map["upgrade"], "websocket", "removed when forwarding");

        for named in ["X-API-KEY", "close, x-api-key", "cookie"] {
            let mut map = headers(&[("connection", named), ("x-api-key", "k")]);
            let refused = remove_connection_options(&mut map, &guarded).unwrap_err();
            assert!(matches!(refused.reason, Refusal::ConnectionField));
            let lower = named.rsplit(' ').next().unwrap().to_ascii_lowercase();
            assert!(refused.detail.contains(&lower), "{refused:?}");
        }
        let mut only_other = headers(&[("connection", "x-other"), ("x-other", "1")]);
        remove_connection_options(&mut only_other, &guarded).unwrap();
        assert!(only_other.is_empty(), "{only_other:?}");
    }

    proptest::proptest! {
        /// The same cookies split into crumbs anywhere, once joined, give the key of the
        /// single field, and a name in two crumbs is a repeated field.
        #[test]
        fn cookie_crumbs_in_any_split_give_one_key(
            values in proptest::collection::vec("[a-zA-Z0-9._-]{1,8}", 1..6),
            cuts in proptest::collection::vec(proptest::prelude::any::<bool>(), 6),
            at in 0usize..6,
        ) {
            // Distinct names, `c` (the one keyed on) among them.
            let at = at % values.len();
            let pairs: Vec<String> = values
                .iter()
                .enumerate()
                .map(|(i, v)| if i == at { format!("c={v}") } else { format!("n{i}={v}") })
                .collect();
            let mut single = HeaderMap::new();
            single.insert("cookie", HeaderValue::from_str(&pairs.join("; ")).unwrap());
            let mut crumbs = HeaderMap::new();
            let mut crumb = Vec::new();
            for (i, pair) in pairs.iter().enumerate() {
                crumb.push(pair.as_str());
                if cuts[i] || i + 1 == pairs.len() {
                    crumbs.append("cookie", HeaderValue::from_str(&crumb.join("; ")).unwrap());
                    crumb.clear();
                }
            }
            join_cookie_crumbs(&mut crumbs);
            proptest::prop_assert_eq!(crumbs.get_all("cookie").iter().count(), 1);
            let limit = limit(vec![KeyPart::Cookie("c".to_owned())]);
            proptest::prop_assert_eq!(key_of(&limit, "/", &crumbs), key_of(&limit, "/", &single));
            let fields = [Field::Cookie("c".to_owned())];
            let uri: Uri = "/".parse().unwrap();
            proptest::prop_assert!(fields::repeated_field(&fields, &uri, &crumbs).is_none());
            crumbs.append("cookie", HeaderValue::from_static("c=junk"));
            join_cookie_crumbs(&mut crumbs);
            proptest::prop_assert!(fields::repeated_field(&fields, &uri, &crumbs).is_some());
        }
    }
}
