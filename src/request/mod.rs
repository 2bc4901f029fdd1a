//! The request layer: everything sluice reads from one request before it asks the store, as
//! one pure function, [`plan`]. The gateway (`crate::proxy`), `sluice explain`
//! (`crate::cli::explain`) and the admin API (`crate::admin`, through [`store_key`]) all read
//! requests here, so none of them can tell a different story.
//!
//! # The phase order
//!
//! This is the one place that states it; other docs link here.
//!
//! 1. **head** (`head`): head limits (414, 431), the canonical path (`crate::path`), and the
//!    one-reading rules (`one_reading`): one reading of the request for the router, the
//!    limiter and the upstream, or a 400.
//! 2. **route** (`route`): the first route that matches (or 404), and what it refuses before
//!    a decision: a field its limits read sent twice (400), a declared body over its
//!    `max_body` (413).
//! 3. **identify** (`identify`): the route's `jwt:`: a verified token's claims, or its
//!    `on_invalid` (401, or the anonymous client's limits); 503 while a `jwks_url` verifier
//!    has no keys.
//! 4. **plan** (`checks`): the client address (`client`) and one check for each limit that
//!    applies, under its store key (`store_key`).
//!
//! Then, in `crate::proxy`, the acting side: on a route with a token budget, `tokens` (read
//! the body and plan again with its `model`, `checks::with_body`; reserve its upper
//! bound) → `decide` (one store call; a request only soft budgets refused is switched to
//! their fallback model, planned again with it and decided once more: `proxy::switch`) → `hold` (`on_exceed: delay`) → act (forward to the
//! upstream, or the route's direct response) → `give_back` (count by outcome: give back what
//! `count:` does not keep) → the token settlement (`tokens::settle`: a token budget keeps
//! what the answer reports it used) → `finish`, the one place every answer is completed.
//!
//! The files, by job: `head`, `one_reading`, `path`, `route`, `identify`, `client` (the
//! client's address), `fields` (the query and cookie readers the one-reading rules and the
//! keys share), `store_key` (the store key, built and read back), `checks` (the plan).

pub mod checks;
pub mod client;
pub mod fields;
mod head;
mod identify;
pub mod one_reading;
mod route;
pub mod store_key;

use std::net::IpAddr;
use std::time::SystemTime;

use http::request::Parts;
use http::StatusCode;

pub use self::checks::{LimitChecks, Plan};
pub use self::head::HeadLimits;
pub use self::route::too_large;
use crate::jwt::{Claims, Invalid};
use crate::metrics::Refusal;
use crate::policy::{Policy, Route};

/// The two clocks a request is read at: the system's, which a token's `exp` and `nbf` are
/// checked against, and sluice's wall clock (`crate::runtime::clock`), which a calendar
/// quota's period is taken from (a test may start it elsewhere).
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub system: SystemTime,
    pub calendar: jiff::Timestamp,
}

impl Now {
    /// Both clocks, now.
    pub fn read() -> Now {
        Now {
            system: SystemTime::now(),
            calendar: crate::runtime::clock::now(),
        }
    }
}

/// A request read and planned: its route, what its token said, and the checks to decide.
pub struct Planned<'p> {
    pub route: &'p Route,
    /// The claims of the request's verified token (`None` without one).
    pub claims: Option<Claims>,
    /// Why an `on_invalid: anonymous` route's token was not taken, for the caller to count.
    pub invalid: Option<Invalid>,
    pub plan: Plan<'p>,
}

/// Why sluice answers a request itself before asking the store.
#[derive(Debug)]
pub enum Why {
    /// Its head, its path or how it is written cannot be read one way (400, 413, 414, 431):
    /// counted under `reason`.
    Unreadable {
        status: StatusCode,
        detail: String,
        reason: Refusal,
    },
    /// No route matches (404).
    NoRoute,
    /// The route's `jwt:` rejects a missing or invalid token (401).
    Unauthenticated(Invalid),
    /// The route's `jwks_url` verifier has no keys yet: no token can be judged (503).
    KeysUnavailable,
}

/// A request refused before the store: why, and the route it matched, if it got that far.
pub struct Refused<'p> {
    pub route: Option<&'p Route>,
    pub why: Why,
}

impl<'p> Refused<'p> {
    fn unrouted(why: Why) -> Refused<'p> {
        Refused { route: None, why }
    }

    fn routed(route: &'p Route, why: Why) -> Refused<'p> {
        Refused {
            route: Some(route),
            why,
        }
    }
}

/// A request with no single reading is refused with 400.
impl From<one_reading::Ambiguous> for Why {
    fn from(ambiguous: one_reading::Ambiguous) -> Why {
        Why::Unreadable {
            status: StatusCode::BAD_REQUEST,
            detail: ambiguous.detail,
            reason: ambiguous.reason,
        }
    }
}

