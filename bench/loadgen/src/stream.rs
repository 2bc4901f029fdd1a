//! The streamed-token scenario: a fake LLM API that streams Server-Sent Events, and a client
//! that measures each event's delivery, to compare streaming through sluice (with a token
//! budget settling each answer) against streaming from the upstream directly.
//!
//! `sluice-loadgen serve-sse --port P`: answers every request with `--events` events of
//! `--event-bytes` bytes of text, one every `--interval-us` µs, each carrying the wall-clock
//! time (µs since the epoch) it was written; then a usage event (`--usage` tokens) and
//! `data: [DONE]`. Raw HTTP/1.1 over tokio, keep-alive, chunked: nothing in it is sluice's.
//!
//! `sluice-loadgen stream --url URL --streams N --concurrency C`: sends N chat requests, C at
//! a time, reads every event and prints one JSON line: events, bytes, elapsed, and the
//! percentiles of each event's delivery time (read time minus the time written in it; the
//! same machine's clock on both ends).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `serve-sse` settings.
#[derive(Clone, Copy)]
pub struct Serve {
    pub port: u16,
    pub events: u32,
    pub event_bytes: usize,
    pub interval: Duration,
    pub usage: u64,
}

pub async fn serve(settings: Serve) -> Result<(), String> {
    let listener = TcpListener::bind(("127.0.0.1", settings.port))
        .await
        .map_err(|e| format!("bind 127.0.0.1:{}: {e}", settings.port))?;
    loop {
        let (stream, _) = listener.accept().await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = connection(stream, settings).await;
        });
    }
}

/// One keep-alive connection: requests read by their `Content-Length`, answers chunked.
async fn connection(mut stream: TcpStream, s: Serve) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(8192);
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        buf.drain(..head_end + length);
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            .await?;
        let text = "x".repeat(s.event_bytes);
        let mut next = Instant::now();
        for n in 0..s.events {
            let event = format!(
                "data: {{\"t\":{},\"id\":{n},\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}],\"usage\":null}}\n\n",
                now_us()
            );
            chunk(&mut stream, event.as_bytes()).await?;
            next += s.interval;
            tokio::time::sleep_until(next.into()).await;
        }
        let last = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
            s.usage / 4,
            s.usage - s.usage / 4,
            s.usage
        );
        chunk(&mut stream, last.as_bytes()).await?;
        stream.write_all(b"0\r\n\r\n").await?;
    }
}

async fn chunk(stream: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    stream.write_all(&out).await
}

/// `stream` settings.
pub struct Client {
    pub authority: String,
    pub path: String,
    pub streams: u32,
    pub concurrency: u32,
    pub max_tokens: u32,
}

#[derive(Default)]
struct Tally {
    events: u64,
    bytes: u64,
    answers: u64,
    statuses: std::collections::BTreeMap<u16, u64>,
    delivery_us: Vec<u64>,
}

pub async fn run(client: Client) -> Result<String, String> {
    let client = Arc::new(client);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..client.concurrency {
        let (client, tally, next) = (Arc::clone(&client), Arc::clone(&tally), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let stream = TcpStream::connect(&client.authority)
                .await
                .map_err(|e| format!("connect {}: {e}", client.authority))?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let (mut sender, connection) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(connection);
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < client.streams {
                let body = format!(
                    "{{\"model\":\"bench\",\"stream\":true,\"stream_options\":{{\"include_usage\":true}},\"max_tokens\":{},\"messages\":[{{\"role\":\"user\",\"content\":\"Count to a thousand.\"}}]}}",
                    client.max_tokens
                );
                let request = Request::post(client.path.as_str())
                    .header("host", client.authority.as_str())
                    .header("content-type", "application/json")
                    .header("x-api-key", format!("k{worker}"))
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| e.to_string())?;
                sender.ready().await.map_err(|e| e.to_string())?;
                let response = sender.send_request(request).await.map_err(|e| e.to_string())?;
                let status = response.status().as_u16();
                let mut body = response.into_body();
                let mut pending: Vec<u8> = Vec::new();
                let (mut events, mut bytes, mut delivery) = (0u64, 0u64, Vec::new());
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|e| e.to_string())?;
                    let Some(data) = frame.data_ref() else { continue };
                    let read_at = now_us();
                    bytes += data.len() as u64;
                    pending.extend_from_slice(data);
                    while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
                        let event = &pending[..end];
                        if let Some(at) = find_time(event) {
                            events += 1;
                            delivery.push(read_at.saturating_sub(at));
                        }
                        pending.drain(..end + 2);
                    }
                }
                let mut t = tally.lock().map_err(|_| "poisoned")?;
                *t.statuses.entry(status).or_default() += 1;
                t.answers += 1;
                t.events += events;
                t.bytes += bytes;
                t.delivery_us.extend(delivery);
            }
            Ok::<(), String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut t = tally.lock().map_err(|_| "poisoned")?;
    t.delivery_us.sort_unstable();
    let pct = |p: f64| -> u64 {
        if t.delivery_us.is_empty() {
            return 0;
        }
        let i = ((t.delivery_us.len() as f64 - 1.0) * p).round() as usize;
        t.delivery_us[i]
    };
    let statuses: Vec<String> = t
        .statuses
        .iter()
        .map(|(s, n)| format!("\"{s}\":{n}"))
        .collect();
    Ok(format!(
        "{{\"answers\":{},\"events\":{},\"bytes\":{},\"elapsed_s\":{elapsed:.3},\"delivery_p50_us\":{},\"delivery_p99_us\":{},\"statuses\":{{{}}}}}",
        t.answers,
        t.events,
        t.bytes,
        pct(0.5),
        pct(0.99),
        statuses.join(",")
    ))
}

/// The `"t":MICROS` of an event written by `serve`.
fn find_time(event: &[u8]) -> Option<u64> {
    let at = event.windows(5).position(|w| w == b"{\"t\":")? + 5;
    let digits: Vec<u8> = event[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}
