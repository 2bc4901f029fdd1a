//! `/admin/v1/limits/{route}/{limit}/override?<identity>`: one identity's override of a
//! limit's number (`limiter::overrides`), read (`GET`), set (`PUT ...&requests=N[&ttl=72h]`)
//! or removed (`DELETE`). Every change is an audit line (target `sluice::audit`: who, what,
//! old and new) and tells every instance to forget its denials of the identity.

use std::time::Duration;

use http::{Method, Response, StatusCode};
use serde_json::json;

use super::{json_response, limits, merge, problem, Admin};
use crate::config::ConfigDuration;
use crate::limiter::overrides::{registry_of, OverrideError, DEFAULT_TTL, MAX_TTL};
use crate::limiter::{Check, Store};
use crate::proxy::ProxyBody;
use crate::request::store_key;

/// What a `PUT` asks for, taken out of the query before the identity is read from the rest.
struct Change {
    requests: Option<u32>,
    ttl: Option<Duration>,
}

/// Splits `requests=` and `ttl=` from the query; the rest names the identity.
fn change_of(query: &str) -> Result<(Change, String), String> {
    let mut change = Change {
        requests: None,
        ttl: None,
    };
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        match pair.split_once('=') {
            Some(("requests", value)) => {
                change.requests = Some(value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                    format!("requests=`{value}`: expected a whole number of at least 1")
                })?);
            }
            Some(("ttl", value)) => {
                let ttl: ConfigDuration = value
                    .parse()
                    .map_err(|err| format!("ttl=`{value}`: {err}"))?;
                if ttl.0.is_zero() || ttl.0 > MAX_TTL {
                    return Err(format!(
                        "ttl=`{value}`: an override lasts from 1 ms to {} days",
                        MAX_TTL.as_secs() / 86_400
                    ));
                }
                change.ttl = Some(ttl.0);
            }
            _ => rest.push(pair),
        }
    }
    Ok((change, rest.join("&")))
}

/// Most overrides one list answers, and the default.
const MOST_LISTED: usize = 1000;
const DEFAULT_LISTED: usize = 100;

impl Admin {
    /// `GET /admin/v1/limits/{route}/{limit}/overrides?max=N`: the limit's overrides, soonest
    /// to expire first, at most `max` (100 by default, at most 1,000). On Redis, one read of
    /// the limit's index and one per override listed.
    pub(super) async fn overrides_of(
        &self,
        (route, limit): (&str, &str),
        query: &str,
        path: &str,
    ) -> Response<ProxyBody> {
        self.on_limit((route, limit), path, async |policy, found, rule| {
            let most = match query.split('&').find_map(|pair| pair.strip_prefix("max=")) {
                None => DEFAULT_LISTED,
                Some(text) => match text.parse::<usize>() {
                    Ok(n) if (1..=MOST_LISTED).contains(&n) => n,
                    _ => {
                        return problem(
                            StatusCode::BAD_REQUEST,
                            &format!(
                                "max=`{text}`: expected a whole number from 1 to {MOST_LISTED}"
                            ),
                            path,
                            &[],
                        )
                    }
                },
            };
            let check = crate::limiter::Check {
                key: store_key::prefix(policy, found, rule),
                spec: rule.spec,
            };
            let store = self.gateway.store();
            match store.list_overrides(&check, most).await {
                Ok(listed) => {
                    let overrides: Vec<_> = listed
                        .iter()
                        .map(|entry| {
                            json!({
                                "identity": crate::limiter::overrides::identity_of(&entry.key),
                                "requests": entry.requests,
                                "expires_in": entry.expires_in.as_secs_f64(),
                            })
                        })
                        .collect();
                    json_response(
                        StatusCode::OK,
                        &json!({
                            "route": route,
                            "limit": limit,
                            "unit": rule.unit(),
                            "policy_requests": rule.spec.requests,
                            "store": store.name(),
                            "truncated": overrides.len() == most,
                            "overrides": overrides,
                        }),
                    )
                }
                Err(err) => problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("{} store: {err}", store.name()),
                    path,
                    &[],
                ),
            }
        })
        .await
    }

    pub(super) async fn override_of(
        &self,
        method: &Method,
        (route, limit): (&str, &str),
        query: &str,
        path: &str,
        by: &str,
    ) -> Response<ProxyBody> {
        self.on_limit((route, limit), path, async |policy, found, rule| {
            if !rule.spec.overridable {
                return takes_none(route, limit, path);
            }
            let (change, identity_query) = match change_of(query) {
                Ok(split) => split,
                Err(detail) => return problem(StatusCode::BAD_REQUEST, &detail, path, &[]),
            };
            let key = match limits::store_key(policy, found, rule, &identity_query) {
                Ok(key) => key,
                Err(detail) => return problem(StatusCode::BAD_REQUEST, &detail, path, &[]),
            };
            let check = store_key::check(rule, key, crate::runtime::clock::now());
            let identity = store_key::identity_of(policy, found, rule, &check.key).to_owned();
            let store = self.gateway.store();
            let failed =
                |detail: String| problem(StatusCode::SERVICE_UNAVAILABLE, &detail, path, &[]);
            let mut body = json!({
                "route": route,
                "limit": limit,
                "identity": identity,
                "unit": rule.unit(),
                "policy_requests": rule.spec.requests,
                "store": store.name(),
            });
            let audit = |action: &str, old: Option<u32>, new: Option<u32>| {
                self.metrics
                    .store
                    .override_changes
                    .with_label_values(&[action])
                    .inc();
                tracing::info!(
                    target: "sluice::audit",
                    by,
                    action,
                    route,
                    limit,
                    identity = %crate::log::key_hash(&check.key),
                    old = ?old,
                    new = ?new,
                    ttl_s = change.ttl.unwrap_or(DEFAULT_TTL).as_secs(),
                    "admin API: override {action}"
                );
            };
            let answer = match *method {
                Method::PUT => {
                    let registry = registry_of(&policy.key_prefix);
                    set(store, &check, &change, &registry, path).await
                }
                Method::DELETE => delete(store, &check).await,
                _ => get(store, &check).await,
            };
            match answer {
                Ok(Answer { outcome, audited }) => {
                    if let Some((action, old, new)) = audited {
                        audit(action, old, new);
                    }
                    merge(&mut body, outcome);
                }
                Err(Failed::Refused(response)) => return response,
                Err(Failed::Store(detail)) => return failed(detail),
            }
            json_response(StatusCode::OK, &body)
        })
        .await
    }
}

