//! `on_exceed: delay` and `count:` on the request path: holding a delayed request until the
//! time the store recorded it at, giving its places back if its client leaves meanwhile, and
//! giving back a request's places in the limits whose `count:` its response status does not
//! match.
//!
//! A held request costs its connection, its parsed head and a sleeping task: no thread. The
//! places a request holds in the store are given back on a best-effort basis: if sluice dies
//! while holding requests, or the give-back fails, the places stay recorded until they leave
//! their window, so the limit admits fewer than it could for that while, never more.

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use prometheus::IntGauge;

use super::ProxyBody;
use crate::limiter::{Admission, Check, Decision, Store};
use crate::policy::{Limit, Route};
use crate::response;

/// An admitted request: the limits that applied, their checks and the store's decision, all
/// in the same order.
pub struct Admitted<'r> {
    pub limits: Vec<&'r Limit>,
    pub checks: Vec<Check>,
    pub decision: Decision,
}

impl Admitted<'_> {
    /// The checks the request was recorded under, among those `keep` selects: all of them
    /// but a shadow limit that had no room (it records nothing).
    fn recorded<'a>(
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

/// Holds a delayed request until its time. `Err`: the route already holds `max_delayed`
/// requests; the request's places were given back and this is its 429.
pub async fn hold(
    store: &Arc<Store>,
    route: &Route,
    admitted: &Admitted<'_>,
    path: &str,
) -> Result<(), Response<ProxyBody>> {
    let delay = admitted.decision.delay();
    let Some(admission) = admitted.decision.admission.as_ref() else {
        return Ok(());
    };
    if delay.is_zero() {
        return Ok(());
    }
    let _place = Place::take(&route.metrics.held);
    let checks: Vec<Check> = admitted
        .recorded(|_| true)
        .map(|(_, c)| c.clone())
        .collect();
    if route.metrics.held.get() > i64::from(route.max_delayed) {
        give_back(store, &checks, admission, route).await;
        return Err(too_many_held(route, admitted, delay, path));
    }
    route.metrics.delay.observe(delay.as_secs_f64());
    // If the client leaves, the server drops this future: the guard gives the places back.
    let mut guard = ReleaseOnDrop {
        store: Arc::clone(store),
        pending: Some((checks, admission.clone())),
    };
    tokio::time::sleep(delay).await;
    guard.pending = None;
    Ok(())
}

/// Gives back the request's places in the limits whose `count:` does not match the status
/// the client gets (the upstream's, or sluice's own 502/504/4xx), before the response goes
/// out: a client that follows a success with another attempt finds its place back.
pub async fn give_back_uncounted(
    store: &Store,
    route: &Route,
    admitted: &Admitted<'_>,
    status: StatusCode,
) {
    let Some(admission) = admitted.decision.admission.as_ref() else {
        return;
    };
    let status = status.as_u16();
    let mut uncounted = admitted.recorded(|limit| !limit.counts(status)).peekable();
    if uncounted.peek().is_none() {
        return;
    }
    let checks: Vec<Check> = uncounted
        .map(|(limit, check)| {
            limit.metrics.released.inc();
            check.clone()
        })
        .collect();
    give_back(store, &checks, admission, route).await;
}

async fn give_back(store: &Store, checks: &[Check], admission: &Admission, route: &Route) {
    if let Err(err) = store.release(checks, admission).await {
        // The places stay recorded until they expire: the limit under-admits meanwhile.
        tracing::debug!(route = %route.name, store = store.name(), error = %err, "cannot give back a request's places");
    }
}

/// One place among the route's held requests, freed when dropped.
struct Place<'a>(&'a IntGauge);

impl<'a> Place<'a> {
    fn take(held: &'a IntGauge) -> Place<'a> {
        held.inc();
        Place(held)
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Gives an admission back if dropped while still pending: a held client that left. The
/// give-back runs in a task of its own, since a drop cannot wait.
struct ReleaseOnDrop {
    store: Arc<Store>,
    pending: Option<(Vec<Check>, Admission)>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some((checks, admission)) = self.pending.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(&self.store);
        runtime.spawn(async move {
            if let Err(err) = store.release(&checks, &admission).await {
                tracing::debug!(store = store.name(), error = %err, "cannot give back a held request's places");
            }
        });
    }
}

/// The 429 for a delayed request the route has no room to hold.
fn too_many_held(
    route: &Route,
    admitted: &Admitted<'_>,
    delay: Duration,
    path: &str,
) -> Response<ProxyBody> {
    let retry_after = response::ceil_seconds(delay).max(1);
    let detail = format!(
        "route `{}` already holds {} delayed requests, its max_delayed; retry in {retry_after} s",
        route.name, route.max_delayed
    );
    let mut response = response::problem(StatusCode::TOO_MANY_REQUESTS, &detail, path, &[]);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after));
    response::add_rate_limit_fields(&mut response, route, &admitted.limits, &admitted.decision);
    response
}
