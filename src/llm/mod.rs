//! LLM token budgets: a limit counted in tokens instead of requests. Before the request is
//! decided, `estimate` bounds from the buffered request body what it can consume at most
//! (the reservation, the check's cost); after the upstream answers, `usage` reads what it
//! did consume from the response as it streams, and the difference is given back
//! (`Store::settle`). Reserving the upper bound atomically and only ever settling down is
//! what keeps settled plus reserved tokens inside the limit at every instant.

pub mod estimate;
pub mod usage;

pub use self::estimate::{estimate, EstimateError, Reservation, Reserve};
pub use self::usage::{Usage, UsageScanner};
