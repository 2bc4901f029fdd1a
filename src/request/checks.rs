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
    pub limits: LimitChecks<'r>,
    /// The limits that read the body's `model` and whose head conditions hold: planned by
    /// `with_body` once the body is read (empty in that plan).
    pub deferred: Vec<&'r Limit>,
}

impl Plan<'_> {
    /// Whether no limit applies: the request is acted on without asking the store.
    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }
}

/// Limits, each with its check under its store key, in the route's order. Held as two lists
/// of one length, which only `build` fills, from the limits: the store takes the checks as
/// one slice ([`checks`](Self::checks), as `Store::decide` wants them, with no copy per
/// call), and whatever needs a limit's check reads it beside its limit ([`iter`](Self::iter),
/// [`check_of`](Self::check_of)), never by an index into the other list.
#[derive(Clone)]
pub struct LimitChecks<'r> {
    limits: Vec<&'r Limit>,
    checks: Vec<Check>,
}

impl<'r> LimitChecks<'r> {
    pub fn len(&self) -> usize {
        self.checks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.checks.is_empty()
    }

    /// The limits, in order.
    pub fn limits(&self) -> &[&'r Limit] {
        &self.limits
    }

    /// The checks, in the limits' order: what the store decides.
    pub fn checks(&self) -> &[Check] {
        &self.checks
    }

    /// Each limit with its check.
    pub fn iter(&self) -> impl Iterator<Item = (&'r Limit, &Check)> + '_ {
        self.limits.iter().copied().zip(&self.checks)
    }

    /// Each limit with its check, to be changed (a token limit's cost, set to the
    /// reservation once the body is read).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&'r Limit, &mut Check)> + '_ {
        self.limits.iter().copied().zip(&mut self.checks)
    }

    /// The check of `limit`, that very limit of the route (found by address: two limits of
    /// a route may be alike in every field); `None` when it does not apply.
    pub fn check_of(&self, limit: &Limit) -> Option<&Check> {
        self.iter()
            .find(|(planned, _)| std::ptr::eq(*planned, limit))
            .map(|(_, check)| check)
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
        limits: LimitChecks { limits, checks },
        deferred,
    }
}
