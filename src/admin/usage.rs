//! Usage reports: who uses a limit most, and where one identity stands in every limit it
//! falls under.
//!
//! - `GET /admin/v1/limits/{route}/{limit}/usage?top=N`: the N identities of a `report: true`
//!   limit with the most use in its current window or period. The candidates come from the
//!   limit's usage index (`limiter::usage`: a few times N of its top members per time
//!   bucket, one `ZREVRANGE` each, never a read of the keyspace), then each candidate's exact
//!   state is read as the single-identity `GET` reads it (`peek`, override included) and the
//!   list is sorted by that. In process, the candidates are the identities the store holds
//!   keys of for the limit.
//! - `GET /admin/v1/usage?<key part>=<value>&...[&route=R]`: one identity, named by one value
//!   per key part (as the single-identity `GET` names them), in every limit whose key parts
//!   are all named (a part a limit's key lacks is ignored for that limit; a limit with a
//!   part not named is listed under `not_named`, never guessed). Reads the store once per
//!   limit.
//!
//! Each entry says `used`, the `limit` in force (an identity's override when it has one),
//! `remaining` and `reset` in the limit's unit; a money budget also its `spend` and `budget`
//! in the currency.

use std::fmt::Write as _;

use http::{Response, StatusCode};
use serde_json::json;

use super::{find_limit, json_response, limits, problem, Admin};
use crate::config::KeyPart;
use crate::limiter::{Peek, Store};
use crate::policy::{Limit, Policy, Route};
use crate::proxy::ProxyBody;
use crate::request::store_key;

/// Most identities one report answers, and the default.
const MOST_TOP: usize = 1000;
const DEFAULT_TOP: usize = 10;

/// Candidates read from the index per bucket, per identity answered: enough that an identity
/// whose settled use ranks above its index score (a token budget's reservation given back)
/// is still among them.
const CANDIDATES_PER_ENTRY: usize = 3;

impl Admin {
    /// `GET /admin/v1/limits/{route}/{limit}/usage?top=N`.
    pub(super) async fn usage_top(
        &self,
        (route, limit): (&str, &str),
        query: &str,
        path: &str,
    ) -> Response<ProxyBody> {
        let policy = self.gateway.policy();
        let (found, rule) = match find_limit(&policy, route, limit, path) {
            Ok(found) => found,
            Err(response) => return *response,
        };
        if !rule.report {
            return problem(
                StatusCode::CONFLICT,
                &format!(
                    "limit `{limit}` of route `{route}` keeps no usage index: set `report: true` \
                     on it in the policy"
                ),
                path,
                &[("route", route), ("limit", limit)],
            );
        }
        let top = match query.split('&').find_map(|pair| pair.strip_prefix("top=")) {
            None => DEFAULT_TOP,
            Some(text) => match text.parse::<usize>() {
                Ok(n) if (1..=MOST_TOP).contains(&n) => n,
                _ => {
                    return problem(
                        StatusCode::BAD_REQUEST,
                        &format!("top=`{text}`: expected a whole number from 1 to {MOST_TOP}"),
                        path,
                        &[],
                    )
                }
            },
        };
        let store = self.gateway.store();
        let prefix = store_key::prefix(&policy, found, rule);
        let candidates = match store
            .usage_candidates(
                &prefix,
                rule.spec.window,
                rule.quota.is_some(),
                top * CANDIDATES_PER_ENTRY,
            )
            .await
        {
            Ok(candidates) => candidates,
            Err(err) => return unavailable(store, &err, path),
        };
        let now = crate::runtime::clock::now();
        let mut read = Vec::with_capacity(candidates.len());
        let mut answered = store.name();
        for (identity, _) in &candidates {
            let key = store_key::from_identity(&policy, found, rule, identity);
            let check = store_key::check(rule, key, now);
            match store.peek(&check).await {
                Ok((peek, by)) if peek.count > 0 => {
                    answered = by;
                    read.push((identity.as_str(), peek));
                }
                Ok(_) => {}
                Err(err) => return unavailable(store, &err, path),
            }
        }
        read.sort_by(|a, b| b.1.count.cmp(&a.1.count).then_with(|| a.0.cmp(b.0)));
        read.truncate(top);
        let identities: Vec<_> = read
            .iter()
            .map(|(identity, peek)| entry(rule, identity, peek))
            .collect();
        let mut body = json!({
            "route": route,
            "limit": limit,
            "algorithm": rule.spec.algorithm.label(),
            "unit": rule.unit(),
            "window": rule.spec.window.as_secs_f64(),
            "policy_requests": rule.spec.requests,
            "store": answered,
            "candidates_read": candidates.len(),
            "identities": identities,
        });
        if let Some(quota) = &rule.quota {
            body["quota"] = quota.period.label().into();
        }
        if let Some(currency) = currency(rule) {
            body["currency"] = currency.into();
        }
        json_response(StatusCode::OK, &body)
    }

