//! A typed builder for the policy files the tests run sluice with, written out as YAML so the
//! binary still reads a real file the way it reads an operator's:
//!
//! ```ignore
//! let policy = Policy::new()
//!     .store_redis(&redis)
//!     .upstream("api", UpstreamSpec::new(&up.url()).timeout("10s"))
//!     .route(
//!         Route::new("default", "/api")
//!             .upstream("api")
//!             .limit(Limit::requests("per-key", 2, "1m").key(["header:x-api-key"])),
//!     );
//! let sluice = Sluice::start(&policy).await;
//! ```
//!
//! The builder knows which store it names, so the harness's end-of-test guard (did Redis
//! decide every request?) reads that from [`Policy::uses_redis`] instead of scanning text.
//! The fields the tests use often have their own methods; any other field of the policy file
//! is written with `.set(field, value)`, so a test never needs a raw YAML string to reach
//! one. Tests about YAML itself (`check_cli`, `schema`, config errors) keep raw strings.

use std::fmt::Write as _;

use super::{Redis, RedisCluster, Store};

/// One value of the policy file: a scalar, a list or a map whose fields keep their order.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Seq(Vec<Node>),
    Map(Vec<(String, Node)>),
}

impl Node {
    /// A map with these fields, in this order.
    pub fn map<K: Into<String>, V: Into<Node>>(fields: impl IntoIterator<Item = (K, V)>) -> Node {
        Node::Map(
            fields
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }

    fn is_scalar(&self) -> bool {
        !matches!(self, Node::Seq(_) | Node::Map(_))
    }

    /// A scalar as YAML: strings double-quoted (JSON's escapes are YAML's), so no value is
    /// ever read as another type (`on`, `1m`, `0x1`).
    fn scalar(&self) -> String {
        match self {
            Node::Str(s) => serde_json::to_string(s).expect("a string serialises"),
            Node::Int(n) => n.to_string(),
            Node::Float(x) => format!("{x:?}"),
            Node::Bool(b) => b.to_string(),
            Node::Seq(_) | Node::Map(_) => unreachable!("not a scalar"),
        }
    }

    /// Flow style (`[a, b]`, `{ k: v }`), for lists of scalars and inside them.
    fn flow(&self) -> String {
        match self {
            Node::Seq(items) => format!(
                "[{}]",
                items.iter().map(Node::flow).collect::<Vec<_>>().join(", ")
            ),
            Node::Map(fields) => format!(
                "{{ {} }}",
                fields
                    .iter()
                    .map(|(k, v)| format!("{k}: {}", v.flow()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            scalar => scalar.scalar(),
        }
    }
}

impl From<&str> for Node {
    fn from(s: &str) -> Node {
        Node::Str(s.to_owned())
    }
}
impl From<String> for Node {
    fn from(s: String) -> Node {
        Node::Str(s)
    }
}
impl From<&String> for Node {
    fn from(s: &String) -> Node {
        Node::Str(s.clone())
    }
}
impl From<u32> for Node {
    fn from(n: u32) -> Node {
        Node::Int(n.into())
    }
}
impl From<u64> for Node {
    fn from(n: u64) -> Node {
        Node::Int(i64::try_from(n).expect("fits an i64"))
    }
}
impl From<i64> for Node {
    fn from(n: i64) -> Node {
        Node::Int(n)
    }
}
impl From<i32> for Node {
    fn from(n: i32) -> Node {
        Node::Int(n.into())
    }
}
impl From<u16> for Node {
    fn from(n: u16) -> Node {
        Node::Int(n.into())
    }
}
impl From<f64> for Node {
    fn from(x: f64) -> Node {
        Node::Float(x)
    }
}
impl From<bool> for Node {
    fn from(b: bool) -> Node {
        Node::Bool(b)
    }
}
impl<T: Into<Node>> From<Vec<T>> for Node {
    fn from(items: Vec<T>) -> Node {
        Node::Seq(items.into_iter().map(Into::into).collect())
    }
}
impl<T: Into<Node>, const N: usize> From<[T; N]> for Node {
    fn from(items: [T; N]) -> Node {
        Node::Seq(items.into_iter().map(Into::into).collect())
    }
}

/// Writes `fields` as a block map at `indent`; the first line's indent is already written
/// when `inline_first` (the map is a list item, after its `- `).
fn write_map(out: &mut String, fields: &[(String, Node)], indent: usize, inline_first: bool) {
    for (i, (key, value)) in fields.iter().enumerate() {
        if i > 0 || !inline_first {
            out.push_str(&" ".repeat(indent));
        }
        out.push_str(key);
        out.push(':');
        write_value(out, value, indent);
    }
}

/// Writes what follows `key:` for a field at `indent`.
fn write_value(out: &mut String, value: &Node, indent: usize) {
    match value {
        Node::Map(fields) if fields.is_empty() => out.push_str(" {}\n"),
        Node::Seq(items) if items.iter().all(Node::is_scalar) => {
            let _ = writeln!(out, " {}", value.flow());
        }
        Node::Map(fields) => {
            out.push('\n');
            write_map(out, fields, indent + 2, false);
        }
        Node::Seq(items) => {
            out.push('\n');
            for item in items {
                out.push_str(&" ".repeat(indent + 2));
                out.push_str("- ");
                match item {
                    Node::Map(fields) if !fields.is_empty() => {
                        write_map(out, fields, indent + 4, true)
                    }
                    other => {
                        let _ = writeln!(out, "{}", other.flow());
                    }
                }
            }
        }
        scalar => {
            let _ = writeln!(out, " {}", scalar.scalar());
        }
    }
}

/// Sets `key` in an ordered field list, replacing an earlier value.
fn put(fields: &mut Vec<(String, Node)>, key: &str, value: Node) {
    match fields.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => fields.push((key.to_owned(), value)),
    }
}

/// Which store a policy names; the harness's Redis guard follows from it.
#[derive(Clone, Debug)]
enum StoreChoice {
    /// No `store:` section: the in-process store.
    Memory,
    /// A Redis store (standalone, Sentinel or Cluster), written as this `store:` map.
    Redis(Vec<(String, Node)>),
}

/// What a route does when the store cannot decide.
#[derive(Clone, Copy, Debug)]
pub enum OnStoreError {
    Local,
    Allow,
    Deny,
}

impl OnStoreError {
    fn word(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::Allow => "allow",
            OnStoreError::Deny => "deny",
        }
    }
}

/// A whole policy file but for `listen` and `admin_listen`, which the harness picks.
#[derive(Clone, Debug)]
pub struct Policy {
    store: StoreChoice,
    /// `store:` fields besides `redis:` (`on_store_error`, `key_prefix`, `local`).
    store_extra: Vec<(String, Node)>,
    /// Top-level fields other than `store`, `upstreams` and `routes`, in order.
    fields: Vec<(String, Node)>,
    server: Vec<(String, Node)>,
    upstreams: Vec<(String, Node)>,
    routes: Vec<Route>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::new()
    }
}

impl Policy {
    /// No store section (the in-process store), no upstreams, no routes.
    pub fn new() -> Policy {
        Policy {
            store: StoreChoice::Memory,
            store_extra: Vec::new(),
            fields: Vec::new(),
            server: Vec::new(),
            upstreams: Vec::new(),
            routes: Vec::new(),
        }
    }

