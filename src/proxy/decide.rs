//! The decide phase: one store call for every limit the plan checks, the route's
//! `on_store_error` when the store cannot answer, and each limit's counters.

use std::sync::Arc;
use std::time::Instant;

use crate::config::OnStoreError;
use crate::limiter::{Algorithm, Check, Decision, Lease, LeaseHold, Store};
use crate::log::RequestLog;
use crate::policy::{Limit, Route};
use crate::request::{LimitChecks, Plan};

use super::held::CountedAsHeld;
use super::in_flight::{poll_gap, waits, Waiting};
use super::stop::Stop;
use super::Exchange;

/// A decided request: the limits that applied with their checks, and the store's decision,
/// in the same order. Kept by the exchange for the phases after it (hold, give-back, the
/// token settlement) and for the RateLimit fields `finish` writes.
pub struct Decided<'r> {
    pub limits: LimitChecks<'r>,
    pub decision: Decision,
    /// The leases of the concurrency limits that admitted it, held until its answer ends.
    pub lease: Option<LeaseHold>,
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
            .zip(&self.decision.rejecting)
            .filter(|&((limit, _), &rejecting)| !(rejecting && limit.spec.shadow))
            .map(|(limit_check, _)| limit_check)
            .filter(move |(limit, _)| keep(limit))
    }
}

/// Decides `plan` and keeps the decision in `exchange`. `Err`: the request is rejected
/// (`Limited`), or the store failed and the route denies. When the store fails and the route
/// allows, nothing is kept: the request goes on undecided.
pub async fn decide<'r>(
    store: &Arc<Store>,
    notifier: &crate::notify::Notifier,
    waiting: &Waiting,
    log: &RequestLog,
    route: &'r Route,
    plan: Plan<'r>,
    exchange: &mut Exchange<'r>,
) -> Result<(), Stop> {
    if plan.is_empty() {
        return Ok(());
    }
    let mut sent = Instant::now();
    let Some(mut decision) = ask(store, log, route, plan.limits.checks()).await? else {
        return Ok(());
    };
    let refused_first = !decision.admitted;
    if refused_first {
        // Boxed: only a refusal a concurrency limit may wait out takes this step.
        match Box::pin(wait_for_place(store, waiting, log, route, &plan, decision)).await? {
            (Some(waited), at) => (decision, sent) = (waited, at),
            (None, _) => return Ok(()),
        }
    }
    // Admitted after waiting for a place: counted as delayed by the limits that waited.
    let waited = refused_first && decision.admitted;
    count(plan.limits.limits(), &decision, waited, exchange);
    // The thresholds this admission crossed, marked by the store in the same step: only
    // this instance heard of them, so only it sends (queued, off the request's path).
    notifier.crossed(route.name.as_str(), plan.limits.iter(), &decision);
    let admitted = decision.admitted;
    let mut decided = Decided {
        limits: plan.limits,
        decision,
        lease: None,
    };
    decided.lease = lease(store, &decided, sent);
    if admitted {
        note_usage(store, &decided);
    }
    exchange.decided = Some(decided);
    if admitted {
        Ok(())
    } else {
        Err(Stop::Limited)
    }
}

/// Notes the admission in the usage index of each `report: true` limit it was recorded in
/// (`limiter::usage`): no store call, an entry in this instance's map for the next flush.
fn note_usage(store: &Store, decided: &Decided<'_>) {
    for (limit, check) in decided.recorded(|limit| limit.report) {
        store.note_usage(&check.key, limit.spec.window, u64::from(check.spec.cost));
    }
}

/// One store call for `checks`; `None` when the store failed and the route allows the
/// request undecided.
async fn ask(
    store: &Store,
    log: &RequestLog,
    route: &Route,
    checks: &[Check],
) -> Result<Option<Decision>, Stop> {
    match store.decide(checks).await {
        Ok(decision) => Ok(Some(decision)),
        Err(err) => {
            // Per request at debug: during an outage the breaker's transitions (warn) and
            // the fallback counters say it once, not once per request.
            if tracing::enabled!(tracing::Level::DEBUG) && log.store_failed.allow() {
                tracing::debug!(target: "sluice::proxy", route = %route.name, store = store.name(), error = %err, action = route.on_store_error.label(), "store failed");
            }
            route.metrics.count_fallback(route.on_store_error.label());
            match route.on_store_error {
                OnStoreError::Local => Ok(Some(store.decide_locally(checks))),
                OnStoreError::Allow => Ok(None),
                OnStoreError::Deny => Err(Stop::StoreUnavailable),
            }
        }
    }
}

