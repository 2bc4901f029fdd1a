//! `when:` conditions on a limit: which requests it applies to. Tiers are built from them:
//! the same key limited differently when `x-plan` is `free` or `paid` (a header an
//! authentication layer in front sets), or better, when a claim of the request's verified
//! JWT is (`jwt: plan`), which the client cannot write. A `model` condition reads the JSON
//! body's `model` (`crate::model`): allowed on a token limit only, whose body is read before
//! the decision, and so held until the body is read (`request::checks::with_body`).

use std::path::Path;

use http::header::{HeaderName, HOST};
use http::{HeaderMap, Method, Uri};

use crate::config::{ConditionConfig, ConfigError, Position, Spanned};
use crate::jwt::Claims;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    Header {
        name: HeaderName,
        test: HeaderTest,
    },
    /// The request method is one of these (`HEAD` is added to a list naming `GET`, see
    /// `matcher::with_head`).
    Method(Vec<Method>),
    /// The host (without its port, lower-cased) is one of these.
    Host(Vec<String>),
    /// A claim of the verified token: `OneOf` compares its text (a number as its decimal
    /// text); without a valid token no claim is present.
    Claim {
        claim: String,
        test: HeaderTest,
    },
    /// The JSON body's `model`, normalised, matches one of these (`crate::model`). Read only
    /// once the body is (a token limit's); never holds for a body that names no model.
    Model(Vec<crate::model::Pattern>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    /// Some value of the header is exactly one of these.
    OneOf(Vec<String>),
    /// The header is present (`true`) or absent (`false`).
    Present(bool),
}

impl Condition {
    /// Whether it reads the request body (only a token limit's may).
    pub fn reads_body(&self) -> bool {
        matches!(self, Condition::Model(_))
    }

    /// `model`: the body's, normalised; `None` when the body was not read or names none.
    pub fn holds(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        claims: Option<&Claims>,
        model: Option<&str>,
    ) -> bool {
        match self {
            Condition::Model(patterns) => {
                model.is_some_and(|model| patterns.iter().any(|p| p.matches(model)))
            }
            Condition::Claim { claim, test } => {
                let value = claims.and_then(|claims| claims.text(claim));
                match test {
                    HeaderTest::Present(present) => value.is_some() == *present,
                    HeaderTest::OneOf(values) => value
                        .is_some_and(|value| values.iter().any(|wanted| wanted == value.as_str())),
                }
            }
            Condition::Header { name, test } => match test {
                HeaderTest::Present(present) => headers.contains_key(name) == *present,
                HeaderTest::OneOf(values) => headers.get_all(name).iter().any(|value| {
                    values
                        .iter()
                        .any(|wanted| value.as_bytes() == wanted.as_bytes())
                }),
            },
            Condition::Method(methods) => methods.contains(method),
            Condition::Host(hosts) => {
                let host = headers
                    .get(HOST)
                    .and_then(|value| value.to_str().ok())
                    .or_else(|| uri.authority().map(|a| a.as_str()))
                    .unwrap_or_default();
                let host = strip_port(host);
                hosts.iter().any(|wanted| wanted.eq_ignore_ascii_case(host))
            }
        }
    }

    /// A condition of the file, checked: exactly one kind, a header with exactly one test.
    pub fn compile(
        spanned: &Spanned<ConditionConfig>,
        file: &Path,
        field: &str,
    ) -> Result<Condition, ConfigError> {
        let config = &spanned.value;
        let invalid = |message: &str| {
            ConfigError::invalid(file, Position::from(spanned), field, message.to_owned())
        };
        let kinds = [
            config.jwt.is_some(),
            config.header.is_some(),
            config.method.is_some(),
            config.host.is_some(),
            config.model.is_some(),
        ];
        if kinds.iter().filter(|given| **given).count() != 1 {
            return Err(invalid(
                "a condition names exactly one of `header`, `jwt`, `method`, `host` or `model`",
            ));
        }
        let named = config.header.as_ref().map(|h| Ok(h.0.clone()));
        let claim = config.jwt.as_ref().map(|c| Err(c.clone()));
        if let Some(name) = named.or(claim) {
            let test = match (&config.equals, &config.one_of, config.present) {
                (Some(value), None, None) => HeaderTest::OneOf(vec![value.clone()]),
                (None, Some(values), None) if !values.is_empty() => {
                    HeaderTest::OneOf(values.clone())
                }
                (None, None, Some(present)) => HeaderTest::Present(present),
                _ => {
                    let kind = if name.is_ok() { "header" } else { "jwt" };
                    return Err(invalid(&format!(
                        "a {kind} condition has exactly one of `equals`, `one_of` (not empty) or `present`"
                    )));
                }
            };
            return Ok(match name {
                Ok(name) => Condition::Header { name, test },
                Err(claim) if claim.is_empty() => return Err(invalid("`jwt` names a claim")),
                Err(claim) => Condition::Claim { claim, test },
            });
        }
        if config.equals.is_some() || config.one_of.is_some() || config.present.is_some() {
            return Err(invalid(
                "`equals`, `one_of` and `present` go with `header` or `jwt`",
            ));
        }
        if let Some(models) = &config.model {
            if models.is_empty() {
                return Err(invalid("`model` lists at least one model"));
            }
            let patterns = models
                .iter()
                .map(|text| crate::model::Pattern::parse(text))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|err| invalid(&err))?;
            return Ok(Condition::Model(patterns));
        }
        if let Some(methods) = &config.method {
            return Ok(Condition::Method(super::matcher::with_head(
                methods.iter().map(|m| m.0.clone()),
            )));
        }
        let hosts = config.host.clone().unwrap_or_default();
        if hosts.is_empty() {
            return Err(invalid("`host` lists at least one host"));
        }
        Ok(Condition::Host(
            hosts
                .iter()
                .map(|h| strip_port(h).to_ascii_lowercase())
                .collect(),
        ))
    }
}

