//! Identifying the client by its token, between route and plan: on a route with `jwt:`, the
//! request's token is verified (`crate::jwt`) and its claims handed to the plan, the only way
//! a `jwt:` key part or condition sees a claim. A missing or invalid token gets the route's
//! `on_invalid`: a 401, or no claims (the anonymous client's limits); either way its reason
//! is returned for the caller to count. A `jwks_url` verifier that has no keys yet (no fetch
//! has succeeded since start) can judge no token: its routes answer 503 whatever their
//! `on_invalid`, rather than let every request through as anonymous or refuse valid tokens as
//! invalid.

use std::time::SystemTime;

use http::HeaderMap;

use super::Why;
use crate::jwt::{Claims, Failure, Invalid, OnInvalid};
use crate::policy::Route;

/// What the token says of the client.
pub struct Identified {
    /// The claims of the request's verified token; `None` on a route without `jwt:` or, on
    /// an `on_invalid: anonymous` route, for a missing or invalid token.
    pub claims: Option<Claims>,
    /// Why an `on_invalid: anonymous` route's token was not taken (`sluice_jwt_invalid_total`).
    pub invalid: Option<Invalid>,
}

/// The request's token on `route`, verified at `now`.
pub fn identify(route: &Route, headers: &HeaderMap, now: SystemTime) -> Result<Identified, Why> {
    let Some(jwt) = &route.jwt else {
        return Ok(Identified {
            claims: None,
            invalid: None,
        });
    };
    let verified = match jwt.verifier.token(headers) {
        Some(token) => jwt.verifier.verify(token, now),
        None => Err(Failure::Invalid(Invalid::Missing)),
    };
    match verified {
        Ok(claims) => Ok(Identified {
            claims: Some(claims),
            invalid: None,
        }),
        Err(Failure::NoKeys) => Err(Why::KeysUnavailable),
        Err(Failure::Invalid(reason)) => match jwt.on_invalid {
            OnInvalid::Reject => Err(Why::Unauthenticated(reason)),
            OnInvalid::Anonymous => Ok(Identified {
                claims: None,
                invalid: Some(reason),
            }),
        },
    }
}