    /// `GET /admin/v1/usage?<key part>=<value>&...[&route=R]`.
    pub(super) async fn usage_of(&self, query: &str, path: &str) -> Response<ProxyBody> {
        let (only_route, named) = match named_parts(query) {
            Ok(named) => named,
            Err(detail) => return problem(StatusCode::BAD_REQUEST, &detail, path, &[]),
        };
        if named.is_empty() {
            return problem(
                StatusCode::BAD_REQUEST,
                "name the identity with one value per key part: client_ip=, header.NAME=, \
                 query.NAME=, cookie.NAME=, jwt.CLAIM=, method=, host=, path=, model= \
                 (and route= to read one route only)",
                path,
                &[],
            );
        }
        let policy = self.gateway.policy();
        let store = self.gateway.store();
        let now = crate::runtime::clock::now();
        let (mut limits_read, mut not_named, mut refused) = (Vec::new(), Vec::new(), Vec::new());
        let routes = policy.routes.iter().filter(|route| {
            only_route
                .as_deref()
                .is_none_or(|only| route.name.as_str() == only)
        });
        for route in routes {
            for rule in &route.limits {
                let Some(query) = query_for(rule, &named) else {
                    not_named.push(json!({
                        "route": route.name.as_str(),
                        "limit": rule.name.as_str(),
                        "key": rule.key.iter().map(KeyPart::to_string).collect::<Vec<_>>(),
                    }));
                    continue;
                };
                let key = match key_of(&policy, route, rule, &query) {
                    Ok(key) => key,
                    Err(detail) => {
                        refused.push(json!({
                            "route": route.name.as_str(),
                            "limit": rule.name.as_str(),
                            "detail": detail,
                        }));
                        continue;
                    }
                };
                let check = store_key::check(rule, key, now);
                let identity = store_key::identity_of(&policy, route, rule, &check.key);
                match store.peek(&check).await {
                    Ok((peek, _)) => {
                        let mut one = entry(rule, identity, &peek);
                        one["route"] = route.name.as_str().into();
                        one["name"] = rule.name.as_str().into();
                        one["unit"] = rule.unit().into();
                        one["algorithm"] = rule.spec.algorithm.label().into();
                        if let Some(currency) = currency(rule) {
                            one["currency"] = currency.into();
                        }
                        limits_read.push(one);
                    }
                    Err(err) => return unavailable(store, &err, path),
                }
            }
        }
        let given: serde_json::Map<String, serde_json::Value> = named
            .iter()
            .map(|(name, value, _)| (name.clone(), value.clone().into()))
            .collect();
        json_response(
            StatusCode::OK,
            &json!({
                "identity": given,
                "store": store.name(),
                "limits": limits_read,
                "not_named": not_named,
                "refused": refused,
            }),
        )
    }
}

/// One identity's line of a report.
fn entry(rule: &Limit, identity: &str, peek: &Peek) -> serde_json::Value {
    let in_force = peek.overridden.unwrap_or(rule.spec.requests);
    let mut one = json!({
        "identity": identity,
        "used": peek.count,
        "limit": in_force,
        "overridden": peek.overridden.is_some(),
        "remaining": peek.remaining,
        "reset": peek.reset.as_secs_f64(),
    });
    if currency(rule).is_some() {
        one["spend"] = decimal(peek.count).into();
        one["budget"] = decimal(u64::from(in_force)).into();
    }
    one
}

/// A money budget's currency (it counts micro-units of it); `None` for the others.
fn currency(rule: &Limit) -> Option<&str> {
    match rule.tokens.as_deref().map(|budget| &budget.unit) {
        Some(crate::llm::Unit::Money { currency, .. }) => Some(currency),
        _ => None,
    }
}

/// Micro-units as a decimal amount with six places: `12500000` → `12.500000`. Exact, as
/// the store counts them (no floating point).
pub fn decimal(micro: u64) -> String {
    let mut text = String::new();
    let _ = write!(text, "{}.{:06}", micro / 1_000_000, micro % 1_000_000);
    text
}

