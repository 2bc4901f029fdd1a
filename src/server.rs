//! Listeners: accept TCP connections and serve HTTP/1.1 and cleartext HTTP/2 (h2c) on them, or
//! TLS with both offered through ALPN, with a bounded number of connections, a header-read
//! timeout against slow clients (which bounds the TLS handshake too), an idle timeout, and a
//! graceful shutdown that lets requests in flight finish. HTTP/1.1 connections may be upgraded
//! (WebSocket): the upgraded connection keeps its slot until it closes ([`ConnectionHold`]).
//!
//! The gateway is served by `server.workers` workers ([`start_workers`]), each a thread with a
//! current-thread runtime and its own listener on the same address (`SO_REUSEPORT`, see
//! [`bind_workers`]): the kernel spreads new connections over them, and a connection lives on
//! one thread from accept to close, so serving it never wakes another thread. The workers
//! share one bound on connections (the semaphore handed to each [`serve`]).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::{IntCounter, IntGauge};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::config::ServerConfig;
use crate::runtime::activity::{Activity, IdleWatch, StampedIo};
use crate::tls::stream::{Accepted, MaybeTls};

/// Connections the kernel may hold, handshake done, until sluice accepts them. The standard
/// library's (and tokio's) 128 is easily overrun by a burst of new connections, and each SYN
/// dropped then waits a second for its retransmission. The kernel caps it at
/// `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 1024;

/// Binds a listener on `addr` with a backlog of 1024 connections (`LISTEN_BACKLOG`).
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    bind_socket(addr, false)
}

fn bind_socket(addr: SocketAddr, reuse_port: bool) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Binds `workers` listeners on `addr`, one per worker, as standard-library listeners that
/// each worker registers with its own runtime ([`TcpListener::from_std`]).
///
/// With more than one, they share the address through `SO_REUSEPORT`, which would also let a
/// second sluice (of the same user) bind the same port without an error: so the address is
/// first bound once without it, which fails as before when something else listens there.
/// Port 0 is resolved by the first listener, and the others bind the port it got.
pub fn bind_workers(addr: SocketAddr, workers: usize) -> io::Result<Vec<std::net::TcpListener>> {
    if workers <= 1 {
        return Ok(vec![bind(addr)?.into_std()?]);
    }
    let addr = {
        let probe = bind(addr)?;
        probe.local_addr()?
    };
    (0..workers)
        .map(|_| bind_socket(addr, true)?.into_std())
        .collect()
}

/// What keeps one client connection counted (its slot under `server.max_connections`, the
/// open-connections gauge) for as long as a clone of it lives, with the listener's idle
/// timeout. The listener puts one into the extensions of a request that asks for an upgrade
/// (only those: an extensions map is an allocation other requests are spared); a WebSocket
/// tunnel takes it, so a connection taken over from HTTP still counts, and is closed when it
/// falls silent.
#[derive(Clone)]
pub struct ConnectionHold {
    pub idle_timeout: Duration,
    pub hold: Arc<dyn Send + Sync>,
}

/// The streams of one HTTP/2 connection reading a body whole now: put in each HTTP/2
/// request's extensions here, counted by the token flow (`proxy::tokens`), shared by the connection's streams. (An HTTP/1.1
/// connection reads one request at a time, so it needs none.)
#[derive(Clone, Default)]
pub struct ConnectionReaders(Arc<AtomicUsize>);

impl ConnectionReaders {
    /// A place for one more reader if fewer than `most` read now.
    pub fn enter(&self, most: usize) -> Option<Reader> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now < most).then_some(now + 1)
            })
            .ok()?;
        Some(Reader(Arc::clone(&self.0)))
    }
}

/// One stream's place among its connection's readers, given back when dropped.
pub struct Reader(Arc<AtomicUsize>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How one listener treats its connections, from `server:` in the config.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_connections: u32,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// Once the listener has closed, requests in flight get this long to finish.
    pub shutdown_grace: Duration,
    /// The HTTP parser's own cap on a request head, in bytes and fields: twice the limits the
    /// gateway answers with a problem body, so that within them the gateway's precise answer
    /// wins, and past them the parser cuts a hostile head short without buffering it.
    pub parser_max_head_bytes: usize,
    pub parser_max_headers: usize,
    /// TLS on this listener; `None`: cleartext.
    pub tls: Option<ServerTls>,
    /// Give each request the connection's own address (`LocalAddr`): the admin listener's
    /// guard compares the `Host` with it. Off on the gateway, whose requests need not carry
    /// the extension's allocation.
    pub local_addr: bool,
}

/// The local end of the connection a request came on: the address the client connected to,
/// a concrete one even when the listener is bound to `0.0.0.0` or `[::]`.
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub SocketAddr);

