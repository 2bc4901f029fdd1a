//! `sluice explain-rls`: what the rate limit service would answer to one `ShouldRateLimit`
//! call, from the files alone: each descriptor's rule (file and line, stat key, name), its
//! limit and algorithm, whether another rule replaces it, and the exact store key it would
//! touch. It runs the service's own planning (`decide::plan_call`), so it cannot tell a
//! different story, and sends nothing to the store.

use std::fmt::Write as _;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

use super::decide::{plan_call, Applies};
use super::rules::RlsRule;
use super::Compiled;
use crate::limiter::Check;

/// Why a descriptor given on the command line cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum DescriptorError {
    #[error("`{0}` is not a descriptor like `user=alice` or `kind=vip,user=alice`")]
    Syntax(String),
    #[error("{0}")]
    Invalid(String),
}

/// Parses `key=value,key=value` into a descriptor.
pub fn descriptor(text: &str) -> Result<RateLimitDescriptor, DescriptorError> {
    let mut entries = Vec::new();
    for pair in text.split(',') {
        let (key, value) = pair
            .split_once('=')
            .filter(|(key, _)| !key.is_empty())
            .ok_or_else(|| DescriptorError::Syntax(text.to_owned()))?;
        entries.push(Entry {
            key: key.to_owned(),
            value: value.to_owned(),
        });
    }
    Ok(RateLimitDescriptor {
        entries,
        ..RateLimitDescriptor::default()
    })
}

/// The explanation of a call for `domain` with `descriptors` and `hits` (0: one).
pub fn explain(
    compiled: &Compiled,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
) -> Result<String, DescriptorError> {
    let request = RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: hits,
    };
    let planned = plan_call(&compiled.rules, &compiled.settings, &request)
        .map_err(|err| DescriptorError::Invalid(err.to_string()))?;
    let mut out = String::new();
    if !compiled.rules.has_domain(domain) {
        let _ = writeln!(
            out,
            "domain `{domain}` is in no rule file: every descriptor is OK and not counted"
        );
    }
    for (index, (applied, descriptor)) in
        planned.applies.iter().zip(&request.descriptors).enumerate()
    {
        let entries: Vec<String> = descriptor
            .entries
            .iter()
            .map(|e| format!("{}={}", e.key, e.value))
            .collect();
        let _ = writeln!(out, "descriptor {index}: {}", entries.join(","));
        write_applied(&mut out, compiled, applied, &planned.checks);
    }
    let counted = planned.checks.len();
    let _ = writeln!(
        out,
        "decided in one store call over {counted} key(s): all or nothing"
    );
    Ok(out)
}

/// What applies to one descriptor (`applied`), and how it is counted (`checks`: the call's).
fn write_applied(out: &mut String, compiled: &Compiled, applied: &Applies, checks: &[Check]) {
    match applied {
        Applies::Nothing => {
            let _ = writeln!(out, "  no rule applies (none matches, or it ends where there is no rate_limit): OK, not counted");
        }
        Applies::Replaced(rule) => {
            let _ = writeln!(
                out,
                "  rule {} name={} is replaced by another rule in this call: OK, not counted",
                written(rule),
                rule.name
            );
        }
        Applies::Unlimited(rule) => {
            let _ = writeln!(out, "  rule {}: unlimited: OK, not counted", written(rule));
        }
        Applies::Blocked { rule, limit, .. } => {
            write_rule(out, rule.as_deref(), false);
            let shadow = compiled.settings.shadow_mode || rule.as_ref().is_some_and(|r| r.shadow);
            let _ = writeln!(
                out,
                "  limit: 0 per {}: OVER_LIMIT{}, the store is not asked",
                limit.unit.label(),
                if shadow {
                    " (shadow mode: the call is not refused)"
                } else {
                    ""
                }
            );
        }
        Applies::Unasked => {
            let _ = writeln!(
                out,
                "  a limit of 0 refuses this call: not asked of the store, OK, not counted"
            );
        }
        Applies::Counted {
            rule,
            limit,
            hits,
            check,
        } => {
            write_rule(out, rule.as_deref(), true);
            let check = &checks[*check];
            let _ = writeln!(
                out,
                "  limit: {} per {}, counted with {} (window now {} s), {hits} hit(s){}",
                limit.requests,
                limit.unit.label(),
                check.spec.algorithm.label(),
                check.spec.window.as_secs(),
                if check.spec.shadow {
                    ", shadow mode: never OVER_LIMIT"
                } else {
                    ""
                }
            );
            let _ = writeln!(out, "  store key: {}", check.key);
        }
    }
}

/// The rule that limits a descriptor (with its name, if `named` and it has one), or the
/// descriptor's own limit override (`None`).
fn write_rule(out: &mut String, rule: Option<&RlsRule>, named: bool) {
    match rule {
        Some(rule) => {
            let name = if named && !rule.name.is_empty() {
                format!(" name={}", rule.name)
            } else {
                String::new()
            };
            let _ = writeln!(out, "  rule {}{name}", written(rule));
        }
        None => {
            let _ = writeln!(out, "  the descriptor's own limit override");
        }
    }
}

/// A rule as explain names it: its path and where it is written, `key_value.key2 (file:line)`.
fn written(rule: &RlsRule) -> String {
    format!("{} ({}:{})", rule.path, rule.file.display(), rule.line)
}
