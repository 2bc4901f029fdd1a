//! The store key: the one file that spells it, and reads it back.
//!
//! ```text
//! prefix:route:limit[:algorithm]:{identity}[:period]
//! ```
//!
//! - `prefix` is `store.key_prefix` (`sluice` by default), then the route's and the limit's
//!   names. The algorithm's label follows when its row says `label_in_key` (all but the
//!   first algorithm, whose keys predate the others), so a reload that changes a limit's
//!   algorithm starts afresh instead of reading another algorithm's state ([`prefix`]).
//! - `{identity}` says which client the limit counts: the values of the limit's key parts,
//!   each after its label (`ip=`, `h:x-api-key=`, ...; [`part_label`]) and joined by `|`, or
//!   `*` for an empty key (`key: []`, one bucket for the whole route). The braces are a Redis
//!   Cluster hash tag, so every entry of one identity's limit lives in one slot. If a header,
//!   query parameter or cookie a limit is keyed on is missing, that limit counts the client IP
//!   instead: leaving one out must never be a way around a limit. The client address
//!   (`super::client`) is written as its network, `ip=2001:db8:1:2::/64`, or bare when the
//!   prefix is the whole address (`ip=192.0.2.7`).
//! - `:period` ends a calendar quota's key: the label of the period holding now (`:2026-11`),
//!   outside the braces so that every period of one identity is in its slot ([`check`]).
//!
//! A value taken from the request is written by [`key_text`], as the rate limit service's
//! keys are: as it came (escaped) when short and printable, otherwise hashed, so a hostile
//! client cannot make a store key large or unreadable.
//!
//! Built here for a live request ([`build`]), for an operator's per-part values and for an
//! identity an operator copied from `sluice explain` (the admin API, [`from_identity`] after
//! [`identity_fits`]); read back here too ([`identity_of`]).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

use http::header::HOST;
use http::{HeaderMap, Method, Uri};

use super::client::client_network;
use super::fields::{cookie_values, query_values};
use crate::config::KeyPart;
use crate::jwt::Claims;
use crate::limiter::key_text;
use crate::limiter::Check;
use crate::policy::{ClientPrefix, Limit, Matcher, Policy, Route};

/// What the parts of a key are read from: the request (its path already canonical) and the
/// client's address.
pub struct RequestParts<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    pub client_ip: IpAddr,
    /// The claims of the request's verified token; `None` without one (no `jwt:` on the
    /// route, or an `on_invalid: anonymous` route's missing or invalid token).
    pub claims: Option<&'a Claims>,
    /// The `model` of the request's JSON body, normalised (`crate::model`); `None` before the
    /// body is read, or when it names none.
    pub model: Option<&'a str>,
}

/// `prefix:route:limit:`, with the algorithm's label before the last `:` when its row says
/// `label_in_key`: what every key of `limit` starts with.
pub fn prefix(policy: &Policy, route: &Route, limit: &Limit) -> String {
    let mut key = String::new();
    push_prefix(&mut key, &policy.key_prefix, route.name.as_str(), limit);
    key
}

fn push_prefix(key: &mut String, store: &str, route: &str, limit: &Limit) {
    for name in [store, route, limit.name.as_str()] {
        key.push_str(name);
        key.push(':');
    }
    let traits = limit.spec.algorithm.traits();
    if traits.label_in_key {
        key.push_str(traits.label);
        key.push(':');
    }
}

/// The store key of `limit`, a limit of `route`, for `request`, without a calendar quota's
/// period ([`check`] adds it): what a live request is checked under. The admin API builds a
/// request from an operator's per-part values and asks here too, so it never spells a key
/// differently from the gateway.
pub fn build(policy: &Policy, route: &Route, limit: &Limit, request: &RequestParts<'_>) -> String {
    let route_name = route.name.as_str();
    key(
        [policy.key_prefix.as_str(), route_name],
        &route.matcher,
        limit,
        request,
    )
}

/// The store key of the identity `identity` (checked with [`identity_fits`]) of `limit`.
pub fn from_identity(policy: &Policy, route: &Route, limit: &Limit, identity: &str) -> String {
    let mut key = prefix(policy, route, limit);
    key.push('{');
    key.push_str(identity);
    key.push('}');
    key
}