/// A listener's TLS: the acceptor (its certificate may rotate underneath) and the counter of
/// handshakes that failed or timed out.
#[derive(Clone)]
pub struct ServerTls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub handshake_errors: IntCounter,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl Settings {
    pub fn new(config: &ServerConfig) -> Settings {
        let head = config
            .max_request_line
            .0
            .saturating_add(config.max_header_bytes.0)
            .saturating_mul(2);
        Settings {
            max_connections: config.max_connections.0,
            header_read_timeout: config.header_read_timeout.0,
            idle_timeout: config.idle_timeout.0,
            shutdown_grace: config.shutdown_grace.0,
            // hyper refuses a buffer below 8 KiB.
            parser_max_head_bytes: usize::try_from(head).unwrap_or(usize::MAX).max(8192),
            parser_max_headers: config.max_headers.0 as usize * 2,
            tls: None,
            local_addr: false,
        }
    }
}

/// The connection slots of one listener (`max_connections` of them), shared by its workers.
pub fn slots(settings: &Settings) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(settings.max_connections as usize))
}

/// How one worker's listener counts its connections.
#[derive(Clone)]
pub struct Counters {
    /// Open connections of the listener (all workers).
    pub open: IntGauge,
    /// Connections this worker accepted.
    pub accepted: Option<IntCounter>,
}

/// One worker's runtime: current-thread, so a connection and everything its requests do run
/// on the worker's own thread.
pub fn worker_runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Why the gateway's workers could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkersError {
    /// A listener could not be registered with its worker's runtime (or none was bound).
    #[error("cannot register a gateway listener with its worker")]
    Listener(#[source] io::Error),
    #[error("cannot start the async runtime")]
    Runtime(#[source] io::Error),
    #[error("cannot start a worker thread")]
    Thread(#[source] io::Error),
}

/// The gateway's workers, started: worker 0 to be served by the caller, workers 1.. already
/// serving on threads of their own.
pub struct Workers<S> {
    /// Worker 0's listener served: it runs on the runtime of the thread that awaits it.
    pub first: S,
    /// Workers 1.., to be waited for once `first` is done.
    pub others: WorkerThreads,
}

/// The threads of workers 1.., each with its own runtime and listener.
pub struct WorkerThreads {
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Ends (`recv` gives `None`) when every worker has dropped its sender, which it does once
    /// its connections are drained.
    finished: tokio::sync::mpsc::Receiver<()>,
}

impl WorkerThreads {
    /// Waits until every worker's connections are drained and its thread has ended. The
    /// awaiting runtime keeps driving the shared tasks (the store's connections) meanwhile:
    /// the other workers' requests may still need them.
    pub async fn drained(mut self) {
        while self.finished.recv().await.is_some() {}
        for thread in self.threads {
            if thread.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
    }
}

/// Starts the gateway's workers, one per listener of [`bind_workers`]: worker 0's listener
/// is registered with the calling thread's runtime (so this must be called on it), and each
/// of workers 1.. gets a thread with its own runtime ([`worker_runtime`]). Every runtime is
/// built and every listener registered before this returns, so a failure stops the start.
/// The workers share one bound on connections (`settings.max_connections`); `counters`
/// gives each worker's, by its index.
pub fn start_workers<H, F, B>(
    listeners: Vec<std::net::TcpListener>,
    handler: H,
    settings: Settings,
    counters: impl Fn(usize) -> Counters,
    stopping: watch::Receiver<bool>,
) -> Result<Workers<impl Future<Output = ()>>, WorkersError>
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = slots(&settings);
    crate::runtime::worker::set_count(listeners.len());
    let mut listeners = listeners.into_iter();
    let first = listeners.next().ok_or_else(|| {
        WorkersError::Listener(io::Error::other("no listener was bound for worker 0"))
    })?;
    let (finished, finished_all) = tokio::sync::mpsc::channel::<()>(listeners.len().max(1));
    let mut threads = Vec::new();
    for (index, listener) in listeners.enumerate() {
        let worker = index + 1;
        let runtime = worker_runtime().map_err(WorkersError::Runtime)?;
        let listener = {
            let _registered_with = runtime.enter();
            listener
                .set_nonblocking(true)
                .map_err(WorkersError::Listener)?;
            TcpListener::from_std(listener).map_err(WorkersError::Listener)?
        };
        let (handler, settings, slots, counters, stopping, finished) = (
            handler.clone(),
            settings.clone(),
            Arc::clone(&slots),
            counters(worker),
            stopping.clone(),
            finished.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("sluice-worker-{worker}"))
            .spawn(move || {
                crate::runtime::worker::enter(worker);
                runtime.block_on(serve(
                    listener, handler, settings, slots, counters, stopping,
                ));
                drop(finished);
            })
            .map_err(WorkersError::Thread)?;
        threads.push(thread);
    }
    drop(finished);
    first
        .set_nonblocking(true)
        .map_err(WorkersError::Listener)?;
    let first = TcpListener::from_std(first).map_err(WorkersError::Listener)?;
    Ok(Workers {
        first: serve(first, handler, settings, slots, counters(0), stopping),
        others: WorkerThreads {
            threads,
            finished: finished_all,
        },
    })
}

/// Serves `handler` on `listener` until `shutdown` turns true, then drains connections.
///
/// `slots` bounds the open connections of all the workers of this listener together. A
/// worker that has accepted a connection waits for a slot before it serves it, and accepts
/// no other meanwhile: past `max_connections`, new connections wait in the kernel's backlog
/// (and are refused by the kernel once it is full) rather than being accepted and closed.
/// (Waiting for a slot *before* accepting would let a worker whose backlog is empty take the
/// slot a connection queued at another worker needs.)
pub async fn serve<H, F, B>(
    listener: TcpListener,
    handler: H,
    settings: Settings,
    slots: Arc<Semaphore>,
    counters: Counters,
    mut shutdown: watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let Counters { open, accepted } = counters;
    let builder = Arc::new(connection_builder(&settings));
    loop {
        let Some((stream, peer)) = accept(&listener, &mut shutdown).await else {
            break;
        };
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        if let Some(accepted) = &accepted {
            accepted.inc();
        }
        open.inc();
        let hold = ConnectionHold {
            idle_timeout: settings.idle_timeout,
            hold: Arc::new(Counted {
                _slot: slot,
                open: open.clone(),
            }),
        };
        let handler = handler.clone();
        let builder = Arc::clone(&builder);
        spawn_connection(stream, peer, handler, hold, &settings, builder, &shutdown);
    }
    drop(listener);
    // Every open connection holds a slot: all of them back means every connection is done
    // (those of the other workers too: each worker's runtime lives until then, or the grace).
    let grace = settings.shutdown_grace;
    if tokio::time::timeout(grace, slots.acquire_many(settings.max_connections))
        .await
        .is_err()
    {
        tracing::warn!("some connections were still busy after {grace:?}; closing them");
    }
}

/// The HTTP/1.1 and HTTP/2 connection builder of a listener: its timers, its header-read
/// timeout and the parser's caps on a request head.
fn connection_builder(settings: &Settings) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(settings.parser_max_head_bytes)
        .max_headers(settings.parser_max_headers);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(settings.parser_max_head_bytes).unwrap_or(u32::MAX));
    builder
}

