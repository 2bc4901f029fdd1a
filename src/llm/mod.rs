//! LLM token budgets: a limit counted in tokens instead of requests. Before the request is
//! decided, `estimate` bounds from the buffered request body what it can consume at most
//! (the reservation, the check's cost); after the upstream answers, `usage` reads what it
//! did consume from the response as it streams, and the difference is given back
//! (`Store::settle`). Reserving the upper bound atomically and settling down is what keeps
//! settled plus reserved tokens inside the limit at every instant; an answer that reports
//! more than its reservation (the bound was wrong) is charged the excess, so the identity
//! waits for what the upstream spent.

pub mod config;
pub mod estimate;
pub mod usage;

pub use self::estimate::{estimate, EstimateError, Reservation, Reserve};
pub use self::usage::{Usage, UsageScanner};

use http::HeaderName;

/// Most tokens a `sliding_log` token budget may hold: its log keeps one entry per token
/// (`weighted_log`, the default of a token budget, keeps one per request).
pub const MAX_SLIDING_LOG_TOKENS: u32 = 1_000_000;

/// A limit counted in tokens: how each request reserves, and how it is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBudget {
    pub reserve: Reserve,
    pub settle: Settle,
}

/// Where a token limit reads the real count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// The response body's usage (JSON `usage`, or the usage events of an event stream).
    Usage,
    /// A response header holding the tokens used, as a decimal integer.
    Header(HeaderName),
}

/// Whether a token budget can run on `algorithm`: its settlement gives back exactly what
/// was not used, which needs an algorithm whose give-back is exact.
pub fn settles_exactly(algorithm: crate::limiter::Algorithm) -> bool {
    // A calendar quota gives back within the request's period (`release.lua`): exact too.
    use crate::limiter::Algorithm;
    matches!(
        algorithm,
        Algorithm::SlidingLog | Algorithm::WeightedLog | Algorithm::Calendar
    )
}

/// How a token budget reserves and settles, in a sentence (`sluice explain`).
pub fn describe(budget: &TokenBudget) -> String {
    let r = &budget.reserve;
    let settle = match &budget.settle {
        Settle::Usage => {
            "the answer's usage (JSON `usage` or the usage events of a stream)".to_owned()
        }
        Settle::Header(name) => format!("the answer's `{name}` header"),
    };
    format!(
        "reserves body bytes + output cap (default {}, at most {}) + {} per non-text part + {} \
         per request, body read whole up to {} bytes; settles to {settle}; without a figure, \
         keeps the reservation (gives it all back when the upstream cannot be reached)",
        r.default_output, r.max_output, r.per_non_text_part, r.per_request, r.max_body
    )
}