/// The identity in `key` (what is between the braces), given whole (`prefix...{identity}`,
/// a quota's `:period` after it or not) or as the bare identity; `key` as it is when it has
/// no braces.
pub fn identity_of<'k>(policy: &Policy, route: &Route, limit: &Limit, key: &'k str) -> &'k str {
    let rest = key
        .strip_prefix(prefix(policy, route, limit).as_str())
        .unwrap_or(key);
    rest.strip_prefix('{')
        .and_then(|inner| inner.rfind('}').map(|end| &inner[..end]))
        .unwrap_or(rest)
}

/// The check of `limit` for the store key `key`, at `now` (sluice's wall clock,
/// `crate::runtime::clock`): the one place a `Check` is built. A calendar quota's key gets the
/// label of the period holding `now`, and its window is the time left in that period.
pub fn check(limit: &Limit, key: String, now: jiff::Timestamp) -> Check {
    let mut check = Check {
        key,
        spec: limit.spec,
    };
    if let Some(quota) = &limit.quota {
        check.key.push(':');
        match quota.span_at(now) {
            Ok(span) => {
                span.push_label(&mut check.key);
                check.spec.window = span.left_at(now);
            }
            // Only a clock set beyond the year 9999 gets here: count in a key of its own,
            // one second at a time, rather than fail the request.
            Err(_) => {
                check.key.push_str("beyond-the-calendar");
                check.spec.window = Duration::from_secs(1);
            }
        }
    }
    check
}

/// Writes the client's network as a key part's value: `2001:db8:1:2::/64`, or the bare
/// address when the prefix is all of it.
fn push_client(key: &mut String, ip: IpAddr, prefix: ClientPrefix) {
    let (network, bits) = client_network(ip, prefix);
    let _ = write!(key, "{network}");
    if bits < if network.is_ipv4() { 32 } else { 128 } {
        let _ = write!(key, "/{bits}");
    }
}

/// `names`: the policy's `key_prefix` and the route's name; `matcher`: the route's, for its
/// path parameters and whether it compares paths case-sensitively (a `path` part is
/// lower-cased otherwise, so that `/LOGIN` is not a bucket of its own).
fn key(
    [store, route]: [&str; 2],
    matcher: &Matcher,
    limit: &Limit,
    request: &RequestParts<'_>,
) -> String {
    let mut key = String::with_capacity(store.len() + route.len() + 64);
    push_prefix(&mut key, store, route, limit);
    key.push('{');
    if limit.key.is_empty() {
        key.push('*');
    } else if limit.key.iter().all(|part| present(part, request)) {
        for (index, part) in limit.key.iter().enumerate() {
            if index > 0 {
                key.push('|');
            }
            push_part(&mut key, part, limit.client_prefix, matcher, request);
        }
    } else {
        push_part(
            &mut key,
            &KeyPart::ClientIp,
            limit.client_prefix,
            matcher,
            request,
        );
    }
    key.push('}');
    key
}

/// How a part's value is labelled inside the identity (`ip=`, `h:x-api-key=`, ...).
pub fn part_label(part: &KeyPart) -> Cow<'static, str> {
    match part {
        KeyPart::ClientIp => Cow::Borrowed("ip="),
        KeyPart::Header(name) => Cow::Owned(format!("h:{name}=")),
        KeyPart::Query(name) => Cow::Owned(format!("q:{name}=")),
        KeyPart::Cookie(name) => Cow::Owned(format!("c:{name}=")),
        KeyPart::Method => Cow::Borrowed("m="),
        KeyPart::Host => Cow::Borrowed("host="),
        KeyPart::Param(name) => Cow::Owned(format!("param:{name}=")),
        KeyPart::Path => Cow::Borrowed("p="),
        KeyPart::Jwt(claim) => Cow::Owned(format!("jwt:{claim}=")),
        KeyPart::Model => Cow::Borrowed("model="),
    }
}

