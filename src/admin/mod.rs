//! The admin listener: `/metrics` for Prometheus, `/healthz` (the process is up), `/readyz`
//! (this instance should get traffic) and `/healthcheck` (envoyproxy/ratelimit's probe,
//! `crate::health`) for orchestrators — open, so scrapers and probes need
//! no credentials — and the admin API under `/admin/v1/`, behind a bearer token: one
//! identity's quota (`limits`), the policy in force (`config`), a reload (`reload`). Kept on
//! its own address so it is never exposed through the gateway's routes; `guard` refuses what
//! a web page could send it (DNS rebinding, cross-site posts) before anything else.

mod auth;
mod bulk;
mod config_view;
mod guard;
mod limits;
mod overridden;
mod overrides;
mod usage;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use serde_json::json;

pub use self::auth::{Token, TokenError};
pub use self::guard::Guard;
use crate::config::ConfigError;
use crate::health::Health;
use crate::metrics::Metrics;
use crate::proxy::{Gateway, ProxyBody};
use crate::reload::{ReloadError, ReloadHandle};
use crate::request::store_key;
use crate::response::{problem, problem_with};
use crate::server::LocalAddr;

pub struct Admin {
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<Metrics>,
    /// Set on SIGTERM: `/readyz` answers 503 from then on.
    pub draining: Arc<AtomicBool>,
    /// `/healthcheck`'s answer (the gRPC health service's too).
    pub health: Arc<Health>,
    /// `None` with `admin: { api: false }`: `/admin/v1/*` is not served.
    pub api: Option<Api>,
    /// Refuses what a web page sends: foreign `Host`s and `Origin`s, changes without
    /// `X-Sluice-Admin`.
    pub guard: Guard,
}

/// What the admin API needs beyond the open endpoints.
pub struct Api {
    /// `None`: no token configured, which the config allows only on a loopback address.
    pub token: Option<Token>,
    pub reload: ReloadHandle,
}

const API_PREFIX: &str = "/admin/v1/";

impl Admin {
    pub async fn handle<B>(&self, request: Request<B>) -> Response<ProxyBody>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let local = request.extensions().get::<LocalAddr>().map(|l| l.0);
        let path = request.uri().path();
        let guarded = if path.starts_with(API_PREFIX) && self.api.is_some() {
            self.guard
                .api(request.method(), request.uri(), request.headers(), local)
        } else {
            self.guard.open(request.headers(), local)
        };
        if let Err(refusal) = guarded {
            tracing::warn!(
                path,
                status = refusal.status.as_u16(),
                "admin listener: {}",
                refusal.detail
            );
            return problem(refusal.status, &refusal.detail, path, &[]);
        }
        if request.uri().path().starts_with(API_PREFIX) {
            return match &self.api {
                Some(api) => {
                    // Kept aside for the one endpoint that reads a body (`bulk`).
                    let request = request.map(bulk::Body::new);
                    self.api(api, &request).await
                }
                None => problem(
                    StatusCode::NOT_FOUND,
                    "the admin API is off (admin.api: false)",
                    request.uri().path(),
                    &[],
                ),
            };
        }
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
            // envoyproxy/ratelimit's probe, with its answers: 200 `OK`, 500 when not serving.
            "/healthcheck" => match self.health.check().await {
                Ok(()) => text(StatusCode::OK, "OK"),
                Err(why) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("not serving: {why}\n"),
                ),
            },
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /healthz, /readyz or /healthcheck\n",
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

