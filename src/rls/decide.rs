//! One `ShouldRateLimit` call: each descriptor's rule (or its own `limit` override), the
//! checks of the counted ones decided in one store call (all or nothing: a request one
//! descriptor refuses is recorded in none), and the answer Envoy reads.
//!
//! The mapping to Envoy's answer, per descriptor in order: no rule, a replaced rule, or a
//! failed store with `allow` → OK without `current_limit`; `unlimited` → OK with
//! `limit_remaining` u32::MAX (as envoyproxy/ratelimit answers); a counted rule → its
//! `current_limit`, the limit's `remaining` and the exact time until it admits one more
//! request (`duration_until_reset`); OVER_LIMIT where the limit had no room, unless the rule
//! is in shadow mode. The overall code is OVER_LIMIT when some descriptor is, unless the
//! service is in global shadow mode.
//!
//! A limit of 0 (`requests_per_unit: 0`, envoyproxy/ratelimit's block list, in a rule or a
//! descriptor's override) is OVER_LIMIT for every hit and never asks the store: there is
//! nothing to count against. Its status is what envoyproxy/ratelimit answers (it increments
//! its counter anyway, and every count is over 0): `current_limit` with 0, `limit_remaining`
//! 0 and `duration_until_reset` the rest of the unit's epoch-aligned window; its hits count as
//! `total_hits` and `over_limit` (`shadow_mode` too for a shadow rule). A call such a limit
//! refuses records nothing, as any refused call: the store is not asked at all and its other
//! counted descriptors answer OK without `current_limit`, uncounted.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;

use crate::config::{OnStoreError, RlsAlgorithm};
use crate::limiter::{Algorithm, Check, Decision, Spec, Store};

use super::file::UnitName;
use super::key;
use super::rules::{Counted, RlsRule, RuleLimit, Rules};

/// The settings of the service that are not in the rule files.
#[derive(Debug, Clone)]
pub struct Settings {
    pub shadow_mode: bool,
    pub algorithm: RlsAlgorithm,
    pub on_store_error: OnStoreError,
    pub key_prefix: String,
}

/// Why a call is refused as a whole (gRPC INVALID_ARGUMENT).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Invalid {
    #[error("the request names no domain")]
    NoDomain,
    #[error("descriptor {0} has no entries")]
    NoEntries(usize),
    #[error("descriptor {0}: hits_addend {1} is above {max}", max = u32::MAX)]
    TooManyHits(usize, u64),
    #[error("descriptor {0}: its limit override has an unknown unit")]
    BadOverride(usize),
}

/// What applies to one descriptor of the call.
#[derive(Debug, Clone)]
pub enum Applies {
    /// No rule: OK, not counted.
    Nothing,
    /// A rule another one in the same call replaces (`replaces:`): OK, not counted.
    Replaced(Arc<RlsRule>),
    /// `unlimited: true`: OK, not counted.
    Unlimited(Arc<RlsRule>),
    /// A limit of 0: OVER_LIMIT (unless in shadow mode), never asks the store.
    Blocked {
        /// The rule, `None` for the descriptor's own `limit` override.
        rule: Option<Arc<RlsRule>>,
        limit: Counted,
        hits: u32,
    },
    /// A counted descriptor of a call a limit of 0 refuses: OK, not counted.
    Unasked,
    /// Counted in `checks[check]`.
    Counted {
        /// The rule, `None` for the descriptor's own `limit` override.
        rule: Option<Arc<RlsRule>>,
        limit: Counted,
        hits: u32,
        check: usize,
    },
}

/// The descriptors' rules and the checks of the counted ones, before the store is asked.
#[derive(Debug)]
pub struct PlannedCall {
    pub applies: Vec<Applies>,
    pub checks: Vec<Check>,
}

