//! `Stop`: every answer sluice makes itself instead of the upstream's, as data. A phase that
//! cannot go on returns one; `finish` turns it into the response, once. Each kind knows whose
//! fault it is, its status, its problem body and the outcome it is counted under.

use std::time::Duration;

use http::StatusCode;

use super::request_body::BodyFault;
use super::upstream::forward::ForwardError;
use crate::config::Name;
use crate::metrics::{Outcome, Refusal};
use crate::policy::Route;
use crate::request::{self, Why};

/// Whose fault an answer is: what an operator looks at first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request cannot be served as sent (4xx but 429).
    Client,
    /// A limit has no room for it (429).
    Limit,
    /// The rate-limit store cannot decide and the route refuses without it (503).
    Store,
    /// The upstream cannot be reached or did not answer in time (502, 504).
    Upstream,
    /// sluice itself (500).
    Sluice,
}

#[derive(Debug)]
pub enum Stop {
    /// Refused for its head or how it is written (400, 414, 431, ...): counted under `reason`.
    Refused {
        status: StatusCode,
        detail: String,
        reason: Refusal,
    },
    /// No route matches (404).
    NoRoute,
    /// The route's `jwt:` rejects a missing or invalid token (401, `WWW-Authenticate`).
    Unauthenticated(crate::jwt::Invalid),
    /// The request body broke a bound of the route while it streamed; counted where it broke.
    Body(BodyFault),
    /// A limit has no room: the request's decision says which and for how long (429).
    Limited,
    /// Admitted for later, but the route already holds `max_delayed` requests (429).
    TooManyHeld { delay: Duration },
    /// The store cannot decide and the route's `on_store_error` is `deny` (503).
    StoreUnavailable,
    /// A concurrency limit's lease could not be renewed before the store gives its place to
    /// another request: the request was stopped before its answer began (503).
    LeaseLost,
    /// The route's `jwks_url` verifier has no keys yet: no token can be judged (503).
    KeysUnavailable,
    /// The upstream failed.
    Upstream { error: ForwardError, upstream: Name },
    /// sluice has no way to act on an admitted request.
    Internal(&'static str),
    /// A token budget cannot reserve for the request's body (400), or the reservation can
    /// never fit (413).
    Unreservable { status: StatusCode, detail: String },
    /// A bound on what sluice holds for requests being read is reached (503, `Retry-After`):
    /// the process's budget of body bytes, or a connection's streams reading bodies whole.
    Busy { detail: String, reason: Refusal },
}

impl Stop {
    pub fn fault(&self) -> Fault {
        match self {
            Stop::Refused { .. }
            | Stop::NoRoute
            | Stop::Body(_)
            | Stop::Unauthenticated(_)
            | Stop::Unreservable { .. } => Fault::Client,
            Stop::Limited | Stop::TooManyHeld { .. } | Stop::Busy { .. } => Fault::Limit,
            Stop::StoreUnavailable | Stop::LeaseLost => Fault::Store,
            Stop::Upstream { .. } => Fault::Upstream,
            Stop::Internal(_) | Stop::KeysUnavailable => Fault::Sluice,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Stop::Refused { status, .. } | Stop::Unreservable { status, .. } => *status,
            Stop::NoRoute => StatusCode::NOT_FOUND,
            Stop::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Stop::Body(BodyFault::TooLarge) => StatusCode::PAYLOAD_TOO_LARGE,
            Stop::Body(BodyFault::TooSlow) => StatusCode::REQUEST_TIMEOUT,
            Stop::Body(BodyFault::Malformed) => StatusCode::BAD_REQUEST,
            Stop::Limited | Stop::TooManyHeld { .. } => StatusCode::TOO_MANY_REQUESTS,
            Stop::StoreUnavailable
            | Stop::LeaseLost
            | Stop::Busy { .. }
            | Stop::KeysUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Stop::Upstream { error, .. } => match error {
                ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
                _ => StatusCode::BAD_GATEWAY,
            },
            Stop::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The outcome counted in `sluice_requests_total`; `routed`: whether a route matched.
    pub fn outcome(&self, routed: bool) -> Outcome {
        match self.fault() {
            _ if matches!(self, Stop::NoRoute) => Outcome::NoRoute,
            Fault::Client if routed => Outcome::ClientError,
            Fault::Client => Outcome::Refused,
            Fault::Limit => Outcome::Limited,
            Fault::Store => Outcome::StoreError,
            Fault::Upstream | Fault::Sluice => Outcome::UpstreamError,
        }
    }

    /// The reason `finish` counts in `sluice_refused_requests_total`; `None` for the answers
    /// that are not refusals, and for a body fault, counted by the body where it happened.
    pub fn refusal(&self) -> Option<Refusal> {
        match self {
            Stop::Refused { reason, .. } | Stop::Busy { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// The problem body's `detail` and, for an upstream, its name. A limit's 429 is written by
    /// `finish`, which holds the decision.
    pub fn detail(&self, route: Option<&Route>) -> String {
        match self {
            Stop::Refused { detail, .. }
            | Stop::Unreservable { detail, .. }
            | Stop::Busy { detail, .. } => detail.clone(),
            Stop::NoRoute => "no route matches this request".to_owned(),
            Stop::Unauthenticated(invalid) => invalid.detail().to_owned(),
            Stop::Body(fault) => body_detail(*fault, route),
            Stop::Limited => "a limit of this route is exhausted".to_owned(),
            Stop::TooManyHeld { delay } => format!(
                "route `{}` already holds {} delayed requests, its max_delayed; retry in {} s",
                route.map_or("", |route| route.name.as_str()),
                route.map_or(0, |route| route.max_delayed),
                crate::response::retry_after_seconds(*delay)
            ),
            Stop::StoreUnavailable => {
                "the rate-limit store is unavailable; the request was not forwarded".to_owned()
            }
            Stop::LeaseLost => "the rate-limit store could not be reached to keep this \
                request's place of a concurrency limit, which the store then gives to another \
                request: it was forwarded, and stopped before its answer began"
                .to_owned(),
            Stop::Upstream { error, .. } => error.to_string(),
            Stop::Internal(what) => (*what).to_owned(),
            Stop::KeysUnavailable => "keys not yet available: this route's JWT verifier has not \
                fetched its jwks_url successfully since sluice started; the request was not \
                forwarded"
                .to_owned(),
        }
    }
}

/// A request the request layer refused before the store (`crate::request::plan`).
impl From<Why> for Stop {
    fn from(why: Why) -> Stop {
        match why {
            Why::Unreadable {
                status,
                detail,
                reason,
            } => Stop::Refused {
                status,
                detail,
                reason,
            },
            Why::NoRoute => Stop::NoRoute,
            Why::Unauthenticated(invalid) => Stop::Unauthenticated(invalid),
            Why::KeysUnavailable => Stop::KeysUnavailable,
        }
    }
}

/// 413 past the route's limit, 408 behind its pace, 400 when malformed.
pub fn body_detail(fault: BodyFault, route: Option<&Route>) -> String {
    match (fault, route) {
        (BodyFault::TooLarge, Some(route)) => {
            request::too_large(route.max_body.unwrap_or(u64::MAX))
        }
        (BodyFault::TooSlow, Some(route)) => {
            let pace = &route.body_pace;
            let rate = if pace.min_rate == 0 {
                String::new()
            } else {
                format!(
                    " and, after the first {} ms, at {} bytes a second or more",
                    pace.grace.as_millis(),
                    pace.min_rate
                )
            };
            format!(
                "the request body came too slowly: it must arrive whole within {} ms{rate}; \
                 it was not forwarded whole",
                pace.timeout.as_millis()
            )
        }
        _ => "the request body is malformed or broke off; it was not forwarded whole".to_owned(),
    }
}