impl Admin {
    async fn api(&self, api: &Api, request: &Request<bulk::Body>) -> Response<ProxyBody> {
        let path = request.uri().path();
        if let Some(token) = &api.token {
            if !token.admits(request.headers().get(AUTHORIZATION)) {
                let mut response = problem(
                    StatusCode::UNAUTHORIZED,
                    "the admin API needs `Authorization: Bearer <token>` with the token in the \
                     environment variable admin.token_env names",
                    path,
                    &[],
                );
                response.headers_mut().insert(
                    WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"sluice-admin\""),
                );
                return response;
            }
        }
        let method = request.method();
        let rest = &path[API_PREFIX.len()..];
        match rest.split('/').collect::<Vec<_>>()[..] {
            ["config"] if method == Method::GET => {
                let policy = self.gateway.policy();
                json_response(
                    StatusCode::OK,
                    &config_view::view(&api.reload.serving(), &policy),
                )
            }
            ["config"] => not_allowed(path, "GET"),
            ["reload"] if method == Method::POST => self.reload(api, path).await,
            ["reload"] => not_allowed(path, "POST"),
            ["limits", route, limit] if method == Method::GET || method == Method::DELETE => {
                let query = request.uri().query().unwrap_or_default();
                self.limit(method, (route, limit, None), query, path).await
            }
            ["limits", _, _] => not_allowed(path, "GET, DELETE"),
            ["limits", route, limit, "leases", lease] if method == Method::DELETE => {
                let query = request.uri().query().unwrap_or_default();
                self.limit(method, (route, limit, Some(lease)), query, path)
                    .await
            }
            ["limits", _, _, "leases", _] => not_allowed(path, "DELETE"),
            ["limits", route, limit, "override"]
                if [Method::GET, Method::PUT, Method::DELETE].contains(method) =>
            {
                let query = request.uri().query().unwrap_or_default();
                // Who, for the audit line: the token holder, or anyone on loopback.
                let by = if api.token.is_some() {
                    "admin token"
                } else {
                    "loopback (no token)"
                };
                self.override_of(method, (route, limit), query, path, by)
                    .await
            }
            ["limits", _, _, "override"] => not_allowed(path, "GET, PUT, DELETE"),
            ["limits", route, limit, "overrides"] if method == Method::GET => {
                let query = request.uri().query().unwrap_or_default();
                self.overrides_of((route, limit), query, path).await
            }
            ["limits", route, limit, "overrides"] if method == Method::POST => {
                let by = if api.token.is_some() {
                    "admin token"
                } else {
                    "loopback (no token)"
                };
                self.load_overrides((route, limit), request.body(), path, by)
                    .await
            }
            ["limits", _, _, "overrides"] => not_allowed(path, "GET, POST"),
            ["limits", route, limit, "usage"] if method == Method::GET => {
                let query = request.uri().query().unwrap_or_default();
                self.usage_top((route, limit), query, path).await
            }
            ["limits", _, _, "usage"] => not_allowed(path, "GET"),
            ["usage"] if method == Method::GET => {
                let query = request.uri().query().unwrap_or_default();
                self.usage_of(query, path).await
            }
            ["usage"] => not_allowed(path, "GET"),
            ["overrides"] if method == Method::GET => self.overridden(path).await,
            ["overrides"] => not_allowed(path, "GET"),
            _ => problem(
                StatusCode::NOT_FOUND,
                "no such admin endpoint: try /admin/v1/limits/{route}/{limit}?key=..., \
                 /admin/v1/limits/{route}/{limit}/override?key=..., \
                 /admin/v1/limits/{route}/{limit}/overrides, \
                 /admin/v1/limits/{route}/{limit}/usage, /admin/v1/usage?key=..., \
                 /admin/v1/overrides, /admin/v1/config or /admin/v1/reload",
                path,
                &[],
            ),
        }
    }

    /// One identity of `route`'s `limit`: read (`GET`), reset (`DELETE`), or, for a
    /// concurrency limit, one of its leases ended (`DELETE .../leases/{lease}`).
    async fn limit(
        &self,
        method: &Method,
        (route, limit, lease): (&str, &str, Option<&str>),
        query: &str,
        path: &str,
    ) -> Response<ProxyBody> {
        self.on_limit((route, limit), path, async |policy, found, rule| {
            let key = match limits::store_key(policy, found, rule, query) {
                Ok(key) => key,
                Err(detail) => return problem(StatusCode::BAD_REQUEST, &detail, path, &[]),
            };
            let check = store_key::check(rule, key, crate::runtime::clock::now());
            let store = self.gateway.store();
            let identity = store_key::identity_of(policy, found, rule, &check.key);
            let concurrent = rule.spec.algorithm == crate::limiter::Algorithm::Concurrency;
            let failed = |err: crate::limiter::StoreError| {
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("{} store: {err}", store.name()),
                    path,
                    &[],
                )
            };
            let outcome = match lease {
                Some(_) if !concurrent => {
                    return problem(
                        StatusCode::NOT_FOUND,
                        &format!("limit `{limit}` is not a concurrency limit: it holds no leases"),
                        path,
                        &[],
                    )
                }
                Some(lease) => end_lease(store, &check, (route, limit, lease)).await,
                None if method == Method::DELETE => reset(store, &check, (route, limit)).await,
                None => peek(store, &check).await,
            };
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(detail) => return problem(StatusCode::SERVICE_UNAVAILABLE, &detail, path, &[]),
            };
            let mut body = limit_view((route, limit), rule, &check, identity);
            if concurrent && lease.is_none() && method == Method::GET {
                match store.holders(&check).await {
                    Ok((holders, _)) => merge(&mut body, holders_view(rule, &holders)),
                    Err(err) => return failed(err),
                }
            }
            merge(&mut body, outcome);
            json_response(StatusCode::OK, &body)
        })
        .await
    }

    async fn reload(&self, api: &Api, path: &str) -> Response<ProxyBody> {
        match api.reload.reload().await {
            Some(Ok(applied)) => json_response(
                StatusCode::OK,
                &json!({
                    "applied": true,
                    "sha256": applied.sha256,
                    "config_hash": applied.config_hash,
                    "routes": applied.routes,
                }),
            ),
            Some(Err(err)) => problem_with(
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("the config was not applied; the old policy keeps serving: {err}"),
                path,
                [("applied", false.into()), ("error", error_fields(&err))],
            ),
            None => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting down: no reload",
                path,
                &[],
            ),
        }
    }
}

