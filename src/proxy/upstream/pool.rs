//! Upstream connections, one pool per worker thread, each connection driven by the request
//! that uses it.
//!
//! hyper's pooled client (hyper-util's `legacy::Client`) gives every upstream connection a
//! task of its own and hands each request to it through a channel: the request's task sends,
//! the connection's task wakes (often on another thread), writes, reads, and wakes the
//! request's task back. Here there is no second task:
//!
//! - A connection is hyper's low-level pair ([`hyper::client::conn::http1`]): a
//!   `SendRequest` and the `Connection` future that does its reading and writing. The request
//!   takes both out of its worker's pool (or connects), hands the request to `SendRequest`,
//!   and then polls the `Connection` itself, together with the response future, in one
//!   `poll_fn`. The hand-over between the two halves is still hyper's in-memory queue, but
//!   both are polled by the same task on the same thread, so no task is woken to carry it.
//! - The response body ([`UpstreamBody`]) carries the connection on: each poll of the body
//!   polls the `Connection` first (which reads the socket and feeds the body), then the body.
//!   When the body has ended, the `Connection` is polled once more (so hyper notes the
//!   exchange is over and asks for the next request), and the pair goes back to the pool if
//!   it is ready for one. A body dropped before its end drops the connection, which closes.
//! - The pool is a thread-local (`POOLS`): each worker runs a current-thread runtime (see
//!   `server`), so the connections of a worker are registered with its runtime and reused only
//!   by its own requests; there is no lock and nothing shared between cores. Idle connections
//!   are not polled while idle: a pooled connection is polled before it is reused, and one the
//!   upstream has closed meanwhile is dropped and the next one (or a new one) is taken. A
//!   request hyper reports as not sent on a reused connection is sent again on another.
//!   Idle connections expire after [`IDLE_TIMEOUT`]; at most [`MAX_IDLE`] are kept per
//!   upstream and worker; the pools of upstreams no longer in the policy are dropped by the
//!   next sweep (every [`SWEEP_EVERY`], done by whichever request comes).
//! - WebSocket upgrades take a connection too, but it leaves the pool for good: its
//!   `Connection` is spawned as a task with upgrades enabled, which hands the socket over
//!   once the upstream answers `101`.
//! - HTTP/2 upstreams (`http2: true`, h2c or h2 over TLS) multiplex all requests on one
//!   connection per worker, which must be polled for as long as it is open whatever request
//!   is in flight: its `Connection` is a task on the worker's runtime, and requests share a
//!   clone of its `SendRequest`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::{pin, Pin};
use std::sync::{Arc, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HeaderValue, HOST};
use http::uri::Authority;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::error::{error_chain, ForwardError};
use crate::proxy::request_body::RequestBody;
use crate::tls::stream::MaybeTls;
use crate::tls::UpstreamTls;

