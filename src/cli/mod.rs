//! The commands besides `run` (which is `crate::app`): each reads a version of the config file
//! (`crate::version`) as `run` would and prints what it found; none serves, touches the store
//! or fetches anything.
//!
//! - `check`: the file checked whole, summed up in one line (or every mistake).
//! - `explain`: what sluice would do with one request.
//! - `explain_rls`: the rate limit service's answer to one call.
//!
//! Apart from those, `usage` (and `overrides load`) call a running sluice's admin API
//! (`admin_client`) instead of reading the file.

mod admin_client;
mod check;
pub mod explain;
mod explain_rls;
mod usage;

pub use check::check;
pub use explain::{explain, ExplainError, Question};
pub use explain_rls::explain_rls;
pub use usage::{load_overrides, usage, AdminFlags, UsageQuestion};
