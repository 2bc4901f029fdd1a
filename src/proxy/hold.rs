//! The hold phase, for `on_exceed: delay`: an admitted request some limit delayed waits until
//! the time the store recorded it at; its places are given back if its client leaves
//! meanwhile, or at once when the route already holds `max_delayed` requests.
//!
//! A held request costs its connection, its parsed head and a sleeping task: no thread.

use std::sync::Arc;

use super::decide::Decided;
use super::give_back::give_back;
use super::held::CountedAsHeld;
use super::stop::Stop;
use crate::limiter::{Admission, Algorithm, Check, Store};
use crate::policy::Route;

/// Holds a delayed request until its time. `Err`: the route already holds `max_delayed`
/// requests; the request's places were given back.
pub async fn hold(store: &Arc<Store>, route: &Route, decided: &Decided<'_>) -> Result<(), Stop> {
    let delay = decided.decision.delay();
    let Some(admission) = decided.decision.admission.as_ref() else {
        return Ok(());
    };
    if delay.is_zero() {
        return Ok(());
    }
    let _held = CountedAsHeld::start(&route.metrics.held);
    // A concurrency limit's place is the lease's to give back, whenever the request ends.
    let checks: Vec<Check> = decided
        .recorded(|limit| limit.spec.algorithm != Algorithm::Concurrency)
        .map(|(_, c)| c.clone())
        .collect();
    if route.metrics.held.get() > i64::from(route.max_delayed) {
        give_back(store, &checks, admission, route).await;
        return Err(Stop::TooManyHeld { delay });
    }
    route.metrics.delay.observe(delay.as_secs_f64());
    // If the client leaves, the server drops this future: the guard gives the places back.
    let mut guard = GiveBackIfLeft {
        store: Arc::clone(store),
        pending: Some((checks, admission.clone())),
    };
    tokio::time::sleep(delay).await;
    guard.pending = None;
    Ok(())
}

/// Gives an admission back if dropped while still pending: a held client that left. The
/// give-back runs in a task of its own, since a drop cannot wait.
struct GiveBackIfLeft {
    store: Arc<Store>,
    pending: Option<(Vec<Check>, Admission)>,
}

impl Drop for GiveBackIfLeft {
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
