//! A fake LLM API: an in-process hyper server on 127.0.0.1 that answers OpenAI Chat
//! Completions, legacy Completions, Responses, Embeddings and Anthropic Messages requests. It
//! records for each request when it arrived and what it spent (input, output, total tokens
//! and money at the model's price), so a test computes ground truth from the upstream's own
//! record.
//!
//! **A body without `sim` is charged like the real API would, spending the most it allows**
//! (`charge`): input = the bytes of every text in the body (a byte-level BPE token covers at
//! least one byte) plus the chat template's 4 tokens per message and 3 per request, plus each
//! image at the model's published price for its detail, each file at 100 pages, the tool-use
//! system prompt when `tools` are given, the context the fake holds for
//! `previous_response_id` / `conversation` / a stored `prompt` / `item_reference`, and the
//! results of each server-side tool; output = the cap (the API's own default or the model's
//! own maximum when the body names none) × completions (`n`, `best_of`, array `prompt`). An
//! Anthropic request without `max_tokens` is refused (400, nothing spent), as Anthropic does.
//! A request header `x-fake-finish: P` stops the output at P % of that (an answer that ends
//! before its cap). The usage it reports is what it spent. Figures and their sources are in `MODELS`.
//!
//! A body with a `sim` object asks for a usage instead (older tests of the settlement):
//! - `usage`: the tokens the answer reports (default 10);
//! - `mode`: `json` (OpenAI `usage`, the default), `sse` (OpenAI chunks and a final usage
//!   chunk), `anthropic` (Anthropic events: input in `message_start`, output in
//!   `message_delta`), `header` (`x-tokens-used`, no usage in the body), `none` (no figure);
//! - `status`: the answer's status (default 200);
//! - `events`, `event_bytes`: content events of a streamed answer and the text of each;
//! - `delay_ms`: wait before answering;
//! - `tail_ms`: a streamed answer's body ends this long after its last event (a server that
//!   keeps the stream open after `[DONE]` or `message_stop`);
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

use std::collections::HashMap;
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

use super::Node;

type Body = BoxBody<Bytes, Infallible>;

/// One answer: when its request arrived, what it spent (`usage` = `input + output` tokens,
/// `micro_usd` at the model's price), and when its last byte was handed to the connection.
#[derive(Debug, Clone, Copy)]
pub struct Answer {
    pub at: Instant,
    pub usage: u64,
    pub input: u64,
    pub output: u64,
    pub micro_usd: f64,
    pub finished: Option<Instant>,
}

#[derive(Default)]
struct State {
    answers: Mutex<Vec<Answer>>,
    /// The model each answer was asked for (the body's `model` as received), in the order of
    /// `answers`.
    asked: Mutex<Vec<String>>,
    bodies: Mutex<Vec<Bytes>>,
    /// Context held for stored responses and conversations, by id: what a later request
    /// that refers to it is billed on top of its own input.
    stored: Mutex<HashMap<String, u64>>,
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

    /// The model each answer was asked for, as the body named it, in the order of
    /// [`LlmUpstream::answers`].
    pub fn models(&self) -> Vec<String> {
        self.state.asked.lock().expect("asked").clone()
    }

    /// The request bodies received, as received.
    pub fn bodies(&self) -> Vec<Bytes> {
        self.state.bodies.lock().expect("bodies").clone()
    }

    /// Tokens spent in the busiest `span` of arrivals (the record's ground truth), and the
    /// same in micro-USD.
    pub fn busiest(&self, span: Duration) -> (u64, f64) {
        let answers = self.answers();
        let mut most = (0, 0.0f64);
        for first in &answers {
            let within = answers
                .iter()
                .filter(|a| a.at >= first.at && a.at < first.at + span);
            let tokens: u64 = within.clone().map(|a| a.usage).sum();
            let money: f64 = within.map(|a| a.micro_usd).sum();
            most = (most.0.max(tokens), most.1.max(money));
        }
        most
    }

