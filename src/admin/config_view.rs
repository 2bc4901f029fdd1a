//! `GET /admin/v1/config`: the policy in force, as JSON, with secrets redacted — the file as
//! written (after the last applied reload) and the limits as compiled, defaults filled in.
//!
//! Redaction is by shape, not by a list of today's fields, so a secret added to the config
//! later is still hidden: any member whose name says it is a secret (`password`, `secret`,
//! `token`, ...), the userinfo password (and a password query parameter) of any URL, and the
//! values a `when:` condition compares a credential-like header to.

use serde_json::{json, Value};

use crate::config::KeyPart;
use crate::policy::{Action, Policy};
use crate::reload::{hash_value, Serving};
use crate::request::store_key;

pub const REDACTED: &str = "[redacted]";

/// The JSON body of `/admin/v1/config`.
pub fn view(serving: &Serving, policy: &Policy) -> Value {
    let file = match crate::config::to_json(&serving.text) {
        Ok(mut value) => {
            redact(&mut value);
            value
        }
        // The text was parsed when it was applied; this cannot fail unless memory does.
        Err(err) => json!({ "error": err.to_string() }),
    };
    let routes: Vec<Value> = policy
        .routes
        .iter()
        .map(|route| {
            let action = match &route.action {
                Action::Forward(upstream) => json!({ "upstream": upstream.name.as_str() }),
                Action::Respond(direct) => json!({ "respond": direct.status.as_u16() }),
            };
            let limits: Vec<Value> = route
                .limits
                .iter()
                .map(|limit| {
                    json!({
                        "name": limit.name.as_str(),
                        "algorithm": limit.spec.algorithm.label(),
                        "requests": limit.spec.requests,
                        "window": limit.spec.window.as_secs_f64(),
                        "burst": limit.spec.burst,
                        "cost": limit.spec.cost,
                        "shadow": limit.spec.shadow,
                        "conditional": !limit.when.is_empty(),
                        "key": limit.key.iter().map(KeyPart::to_string).collect::<Vec<_>>(),
                        "key_prefix": store_key::prefix(policy, route, limit),
                        "unit": limit.unit(),
                        "quota": limit.quota.as_ref().map(|q| q.period.label()),
                        "time_zone": limit.quota.as_ref().map(|q| q.zone_name.as_str()),
                    })
                })
                .collect();
            json!({
                "name": route.name.as_str(),
                "action": action,
                "on_store_error": route.on_store_error.label(),
                "limits": limits,
            })
        })
        .collect();
    json!({
        "file": serving.file.display().to_string(),
        "sha256": serving.sha256(),
        "config_hash": hash_value(&serving.digest),
        "config": file,
        "routes": routes,
    })
}

/// Whether a member of this name holds a secret (`token_env` holds a variable's name).
fn secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name != "token_env"
        && [
            "password",
            "passwd",
            "secret",
            "token",
            "credential",
            "api_key",
            "apikey",
        ]
        .iter()
        .any(|word| name.contains(word))
}

/// Headers whose values are credentials: a condition comparing one of them names secrets.
fn credential_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "authorization",
        "cookie",
        "token",
        "secret",
        "key",
        "session",
        "password",
    ]
    .iter()
    .any(|word| name.contains(word))
}

