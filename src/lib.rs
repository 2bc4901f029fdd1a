//! sluice: a rate-limiting reverse proxy. One request's path through the modules:
//!
//! `server` (accept, TLS from `tls`, HTTP/1.1 and HTTP/2, connection limits, `activity` for
//! idle timeouts) → `proxy`, the request's phases: `head` (head limits, the canonical `path`,
//! `one_request`: one reading of the request for the router, the limiter and the upstream) →
//! `route` (on the `policy`) → `plan` (the client address and the `keys` of each limit) →
//! on a token route, the body read whole and planned again with its `model` → `decide` (the
//! `limiter`, one store call) → `hold` → forward to the upstream or answer directly →
//! `settle` (a token budget's reservation, bounded and settled by `llm`) → `finish`, the one
//! place an answer is completed (`response` spells sluice's own answers, `body` carries
//! them). `metrics` observe each step and `admin` serves
//! them with the admin API; `log` writes lines that never block a request. `config` reads
//! the policy file; `app` loads one version of it (for `run`, `check`, a reload and
//! `explain` alike) and wires the running process; `reload` watches it (`file_watch`, shared
//! with the listener certificate's rotation) and swaps in each valid new policy whole.
//!
//! The binary (`main.rs`) is the command line around this library; the library exists so
//! that benchmarks can measure its parts.

pub mod activity;
pub mod admin;
pub mod app;
pub mod body;
pub mod clock;
pub mod config;
pub mod explain;
pub mod file_watch;
pub mod identity;
pub mod keys;
pub mod limiter;
pub mod llm;
pub mod log;
pub mod metrics;
pub mod model;
pub mod one_request;
pub mod path;
pub mod plan;
pub mod policy;
pub mod proxy;
pub mod ratelimit_field;
pub mod reload;
pub mod response;
pub mod rls;
pub mod server;
pub mod tls;
pub mod worker;
