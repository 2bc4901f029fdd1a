//! The fake backend: an in-process hyper HTTP server on 127.0.0.1 that echoes requests,
//! streams and checks pattern bodies, answers slowly or with hop-by-hop headers, and records
//! what it received.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::task::JoinHandle;

type UpBody = BoxBody<Bytes, Infallible>;

/// Size of one download chunk. It is a multiple of 251 so every chunk holds
/// the same repeating pattern `byte[k] = k % 251`.
pub const PATTERN_CHUNK: usize = 251 * 261;

/// The byte expected at absolute offset `k` of a download / upload body.
pub fn pattern_byte(k: u64) -> u8 {
    (k % 251) as u8
}

/// One chunk of the repeating pattern (starts at an offset multiple of 251).
pub fn pattern_chunk() -> Bytes {
    Bytes::from(
        (0..PATTERN_CHUNK as u64)
            .map(pattern_byte)
            .collect::<Vec<u8>>(),
    )
}

/// Whether `data`, found at absolute offset `offset` of a body, follows the
/// pattern (fast: compares slices, not bytes one by one).
pub fn pattern_matches(offset: u64, data: &[u8]) -> bool {
    static PATTERN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pat = PATTERN.get_or_init(|| (0..PATTERN_CHUNK as u64 + 251).map(pattern_byte).collect());
    let step = PATTERN_CHUNK;
    let mut at = offset;
    for piece in data.chunks(step) {
        let off = (at % 251) as usize;
        if piece != &pat[off..off + piece.len()] {
            return false;
        }
        at += piece.len() as u64;
    }
    true
}

#[derive(Default)]
struct UpState {
    arrivals: Mutex<Vec<Instant>>,
    /// The path and query of each request, in arrival order.
    paths: Mutex<Vec<String>>,
    /// How each `/upload` body ended, in the order they ended.
    uploads: Mutex<Vec<UploadSeen>>,
}

/// How the upstream's `/upload` handler saw one request body end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadSeen {
    /// The body ended cleanly after this many bytes.
    Complete(u64),
    /// The body broke off with an error after this many bytes.
    Broken(u64),
}

/// An in-process hyper HTTP server on 127.0.0.1 standing in for a backend.
///
/// Routes:
/// - `/download/<n>`: 200, streams n bytes of the pattern in chunks
/// - `/upload`: consumes the body chunk by chunk, answers the byte count as
///   text, and `x-pattern-ok: true|false` (whether the bytes followed the pattern)
/// - `/too-large`: 413 at once, its body unread (hyper then closes the connection unless
///   the whole body had already arrived)
/// - `/slow/<ms>`: sleeps, then 200 "slow"
/// - `/login?password=right`: 200 "welcome"; `/login` with any other query: 401
/// - `/hop-response`: like the echo, but also sends hop-by-hop response headers
///   (`connection: x-hop`, `x-hop: 1`, `keep-alive: timeout=5`,
///   `proxy-connection: keep-alive`) and an ordinary `x-normal-resp: yes`
/// - anything else: 200 JSON `{"method","path","headers":{name:[values]}}`
pub struct Upstream {
    addr: SocketAddr,
    state: Arc<UpState>,
    task: JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpState::default());
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(x) => x,
                    Err(_) => continue,
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, st.clone()));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream { addr, state, task }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Number of requests received so far.
    pub fn hits(&self) -> usize {
        self.state.arrivals.lock().unwrap().len()
    }

    /// The instant each request arrived, in arrival order.
    pub fn arrivals(&self) -> Vec<Instant> {
        self.state.arrivals.lock().unwrap().clone()
    }

    /// The path and query of each request received, in arrival order.
    pub fn paths(&self) -> Vec<String> {
        self.state.paths.lock().unwrap().clone()
    }

    /// How each `/upload` body ended so far (complete or broken, with its byte count).
    pub fn uploads(&self) -> Vec<UploadSeen> {
        self.state.uploads.lock().unwrap().clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn full(b: impl Into<Bytes>) -> UpBody {
    Full::new(b.into()).boxed()
}

fn echo_json(req: &Request<Incoming>) -> serde_json::Value {
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in req.headers() {
        headers
            .entry(name.as_str().to_string())
            .or_default()
            .push(String::from_utf8_lossy(value.as_bytes()).into_owned());
    }
    let path = req
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    serde_json::json!({
        "method": req.method().as_str(),
        "path": path,
        "headers": headers,
    })
}

async fn handle(req: Request<Incoming>, st: Arc<UpState>) -> Result<Response<UpBody>, Infallible> {
    st.arrivals.lock().unwrap().push(Instant::now());
    let path = req.uri().path().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), |pq| pq.as_str().to_string());
    st.paths.lock().unwrap().push(path_and_query);

    if let Some(n) = path.strip_prefix("/download/") {
        let total: u64 = n.parse().unwrap_or(0);
        let chunk = pattern_chunk();
        let stream = futures_util::stream::unfold(0u64, move |sent| {
            let chunk = chunk.clone();
            async move {
                if sent >= total {
                    return None;
                }
                let len = std::cmp::min(chunk.len() as u64, total - sent) as usize;
                Some((
                    Ok::<_, Infallible>(Frame::data(chunk.slice(..len))),
                    sent + len as u64,
                ))
            }
        });
        let resp = Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/octet-stream")
            .body(StreamBody::new(stream).boxed())
            .unwrap();
        return Ok(resp);
    }

    if path == "/upload" {
        let mut body = req.into_body();
        let mut count: u64 = 0;
        let mut ok = true;
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    st.uploads.lock().unwrap().push(UploadSeen::Broken(count));
                    return Ok(Response::builder()
                        .status(StatusCode::BAD_REQUEST)
                        .body(full(format!("body error after {count} bytes: {e}")))
                        .unwrap());
                }
            };
            if let Some(data) = frame.data_ref() {
                if ok {
                    ok = pattern_matches(count, data);
                }
                count += data.len() as u64;
            }
        }
        st.uploads.lock().unwrap().push(UploadSeen::Complete(count));
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/plain")
            .header("x-pattern-ok", if ok { "true" } else { "false" })
            .body(full(count.to_string()))
            .unwrap());
    }

    if path == "/too-large" {
        // Answered from the head alone, as an upload limit does, before the body is read.
        return Ok(Response::builder()
            .status(StatusCode::PAYLOAD_TOO_LARGE)
            .body(full("too large"))
            .unwrap());
    }

    if path == "/login" {
        // A login form: 200 for the right password, 401 for any other.
        let right = req.uri().query() == Some("password=right");
        let (status, body) = if right {
            (StatusCode::OK, "welcome")
        } else {
            (StatusCode::UNAUTHORIZED, "wrong password")
        };
        return Ok(Response::builder().status(status).body(full(body)).unwrap());
    }

    if let Some(ms) = path.strip_prefix("/slow/") {
        let ms: u64 = ms.parse().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .body(full("slow"))
            .unwrap());
    }

    let json = echo_json(&req);
    let mut b = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json");
    if path == "/hop-response" {
        b = b
            .header("connection", "x-hop")
            .header("x-hop", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-connection", "keep-alive")
            .header("x-normal-resp", "yes");
    }
    Ok(b.body(full(json.to_string())).unwrap())
}