    /// The harness's standalone Redis store: `redis`'s URL, a generous timeout
    /// ([`super::REDIS_TIMEOUT`]), a pool
    /// of 8 and the `sluice-test` key prefix (as [`super::redis_store_yaml`]).
    pub fn store_redis(self, redis: &Redis) -> Policy {
        self.store_redis_url(&redis.url())
    }

    /// As [`Policy::store_redis`], for a Redis at `url`.
    pub fn store_redis_url(mut self, url: &str) -> Policy {
        self.store = StoreChoice::Redis(vec![
            ("url".into(), url.into()),
            (
                "timeout".into(),
                format!("{}ms", super::REDIS_TIMEOUT.as_millis()).into(),
            ),
            ("pool_size".into(), 8u32.into()),
        ]);
        self.store_extra = vec![("key_prefix".into(), "sluice-test".into())];
        self
    }

    /// `redis` as the store with only its URL: every other setting at sluice's default.
    pub fn store_redis_defaults(mut self, redis: &Redis) -> Policy {
        self.store = StoreChoice::Redis(vec![("url".into(), redis.url().into())]);
        self.store_extra = Vec::new();
        self
    }

    /// A Redis at `url` with only its URL: every other setting (timeout, pool, key prefix)
    /// at sluice's default.
    pub fn store_redis_url_defaults(mut self, url: &str) -> Policy {
        self.store = StoreChoice::Redis(vec![("url".into(), url.into())]);
        self.store_extra = Vec::new();
        self
    }

