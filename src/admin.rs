//! The admin listener: `/metrics` for Prometheus, `/healthz` (the process is up) and `/readyz`
//! (the policy is loaded and the store answers) for orchestrators. Kept on its own address so
//! it is never exposed through the gateway's routes.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};

use crate::metrics::Metrics;
use crate::proxy::{Gateway, ProxyBody};

pub struct Admin {
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<Metrics>,
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
            "/readyz" => match self.gateway.store().ping().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(err) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("not ready: {} store: {err}\n", self.gateway.store().name()),
                ),
            },
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /healthz or /readyz\n",
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
