//! Header rewriting at the proxy boundary: hop-by-hop fields removed in both directions
//! (RFC 9110 §7.6.1) and the X-Forwarded-* fields upstreams read to learn who asked.
//!
//! Both start from one pass over the field names ([`scan`]): most requests carry no
//! hop-by-hop field and no X-Forwarded-*, and then nothing is looked up or removed by name
//! (seven removals by name, found or not, cost a hash and a probe each on every request).

use std::net::IpAddr;

use bytes::{BufMut, BytesMut};

use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION};

pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The fixed hop-by-hop fields, the list the policy's key parts are refused on too
/// (`config::HOP_BY_HOP`, `Connection` first), as names to compare at no cost.
const HOP_BY_HOP: [HeaderName; 7] = {
    let names = crate::config::HOP_BY_HOP;
    [
        HeaderName::from_static(names[0]),
        HeaderName::from_static(names[1]),
        HeaderName::from_static(names[2]),
        HeaderName::from_static(names[3]),
        HeaderName::from_static(names[4]),
        HeaderName::from_static(names[5]),
        HeaderName::from_static(names[6]),
    ]
};

/// What one pass over a header map's names found.
#[derive(Debug, Default, Clone, Copy)]
pub struct Scan {
    /// Bit `i`: `HOP_BY_HOP[i]` is present.
    hop_by_hop: u8,
    forwarded_for: bool,
    forwarded_host: bool,
}

/// One pass over the names of `headers`.
pub fn scan(headers: &HeaderMap) -> Scan {
    let mut scan = Scan::default();
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            scan.hop_by_hop |= 1 << i;
        } else if name == X_FORWARDED_FOR {
            scan.forwarded_for = true;
        } else if name == X_FORWARDED_HOST {
            scan.forwarded_host = true;
        }
    }
    scan
}

/// Removes `Connection`, every field it names, and the fixed hop-by-hop fields.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let found = scan(headers);
    remove_scanned(headers, &found);
}

/// [`remove_hop_by_hop`] with the names already scanned (`found`, of these `headers`).
pub fn remove_scanned(headers: &mut HeaderMap, found: &Scan) {
    if found.hop_by_hop == 0 {
        return;
    }
    if found.hop_by_hop & 1 != 0 {
        // The fields `Connection` names; those it usually names (`keep-alive`, `close`,
        // `upgrade`, `te`) are removed below or are no field, and need no name of their own.
        let tokens = || {
            headers
                .get_all(CONNECTION)
                .iter()
                .filter_map(|value| value.to_str().ok())
                .flat_map(|value| value.split(','))
                .map(str::trim)
                .filter(|token| !is_fixed_token(token))
        };
        if tokens().next().is_some() {
            let named: Vec<HeaderName> = tokens()
                .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
                .collect();
            for name in named {
                headers.remove(name);
            }
        }
    }
    for (i, name) in HOP_BY_HOP.into_iter().enumerate() {
        if found.hop_by_hop & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

/// A `Connection` token that names a fixed hop-by-hop field, or `close`.
fn is_fixed_token(token: &str) -> bool {
    token.is_empty()
        || token.eq_ignore_ascii_case("close")
        || HOP_BY_HOP
            .iter()
            .any(|name| token.eq_ignore_ascii_case(name.as_str()))
}

/// Appends the peer to `X-Forwarded-For` (joining repeated fields into one list) and sets
/// `X-Forwarded-Proto` (`https` when the client spoke TLS) and `X-Forwarded-Host`. `found`:
/// the scan of these `headers` (before any X-Forwarded-* was set).
pub fn add_forwarded(
    headers: &mut HeaderMap,
    found: &Scan,
    peer: IpAddr,
    host: Option<HeaderValue>,
    tls: bool,
) {
    // One buffer, handed to the header without a copy (this runs for every forwarded request).
    let mut chain = BytesMut::with_capacity(48);
    if found.forwarded_for {
        for value in headers.get_all(&X_FORWARDED_FOR) {
            if let Ok(text) = value.to_str() {
                chain.put_slice(text.trim().as_bytes());
                chain.put_slice(b", ");
            }
        }
    }
    write_ip(&mut chain, peer);
    if let Ok(value) = HeaderValue::from_maybe_shared(chain.freeze()) {
        headers.insert(X_FORWARDED_FOR, value);
    }
    headers.insert(
        X_FORWARDED_PROTO,
        HeaderValue::from_static(if tls { "https" } else { "http" }),
    );
    match host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        None if found.forwarded_host => {
            headers.remove(X_FORWARDED_HOST);
        }
        None => {}
    }
}

/// Writes `ip` as text: an IPv4 address digit by digit (every request's peer; `Display`
/// goes through the formatting machinery and a padding check), an IPv6 one through its
/// `Display`, whose compressed form has rules not worth writing twice.
fn write_ip(out: &mut BytesMut, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.put_u8(b'.');
                }
                if octet >= 100 {
                    out.put_u8(b'0' + octet / 100);
                }
                if octet >= 10 {
                    out.put_u8(b'0' + octet / 10 % 10);
                }
                out.put_u8(b'0' + octet % 10);
            }
        }
        IpAddr::V6(v6) => {
            use std::fmt::Write as _;
            let mut text = String::with_capacity(39);
            let _ = write!(text, "{v6}");
            out.put_slice(text.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use http::header::{TE, TRANSFER_ENCODING, UPGRADE};

    use super::*;

    const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
    const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

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
    fn a_field_connection_names_goes_even_beside_only_fixed_tokens() {
        let mut headers = HeaderMap::new();
        headers.append(CONNECTION, HeaderValue::from_static("close"));
        headers.append(
            CONNECTION,
            HeaderValue::from_static("Keep-Alive,, x-a , upgrade"),
        );
        headers.insert("x-a", HeaderValue::from_static("1"));
        headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
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
        let found = scan(&headers);
        add_forwarded(
            &mut headers,
            &found,
            "127.0.0.1".parse().unwrap(),
            Some(HeaderValue::from_static("api.example")),
            false,
        );
        assert_eq!(
            headers[X_FORWARDED_FOR],
            "203.0.113.9, 198.51.100.2, 127.0.0.1"
        );
        assert_eq!(headers[X_FORWARDED_PROTO], "http");
        assert_eq!(headers[X_FORWARDED_HOST], "api.example");
    }

    #[test]
    fn forwarded_fields_without_any_before() {
        for (peer, text) in [
            ("10.200.3.45", "10.200.3.45"),
            ("0.0.0.0", "0.0.0.0"),
            ("255.9.100.10", "255.9.100.10"),
            ("2001:db8::1", "2001:db8::1"),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(X_FORWARDED_HOST, HeaderValue::from_static("spoofed"));
            let found = scan(&headers);
            add_forwarded(&mut headers, &found, peer.parse().unwrap(), None, true);
            assert_eq!(headers[X_FORWARDED_FOR], text);
            assert_eq!(headers[X_FORWARDED_PROTO], "https");
            assert!(
                !headers.contains_key(X_FORWARDED_HOST),
                "a spoofed host goes"
            );
        }
    }

    #[test]
    fn every_ipv4_address_reads_as_display_writes_it() {
        for octet in 0..=255u8 {
            let ip = IpAddr::from([octet, 255 - octet, octet / 3, 7]);
            let mut out = BytesMut::new();
            write_ip(&mut out, ip);
            assert_eq!(&out[..], ip.to_string().as_bytes());
        }
    }
}
