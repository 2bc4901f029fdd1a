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

/// One worker's runtime: current-thread, so a connection and everything its requests do run
/// on the worker's own thread (see `server`).
pub fn worker_runtime() -> Result<tokio::runtime::Runtime, StartError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| StartError::Start {
            what: "the async runtime",
            source,
        })
}

/// Serves `loaded` (the version in `file`) until SIGTERM or Ctrl-C. Runs on the calling
/// thread, which is worker 0: it also hosts what there is one of (the admin listener, the
/// reloader, the TLS file watch, the signal handler, the store's background tasks). Workers
/// 1.. each get a thread with its own runtime and listener.
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
    let admin_api = config.admin.api;
    let admin_hosts = config.admin.hosts.clone();
    let metrics = Arc::new(Metrics::new()?);
    let policy = policy.metered(&metrics);
    // In the background from now: the verifiers' routes answer 503 until their keys are in.
    verifiers.start(&jwks_metrics(&metrics));
    let store = open_store(config, &metrics).await?;
    let workers = config.server.workers.resolve();
    let Bound {
        gateway: listeners,
        rls: rls_listener,
        admin: admin_listener,
    } = bind(config, workers)?;
    tracing::info!(
        listen = %config.listen,
        workers,
        tls = config.tls.is_some(),
        admin_listen = %config.admin_listen.value,
        admin_listen_default = config.admin_listen.referenced == serde_saphyr::Location::UNKNOWN,
        routes = policy.routes.len(),
        store = store.name(),
        admin_api = match (admin_api, &token) {
            (false, _) => "off",
            (true, Some(_)) => "bearer token",
            (true, None) => "open (loopback, no token)",
        },
        "sluice is serving"
    );

    let settings = server::Settings::new(&config.server);
    let open = |listener: &str| metrics.open_connections.with_label_values(&[listener]);
    let (gateway_open, admin_open) = (open("gateway"), open("admin"));
    let worker_connections = metrics.worker_connections.clone();
    let gateway = Arc::new(Gateway::new(policy, store, &config.server, &metrics));
    let request_log = gateway.request_log();
    let store = gateway.shared_store();
    let draining = Arc::new(AtomicBool::new(false));
    let (stop, stopping) = watch::channel(false);
    let mut gateway_settings = settings.clone();
    if let Some(tls) = listener_tls {
        gateway_settings.tls = Some(server::ServerTls {
            acceptor: tls.acceptor(),
            handshake_errors: metrics.tls_handshake_errors.clone(),
        });
        tokio::spawn(tls.watch(metrics.tls_cert_reloads.clone(), stopping.clone()));
    }
    let listen = config.listen;
    let listener_error = |source| StartError::Listen {
        addr: listen,
        what: "",
        source,
    };
    let shutdown_delay = config.server.shutdown_delay.map_or(Duration::ZERO, |d| d.0);
    let admin_metrics = Arc::clone(&metrics);
    let rls_tls = rls_tls.map(|tls| tls.acceptor());
    let rls_service = match (rls, rls_listener) {
        (Some(rls), Some(listener)) => {
            let rls_metrics = crate::rls::RlsMetrics::new(&metrics)?;
            let service = Arc::new(crate::rls::Service::new(
                rls,
                gateway.shared_store(),
                rls_metrics,
            ));
            tokio::spawn(crate::rls::serve(
                Arc::clone(&service),
                listener,
                rls_tls,
                stopping.clone(),
            ));
            Some(service)
        }
        _ => None,
    };
    let versions = GatewayVersions {
        gateway: Arc::clone(&gateway),
        metrics: Arc::clone(&metrics),
        rls: rls_service,
    };
    let reloader = Reloader::new(file, source, versions, metrics);
    let admin = Arc::new(Admin {
        gateway: Arc::clone(&gateway),
        metrics: admin_metrics,
        draining: Arc::clone(&draining),
        api: admin_api.then(|| Api {
            token,
            reload: reloader.handle(),
        }),
        guard: Guard::new(admin_hosts),
    });
    tokio::spawn(reloader.run(stopping.clone()));
    tokio::spawn(shut_down_on_signal(draining, shutdown_delay, stop));
    let handler = move |request, peer| {
        let gateway = Arc::clone(&gateway);
        async move { gateway.handle(request, peer).await }
    };
    let gateway_slots = server::slots(&gateway_settings);
    let counters = |worker: usize| server::Counters {
        open: gateway_open.clone(),
        accepted: Some(worker_connections.with_label_values(&[&worker.to_string()])),
    };
    crate::runtime::worker::set_count(listeners.len());
    let mut listeners = listeners.into_iter();
    let first = listeners.next().ok_or_else(|| {
        listener_error(std::io::Error::other("no listener was bound for worker 0"))
    })?;
    // Workers 1..: their runtimes built and listeners registered here, so a failure stops the
    // start; each reports on `finished` when its connections are drained.
    let (finished, mut workers_done) = tokio::sync::mpsc::channel::<()>(workers.max(1));
    let mut threads = Vec::new();
    for (index, listener) in listeners.enumerate() {
        let worker = index + 1;
        let runtime = worker_runtime()?;
        let listener = {
            let _registered_with = runtime.enter();
            listener.set_nonblocking(true).map_err(listener_error)?;
            tokio::net::TcpListener::from_std(listener).map_err(listener_error)?
        };
        let (handler, settings, slots, counters, stopping, finished) = (
            handler.clone(),
            gateway_settings.clone(),
            Arc::clone(&gateway_slots),
            counters(worker),
            stopping.clone(),
            finished.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("sluice-worker-{worker}"))
            .spawn(move || {
                crate::runtime::worker::enter(worker);
                let serve = server::serve(listener, handler, settings, slots, counters, stopping);
                runtime.block_on(serve);
                drop(finished);
            })
            .map_err(|source| StartError::Start {
                what: "a worker thread",
                source,
            })?;
        threads.push(thread);
    }
    drop(finished);
    first.set_nonblocking(true).map_err(listener_error)?;
    let serve_gateway = server::serve(
        tokio::net::TcpListener::from_std(first).map_err(listener_error)?,
        handler,
        gateway_settings,
        gateway_slots,
        counters(0),
        stopping.clone(),
    );
    let admin_slots = server::slots(&settings);
    let mut settings = settings;
    settings.local_addr = true;
    let serve_admin = server::serve(
        admin_listener,
        move |request, _peer| {
            let admin = Arc::clone(&admin);
            async move { admin.handle(request).await }
        },
        settings,
        admin_slots,
        server::Counters {
            open: admin_open,
            accepted: None,
        },
        stopping,
    );
    tokio::join!(serve_gateway, serve_admin);
    // This runtime keeps driving the shared tasks (the store's connections) until the other
    // workers are done: then every sender is dropped and `recv` ends.
    while workers_done.recv().await.is_some() {}
    for thread in threads {
        if thread.join().is_err() {
            tracing::error!("a worker thread panicked");
        }
    }
    // The leases of requests the drain cut (their releases' tasks died with the workers'
    // runtimes), so no place stays taken until its lease period ends.
    store.end_leases(Duration::from_secs(2)).await;
    // The counts since the last report, so a rejection summary is never lost at exit.
    request_log.report();
    Ok(())
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
            Store::redis(store, max_keys, metrics)
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
        fetches: metrics.jwks_fetches.clone(),
        age: metrics.jwks_keys_age.clone(),
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