/// Finds each descriptor's rule and builds the checks, reading sluice's wall clock for
/// calendar and epoch windows.
pub fn plan_call(
    rules: &Rules,
    settings: &Settings,
    request: &RateLimitRequest,
) -> Result<PlannedCall, Invalid> {
    if request.domain.is_empty() {
        return Err(Invalid::NoDomain);
    }
    // Envoy sends 0 for "not set": one hit.
    let request_hits = request.hits_addend.max(1);
    let mut applies = Vec::with_capacity(request.descriptors.len());
    for (index, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.is_empty() {
            return Err(Invalid::NoEntries(index));
        }
        let hits = match &descriptor.hits_addend {
            Some(own) => {
                u32::try_from(own.value).map_err(|_| Invalid::TooManyHits(index, own.value))?
            }
            None => request_hits,
        };
        applies.push(applies_to(
            rules,
            settings,
            &request.domain,
            descriptor,
            index,
            hits,
        )?);
    }
    drop_replaced(&mut applies);
    // A call a limit of 0 refuses records nothing (all or nothing): its other counted
    // descriptors are not asked of the store.
    let refused = !settings.shadow_mode
        && applies.iter().any(|applied| {
            matches!(applied, Applies::Blocked { rule, .. } if !rule.as_ref().is_some_and(|r| r.shadow))
        });
    if refused {
        for applied in applies.iter_mut() {
            if matches!(applied, Applies::Counted { .. }) {
                *applied = Applies::Unasked;
            }
        }
    }
    let now = crate::runtime::clock::now();
    let mut checks = Vec::new();
    for (applied, descriptor) in applies.iter_mut().zip(&request.descriptors) {
        if let Applies::Counted {
            rule,
            limit,
            hits,
            check,
        } = applied
        {
            *check = checks.len();
            checks.push(build_check(
                settings,
                &request.domain,
                descriptor,
                rule.as_deref(),
                *limit,
                *hits,
                now,
            ));
        }
    }
    Ok(PlannedCall { applies, checks })
}

fn applies_to(
    rules: &Rules,
    settings: &Settings,
    domain: &str,
    descriptor: &RateLimitDescriptor,
    index: usize,
    hits: u32,
) -> Result<Applies, Invalid> {
    if let Some(limit) = &descriptor.limit {
        // As envoyproxy/ratelimit: an override applies in a configured domain, rule or not.
        if !rules.has_domain(domain) {
            return Ok(Applies::Nothing);
        }
        let unit = unit_of_proto(limit.unit).ok_or(Invalid::BadOverride(index))?;
        let limit = Counted {
            requests: limit.requests_per_unit,
            unit,
            algorithm: settings.algorithm,
        };
        return Ok(counted(None, limit, hits));
    }
    let entries = descriptor
        .entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()));
    let Some(rule) = rules.find(domain, entries) else {
        return Ok(Applies::Nothing);
    };
    Ok(match rule.limit {
        RuleLimit::Unlimited => Applies::Unlimited(Arc::clone(rule)),
        RuleLimit::Counted(limit) => counted(Some(Arc::clone(rule)), limit, hits),
    })
}

/// A counted limit, or a blocked one when it admits nothing.
fn counted(rule: Option<Arc<RlsRule>>, limit: Counted, hits: u32) -> Applies {
    if limit.requests == 0 {
        Applies::Blocked { rule, limit, hits }
    } else {
        Applies::Counted {
            rule,
            limit,
            hits,
            check: 0,
        }
    }
}

/// `replaces`: a rule named by another rule that applies in the same call does not apply.
fn drop_replaced(applies: &mut [Applies]) {
    let rule_of = |applied: &Applies| match applied {
        Applies::Unlimited(rule)
        | Applies::Blocked {
            rule: Some(rule), ..
        }
        | Applies::Counted {
            rule: Some(rule), ..
        } => Some(Arc::clone(rule)),
        _ => None,
    };
    let replaced: Vec<String> = applies
        .iter()
        .filter_map(rule_of)
        .flat_map(|rule| rule.replaces.clone())
        .collect();
    if replaced.is_empty() {
        return;
    }
    for applied in applies.iter_mut() {
        let named =
            rule_of(applied).filter(|rule| !rule.name.is_empty() && replaced.contains(&rule.name));
        if let Some(rule) = named {
            *applied = Applies::Replaced(rule);
        }
    }
}

