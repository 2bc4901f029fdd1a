//! The compiled policy: routes with their matchers, actions and limits, built once from the
//! config and never changed afterwards. This is where the parts of the file are checked against
//! each other (every upstream a route names exists, names are unique), with positions.
//!
//! A policy is plain data, built once per config file and swapped whole on reload; what must
//! outlive a reload (upstream connection pools, the store) lives outside it, so nothing here
//! needs the proxy. Compiling is a pure function of the parsed config and the upstreams' TLS
//! settings, read from their files beforehand (`tls::UpstreamTlsSet`): it reads no file and
//! creates no metric series. The metric handles each route and limit counts into are
//! attached afterwards (`Compiled::metered`), by whoever puts the policy in force, so a file
//! that is refused leaves no series behind.

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
