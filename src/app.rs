//! The composition root: how a version of the config file (`crate::version`) becomes a
//! running sluice. `serve` wires the parts of a running process together: the store, the
//! listeners and their workers, the gateway, the admin API, the reloader (its versions read
//! as at start) and the certificate watch.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::admin::{Admin, Api, Guard, Token, TokenError};
use crate::config::{ConfigError, Source};
use crate::health::Health;
use crate::limiter::{RedisStore, Store, StoreError};
use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::reload::{Reloader, Versions};
use crate::server;
use crate::version::{version, ListenerFiles, Version};

/// Why sluice cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    WebhookSecret(#[from] crate::notify::SecretError),
    #[error("cannot create the metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("invalid Redis settings: {0}")]
    Redis(#[from] StoreError),
    #[error("cannot listen on {addr}{what}: {source}")]
    Listen {
        addr: SocketAddr,
        /// Which setting the address comes from, when it is not `listen`.
        what: &'static str,
        source: std::io::Error,
    },
    #[error("cannot start {what}: {source}")]
    Start {
        what: &'static str,
        source: std::io::Error,
    },
}

/// A reload's versions: loaded as at start-up, put in force in the gateway with their
/// metric handles.
struct GatewayVersions {
    gateway: Arc<Gateway>,
    metrics: Arc<Metrics>,
    /// The rate limit service, when it was started (its listener is fixed at start).
    rls: Option<Arc<crate::rls::Service>>,
}

impl Versions for GatewayVersions {
    type Version = Version;

    fn load(&mut self, bytes: &[u8], file: &Path) -> Result<Version, ConfigError> {
        version(bytes, file, ListenerFiles::Skip)
    }

    fn source(version: &Version) -> &Source {
        &version.source
    }

    fn put_in_force(&mut self, version: Version) -> (Source, usize) {
        let policy = version.policy.metered(&self.metrics);
        version.verifiers.start(&jwks_metrics(&self.metrics));
        let routes = policy.routes.len();
        self.gateway.install(policy);
        if let Some(rls) = &self.rls {
            rls.install(version.rls);
        }
        (version.source, routes)
    }
}

/// One worker's runtime (see [`server::worker_runtime`]): the calling thread's, which is
/// worker 0.
pub fn worker_runtime() -> Result<tokio::runtime::Runtime, StartError> {
    server::worker_runtime().map_err(runtime_error)
}

fn runtime_error(source: std::io::Error) -> StartError {
    StartError::Start {
        what: "the async runtime",
        source,
    }
}

