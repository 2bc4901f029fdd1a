//! sluice: a rate-limiting reverse proxy. One request's path through the modules:
//!
//! `server` (accept, TLS from `tls`, HTTP/1.1 and HTTP/2, connection limits, `activity` for
//! idle timeouts) → `proxy` (the request phases:
//! `path` canonicalization and head limits, `one_request` (one reading of the request for
//! the router, the limiter and the upstream), routing on the `policy`, `keys` for each limit,
//! the `limiter` decision, then a `response` of 429 or a forward to the upstream) — with
//! `metrics` observing each step and `admin` serving them, `log` writing lines that never block a
//! request, with the admin API (one identity's
//! quota, the policy in force, reload on request). `config` reads the policy file;
//! `reload` watches it and swaps in each valid new policy whole.
//!
//! The binary (`main.rs`) is the command line around this library; the library exists so
//! that benchmarks can measure its parts.

pub mod activity;
pub mod admin;
pub mod body;
pub mod config;
pub mod explain;
pub mod keys;
pub mod limiter;
pub mod log;
pub mod metrics;
pub mod one_request;
pub mod path;
pub mod plan;
pub mod policy;
pub mod proxy;
pub mod ratelimit_field;
pub mod reload;
pub mod response;
pub mod server;
pub mod tls;
