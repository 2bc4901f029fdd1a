//! `POST /admin/v1/limits/{route}/{limit}/overrides`: many overrides at once, for a
//! migration or a periodic load from the system that owns the contracts.
//!
//! The body is JSON lines, one override per line:
//! `{"identity": {"header.x-api-key": "k1"}, "requests": 1000, "ttl": "30d"}` — the identity
//! named with the same parameters as the single-identity endpoints (`key`, or one value per
//! key part), `requests` the number in the limit's unit, `ttl` optional (30 days by default,
//! at most 366). Every line is checked before anything is written: with any bad line the
//! answer is 422 naming each bad line by number, and nothing is written. Then the overrides
//! are written [`IN_FLIGHT`] at a time over the store's multiplexed connections (so their
//! commands travel pipelined, chunk by chunk), each audited and counted exactly as a single `PUT` is.
//! The body is bounded ([`MAX_BODY`], [`MAX_LINES`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt as _;
use serde_json::json;

use super::{find_limit, json_response, limits, problem, Admin};
use crate::config::ConfigDuration;
use crate::limiter::overrides::{OverrideError, DEFAULT_TTL, MAX_TTL};
use crate::limiter::Check;
use crate::proxy::ProxyBody;
use crate::request::store_key;
use crate::response::problem_with;

/// Most bytes of a bulk body: about 100,000 lines of a typical override.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

/// Most lines of a bulk body.
pub const MAX_LINES: usize = 100_000;

/// Most bad lines an answer lists (it says how many more there were).
const MOST_ERRORS_LISTED: usize = 1000;

/// Overrides written at once: their commands share the store's connections, pipelined.
const IN_FLIGHT: usize = 64;

/// A request's body, kept aside so an endpoint that reads it can take it.
pub struct Body(Mutex<Option<UnsyncBoxBody<Bytes, BoxError>>>);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body {
    pub fn new<B>(body: B) -> Body
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Body(Mutex::new(Some(body.map_err(Into::into).boxed_unsync())))
    }

    fn take(&self) -> Option<UnsyncBoxBody<Bytes, BoxError>> {
        match self.0.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        }
    }
}

/// One line of the body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    identity: serde_json::Map<String, serde_json::Value>,
    requests: u32,
    #[serde(default)]
    ttl: Option<String>,
}

/// One checked line, ready to write.
struct Checked {
    line: usize,
    check: Check,
    requests: u32,
    ttl: Duration,
}

impl Admin {
    pub(super) async fn load_overrides(
        &self,
        (route, limit): (&str, &str),
        body: &Body,
        path: &str,
        by: &str,
    ) -> Response<ProxyBody> {
        let policy = self.gateway.policy();
        let (found, rule) = match find_limit(&policy, route, limit, path) {
            Ok(found) => found,
            Err(response) => return *response,
        };
        if !rule.spec.overridable {
            return super::overrides::takes_none(route, limit, path);
        }
        let text = match read(body).await {
            Ok(text) => text,
            Err((status, detail)) => return problem(status, &detail, path, &[]),
        };
        let now = crate::runtime::clock::now();
        let mut errors = Vec::new();
        let mut checked = Vec::new();
        let mut seen: HashMap<String, usize> = HashMap::new();
        let lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        for (index, line) in lines {
            let number = index + 1;
            if number > MAX_LINES {
                errors.push(json!({ "line": number, "error": format!("more than {MAX_LINES} lines: send the rest in another request") }));
                break;
            }
            match check_line(line, |query| limits::store_key(&policy, found, rule, query)) {
                Ok((key, requests, ttl)) => {
                    if let Some(first) = seen.insert(key.clone(), number) {
                        errors.push(json!({ "line": number, "error": format!("the same identity as line {first}") }));
                        continue;
                    }
                    let check = store_key::check(rule, key, now);
                    checked.push(Checked {
                        line: number,
                        check,
                        requests,
                        ttl,
                    });
                }
                Err(error) => errors.push(json!({ "line": number, "error": error })),
            }
        }
        if !errors.is_empty() {
            let bad = errors.len();
            errors.truncate(MOST_ERRORS_LISTED);
            return problem_with(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("{bad} bad line(s); nothing was written"),
                path,
                [
                    ("written", 0.into()),
                    ("bad_lines", bad.into()),
                    ("errors", errors.into()),
                ],
            );
        }
        self.write_all((route, limit), checked, by).await
    }

