//! An upstream that keeps its own record of how many requests of each key it is serving at
//! once: the ground truth for concurrency limits. A request counts from the moment its head
//! arrives until its response body is dropped by the server (sent whole, or its connection or
//! stream gone), as a real model server's slot is held.
//!
//! Routes (the key is the `x-api-key` header, `-` without one; any prefix before them is
//! skipped):
//! - `/hold/<ms>`: answers 200 after `ms`, a small body;
//! - `/stream/<n>/<ms>`: 200 `text/event-stream`, `n` events `ms` apart, then `data: [DONE]`;
//! - `/bytes/<n>`: 200, `n` bytes in 16 KiB chunks as fast as they are taken;
//! - anything else: 200 at once.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::task::JoinHandle;

#[derive(Default, Clone, Copy, Debug)]
pub struct KeyRecord {
    pub now: usize,
    pub max: usize,
    pub served: usize,
}

#[derive(Default)]
struct Record {
    keys: Mutex<HashMap<String, KeyRecord>>,
}

impl Record {
    fn enter(self: &Arc<Self>, key: &str) -> Serving {
        let mut keys = self.keys.lock().unwrap();
        let k = keys.entry(key.to_owned()).or_default();
        k.now += 1;
        k.served += 1;
        k.max = k.max.max(k.now);
        Serving {
            record: Arc::clone(self),
            key: key.to_owned(),
        }
    }
}

/// One request being served; leaves the count when dropped.
struct Serving {
    record: Arc<Record>,
    key: String,
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(k) = self.record.keys.lock().unwrap().get_mut(&self.key) {
            k.now -= 1;
        }
    }
}

pub struct InFlightUpstream {
    addr: SocketAddr,
    record: Arc<Record>,
    task: JoinHandle<()>,
}

impl InFlightUpstream {
    pub async fn start() -> InFlightUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let record = Arc::new(Record::default());
        let rec = Arc::clone(&record);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let rec = Arc::clone(&rec);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, Arc::clone(&rec)));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        InFlightUpstream { addr, record, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The record of `key` so far.
    pub fn of(&self, key: &str) -> KeyRecord {
        self.record
            .keys
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or_default()
    }

    /// Starts `key`'s record of the most in flight at once over from the number in flight
    /// now, so that `of(key).max` tells the most since this call.
    pub fn reset_max(&self, key: &str) {
        if let Some(k) = self.record.keys.lock().unwrap().get_mut(key) {
            k.max = k.now;
        }
    }
}

impl Drop for InFlightUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response body that holds its request's place in the record until dropped.
struct Counted {
    frames: tokio::sync::mpsc::Receiver<Bytes>,
    _serving: Serving,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.frames
            .poll_recv(cx)
            .map(|frame| frame.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

async fn handle(
    req: Request<Incoming>,
    record: Arc<Record>,
) -> Result<Response<http_body_util::combinators::BoxBody<Bytes, Infallible>>, Infallible> {
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let serving = record.enter(&key);
    let path = req.uri().path().to_owned();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let body = Counted {
        frames: rx,
        _serving: serving,
    };
    // A route's prefix may come first (`/slow/hold/2000`).
    let path = ["/hold/", "/stream/", "/bytes/"]
        .iter()
        .find_map(|verb| path.find(verb).map(|at| path[at..].to_owned()))
        .unwrap_or(path);
    let mut parts = path.trim_start_matches('/').split('/');
    let mut content_type = "text/plain";
    match (parts.next(), parts.next(), parts.next()) {
        (Some("hold"), Some(ms), _) => {
            let ms: u64 = ms.parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let _ = tx.try_send(Bytes::from_static(b"done\n"));
        }
        (Some("stream"), Some(n), Some(ms)) => {
            content_type = "text/event-stream";
            let n: u64 = n.parse().unwrap_or(1);
            let ms: u64 = ms.parse().unwrap_or(10);
            tokio::spawn(async move {
                for i in 0..n {
                    if tx
                        .send(Bytes::from(format!("data: {i}\n\n")))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            });
            return Ok(Response::builder()
                .header("content-type", content_type)
                .body(body.boxed())
                .unwrap());
        }
        (Some("bytes"), Some(n), _) => {
            let mut left: usize = n.parse().unwrap_or(0);
            tokio::spawn(async move {
                let chunk = Bytes::from(vec![b'x'; 16 * 1024]);
                while left > 0 {
                    let size = left.min(chunk.len());
                    if tx.send(chunk.slice(..size)).await.is_err() {
                        return;
                    }
                    left -= size;
                }
            });
            return Ok(Response::builder()
                .header("content-type", content_type)
                .body(body.boxed())
                .unwrap());
        }
        _ => {
            let _ = tx.try_send(Bytes::from_static(b"ok\n"));
        }
    }
    drop(tx);
    Ok(Response::builder()
        .header("content-type", content_type)
        .body(body.boxed())
        .unwrap())
}