/// Where a refused config is wrong, as members of the 422 answer.
fn error_fields(err: &ReloadError) -> serde_json::Value {
    match err {
        ReloadError::Config(err) => config_error_fields(err),
        ReloadError::NeedsRestart { file, change } => json!({
            "file": file.display().to_string(),
            "message": format!("{change}: a restart is needed to apply it"),
        }),
    }
}

/// One refused file's mistakes: where and what; with several, the first's place and every
/// one in `errors`.
fn config_error_fields(err: &ConfigError) -> serde_json::Value {
    match err {
        ConfigError::Invalid {
            file,
            position,
            field,
            message,
        } => json!({
            "file": file.display().to_string(),
            "line": position.line,
            "column": position.column,
            "field": field,
            "message": message,
        }),
        ConfigError::Read { file, source } => json!({
            "file": file.display().to_string(),
            "message": format!("cannot read the file: {source}"),
        }),
        ConfigError::Several { errors } => {
            let each: Vec<serde_json::Value> = errors.iter().map(config_error_fields).collect();
            let mut fields = each.first().cloned().unwrap_or_else(|| json!({}));
            fields["message"] = err.to_string().into();
            fields["errors"] = each.into();
            fields
        }
    }
}

/// Adds the members of the object `extra` to the object `body`.
/// A concurrency limit's read: its unit, lease period and the requests holding its places.
fn holders_view(
    rule: &crate::policy::Limit,
    holders: &[crate::limiter::Holder],
) -> serde_json::Value {
    let holders: Vec<serde_json::Value> = holders
        .iter()
        .map(|h| json!({ "lease": h.lease, "instance": h.instance, "age": h.age.as_secs_f64() }))
        .collect();
    json!({
        "unit": "concurrent-requests",
        "lease_period": rule.spec.window.as_secs_f64(),
        "window": serde_json::Value::Null,
        "holders": holders,
    })
}

/// What `GET` and `DELETE` of a limit answer besides their outcome: the limit as the policy
/// states it, and the identity's key (with its calendar quota's period, if it has one).
fn limit_view(
    (route, limit): (&str, &str),
    rule: &crate::policy::Limit,
    check: &crate::limiter::Check,
    identity: &str,
) -> serde_json::Value {
    let mut body = json!({
        "route": route,
        "limit": limit,
        "algorithm": rule.spec.algorithm.label(),
        "key": check.key,
        "identity": identity,
        "requests": rule.spec.requests,
        "window": rule.spec.window.as_secs_f64(),
        "burst": rule.spec.burst,
        "cost": rule.spec.cost,
        "unit": rule.unit(),
    });
    if let Some(quota) = &rule.quota {
        merge(
            &mut body,
            json!({
                "quota": quota.period.label(),
                "time_zone": quota.zone_name,
                "period": check.key.rsplit(':').next(),
                "window": check.spec.window.as_secs_f64(),
                "resets_at": crate::response::reset_instant(quota, check.spec.window),
            }),
        );
    }
    body
}

