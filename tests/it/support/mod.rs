//! Test harness for sluice's integration tests, by concern:
//! - [`redis_server`]: a real standalone `redis-server` child process, commands to it,
//!   `MONITOR`, and the store (Redis or in-process) a limit test runs against;
//! - [`sentinel`] and [`cluster`]: Redis Sentinel and Redis Cluster setups of real processes;
//!   [`netns`]: a Redis across a real network link (its own namespace) that can be cut;
//! - [`upstream`]: the fake HTTP backend (in-process hyper on 127.0.0.1); [`in_flight_upstream`]:
//!   one that records how many requests of each key it serves at once;
//! - [`policy`]: a typed builder for the policy files tests run sluice with, written out as
//!   YAML; a built policy tells the harness whether it uses Redis;
//! - [`sluice_process`]: the `sluice` binary itself, spawned as a child process with a YAML
//!   config written to a temporary file, with the store guard its `Drop` runs;
//! - [`metrics`] and [`ratelimit_fields`]: parsing what sluice answers;
//! - [`wire`], [`grpc`], [`websocket`], [`certs`]: raw HTTP/1.1, gRPC over h2c, WebSocket and
//!   TLS certificates, for the tests of those protocols;
//! - here: free ports, HTTP clients, polling, and the lock the heavy tests hold.
//!
//! Everything is real: nothing here mocks Redis, an upstream or sluice. Each test uses only
//! the parts it needs, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod certs;
pub mod cluster;
pub mod envoy;
pub mod grpc;
pub mod in_flight_upstream;
pub mod llm_upstream;
pub mod metrics;
pub mod netns;
pub mod policy;
pub mod ratelimit_fields;
pub mod redis_server;
pub mod sentinel;
pub mod sluice_process;
pub mod upstream;
pub mod websocket;
pub mod wire;

pub use cluster::*;
pub use llm_upstream::{chat_body, LlmUpstream};
pub use metrics::*;
pub use policy::{Jwt, Limit, Node, OnStoreError, Policy, Route, UpstreamSpec};
pub use ratelimit_fields::*;
pub use redis_server::*;
pub use sentinel::*;
pub use sluice_process::*;
pub use upstream::*;
pub use wire::{raw_http, RawResponse};

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Pick a free loopback TCP port (bind to :0, read the port, drop the socket).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// A port on which nothing listens (bound once, then released).
pub fn closed_port() -> u16 {
    free_port()
}

/// A reqwest client for talking to loopback servers: never goes through a
/// proxy from the environment, generous timeout.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build()
        .expect("build reqwest client")
}

/// Like [`client`], but every connection leaves from `ip` (any 127.x.y.z
/// works on Linux loopback), so sluice sees that client address.
pub fn client_from(ip: &str) -> reqwest::Client {
    let ip: std::net::IpAddr = ip.parse().expect("IP address");
    reqwest::Client::builder()
        .no_proxy()
        .local_address(ip)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("build reqwest client")
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Polls `ready` every 100 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_for<F, Fut>(limit: Duration, what: &str, mut ready: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !ready().await {
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Header value as &str, panicking with a clear message if absent.
pub fn header<'a>(resp: &'a reqwest::Response, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| {
            panic!(
                "response {} lacks header {name}; headers: {:?}",
                resp.status(),
                resp.headers()
            )
        })
        .to_str()
        .unwrap()
}

/// Held, for its whole run, by each test that loads the machine (a flood from many clients,
/// hundreds of connections, a 50 MB transfer) or whose assertions are time bounds that a
/// flood next to it could break: no two of them run at once. Each test file used to be its
/// own binary, run one after another; now every test shares one process and cargo's test
/// threads, and this keeps the heavy ones from meeting.
///
/// Take it first, so that it is released last (after the test's sluice, Redis and upstreams
/// are stopped): `let _heavy = support::heavy().await;`. A test that panics releases it too.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    HEAVY.lock().await
}
