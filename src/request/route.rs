//! The route phase: the first route of the policy that matches the head, and what that route
//! refuses before anything is decided: a field its limits read sent twice, a declared body
//! over its size limit.

use http::request::Parts;
use http::StatusCode;

use super::request_body::BodyFault;
use super::stop::{body_detail, Stop};
use crate::metrics::Refusal;
use crate::one_request;
use crate::policy::{Policy, Route};

/// The first route of `policy` that matches `head`.
pub fn route<'p>(policy: &'p Policy, head: &Parts) -> Result<&'p Route, Stop> {
    policy
        .route(&head.method, head.uri.path())
        .ok_or(Stop::NoRoute)
}

/// What `route` refuses before a decision. `declared_length`: the body's length as the
/// request declares it (0 when it does not).
pub fn refuse(route: &Route, head: &Parts, declared_length: u64) -> Result<(), Stop> {
    one_request::check_fields(&route.fields, &head.uri, &head.headers)?;
    // A declared length over the limit is refused before it costs a decision.
    if route.max_body.is_some_and(|max| declared_length > max) {
        return Err(Stop::Refused {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            detail: body_detail(BodyFault::TooLarge, Some(route)),
            reason: Refusal::BodyTooLarge,
        });
    }
    Ok(())
}
