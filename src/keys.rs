//! From a request to the store keys of its route's limits: which client each limit counts.
//!
//! A key is `prefix:route:limit:{identity}`. The identity is wrapped in a Redis Cluster hash
//! tag so all entries of one identity's limit live in one slot. If a header a limit is keyed
//! on is missing, that limit counts the client IP instead: leaving a header out must never be a
//! way around a limit.

use std::fmt::Write as _;
use std::net::IpAddr;

use http::HeaderMap;

use crate::config::KeyPart;
use crate::limiter::Check;
use crate::policy::{Limit, Route};

/// One check per limit of the route, in the route's order.
pub fn checks(route: &Route, headers: &HeaderMap, client_ip: IpAddr) -> Vec<Check> {
    route
        .limits
        .iter()
        .map(|limit| Check {
            key: key(limit, headers, client_ip),
            requests: limit.requests,
            window: limit.window,
        })
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
            // Several values of one header count as one identity, in the order sent.
            for (index, value) in headers.get_all(name).iter().enumerate() {
                if index > 0 {
                    key.push(',');
                }
                push_escaped(key, value.as_bytes());
            }
        }
    }
}

/// Writes header bytes so that distinct values stay distinct and cannot forge the key's own
/// separators (`|`, `{`, `}`, `,`) or carry bytes Redis tools print badly.
fn push_escaped(key: &mut String, bytes: &[u8]) {
    for &byte in bytes {
        match byte {
            b'%' | b'|' | b'{' | b'}' | b',' => {
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
            requests: 1,
            window: Duration::from_secs(1),
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
}
