//! How forwarding to an upstream fails: the upstream's fault (cannot connect, no answer in
//! time, anything else, each its own counter and status) or the client body's.

use std::time::Duration;

use crate::proxy::request_body::BodyFault;

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("cannot connect to the upstream: {0}")]
    Connect(String),
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the upstream failed: {0}")]
    Other(String),
    /// The client's fault, not the upstream's.
    #[error("{0}")]
    Body(BodyFault),
}

/// hyper's client errors say little at the top ("client error (Connect)"); the cause is below.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