    /// A Redis Cluster at these seed nodes (`host:port`), nothing else set; more fields of
    /// `store.redis.cluster` with [`Policy::cluster_setting`].
    pub fn store_cluster_nodes(mut self, nodes: &[String]) -> Policy {
        self.store = StoreChoice::Redis(vec![(
            "cluster".into(),
            Node::map([("nodes", Node::from(nodes.to_vec()))]),
        )]);
        self.store_extra = Vec::new();
        self
    }

    /// Another field of `store.redis.cluster` (`username`, `password`).
    pub fn cluster_setting(mut self, key: &str, value: impl Into<Node>) -> Policy {
        let cluster = match &mut self.store {
            StoreChoice::Redis(fields) => fields.iter_mut().find(|(k, _)| k == "cluster"),
            StoreChoice::Memory => None,
        };
        match cluster {
            Some((_, Node::Map(fields))) => put(fields, key, value.into()),
            _ => panic!("cluster_setting({key}) on a policy without a Cluster store"),
        }
        self
    }

    /// The store a limit test was started with ([`Store::start`]): Redis or in-process.
    pub fn store(self, store: &Store) -> Policy {
        match &store.redis {
            Some(redis) => self.store_redis(redis),
            None => self,
        }
    }

    /// The harness's Redis Cluster as the store (as [`RedisCluster::store_yaml`]).
    pub fn store_cluster(mut self, cluster: &RedisCluster) -> Policy {
        let nodes: Vec<Node> = cluster
            .addrs()
            .iter()
            .map(|a| Node::Str(a.to_string()))
            .collect();
        self.store = StoreChoice::Redis(vec![
            ("cluster".into(), Node::map([("nodes", Node::Seq(nodes))])),
            ("timeout".into(), "1s".into()),
        ]);
        self.store_extra = vec![("key_prefix".into(), "sluice-test".into())];
        self
    }

    /// A Redis Sentinel store: the master's name and the Sentinel nodes (`host:port`).
    pub fn store_sentinel(mut self, master_name: &str, nodes: &[String]) -> Policy {
        self.store = StoreChoice::Redis(vec![(
            "sentinel".into(),
            Node::map([
                ("master_name", Node::from(master_name)),
                ("nodes", Node::from(nodes.to_vec())),
            ]),
        )]);
        self.store_extra = vec![("key_prefix".into(), "sluice-test".into())];
        self
    }

    /// Another field of `store.redis.sentinel` (`password`, `sentinel_password`).
    pub fn sentinel_setting(mut self, key: &str, value: impl Into<Node>) -> Policy {
        let sentinel = match &mut self.store {
            StoreChoice::Redis(fields) => fields.iter_mut().find(|(k, _)| k == "sentinel"),
            StoreChoice::Memory => None,
        };
        match sentinel {
            Some((_, Node::Map(fields))) => put(fields, key, value.into()),
            _ => panic!("sentinel_setting({key}) on a policy without a Sentinel store"),
        }
        self
    }

    /// Another field of `store.redis` (`timeout`, `pool_size`): a Redis store only.
    pub fn redis_setting(mut self, key: &str, value: impl Into<Node>) -> Policy {
        match &mut self.store {
            StoreChoice::Redis(fields) => put(fields, key, value.into()),
            StoreChoice::Memory => panic!("redis_setting({key}) on a policy without Redis"),
        }
        self
    }

    /// A field of `store:` beside `redis:` (`on_store_error`, `key_prefix`, `local`).
    pub fn store_setting(mut self, key: &str, value: impl Into<Node>) -> Policy {
        put(&mut self.store_extra, key, value.into());
        self
    }

