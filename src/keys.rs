//! From a request to the store keys of its route's limits: which client each limit counts.
//!
//! A key is `prefix:route:limit:{identity}`. The identity is wrapped in a Redis Cluster hash
//! tag so all entries of one identity's limit live in one slot. If a header a limit is keyed
//! on is missing, that limit counts the client IP instead: leaving a header out must never be a
//! way around a limit.
//!
//! A value taken from the request is written as it came (with the key's separators escaped)
//! only when it is short and printable; anything longer than [`MAX_RAW_VALUE`] bytes, or with
//! a byte outside printable ASCII, is written as `#` and a SHA-256 of the value truncated to
//! 128 bits, so a hostile client cannot make a store key large or unreadable.

use std::fmt::Write as _;
use std::net::IpAddr;

use http::header::{GetAll, HeaderValue};
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::config::KeyPart;
use crate::limiter::Check;
use crate::policy::{Limit, Route};

/// One check per limit of the route, in the route's order.
pub fn checks(route: &Route, headers: &HeaderMap, client_ip: IpAddr) -> Vec<Check> {
    route
        .limits
        .iter()
        .map(|limit| limit.check(key(limit, headers, client_ip)))
        .collect()
}

fn key(limit: &Limit, headers: &HeaderMap, client_ip: IpAddr) -> String {
    let mut key = String::with_capacity(limit.key_prefix.len() + 48);
    key.push_str(&limit.key_prefix);
    key.push('{');
    let complete = limit.key.iter().all(|part| match part {
        KeyPart::ClientIp => true,
        KeyPart::Header(name) => headers.contains_key(name),
    });
    if complete {
        for (index, part) in limit.key.iter().enumerate() {
            if index > 0 {
                key.push('|');
            }
            push_part(&mut key, part, headers, client_ip);
        }
    } else {
        push_part(&mut key, &KeyPart::ClientIp, headers, client_ip);
    }
    key.push('}');
    key
}

fn push_part(key: &mut String, part: &KeyPart, headers: &HeaderMap, client_ip: IpAddr) {
    match part {
        KeyPart::ClientIp => {
            let _ = write!(key, "ip={client_ip}");
        }
        KeyPart::Header(name) => {
            key.push_str("h:");
            key.push_str(name.as_str());
            key.push('=');
            push_values(key, headers.get_all(name));
        }
    }
}

/// Longest value, in bytes, written into a key as it came; longer values are hashed.
pub const MAX_RAW_VALUE: usize = 64;

/// Hex digits of the truncated SHA-256 written for a hashed value (128 bits).
const HASH_HEX_DIGITS: usize = 32;

/// Writes the values of one header (several values count as one identity, in the order sent):
/// raw and escaped when short and printable, otherwise hashed.
fn push_values(key: &mut String, values: GetAll<'_, HeaderValue>) {
    let total: usize = values.iter().map(|v| v.len() + 1).sum();
    let printable = values
        .iter()
        .all(|v| v.as_bytes().iter().all(|b| (0x20..=0x7E).contains(b)));
    if printable && total <= MAX_RAW_VALUE + 1 {
        for (index, value) in values.iter().enumerate() {
            if index > 0 {
                key.push(',');
            }
            push_escaped(key, value.as_bytes());
        }
    } else {
        let mut hasher = Sha256::new();
        for value in values.iter() {
            // Length-prefixed, so no two lists of values hash the same input.
            hasher.update((value.len() as u64).to_be_bytes());
            hasher.update(value.as_bytes());
        }
        key.push('#');
        for byte in &hasher.finalize()[..HASH_HEX_DIGITS / 2] {
            let _ = write!(key, "{byte:02x}");
        }
    }
}

/// Writes header bytes so that distinct values stay distinct and cannot forge the key's own
/// separators (`|`, `{`, `}`, `,`) or the mark of a hashed value (`#`).
fn push_escaped(key: &mut String, bytes: &[u8]) {
    for &byte in bytes {
        match byte {
            b'%' | b'|' | b'{' | b'}' | b',' | b'#' => {
                let _ = write!(key, "%{byte:02X}");
            }
            0x21..=0x7E => key.push(char::from(byte)),
            _ => {
                let _ = write!(key, "%{byte:02X}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{HeaderName, HeaderValue};
    use std::time::Duration;

    fn limit(parts: Vec<KeyPart>) -> Limit {
        let metrics = crate::metrics::Metrics::new().unwrap();
        Limit {
            name: "l".parse().unwrap(),
            key: parts,
            algorithm: crate::limiter::Algorithm::SlidingLog,
            requests: 1,
            window: Duration::from_secs(1),
            burst: 1,
            cost: 1,
            shadow: false,
            key_prefix: "sluice:r:l:".to_owned(),
            metrics: metrics.for_limit("r", "l"),
        }
    }

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7));
    const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

    #[test]
    fn header_identity() {
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, HeaderValue::from_static("abc"));
        let key = key(&limit(vec![KeyPart::Header(API_KEY)]), &headers, IP);
        assert_eq!(key, "sluice:r:l:{h:x-api-key=abc}");
    }

    #[test]
    fn a_missing_header_falls_back_to_the_client_ip() {
        let key = key(
            &limit(vec![KeyPart::Header(API_KEY), KeyPart::ClientIp]),
            &HeaderMap::new(),
            IP,
        );
        assert_eq!(key, "sluice:r:l:{ip=10.0.0.7}");
    }

    #[test]
    fn composite_keys_and_escaping() {
        let mut headers = HeaderMap::new();
        headers.insert(API_KEY, HeaderValue::from_static("a|b}{ %"));
        let key = key(
            &limit(vec![KeyPart::ClientIp, KeyPart::Header(API_KEY)]),
            &headers,
            IP,
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
        key(&limit(vec![KeyPart::Header(API_KEY)]), &headers, IP)
    }

    #[test]
    fn long_or_binary_values_are_hashed_to_a_fixed_length() {
        let long = header_key(&[&[b'k'; 200_000]]);
        let binary = header_key(&[b"caf\xc3\xa9"]);
        let raw = header_key(&[&[b'k'; MAX_RAW_VALUE]]);
        for hashed in [&long, &binary] {
            let (head, hash) = hashed.split_once('#').unwrap();
            assert_eq!(head, "sluice:r:l:{h:x-api-key=");
            assert_eq!(hash.len(), HASH_HEX_DIGITS + 1, "{hashed}");
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
                let longest = HEAD.len() + 1 + 3 * (MAX_RAW_VALUE + 1);
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
}
