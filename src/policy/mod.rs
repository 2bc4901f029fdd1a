//! The compiled policy: routes with their matchers, actions and limits, built once from the
//! config and never changed afterwards; plain data, swapped whole on reload. What must outlive
//! a reload (upstream connection pools, the store) lives outside it, so nothing here needs the
//! proxy.
//!
//! By job: `model` holds the types the request path reads (`Policy`, `Route`, `Limit`,
//! `Upstream`), `index` finds the routes a path can match by its first segment, `compile`
//! turns a parsed config into a policy (a pure function of it and of the TLS settings and JWT
//! verifiers read beforehand: it reads no file and creates no metric series) and attaches the
//! metric handles once the policy is put in force (`Compiled::metered`, so a refused file
//! leaves no series behind), and `rules` is the table of which limit options go together.
//! `matcher`, `condition` and `fields` compile a route's `match:`, a limit's `when:` and the
//! request fields its limits read. A limit's store key is completed here (`Limit::check`).

mod compile;
mod condition;
mod fields;
mod index;
mod matcher;
mod model;
mod rules;

use std::time::Duration;

pub use self::condition::{Condition, HeaderTest};
pub use self::fields::Field;
pub use self::matcher::Matcher;
pub use self::model::*;
use crate::limiter::Check;

impl<M: Metering> Limit<M> {
    /// The check of this limit for one identity's store key: the one place a `Check` is built.
    /// A calendar quota's key gets the current period's label (`:2026-11`, outside the
    /// identity's `{...}`, so Redis Cluster places every period of one identity in its slot)
    /// and its window is the time left in that period, both from sluice's wall clock.
    pub fn check(&self, key: String) -> Check {
        let mut check = Check {
            key,
            spec: self.spec,
        };
        if let Some(quota) = &self.quota {
            let now = crate::clock::now();
            check.key.push(':');
            match quota.span_at(now) {
                Ok(span) => {
                    span.push_label(&mut check.key);
                    check.spec.window = span.left_at(now);
                }
                // Only a clock set beyond the year 9999 gets here: count in a key of its own,
                // one second at a time, rather than fail the request.
                Err(_) => {
                    check.key.push_str("beyond-the-calendar");
                    check.spec.window = Duration::from_secs(1);
                }
            }
        }
        check
    }
}