    /// `store.on_store_error`, the default of every route.
    pub fn on_store_error(self, action: OnStoreError) -> Policy {
        self.store_setting("on_store_error", action.word())
    }

    /// A field of `server:` (`workers`, `max_connections`, `body_timeout`, ...).
    pub fn server(mut self, key: &str, value: impl Into<Node>) -> Policy {
        put(&mut self.server, key, value.into());
        self
    }

    /// `admin.token_env`: the admin API asks for the bearer token held in this environment
    /// variable.
    pub fn admin_token_env(self, variable: &str) -> Policy {
        self.admin_setting("token_env", variable)
    }

    /// `admin.api`: whether the admin API is served at all (default: on).
    pub fn admin_api(self, on: bool) -> Policy {
        self.admin_setting("api", on)
    }

    /// A field of `admin:`, kept beside the others already set.
    fn admin_setting(mut self, key: &str, value: impl Into<Node>) -> Policy {
        match self.fields.iter_mut().find(|(k, _)| k == "admin") {
            Some((_, Node::Map(admin))) => put(admin, key, value.into()),
            _ => put(
                &mut self.fields,
                "admin",
                Node::Map(vec![(key.to_owned(), value.into())]),
            ),
        }
        self
    }

    /// `tls:`: the listener serves HTTPS with this certificate chain and key (PEM files).
    pub fn tls(self, cert: &std::path::Path, key: &std::path::Path) -> Policy {
        self.set(
            "tls",
            Node::map([
                ("cert", cert.display().to_string()),
                ("key", key.display().to_string()),
            ]),
        )
    }

    /// `tls:` with `client_ca` (mutual TLS): clients must present a certificate of that CA.
    pub fn mtls(
        self,
        cert: &std::path::Path,
        key: &std::path::Path,
        client_ca: &std::path::Path,
    ) -> Policy {
        self.set(
            "tls",
            Node::map([
                ("cert", cert.display().to_string()),
                ("key", key.display().to_string()),
                ("client_ca", client_ca.display().to_string()),
            ]),
        )
    }

    /// One JWT verifier of `jwt:`, after those already added.
    pub fn jwt(mut self, verifier: Jwt) -> Policy {
        match self.fields.iter_mut().find(|(k, _)| k == "jwt") {
            Some((_, Node::Seq(verifiers))) => verifiers.push(Node::Map(verifier.0)),
            _ => put(
                &mut self.fields,
                "jwt",
                Node::Seq(vec![Node::Map(verifier.0)]),
            ),
        }
        self
    }

    /// An upstream named `name`: a URL, or an [`UpstreamSpec`] with its settings.
    pub fn upstream(mut self, name: &str, upstream: impl Into<UpstreamSpec>) -> Policy {
        put(&mut self.upstreams, name, Node::Map(upstream.into().0));
        self
    }

    /// A route, after those already added (the first matching route wins).
    pub fn route(mut self, route: Route) -> Policy {
        self.routes.push(route);
        self
    }

    /// Any other top-level field (`trusted_proxies`, `response_headers`, `jwt`, `models`).
    pub fn set(mut self, key: &str, value: impl Into<Node>) -> Policy {
        put(&mut self.fields, key, value.into());
        self
    }

    /// Whether the policy's store is Redis: the harness then checks, when the test ends,
    /// that Redis decided every request.
    pub fn uses_redis(&self) -> bool {
        matches!(self.store, StoreChoice::Redis(_))
    }

    /// The policy file, without `listen` and `admin_listen`.
    pub fn to_yaml(&self) -> String {
        let mut top: Vec<(String, Node)> = Vec::new();
        let mut store = Vec::new();
        if let StoreChoice::Redis(redis) = &self.store {
            store.push(("redis".to_owned(), Node::Map(redis.clone())));
        }
        store.extend(self.store_extra.iter().cloned());
        if !store.is_empty() {
            top.push(("store".into(), Node::Map(store)));
        }
        if !self.server.is_empty() {
            top.push(("server".into(), Node::Map(self.server.clone())));
        }
        top.extend(self.fields.iter().cloned());
        if !self.upstreams.is_empty() {
            top.push(("upstreams".into(), Node::Map(self.upstreams.clone())));
        }
        top.push((
            "routes".into(),
            Node::Seq(self.routes.iter().map(Route::node).collect()),
        ));
        let mut out = String::new();
        write_map(&mut out, &top, 0, false);
        out
    }
}

/// One upstream: its URL and settings.
#[derive(Clone, Debug)]
pub struct UpstreamSpec(Vec<(String, Node)>);

impl UpstreamSpec {
    pub fn new(url: &str) -> UpstreamSpec {
        UpstreamSpec(vec![("url".into(), url.into())])
    }

