//! sluice: a rate-limiting reverse proxy. The modules, from a connection to the store:
//!
//! - `server` accepts connections (TLS from `tls`, HTTP/1.1 and HTTP/2, connection limits)
//!   and hands each request to the gateway, `proxy`.
//! - `request` reads the request and plans it, a pure function of the policy, the head and
//!   the time: head, route, identify (`jwt`), plan, each limit's check under its store key.
//!   The phase order is stated once, in [`request`]'s docs. `sluice explain` (`cli`) and
//!   the admin API (`admin`) read requests and keys there too.
//! - `proxy` acts on the plan: a token budget's body (`llm`), the decision (the `limiter`,
//!   one store call), a hold, the act (its upstream side in `proxy::upstream`), the give-back
//!   that counts by outcome, the token settlement, and `finish`, the one place an answer is
//!   completed (`response` spells sluice's own answers, `body` carries them).
//! - `policy` is the compiled policy the phases read; `config` reads the policy file.
//! - `metrics` observe each step and `admin` serves them with the admin API (and `health`'s
//!   probe, which the rate limit service, `rls`, serves over gRPC too); `log` writes
//!   lines that never block a request.
//! - `version` loads one version of the policy (for `run`, `check`, a reload and `explain`
//!   alike); `app` wires the running process from it and `cli` holds the other commands;
//!   `reload` watches the file and swaps in each valid new policy whole; `runtime` holds the process helpers every layer may use (the clock, file
//!   watching, activity stamps, background workers).
//!
//! The binary (`main.rs`) is the command line around this library; the library exists so
//! that benchmarks (`microbench/`) and the in-process tests can reach its parts.

pub mod admin;
pub mod app;
pub mod body;
pub mod cli;
pub mod config;
pub mod health;
pub mod jwt;
pub mod limiter;
pub mod llm;
pub mod log;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod path;
pub mod policy;
pub mod proxy;
pub mod ratelimit_field;
pub mod reload;
pub mod request;
pub mod response;
pub mod rls;
pub mod runtime;
pub mod server;
pub mod tls;
pub mod version;
