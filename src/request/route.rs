//! Routing: the first route of the policy that matches the head, and what that route
//! refuses before anything is decided: a field its limits read sent twice (the one-reading
//! rule, `super::one_reading::check_fields`), a declared body over its size limit.

use http::request::Parts;
use http::StatusCode;

use super::{one_reading, Why};
use crate::metrics::Refusal;
use crate::policy::{Policy, Route};

/// The first route of `policy` that matches `head`.
pub fn route<'p>(policy: &'p Policy, head: &Parts) -> Result<&'p Route, Why> {
    policy
        .route(&head.method, head.uri.path())
        .ok_or(Why::NoRoute)
}

/// What `route` refuses before a decision. `declared_length`: the body's length as the
/// request declares it (0 when it does not).
pub fn refuse(route: &Route, head: &Parts, declared_length: u64) -> Result<(), Why> {
    one_reading::check_fields(&route.fields, &head.uri, &head.headers)?;
    // A declared length over the limit is refused before it costs a decision.
    if let Some(max) = route.max_body.filter(|max| declared_length > *max) {
        return Err(Why::Unreadable {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            detail: too_large(max),
            reason: Refusal::BodyTooLarge,
        });
    }
    Ok(())
}

/// The detail of a 413 on a route that accepts at most `max` bytes of body: the same words
/// whether the length was declared or the body outgrew it while streaming.
pub fn too_large(max: u64) -> String {
    format!("the request body is larger than {max} bytes, the most this route accepts")
}
