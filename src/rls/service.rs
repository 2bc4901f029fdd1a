//! The gRPC side: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` served with
//! tonic on `rls.listen` (HTTP/2, with or without TLS), beside `grpc.health.v1.Health`
//! (`tonic-health`, whose statuses `crate::health` keeps), answering from the rules in force (swapped on
//! reload) and sluice's one `Store` (shared with the HTTP routes: the same Redis, deny cache
//! and breaker).

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::sync::watch;

use crate::limiter::Store;

use super::decide::{self, Applies};
use super::metrics::RlsMetrics;
use super::Compiled;

/// The service: the version of the rules in force, the store, the metrics.
pub struct Service {
    active: ArcSwapOption<Compiled>,
    store: Arc<Store>,
    metrics: RlsMetrics,
}

impl Service {
    pub fn new(compiled: Compiled, store: Arc<Store>, metrics: RlsMetrics) -> Service {
        Service {
            active: ArcSwapOption::from_pointee(compiled),
            store,
            metrics,
        }
    }

    /// Puts a reloaded version in force; `None`: the new file has no `rls:` section, and calls
    /// are refused (UNAVAILABLE) until one has.
    pub fn install(&self, compiled: Option<Compiled>) {
        self.active.store(compiled.map(Arc::new));
    }

    /// Whether an answer fails closed when the store does not answer (`on_store_error:
    /// deny`); `None` while no rules are in force (calls are refused).
    pub fn fails_closed(&self) -> Option<bool> {
        self.active
            .load()
            .as_ref()
            .map(|active| active.settings.on_store_error == crate::config::OnStoreError::Deny)
    }

    /// Answers one call.
    pub async fn answer(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        let started = Instant::now();
        let Some(active) = self.active.load_full() else {
            return Err(tonic::Status::unavailable(
                "the rate limit service is not configured",
            ));
        };
        let domain = if active.rules.has_domain(&request.domain) {
            request.domain.as_str()
        } else {
            "unknown"
        };
        let planned = match decide::plan_call(&active.rules, &active.settings, request) {
            Ok(planned) => planned,
            Err(invalid) => {
                self.metrics
                    .call(domain, "invalid", started.elapsed().as_secs_f64());
                return Err(tonic::Status::invalid_argument(invalid.to_string()));
            }
        };
        let fallback =
            |action: crate::config::OnStoreError| self.metrics.fallback(domain, action.label());
        let (decision, failed) = match decide::decide(
            &self.store,
            &active.settings,
            &planned,
            fallback,
        )
        .await
        {
            Ok(decision) => (decision, None),
            Err(failed) => {
                tracing::debug!(target: "sluice::rls", error = %failed.error, deny = failed.deny, "store failed");
                (None, Some(failed))
            }
        };
        let (response, outcomes) = decide::answer(
            &active.settings,
            &planned,
            decision.as_ref(),
            failed.as_ref(),
        );
        for (applied, outcome) in planned.applies.iter().zip(&outcomes) {
            if let Applies::Counted {
                rule: Some(rule),
                hits,
                ..
            }
            | Applies::Blocked {
                rule: Some(rule),
                hits,
                ..
            } = applied
            {
                self.metrics
                    .rule(rule, *hits, *outcome, active.settings.shadow_mode);
            }
        }
        let code = match (&failed, response.overall_code == Code::OverLimit as i32) {
            (Some(_), _) => "store_error",
            (None, true) => "over_limit",
            (None, false) => "ok",
        };
        self.metrics
            .call(domain, code, started.elapsed().as_secs_f64());
        Ok(response)
    }
}

/// tonic's handle on the service.
struct Handler(Arc<Service>);

#[tonic::async_trait]
impl RateLimitService for Handler {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        self.0
            .answer(request.get_ref())
            .await
            .map(tonic::Response::new)
    }
}

/// Serves `service` and `grpc.health.v1.Health` (the statuses `health` reports, kept by
/// `crate::health`) on `listener` (with TLS when `tls` is given) until `stopping` turns
/// true, then finishes the calls in flight.
pub async fn serve(
    service: Arc<Service>,
    health: tonic_health::server::HealthReporter,
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut stopping: watch::Receiver<bool>,
) {
    let stop = async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    let health = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(health),
    );
    let router = tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(Handler(service)))
        .add_service(health);
    let served = match tls {
        None => {
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router.serve_with_incoming_shutdown(incoming, stop).await
        }
        Some(acceptor) => {
            let (ready, connections) = tokio::sync::mpsc::channel(64);
            tokio::spawn(super::tls::accept(listener, acceptor, ready));
            let incoming =
                futures_util::stream::unfold(connections, |mut connections| async move {
                    connections
                        .recv()
                        .await
                        .map(|connection| (connection, connections))
                });
            router.serve_with_incoming_shutdown(incoming, stop).await
        }
    };
    if let Err(err) = served {
        tracing::error!(target: "sluice::rls", error = %err, "the rate limit service stopped");
    }
}