    pub fn connect_timeout(self, duration: &str) -> UpstreamSpec {
        self.set("connect_timeout", duration)
    }

    pub fn timeout(self, duration: &str) -> UpstreamSpec {
        self.set("timeout", duration)
    }

    /// Speak HTTP/2 (prior knowledge) to it, as gRPC needs.
    pub fn http2(self) -> UpstreamSpec {
        self.set("http2", true)
    }

    /// Trust an https upstream through this CA bundle (PEM) instead of the system roots.
    pub fn ca_file(self, path: &std::path::Path) -> UpstreamSpec {
        self.set("ca_file", path.display().to_string())
    }

    /// Present this client certificate and key (PEM files) to an https upstream (mTLS).
    pub fn client_cert(self, cert: &std::path::Path, key: &std::path::Path) -> UpstreamSpec {
        self.set("client_cert", cert.display().to_string())
            .set("client_key", key.display().to_string())
    }

    /// Any other field of the upstream.
    pub fn set(mut self, key: &str, value: impl Into<Node>) -> UpstreamSpec {
        put(&mut self.0, key, value.into());
        self
    }
}

impl From<&str> for UpstreamSpec {
    fn from(url: &str) -> UpstreamSpec {
        UpstreamSpec::new(url)
    }
}

impl From<String> for UpstreamSpec {
    fn from(url: String) -> UpstreamSpec {
        UpstreamSpec::new(&url)
    }
}

/// One JWT verifier of `jwt:`: its name, the issuer and audiences it accepts and where its
/// keys come from.
#[derive(Clone, Debug)]
pub struct Jwt(Vec<(String, Node)>);

impl Jwt {
    /// A verifier named `name` accepting tokens from `issuer` for any of `audiences`.
    pub fn new<const N: usize>(name: &str, issuer: &str, audiences: [&str; N]) -> Jwt {
        Jwt(vec![
            ("name".into(), name.into()),
            ("issuer".into(), issuer.into()),
            ("audiences".into(), audiences.into()),
        ])
    }

    /// Keys from a JWKS file (re-read when it changes).
    pub fn jwks_file(self, path: &std::path::Path) -> Jwt {
        self.set("jwks_file", path.display().to_string())
    }

    /// Keys fetched from a JWKS URL, trusted through `ca_file` when given.
    pub fn jwks_url(self, url: &str, ca_file: Option<&std::path::Path>) -> Jwt {
        let with_url = self.set("jwks_url", url);
        match ca_file {
            Some(ca) => with_url.set("jwks_ca_file", ca.display().to_string()),
            None => with_url,
        }
    }

    /// How far a token's `exp` and `nbf` may be off (a duration: `5s`).
    pub fn clock_skew(self, skew: &str) -> Jwt {
        self.set("clock_skew", skew)
    }

    /// One key of `keys:` (`{ secret_file, algorithm, kid }`, `{ pem_file, ... }`), after
    /// those already added.
    pub fn key(mut self, key: Node) -> Jwt {
        match self.0.iter_mut().find(|(k, _)| k == "keys") {
            Some((_, Node::Seq(keys))) => keys.push(key),
            _ => put(&mut self.0, "keys", Node::Seq(vec![key])),
        }
        self
    }

    /// Any other field of the verifier (`fetch_timeout`, `min_refresh`, ...).
    pub fn set(mut self, key: &str, value: impl Into<Node>) -> Jwt {
        put(&mut self.0, key, value.into());
        self
    }
}

/// One route: its name, what it matches, what it does and its limits.
#[derive(Clone, Debug)]
pub struct Route {
    fields: Vec<(String, Node)>,
    matcher: Vec<(String, Node)>,
    limits: Vec<Limit>,
}

impl Route {
    /// A route named `name` matching paths under `path_prefix`.
    pub fn new(name: &str, path_prefix: &str) -> Route {
        Route {
            fields: vec![("name".into(), name.into())],
            matcher: vec![("path_prefix".into(), path_prefix.into())],
            limits: Vec::new(),
        }
    }