/// How long an idle upstream connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle connections kept per upstream and worker; past it, a finished one is closed.
pub const MAX_IDLE: usize = 1024;
/// How often a worker drops expired idle connections and the pools of removed upstreams.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// How to reach one upstream: where, within what connect timeout, over TLS or not, speaking
/// HTTP/1.1 or HTTP/2. Its connections live in the pools of the workers, keyed by it.
pub struct Connector {
    host: String,
    port: u16,
    /// `Host` of HTTP/1.1 requests: the authority, without the scheme's default port.
    host_field: HeaderValue,
    connect_timeout: Duration,
    /// The connector and the name the certificate must have; a host that is no TLS name
    /// (which the config's URL check lets through only in theory) fails each connect.
    tls: Option<(TlsConnector, Result<ServerName<'static>, String>)>,
    http2: bool,
}

type Io = TokioIo<UpstreamIo>;
type Http1Connection = http1::Connection<Io, RequestBody>;

/// One HTTP/1.1 connection: the half that sends and the half that reads and writes.
struct Http1 {
    sender: http1::SendRequest<RequestBody>,
    connection: Http1Connection,
    /// When it went back to the pool.
    idle_since: Instant,
}

/// The pools of one worker thread, by connector.
#[derive(Default)]
struct Pools {
    /// Keyed by the connector's address. The entry's `Weak` keeps that address from being
    /// reused by another connector while the entry exists, and says when it was dropped.
    by_connector: HashMap<usize, Pool, BuildHasherDefault<AddressHasher>>,
    swept: Option<Instant>,
}

struct Pool {
    connector: Weak<Connector>,
    /// Boxed once when connected: a connection moves from the pool to a request's body and
    /// back on every request, a pointer's worth instead of hundreds of bytes.
    #[allow(clippy::vec_box)]
    http1: Vec<Box<Http1>>,
    http2: Option<http2::SendRequest<RequestBody>>,
}

/// Hashes the address of a connector: sluice's own allocation, which no client chooses, so
/// SipHash's defence against chosen keys buys nothing on a lookup made twice per request.
/// The multiplication (Fibonacci hashing) spreads the aligned, clustered addresses over the
/// high bits the table probes with.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, address: usize) {
        self.0 = (address as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

thread_local! {
    static POOLS: RefCell<Pools> = RefCell::new(Pools::default());
}

impl Pools {
    /// The pool of `connector`, and the time now: the one clock read of a checkout or a
    /// give-back, shared by the sweep and the caller.
    fn pool(&mut self, connector: &Arc<Connector>) -> (&mut Pool, Instant) {
        let now = Instant::now();
        if self
            .swept
            .is_none_or(|swept| now.duration_since(swept) >= SWEEP_EVERY)
        {
            self.swept = Some(now);
            self.by_connector.retain(|_, pool| {
                pool.http1
                    .retain(|idle| now.duration_since(idle.idle_since) < IDLE_TIMEOUT);
                pool.connector.strong_count() > 0
            });
        }
        let pool = self
            .by_connector
            .entry(Arc::as_ptr(connector) as usize)
            .or_insert_with(|| Pool {
                connector: Arc::downgrade(connector),
                http1: Vec::new(),
                http2: None,
            });
        (pool, now)
    }
}

impl Connector {
    /// `authority`: the upstream's, with the port or without (then the scheme's default).
    /// `tls`: the settings of an https upstream (a failed handshake is a connect error).
    pub fn new(
        authority: &Authority,
        connect_timeout: Duration,
        tls: Option<&UpstreamTls>,
        http2: bool,
    ) -> Connector {
        let default_port = if tls.is_some() { 443 } else { 80 };
        let port = authority.port_u16().unwrap_or(default_port);
        let host = authority.host();
        let with_port = port != default_port;
        // An authority is made of characters a field value allows.
        let host_field = HeaderValue::from_str(if with_port { authority.as_str() } else { host })
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        // `[::1]` in a URI, `::1` to connect and as a TLS name.
        let bare = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tls = tls.map(|tls| {
            let name = ServerName::try_from(bare.clone())
                .map_err(|e| format!("not a TLS server name: {bare}: {e}"));
            let config = crate::tls::upstream::client_config(tls, http2);
            (TlsConnector::from(config), name)
        });
        Connector {
            host: bare,
            port,
            host_field,
            connect_timeout,
            tls,
            http2,
        }
    }

    /// Sends `request` (its URI absolute) and returns the response with a body that brings
    /// the connection back to this worker's pool when it ends. `upgrade`: a WebSocket
    /// upgrade, whose connection never returns to the pool.
    pub async fn send(
        self: &Arc<Self>,
        mut request: Request<RequestBody>,
        upgrade: bool,
    ) -> Result<Response<UpstreamBody>, ForwardError> {
        // Boxed, as are the rarer steps below (a new connection, an upgrade): a future holds
        // room for its largest step, and this one is moved several times per request.
        if self.http2 {
            return Box::pin(self.send_http2(request)).await;
        }
        // HTTP/1.1 asks for the origin form, with the authority in `Host`.
        let origin = request
            .uri()
            .path_and_query()
            .cloned()
            .map_or_else(|| Uri::from_static("/"), Uri::from);
        *request.uri_mut() = origin;
        request.headers_mut().insert(HOST, self.host_field.clone());
        loop {
            let (mut conn, reused) = match self.checkout() {
                Some(conn) => (conn, true),
                None => (Box::pin(self.connect_http1()).await?, false),
            };
            // A pooled connection may have been closed by the upstream while it was idle:
            // polling it finds out (it ends) before a request is given to it.
            let ready = poll_fn(|cx| {
                if let Poll::Ready(ended) = Pin::new(&mut conn.connection).poll(cx) {
                    return Poll::Ready(Err(ended.err()));
                }
                conn.sender.poll_ready(cx).map_err(Some)
            })
            .await;
            if let Err(err) = ready {
                if reused {
                    continue;
                }
                return Err(match err {
                    Some(err) => hyper_error(&err),
                    None => ForwardError::Other("the upstream closed the connection".to_owned()),
                });
            }
            if upgrade {
                let Http1 {
                    mut sender,
                    connection,
                    ..
                } = *conn;
                tokio::spawn(async move {
                    if let Err(err) = connection.with_upgrades().await {
                        tracing::debug!(error = %err, "an upgraded upstream connection failed");
                    }
                });
                let response = Box::pin(sender.send_request(request))
                    .await
                    .map_err(|e| hyper_error(&e))?;
                return Ok(response.map(UpstreamBody::alone));
            }
            let sent = conn.sender.try_send_request(request);
            match drive(&mut conn.connection, sent).await {
                Ok(response) => {
                    let mut response = response.map(|body| UpstreamBody {
                        inner: body,
                        held: Some(Held {
                            conn,
                            connector: Arc::clone(self),
                        }),
                    });
                    // A body that is over before it starts (HEAD, 204, 304, length 0) may
                    // never be polled: the connection is given back now.
                    if response.body().is_end_stream() {
                        let body = response.body_mut();
                        poll_fn(|cx| {
                            body.release(cx);
                            Poll::Ready(())
                        })
                        .await;
                    }
                    return Ok(response);
                }
                Err(mut err) => match err.take_message() {
                    // Not sent: the connection was closing. Another one gets it.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(hyper_error(err.error())),
                },
            }
        }
    }

    async fn send_http2(
        self: &Arc<Self>,
        request: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, ForwardError> {
        let cached = with_pool(self, |pool, _| pool.http2.clone()).flatten();
        let mut sender = match cached {
            Some(sender) if !sender.is_closed() => sender,
            _ => self.connect_http2().await?,
        };
        if poll_fn(|cx| sender.poll_ready(cx)).await.is_err() {
            sender = self.connect_http2().await?;
            poll_fn(|cx| sender.poll_ready(cx))
                .await
                .map_err(|e| hyper_error(&e))?;
        }
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| hyper_error(&e))?;
        Ok(response.map(UpstreamBody::alone))
    }

    /// A pooled connection of this worker, the most recently used first (its socket is the
    /// likeliest to still be open and warm).
    fn checkout(self: &Arc<Self>) -> Option<Box<Http1>> {
        with_pool(self, |pool, now| {
            while let Some(idle) = pool.http1.pop() {
                if now.saturating_duration_since(idle.idle_since) < IDLE_TIMEOUT {
                    return Some(idle);
                }
            }
            None
        })
        .flatten()
    }

    fn give_back(self: &Arc<Self>, mut conn: Box<Http1>) {
        with_pool(self, |pool, now| {
            conn.idle_since = now;
            if pool.http1.len() < MAX_IDLE {
                pool.http1.push(conn);
            }
        });
    }

    async fn connect(&self) -> Result<Io, ForwardError> {
        let connecting = TcpStream::connect((self.host.as_str(), self.port));
        let tcp = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(err)) => return Err(ForwardError::Connect(format!("tcp connect error: {err}"))),
            Err(_) => {
                return Err(ForwardError::Connect(format!(
                    "tcp connect timed out after {:?}",
                    self.connect_timeout
                )))
            }
        };
        let _ = tcp.set_nodelay(true);
        let io = match &self.tls {
            None => MaybeTls::Plain(tcp),
            Some((connector, name)) => {
                let name = name.clone().map_err(ForwardError::Connect)?;
                let tls = connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| ForwardError::Connect(error_chain(&e)))?;
                MaybeTls::Tls(Box::new(tls))
            }
        };
        Ok(TokioIo::new(io))
    }

    async fn connect_http1(&self) -> Result<Box<Http1>, ForwardError> {
        let io = self.connect().await?;
        let (sender, connection) = http1::handshake(io).await.map_err(|e| hyper_error(&e))?;
        Ok(Box::new(Http1 {
            sender,
            connection,
            idle_since: Instant::now(),
        }))
    }

    async fn connect_http2(
        self: &Arc<Self>,
    ) -> Result<http2::SendRequest<RequestBody>, ForwardError> {
        let io = self.connect().await?;
        let (sender, connection) = http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| hyper_error(&e))?;
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(error = %err, "an HTTP/2 upstream connection failed");
            }
        });
        with_pool(self, |pool, _| pool.http2 = Some(sender.clone()));
        Ok(sender)
    }
}