pub fn redact(value: &mut Value) {
    match value {
        Value::Object(members) => {
            let credential = members
                .get("header")
                .and_then(Value::as_str)
                .is_some_and(credential_header);
            for (name, member) in members.iter_mut() {
                let compared = credential && matches!(name.as_str(), "equals" | "one_of");
                if (secret_name(name) || compared) && !member.is_null() {
                    hide(member);
                } else {
                    redact(member);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        Value::String(text) => {
            if let Some(clean) = redact_url(text) {
                *text = clean;
            }
        }
        _ => {}
    }
}

/// Replaces every scalar under `value` (a list stays a list of the same length).
fn hide(value: &mut Value) {
    match value {
        Value::Array(items) => items.iter_mut().for_each(hide),
        Value::Object(members) => members.values_mut().for_each(hide),
        _ => *value = Value::String(REDACTED.to_owned()),
    }
}

/// `scheme://user:password@host/...?password=x` with the password and any secret query
/// parameter replaced (userinfo without a `:` is redacted whole: Redis reads it as the
/// password); `None` when `text` holds nothing to redact.
fn redact_url(text: &str) -> Option<String> {
    let scheme_end = text.find("://")? + 3;
    let rest = &text[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..scheme_end]);
    let mut changed = false;
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.split_once(':') {
                Some((user, _)) => out.push_str(&format!("{user}:{REDACTED}")),
                None => out.push_str(REDACTED),
            }
            out.push_str(&authority[at..]);
            changed = true;
        }
        None => out.push_str(authority),
    }
    let tail = &rest[authority_end..];
    match tail.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let (query, fragment) = query
                .split_once('#')
                .map_or((query, None), |(q, f)| (q, Some(f)));
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if secret_name(name) || name.eq_ignore_ascii_case("pass") => {
                        changed = true;
                        format!("{name}={REDACTED}")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
            if let Some(fragment) = fragment {
                out.push('#');
                out.push_str(fragment);
            }
        }
        None => out.push_str(tail),
    }
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(value: &Value) -> &serde_json::Map<String, Value> {
        value.as_object().expect("an object")
    }

    #[test]
    fn urls_lose_their_passwords() {
        assert_eq!(
            redact_url("redis://:hunter2@10.0.0.1:6379/0").as_deref(),
            Some("redis://:[redacted]@10.0.0.1:6379/0")
        );
        assert_eq!(
            redact_url("rediss://app:hunter2@r:6380/1?password=x&db=2").as_deref(),
            Some("rediss://app:[redacted]@r:6380/1?password=[redacted]&db=2")
        );
        assert_eq!(
            redact_url("redis://hunter2@r").as_deref(),
            Some("redis://[redacted]@r")
        );
        assert_eq!(redact_url("http://api:3000/v1"), None);
        assert_eq!(redact_url("not a url"), None);
    }

    #[test]
    fn secrets_are_hidden_wherever_they_are() {
        let mut value = json!({
            "admin": {"token_env": "SLUICE_ADMIN_TOKEN"},
            "store": {"redis": {"url": "redis://:pw1@h:1", "sentinel": {
                "password": "pw2", "sentinel_password": "pw3", "master_name": "m"}}},
            "routes": [{"limits": [{"when": [
                {"header": "x-api-key", "one_of": ["k1", "k2"]},
                {"header": "x-plan", "equals": "gold"}]}]}],
        });
        redact(&mut value);
        let text = value.to_string();
        for secret in ["pw1", "pw2", "pw3", "k1", "k2"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("SLUICE_ADMIN_TOKEN"));
        assert!(text.contains("gold"), "a plan name is no secret");
        assert_eq!(members(&value["admin"])["token_env"], "SLUICE_ADMIN_TOKEN");
    }

    /// Every member name the README lists as secret-looking, including ones no config field
    /// has today (`credential`, `api_key`): redaction is by shape, for fields added later.
    #[test]
    fn every_secret_looking_member_name_is_hidden() {
        let names = [
            "password",
            "db_password",
            "client_secret",
            "secret",
            "token",
            "refresh_token",
            "credential",
            "aws_credentials",
            "api_key",
            "upstream_api_key",
            "Password",
        ];
        let mut value = Value::Object(
            names
                .iter()
                .map(|name| (name.to_string(), json!(format!("s3cr-{name}"))))
                .chain([
                    ("token_env".to_owned(), json!("SLUICE_ADMIN_TOKEN")),
                    ("keyless".to_owned(), json!("plain")),
                ])
                .collect(),
        );
        redact(&mut value);
        for name in names {
            assert_eq!(value[name], REDACTED, "{name}: {value}");
        }
        assert_eq!(value["token_env"], "SLUICE_ADMIN_TOKEN");
        assert_eq!(value["keyless"], "plain");
    }
}