/// Whether `identity` (the part of a store key between `{` and `}`) has the shape `limit`'s
/// keys have: `*` for an empty key, its parts' labels in order joined by `|`, or the client
/// IP a request lacking a part counts instead. Values are escaped (`|`, `{`, `}` never appear
/// raw), so splitting on `|` finds the parts.
pub fn identity_fits(limit: &Limit, identity: &str) -> bool {
    let printable = |s: &str| s.bytes().all(|b| (0x21..=0x7E).contains(&b));
    if identity.is_empty() || !printable(identity) || identity.contains(['{', '}']) {
        return false;
    }
    if limit.key.is_empty() {
        return identity == "*";
    }
    let segments: Vec<&str> = identity.split('|').collect();
    let fits = segments.len() == limit.key.len()
        && segments
            .iter()
            .zip(&limit.key)
            .all(|(segment, part)| segment.starts_with(&*part_label(part)));
    fits || (segments.len() == 1 && identity.starts_with("ip="))
}

/// The first part of `limit`'s key the request lacks, if any: the limit then counts the
/// client IP instead.
pub fn missing_part<'a>(limit: &'a Limit, request: &RequestParts<'_>) -> Option<&'a KeyPart> {
    limit.key.iter().find(|part| !present(part, request))
}

fn present(part: &KeyPart, request: &RequestParts<'_>) -> bool {
    match part {
        KeyPart::ClientIp | KeyPart::Method | KeyPart::Host | KeyPart::Path => true,
        // Checked against the route's pattern when the policy is compiled.
        KeyPart::Param(_) => true,
        KeyPart::Header(name) => request.headers.contains_key(name),
        KeyPart::Query(name) => query_values(request.uri, name).next().is_some(),
        KeyPart::Cookie(name) => cookie_values(request.headers, name).next().is_some(),
        KeyPart::Jwt(claim) => request
            .claims
            .is_some_and(|claims| claims.text(claim).is_some()),
        KeyPart::Model => request.model.is_some(),
    }
}

fn push_part(
    key: &mut String,
    part: &KeyPart,
    prefix: ClientPrefix,
    matcher: &Matcher,
    request: &RequestParts<'_>,
) {
    match part {
        KeyPart::ClientIp => {
            key.push_str("ip=");
            push_client(key, request.client_ip, prefix);
        }
        KeyPart::Header(name) => {
            let _ = write!(key, "h:{name}=");
            let values: Vec<&[u8]> = request
                .headers
                .get_all(name)
                .iter()
                .map(|value| value.as_bytes())
                .collect();
            push_values(key, &values);
        }
        KeyPart::Query(name) => {
            let _ = write!(key, "q:{name}=");
            let values: Vec<Vec<u8>> = query_values(request.uri, name).collect();
            push_values(key, &values);
        }
        KeyPart::Cookie(name) => {
            let _ = write!(key, "c:{name}=");
            let values: Vec<&[u8]> = cookie_values(request.headers, name).collect();
            push_values(key, &values);
        }
        KeyPart::Method => {
            key.push_str("m=");
            push_values(key, &[request.method.as_str()]);
        }
        KeyPart::Host => {
            key.push_str("host=");
            let host = request
                .headers
                .get(HOST)
                .map(|value| value.as_bytes())
                .or_else(|| request.uri.authority().map(|a| a.as_str().as_bytes()))
                .unwrap_or_default();
            push_values(key, &[host.to_ascii_lowercase()]);
        }
        KeyPart::Param(name) => {
            let _ = write!(key, "param:{name}=");
            let path = crate::path::without_parameters(request.uri.path());
            let value = matcher.param(&path, name).unwrap_or_default();
            push_values(key, &[value.as_bytes()]);
        }
        KeyPart::Path => {
            key.push_str("p=");
            // The path as the route matched it, so no other spelling is another bucket.
            let path = crate::path::without_parameters(request.uri.path());
            let path = if matcher.case_sensitive() {
                path
            } else {
                Cow::Owned(path.to_ascii_lowercase())
            };
            push_values(key, &[path.as_bytes()]);
        }
        KeyPart::Jwt(claim) => {
            let _ = write!(key, "jwt:{claim}=");
            let value = request.claims.and_then(|claims| claims.text(claim));
            push_values(key, &[value.as_ref().map_or("", |v| v.as_str())]);
        }
        KeyPart::Model => {
            key.push_str("model=");
            push_values(key, &[request.model.unwrap_or_default()]);
        }
    }
}

/// The separators of this key shape a value must not forge (`key_text` adds `%`, `,`, `#`).
const RESERVED: &[u8] = b"|{}";