    /// Only these methods.
    pub fn methods<const N: usize>(mut self, methods: [&str; N]) -> Route {
        put(&mut self.matcher, "methods", methods.into());
        self
    }

    /// Forward to the upstream named `name`.
    pub fn upstream(self, name: &str) -> Route {
        self.set("upstream", name)
    }

    /// Answer directly with this status and body.
    pub fn respond(self, status: u16, body: &str) -> Route {
        self.set(
            "respond",
            Node::map([("status", Node::from(status)), ("body", Node::from(body))]),
        )
    }

    /// Answer directly with this status and an empty body.
    pub fn respond_status(self, status: u16) -> Route {
        self.set("respond", Node::map([("status", status)]))
    }

    /// Verify the bearer token with the verifier named `verifier`; a request whose token is
    /// invalid is refused (401), or counted as anonymous when `anonymous_when_invalid`.
    pub fn jwt(self, verifier: &str, anonymous_when_invalid: bool) -> Route {
        let mut jwt = vec![("verifier".to_owned(), Node::from(verifier))];
        if anonymous_when_invalid {
            jwt.push(("on_invalid".into(), "anonymous".into()));
        }
        self.set("jwt", Node::Map(jwt))
    }

    /// Another field of `match:` (`host`, `case_sensitive`, `headers`, ...).
    pub fn matching(mut self, key: &str, value: impl Into<Node>) -> Route {
        put(&mut self.matcher, key, value.into());
        self
    }

    pub fn on_store_error(self, action: OnStoreError) -> Route {
        self.set("on_store_error", action.word())
    }

    pub fn max_body(self, size: &str) -> Route {
        self.set("max_body", size)
    }

    /// A limit, after those already added.
    pub fn limit(mut self, limit: Limit) -> Route {
        self.limits.push(limit);
        self
    }

    /// Any other field of the route (`body_timeout`, `max_delayed`, `jwt`, ...).
    pub fn set(mut self, key: &str, value: impl Into<Node>) -> Route {
        put(&mut self.fields, key, value.into());
        self
    }