/// Serves `loaded` (the version in `file`) until SIGTERM or Ctrl-C. Runs on the calling
/// thread, which is worker 0: it also hosts what there is one of (the admin listener, the
/// reloader, the TLS file watch, the signal handler, the store's background tasks). Workers
/// 1.. each get a thread with its own runtime and listener (`server::start_workers`).
pub async fn serve(file: &Path, loaded: Version) -> Result<(), StartError> {
    let Version {
        source,
        policy,
        listener_tls,
        verifiers,
        rls,
        rls_tls,
    } = loaded;
    let config = &source.config;
    // Before anything is bound or connected: a token that cannot be read stops the start.
    let token = if config.admin.api {
        Token::from_env(&config.admin)?
    } else {
        None
    };
    let metrics = Arc::new(Metrics::new()?);
    // Before anything is bound too: a webhook whose secret cannot be read stops the start.
    let notifier = match &config.webhook {
        Some(webhook) => crate::notify::Notifier::start(webhook, &metrics)?,
        None => crate::notify::Notifier::off(&metrics),
    };
    let policy = policy.metered(&metrics);
    // In the background from now: the verifiers' routes answer 503 until their keys are in.
    verifiers.start(&jwks_metrics(&metrics));
    let store = open_store(config, &metrics).await?;
    let workers = config.server.workers.resolve();
    let bound = bind(config, workers)?;
    log_serving(
        config,
        workers,
        policy.routes.len(),
        store.name(),
        token.as_ref(),
    );

    let settings = server::Settings::new(&config.server);
    let gateway =
        Arc::new(Gateway::new(policy, store, &config.server, &metrics).notifying(notifier));
    let (request_log, store) = (gateway.request_log(), gateway.shared_store());
    let draining = Arc::new(AtomicBool::new(false));
    let (stop, stopping) = watch::channel(false);
    let gateway_settings = gateway_settings(&settings, listener_tls, &metrics, &stopping);
    let health_reporter = tonic_health::server::HealthReporter::new();
    let rls = start_rls(
        rls,
        bound.rls,
        rls_tls,
        health_reporter.clone(),
        &gateway,
        &metrics,
        &stopping,
    )?;
    let health = Arc::new(Health {
        draining: Arc::clone(&draining),
        gateway: Arc::clone(&gateway),
        rls: rls.clone(),
    });
    report_health(&health, health_reporter, &stopping);
    let (admin_api, admin_hosts) = (config.admin.api, config.admin.hosts.clone());
    let listen = config.listen;
    let shutdown_delay = config.server.shutdown_delay.map_or(Duration::ZERO, |d| d.0);
    let versions = GatewayVersions {
        gateway: Arc::clone(&gateway),
        metrics: Arc::clone(&metrics),
        rls,
    };
    let reloader = Reloader::new(file, source, versions, Arc::clone(&metrics));
    let admin = Admin {
        gateway: Arc::clone(&gateway),
        metrics: Arc::clone(&metrics),
        draining: Arc::clone(&draining),
        health,
        api: admin_api.then(|| Api {
            token,
            reload: reloader.handle(),
        }),
        guard: Guard::new(admin_hosts),
    };
    tokio::spawn(reloader.run(stopping.clone()));
    tokio::spawn(shut_down_on_signal(draining, shutdown_delay, stop));
    let handler = move |request, peer| {
        let gateway = Arc::clone(&gateway);
        async move { gateway.handle(request, peer).await }
    };
    let counters = gateway_counters(&metrics);
    let (listeners, stopped) = (bound.gateway, stopping.clone());
    let server::Workers { first, others } =
        server::start_workers(listeners, handler, gateway_settings, counters, stopped)
            .map_err(|err| workers_error(err, listen))?;
    let admin = serve_admin(admin, bound.admin, settings, &metrics, stopping);
    tokio::join!(first, admin);
    others.drained().await;
    // The leases of requests the drain cut (their releases' tasks died with the workers'
    // runtimes), so no place stays taken until its lease period ends.
    store.end_leases(Duration::from_secs(2)).await;
    // The counts since the last report, so a rejection summary is never lost at exit.
    request_log.report();
    Ok(())
}

/// Reports `health` over gRPC's health service on the rate limit service's port, when there
/// is one, until the server stops.
fn report_health(
    health: &Arc<Health>,
    reporter: tonic_health::server::HealthReporter,
    stopping: &watch::Receiver<bool>,
) {
    if health.rls.is_some() {
        tokio::spawn(Arc::clone(health).report(reporter, stopping.clone()));
    }
}

/// The line that says sluice is serving, and how: its listeners, workers, routes, store and
/// admin API.
fn log_serving(
    config: &crate::config::Config,
    workers: usize,
    routes: usize,
    store: &str,
    token: Option<&Token>,
) {
    tracing::info!(
        listen = %config.listen,
        workers,
        tls = config.tls.is_some(),
        admin_listen = %config.admin_listen.value,
        admin_listen_default = config.admin_listen.referenced == serde_saphyr::Location::UNKNOWN,
        routes,
        store,
        admin_api = match (config.admin.api, token) {
            (false, _) => "off",
            (true, Some(_)) => "bearer token",
            (true, None) => "open (loopback, no token)",
        },
        "sluice is serving"
    );
}