    /// Holds `tokens` of context under `id`, as if an earlier request had left it there.
    pub fn store(&self, id: &str, tokens: u64) {
        self.state
            .stored
            .lock()
            .expect("stored")
            .insert(id.to_owned(), tokens);
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

/// A `models:` section pricing the fake's two families in USD, with their image and tool
/// figures (as the providers list them): `gpt-4o-mini*` and `claude-sonnet-4*`.
pub fn priced_models() -> Node {
    Node::Seq(vec![
        Node::map([
            ("match", Node::from("gpt-4o-mini*")),
            ("per_image", Node::map([("low", 2833), ("high", 48169)])),
            ("max_output", Node::from(16384)),
            (
                "prices",
                Node::map([
                    ("currency", Node::from("USD")),
                    ("input", Node::from(0.15)),
                    ("cached_input", Node::from(0.075)),
                    ("output", Node::from(0.60)),
                ]),
            ),
        ]),
        Node::map([
            ("match", Node::from("claude-sonnet-4*")),
            ("per_image", Node::map([("low", 1600), ("high", 1600)])),
            ("tool_prompt", Node::from(346)),
            ("max_output", Node::from(64000)),
            (
                "prices",
                Node::map([
                    ("currency", Node::from("USD")),
                    ("input", Node::from(3)),
                    ("cached_input", Node::from(0.30)),
                    ("output", Node::from(15)),
                ]),
            ),
        ]),
    ])
}

/// A request header asking a charged answer to stop at this percentage of the output it may
/// generate (a model that finishes before its cap, as most answers do); 100 without it.
pub const FINISH_HEADER: &str = "x-fake-finish";

/// What a model bills, as its provider publishes it. `image_low`/`image_high`: one image at
/// low detail, and at high detail with the most tiles an image can have (8 tiles of 512 px:
/// scaled into 2048×2048, short side 768). Prices: USD per million tokens (input, output).
struct Model {
    image_low: u64,
    image_high: u64,
    /// Added when `tools` are given.
    tool_prompt: u64,
    /// The model's own largest output.
    max_output: u64,
    /// The context window: the most of the stored context one call can read (the API
    /// truncates the oldest turns, or refuses, beyond it).
    context: u64,
    price_in: f64,
    price_out: f64,
}

/// Sources: OpenAI "Images and vision", calculating costs (gpt-4o-mini 2,833 + 5,667 per tile;
/// gpt-4o 85 + 170 per tile); OpenAI model pages (max output 16,384) and pricing
/// (gpt-4o-mini $0.15/$0.60, gpt-4o $2.50/$10); Anthropic "Vision" (about 1,600 tokens for the
/// largest image), "Tool use" pricing (346 tokens of tool system prompt for Claude 4 models,
/// 530 for Claude 3 Opus), model overview (Sonnet 4 max output 64,000) and pricing ($3/$15).
/// Any other model: the most expensive of these figures.
fn model(name: &str) -> Model {
    if name.starts_with("gpt-4o-mini") {
        Model {
            image_low: 2_833,
            image_high: 2_833 + 8 * 5_667,
            tool_prompt: 0,
            max_output: 16_384,
            context: 128_000,
            price_in: 0.15,
            price_out: 0.60,
        }
    } else if name.starts_with("gpt-4o") {
        Model {
            image_low: 85,
            image_high: 85 + 8 * 170,
            tool_prompt: 0,
            max_output: 16_384,
            context: 128_000,
            price_in: 2.50,
            price_out: 10.00,
        }
    } else if name.starts_with("claude-3-opus") {
        Model {
            image_low: 1_600,
            image_high: 1_600,
            tool_prompt: 530,
            max_output: 4_096,
            context: 200_000,
            price_in: 15.0,
            price_out: 75.0,
        }
    } else if name.starts_with("claude") {
        Model {
            image_low: 1_600,
            image_high: 1_600,
            tool_prompt: 346,
            max_output: 64_000,
            context: 200_000,
            price_in: 3.0,
            price_out: 15.0,
        }
    } else {
        Model {
            image_low: 2_833,
            image_high: 2_833 + 8 * 5_667,
            tool_prompt: 530,
            max_output: 128_000,
            context: 2_097_152,
            price_in: 15.0,
            price_out: 75.0,
        }
    }
}

/// Pages billed for a file part (a PDF is billed per page, text and image; 100 pages is the
/// most OpenAI and Anthropic take in one file), and the text of one page at most.
const FILE_PAGES: u64 = 100;
const PAGE_TEXT: u64 = 3_000;
/// Tokens a server-side tool's results add to the context (a web search returns pages of
/// text; Anthropic bills them as input).
const SERVER_TOOL: u64 = 25_000;
/// A stored prompt (`prompt: {"id": …}`) holds this much.
const STORED_PROMPT: u64 = 20_000;

/// What a request spends, charged like its API: `Err` for a request the API refuses (it
/// spends nothing).
struct Charge {
    input: u64,
    output: u64,
    model: String,
}

fn charge(path: &str, body: &Value, stored: &HashMap<String, u64>) -> Result<Charge, String> {
    let name = body["model"].as_str().unwrap_or("unknown").to_owned();
    let m = model(&name);
    let mut input = 3 + text_bytes(body);
    let messages = body["messages"].as_array().map_or(0, Vec::len) as u64;
    // Responses input items that are messages get the template too (a plain text does not).
    let items = body["input"]
        .as_array()
        .map_or(0, |items| items.iter().filter(|i| i.is_object()).count()) as u64;
    input += 4 * (messages + items);
    let (images_low, images_high, files) = parts(body);
    input += images_low * m.image_low + images_high * m.image_high;
    input += files * FILE_PAGES * (PAGE_TEXT + m.image_high);
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    if !tools.is_empty() {
        input += m.tool_prompt;
    }
    let server_tools = tools
        .iter()
        .filter(|t| !matches!(t["type"].as_str(), None | Some("function" | "custom")))
        .count() as u64
        + u64::from(!body["web_search_options"].is_null())
        + body["mcp_servers"].as_array().map_or(0, Vec::len) as u64;
    input += server_tools * SERVER_TOOL;
    for field in ["previous_response_id", "conversation"] {
        if let Some(id) = body[field].as_str() {
            let held = stored
                .get(id)
                .copied()
                .ok_or(format!("no {field} `{id}`"))?;
            input += held.min(m.context);
        }
    }
    if body["prompt"].is_object() {
        input += STORED_PROMPT;
    }
    for reference in find_types(body, "item_reference") {
        input += reference["id"]
            .as_str()
            .and_then(|id| stored.get(id))
            .copied()
            .unwrap_or(STORED_PROMPT);
    }
    let cap =
        |fields: &[&str]| -> Option<u64> { fields.iter().filter_map(|f| body[*f].as_u64()).max() };
    let count = |field: &str| body[field].as_u64().unwrap_or(1);
    let output = if path.ends_with("/chat/completions") {
        cap(&["max_completion_tokens", "max_tokens"]).unwrap_or(m.max_output) * count("n")
    } else if path.ends_with("/completions") {
        let prompts = match &body["prompt"] {
            Value::Array(items) if !items.iter().all(Value::is_number) => items.len() as u64,
            _ => 1,
        };
        // The legacy API's own default cap is 16.
        cap(&["max_tokens"]).unwrap_or(16) * count("n").max(count("best_of")) * prompts
    } else if path.ends_with("/responses") {
        cap(&["max_output_tokens"]).unwrap_or(m.max_output)
    } else if path.ends_with("/embeddings") {
        0
    } else if path.ends_with("/messages") {
        cap(&["max_tokens"]).ok_or("max_tokens: Field required")?
    } else {
        return Err(format!("no such endpoint {path}"));
    };
    Ok(Charge {
        input,
        output,
        model: name,
    })
}

/// The bytes of every text in the body (object keys aside), counted as tokens: the most a
/// byte-level BPE tokenizer can make of them.
fn text_bytes(value: &Value) -> u64 {
    match value {
        Value::String(text) => text.len() as u64,
        // A token id is one token.
        Value::Number(_) => 1,
        Value::Array(items) => items.iter().map(text_bytes).sum(),
        Value::Object(fields) => fields
            .iter()
            .filter(|(key, _)| !matches!(key.as_str(), "model" | "type" | "role" | "detail"))
            .map(|(_, v)| text_bytes(v))
            .sum(),
        _ => 0,
    }
}

/// Low-detail images, other images, and files, audio, video and documents in the body.
fn parts(body: &Value) -> (u64, u64, u64) {
    let (mut low, mut high, mut files) = (0, 0, 0);
    let mut stack = vec![body];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                match fields.get("type").and_then(Value::as_str) {
                    Some("image_url" | "input_image" | "image") => {
                        let detail = fields
                            .get("detail")
                            .or_else(|| fields.get("image_url").and_then(|u| u.get("detail")))
                            .and_then(Value::as_str);
                        if detail == Some("low") {
                            low += 1;
                        } else {
                            high += 1;
                        }
                    }
                    Some(
                        "file" | "input_file" | "input_audio" | "audio" | "document" | "video"
                        | "video_url",
                    ) => files += 1,
                    _ => {}
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    (low, high, files)
}

fn find_types<'v>(value: &'v Value, kind: &str) -> Vec<&'v Value> {
    let mut found = Vec::new();
    let mut stack = vec![value];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                if fields.get("type").and_then(Value::as_str) == Some(kind) {
                    found.push(value);
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    found
}

/// A problem the API answers with, having spent nothing.
fn refusal(message: String) -> Response<Body> {
    Response::builder()
        .status(StatusCode::BAD_REQUEST)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(Full::new(Bytes::from(
            json!({"error": {"message": message}}).to_string(),
        ))))
        .expect("a response")
}

async fn answer(
    request: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<Body>, Infallible> {
    let arrived = Instant::now();
    let path = request.uri().path().to_owned();
    let finish = request
        .headers()
        .get(FINISH_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(100, |percent| percent.min(100));
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    state.bodies.lock().expect("bodies").push(body.clone());
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if request.get("sim").is_none() {
        return Ok(charged(&path, &request, finish, arrived, &state));
    }
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
    let tail = Duration::from_millis(sim["tail_ms"].as_u64().unwrap_or(0));
    if let Some(delay) = sim["delay_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let index = {
        let mut answers = state.answers.lock().expect("answers");
        let asked = request["model"].as_str().unwrap_or_default().to_owned();
        state.asked.lock().expect("asked").push(asked);
        let usage = if mode == "none" { 0 } else { usage };
        answers.push(Answer {
            at: arrived,
            usage,
            input: usage / 3,
            output: usage - usage / 3,
            micro_usd: 0.0,
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
                tokio::time::sleep(tail).await;
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

/// The answer to a request without `sim`: charged like the real API, its usage reported in
/// the API's own shape (JSON, or the API's events when it asks to `stream`).
fn charged(
    path: &str,
    request: &Value,
    finish: u64,
    arrived: Instant,
    state: &State,
) -> Response<Body> {
    let stored = state.stored.lock().expect("stored").clone();
    let charge = match charge(path, request, &stored) {
        Ok(charge) => charge,
        Err(message) => return refusal(message),
    };
    let m = model(&charge.model);
    // A model that finishes its answer before the cap generates less than the most allowed.
    let (input, output) = (charge.input, charge.output * finish / 100);
    let micro_usd = input as f64 * m.price_in + output as f64 * m.price_out;
    let id = {
        let mut answers = state.answers.lock().expect("answers");
        state
            .asked
            .lock()
            .expect("asked")
            .push(charge.model.clone());
        answers.push(Answer {
            at: arrived,
            usage: input + output,
            input,
            output,
            micro_usd,
            finished: Some(Instant::now()),
        });
        format!("resp_{}", answers.len())
    };
    // What a later request referring to this one reads: all of this one's context.
    {
        let mut stored = state.stored.lock().expect("stored");
        stored.insert(id.clone(), input + output);
        if let Some(conversation) = request["conversation"].as_str() {
            stored.insert(conversation.to_owned(), input + output);
        }
    }
    let stream = request["stream"].as_bool().unwrap_or(false);
    let (content_type, text) = if path.ends_with("/messages") {
        let usage = json!({"input_tokens": input, "output_tokens": output});
        if stream {
            (
                "text/event-stream",
                format!(
                    "event: message_start\ndata: {}\n\nevent: message_delta\ndata: {}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n",
                    json!({"type": "message_start", "message": {"id": id, "usage": {"input_tokens": input, "output_tokens": 1}}}),
                    json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": output}}),
                ),
            )
        } else {
            (
                "application/json",
                json!({"id": id, "type": "message", "content": [{"type": "text", "text": "…"}], "usage": usage}).to_string(),
            )
        }
    } else if path.ends_with("/responses") {
        let response = json!({"id": id, "object": "response", "status": "incomplete",
            "usage": {"input_tokens": input, "output_tokens": output, "total_tokens": input + output}});
        if stream {
            (
                "text/event-stream",
                format!(
                    "event: response.completed\ndata: {}\n\n",
                    json!({"type": "response.completed", "response": response})
                ),
            )
        } else {
            ("application/json", response.to_string())
        }
    } else {
        let usage = json!({"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output});
        let include_usage = request["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false);
        if stream {
            let last = if include_usage {
                format!("data: {}\n\n", json!({"choices": [], "usage": usage}))
            } else {
                String::new()
            };
            (
                "text/event-stream",
                format!(
                    "data: {}\n\n{last}data: [DONE]\n\n",
                    json!({"id": id, "choices": [{"delta": {"content": "…"}}]})
                ),
            )
        } else {
            (
                "application/json",
                json!({"id": id, "object": "chat.completion", "choices": [], "data": [], "usage": usage}).to_string(),
            )
        }
    };
    Response::builder()
        .header("content-type", content_type)
        .body(BodyExt::boxed(Full::new(Bytes::from(text))))
        .expect("a response")
}
