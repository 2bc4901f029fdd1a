//! The plan for one request on its route: the client's address and one check for each of
//! the route's limits that applies. A pure function of the policy and the request's head,
//! run by the gateway before it asks the store, and by `sluice explain`, so that what explain
//! prints is what the gateway does.

use std::net::IpAddr;

use http::request::Parts;

use crate::identity::Claims;
use crate::keys::{self, RequestParts};
use crate::limiter::Check;
use crate::policy::{Limit, Policy, Route};

/// The limits of a route that apply to a request (their `when` holds), in the route's
/// order, one check for each, and the client address the keys count.
pub struct Plan<'r> {
    pub client_ip: IpAddr,
    pub limits: Vec<&'r Limit>,
    pub checks: Vec<Check>,
}

impl Plan<'_> {
    /// Whether no limit applies: the request is acted on without asking the store.
    pub fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }
}

/// Plans `head` (already read by `one_request`, its path canonical) on `route`; `peer` is the
/// TCP peer's address. No claims: for a route without `jwt:`.
pub fn plan<'r>(policy: &Policy, route: &'r Route, head: &Parts, peer: IpAddr) -> Plan<'r> {
    plan_identified(policy, route, head, peer, None)
}

/// `plan`, with the claims of the request's verified token (`proxy::identify`): what `jwt:`
/// key parts and conditions read.
pub fn plan_identified<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
) -> Plan<'r> {
    let client_ip = if route.limits.is_empty() {
        peer.to_canonical()
    } else {
        keys::client_ip(
            peer,
            &head.headers,
            &policy.trusted_proxies,
            policy.forwarded_header,
        )
    };
    let parts = RequestParts {
        method: &head.method,
        uri: &head.uri,
        headers: &head.headers,
        client_ip,
        claims,
    };
    let limits: Vec<&Limit> = route
        .limits
        .iter()
        .filter(|limit| limit.applies(&head.method, &head.uri, &head.headers, claims))
        .collect();
    let checks = limits
        .iter()
        .map(|limit| limit.check(keys::store_key(limit, route, &parts)))
        .collect();
    Plan {
        client_ip,
        limits,
        checks,
    }
}
