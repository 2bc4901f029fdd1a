//! The plan for one request on its route: the client's address and one check for each of
//! the route's limits that applies, under its store key (`super::store_key`). A pure
//! function of the policy, the request's head and the time, the last step of
//! `super::plan`.
//!
//! A route with a token budget reads its body before deciding, and is planned twice: from the
//! head (`from_head`), with the limits that read the body's `model` left `deferred`, to
//! know how much body to read and to check before reading; then once the body is read
//! (`with_body`, through `super::Planned::with_body`), with every limit. The second plan is the one decided, so a calendar quota's
//! period and window are those of the decision's time, not of the head's: a head sent before
//! midnight whose body ends after it is charged to the new day.

use std::net::IpAddr;

use http::request::Parts;
use jiff::Timestamp;

use super::client::client_ip;
use super::store_key::{self, RequestParts};
use crate::jwt::Claims;
use crate::limiter::Check;
use crate::policy::{Limit, Policy, Route};

/// The limits of a route that apply to a request (their `when` holds), in the route's
/// order, one check for each, and the client address the keys count.
pub struct Plan<'r> {
    pub client_ip: IpAddr,
    pub limits: Vec<&'r Limit>,
    pub checks: Vec<Check>,
    /// The limits that read the body's `model` and whose head conditions hold: planned by
    /// `with_body` once the body is read (empty in that plan).
    pub deferred: Vec<&'r Limit>,
}

impl Plan<'_> {
    /// Whether no limit applies: the request is acted on without asking the store.
    pub fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }
}

/// Plans `head` (already read, its path canonical: `super::head`) on `route`; `peer` is the
/// TCP peer's address; `claims` are those of the request's verified token (`super::identify`),
/// what `jwt:` key parts and conditions read. Limits that read the body are `deferred`.
pub fn from_head<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
    now: Timestamp,
) -> Plan<'r> {
    build(policy, route, head, peer, claims, None, now)
}

/// The plan of a request whose body has been read: every limit, those that read the body's
/// `model` (normalised, `crate::model`; `None` when it names none) included, and every
/// calendar quota's period taken at `now`, the decision's time.
pub fn with_body<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
    model: Option<&str>,
    now: Timestamp,
) -> Plan<'r> {
    build(policy, route, head, peer, claims, Some(model), now)
}

/// `body`: `None` before the body is read; `Some(model)` after.
fn build<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
    body: Option<Option<&str>>,
    now: Timestamp,
) -> Plan<'r> {
    let client_ip = if route.limits.is_empty() {
        peer.to_canonical()
    } else {
        client_ip(
            peer,
            &head.headers,
            &policy.trusted_proxies,
            policy.forwarded_header,
        )
    };
    let model = body.flatten();
    let parts = RequestParts {
        method: &head.method,
        uri: &head.uri,
        headers: &head.headers,
        client_ip,
        claims,
        model,
    };
    let mut limits = Vec::with_capacity(route.limits.len());
    let mut deferred = Vec::new();
    for limit in &route.limits {
        if body.is_none() && limit.reads_body() {
            if limit.applies_to_head(&head.method, &head.uri, &head.headers, claims) {
                deferred.push(limit);
            }
        } else if limit.applies(&head.method, &head.uri, &head.headers, claims, model) {
            limits.push(limit);
        }
    }
    let checks = limits
        .iter()
        .map(|limit| store_key::check(limit, store_key::build(policy, route, limit, &parts), now))
        .collect();
    Plan {
        client_ip,
        limits,
        checks,
        deferred,
    }
}
