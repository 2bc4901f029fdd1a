//! The rate limit service's metrics: sluice's own (`sluice_rls_*`), and the per-rule counters
//! envoyproxy/ratelimit users have dashboards for, under the names its Prometheus mapping
//! gives them (`ratelimit_service_rate_limit_<stat>`), labelled with the `domain` and the
//! rule's stat key as envoyproxy/ratelimit writes it (`descriptor="key_value.key2"`).
//!
//! Labels are domains and rules from the files, never a request's own values, so the number of
//! series is bounded by the config (a call for an unknown domain counts as `domain="unknown"`).

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts};

use crate::metrics::Metrics;

use super::decide::Outcome;
use super::rules::RlsRule;

/// The handles the service counts into.
#[derive(Clone)]
pub struct RlsMetrics {
    /// `sluice_rls_calls_total{domain, code}`: code `ok`, `over_limit`, `invalid`, `store_error`.
    calls: IntCounterVec,
    duration: Histogram,
    total_hits: IntCounterVec,
    over_limit: IntCounterVec,
    near_limit: IntCounterVec,
    within_limit: IntCounterVec,
    shadow_mode: IntCounterVec,
    /// sluice's `sluice_store_fallback_decisions_total`, with the route label `rls:<domain>`.
    fallback: IntCounterVec,
}

impl RlsMetrics {
    /// Creates the metrics and registers them with sluice's registry.
    pub fn new(metrics: &Metrics) -> Result<RlsMetrics, prometheus::Error> {
        let calls = IntCounterVec::new(
            Opts::new("sluice_rls_calls_total", "ShouldRateLimit calls answered by the rate limit service, by domain and overall answer (ok, over_limit, invalid, store_error)."),
            &["domain", "code"],
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "sluice_rls_call_duration_seconds",
                "Time to answer one ShouldRateLimit call, the store call included.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
        )?;
        let per_rule = |stat: &str, help: &str| {
            IntCounterVec::new(
                Opts::new(format!("ratelimit_service_rate_limit_{stat}"), help),
                &["domain", "descriptor"],
            )
        };
        let this = RlsMetrics {
            fallback: metrics.store.store_fallback_decisions.clone(),
            calls,
            duration,
            total_hits: per_rule("total_hits", "Hits counted against a rule (envoyproxy/ratelimit's total_hits).")?,
            over_limit: per_rule("over_limit", "Hits of a rule that were over its limit, shadow rules included (envoyproxy/ratelimit's over_limit).")?,
            near_limit: per_rule("near_limit", "Hits of a rule admitted past 80% of its limit (envoyproxy/ratelimit's near_limit).")?,
            within_limit: per_rule("within_limit", "Hits of a rule within its limit (envoyproxy/ratelimit's within_limit).")?,
            shadow_mode: per_rule("shadow_mode", "Hits of a shadow-mode rule that were over its limit but answered OK (envoyproxy/ratelimit's shadow_mode).")?,
        };
        for collector in [
            &this.calls,
            &this.total_hits,
            &this.over_limit,
            &this.near_limit,
            &this.within_limit,
            &this.shadow_mode,
        ] {
            metrics.register(Box::new(collector.clone()))?;
        }
        metrics.register(Box::new(this.duration.clone()))?;
        Ok(this)
    }

    pub fn call(&self, domain: &str, code: &str, seconds: f64) {
        self.calls.with_label_values(&[domain, code]).inc();
        self.duration.observe(seconds);
    }

    /// A call decided without the store (`rls.on_store_error`), as routes count theirs.
    pub fn fallback(&self, domain: &str, action: &str) {
        let route = format!("rls:{domain}");
        self.fallback
            .with_label_values(&[route.as_str(), action])
            .inc();
    }

    /// One descriptor's hits under `rule`.
    pub fn rule(&self, rule: &RlsRule, hits: u32, outcome: Outcome, global_shadow: bool) {
        let labels = [rule.domain.as_str(), rule.path.as_str()];
        let hits = u64::from(hits);
        self.total_hits.with_label_values(&labels).inc_by(hits);
        match outcome {
            Outcome::NotCounted => {}
            Outcome::Within { near } => {
                self.within_limit.with_label_values(&labels).inc_by(hits);
                if near {
                    self.near_limit.with_label_values(&labels).inc_by(hits);
                }
            }
            Outcome::Over => {
                self.over_limit.with_label_values(&labels).inc_by(hits);
                if rule.shadow || global_shadow {
                    self.shadow_mode.with_label_values(&labels).inc_by(hits);
                }
            }
        }
    }
}