fn unavailable(store: &Store, err: &crate::limiter::StoreError, path: &str) -> Response<ProxyBody> {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        &format!("{} store: {err}", store.name()),
        path,
        &[],
    )
}

/// The identity's parameters: `route=` apart, then each other parameter with its decoded
/// value and the key part it names (`path=` names the path and its parameters).
type Named = Vec<(String, String, Named1)>;

/// Which key parts one parameter names.
#[derive(Clone)]
enum Named1 {
    Part(KeyPart),
    /// `path=`: the path, and every `param:NAME` a route reads from it.
    Path,
}

fn named_parts(query: &str) -> Result<(Option<String>, Named), String> {
    let mut route = None;
    let mut named = Named::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (raw_name, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |raw: &str| {
            String::from_utf8(crate::request::fields::percent_decode(raw))
                .map_err(|_| format!("`{raw}` is not UTF-8 once decoded"))
        };
        let (name, value) = (decode(raw_name)?, decode(raw_value)?);
        if name == "route" {
            route = Some(value);
            continue;
        }
        if named.iter().any(|(seen, _, _)| *seen == name) {
            return Err(format!(
                "`{name}` is given twice: an identity has one value per key part"
            ));
        }
        let (kind, rest) = match name.split_once(['.', ':']) {
            Some((kind, rest)) if !rest.is_empty() => (kind, Some(rest)),
            _ => (name.as_str(), None),
        };
        let part = match (kind, rest) {
            ("client_ip", None) => Named1::Part(KeyPart::ClientIp),
            ("method", None) => Named1::Part(KeyPart::Method),
            ("host", None) => Named1::Part(KeyPart::Host),
            ("model", None) => Named1::Part(KeyPart::Model),
            ("path", None) => Named1::Path,
            ("header", Some(header)) => Named1::Part(KeyPart::Header(
                http::HeaderName::from_bytes(header.as_bytes())
                    .map_err(|_| format!("`{name}`: `{header}` is not a header name"))?,
            )),
            ("query", Some(field)) => Named1::Part(KeyPart::Query(field.to_owned())),
            ("cookie", Some(field)) => Named1::Part(KeyPart::Cookie(field.to_owned())),
            ("jwt", Some(claim)) => Named1::Part(KeyPart::Jwt(claim.to_owned())),
            _ => {
                return Err(format!(
                    "unknown parameter `{name}`: use client_ip=, header.NAME=, query.NAME=, \
                     cookie.NAME=, jwt.CLAIM=, method=, host=, path=, model=, route="
                ))
            }
        };
        named.push((name, value, part));
    }
    Ok((route, named))
}

/// The query naming `rule`'s identity from `named`: the parameters of the parts its key has.
/// `None` when some part of its key is not named.
fn query_for(rule: &Limit, named: &Named) -> Option<String> {
    let names = |part: &KeyPart, given: &Named1| match (part, given) {
        (KeyPart::Path | KeyPart::Param(_), Named1::Path) => true,
        (part, Named1::Part(given)) => part == given,
        _ => false,
    };
    // A limit without key parts counts everyone together: it is no one identity's.
    if rule.key.is_empty()
        || !rule
            .key
            .iter()
            .all(|part| named.iter().any(|(_, _, given)| names(part, given)))
    {
        return None;
    }
    let mut query = String::new();
    for (name, value, given) in named {
        if rule.key.iter().any(|part| names(part, given)) {
            if !query.is_empty() {
                query.push('&');
            }
            super::limits::encode_into(&mut query, name.as_bytes());
            query.push('=');
            super::limits::encode_into(&mut query, value.as_bytes());
        }
    }
    Some(query)
}

/// The store key `query` names for `rule`, built as a live request's is.
fn key_of(policy: &Policy, route: &Route, rule: &Limit, query: &str) -> Result<String, String> {
    limits::store_key(policy, route, rule, query)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_units_read_as_an_exact_decimal() {
        assert_eq!(decimal(12_500_000), "12.500000");
        assert_eq!(decimal(7), "0.000007");
        assert_eq!(decimal(0), "0.000000");
    }

    #[test]
    fn an_identity_names_each_part_once() {
        let (route, named) =
            named_parts("route=api&header.x-api-key=k%201&client_ip=10.0.0.1").expect("parsed");
        assert_eq!(route.as_deref(), Some("api"));
        assert_eq!(named.len(), 2);
        assert_eq!(named[0].1, "k 1");
        assert!(named_parts("client_ip=1.2.3.4&client_ip=5.6.7.8").is_err());
        assert!(named_parts("colour=red").is_err());
    }
}