    fn node(&self) -> Node {
        let mut fields = vec![self.fields[0].clone()];
        fields.push(("match".into(), Node::Map(self.matcher.clone())));
        fields.extend(self.fields[1..].iter().cloned());
        if !self.limits.is_empty() {
            fields.push((
                "limits".into(),
                Node::Seq(self.limits.iter().map(|l| Node::Map(l.0.clone())).collect()),
            ));
        }
        Node::Map(fields)
    }
}

/// One limit of a route. Its key is `[client_ip]` until [`Limit::key`] says otherwise.
#[derive(Clone, Debug)]
pub struct Limit(Vec<(String, Node)>);

impl Limit {
    /// `requests` per sliding `window` (the default algorithm, `sliding_log`).
    pub fn requests(name: &str, requests: u32, window: &str) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("requests".into(), requests.into()),
            ("window".into(), window.into()),
        ])
    }

    /// A token budget: `tokens` per sliding `window` (counted with `weighted_log`).
    pub fn tokens(name: &str, tokens: u32, window: &str) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("tokens".into(), tokens.into()),
            ("window".into(), window.into()),
        ])
    }

    /// A token budget per calendar `quota` period (`day`, `month`, ...).
    pub fn tokens_quota(name: &str, tokens: u32, period: &str) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("tokens".into(), tokens.into()),
            ("quota".into(), period.into()),
        ])
    }

    /// A money budget: `amount` of `currency` per sliding `window`, priced by `models:`.
    pub fn money(name: &str, amount: f64, currency: &str, window: &str) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("money".into(), amount.into()),
            ("currency".into(), currency.into()),
            ("window".into(), window.into()),
        ])
    }

    /// A concurrency limit: at most `at_once` requests of one key in flight.
    pub fn concurrent(name: &str, at_once: u32) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("concurrent".into(), at_once.into()),
        ])
    }

    /// `requests` per sliding `window`, counted with `sliding_window`.
    pub fn sliding_window(name: &str, requests: u32, window: &str) -> Limit {
        Limit::requests(name, requests, window).algorithm("sliding_window")
    }

    /// `requests` per calendar `quota` period (`day`, `month`, ...).
    pub fn quota(name: &str, requests: u32, period: &str) -> Limit {
        Limit(vec![
            ("name".into(), name.into()),
            ("key".into(), ["client_ip"].into()),
            ("requests".into(), requests.into()),
            ("quota".into(), period.into()),
        ])
    }

    /// The parts of its key (`client_ip`, `header:NAME`, `jwt:CLAIM`, ...); `[]` for one
    /// shared counter.
    pub fn key<const N: usize>(self, parts: [&str; N]) -> Limit {
        self.set("key", parts)
    }

    pub fn algorithm(self, algorithm: &str) -> Limit {
        self.set("algorithm", algorithm)
    }

    pub fn burst(self, burst: u32) -> Limit {
        self.set("burst", burst)
    }

    /// Each request counts `cost` (default 1).
    pub fn cost(self, cost: u32) -> Limit {
        self.set("cost", cost)
    }

    /// A token or money limit reserves at most `tokens` of output per request (its cap, or
    /// the route's when the request names none).
    pub fn reserve_max_output(self, tokens: u32) -> Limit {
        self.set("reserve", Node::map([("max_output", tokens)]))
    }

    /// Applies only to requests meeting every one of these conditions (`{ header: x-plan,
    /// equals: paid }`, `{ jwt: sub, present: false }`, ...).
    pub fn when(self, conditions: Vec<Node>) -> Limit {
        self.set("when", Node::Seq(conditions))
    }

    /// Counted and reported, never refusing.
    pub fn shadow(self) -> Limit {
        self.set("shadow", true)
    }

    /// Count only answers with these statuses or classes (`401`, `5xx`).
    pub fn count_status<T: Into<Node>>(self, statuses: impl IntoIterator<Item = T>) -> Limit {
        let statuses = statuses.into_iter().map(Into::into).collect();
        self.set("count", Node::map([("status", Node::Seq(statuses))]))
    }

    /// Hold an over-limit request up to `max_delay` instead of refusing it.
    pub fn delay(self, max_delay: &str) -> Limit {
        self.set("on_exceed", "delay").set("max_delay", max_delay)
    }

    /// Whether it is an exact log (`sliding_log`, the default, or `weighted_log`): in Redis
    /// its waits and resets are the lateness bound longer than its window
    /// ([`super::Store::lateness`]).
    pub fn is_log(&self) -> bool {
        !self.0.iter().any(|(field, value)| {
            field == "algorithm"
                && !matches!(value, Node::Str(a) if a == "sliding_log" || a == "weighted_log")
        })
    }

    /// Any other field of the limit (`cost`, `shadow`, `when`, `ipv6_prefix`, ...).
    pub fn set(mut self, key: &str, value: impl Into<Node>) -> Limit {
        put(&mut self.0, key, value.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_block_yaml_in_field_order() {
        let yaml = Policy::new()
            .store_redis_url("redis://127.0.0.1:1/0")
            .upstream(
                "api",
                UpstreamSpec::new("http://127.0.0.1:2").timeout("10s"),
            )
            .route(
                Route::new("api", "/api")
                    .methods(["GET"])
                    .upstream("api")
                    .limit(Limit::requests("per-key", 2, "1m").key(["header:x-api-key"])),
            )
            .to_yaml();
        assert_eq!(
            yaml,
            "store:\n  redis:\n    url: \"redis://127.0.0.1:1/0\"\n    timeout: \"500ms\"\n    pool_size: 8\n  key_prefix: \"sluice-test\"\nupstreams:\n  api:\n    url: \"http://127.0.0.1:2\"\n    timeout: \"10s\"\nroutes:\n  - name: \"api\"\n    match:\n      path_prefix: \"/api\"\n      methods: [\"GET\"]\n    upstream: \"api\"\n    limits:\n      - name: \"per-key\"\n        key: [\"header:x-api-key\"]\n        requests: 2\n        window: \"1m\"\n"
        );
    }
}