/// What a change of an override answers, and what it changed for the audit line: the
/// action, the old and the new number.
struct Answer {
    outcome: serde_json::Value,
    audited: Option<(&'static str, Option<u32>, Option<u32>)>,
}

/// Why a request on an override failed: refused as asked (its answer), or the store's fault.
enum Failed {
    Refused(Response<ProxyBody>),
    Store(String),
}

/// `PUT`: sets the identity's override to `change`'s number, for its `ttl`, noting its limit in
/// `registry` (the list of limits holding overrides).
async fn set(
    store: &Store,
    check: &Check,
    change: &Change,
    registry: &str,
    path: &str,
) -> Result<Answer, Failed> {
    let Some(requests) = change.requests else {
        return Err(Failed::Refused(problem(
            StatusCode::BAD_REQUEST,
            "PUT needs requests=N: the identity's number, in the limit's unit",
            path,
            &[],
        )));
    };
    let ttl = change.ttl.unwrap_or(DEFAULT_TTL);
    match store.set_override(check, requests, ttl, registry).await {
        Ok((old, told)) => Ok(Answer {
            outcome: json!({
                "old": old,
                "requests": requests,
                "expires_in": ttl.as_secs_f64(),
                "instances_told": told,
            }),
            audited: Some(("set", old, Some(requests))),
        }),
        Err(OverrideError::Full(bound)) => Err(Failed::Refused(problem(
            StatusCode::INSUFFICIENT_STORAGE,
            &format!(
                "the in-process store holds {bound} overrides, its bound (store.local.max_keys)"
            ),
            path,
            &[],
        ))),
        Err(OverrideError::Store(err)) => {
            Err(Failed::Store(format!("{} store: {err}", store.name())))
        }
    }
}

/// `DELETE`: removes the identity's override.
async fn delete(store: &Store, check: &Check) -> Result<Answer, Failed> {
    match store.delete_override(check).await {
        Ok((old, told)) => Ok(Answer {
            outcome: json!({ "old": old, "requests": null, "instances_told": told }),
            audited: Some(("deleted", old, None)),
        }),
        Err(err) => Err(Failed::Store(format!("{} store: {err}", store.name()))),
    }
}

/// `GET`: the identity's override, if it has one.
async fn get(store: &Store, check: &Check) -> Result<Answer, Failed> {
    match store.get_override(check).await {
        Ok(found) => Ok(Answer {
            outcome: json!({
                "requests": found.map(|o| o.requests),
                "expires_in": found.map(|o| o.expires_in.as_secs_f64()),
            }),
            audited: None,
        }),
        Err(err) => Err(Failed::Store(format!("{} store: {err}", store.name()))),
    }
}
/// The `409` of an override asked of a limit without `overrides: true`.
pub(super) fn takes_none(route: &str, limit: &str, path: &str) -> Response<ProxyBody> {
    problem(
        StatusCode::CONFLICT,
        &format!(
            "limit `{limit}` of route `{route}` takes no overrides: set `overrides: true` on it \
             in the policy"
        ),
        path,
        &[("route", route), ("limit", limit)],
    )
}