/// Runs `f` on this worker's pool of `connector`, with the time now; `None` while the thread
/// is being torn down.
fn with_pool<T>(connector: &Arc<Connector>, f: impl FnOnce(&mut Pool, Instant) -> T) -> Option<T> {
    POOLS
        .try_with(|pools| {
            let mut pools = pools.borrow_mut();
            let (pool, now) = pools.pool(connector);
            f(pool, now)
        })
        .ok()
}

/// Polls `connection` along with `sent` until the response head has arrived (or failed).
async fn drive<F, T>(connection: &mut Http1Connection, sent: F) -> T
where
    F: Future<Output = T>,
{
    let mut sent = pin!(sent);
    let mut ended = false;
    poll_fn(|cx| {
        if !ended {
            // An ended connection fails the exchange in flight, which `sent` then reports.
            if let Poll::Ready(result) = Pin::new(&mut *connection).poll(cx) {
                ended = true;
                if let Err(err) = result {
                    tracing::debug!(error = %err, "an upstream connection failed");
                }
            }
        }
        sent.as_mut().poll(cx)
    })
    .await
}

fn hyper_error(err: &hyper::Error) -> ForwardError {
    if crate::tls::upstream::is_tls_failure(err) {
        ForwardError::Connect(error_chain(err))
    } else {
        ForwardError::Other(error_chain(err))
    }
}

