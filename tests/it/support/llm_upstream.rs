//! A fake LLM API: an in-process hyper server on 127.0.0.1 that answers chat requests with
//! the usage the request itself asks for, so a test knows what each answer cost. It records
//! when it answered and the usage it reported.
//!
//! The request is a chat body (`messages`, `max_tokens` …) with a `sim` object:
//! - `usage`: the tokens the answer reports (default 10);
//! - `mode`: `json` (OpenAI `usage`, the default), `sse` (OpenAI chunks and a final usage
//!   chunk), `anthropic` (Anthropic events: input in `message_start`, output in
//!   `message_delta`), `header` (`x-tokens-used`, no usage in the body), `none` (no figure);
//! - `status`: the answer's status (default 200);
//! - `events`, `event_bytes`: content events of a streamed answer and the text of each;
//! - `delay_ms`: wait before answering;
//! - `gate`: a streamed answer sends its first event, then waits for [`LlmUpstream::open_gate`]
//!   before the rest;
//! - `encoding`: `gzip`, `deflate` (zlib), `deflate-raw` (raw deflate, as some servers send
//!   `deflate`), `br` or `zstd`: the answer's bytes compressed so, with `Content-Encoding`
//!   (`deflate` for both deflates), sent in frames of `frame_bytes` (default 64) so a reader
//!   decodes them as they come; a streamed answer is compressed whole (no `gate`). The bytes
//!   sent are kept ([`LlmUpstream::sent`]);
//! - `bomb_mb` (with `encoding: gzip`): before the answer, a JSON string of that many MiB of
//!   `x` in the same gzip stream (repeated gzip members of 1 MiB each, a few KiB on the
//!   wire): a decompression bomb whose usage, at its start, only a reader that decodes it
//!   all would see.

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
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

type Body = BoxBody<Bytes, Infallible>;

/// One answer: when its request arrived, the usage it reported, and when its last byte was
/// handed to the connection.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub at: Instant,
    pub usage: u64,
    pub finished: Option<Instant>,
}

#[derive(Default)]
struct State {
    answers: Mutex<Vec<Answer>>,
    bodies: Mutex<Vec<Bytes>>,
    /// The bytes of each compressed answer, as sent.
    sent: Mutex<Vec<Bytes>>,
    gate: Notify,
}

