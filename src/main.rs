//! sluice: a rate-limiting reverse proxy. This file is the command line and the process edge
//! only (exit codes, errors as text); loading a config is `sluice::version`, wiring the parts
//! together `sluice::app`, the other commands `sluice::cli`, and the request path starts in
//! `server` and `proxy` (see `lib.rs`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use sluice::app;
use sluice::cli;
use sluice::version::{self, ListenerFiles};

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
    /// Show what the rate limit service (`rls:`) would do with one ShouldRateLimit call: each
    /// descriptor's rule, limit, algorithm and store key, without touching the store.
    ExplainRls {
        #[arg(long, default_value = "config/sluice.yaml")]
        config: PathBuf,
        /// The call's domain.
        domain: String,
        /// One descriptor per argument: `key=value[,key=value...]`, in order.
        #[arg(required = true)]
        descriptors: Vec<String>,
        /// The call's hits_addend (0 counts as 1, as Envoy sends it).
        #[arg(long, default_value_t = 0)]
        hits: u32,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        sluice::log::init_direct(sluice::log::Format::Text);
    }
    let result = match cli.command {
        Command::Check { config } => cli::check(&config)
            .map(|summary| println!("{summary}"))
            .map_err(|err| {
                // Each mistake with its line and a caret, as compilers show them.
                let text = std::fs::read_to_string(&config).ok();
                anyhow::anyhow!("{}", err.report(text.as_deref()))
            }),
        Command::Explain {
            config,
            method,
            target,
            headers,
            from,
        } => {
            let question = cli::Question {
                method: &method,
                target: &target,
                headers: &headers,
                from,
            };
            sluice::runtime::clock::init()
                .map_err(anyhow::Error::from)
                .and_then(|_| cli::explain(&config, &question).map_err(anyhow::Error::from))
                .map(|text| print!("{text}"))
        }
        Command::ExplainRls {
            config,
            domain,
            descriptors,
            hits,
        } => sluice::runtime::clock::init()
            .map_err(anyhow::Error::from)
            .and_then(|_| cli::explain_rls(&config, &domain, &descriptors, hits))
            .map(|text| print!("{text}")),
        Command::Run { config } => run(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: &std::path::Path) -> anyhow::Result<()> {
    let loaded = version::load(config, ListenerFiles::Read)?;
    // The file names the log format, so it is read before anything is logged.
    let flusher = sluice::log::init(loaded.source.config.log_format.into())
        .context("cannot start the log writer")?;
    if let Some(start) = sluice::runtime::clock::init()? {
        tracing::warn!(
            target: "sluice::runtime::clock",
            %start,
            "{} is set: the wall clock calendar quotas count by was started at {start} (for \
             tests only)",
            sluice::runtime::clock::START_ENV
        );
    }
    let served = app::worker_runtime()
        .and_then(|runtime| runtime.block_on(app::serve(config, loaded)))
        .map_err(anyhow::Error::from);
    // Whatever standard error's reader does, the exit waits for it this long at most.
    flusher.flush(sluice::log::FLUSH_TIMEOUT);
    served
}