/// The next connection, or `None` once `shutdown` turns true. A failed accept (usually out
/// of file descriptors) waits a little instead of spinning.
async fn accept(
    listener: &TcpListener,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => return Some(accepted),
                Err(err) => {
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.wait_for(|stop| *stop) => return None,
        }
    }
}

/// Serves one accepted connection on a task of its own: its TLS handshake (if any), then its
/// requests through `handler`, until `ConnectionCloser` ends it. `hold` keeps its slot.
fn spawn_connection<H, F, B>(
    stream: TcpStream,
    peer: SocketAddr,
    handler: H,
    hold: ConnectionHold,
    settings: &Settings,
    builder: Arc<auto::Builder<TokioExecutor>>,
    shutdown: &watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let _ = stream.set_nodelay(true);
    let accepted = Instant::now();
    let first_request = Arc::new(AtomicBool::new(false));
    let local = settings
        .local_addr
        .then(|| stream.local_addr().ok())
        .flatten()
        .map(LocalAddr);
    let service = {
        let first_request = Arc::clone(&first_request);
        let over_tls = settings.tls.is_some();
        // The streams of this connection reading a body whole (HTTP/2 only: an HTTP/1.1
        // connection reads one request at a time).
        let readers = ConnectionReaders::default();
        service_fn(move |mut request: Request<Incoming>| {
            first_request.store(true, Ordering::Relaxed);
            if request.version() == http::Version::HTTP_2 {
                request.extensions_mut().insert(readers.clone());
            }
            if over_tls {
                request.extensions_mut().insert(crate::tls::ClientTls);
            }
            if let Some(local) = local {
                request.extensions_mut().insert(local);
            }
            if request.headers().contains_key(http::header::UPGRADE) {
                request.extensions_mut().insert(hold.clone());
            }
            // Boxed once here, so what hyper stores and moves into place on every request
            // is a pointer, not the handler's ~6 KB future; and `map`, not an async block
            // awaiting it: a future captured by an async block takes its room twice.
            Box::pin(handler(request, peer)).map(Ok::<_, Infallible>)
        })
    };
    let shutdown = shutdown.clone();
    let idle_timeout = settings.idle_timeout;
    let head_due = accepted + settings.header_read_timeout;
    let tls = settings.tls.clone();
    tokio::spawn(async move {
        let activity = Activity::default();
        let stream = StampedIo::new(stream, &activity);
        let Some(stream) = handshake(stream, tls, head_due, peer).await else {
            return;
        };
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        let closer = ConnectionCloser {
            idle: IdleWatch::new(activity, idle_timeout),
            head_due,
            first_request,
            shutdown,
        };
        if let Err(err) = closer.run(connection).await {
            tracing::debug!(%peer, error = %err, "connection ended with an error");
        }
    });
}