pub struct LlmUpstream {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl LlmUpstream {
    pub async fn start() -> LlmUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the LLM upstream");
        let addr = listener.local_addr().expect("an address");
        let state = Arc::new(State::default());
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = Arc::clone(&shared);
                tokio::spawn(async move {
                    let service = service_fn(move |request| answer(request, Arc::clone(&state)));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        LlmUpstream { addr, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every answer so far, in the order they were made.
    pub fn answers(&self) -> Vec<Answer> {
        self.state.answers.lock().expect("answers").clone()
    }

    /// The request bodies received, as received.
    pub fn bodies(&self) -> Vec<Bytes> {
        self.state.bodies.lock().expect("bodies").clone()
    }

    /// The bytes of each compressed answer (`sim.encoding`), as sent, in order.
    pub fn sent(&self) -> Vec<Bytes> {
        self.state.sent.lock().expect("sent").clone()
    }

    /// Lets a gated streamed answer send the rest of its events.
    pub fn open_gate(&self) {
        self.state.gate.notify_one();
    }
}

impl Drop for LlmUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A chat request body asking the fake for `sim`, with `max_tokens` as the output cap.
pub fn chat_body(max_tokens: u64, sim: Value) -> String {
    json!({
        "model": "fake-1",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "sim": sim,
    })
    .to_string()
}

async fn answer(
    request: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<Body>, Infallible> {
    let arrived = Instant::now();
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    state.bodies.lock().expect("bodies").push(body.clone());
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let sim = &request["sim"];
    let usage = sim["usage"].as_u64().unwrap_or(10);
    let mode = sim["mode"].as_str().unwrap_or("json").to_owned();
    let status = sim["status"].as_u64().unwrap_or(200) as u16;
    let events = sim["events"].as_u64().unwrap_or(3);
    let event_bytes = sim["event_bytes"].as_u64().unwrap_or(10) as usize;
    let gate = sim["gate"].as_bool().unwrap_or(false);
    let encoding = sim["encoding"].as_str().map(str::to_owned);
    let frame_bytes = sim["frame_bytes"].as_u64().unwrap_or(64) as usize;
    let bomb_mb = sim["bomb_mb"].as_u64().unwrap_or(0);
    if let Some(delay) = sim["delay_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let index = {
        let mut answers = state.answers.lock().expect("answers");
        answers.push(Answer {
            at: arrived,
            usage: if mode == "none" { 0 } else { usage },
            finished: None,
        });
        answers.len() - 1
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let input = usage / 3;
    let output = usage - input;
    let builder = Response::builder().status(status);
    let response = match mode.as_str() {
        "sse" | "anthropic" => {
            let text = "x".repeat(event_bytes);
            let content = move |n: u64| -> String {
                if mode == "sse" {
                    format!(
                        "data: {}\n\n",
                        json!({"id": n, "choices": [{"delta": {"content": text}}], "usage": null})
                    )
                } else {
                    format!(
                        "event: content_block_delta\ndata: {}\n\n",
                        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})
                    )
                }
            };
            let (first, last) = if content(0).starts_with("data") {
                (
                    String::new(),
                    format!(
                        "data: {}\n\ndata: [DONE]\n\n",
                        json!({"choices": [], "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": usage}})
                    ),
                )
            } else {
                (
                    format!("event: message_start\ndata: {}\n\n", json!({"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": input, "output_tokens": 1}}})),
                    format!(
                        "event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n",
                        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": output}})
                    ),
                )
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let tx = tx;
                if !first.is_empty() && tx.send(Bytes::from(first)).await.is_err() {
                    return;
                }
                for n in 0..events {
                    if tx.send(Bytes::from(content(n))).await.is_err() {
                        return;
                    }
                    if n == 0 && gate {
                        state.gate.notified().await;
                    }
                }
                if tx.send(Bytes::from(last)).await.is_ok() {
                    state.answers.lock().expect("answers")[index].finished = Some(Instant::now());
                }
            });
            let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                let bytes = rx.recv().await?;
                Some((Ok::<_, Infallible>(Frame::data(bytes)), rx))
            });
            builder
                .header("content-type", "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(stream)))
        }
        _ => {
            let mut answer = json!({
                "id": "c", "object": "chat.completion",
                "choices": [{"message": {"role": "assistant", "content": "Something."}}],
            });
            if mode == "json" {
                answer["usage"] = json!({"prompt_tokens": input, "completion_tokens": output, "total_tokens": usage});
            }
            let builder = if mode == "header" {
                builder.header("x-tokens-used", usage.to_string())
            } else {
                builder
            };
            state.answers.lock().expect("answers")[index].finished = Some(Instant::now());
            builder
                .header("content-type", "application/json")
                .body(BodyExt::boxed(Full::new(Bytes::from(answer.to_string()))))
        }
    };
    let response = response.expect("a response");
    let Some(encoding) = encoding else {
        return Ok(response);
    };
    let (mut parts, body) = response.into_parts();
    let plain = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let encoded = Bytes::from(encode(&encoding, &plain, bomb_mb));
    state.sent.lock().expect("sent").push(encoded.clone());
    let coding = if encoding == "deflate-raw" {
        "deflate"
    } else {
        encoding.as_str()
    };
    parts.headers.insert(
        "content-encoding",
        http::HeaderValue::from_str(coding).expect("a coding"),
    );
    parts.headers.remove("content-length");
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = (0..encoded.len())
        .step_by(frame_bytes.max(1))
        .map(|at| {
            Ok(Frame::data(
                encoded.slice(at..(at + frame_bytes).min(encoded.len())),
            ))
        })
        .collect();
    let body = BodyExt::boxed(StreamBody::new(futures_util::stream::iter(frames)));
    Ok(Response::from_parts(parts, body))
}

/// `plain` compressed with `encoding`; with `bomb_mb`, a gzip stream that first decodes to
/// that many MiB of a JSON string.
fn encode(encoding: &str, plain: &[u8], bomb_mb: u64) -> Vec<u8> {
    use std::io::Write;
    let gzip = |bytes: &[u8]| {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(bytes).expect("gzip");
        encoder.finish().expect("gzip")
    };
    match encoding {
        "gzip" if bomb_mb > 0 => {
            // {"usage": ..., "bomb": "xxxx…", then the answer's own fields.
            let mut out = gzip(b"{\"usage\":{\"total_tokens\":1},\"bomb\":\"");
            let megabyte = gzip(&vec![b'x'; 1 << 20]);
            for _ in 0..bomb_mb {
                out.extend_from_slice(&megabyte);
            }
            let mut tail = b"\",\"answer\":".to_vec();
            tail.extend_from_slice(plain);
            tail.push(b'}');
            out.extend_from_slice(&gzip(&tail));
            out
        }
        "gzip" => gzip(plain),
        "deflate" => {
            let mut encoder =
                flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(plain).expect("zlib");
            encoder.finish().expect("zlib")
        }
        "deflate-raw" => {
            let mut encoder =
                flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(plain).expect("deflate");
            encoder.finish().expect("deflate")
        }
        "br" => {
            let mut out = Vec::new();
            {
                let mut encoder = brotli::CompressorWriter::new(&mut out, 4096, 9, 22);
                encoder.write_all(plain).expect("brotli");
            }
            out
        }
        "zstd" => {
            ruzstd::encoding::compress_to_vec(plain, ruzstd::encoding::CompressionLevel::Fastest)
        }
        other => panic!("the fake LLM API has no encoding {other}"),
    }
}
