//! The registry of upstream clients: one pooled client per upstream, kept across reloads so
//! that a reload which leaves an upstream unchanged keeps its warm keep-alive connections.
//! The policy names upstreams by plain settings; the registry turns them into clients.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Authority;
use prometheus::IntCounterVec;

use super::forward::UpstreamClient;
use crate::config::Name;
use crate::policy::Policy;

/// What a client is built from: a change in any of these needs a new client (and pool).
/// The response `timeout` and the base path are applied per request, so they are not here.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    name: Name,
    authority: Authority,
    connect_timeout: Duration,
    /// The fingerprint of the TLS settings and files of an https upstream.
    tls: Option<[u8; 32]>,
    http2: bool,
}

/// Clients by upstream settings, for the life of the process.
pub struct Upstreams {
    /// `sluice_upstream_errors_total`, for the clients built later.
    errors: IntCounterVec,
    clients: Mutex<HashMap<ClientKey, Arc<UpstreamClient>>>,
}

/// The client of each upstream a policy forwards to, by upstream name.
pub type Clients = HashMap<Name, Arc<UpstreamClient>>;

impl Upstreams {
    pub fn new(errors: IntCounterVec) -> Upstreams {
        Upstreams {
            errors,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// The clients for `policy`: the registry's own where the settings are unchanged, new
    /// ones otherwise. Clients no longer named are dropped from the registry (requests in
    /// flight on them keep them alive until they finish).
    pub fn clients_for(&self, policy: &Policy) -> Clients {
        // A poisoned lock only means a panic elsewhere while it was held; the map is still
        // a valid cache of clients.
        let mut registry = self
            .clients
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut clients = Clients::new();
        let mut used = Vec::new();
        for upstream in policy.upstreams() {
            let key = ClientKey {
                name: upstream.name.clone(),
                authority: upstream.authority.clone(),
                connect_timeout: upstream.connect_timeout,
                tls: upstream.tls.as_ref().map(|tls| tls.fingerprint),
                http2: upstream.http2,
            };
            let client = registry.entry(key.clone()).or_insert_with(|| {
                Arc::new(UpstreamClient::new(
                    &upstream.authority,
                    upstream.connect_timeout,
                    upstream.tls.as_deref(),
                    upstream.name.as_str(),
                    &self.errors,
                    upstream.http2,
                ))
            });
            clients.insert(upstream.name.clone(), Arc::clone(client));
            used.push(key);
        }
        registry.retain(|key, _| used.contains(key));
        clients
    }
}