    /// Writes every checked override, `IN_FLIGHT` at a time, each audited and counted.
    async fn write_all(
        &self,
        (route, limit): (&str, &str),
        checked: Vec<Checked>,
        by: &str,
    ) -> Response<ProxyBody> {
        let store = self.gateway.store();
        let registry = crate::limiter::overrides::registry_of(&self.gateway.policy().key_prefix);
        let mut results = Vec::with_capacity(checked.len());
        for chunk in checked.chunks(IN_FLIGHT) {
            let mut writes = Vec::with_capacity(chunk.len());
            for one in chunk {
                writes.push(store.set_override(&one.check, one.requests, one.ttl, &registry));
            }
            results.extend(chunk.iter().zip(join_all(writes).await));
        }
        let (mut written, mut failed) = (0usize, Vec::new());
        for (one, result) in results {
            match result {
                Ok((old, _)) => {
                    written += 1;
                    self.metrics
                        .store
                        .override_changes
                        .with_label_values(&["set"])
                        .inc();
                    tracing::info!(
                        target: "sluice::audit",
                        by,
                        action = "set",
                        route,
                        limit,
                        identity = %crate::log::key_hash(&one.check.key),
                        old = ?old,
                        new = ?Some(one.requests),
                        ttl_s = one.ttl.as_secs(),
                        line = one.line,
                        "admin API: override set (bulk load)"
                    );
                }
                Err(OverrideError::Full(bound)) => failed.push(json!({ "line": one.line, "error": format!("the in-process store holds {bound} overrides, its bound (store.local.max_keys)") })),
                Err(OverrideError::Store(err)) => failed.push(json!({ "line": one.line, "error": format!("{} store: {err}", store.name()) })),
            }
        }
        let status = if failed.is_empty() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        failed.sort_by_key(|f| f["line"].as_u64());
        json_response(
            status,
            &json!({
                "route": route,
                "limit": limit,
                "store": store.name(),
                "written": written,
                "failed": failed,
            }),
        )
    }
}

/// The body as text, bounded by `MAX_BODY`; `Err`: the answer's status and detail.
async fn read(body: &Body) -> Result<String, (StatusCode, String)> {
    let Some(body) = body.take() else {
        return Err((
            StatusCode::BAD_REQUEST,
            "the request has no body".to_owned(),
        ));
    };
    let mut body = body;
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| {
            (
                StatusCode::BAD_REQUEST,
                format!("cannot read the body: {err}"),
            )
        })?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > MAX_BODY {
                return Err((
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the body is larger than {MAX_BODY} bytes: split it"),
                ));
            }
            bytes.extend_from_slice(&data);
        }
    }
    String::from_utf8(bytes)
        .map_err(|_| (StatusCode::BAD_REQUEST, "the body is not UTF-8".to_owned()))
}

/// One line checked: its store key (built by `key_of` from the identity's query), its number
/// and its time to live; `Err`: what is wrong with it.
fn check_line(
    line: &str,
    key_of: impl Fn(&str) -> Result<String, String>,
) -> Result<(String, u32, Duration), String> {
    let line: Line = serde_json::from_str(line).map_err(|err| {
        format!("{err}; expected {{\"identity\": {{...}}, \"requests\": N, \"ttl\": \"30d\"}}")
    })?;
    if line.requests == 0 {
        return Err("requests: expected a whole number of at least 1".to_owned());
    }
    if line.identity.is_empty() {
        return Err("identity: name it with key, or one value per key part".to_owned());
    }
    let ttl = match &line.ttl {
        None => DEFAULT_TTL,
        Some(text) => {
            let ttl: ConfigDuration = text.parse().map_err(|err| format!("ttl `{text}`: {err}"))?;
            if ttl.0.is_zero() || ttl.0 > MAX_TTL {
                return Err(format!(
                    "ttl `{text}`: an override lasts from 1 ms to {} days",
                    MAX_TTL.as_secs() / 86_400
                ));
            }
            ttl.0
        }
    };
    let mut query = String::new();
    for (name, value) in &line.identity {
        let value = match value {
            serde_json::Value::String(text) => text.clone(),
            serde_json::Value::Number(number) => number.to_string(),
            _ => return Err(format!("identity.{name}: expected a string")),
        };
        if !query.is_empty() {
            query.push('&');
        }
        super::limits::encode_into(&mut query, name.as_bytes());
        query.push('=');
        super::limits::encode_into(&mut query, value.as_bytes());
    }
    let key = key_of(&query).map_err(|err| format!("identity: {err}"))?;
    Ok((key, line.requests, ttl))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_checked_whole() {
        let ok = |query: &str| Ok(format!("k{{{query}}}"));
        let (key, requests, ttl) = check_line(
            r#"{"identity": {"header.x-api-key": "k 1"}, "requests": 5, "ttl": "1h"}"#,
            ok,
        )
        .expect("good line");
        assert_eq!(key, "k{header.x-api-key=k%201}");
        assert_eq!((requests, ttl), (5, Duration::from_secs(3600)));
        assert!(check_line(r#"{"identity": {"a": "b"}, "requests": 0}"#, ok).is_err());
        assert!(check_line(
            r#"{"identity": {"a": "b"}, "requests": 5, "ttl": "400d"}"#,
            ok
        )
        .is_err());
        assert!(check_line(
            r#"{"identity": {"a": "b"}, "requests": 5, "colour": 1}"#,
            ok
        )
        .is_err());
        assert!(check_line("not json", ok).is_err());
    }
}