/// Why the workers did not start, as a start error: a gateway listener that cannot be
/// registered with its worker is one sluice cannot listen on (`listen`).
fn workers_error(err: server::WorkersError, listen: SocketAddr) -> StartError {
    match err {
        server::WorkersError::Listener(source) => StartError::Listen {
            addr: listen,
            what: "",
            source,
        },
        server::WorkersError::Runtime(source) => runtime_error(source),
        server::WorkersError::Thread(source) => StartError::Start {
            what: "a worker thread",
            source,
        },
    }
}

/// How each gateway worker counts its connections: the listener's open connections (all
/// workers) and those the worker accepted, by its index.
fn gateway_counters(metrics: &Metrics) -> impl Fn(usize) -> server::Counters {
    let listeners = &metrics.listeners;
    let open = listeners.open_connections.with_label_values(&["gateway"]);
    let accepted = listeners.worker_connections.clone();
    move |worker| server::Counters {
        open: open.clone(),
        accepted: Some(accepted.with_label_values(&[&worker.to_string()])),
    }
}

/// The gateway listener's settings: the server's, with TLS when the version has a
/// certificate, whose files are watched from now until `stopping`.
fn gateway_settings(
    settings: &server::Settings,
    listener_tls: Option<crate::tls::ListenerTls>,
    metrics: &Metrics,
    stopping: &watch::Receiver<bool>,
) -> server::Settings {
    let mut gateway_settings = settings.clone();
    if let Some(tls) = listener_tls {
        gateway_settings.tls = Some(server::ServerTls {
            acceptor: tls.acceptor(),
            handshake_errors: metrics.listeners.tls_handshake_errors.clone(),
        });
        tokio::spawn(tls.watch(metrics.listeners.tls_cert_reloads.clone(), stopping.clone()));
    }
    gateway_settings
}

/// The rate limit service, serving on its listener (with `grpc.health.v1.Health` from
/// `health`) from now until `stopping`, when the version has rules for it (`rls:`, whose
/// listener `bind` bound); its TLS files are watched until then.
fn start_rls(
    rls: Option<crate::rls::Compiled>,
    listener: Option<tokio::net::TcpListener>,
    tls: Option<crate::tls::ListenerTls>,
    health: tonic_health::server::HealthReporter,
    gateway: &Gateway,
    metrics: &Metrics,
    stopping: &watch::Receiver<bool>,
) -> Result<Option<Arc<crate::rls::Service>>, StartError> {
    let (Some(rls), Some(listener)) = (rls, listener) else {
        return Ok(None);
    };
    let rls_metrics = crate::rls::RlsMetrics::new(metrics)?;
    let service = Arc::new(crate::rls::Service::new(
        rls,
        gateway.shared_store(),
        rls_metrics,
    ));
    let acceptor = tls.map(|tls| {
        let acceptor = tls.acceptor();
        tokio::spawn(tls.watch(metrics.listeners.tls_cert_reloads.clone(), stopping.clone()));
        acceptor
    });
    tokio::spawn(crate::rls::serve(
        Arc::clone(&service),
        health,
        listener,
        acceptor,
        stopping.clone(),
    ));
    Ok(Some(service))
}

/// The admin listener served until `stopping`: its own connection slots, and each request
/// given the address it came to (the guard compares the `Host` with it).
fn serve_admin(
    admin: Admin,
    listener: tokio::net::TcpListener,
    mut settings: server::Settings,
    metrics: &Metrics,
    stopping: watch::Receiver<bool>,
) -> impl std::future::Future<Output = ()> {
    let admin = Arc::new(admin);
    let slots = server::slots(&settings);
    settings.local_addr = true;
    let counters = server::Counters {
        open: metrics
            .listeners
            .open_connections
            .with_label_values(&["admin"]),
        accepted: None,
    };
    let handler = move |request, _peer| {
        let admin = Arc::clone(&admin);
        async move { admin.handle(request).await }
    };
    server::serve(listener, handler, settings, slots, counters, stopping)
}

