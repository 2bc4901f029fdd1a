//! The plan for one request on its route: the client's address and one check for each of
//! the route's limits that applies. A pure function of the policy and the request's head,
//! run by the gateway before it asks the store, and by `sluice explain`, so that what explain
//! prints is what the gateway does.
//!
//! A route with a token budget reads its body before deciding, and is planned twice: from the
//! head (`plan_identified`), with the limits that read the body's `model` left `deferred`, to
//! know how much body to read and to check before reading; then once the body is read
//! (`plan_read`), with every limit. The second plan is the one decided, so a calendar quota's
//! period and window are those of the decision's time, not of the head's: a head sent before
//! midnight whose body ends after it is charged to the new day.

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
    /// The limits that read the body's `model` and whose head conditions hold: planned by
    /// `plan_read` once the body is read (empty in that plan).
    pub deferred: Vec<&'r Limit>,
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
/// key parts and conditions read. Limits that read the body are `deferred`.
pub fn plan_identified<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
) -> Plan<'r> {
    build(policy, route, head, peer, claims, None)
}

/// The plan of a request whose body has been read: every limit, those that read the body's
/// `model` (normalised, `crate::model`; `None` when it names none) included, and every
/// calendar quota's period taken now.
pub fn plan_read<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
    model: Option<&str>,
) -> Plan<'r> {
    build(policy, route, head, peer, claims, Some(model))
}

/// `body`: `None` before the body is read; `Some(model)` after.
fn build<'r>(
    policy: &Policy,
    route: &'r Route,
    head: &Parts,
    peer: IpAddr,
    claims: Option<&Claims>,
    body: Option<Option<&str>>,
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
        .map(|limit| limit.check(keys::store_key(limit, route, &parts)))
        .collect();
    Plan {
        client_ip,
        limits,
        checks,
        deferred,
    }
}