/// `api.example:8443` → `api.example`; `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((name, port))
            if !name.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && !name.ends_with(':') =>
        {
            name
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn holds(condition: &Condition, headers: &[(&str, &str)]) -> bool {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        condition.holds(&Method::GET, &"/".parse().unwrap(), &map, None, None)
    }

    #[test]
    fn header_tests() {
        let plan = HeaderName::from_static("x-plan");
        let free = Condition::Header {
            name: plan.clone(),
            test: HeaderTest::OneOf(vec!["free".to_owned()]),
        };
        assert!(holds(&free, &[("x-plan", "free")]));
        assert!(!holds(&free, &[("x-plan", "Free")]), "values are exact");
        assert!(!holds(&free, &[]));
        let absent = Condition::Header {
            name: plan,
            test: HeaderTest::Present(false),
        };
        assert!(holds(&absent, &[]));
        assert!(!holds(&absent, &[("x-plan", "paid")]));
    }

    #[test]
    fn claim_tests_read_verified_claims_only() {
        let paid = Condition::Claim {
            claim: "plan".to_owned(),
            test: HeaderTest::OneOf(vec!["paid".to_owned(), "7".to_owned()]),
        };
        let claims = |value: serde_json::Value| {
            let mut map = serde_json::Map::new();
            map.insert("plan".to_owned(), value);
            Claims::new(map)
        };
        let at = |claims: Option<&Claims>| {
            let mut headers = HeaderMap::new();
            headers.insert("plan", HeaderValue::from_static("paid"));
            paid.holds(&Method::GET, &"/".parse().unwrap(), &headers, claims, None)
        };
        assert!(at(Some(&claims("paid".into()))));
        assert!(at(Some(&claims(7.into()))), "a number is its decimal text");
        assert!(
            !at(Some(&claims(serde_json::json!(["paid"])))),
            "an array is no value"
        );
        assert!(!at(None), "a header of the same name is not a claim");
        let absent = Condition::Claim {
            claim: "plan".to_owned(),
            test: HeaderTest::Present(false),
        };
        let empty = HeaderMap::new();
        assert!(absent.holds(&Method::GET, &"/".parse().unwrap(), &empty, None, None));
        assert!(!absent.holds(
            &Method::GET,
            &"/".parse().unwrap(),
            &empty,
            Some(&claims("x".into())),
            None
        ));
    }

    #[test]
    fn hosts_ignore_port_and_case() {
        let host = Condition::Host(vec!["api.example".to_owned()]);
        assert!(holds(&host, &[("host", "API.example:8443")]));
        assert!(!holds(&host, &[("host", "other.example")]));
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
    }

    #[test]
    fn model_tests_read_the_normalised_body_model() {
        let large = Condition::Model(vec![
            crate::model::Pattern::parse("gpt-4o").unwrap(),
            crate::model::Pattern::parse("gpt-4o-20*").unwrap(),
        ]);
        let at = |model: Option<&str>| {
            large.holds(
                &Method::POST,
                &"/".parse().unwrap(),
                &HeaderMap::new(),
                None,
                model,
            )
        };
        assert!(at(Some("gpt-4o")));
        assert!(at(Some("gpt-4o-2024-08-06")));
        assert!(!at(Some("gpt-4o-mini")));
        assert!(!at(None), "no body model, no match");
        assert!(large.reads_body());
    }
}
