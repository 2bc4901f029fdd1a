//! The client's address: the TCP peer, unless the peer is a trusted proxy; then the rightmost
//! address in the forwarded-for header that is not itself a trusted proxy (clients write the
//! left part of that header freely, so it is never believed). A limit counts it by its
//! network (`client_network`): the limit's `ipv6_prefix` (a /64 by default: one subscriber's
//! usual share, which would otherwise be 2^64 buckets) or `ipv4_prefix` (/32); an
//! IPv4-mapped IPv6 address is the IPv4 client.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;

use crate::config::{ForwardedHeader, IpNet};
use crate::policy::ClientPrefix;

/// The client's address: `peer`, or when `peer` is a trusted proxy, the rightmost address of
/// the forwarded-for chain that is not a trusted proxy (the leftmost when all are). A hop that
/// is not an address (`unknown`, an obfuscated name, garbage) ends the walk at the last
/// address found: nothing left of it can be believed.
pub fn client_ip(
    peer: IpAddr,
    headers: &HeaderMap,
    trusted: &[IpNet],
    header: ForwardedHeader,
) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|net| net.contains(ip));
    let peer = peer.to_canonical();
    if !is_trusted(peer) {
        return peer;
    }
    let hops = forwarded_hops(headers, header);
    let mut client = peer;
    for hop in hops.iter().rev() {
        match hop {
            Some(ip) => {
                client = *ip;
                if !is_trusted(client) {
                    return client;
                }
            }
            None => return client,
        }
    }
    client
}

/// The network `ip` counts as under `prefix`, and its prefix length: an IPv4 address (an
/// IPv4-mapped IPv6 one included) by `prefix.ipv4` bits, an IPv6 one by `prefix.ipv6`.
pub fn client_network(ip: IpAddr, prefix: ClientPrefix) -> (IpAddr, u8) {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let bits = prefix.ipv4.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            (IpAddr::V4((u32::from(v4) & mask).into()), bits)
        }
        IpAddr::V6(v6) => {
            let bits = prefix.ipv6.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            (IpAddr::V6((u128::from(v6) & mask).into()), bits)
        }
    }
}

/// Every hop of the forwarded-for chain, in order, `None` where a hop is not an address.
fn forwarded_hops(headers: &HeaderMap, header: ForwardedHeader) -> Vec<Option<IpAddr>> {
    let values = headers
        .get_all(match header {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        })
        .iter()
        .map(|value| value.to_str().ok());
    let mut hops = Vec::new();
    for value in values {
        let Some(value) = value else {
            hops.push(None);
            continue;
        };
        for element in value.split(',') {
            let node = match header {
                ForwardedHeader::XForwardedFor => Some(element.trim()),
                // RFC 7239: `for=192.0.2.60;proto=http`, `for="[2001:db8::1]:4711"`.
                ForwardedHeader::Forwarded => element.split(';').find_map(|pair| {
                    let (name, value) = pair.trim().split_once('=')?;
                    name.eq_ignore_ascii_case("for")
                        .then(|| value.trim_matches('"'))
                }),
            };
            hops.push(node.and_then(parse_node));
        }
    }
    hops
}

/// An address as proxies write it: bare, with a port, or IPv6 in brackets.
fn parse_node(node: &str) -> Option<IpAddr> {
    node.parse::<IpAddr>()
        .or_else(|_| node.parse::<SocketAddr>().map(|addr| addr.ip()))
        .or_else(|_| node.trim_start_matches('[').trim_end_matches(']').parse())
        .ok()
        .map(|ip: IpAddr| ip.to_canonical())
}