/// The check of one counted descriptor: its key, and the algorithm and window its unit
/// calls for (see `RlsAlgorithm`).
fn build_check(
    settings: &Settings,
    domain: &str,
    descriptor: &RateLimitDescriptor,
    rule: Option<&RlsRule>,
    limit: Counted,
    hits: u32,
    now: jiff::Timestamp,
) -> Check {
    let shadow = settings.shadow_mode || rule.is_some_and(|r| r.shadow);
    let shared = rule.map_or(&[][..], |r| r.shared.as_slice());
    let mut key = key::store_key(&settings.key_prefix, domain, descriptor, shared, limit);
    let unit = Duration::from_secs(limit.unit.seconds());
    let rolling = |algorithm: Algorithm| (algorithm, unit);
    let (algorithm, window) = match limit.algorithm {
        RlsAlgorithm::Exact => match limit.unit {
            UnitName::Second | UnitName::Minute | UnitName::Hour => rolling(Algorithm::default()),
            _ => (
                Algorithm::Calendar,
                key::calendar_period(&mut key, limit.unit, now),
            ),
        },
        RlsAlgorithm::Rolling(algorithm) => rolling(algorithm.into()),
        RlsAlgorithm::EpochAligned => (
            Algorithm::Calendar,
            key::epoch_window(&mut key, limit.unit, now),
        ),
    };
    Check {
        key,
        spec: Spec {
            algorithm,
            requests: limit.requests,
            window,
            burst: limit.requests,
            cost: hits,
            shadow,
            ..Spec::default()
        },
    }
}

/// Decides `planned` in one store call; a failed store follows `on_store_error`, and
/// `fallback` is told which action it took (for `sluice_store_fallback_decisions_total`).
/// `Ok(None)`: nothing to count.
pub async fn decide(
    store: &Store,
    settings: &Settings,
    planned: &PlannedCall,
    fallback: impl FnOnce(OnStoreError),
) -> Result<Option<Decision>, StoreFailed> {
    if planned.checks.is_empty() {
        return Ok(None);
    }
    let err = match store.decide(&planned.checks).await {
        Ok(decision) => return Ok(Some(decision)),
        Err(err) => err,
    };
    let action = settings.on_store_error;
    fallback(action);
    match action {
        OnStoreError::Local => Ok(Some(store.decide_locally(&planned.checks))),
        OnStoreError::Allow | OnStoreError::Deny => Err(StoreFailed {
            deny: action == OnStoreError::Deny,
            error: err.to_string(),
        }),
    }
}

/// The store could not decide and `on_store_error` is `allow` or `deny`.
#[derive(Debug)]
pub struct StoreFailed {
    pub deny: bool,
    pub error: String,
}

/// How one descriptor came out, for the answer and the per-rule stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    NotCounted,
    Within { near: bool },
    Over,
}

/// Envoy's answer for `planned` and its decision (`None` with `failed`: the store failed).
pub fn answer(
    settings: &Settings,
    planned: &PlannedCall,
    decision: Option<&Decision>,
    failed: Option<&StoreFailed>,
) -> (RateLimitResponse, Vec<Outcome>) {
    let mut overall = Code::Ok;
    let mut statuses = Vec::with_capacity(planned.applies.len());
    let mut outcomes = Vec::with_capacity(planned.applies.len());
    let now = crate::runtime::clock::now();
    for applied in &planned.applies {
        let (status, outcome) = match applied {
            Applies::Nothing | Applies::Replaced(_) | Applies::Unasked => {
                (ok_without_limit(0), Outcome::NotCounted)
            }
            Applies::Blocked { rule, limit, .. } => {
                let reset = key::epoch_seconds_left(limit.unit, now);
                (
                    DescriptorStatus {
                        code: Code::OverLimit as i32,
                        current_limit: Some(current_limit(rule.as_deref(), *limit)),
                        limit_remaining: 0,
                        duration_until_reset: Some(proto_duration(reset)),
                        ..DescriptorStatus::default()
                    },
                    Outcome::Over,
                )
            }
            Applies::Unlimited(_) => (ok_without_limit(u32::MAX), Outcome::NotCounted),
            Applies::Counted {
                rule,
                limit,
                hits,
                check,
            } => {
                let current = current_limit(rule.as_deref(), *limit);
                match (decision, failed) {
                    (Some(decision), _) => counted_status(decision, *check, current, *limit, *hits),
                    (None, Some(failed)) if failed.deny => (
                        DescriptorStatus {
                            code: Code::OverLimit as i32,
                            current_limit: Some(current),
                            ..DescriptorStatus::default()
                        },
                        Outcome::Over,
                    ),
                    _ => (ok_without_limit(0), Outcome::NotCounted),
                }
            }
        };
        let shadow = matches!(
            applied,
            Applies::Counted { rule: Some(rule), .. } | Applies::Blocked { rule: Some(rule), .. }
                if rule.shadow
        );
        let mut status = status;
        if outcome == Outcome::Over && shadow {
            status.code = Code::Ok as i32;
        }
        if status.code == Code::OverLimit as i32 {
            overall = Code::OverLimit;
        }
        statuses.push(status);
        outcomes.push(outcome);
    }
    if settings.shadow_mode {
        overall = Code::Ok;
    }
    let response = RateLimitResponse {
        overall_code: overall as i32,
        statuses,
        ..RateLimitResponse::default()
    };
    (response, outcomes)
}

