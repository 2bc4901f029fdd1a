//! The admin listener: `/metrics` for Prometheus, `/healthz` (the process is up) and `/readyz`
//! (this instance should get traffic) for orchestrators. Kept on its own address so it is
//! never exposed through the gateway's routes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};

use crate::metrics::Metrics;
use crate::proxy::{Gateway, ProxyBody};

pub struct Admin {
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<Metrics>,
    /// Set on SIGTERM: `/readyz` answers 503 from then on.
    pub draining: Arc<AtomicBool>,
}

impl Admin {
    pub async fn handle<B>(&self, request: Request<B>) -> Response<ProxyBody> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        match request.uri().path() {
            "/metrics" => {
                let mut response =
                    Response::new(ProxyBody::full(Bytes::from(self.metrics.render())));
                response.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => self.readiness().await,
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /healthz or /readyz\n",
            ),
        }
    }
}

impl Admin {
    /// Not ready while shutting down. When the store does not answer, not ready only if a
    /// limited route refuses requests then (`on_store_error: deny`): routes that decide
    /// locally or admit keep serving, and taking every instance out of the load balancer
    /// would turn a Redis outage into an API outage.
    async fn readiness(&self) -> Response<ProxyBody> {
        if self.draining.load(Ordering::Relaxed) {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: shutting down\n",
            );
        }
        let store = self.gateway.store();
        match store.ping().await {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(err) if self.gateway.refuses_without_store() => text(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("not ready: {} store: {err}\n", store.name()),
            ),
            Err(err) => text(
                StatusCode::OK,
                &format!(
                    "ready; {} store: {err}; limited routes follow on_store_error\n",
                    store.name()
                ),
            ),
        }
    }
}

fn text(status: StatusCode, body: &str) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(Bytes::copy_from_slice(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
