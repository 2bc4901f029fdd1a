//! The benchmark's floor: a bare hyper 1.x reverse proxy laid out as sluice is, and nothing
//! else, so that sluice's CPU per request can be read against what its stack costs.
//!
//! The layout is sluice's (`src/app.rs`, `src/server.rs`): one current-thread tokio runtime
//! per worker thread, each with its own listener on the same port (`SO_REUSEPORT`), and each
//! with its own pool of kept-alive HTTP/1 connections to the upstream
//! (`hyper::client::conn::http1`, one request at a time per connection, the connection given
//! back when the response body has ended). The request goes upstream as it came, with its URI
//! cut to the path and query; no header is added or removed, nothing is logged or counted.
//!
//! With `--redis PORT` it also limits each request the way envoyproxy/ratelimit does with its
//! fixed window: for the one descriptor (`--key-header`'s value), `INCRBY key 1` and
//! `EXPIRE key WINDOW` pipelined, where the key names the window it counts
//! (`PREFIX_VALUE_WINDOWSTART`); over `--limit`, a 429. Commands from requests that arrive
//! together go out in one write on the worker's one Redis connection (envoy's implicit
//! pipelining), so Redis's CPU per decision can be measured beside sluice's scripts.
//!
//! ```text
//! sluice-floor --port 8080 --upstream 127.0.0.1:8081 [--workers 2]
//!              [--redis 6379 --limit 50 --window 1 --key-header x-api-key --prefix floor]
//! ```

use std::cell::RefCell;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self as client, SendRequest};
use hyper::server::conn::http1 as server;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use socket2::{Domain, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

struct Args {
    port: u16,
    upstream: SocketAddr,
    workers: usize,
    redis: Option<u16>,
    limit: i64,
    window: u64,
    key_header: String,
    prefix: String,
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => Rc::new(args),
        Err(message) => {
            eprintln!("sluice-floor: {message}");
            return ExitCode::from(2);
        }
    };
    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    // Bound here, before any worker runs, so that a taken port fails the start at once.
    let listeners: Vec<std::net::TcpListener> = match (0..args.workers)
        .map(|_| bind(addr))
        .collect::<std::io::Result<_>>()
    {
        Ok(listeners) => listeners,
        Err(err) => {
            eprintln!("sluice-floor: cannot listen on {addr}: {err}");
            return ExitCode::FAILURE;
        }
    };
    let mut threads = Vec::new();
    let mut listeners = listeners.into_iter();
    let first = listeners.next();
    for listener in listeners {
        let args = Args {
            key_header: args.key_header.clone(),
            prefix: args.prefix.clone(),
            ..*args
        };
        threads.push(std::thread::spawn(move || worker(Rc::new(args), listener)));
    }
    if let Some(listener) = first {
        worker(args, listener);
    }
    for thread in threads {
        let _ = thread.join();
    }
    ExitCode::SUCCESS
}

/// A listener of its own for each worker, on the same port (`SO_REUSEPORT`, as sluice's
/// `server::bind_workers`), with sluice's backlog.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// One worker: a current-thread runtime serving its own listener, with its own upstream pool
/// and Redis connection.
fn worker(args: Rc<Args>, listener: std::net::TcpListener) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("sluice-floor: no runtime: {err}");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        if let Err(err) = serve(args, listener).await {
            eprintln!("sluice-floor: {err}");
        }
    });
}

struct Worker {
    args: Rc<Args>,
    pool: Pool,
    redis: Option<mpsc::UnboundedSender<Decision>>,
}

type Pool = Rc<RefCell<Vec<SendRequest<Incoming>>>>;