/// An upstream response body; for HTTP/1.1, with the connection it arrives on, which it
/// drives and gives back to the worker's pool when it ends.
pub struct UpstreamBody {
    inner: Incoming,
    held: Option<Held>,
}

struct Held {
    conn: Box<Http1>,
    connector: Arc<Connector>,
}

impl UpstreamBody {
    fn alone(inner: Incoming) -> UpstreamBody {
        UpstreamBody { inner, held: None }
    }

    /// The response is over: hyper notes it on the connection's next poll, and then asks for
    /// the next request; a connection that does goes back to the pool, one that is closing
    /// is dropped. One that still sends the request body (the upstream answered before it had
    /// all of it) is driven by a task of its own until the body is sent, or fails at its
    /// bounds, as it would have been if the response had taken longer.
    fn release(&mut self, cx: &mut Context<'_>) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        if Pin::new(&mut held.conn.connection).poll(cx).is_ready() {
            return;
        }
        if held.conn.sender.is_ready() {
            held.connector.give_back(held.conn);
            return;
        }
        tokio::spawn(async move {
            let Held {
                mut conn,
                connector,
            } = held;
            let ready = poll_fn(|cx| {
                if Pin::new(&mut conn.connection).poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                conn.sender.poll_ready(cx).map(|ready| ready.is_ok())
            })
            .await;
            if ready {
                connector.give_back(conn);
            }
        });
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(held) = &mut this.held {
            // Reads the socket and feeds `inner`. If it ends, `inner` ends or fails with it.
            if Pin::new(&mut held.conn.connection).poll(cx).is_ready() {
                this.held = None;
            }
        }
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            None => this.release(cx),
            Some(Ok(_)) if this.inner.is_end_stream() => this.release(cx),
            Some(Err(_)) => this.held = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An upstream connection, cleartext or TLS.
pub type UpstreamIo = MaybeTls<TcpStream, TlsStream<TcpStream>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn connector(authority: &str) -> Connector {
        Connector::new(
            &authority.parse().unwrap(),
            Duration::from_secs(1),
            None,
            false,
        )
    }

    #[test]
    fn host_names_the_port_only_when_it_is_not_the_schemes_default() {
        let plain = connector("api.internal:8080");
        assert_eq!(plain.host_field, "api.internal:8080");
        assert_eq!((plain.host.as_str(), plain.port), ("api.internal", 8080));
        let default = connector("api.internal:80");
        assert_eq!(default.host_field, "api.internal");
        assert_eq!(default.port, 80);
        let bare = connector("api.internal");
        assert_eq!(
            (bare.host_field.to_str().unwrap(), bare.port),
            ("api.internal", 80)
        );
        let v6 = connector("[::1]:3000");
        assert_eq!(v6.host_field, "[::1]:3000");
        assert_eq!(v6.host, "::1", "connected to without the brackets");
    }

    #[test]
    fn addresses_hash_apart() {
        let hash = |address: usize| {
            let mut hasher = AddressHasher::default();
            hasher.write_usize(address);
            hasher.finish()
        };
        assert_ne!(
            hash(0x1000) >> 57,
            hash(0x1040) >> 57,
            "the high bits differ"
        );
    }
}
