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
    /// Ask a running sluice's admin API who uses a limit most (--route, --limit, --top), or
    /// where one identity stands in every limit its key parts name (--part NAME=VALUE ...).
    Usage {
        #[command(flatten)]
        admin: AdminArgs,
        /// The route (with --limit: its top identities; with --part: only this route).
        #[arg(long)]
        route: Option<String>,
        /// The limit whose top identities to list (`report: true` in the policy).
        #[arg(long)]
        limit: Option<String>,
        /// How many identities to list.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// One key part of the identity, `NAME=VALUE` as the admin API names them:
        /// `client_ip=`, `header.NAME=`, `query.NAME=`, `cookie.NAME=`, `jwt.CLAIM=`, `path=`,
        /// `method=`, `host=`, `model=` (repeatable).
        #[arg(long = "part")]
        parts: Vec<String>,
        /// Print the admin API's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Per-identity overrides through a running sluice's admin API.
    Overrides {
        #[command(subcommand)]
        action: OverridesAction,
    },
}

#[derive(Subcommand)]
enum OverridesAction {
    /// Load a file of JSON lines (`{"identity": {...}, "requests": N, "ttl": "30d"}`) as
    /// overrides of one limit: every line is checked first, nothing is written if one is bad.
    Load {
        #[command(flatten)]
        admin: AdminArgs,
        #[arg(long)]
        route: String,
        #[arg(long)]
        limit: String,
        /// Print the admin API's JSON answer.
        #[arg(long)]
        json: bool,
        /// The JSON lines file.
        file: PathBuf,
    },
}

/// Where the admin API of a running sluice is.
#[derive(clap::Args)]
struct AdminArgs {
    /// The admin listener, `http://host:port` (default: `SLUICE_ADMIN`, else
    /// `http://127.0.0.1:9090`).
    #[arg(long)]
    admin: Option<String>,
    /// A file holding the admin token; without it, the token in `SLUICE_ADMIN_TOKEN`.
    #[arg(long)]
    token_file: Option<PathBuf>,
}

impl AdminArgs {
    fn flags(self) -> cli::AdminFlags {
        cli::AdminFlags {
            admin: self
                .admin
                .or_else(|| std::env::var("SLUICE_ADMIN").ok())
                .unwrap_or_else(|| "http://127.0.0.1:9090".to_owned()),
            token_file: self.token_file,
        }
    }
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
        Command::Usage {
            admin,
            route,
            limit,
            top,
            parts,
            json,
        } => {
            let question = cli::UsageQuestion {
                route,
                limit,
                top,
                parts,
                json,
            };
            cli::usage(&admin.flags(), &question).map(|text| print!("{text}"))
        }
        Command::Overrides {
            action:
                OverridesAction::Load {
                    admin,
                    route,
                    limit,
                    json,
                    file,
                },
        } => cli::load_overrides(&admin.flags(), &route, &limit, &file, json)
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