async fn serve(args: Rc<Args>, listener: std::net::TcpListener) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let redis = match args.redis {
        Some(port) => {
            let stream = TcpStream::connect(("127.0.0.1", port)).await?;
            stream.set_nodelay(true)?;
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::task::spawn_local(redis_connection(stream, rx));
            Some(tx)
        }
        None => None,
    };
    let worker = Rc::new(Worker {
        args,
        pool: Rc::new(RefCell::new(Vec::new())),
        redis,
    });
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let worker = worker.clone();
        tokio::task::spawn_local(async move {
            let service = hyper::service::service_fn(move |request| {
                let worker = worker.clone();
                async move { Ok::<_, Infallible>(handle(&worker, request).await) }
            });
            let _ = server::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Answer = Response<Either>;

async fn handle(worker: &Worker, request: Request<Incoming>) -> Answer {
    if let Some(redis) = &worker.redis {
        match decide(worker, redis, &request).await {
            Some(true) => {}
            Some(false) => return status(StatusCode::TOO_MANY_REQUESTS),
            None => return status(StatusCode::SERVICE_UNAVAILABLE),
        }
    }
    forward(worker, request)
        .await
        .unwrap_or_else(|| status(StatusCode::BAD_GATEWAY))
}

fn status(code: StatusCode) -> Answer {
    let mut response = Response::new(Either::Empty);
    *response.status_mut() = code;
    response
}

/// None: the upstream could not be reached or broke off.
async fn forward(worker: &Worker, request: Request<Incoming>) -> Option<Answer> {
    let (mut parts, body) = request.into_parts();
    if let Some(path) = parts.uri.path_and_query() {
        if let Ok(uri) = Uri::try_from(path.as_str()) {
            parts.uri = uri;
        }
    }
    let mut sender = checkout(worker).await?;
    let response = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .ok()?;
    let (parts, body) = response.into_parts();
    Some(Response::from_parts(
        parts,
        Either::Upstream(GiveBack {
            body,
            sender: Some(sender),
            pool: worker.pool.clone(),
        }),
    ))
}

/// A pooled connection that is ready for a request, or a new one.
async fn checkout(worker: &Worker) -> Option<SendRequest<Incoming>> {
    loop {
        let pooled = worker.pool.borrow_mut().pop();
        match pooled {
            Some(mut sender) => {
                if sender.ready().await.is_ok() {
                    return Some(sender);
                }
            }
            None => break,
        }
    }
    let stream = TcpStream::connect(worker.args.upstream).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = client::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::task::spawn_local(async move {
        let _ = connection.await;
    });
    Some(sender)
}

/// The upstream's response body; when it has ended, its connection goes back to the pool.
struct GiveBack {
    body: Incoming,
    sender: Option<SendRequest<Incoming>>,
    pool: Pool,
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        if self.body.is_end_stream() {
            if let Some(sender) = self.sender.take() {
                self.pool.borrow_mut().push(sender);
            }
        }
    }
}

enum Either {
    Empty,
    Upstream(GiveBack),
}

impl Body for Either {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Either::Empty => Poll::Ready(None),
            Either::Upstream(up) => Pin::new(&mut up.body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Either::Empty => true,
            Either::Upstream(up) => up.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Either::Empty => SizeHint::with_exact(0),
            Either::Upstream(up) => up.body.size_hint(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The envoyproxy/ratelimit way: INCRBY + EXPIRE per descriptor, pipelined, fixed window.

struct Decision {
    /// `INCRBY key 1` and `EXPIRE key window`, encoded.
    commands: Vec<u8>,
    answer: oneshot::Sender<i64>,
}

/// Some(admitted), or None when Redis did not answer.
async fn decide(
    worker: &Worker,
    redis: &mpsc::UnboundedSender<Decision>,
    request: &Request<Incoming>,
) -> Option<bool> {
    let args = &worker.args;
    let value = request
        .headers()
        .get(args.key_header.as_str())
        .map(|v| v.as_bytes())
        .unwrap_or(b"");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let start = now - now % args.window;
    let mut key = Vec::with_capacity(args.prefix.len() + value.len() + 24);
    key.extend_from_slice(args.prefix.as_bytes());
    key.push(b'_');
    key.extend_from_slice(value);
    key.push(b'_');
    key.extend_from_slice(start.to_string().as_bytes());
    let mut commands = Vec::with_capacity(2 * key.len() + 64);
    encode(&mut commands, &[b"INCRBY", &key, b"1"]);
    encode(
        &mut commands,
        &[b"EXPIRE", &key, args.window.to_string().as_bytes()],
    );
    let (tx, rx) = oneshot::channel();
    redis
        .send(Decision {
            commands,
            answer: tx,
        })
        .ok()?;
    let count = rx.await.ok()?;
    Some(count <= args.limit)
}

fn encode(out: &mut Vec<u8>, parts: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", parts.len()).as_bytes());
    for part in parts {
        out.extend_from_slice(format!("${}\r\n", part.len()).as_bytes());
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
}

/// The worker's one Redis connection: every decision waiting when it writes goes out in one
/// write; replies come back in order, two per decision (INCRBY's count, then EXPIRE's 1).
async fn redis_connection(stream: TcpStream, mut decisions: mpsc::UnboundedReceiver<Decision>) {
    let (mut read, mut write) = stream.into_split();
    let mut waiting: VecDeque<oneshot::Sender<i64>> = VecDeque::new();
    let mut out = Vec::with_capacity(16 * 1024);
    let mut input = BytesMut::with_capacity(16 * 1024);
    let mut count: Option<i64> = None;
    loop {
        tokio::select! {
            decision = decisions.recv() => {
                let Some(decision) = decision else { return };
                out.extend_from_slice(&decision.commands);
                waiting.push_back(decision.answer);
                while let Ok(decision) = decisions.try_recv() {
                    out.extend_from_slice(&decision.commands);
                    waiting.push_back(decision.answer);
                }
                if write.write_all(&out).await.is_err() {
                    return;
                }
                out.clear();
            }
            read_result = read.read_buf(&mut input) => {
                match read_result {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                while let Some(value) = integer_reply(&mut input) {
                    match count.take() {
                        None => count = Some(value),
                        Some(incremented) => {
                            if let Some(answer) = waiting.pop_front() {
                                let _ = answer.send(incremented);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One `:N\r\n` reply off the front of `input`, when it is all there (an error reply, which
/// these commands do not get, counts as -1).
fn integer_reply(input: &mut BytesMut) -> Option<i64> {
    let end = input.windows(2).position(|w| w == b"\r\n")?;
    let value = match input.first() {
        Some(b':') => std::str::from_utf8(&input[1..end])
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1),
        _ => -1,
    };
    input.advance(end + 2);
    Some(value)
}

// ---------------------------------------------------------------------------------------------

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        port: 0,
        upstream: SocketAddr::from(([127, 0, 0, 1], 0)),
        workers: 1,
        redis: None,
        limit: 50,
        window: 1,
        key_header: "x-api-key".into(),
        prefix: "floor".into(),
    };
    while let Some(flag) = argv.next() {
        let value = argv.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--port" => args.port = value.parse().map_err(|e| bad(&e))?,
            "--upstream" => args.upstream = value.parse().map_err(|e| bad(&e))?,
            "--workers" => args.workers = value.parse().map_err(|e| bad(&e))?,
            "--redis" => args.redis = Some(value.parse().map_err(|e| bad(&e))?),
            "--limit" => args.limit = value.parse().map_err(|e| bad(&e))?,
            "--window" => args.window = value.parse().map_err(|e| bad(&e))?,
            "--key-header" => args.key_header = value.to_ascii_lowercase(),
            "--prefix" => args.prefix = value,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.port == 0 || args.upstream.port() == 0 {
        return Err("--port and --upstream are needed".into());
    }
    if args.workers == 0 || args.window == 0 {
        return Err("--workers and --window must be at least 1".into());
    }
    Ok(args)
}