/// Writes the values of one key part (see `key_text::push_values`).
fn push_values<V: AsRef<[u8]>>(key: &mut String, values: &[V]) {
    key_text::push_values(key, values, RESERVED);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{ForwardedHeader, IpNet};
    use crate::policy::Field;
    use crate::request::client::client_ip;
    use crate::request::fields::repeated_field;
    use http::header::{HeaderName, HeaderValue};

    pub(crate) fn limit(parts: Vec<KeyPart>) -> Limit {
        let metrics = crate::metrics::Metrics::new().unwrap();
        Limit {
            settings: crate::policy::LimitSettings {
                name: "l".parse().unwrap(),
                key: parts,
                spec: crate::limiter::Spec {
                    algorithm: crate::limiter::Algorithm::SlidingLog,
                    requests: 1,
                    window: Duration::from_secs(1),
                    burst: 1,
                    cost: 1,
                    ..crate::limiter::Spec::default()
                },
                count: None,
                when: Vec::new(),
                quota: None,
                client_prefix: ClientPrefix::default(),
                tokens: None,
                report: false,
            },
            metrics: metrics.for_limit("r", "l"),
        }
    }

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7));
    const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

    /// The key of `limit` for a GET of `target` with `headers`, from `IP`.
    pub(crate) fn key_of(limit: &Limit, target: &str, headers: &HeaderMap) -> String {
        let uri: Uri = target.parse().unwrap();
        let request = RequestParts {
            method: &Method::GET,
            uri: &uri,
            headers,
            client_ip: IP,
            claims: None,
            model: None,
        };
        let matcher = Matcher::new(&crate::config::MatchConfig {
            path_prefix: crate::config::PathPrefix("/".to_owned()),
            methods: Vec::new(),
            case_sensitive: false,
        });
        key(["sluice", "r"], &matcher, limit, &request)
    }

    #[test]
    fn header_identity() {
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, HeaderValue::from_static("abc"));
        let key = key_of(&limit(vec![KeyPart::Header(API_KEY)]), "/", &headers);
        assert_eq!(key, "sluice:r:l:{h:x-api-key=abc}");
    }

    #[test]
    fn a_missing_header_falls_back_to_the_client_ip() {
        let key = key_of(
            &limit(vec![KeyPart::Header(API_KEY), KeyPart::ClientIp]),
            "/",
            &HeaderMap::new(),
        );
        assert_eq!(key, "sluice:r:l:{ip=10.0.0.7}");
    }

    #[test]
    fn composite_keys_and_escaping() {
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, HeaderValue::from_static("a|b}{ %"));
        let key = key_of(
            &limit(vec![KeyPart::ClientIp, KeyPart::Header(API_KEY)]),
            "/",
            &headers,
        );
        assert_eq!(
            key,
            "sluice:r:l:{ip=10.0.0.7|h:x-api-key=a%7Cb%7D%7B%20%25}"
        );
    }

    fn header_key(values: &[&[u8]]) -> String {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(API_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        key_of(&limit(vec![KeyPart::Header(API_KEY)]), "/", &headers)
    }

    #[test]
    fn long_or_binary_values_are_hashed_to_a_fixed_length() {
        let long = header_key(&[&[b'k'; 200_000]]);
        let binary = header_key(&[b"caf\xc3\xa9"]);
        let raw = header_key(&[&[b'k'; key_text::MAX_RAW_VALUE]]);
        for hashed in [&long, &binary] {
            let (head, hash) = hashed.split_once('#').unwrap();
            assert_eq!(head, "sluice:r:l:{h:x-api-key=");
            assert_eq!(hash.len(), key_text::HASH_HEX_DIGITS + 1, "{hashed}");
            assert!(hash.ends_with('}'));
        }
        assert_ne!(long, header_key(&[&[b'k'; 200_001]]));
        assert!(!raw.contains('#'), "{raw}");
    }

    #[test]
    fn a_raw_value_never_looks_hashed_or_splits_differently() {
        assert_ne!(header_key(&[b"a", b"b"]), header_key(&[b"a,b"]));
        assert_ne!(header_key(&[b"#abc"]), header_key(&[b"abc"]));
        assert!(header_key(&[b"#abc"]).contains("=%23abc"));
        let long = [b'x'; 100];
        assert_ne!(header_key(&[&long, b""]), header_key(&[&long]));
    }

    /// Bytes a header value may hold (RFC 9110: tab, visible ASCII, space, obs-text), with
    /// the key's own separators common so they are often mixed in.
    fn header_values() -> impl proptest::strategy::Strategy<Value = Vec<Vec<u8>>> {
        use proptest::prelude::*;
        let byte = prop_oneof![
            4 => proptest::sample::select(b"%|{},#=:a".to_vec()),
            4 => 0x20u8..=0x7e,
            1 => Just(b'\t'),
            1 => 0x80u8..=0xff,
        ];
        proptest::collection::vec(proptest::collection::vec(byte, 0..90), 1..3)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn distinct_values_give_distinct_keys_of_one_shape(a in header_values(), b in header_values()) {
            let slices_a: Vec<&[u8]> = a.iter().map(Vec::as_slice).collect();
            let slices_b: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
            let (key_a, key_b) = (header_key(&slices_a), header_key(&slices_b));
            proptest::prop_assert_eq!(a == b, key_a == key_b);
            const HEAD: &str = "sluice:r:l:{h:x-api-key=";
            for key in [&key_a, &key_b] {
                // One hash tag, closing the key; nothing from the value can open or close one.
                let (open, close) = ('{', '}');
                proptest::prop_assert!(key.starts_with(HEAD));
                proptest::prop_assert!(key.ends_with(close));
                proptest::prop_assert_eq!(key.matches(open).count(), 1);
                proptest::prop_assert_eq!(key.matches(close).count(), 1);
                proptest::prop_assert!(!key.contains('|'));
                proptest::prop_assert!(key.bytes().all(|b| (0x21..=0x7E).contains(&b)));
                let longest = HEAD.len() + 1 + 3 * (key_text::MAX_RAW_VALUE + 1);
                proptest::prop_assert!(key.len() <= longest);
            }
        }

        #[test]
        fn two_values_apart_differ_from_one(a in header_values()) {
            // Equal-looking single and split values never share a key.
            let joined: Vec<u8> = a.join(&b","[..]);
            let slices: Vec<&[u8]> = a.iter().map(Vec::as_slice).collect();
            if a.len() > 1 {
                proptest::prop_assert_ne!(header_key(&slices), header_key(&[&joined]));
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Whatever a client writes in the forwarded-for headers, an untrusted peer is the
        /// client, and a trusted one yields the peer or an address the header named; nothing
        /// panics.
        #[test]
        fn forwarded_headers_never_lift_an_untrusted_peer(
            hops in proptest::collection::vec(proptest::sample::select(vec![
                "198.51.100.7", "10.1.1.1", "::1", "[2001:db8::1]:80", "203.0.113.9:4711",
                "unknown", "_hidden", "garbage", "", " 10.2.2.2 ",
            ]), 0..5),
        ) {
            let xff = hops.join(",");
            let forwarded = hops
                .iter()
                .map(|hop| format!("for=\"{hop}\";proto=http"))
                .collect::<Vec<_>>()
                .join(", ");
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_str(&xff) {
                headers.insert("x-forwarded-for", value);
            }
            if let Ok(value) = HeaderValue::from_str(&forwarded) {
                headers.insert("forwarded", value);
            }
            let trusted: IpNet = "10.0.0.0/8".parse().unwrap();
            for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
                let stranger: IpAddr = "192.0.2.1".parse().unwrap();
                let untrusted = client_ip(stranger, &headers, &[trusted], header);
                proptest::prop_assert_eq!(untrusted, stranger);
                let peer: IpAddr = "10.1.2.3".parse().unwrap();
                let found = client_ip(peer, &headers, &[trusted], header);
                let named = xff.contains(&found.to_string()) || forwarded.contains(&found.to_string());
                proptest::prop_assert!(found == peer || named, "{found}");
            }
        }

        /// A query string carrying the identity parameter `k` twice or more, in any spelling
        /// of its name and among any others, is a repeated field; once or never is not.
        #[test]
        fn a_repeated_query_identity_is_always_found(
            pairs in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["k", "%6B", "%6b", "x", "kk", "k%20", "%4B"]),
                    "[a-z0-9%+]{0,6}",
                    proptest::prelude::any::<bool>(),
                ),
                0..6,
            ),
        ) {
            let query = pairs
                .iter()
                .map(|(name, value, bare)| {
                    if *bare { (*name).to_owned() } else { format!("{name}={value}") }
                })
                .collect::<Vec<_>>()
                .join("&");
            let named_k = pairs
                .iter()
                .filter(|(name, _, _)| matches!(*name, "k" | "%6B" | "%6b"))
                .count();
            let uri: Uri = format!("/?{query}").parse().unwrap();
            let fields = [Field::Query("k".to_owned())];
            let found = repeated_field(&fields, &uri, &HeaderMap::new());
            proptest::prop_assert_eq!(found.is_some(), named_k >= 2, "{}", query);
        }

        /// Any query string and cookie field gives a key of one shape, and the identity is
        /// the decoded value: two spellings of one value share a key.
        #[test]
        fn query_and_cookie_parts_keep_the_key_shape(
            query in "[a-z0-9=&%+;._~-]{0,40}",
            cookie in "[a-z0-9=; \"._-]{0,40}",
        ) {
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_str(&cookie) {
                headers.insert("cookie", value);
            }
            let parts = vec![
                KeyPart::Query("k".to_owned()),
                KeyPart::Cookie("c".to_owned()),
            ];
            let key = key_of(&limit(parts), &format!("/?{query}"), &headers);
            let (open, close) = ('{', '}');
            let head = format!("sluice:r:l:{open}");
            proptest::prop_assert!(key.starts_with(&head));
            proptest::prop_assert!(key.ends_with(close));
            proptest::prop_assert_eq!(key.matches(open).count(), 1);
            proptest::prop_assert_eq!(key.matches(close).count(), 1);
        }
    }

    #[test]
    fn each_part_is_written_after_its_label_and_fits() {
        let parts = vec![
            KeyPart::ClientIp,
            KeyPart::Header(API_KEY),
            KeyPart::Query("k".to_owned()),
            KeyPart::Cookie("c".to_owned()),
            KeyPart::Method,
            KeyPart::Host,
            KeyPart::Path,
        ];
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, HeaderValue::from_static("a|b"));
        headers.insert("cookie", HeaderValue::from_static("c=v"));
        headers.insert("host", HeaderValue::from_static("h"));
        for part in &parts {
            let one = limit(vec![part.clone()]);
            let key = key_of(&one, "/x?k=1", &headers);
            let identity = &key["sluice:r:l:{".len()..key.len() - 1];
            assert!(identity.starts_with(&*part_label(part)), "{key}");
            assert!(identity_fits(&one, identity), "{identity}");
        }
        let all = limit(parts);
        let key = key_of(&all, "/x?k=1", &headers);
        let identity = &key["sluice:r:l:{".len()..key.len() - 1];
        assert!(identity_fits(&all, identity), "{identity}");
        assert!(
            identity_fits(&all, "ip=10.0.0.7"),
            "the fallback to the client ip"
        );
        assert!(!identity_fits(&all, "h:x-api-key=a"), "parts missing");
        assert!(!identity_fits(&all, "ip=1|x}"), "braces");
        assert!(!identity_fits(&limit(Vec::new()), "ip=1"));
        assert!(identity_fits(&limit(Vec::new()), "*"));
    }

    #[test]
    fn query_spellings_of_one_value_share_a_key() {
        let limit = limit(vec![KeyPart::Query("key".to_owned())]);
        let plain = key_of(&limit, "/?key=a+b%2Fc", &HeaderMap::new());
        assert_eq!(
            plain,
            key_of(&limit, "/?x=1&%6Bey=a%20b/c", &HeaderMap::new())
        );
        assert_ne!(plain, key_of(&limit, "/?key=a+b%2Fd", &HeaderMap::new()));
    }

    fn ip_key(ip: &str, prefix: ClientPrefix) -> String {
        let mut one = limit(vec![KeyPart::ClientIp]);
        one.settings.client_prefix = prefix;
        let uri: Uri = "/".parse().unwrap();
        let headers = HeaderMap::new();
        let request = RequestParts {
            method: &Method::GET,
            uri: &uri,
            headers: &headers,
            client_ip: ip.parse().unwrap(),
            claims: None,
            model: None,
        };
        let matcher = Matcher::new(&crate::config::MatchConfig {
            path_prefix: crate::config::PathPrefix("/".to_owned()),
            methods: Vec::new(),
            case_sensitive: false,
        });
        key(["sluice", "r"], &matcher, &one, &request)
    }

    #[test]
    fn client_addresses_count_by_their_network() {
        let default = ClientPrefix::default();
        assert_eq!(
            ip_key("2001:db8:1:2:aaaa::1", default),
            "sluice:r:l:{ip=2001:db8:1:2::/64}"
        );
        assert_eq!(
            ip_key("2001:db8:1:2:ffff:ffff:ffff:ffff", default),
            ip_key("2001:db8:1:2::", default)
        );
        assert_ne!(
            ip_key("2001:db8:1:3::1", default),
            ip_key("2001:db8:1:2::1", default)
        );
        assert_eq!(ip_key("192.0.2.7", default), "sluice:r:l:{ip=192.0.2.7}");
        assert_eq!(
            ip_key("::ffff:192.0.2.7", default),
            ip_key("192.0.2.7", default),
            "the IPv4-mapped form is the IPv4 client"
        );
        let wide = ClientPrefix { ipv4: 24, ipv6: 48 };
        assert_eq!(
            ip_key("2001:db8:1:3::1", wide),
            "sluice:r:l:{ip=2001:db8:1::/48}"
        );
        assert_eq!(ip_key("192.0.2.7", wide), "sluice:r:l:{ip=192.0.2.0/24}");
        let whole = ClientPrefix {
            ipv4: 32,
            ipv6: 128,
        };
        assert_eq!(ip_key("2001:db8::7", whole), "sluice:r:l:{ip=2001:db8::7}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// The network an address counts as holds it, has no host bits, is its own network,
        /// and two addresses share one exactly when their first `bits` bits agree; an
        /// IPv4-mapped address counts as its IPv4 address.
        #[test]
        fn masking_keeps_exactly_the_prefix(
            a in proptest::prelude::any::<u128>(),
            b in proptest::prelude::any::<u128>(),
            flip in 0u32..128,
            v6 in 1u8..=128,
            v4 in 1u8..=32,
        ) {
            let prefix = ClientPrefix { ipv4: v4, ipv6: v6 };
            // Half the time `b` shares a long prefix with `a`, so both outcomes occur.
            let b = if b % 2 == 0 { a ^ (1u128 << flip) } else { b };
            let ip = |x: u128| IpAddr::V6(std::net::Ipv6Addr::from(x));
            let (net, bits) = client_network(ip(a), prefix);
            let IpAddr::V6(net6) = net else {
                // A mapped address: its IPv4 part, by the IPv4 prefix.
                let mapped = std::net::Ipv6Addr::from(a).to_ipv4_mapped().unwrap();
                let (v4net, v4bits) = client_network(IpAddr::V4(mapped), prefix);
                proptest::prop_assert_eq!((net, bits), (v4net, v4bits));
                proptest::prop_assert_eq!(bits, v4);
                return Ok(());
            };
            proptest::prop_assert_eq!(bits, v6);
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            proptest::prop_assert_eq!(u128::from(net6), a & mask);
            proptest::prop_assert_eq!(client_network(net, prefix), (net, bits));
            if std::net::Ipv6Addr::from(b).to_ipv4_mapped().is_none() {
                let same = client_network(ip(b), prefix).0 == net;
                proptest::prop_assert_eq!(same, (a ^ b) & mask == 0);
            }
            let four = std::net::Ipv4Addr::from(a as u32);
            let mapped = IpAddr::V6(four.to_ipv6_mapped());
            proptest::prop_assert_eq!(
                client_network(mapped, prefix),
                client_network(IpAddr::V4(four), prefix)
            );
            let (net4, bits4) = client_network(IpAddr::V4(four), prefix);
            let mask4 = u32::MAX.checked_shl(32 - u32::from(bits4)).unwrap_or(0);
            proptest::prop_assert_eq!(net4, IpAddr::V4((a as u32 & mask4).into()));
        }
    }
}
