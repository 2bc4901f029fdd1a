//! LLM token budgets: a limit counted in tokens (or in money: tokens priced at the model's
//! prices) instead of requests. Before the request is decided, `estimate` bounds from the
//! buffered request body, its API and its model's facts (`models`) what it can consume at
//! most (the reservation, the check's cost); after the upstream answers, `usage` reads what
//! it did consume from the response as it streams, and the difference is given back
//! (`Store::keep`). Reserving the upper bound atomically and settling down is what keeps
//! settled plus reserved tokens inside the limit at every instant; an answer that reports
//! more than its reservation (the bound was wrong) is charged the excess, so the identity
//! waits for what the upstream spent. A limit may switch a request it refuses to a cheaper
//! model instead (`switch`).

pub mod config;
pub mod estimate;
pub mod models;
pub mod switch;
pub mod usage;

pub use self::estimate::{estimate, Api, EstimateError, Reservation, Reserve, StoredState};
pub use self::models::{ModelFacts, Models, Prices};
pub use self::usage::{Usage, UsageScanner};

use std::sync::Arc;

use http::HeaderName;

/// A limit counted in tokens or money: how each request reserves, how it is settled, in
/// which unit, with which model facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBudget {
    pub reserve: Reserve,
    pub usage_from: UsageFrom,
    pub unit: Unit,
    pub models: Arc<Models>,
    /// `on_exceed: { switch_model: M }`: a request this limit refuses is sent to `M` instead
    /// (`switch`); `None`: refused.
    pub switch_to: Option<switch::Fallback>,
}

/// What a budget counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unit {
    Tokens,
    /// Micro-units of `currency` (`label`: `microUSD`), priced at the models' prices.
    Money {
        currency: String,
        label: String,
    },
}

impl Unit {
    /// The unit's name in RateLimit fields (`qu=`), problem bodies, metrics and `explain`.
    pub fn label(&self) -> &str {
        match self {
            Unit::Tokens => "tokens",
            Unit::Money { label, .. } => label,
        }
    }
}

/// Where a token limit reads the real count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageFrom {
    /// The response body's usage (JSON `usage`, or the usage events of an event stream).
    Usage,
    /// A response header holding the tokens used, as a decimal integer.
    Header(HeaderName),
}

/// How a token budget reserves and settles, in a sentence (`sluice explain`).
pub fn describe(budget: &TokenBudget) -> String {
    let r = &budget.reserve;
    let settle = match &budget.usage_from {
        UsageFrom::Usage => {
            "the answer's usage (JSON `usage` or the usage events of a stream)".to_owned()
        }
        UsageFrom::Header(name) => format!("the answer's `{name}` header"),
    };
    let default = r
        .default_output
        .map_or("the model's max_output".to_owned(), |d| d.to_string());
    let priced = match &budget.unit {
        Unit::Tokens => String::new(),
        Unit::Money { currency, label } => {
            format!(" priced at the model's prices in {currency} and counted in {label}")
        }
    };
    let stored = match r.stored_state {
        None => "refused".to_owned(),
        Some(StoredState::Context) => "charged the model's context".to_owned(),
        Some(StoredState::Tokens(n)) => format!("charged {n}"),
    };
    let tools = r
        .server_tool
        .map_or("refused".to_owned(), |n| format!("charged {n} each"));
    let over = budget.switch_to.as_ref().map_or(String::new(), |to| {
        format!(
            "; over the limit: sent to model `{}` instead, planned and decided again there \
             (once)",
            to.model
        )
    });
    format!(
        "reserves body bytes + images and other non-text parts at the model's figures + \
         per_request ({} here + the model's) + the model's tool prompt when tools are given + \
         output cap × completions (cap written when none: {default}, at most {}){priced}; \
         stored state {stored}; server tools {tools}; body read whole up to {} bytes; settles \
         to {settle}; without a figure, keeps the reservation (gives it all back when the \
         upstream cannot be reached){over}",
        r.per_request, r.max_output, r.max_body
    )
}
