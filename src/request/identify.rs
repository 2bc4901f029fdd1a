//! The identify phase, between route and plan: on a route with `jwt:`, the request's token is
//! verified (`crate::identity`) and its claims handed to plan, the only way a `jwt:` key part
//! or condition sees a claim. A missing or invalid token is counted by reason and gets the
//! route's `on_invalid`: a 401 `Stop`, or no claims (the anonymous client's limits). A
//! `jwks_url` verifier that has no keys yet (no fetch has succeeded since start) can judge
//! no token: its routes answer 503 whatever their `on_invalid`, rather than let every
//! request through as anonymous or refuse valid tokens as invalid.

use std::time::SystemTime;

use http::HeaderMap;
use prometheus::IntCounterVec;

use super::Stop;
use crate::identity::{Claims, Failure, Invalid, OnInvalid};
use crate::policy::Route;

/// The claims of the request's verified token; `None` on a route without `jwt:` or, on an
/// `on_invalid: anonymous` route, for a missing or invalid token. `invalid` counts the
/// failures by route and reason.
pub fn identify(
    route: &Route,
    headers: &HeaderMap,
    now: SystemTime,
    invalid: &IntCounterVec,
) -> Result<Option<Claims>, Stop> {
    let Some(jwt) = &route.jwt else {
        return Ok(None);
    };
    let verified = match jwt.verifier.token(headers) {
        Some(token) => jwt.verifier.verify(token, now),
        None => Err(Failure::Invalid(Invalid::Missing)),
    };
    match verified {
        Ok(claims) => Ok(Some(claims)),
        Err(Failure::NoKeys) => Err(Stop::KeysUnavailable),
        Err(Failure::Invalid(reason)) => {
            invalid
                .with_label_values(&[route.name.as_str(), reason.label()])
                .inc();
            match jwt.on_invalid {
                OnInvalid::Reject => Err(Stop::Unauthenticated(reason)),
                OnInvalid::Anonymous => Ok(None),
            }
        }
    }
}