/// The store the policy names: Redis (connected, its script loaded when it answers) or the
/// in-process one.
async fn open_store(
    config: &crate::config::Config,
    metrics: &Metrics,
) -> Result<Store, StartError> {
    let max_keys = config.store.local.max_keys.0 as usize;
    Ok(match (&config.store.redis, &config.store.topology) {
        (Some(redis), Some(topology)) => {
            let (pool_size, timeout) = (redis.value.pool_size.0 as usize, redis.value.timeout.0);
            let store = RedisStore::connect(topology, pool_size, timeout).await?;
            if let Err(err) = store.load_script().await {
                tracing::warn!(error = %err, "Redis is not answering yet; limited routes follow their on_store_error until it does");
            }
            let store = Store::redis(store, max_keys, metrics);
            store.bound_usage(config.store.local.max_reported.0 as usize);
            store
        }
        _ => Store::local(max_keys, metrics),
    })
}

/// Every listener, bound before anything serves: a port taken stops the start.
struct Bound {
    /// One per worker.
    gateway: Vec<std::net::TcpListener>,
    rls: Option<tokio::net::TcpListener>,
    admin: tokio::net::TcpListener,
}

fn bind(config: &crate::config::Config, workers: usize) -> Result<Bound, StartError> {
    let taken = |addr: SocketAddr, what: &'static str| {
        move |source| StartError::Listen { addr, what, source }
    };
    let gateway = server::bind_workers(config.listen, workers).map_err(taken(config.listen, ""))?;
    let rls = match &config.rls {
        Some(section) => Some(
            server::bind(section.value.listen)
                .map_err(taken(section.value.listen, " (rls.listen)"))?,
        ),
        None => None,
    };
    let admin = server::bind(config.admin_listen.value)
        .map_err(taken(config.admin_listen.value, " (admin_listen)"))?;
    Ok(Bound {
        gateway,
        rls,
        admin,
    })
}

/// On SIGTERM or Ctrl-C: unready first (`/readyz` answers 503), so load balancers stop sending
/// while the listeners still accept; after `delay`, the listeners close (`stop`).
async fn shut_down_on_signal(
    draining: Arc<AtomicBool>,
    delay: Duration,
    stop: watch::Sender<bool>,
) {
    shutdown_signal().await;
    draining.store(true, Ordering::Relaxed);
    tracing::info!(
        shutdown_delay = ?delay,
        "shutting down: /readyz answers 503; listeners close after the delay"
    );
    tokio::time::sleep(delay).await;
    tracing::info!("listeners closed: finishing requests in flight");
    let _ = stop.send(true);
}

/// SIGTERM (Kubernetes, Docker) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The handles the `jwks_url` fetchers count into (built here, where both sides are known:
/// the metrics stay below the identities in the module graph).
fn jwks_metrics(metrics: &Metrics) -> crate::jwt::jwks::JwksMetrics {
    crate::jwt::jwks::JwksMetrics {
        fetches: metrics.jwt.jwks_fetches.clone(),
        age: metrics.jwt.jwks_keys_age.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` and `check` read the listener's certificate files with the version; a reload and
    /// `explain` do not (the listener's files are fixed at start and rotated on their own).
    #[test]
    fn only_a_start_reads_the_listener_certificate() {
        let yaml = b"listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\ntls:\n  cert: missing-cert.pem\n  key: missing-key.pem\nroutes: []\n";
        let file = Path::new("/nonexistent-sluice-dir/t.yaml");
        let skipped = version(yaml, file, ListenerFiles::Skip).expect("no file read");
        assert!(skipped.listener_tls.is_none());
        let read = version(yaml, file, ListenerFiles::Read)
            .err()
            .expect("the certificate is missing");
        let message = read.to_string();
        assert!(
            message.contains("tls.cert") && message.contains("missing-cert.pem"),
            "{message}"
        );
    }
}
