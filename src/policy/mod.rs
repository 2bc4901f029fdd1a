//! The compiled policy: routes with their matchers, actions and limits, built once from the
//! config and never changed afterwards; plain data, swapped whole on reload. What must outlive
//! a reload (upstream connection pools, the store) lives outside it, so nothing here needs the
//! proxy.
//!
//! By job: `routes` holds the types the request path reads (`Policy`, `Route`, `Limit`,
//! `Upstream`), `index` finds the route a path matches (through `matcher`'s trie of
//! prefixes), `compile` turns a parsed config into a policy (a pure function of it and of the TLS settings and JWT
//! verifiers read beforehand: it reads no file and creates no metric series) and attaches the
//! metric handles once the policy is put in force (`Compiled::metered`, so a refused file
//! leaves no series behind), and `rules` is the table of which limit options go together.
//! `matcher`, `condition` and `fields` compile a route's `match:`, a limit's `when:` and the
//! request fields its limits read. A limit's store key is built in `crate::request::store_key`.

mod compile;
mod condition;
mod fields;
mod index;
mod matcher;
mod routes;
mod rules;

pub use self::condition::{Condition, HeaderTest};
pub use self::fields::Field;
pub use self::matcher::Matcher;
pub use self::routes::*;
