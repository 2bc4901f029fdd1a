//! Header rewriting at the proxy boundary: hop-by-hop fields removed in both directions
//! (RFC 9110 §7.6.1) and the X-Forwarded-* fields upstreams read to learn who asked.

use std::fmt::Write as _;
use std::net::IpAddr;

use bytes::Bytes;

use http::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
};

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes `Connection`, every field it names, and the fixed hop-by-hop fields.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in [
        CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
    ] {
        headers.remove(name);
    }
}

/// Appends the peer to `X-Forwarded-For` (joining repeated fields into one list) and sets
/// `X-Forwarded-Proto` and `X-Forwarded-Host`.
pub fn add_forwarded(headers: &mut HeaderMap, peer: IpAddr, host: Option<HeaderValue>) {
    // One buffer, handed to the header without a copy (this runs for every forwarded request).
    let mut chain = String::with_capacity(48);
    for value in headers.get_all(&X_FORWARDED_FOR) {
        if let Ok(text) = value.to_str() {
            chain.push_str(text.trim());
            chain.push_str(", ");
        }
    }
    let _ = write!(chain, "{peer}");
    if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(chain)) {
        headers.insert(X_FORWARDED_FOR, value);
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        None => {
            headers.remove(X_FORWARDED_HOST);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_fields_and_the_ones_connection_names_go() {
        let mut headers = HeaderMap::new();
        headers.insert(CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert(KEEP_ALIVE, HeaderValue::from_static("timeout=5"));
        headers.insert(TE, HeaderValue::from_static("trailers"));
        headers.insert(UPGRADE, HeaderValue::from_static("h2c"));
        headers.insert(PROXY_CONNECTION, HeaderValue::from_static("close"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert!(headers.contains_key("x-kept"));
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut headers = HeaderMap::new();
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.9"));
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.2"));
        add_forwarded(
            &mut headers,
            "127.0.0.1".parse().unwrap(),
            Some(HeaderValue::from_static("api.example")),
        );
        assert_eq!(
            headers[X_FORWARDED_FOR],
            "203.0.113.9, 198.51.100.2, 127.0.0.1"
        );
        assert_eq!(headers[X_FORWARDED_PROTO], "http");
        assert_eq!(headers[X_FORWARDED_HOST], "api.example");
    }
}