/// The concurrency limit a refused request may wait on: when every limit that refused it is
/// one with `on_exceed: delay`, the first of them (its key's queue, its `max_delay`).
fn place_to_wait_for<'a, 'r>(
    limits: &'a LimitChecks<'r>,
    decision: &Decision,
) -> Option<(&'r Limit, &'a Check)> {
    let mut refusing = limits
        .iter()
        .zip(&decision.rejecting)
        .filter(|((limit, _), &rejecting)| rejecting && !limit.spec.shadow)
        .map(|(limit_check, _)| limit_check);
    let first = refusing.next()?;
    let all_wait = waits(first.0) && refusing.all(|(limit, _)| waits(limit));
    all_wait.then_some(first)
}

/// Waits for a place of a concurrency limit (see `in_flight`), asking the store again in the
/// key's queue until admitted, refused for another reason, or `max_delay` has passed; the
/// last answer (with when its call was sent), `None` when the store failed and the route
/// allows the request undecided. A refusal that cannot wait comes back as it was.
async fn wait_for_place(
    store: &Store,
    waiting: &Waiting,
    log: &RequestLog,
    route: &Route,
    plan: &Plan<'_>,
    refused: Decision,
) -> Result<(Option<Decision>, Instant), Stop> {
    let started = Instant::now();
    let Some((limit, check)) = place_to_wait_for(&plan.limits, &refused) else {
        return Ok((Some(refused), started));
    };
    let bound = usize::try_from(limit.spec.requests).unwrap_or(usize::MAX);
    let full = route.metrics.held.get() >= i64::from(route.max_delayed);
    let Some(queue) = waiting.join(&check.key, bound).filter(|_| !full) else {
        return Ok((Some(refused), started));
    };
    let _held = CountedAsHeld::start(&route.metrics.held);
    let deadline = started + limit.spec.max_delay;
    let Some(_turn) = queue.turn(deadline).await else {
        store.count_wait_timeout();
        return Ok((Some(refused), started));
    };
    let mut last = refused;
    loop {
        let now = Instant::now();
        if now >= deadline {
            store.count_wait_timeout();
            return Ok((Some(last), now));
        }
        tokio::time::sleep(poll_gap(last.retry_after).min(deadline - now)).await;
        let sent = Instant::now();
        let Some(decision) = ask(store, log, route, plan.limits.checks()).await? else {
            return Ok((None, sent));
        };
        let still_waiting =
            !decision.admitted && place_to_wait_for(&plan.limits, &decision).is_some();
        if !still_waiting {
            if decision.admitted {
                route.metrics.delay.observe(started.elapsed().as_secs_f64());
            }
            return Ok((Some(decision), sent));
        }
        last = decision;
    }
}

/// Holds the leases an admitted request took in its concurrency limits (a shadow limit with
/// no room took none).
fn lease(store: &Arc<Store>, decided: &Decided<'_>, sent: Instant) -> Option<LeaseHold> {
    let admission = decided.decision.admission.as_ref()?;
    let mut checks = Vec::new();
    let mut gauges = Vec::new();
    for (limit, check) in decided.recorded(|limit| limit.spec.algorithm == Algorithm::Concurrency) {
        checks.push(check.clone());
        gauges.extend(limit.metrics.in_flight.clone());
    }
    if checks.is_empty() {
        return None;
    }
    let lease = Lease::hold(store, checks, admission.clone(), gauges, sent);
    Some(LeaseHold(Arc::new(lease)))
}

/// Each limit's counters; the names of shadow limits that would have rejected the request go
/// to the access log.
fn count(limits: &[&Limit], decision: &Decision, waited: bool, exchange: &mut Exchange<'_>) {
    for (limit, &rejecting) in limits.iter().zip(&decision.rejecting) {
        if limit.spec.shadow && rejecting {
            limit.metrics.shadow_rejected.inc();
            exchange.note_shadow_rejection(limit.name.as_str());
        } else if decision.admitted && (rejecting || (waited && waits(limit))) {
            limit.metrics.delayed.inc();
        } else if decision.admitted {
            limit.metrics.admitted.inc();
        } else if rejecting {
            limit.metrics.rejected.inc();
        }
    }
}
