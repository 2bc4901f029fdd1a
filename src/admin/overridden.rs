//! `GET /admin/v1/overrides`: every limit that holds overrides in force, found from the
//! store's list of them (`limiter::overrides::registry_of`), each named by its route and limit
//! when the policy in force has it, and listed apart when it does not: a removed (or renamed,
//! or re-keyed) limit's overrides are never applied to another limit (their keys name the
//! route, the limit and its algorithm), they wait until they expire, and this is where an
//! operator sees them. A limit added back with the same route, name and algorithm reads them
//! again.

use http::{Response, StatusCode};
use serde_json::json;

use super::{json_response, problem, Admin};
use crate::limiter::overrides::{index_of, registry_of};
use crate::proxy::ProxyBody;
use crate::request::store_key;

/// At most this many limits are listed (each costs the store one `ZCOUNT`).
const MOST_LIMITS: usize = 1000;

impl Admin {
    pub(super) async fn overridden(&self, path: &str) -> Response<ProxyBody> {
        let policy = self.gateway.policy();
        let store = self.gateway.store();
        let holders = match store
            .overridden_limits(&registry_of(&policy.key_prefix), MOST_LIMITS)
            .await
        {
            Ok(holders) => holders,
            Err(err) => {
                return problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("{} store: {err}", store.name()),
                    path,
                    &[],
                )
            }
        };
        // Every limit of the policy by its index key, to name what the store holds.
        let named: Vec<(String, &str, &str, bool)> = policy
            .routes
            .iter()
            .flat_map(|route| {
                route.limits.iter().map(|limit| {
                    (
                        index_of(&store_key::prefix(&policy, route, limit)),
                        route.name.as_str(),
                        limit.name.as_str(),
                        limit.spec.overridable,
                    )
                })
            })
            .collect();
        let (mut limits, mut not_in_policy) = (Vec::new(), Vec::new());
        for holder in &holders {
            match named.iter().find(|(index, ..)| *index == holder.index) {
                Some((_, route, limit, overridable)) => limits.push(json!({
                    "route": route,
                    "limit": limit,
                    "overrides": holder.overrides,
                    // A limit that no longer says `overrides: true` ignores them.
                    "applied": overridable,
                })),
                None => not_in_policy.push(json!({
                    "index": holder.index,
                    "overrides": holder.overrides,
                })),
            }
        }
        json_response(
            StatusCode::OK,
            &json!({
                "store": store.name(),
                "truncated": holders.len() == MOST_LIMITS,
                "limits": limits,
                "not_in_policy": not_in_policy,
            }),
        )
    }
}
