//! Whether this instance is serving, one answer for every probe that asks: the admin
//! listener's `/healthcheck` (envoyproxy/ratelimit's probe: 200 `OK`, else 500) and
//! `grpc.health.v1.Health` on the rate limit service's port (SERVING / NOT_SERVING), so
//! Kubernetes, Istio and Envoy Gateway's readiness probes see the same thing whichever they
//! ask.
//!
//! Not serving means one of: shutting down (from SIGTERM on, through `shutdown_delay`, so
//! load balancers stop sending first); the rate limit service has no rules in force (a
//! reload removed `rls:`; calls are refused); or the store does not answer and an answer then
//! fails closed (`on_store_error: deny` on the service or on a limited route) — with
//! `allow` or `local` the instance still answers, and taking every instance out would turn a
//! Redis outage into an outage of everything behind it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::proxy::Gateway;
use crate::rls::Service;

/// How often the gRPC health status is brought up to date (and the store pinged, when an
/// answer would fail closed without it): a probe sees a change within this.
const REPORT_INTERVAL: Duration = Duration::from_millis(500);

/// The service names `grpc.health.v1.Health` answers for: the server as a whole (`""`) and
/// the rate limit service by its full name.
const SERVICES: [&str; 2] = ["", "envoy.service.ratelimit.v3.RateLimitService"];

/// Why this instance is not serving.
#[derive(Debug, thiserror::Error)]
pub enum NotServing {
    #[error("shutting down")]
    Draining,
    #[error("the rate limit service has no rules in force")]
    NoRules,
    #[error("{store} store: {error}; on_store_error: deny refuses without it")]
    Store { store: &'static str, error: String },
}

/// What the answer is made of.
pub struct Health {
    pub draining: Arc<AtomicBool>,
    pub gateway: Arc<Gateway>,
    /// The rate limit service, when `rls:` started one.
    pub rls: Option<Arc<Service>>,
}

impl Health {
    /// `Ok` when serving. Pings the store only when its failure would refuse answers.
    pub async fn check(&self) -> Result<(), NotServing> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(NotServing::Draining);
        }
        let rls_fails_closed = match &self.rls {
            Some(rls) => rls.fails_closed().ok_or(NotServing::NoRules)?,
            None => false,
        };
        if rls_fails_closed || self.gateway.refuses_without_store() {
            let store = self.gateway.store();
            if let Err(err) = store.ping().await {
                return Err(NotServing::Store {
                    store: store.name(),
                    error: err.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Keeps `reporter`'s statuses (served by `grpc.health.v1.Health`) to [`Health::check`]'s
    /// answer until `stopping` turns true, then reports NOT_SERVING for the calls in flight.
    pub async fn report(
        self: Arc<Self>,
        reporter: HealthReporter,
        stopping: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(REPORT_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = None;
        loop {
            if *stopping.borrow() {
                set(&reporter, ServingStatus::NotServing).await;
                return;
            }
            let status = match self.check().await {
                Ok(()) => ServingStatus::Serving,
                Err(why) => {
                    if last != Some(ServingStatus::NotServing) {
                        tracing::info!(target: "sluice::rls", reason = %why, "gRPC health: NOT_SERVING");
                    }
                    ServingStatus::NotServing
                }
            };
            if last != Some(status) {
                set(&reporter, status).await;
                last = Some(status);
            }
            tick.tick().await;
        }
    }
}

async fn set(reporter: &HealthReporter, status: ServingStatus) {
    for service in SERVICES {
        reporter.set_service_status(service, status).await;
    }
}
