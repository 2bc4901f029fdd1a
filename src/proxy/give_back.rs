//! The give-back phase (counting by outcome), once the status the client gets is known: a request's places in the
//! limits whose `count:` does not match that status are given back, before the response goes
//! out, so a client that follows a success with another attempt finds its place back.
//!
//! Places are given back on a best-effort basis: if the give-back fails, they stay recorded
//! until they leave their window, so the limit admits fewer than it could for that while,
//! never more.

use http::StatusCode;

use super::decide::Decided;
use crate::limiter::{Admission, Check, Store};
use crate::policy::Route;

/// Gives back the request's places in the limits that do not count `status` (the
/// upstream's, or sluice's own 502/504/4xx).
pub async fn give_back_uncounted(
    store: &Store,
    route: &Route,
    decided: &Decided<'_>,
    status: StatusCode,
) {
    let Some(admission) = decided.decision.admission.as_ref() else {
        return;
    };
    let status = status.as_u16();
    let mut uncounted = decided.recorded(|limit| !limit.counts(status)).peekable();
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

/// Gives back the places `checks` recorded for `admission`.
pub async fn give_back(store: &Store, checks: &[Check], admission: &Admission, route: &Route) {
    if let Err(err) = store.release(checks, admission).await {
        // The places stay recorded until they expire: the limit under-admits meanwhile.
        tracing::debug!(route = %route.name, store = store.name(), error = %err, "cannot give back a request's places");
    }
}
