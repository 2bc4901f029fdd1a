//! sluice: a rate-limiting reverse proxy. This file is the command line and start-up wiring
//! only; the request path starts in `server` and `proxy` (see `lib.rs`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio::sync::watch;

use sluice::admin::{Admin, Api, Token};
use sluice::limiter::{RedisStore, Store};
use sluice::metrics::Metrics;
use sluice::policy::Policy;
use sluice::proxy::{self, Gateway};
use sluice::reload::Reloader;
use sluice::tls::ListenerTls;
use sluice::{config, server};

#[derive(Parser)]
#[command(
    version,
    about = "A rate-limiting reverse proxy with exact sliding-window limits"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve traffic with the policy in the config file.
    Run {
        #[arg(long, default_value = "config/sluice.yaml")]
        config: PathBuf,
    },
    /// Check a config file as `run` would, without serving.
    Check {
        #[arg(long, default_value = "config/sluice.yaml")]
        config: PathBuf,
    },
    /// Show what sluice would do with one request: the route, the limits and the exact store
    /// keys, without touching the store.
    Explain {
        #[arg(long, default_value = "config/sluice.yaml")]
        config: PathBuf,
        /// The method, e.g. GET.
        method: String,
        /// The path and query, e.g. /users/42/orders?x=1.
        target: String,
        /// A request header, `name: value` (repeatable).
        #[arg(short = 'H', long = "header")]
        headers: Vec<String>,
        /// The address the request comes from.
        #[arg(long, default_value = "127.0.0.1")]
        from: std::net::IpAddr,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        sluice::log::init_direct(sluice::log::Format::Text);
    }
    let result = match cli.command {
        Command::Check { config } => check(&config),
        Command::Explain {
            config,
            method,
            target,
            headers,
            from,
        } => {
            let question = sluice::explain::Question {
                method: &method,
                target: &target,
                headers: &headers,
                from,
            };
            sluice::explain::explain(&config, &question)
                .map(|text| print!("{text}"))
                .map_err(anyhow::Error::from)
        }
        // The file names the log format, so it is read before anything is logged.
        Command::Run { config } => load(&config).and_then(|loaded| {
            let flusher = sluice::log::init(loaded.source.config.log_format.into())
                .context("cannot start the log writer")?;
            let served =
                worker_runtime().and_then(|runtime| runtime.block_on(run(&config, loaded)));
            // Whatever standard error's reader does, the exit waits for it this long at most.
            flusher.flush(sluice::log::FLUSH_TIMEOUT);
            served
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Everything `run` checks before it binds its listeners (and a reload checks before it
/// replaces the policy): the file parsed and the policy compiled. Builds no clients.
struct Loaded {
    source: config::Source,
    policy: Policy,
    metrics: Arc<Metrics>,
    /// The listener's TLS, its certificate and key read and checked.
    tls: Option<ListenerTls>,
}

fn load(file: &Path) -> anyhow::Result<Loaded> {
    let source = config::load(file)?;
    let metrics = Arc::new(Metrics::new().context("cannot create the metrics registry")?);
    let policy = Policy::compile(&source.config, file, &metrics)?;
    let tls = match &source.config.tls {
        Some(tls) => Some(ListenerTls::load(tls, file)?),
        None => None,
    };
    Ok(Loaded {
        source,
        policy,
        metrics,
        tls,
    })
}

fn check(file: &Path) -> anyhow::Result<()> {
    let loaded = load(file)?;
    let config = &loaded.source.config;
    println!(
        "{}: ok ({} routes, {} upstreams, store: {}{})",
        file.display(),
        loaded.policy.routes.len(),
        config.upstreams.len(),
        if config.store.redis.is_some() {
            "redis"
        } else {
            "in-process"
        },
        if loaded.tls.is_some() { ", tls" } else { "" }
    );
    Ok(())
}

/// One worker's runtime: current-thread, so a connection and everything its requests do run
/// on the worker's own thread (see `server`).
fn worker_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Runs on the main thread, which is worker 0: it also hosts what there is one of (the admin
/// listener, the reloader, the TLS file watch, the signal handler, the store's background
/// tasks). Workers 1.. each get a thread with its own runtime and listener.
async fn run(file: &Path, loaded: Loaded) -> anyhow::Result<()> {
    let Loaded {
        source,
        policy,
        metrics,
        tls,
    } = loaded;
    let config = &source.config;
    // Before anything is bound or connected: a token that cannot be read stops the start.
    let token = if config.admin.api {
        Token::from_env(&config.admin)?
    } else {
        None
    };
    let admin_api = config.admin.api;
    let store = match (&config.store.redis, &config.store.topology) {
        (Some(redis), Some(topology)) => {
            let (pool_size, timeout) = (redis.value.pool_size.0 as usize, redis.value.timeout.0);
            let store = RedisStore::connect(topology, pool_size, timeout)
                .await
                .context("invalid Redis settings")?;
            if let Err(err) = store.load_script().await {
                tracing::warn!(error = %err, "Redis is not answering yet; limited routes follow their on_store_error until it does");
            }
            Store::redis(store, config.store.local.max_keys.0 as usize, &metrics)
        }
        _ => Store::local(config.store.local.max_keys.0 as usize, &metrics),
    };
    let workers = config.server.workers.resolve();
    let listeners = server::bind_workers(config.listen, workers)
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let admin_listener = server::bind(config.admin_listen.value).with_context(|| {
        format!(
            "cannot listen on {} (admin_listen)",
            config.admin_listen.value
        )
    })?;
    tracing::info!(
        listen = %config.listen,
        workers,
        tls = config.tls.is_some(),
        admin_listen = %config.admin_listen.value,
        routes = policy.routes.len(),
        store = store.name(),
        admin_api = match (admin_api, &token) {
            (false, _) => "off",
            (true, Some(_)) => "bearer token",
            (true, None) => "open (loopback, no token)",
        },
        "sluice is serving"
    );

    let head_limits = proxy::HeadLimits::new(&config.server);
    let settings = server::Settings::new(&config.server);
    let open = |listener: &str| metrics.open_connections.with_label_values(&[listener]);
    let (gateway_open, admin_open) = (open("gateway"), open("admin"));
    let worker_connections = metrics.worker_connections.clone();
    let gateway = Arc::new(Gateway::new(policy, store, head_limits, &metrics));
    let request_log = gateway.request_log();
    let draining = Arc::new(AtomicBool::new(false));
    let (stop, stopping) = watch::channel(false);
    let mut gateway_settings = settings.clone();
    if let Some(tls) = tls {
        gateway_settings.tls = Some(server::ServerTls {
            acceptor: tls.acceptor(),
            handshake_errors: metrics.tls_handshake_errors.clone(),
        });
        tokio::spawn(tls.watch(metrics.tls_cert_reloads.clone(), stopping.clone()));
    }
    let shutdown_delay = config.server.shutdown_delay.map_or(Duration::ZERO, |d| d.0);
    let admin_metrics = Arc::clone(&metrics);
    let reloader = Reloader::new(file, source, Arc::clone(&gateway), metrics);
    let admin = Arc::new(Admin {
        gateway: Arc::clone(&gateway),
        metrics: admin_metrics,
        draining: Arc::clone(&draining),
        api: admin_api.then(|| Api {
            token,
            reload: reloader.handle(),
        }),
    });
    tokio::spawn(reloader.run(stopping.clone()));
    tokio::spawn(async move {
        shutdown_signal().await;
        // Unready first, so load balancers stop sending while the listeners still accept.
        draining.store(true, Ordering::Relaxed);
        tracing::info!(
            ?shutdown_delay,
            "shutting down: /readyz answers 503; listeners close after the delay"
        );
        tokio::time::sleep(shutdown_delay).await;
        tracing::info!("listeners closed: finishing requests in flight");
        let _ = stop.send(true);
    });
    let handler = move |request, peer| {
        let gateway = Arc::clone(&gateway);
        async move { gateway.handle(request, peer).await }
    };
    let gateway_slots = server::slots(&gateway_settings);
    let counters = |worker: usize| server::Counters {
        open: gateway_open.clone(),
        accepted: Some(worker_connections.with_label_values(&[&worker.to_string()])),
    };
    let mut listeners = listeners.into_iter();
    let first = listeners
        .next()
        .context("no listener was bound for worker 0")?;
    // Workers 1..: their runtimes built and listeners registered here, so a failure stops the
    // start; each reports on `finished` when its connections are drained.
    let (finished, mut workers_done) = tokio::sync::mpsc::channel::<()>(workers.max(1));
    let mut threads = Vec::new();
    for (index, listener) in listeners.enumerate() {
        let worker = index + 1;
        let runtime = worker_runtime()?;
        let listener = {
            let _registered_with = runtime.enter();
            listener.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(listener)?
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
                let serve = server::serve(listener, handler, settings, slots, counters, stopping);
                runtime.block_on(serve);
                drop(finished);
            })
            .context("cannot start a worker thread")?;
        threads.push(thread);
    }
    drop(finished);
    first.set_nonblocking(true)?;
    let serve_gateway = server::serve(
        tokio::net::TcpListener::from_std(first)?,
        handler,
        gateway_settings,
        gateway_slots,
        counters(0),
        stopping.clone(),
    );
    let admin_slots = server::slots(&settings);
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
    // The counts since the last report, so a rejection summary is never lost at exit.
    request_log.report();
    Ok(())
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
