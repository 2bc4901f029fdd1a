//! The decide phase: one store call for every limit the plan checks, the route's
//! `on_store_error` when the store cannot answer, and each limit's counters.

use crate::config::OnStoreError;
use crate::limiter::{Check, Decision, Store};
use crate::log::RequestLog;
use crate::policy::{Limit, Route};
use crate::request::Plan;

use super::stop::Stop;
use super::Exchange;

/// A decided request: the limits that applied, their checks and the store's decision, all in
/// the same order. Kept by the exchange for the phases after it (hold, give-back, the token
/// settlement) and for the RateLimit fields `finish` writes.
pub struct Decided<'r> {
    pub limits: Vec<&'r Limit>,
    pub checks: Vec<Check>,
    pub decision: Decision,
}

impl Decided<'_> {
    /// The checks the request was recorded under, among those `keep` selects: all of them
    /// but a shadow limit that had no room (it records nothing).
    pub fn recorded<'a>(
        &'a self,
        keep: impl Fn(&Limit) -> bool + 'a,
    ) -> impl Iterator<Item = (&'a Limit, &'a Check)> + 'a {
        self.limits
            .iter()
            .zip(&self.checks)
            .zip(&self.decision.rejecting)
            .filter(|&((limit, _), &rejecting)| !(rejecting && limit.spec.shadow))
            .map(|((limit, check), _)| (*limit, check))
            .filter(move |(limit, _)| keep(limit))
    }
}

/// Decides `plan` and keeps the decision in `exchange`. `Err`: the request is rejected
/// (`Limited`), or the store failed and the route denies. When the store fails and the route
/// allows, nothing is kept: the request goes on undecided.
pub async fn decide<'r>(
    store: &Store,
    log: &RequestLog,
    route: &'r Route,
    plan: Plan<'r>,
    exchange: &mut Exchange<'r>,
) -> Result<(), Stop> {
    if plan.is_empty() {
        return Ok(());
    }
    let decision = match store.decide(&plan.checks).await {
        Ok(decision) => decision,
        Err(err) => {
            // Per request at debug: during an outage the breaker's transitions (warn) and
            // the fallback counters say it once, not once per request.
            if tracing::enabled!(tracing::Level::DEBUG) && log.store_failed.allow() {
                tracing::debug!(target: "sluice::proxy", route = %route.name, store = store.name(), error = %err, action = route.on_store_error.label(), "store failed");
            }
            route.metrics.count_fallback(route.on_store_error.label());
            match route.on_store_error {
                OnStoreError::Local => store.decide_locally(&plan.checks),
                OnStoreError::Allow => return Ok(()),
                OnStoreError::Deny => return Err(Stop::StoreUnavailable),
            }
        }
    };
    count(&plan.limits, &decision, exchange);
    let admitted = decision.admitted;
    exchange.decided = Some(Decided {
        limits: plan.limits,
        checks: plan.checks,
        decision,
    });
    if admitted {
        Ok(())
    } else {
        Err(Stop::Limited)
    }
}

/// Each limit's counters; the names of shadow limits that would have rejected the request go
/// to the access log.
fn count(limits: &[&Limit], decision: &Decision, exchange: &mut Exchange<'_>) {
    for (limit, &rejecting) in limits.iter().zip(&decision.rejecting) {
        if limit.spec.shadow && rejecting {
            limit.metrics.shadow_rejected.inc();
            exchange.note_shadow_rejection(limit.name.as_str());
        } else if decision.admitted && rejecting {
            limit.metrics.delayed.inc();
        } else if decision.admitted {
            limit.metrics.admitted.inc();
        } else if rejecting {
            limit.metrics.rejected.inc();
        }
    }
}