/// Ends one lease of a concurrency limit's identity; `Err`: why the store could not.
async fn end_lease(
    store: &crate::limiter::Store,
    check: &crate::limiter::Check,
    (route, limit, lease): (&str, &str, &str),
) -> Result<serde_json::Value, String> {
    match store.end_lease(check, lease).await {
        Ok(ended) => {
            tracing::info!(route, limit, identity = %crate::log::key_hash(&check.key), lease, ended, "admin API: concurrency lease ended");
            Ok(json!({ "store": store.name(), "lease": lease, "ended": ended }))
        }
        Err(err) => Err(format!("{} store: {err}", store.name())),
    }
}

/// Resets one identity of a limit: its key in the store, and what every instance remembers
/// of it; `Err`: why the store could not.
async fn reset(
    store: &crate::limiter::Store,
    check: &crate::limiter::Check,
    (route, limit): (&str, &str),
) -> Result<serde_json::Value, String> {
    match store.reset(check).await {
        Ok(forgotten) => {
            tracing::info!(route, limit, identity = %crate::log::key_hash(&check.key), "admin API: quota reset");
            Ok(json!({
                "store": store.name(),
                "forgotten": {
                    "store_key": forgotten.store_key,
                    "deny_cache": forgotten.deny_cache,
                    "local_fallback": forgotten.fallback,
                },
                "instances_told": forgotten.instances_told,
            }))
        }
        Err(err) => Err(format!(
            "{} store: {err}; this instance's deny cache and local fallback state for the key \
             were forgotten, the store's key was not",
            store.name()
        )),
    }
}

/// One identity's count, what remains and when it resets; `Err`: why the store could not.
async fn peek(
    store: &crate::limiter::Store,
    check: &crate::limiter::Check,
) -> Result<serde_json::Value, String> {
    match store.peek(check).await {
        Ok((peek, answered)) => Ok(json!({
            "count": peek.count,
            "remaining": peek.remaining,
            "reset": peek.reset.as_secs_f64(),
            "store": answered,
        })),
        Err(err) => Err(format!("{} store: {err}", store.name())),
    }
}

impl Admin {
    /// Answers a request on `route`'s `limit` in the policy in force with `answer` (given the
    /// policy, the route and the limit), or with the 404 that says which of the two the
    /// policy lacks: the one place the limit endpoints find what they are about.
    async fn on_limit(
        &self,
        (route, limit): (&str, &str),
        path: &str,
        answer: impl AsyncFnOnce(
            &crate::policy::Policy,
            &crate::policy::Route,
            &crate::policy::Limit,
        ) -> Response<ProxyBody>,
    ) -> Response<ProxyBody> {
        let policy = self.gateway.policy();
        match find_limit(&policy, route, limit, path) {
            Ok((found, rule)) => answer(&policy, found, rule).await,
            Err(response) => *response,
        }
    }
}

/// `route`'s `limit` in `policy`, or the 404 that says which is missing.
fn find_limit<'p>(
    policy: &'p crate::policy::Policy,
    route: &str,
    limit: &str,
    path: &str,
) -> Result<(&'p crate::policy::Route, &'p crate::policy::Limit), Box<Response<ProxyBody>>> {
    let Some(found) = policy.routes.iter().find(|r| r.name.as_str() == route) else {
        return Err(Box::new(problem(
            StatusCode::NOT_FOUND,
            &format!("no route `{route}` in the policy in force"),
            path,
            &[("route", route)],
        )));
    };
    let Some(rule) = found.limits.iter().find(|l| l.name.as_str() == limit) else {
        return Err(Box::new(problem(
            StatusCode::NOT_FOUND,
            &format!("route `{route}` has no limit `{limit}`"),
            path,
            &[("route", route), ("limit", limit)],
        )));
    };
    Ok((found, rule))
}

fn merge(body: &mut serde_json::Value, extra: serde_json::Value) {
    if let (Some(members), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        members.extend(extra);
    }
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<ProxyBody> {
    let mut response = Response::new(ProxyBody::full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn not_allowed(path: &str, allow: &'static str) -> Response<ProxyBody> {
    let mut response = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("use {allow}"),
        path,
        &[],
    );
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    response
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