/// Reads `head` under `policy` (rewriting it in place: canonical path, joined cookie crumbs,
/// `Connection` options removed) and plans it: the phases up to the decision, in order.
/// `declared_length`: the body's length as the request declares it (0 when it does not);
/// `peer`: the TCP peer's address. Pure: it asks no store and counts nothing.
pub fn plan<'p>(
    policy: &'p Policy,
    limits: &HeadLimits,
    head: &mut Parts,
    declared_length: u64,
    peer: IpAddr,
    now: Now,
) -> Result<Planned<'p>, Refused<'p>> {
    self::head::read(head, limits, policy).map_err(Refused::unrouted)?;
    let matched = self::route::route(policy, head).map_err(Refused::unrouted)?;
    self::route::refuse(matched, head, declared_length)
        .map_err(|why| Refused::routed(matched, why))?;
    let identified = identify::identify(matched, &head.headers, now.system)
        .map_err(|why| Refused::routed(matched, why))?;
    let plan = checks::from_head(
        policy,
        matched,
        head,
        peer,
        identified.claims.as_ref(),
        now.calendar,
    );
    Ok(Planned {
        route: matched,
        claims: identified.claims,
        invalid: identified.invalid,
        plan,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::metrics::Metrics;
    use crate::policy::Compiled;
    use crate::tls::UpstreamTlsSet;

    fn policy() -> Policy {
        let yaml = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: api\n    match: { path_prefix: /api }\n    respond: { status: 200 }\n    limits:\n      - { name: per-key, key: [\"header:x-api-key\"], requests: 5, window: 1m }\n      - { name: daily, key: [client_ip], requests: 100, quota: day }\n";
        let config = crate::config::parse(yaml, Path::new("t.yaml")).expect("a valid config");
        Compiled::compile_without_jwt(&config, Path::new("t.yaml"), &UpstreamTlsSet::default())
            .expect("a valid policy")
            .metered(&Metrics::new().expect("a registry"))
    }

    const LIMITS: HeadLimits = HeadLimits {
        max_request_line: 256,
        max_header_bytes: 1024,
        max_headers: 8,
    };

    fn head(target: &str, headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::get(target);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).expect("a request").into_parts().0
    }

    fn now() -> Now {
        Now {
            system: SystemTime::now(),
            calendar: "2026-11-25T18:00:00Z".parse().expect("an instant"),
        }
    }

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7));

    #[test]
    fn a_request_is_read_routed_and_planned_under_its_store_keys() {
        let policy = policy();
        let mut sent = head("//API/%6Brders", &[("x-api-key", "k1")]);
        let planned = plan(&policy, &LIMITS, &mut sent, 0, PEER, now())
            .unwrap_or_else(|refused| panic!("refused: {:?}", refused.why));
        assert_eq!(sent.uri.path(), "/API/krders", "the head is left canonical");
        assert_eq!(planned.route.name.as_str(), "api");
        let keys: Vec<&str> = planned
            .plan
            .limits
            .checks()
            .iter()
            .map(|c| c.key.as_str())
            .collect();
        assert_eq!(
            keys,
            [
                "sluice:api:per-key:{h:x-api-key=k1}",
                // A calendar quota: its algorithm's label, and the day holding `now`.
                "sluice:api:daily:calendar:{ip=192.0.2.7}:2026-11-25",
            ]
        );
        let (daily, check) = planned.plan.limits.iter().nth(1).expect("two limits");
        let identity = store_key::identity_of(&policy, planned.route, daily, &check.key);
        assert_eq!(
            identity, "ip=192.0.2.7",
            "a key is read back where it is built"
        );
    }

    #[test]
    fn a_refusal_says_why_and_the_route_it_matched() {
        let policy = policy();
        let refused = |target: &str, headers: &[(&str, &str)], length: u64| match plan(
            &policy,
            &LIMITS,
            &mut head(target, headers),
            length,
            PEER,
            now(),
        ) {
            Ok(_) => panic!("{target} was planned"),
            Err(refused) => (
                refused.route.map(|route| route.name.as_str().to_owned()),
                refused.why,
            ),
        };
        let (route, why) = refused("/elsewhere", &[], 0);
        assert!(route.is_none() && matches!(why, Why::NoRoute), "{why:?}");
        let (route, why) = refused("/api/a%2Fb", &[], 0);
        assert!(route.is_none(), "refused before routing");
        assert!(
            matches!(why, Why::Unreadable { status, .. } if status == 400),
            "{why:?}"
        );
        let (route, why) = refused("/api", &[("x-api-key", "a"), ("x-api-key", "b")], 0);
        assert_eq!(route.as_deref(), Some("api"), "refused once routed");
        assert!(
            matches!(
                why,
                Why::Unreadable {
                    reason: Refusal::RepeatedField,
                    ..
                }
            ),
            "{why:?}"
        );
        let long = format!("/api/{}", "x".repeat(300));
        let (_, why) = refused(&long, &[], 0);
        assert!(
            matches!(why, Why::Unreadable { status, .. } if status == 414),
            "{why:?}"
        );
    }
}