fn counted_status(
    decision: &Decision,
    check: usize,
    current: RateLimit,
    limit: Counted,
    hits: u32,
) -> (DescriptorStatus, Outcome) {
    let rejecting = decision
        .rejecting
        .get(check)
        .copied()
        .unwrap_or(!decision.admitted);
    let state = decision.limits.get(check).copied().flatten();
    let (remaining, reset) = match state {
        Some(state) => (state.remaining, state.reset),
        // Answered from the deny cache: full until the request's retry time.
        None => (0, decision.retry_after),
    };
    let outcome = if rejecting {
        Outcome::Over
    } else {
        // envoyproxy/ratelimit's near limit: past 80 % of the limit after this request.
        let used = limit.requests.saturating_sub(remaining);
        let threshold = (u64::from(limit.requests) * 8 / 10) as u32;
        Outcome::Within {
            near: hits > 0 && used > threshold,
        }
    };
    let status = DescriptorStatus {
        code: if rejecting { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: Some(current),
        limit_remaining: if rejecting { 0 } else { remaining },
        duration_until_reset: Some(proto_duration(reset)),
        ..DescriptorStatus::default()
    };
    (status, outcome)
}

fn ok_without_limit(remaining: u32) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: remaining,
        ..DescriptorStatus::default()
    }
}

fn current_limit(rule: Option<&RlsRule>, limit: Counted) -> RateLimit {
    RateLimit {
        name: rule.map(|r| r.name.clone()).unwrap_or_default(),
        requests_per_unit: limit.requests,
        unit: unit_to_proto(limit.unit) as i32,
    }
}

/// A duration as protobuf carries it, to the nanosecond (Envoy rounds it for its headers).
fn proto_duration(duration: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}

fn unit_to_proto(unit: UnitName) -> Unit {
    match unit {
        UnitName::Second => Unit::Second,
        UnitName::Minute => Unit::Minute,
        UnitName::Hour => Unit::Hour,
        UnitName::Day => Unit::Day,
        UnitName::Week => Unit::Week,
        UnitName::Month => Unit::Month,
        UnitName::Year => Unit::Year,
    }
}