/// The connection as the listener serves it: plain, or after its TLS handshake (`None`:
/// the handshake failed, counted). The handshake is part of what must arrive by `head_due`:
/// a client that opens TLS and stalls holds a slot no longer than one that sends no head.
async fn handshake(
    stream: Watched,
    tls: Option<ServerTls>,
    head_due: Instant,
    peer: SocketAddr,
) -> Option<Accepted<Watched>> {
    let Some(tls) = tls else {
        return Some(MaybeTls::Plain(stream));
    };
    let handshake = tokio::time::timeout_at(head_due.into(), tls.acceptor.accept(stream));
    match handshake.await {
        Ok(Ok(stream)) => Some(MaybeTls::Tls(Box::new(stream))),
        Ok(Err(err)) => {
            tls.handshake_errors.inc();
            tracing::debug!(%peer, error = %err, "TLS handshake failed");
            None
        }
        Err(_) => {
            tls.handshake_errors.inc();
            tracing::debug!(%peer, "TLS handshake not done within the header-read timeout");
            None
        }
    }
}

/// Ends one connection gracefully (the request in flight finishes, no new one starts) when
/// the server shuts down or the connection has been silent for the idle timeout; and at once
/// when no first request head has arrived within the header-read timeout of the accept, or
/// when it has been silent for the idle timeout with a write waiting (the client stopped
/// reading: the answer in flight could never finish).
///
/// hyper's own header-read timeout only starts once the connection is known to speak
/// HTTP/1.1, which takes its first byte, and HTTP/2 has none: a client that sends nothing,
/// stops in the middle of the HTTP/2 preface, or opens HTTP/2 and sends no request, is
/// closed here instead.
struct ConnectionCloser {
    /// The connection's silence, looked at on a coarse tick (see `activity`).
    idle: IdleWatch,
    /// When the first request head must have arrived.
    head_due: Instant,
    /// Set by the service when the first request head has arrived.
    first_request: Arc<AtomicBool>,
    shutdown: watch::Receiver<bool>,
}

type Connection<'a, S> =
    auto::UpgradeableConnection<'a, TokioIo<Accepted<Watched>>, S, TokioExecutor>;

/// One accepted connection, counted under `max_connections` and in the open-connections
/// gauge until the last holder (the connection's task, or a tunnel made of it) drops it.
struct Counted {
    _slot: OwnedSemaphorePermit,
    open: IntGauge,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl ConnectionCloser {
    async fn run<S, B>(
        mut self,
        connection: Connection<'_, S>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
    where
        S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut connection = pin!(connection);
        let mut closing = false;
        let mut head_checked = false;
        loop {
            tokio::select! {
                result = connection.as_mut() => return result,
                _ = tokio::time::sleep_until(self.head_due.into()), if !head_checked => {
                    if !self.first_request.load(Ordering::Relaxed) {
                        return Err("no request head within the header-read timeout".into());
                    }
                    head_checked = true;
                }
                _ = self.shutdown.wait_for(|stop| *stop), if !closing => {
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
                // Looked at while closing too: a graceful close waits for the answer in
                // progress, which a client that reads nothing never lets finish.
                _ = tokio::time::sleep_until(self.idle.next()) => {
                    if self.idle.look() {
                        if self.idle.write_waiting() {
                            // Nothing read for the idle timeout with an answer to send: cut,
                            // and the answer with it (its concurrency lease is released).
                            return Err("the client read nothing for the idle timeout".into());
                        }
                        if !closing {
                            closing = true;
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
        }
    }
}

/// A client connection that notes when it last read or wrote a byte, for the idle timeout.
type Watched = StampedIo<TcpStream>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_per_connection_are_bounded() {
        let readers = ConnectionReaders::default();
        let one = readers.enter(2).expect("first");
        let _two = readers.enter(2).expect("second");
        assert!(readers.enter(2).is_none(), "a third is refused");
        drop(one);
        assert!(readers.enter(2).is_some(), "a place came back");
    }
}