/// `envoy.type.v3.RateLimitUnit`, as a descriptor's `limit` override carries it.
fn unit_of_proto(unit: i32) -> Option<UnitName> {
    Some(match unit {
        1 => UnitName::Second,
        2 => UnitName::Minute,
        3 => UnitName::Hour,
        4 => UnitName::Day,
        5 => UnitName::Month,
        6 => UnitName::Year,
        7 => UnitName::Week,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::LimitState;

    fn rule(shadow: bool) -> Arc<RlsRule> {
        Arc::new(RlsRule {
            domain: "d".into(),
            name: "r".into(),
            path: "k".into(),
            limit: RuleLimit::Counted(LIMIT),
            shadow,
            replaces: Vec::new(),
            file: "f.yaml".into(),
            line: 1,
            shared: Vec::new(),
        })
    }

    const LIMIT: Counted = Counted {
        requests: 10,
        unit: UnitName::Minute,
        algorithm: RlsAlgorithm::Exact,
    };

    fn settings(shadow_mode: bool) -> Settings {
        Settings {
            shadow_mode,
            algorithm: RlsAlgorithm::Exact,
            on_store_error: OnStoreError::Allow,
            key_prefix: "p".into(),
        }
    }

    /// Two counted descriptors; the second had no room.
    fn planned(shadow_rule: bool) -> (PlannedCall, Decision) {
        let counted = |check, rule| Applies::Counted {
            rule: Some(rule),
            limit: LIMIT,
            hits: 1,
            check,
        };
        let planned = PlannedCall {
            applies: vec![
                counted(0, rule(false)),
                counted(1, rule(shadow_rule)),
                Applies::Nothing,
            ],
            checks: vec![Check::default(), Check::default()],
        };
        let state = |remaining, secs| {
            Some(LimitState {
                remaining,
                reset: Duration::from_secs(secs),
                overridden: None,
            })
        };
        let decision = Decision {
            admitted: shadow_rule,
            retry_after: Duration::from_secs(7),
            limits: vec![state(1, 3), state(0, 7)],
            rejecting: vec![false, true],
            admission: None,
            crossed: Vec::new(),
        };
        (planned, decision)
    }

    fn codes(response: &RateLimitResponse) -> (i32, Vec<i32>) {
        let statuses = response.statuses.iter().map(|s| s.code).collect();
        (response.overall_code, statuses)
    }

    const OK: i32 = Code::Ok as i32;
    const OVER: i32 = Code::OverLimit as i32;

    #[test]
    fn statuses_in_order_with_the_true_wait() {
        let (planned, decision) = planned(false);
        let (response, outcomes) = answer(&settings(false), &planned, Some(&decision), None);
        assert_eq!(codes(&response), (OVER, vec![OK, OVER, OK]));
        let first = &response.statuses[0];
        assert_eq!(
            (
                first.limit_remaining,
                first.duration_until_reset.map(|d| d.seconds)
            ),
            (1, Some(3))
        );
        assert_eq!(
            response.statuses[1].duration_until_reset.map(|d| d.seconds),
            Some(7)
        );
        assert_eq!(response.statuses[2].current_limit, None);
        assert_eq!(
            outcomes,
            [
                Outcome::Within { near: true },
                Outcome::Over,
                Outcome::NotCounted
            ]
        );
    }

    #[test]
    fn shadow_rules_answer_ok_and_global_shadow_mode_answers_ok_overall() {
        let (planned, decision) = planned(true);
        let (response, outcomes) = answer(&settings(false), &planned, Some(&decision), None);
        assert_eq!(
            codes(&response),
            (OK, vec![OK, OK, OK]),
            "a shadow rule's descriptor is OK"
        );
        assert_eq!(outcomes[1], Outcome::Over, "and counted as over its limit");
        let (planned, decision) = planned_global();
        let (response, _) = answer(&settings(true), &planned, Some(&decision), None);
        assert_eq!(
            codes(&response),
            (OK, vec![OK, OVER, OK]),
            "global: the descriptor says OVER_LIMIT, the answer OK"
        );
    }

    fn planned_global() -> (PlannedCall, Decision) {
        let (planned, mut decision) = planned(false);
        decision.admitted = true;
        (planned, decision)
    }

    #[test]
    fn a_failed_store_allows_or_denies_as_configured() {
        let (planned, _) = planned(false);
        let allow = StoreFailed {
            deny: false,
            error: String::new(),
        };
        let (response, _) = answer(&settings(false), &planned, None, Some(&allow));
        assert_eq!(codes(&response), (OK, vec![OK, OK, OK]));
        let deny = StoreFailed {
            deny: true,
            error: String::new(),
        };
        let (response, _) = answer(&settings(false), &planned, None, Some(&deny));
        assert_eq!(codes(&response), (OVER, vec![OVER, OVER, OK]));
    }

    /// Rules from a file's text, as the service loads them.
    fn rules_of(yaml: &str) -> Rules {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("rules.yaml"), yaml).expect("write");
        let sluice = dir.path().join("sluice.yaml");
        let entry: Vec<crate::config::Spanned<std::path::PathBuf>> =
            crate::config::parse_as("[rules.yaml]", &sluice).expect("list");
        Rules::load(&entry, RlsAlgorithm::Exact, &sluice).expect("valid")
    }

    const BLOCK_LIST: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: hour, requests_per_unit: 0, name: blocked}
  - key: quiet
    value: q
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 0}
";

    fn call(descriptors: &[(&str, &str)]) -> RateLimitRequest {
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: descriptors
                .iter()
                .map(|(k, v)| RateLimitDescriptor {
                    entries: vec![Entry {
                        key: (*k).into(),
                        value: (*v).into(),
                    }],
                    ..RateLimitDescriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    #[test]
    fn a_zero_limit_is_over_limit_without_the_store() {
        let rules = rules_of(BLOCK_LIST);
        let request = call(&[
            ("remote_address", "50.0.0.5"),
            ("remote_address", "50.0.0.1"),
        ]);
        let planned = plan_call(&rules, &settings(false), &request).expect("valid");
        assert!(
            planned.checks.is_empty(),
            "the store is not asked: {:?}",
            planned.checks
        );
        assert!(matches!(
            planned.applies[0],
            Applies::Blocked { hits: 1, .. }
        ));
        assert!(matches!(planned.applies[1], Applies::Unasked));
        let (response, outcomes) = answer(&settings(false), &planned, None, None);
        assert_eq!(codes(&response), (OVER, vec![OVER, OK]));
        let blocked = &response.statuses[0];
        assert_eq!(
            blocked.current_limit,
            Some(RateLimit {
                name: "blocked".into(),
                requests_per_unit: 0,
                unit: Unit::Hour as i32,
            })
        );
        assert_eq!(blocked.limit_remaining, 0);
        let reset = blocked.duration_until_reset.map(|d| (d.seconds, d.nanos));
        assert!(
            matches!(reset, Some((1..=3_600, 0))),
            "the rest of the hour, in whole seconds: {reset:?}"
        );
        assert_eq!(response.statuses[1].current_limit, None);
        assert_eq!(outcomes, [Outcome::Over, Outcome::NotCounted]);

        // Any other address is counted as before.
        let planned = plan_call(
            &rules,
            &settings(false),
            &call(&[("remote_address", "50.0.0.1")]),
        )
        .expect("valid");
        assert_eq!(planned.checks.len(), 1);
        assert_eq!(planned.checks[0].spec.requests, 10);
    }

    #[test]
    fn a_zero_limit_in_shadow_mode_refuses_nothing() {
        let rules = rules_of(BLOCK_LIST);
        let request = call(&[("quiet", "q"), ("remote_address", "50.0.0.1")]);
        let planned = plan_call(&rules, &settings(false), &request).expect("valid");
        assert_eq!(planned.checks.len(), 1, "the other descriptor is counted");
        assert!(matches!(
            planned.applies[1],
            Applies::Counted { check: 0, .. }
        ));
        let decision = Decision {
            admitted: true,
            limits: vec![Some(LimitState {
                remaining: 9,
                reset: Duration::from_secs(1),
                overridden: None,
            })],
            rejecting: vec![false],
            retry_after: Duration::ZERO,
            admission: None,
            crossed: Vec::new(),
        };
        let (response, outcomes) = answer(&settings(false), &planned, Some(&decision), None);
        assert_eq!(codes(&response), (OK, vec![OK, OK]));
        assert_eq!(outcomes[0], Outcome::Over, "reported as over its limit");

        // Global shadow mode: the descriptor says OVER_LIMIT, the call is not refused.
        let request = call(&[
            ("remote_address", "50.0.0.5"),
            ("remote_address", "50.0.0.1"),
        ]);
        let planned = plan_call(&rules, &settings(true), &request).expect("valid");
        assert_eq!(planned.checks.len(), 1);
        let (response, _) = answer(&settings(true), &planned, Some(&decision), None);
        assert_eq!(codes(&response), (OK, vec![OVER, OK]));
    }

    #[test]
    fn a_zero_override_is_over_limit() {
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
        let rules = rules_of(BLOCK_LIST);
        let mut request = call(&[("anything", "x")]);
        request.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit: 0,
            unit: 2,
        });
        let planned = plan_call(&rules, &settings(false), &request).expect("accepted");
        assert!(planned.checks.is_empty());
        let (response, _) = answer(&settings(false), &planned, None, None);
        assert_eq!(codes(&response), (OVER, vec![OVER]));
        request.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit: 0,
            unit: 99,
        });
        assert_eq!(
            plan_call(&rules, &settings(false), &request).map(|_| ()),
            Err(Invalid::BadOverride(0))
        );
    }

    #[test]
    fn values_of_a_shared_wildcard_count_in_one_key() {
        let rules = rules_of(
            "
domain: edge
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: own
    value: files/*
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: route
    value: api/*
    share_threshold: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 60}
",
        );
        let keys = |descriptors: &[&[(&str, &str)]]| {
            use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
            let request = RateLimitRequest {
                domain: "edge".into(),
                descriptors: descriptors
                    .iter()
                    .map(|entries| RateLimitDescriptor {
                        entries: entries
                            .iter()
                            .map(|(k, v)| Entry {
                                key: (*k).into(),
                                value: (*v).into(),
                            })
                            .collect(),
                        ..RateLimitDescriptor::default()
                    })
                    .collect(),
                hits_addend: 0,
            };
            let planned = plan_call(&rules, &settings(false), &request).expect("valid");
            planned
                .checks
                .iter()
                .map(|c| c.key.clone())
                .collect::<Vec<_>>()
        };
        let shared = keys(&[&[("files", "files/a.pdf")], &[("files", "files/b.csv")]]);
        assert_eq!(shared.len(), 2);
        assert_eq!(shared[0], shared[1], "one count for every matching value");
        assert!(
            shared[0].starts_with("p:rls:edge:{files==files/*}:hour10"),
            "{shared:?}"
        );
        let own = keys(&[&[("own", "files/a.pdf")], &[("own", "files/b.csv")]]);
        assert_ne!(
            own[0], own[1],
            "without share_threshold each value counts alone"
        );
        // Shared at the wildcard's level, with the rule one level deeper.
        let nested = keys(&[
            &[("route", "api/v1"), ("method", "GET")],
            &[("route", "api/v2"), ("method", "GET")],
            &[("route", "api/v2"), ("method", "POST")],
        ]);
        assert_eq!(nested[0], nested[1]);
        assert_ne!(
            nested[1], nested[2],
            "the level below still counts per value"
        );
    }

    /// A rule's `rate_limit.algorithm` takes any algorithm a policy's limit may name, besides
    /// the service's own `exact` and `fixed_window_epoch`.
    #[test]
    fn a_rule_counts_with_any_policy_algorithm() {
        let rules = rules_of(
            "
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: weighted_log}
  - key: org
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: fixed_window_epoch}
  - key: team
    rate_limit: {unit: minute, requests_per_unit: 5}
",
        );
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
        let request = RateLimitRequest {
            domain: "edge".into(),
            descriptors: ["user", "org", "team"]
                .iter()
                .map(|key| RateLimitDescriptor {
                    entries: vec![Entry {
                        key: (*key).into(),
                        value: "a".into(),
                    }],
                    ..RateLimitDescriptor::default()
                })
                .collect(),
            hits_addend: 0,
        };
        let planned = plan_call(&rules, &settings(false), &request).expect("valid");
        let counted: Vec<(Algorithm, Duration)> = planned
            .checks
            .iter()
            .map(|c| (c.spec.algorithm, c.spec.window))
            .collect();
        let minute = Duration::from_secs(60);
        assert_eq!(counted[0], (Algorithm::WeightedLog, minute));
        assert_eq!(counted[1].0, Algorithm::Calendar, "an epoch-aligned window");
        assert_eq!(counted[2], (Algorithm::default(), minute), "exact");
    }
}
