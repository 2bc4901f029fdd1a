//! The reservation of an LLM request: an upper bound of the tokens it can consume, computed
//! from its buffered JSON body, the API its path names and the facts of its `model`
//! (`llm::models`), without a tokenizer. Pure: the same path, bytes and facts give the same
//! bound.
//!
//! **The rule.** `total = input + output`, where
//! - `input = body bytes + per image (low or high detail) + per other non-text part
//!   + per_request (the route's and the model's) + tool_prompt (when `tools` is not empty)
//!   + stored_state (when the body refers to stored state and the route charges it)
//!   + server_tool × server tools (when the route charges them)`;
//! - `output = cap × completions`.
//!
//! Why each term bounds what the provider bills:
//! - Text: the tokenizers of these APIs are byte-level BPE, every token covers at least one
//!   byte, so a text of n bytes is at most n tokens. Every prompt text is in the body and JSON
//!   escaping only lengthens it; the chat template's few tokens per message are fewer than
//!   the JSON bytes around each message (`{"role":"","content":""},`). Token ids given as
//!   integers (`prompt: [1, 2]`) take at least one digit and a separator each.
//! - A part that is not text (image, file, audio, video, document) is billed by what it
//!   shows, not by its bytes: an image `image_low` with `detail: "low"`, else `image_high`;
//!   any other part `per_non_text_part` — the model's figures, or the route's
//!   `reserve.per_non_text_part` when larger.
//! - What the provider adds and the body does not carry: `per_request`, and the tool-use
//!   system prompt (`tool_prompt`) when `tools` is given.
//! - Output: `cap` is the request's own cap — `max_tokens`, `max_completion_tokens`,
//!   `max_output_tokens`, the largest if several — or, when it names none, the cap sluice
//!   writes into the forwarded body: `reserve.default_output` if set, else the model's
//!   `max_output`, never above the route's `reserve.max_output`. A cap above
//!   `reserve.max_output` is refused, not lowered. `completions` is what the API generates
//!   per request: Chat Completions `n`; legacy Completions `max(n, best_of)` times the number
//!   of prompts when `prompt` is an array of texts or of token arrays; Responses and
//!   Anthropic Messages 1; an unknown API `max(n, best_of)`; Embeddings generate nothing
//!   (output 0).
//! - What the body cannot bound is refused (422, the field named), unless the route says how
//!   to charge it: references to state the provider holds (`previous_response_id`,
//!   `conversation`, a stored `prompt` object, `item_reference` input items) unless
//!   `reserve.stored_state` is set (the model's `context` or a figure); tools run on the
//!   provider's side (any tool `type` other than `function` or `custom`, Chat's
//!   `web_search_options`, Anthropic's `mcp_servers`) unless `reserve.server_tool` is set (per
//!   tool); Assistants and Batch paths (`/threads`, `/batches`) always; an unknown API path
//!   whose body names no cap (sluice does not know which field to write).

use serde_json::{Map, Value};

use super::models::{ModelFacts, Models, Prices};

/// How a token limit reserves: its `reserve:` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    /// Output cap written and reserved when the request names none; `None`: the model's
    /// `max_output`.
    pub default_output: Option<u32>,
    /// Largest output cap a request may name, and most ever written.
    pub max_output: u32,
    /// With the model's `per_non_text_part`, the larger applies.
    pub per_non_text_part: Option<u32>,
    /// Added to the model's `per_request`: what the route adds that is not in the body.
    pub per_request: u32,
    /// Largest request body read (bytes).
    pub max_body: u64,
    /// What a reference to stored state is charged; `None`: refused.
    pub stored_state: Option<StoredState>,
    /// What each server-side tool is charged; `None`: refused.
    pub server_tool: Option<u32>,
}

/// How a route charges input the provider holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredState {
    /// The model's context window: the most one call can read.
    Context,
    Tokens(u32),
}

/// The API a path names, by its last segments (so `/openai/deployments/x/chat/completions`
/// is Chat Completions too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Completions,
    Responses,
    Embeddings,
    AnthropicMessages,
    /// Assistants threads and runs, Batch: spending the request sets in motion later.
    Unbounded,
    Other,
}

impl Api {
    pub fn of_path(path: &str) -> Api {
        let path = path.trim_end_matches('/');
        if path
            .split('/')
            .any(|segment| segment == "threads" || segment == "batches")
        {
            Api::Unbounded
        } else if path.ends_with("/chat/completions") {
            Api::ChatCompletions
        } else if path.ends_with("/completions") {
            Api::Completions
        } else if path.ends_with("/responses") {
            Api::Responses
        } else if path.ends_with("/embeddings") {
            Api::Embeddings
        } else if path.ends_with("/messages") {
            Api::AnthropicMessages
        } else {
            Api::Other
        }
    }

    /// The field sluice writes its cap into when the request names none. Chat Completions:
    /// `max_completion_tokens`, the one OpenAI accepts for every model (`max_tokens` is
    /// deprecated there and refused by its reasoning models).
    pub fn cap_field(self) -> Option<&'static str> {
        match self {
            Api::ChatCompletions => Some("max_completion_tokens"),
            Api::Completions | Api::AnthropicMessages => Some("max_tokens"),
            Api::Responses => Some("max_output_tokens"),
            Api::Embeddings | Api::Unbounded | Api::Other => None,
        }
    }
}

/// The output cap fields, OpenAI's and Anthropic's spellings.
pub const OUTPUT_CAP_FIELDS: [&str; 3] =
    ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// The `type` of an image part (OpenAI Chat, Responses; Anthropic).
pub const IMAGE_PART_TYPES: [&str; 3] = ["image_url", "input_image", "image"];

/// The `type` of a part that is neither text nor an image.
pub const OTHER_PART_TYPES: [&str; 7] = [
    "file",
    "input_file",
    "input_audio",
    "audio",
    "document",
    "video",
    "video_url",
];

/// The parts of one reservation, for the problem bodies, `explain` and pricing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reservation {
    /// Upper bound of the prompt's text tokens: the body's length in bytes.
    pub prompt: u64,
    /// Image parts, and what they are charged together.
    pub images: u64,
    pub image_tokens: u64,
    /// Other non-text parts, and what they are charged together.
    pub parts: u64,
    pub part_tokens: u64,
    /// `per_request` (route and model) plus the tool prompt when tools are given.
    pub overhead: u64,
    /// The stored-state charge, when the body refers to it.
    pub stored: u64,
    /// Server-side tools, and what they are charged together.
    pub server_tools: u64,
    pub server_tool_tokens: u64,
    /// Completions generated, each up to `cap`.
    pub completions: u64,
    pub cap: u64,
    /// Everything read: the input bound.
    pub input: u64,
    /// `cap × completions`.
    pub output: u64,
    /// `input + output`: the check's cost in tokens.
    pub total: u64,
    /// The request named no cap: sluice must write `cap` into this field before forwarding.
    pub write_cap: Option<&'static str>,
}

impl Reservation {
    /// The most this reservation can cost at `prices`, in micro-currency, rounded up: every
    /// input token at the input price (at the cache-write price when the body asks for
    /// caching, `cache_control`), every output token at the output price.
    pub fn price(&self, prices: &Prices, caches: bool) -> u64 {
        let mut input = prices.input.max(prices.cached_input);
        if caches {
            input = input.max(prices.cache_write);
        }
        let pico = u128::from(self.input) * u128::from(input)
            + u128::from(self.output) * u128::from(prices.output);
        u64::try_from(pico.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// Whether the body asks the provider to write its cache (Anthropic's `cache_control`), at
/// any depth. Read from the parsed body, whose keys are decoded as the provider decodes them:
/// `"cache\u005fcontrol"` is `cache_control` to every JSON reader, so a search of the raw
/// bytes would miss it.
pub fn asks_caching(fields: &Map<String, Value>) -> bool {
    fn within(value: &Value) -> bool {
        match value {
            Value::Object(map) => map.contains_key("cache_control") || map.values().any(within),
            Value::Array(items) => items.iter().any(within),
            _ => false,
        }
    }
    fields.contains_key("cache_control") || fields.values().any(within)
}

/// Why a request body cannot be reserved for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    #[error("the request body is not JSON: {0}")]
    NotJson(String),
    #[error("the request body is not a JSON object")]
    NotObject,
    #[error(
        "the request body names `{0}` more than once in one object, which JSON readers read \
         differently (the first or the last): it has no single reading to reserve for"
    )]
    RepeatedKey(String),
    #[error("`{field}` must be a non-negative integer")]
    BadCap { field: &'static str },
    #[error("`{field}` must be a positive integer")]
    BadCount { field: &'static str },
    #[error("`{field}` asks for {asked} output tokens; this route allows at most {max}")]
    CapTooLarge {
        field: &'static str,
        asked: u64,
        max: u32,
    },
    #[error(
        "`{field}` refers to input the provider holds, which the body cannot bound; this \
         route does not charge stored state (`reserve.stored_state`)"
    )]
    StoredState { field: &'static str },
    #[error(
        "`{field}` asks for a tool run on the provider's side (`{kind}`), whose input the body \
         cannot bound; this route does not charge server tools (`reserve.server_tool`)"
    )]
    ServerTool { field: &'static str, kind: String },
    #[error(
        "this path is an Assistants or Batch endpoint: what it spends is set in motion later \
         and cannot be reserved for"
    )]
    UnboundedEndpoint,
    #[error(
        "the request names no output cap (`max_tokens`, `max_completion_tokens` or \
         `max_output_tokens`) and sluice does not know which one this API reads"
    )]
    NoCap,
}

impl EstimateError {
    /// 413 for a cap too large; 422 for what is valid but cannot be bounded; 400 otherwise.
    pub fn status(&self) -> http::StatusCode {
        match self {
            EstimateError::CapTooLarge { .. } => http::StatusCode::PAYLOAD_TOO_LARGE,
            EstimateError::StoredState { .. }
            | EstimateError::ServerTool { .. }
            | EstimateError::UnboundedEndpoint
            | EstimateError::NoCap => http::StatusCode::UNPROCESSABLE_ENTITY,
            _ => http::StatusCode::BAD_REQUEST,
        }
    }
}

/// The JSON object of a request body. An object naming a key twice is refused: serde_json
/// keeps the last, other readers (the upstream's among them, perhaps) the first, so a body
/// could reserve for one `model` or `max_tokens` and be served by the other.
pub fn parse(body: &[u8]) -> Result<Map<String, Value>, EstimateError> {
    let value = match serde_json::from_slice::<Unrepeated>(body) {
        Ok(Unrepeated(value)) => value,
        Err(e) => {
            let text = e.to_string();
            return Err(match text.strip_prefix(REPEATED) {
                Some(rest) => EstimateError::RepeatedKey(
                    rest.split('`').next().unwrap_or_default().to_owned(),
                ),
                None => EstimateError::NotJson(text),
            });
        }
    };
    match value {
        Value::Object(fields) => Ok(fields),
        _ => Err(EstimateError::NotObject),
    }
}

/// The start of the error `Unrepeated` raises for a repeated key, before the key.
const REPEATED: &str = "repeated key `";

/// A JSON value read like `serde_json::Value`, but refusing an object that names a key twice.
struct Unrepeated(Value);

impl<'de> serde::Deserialize<'de> for Unrepeated {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_any(UnrepeatedVisitor)
            .map(Unrepeated)
    }
}

struct UnrepeatedVisitor;

impl<'de> serde::de::Visitor<'de> for UnrepeatedVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Unrepeated(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut fields = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Unrepeated(value) = map.next_value()?;
            if fields.insert(key.clone(), value).is_some() {
                return Err(serde::de::Error::custom(format!("{REPEATED}{key}`")));
            }
        }
        Ok(Value::Object(fields))
    }
}

/// The body's `model`, if it names one.
pub fn model_of(fields: &Map<String, Value>) -> Option<&str> {
    fields.get("model").and_then(Value::as_str)
}

/// The reservation of `body` (its parsed `fields`, `len` bytes), sent to `api`, under
/// `reserve` and the facts of its model in `models`.
pub fn estimate(
    api: Api,
    fields: &Map<String, Value>,
    len: u64,
    reserve: &Reserve,
    models: &Models,
) -> Result<Reservation, EstimateError> {
    if api == Api::Unbounded {
        return Err(EstimateError::UnboundedEndpoint);
    }
    let facts = models.lookup(model_of(fields));
    let named = named_cap(fields, reserve)?;
    let (cap, write_cap) = match (named, api.cap_field()) {
        _ if api == Api::Embeddings => (0, None),
        (Some(cap), _) => (cap, None),
        (None, Some(field)) => (u64::from(default_cap(reserve, facts)), Some(field)),
        (None, None) => return Err(EstimateError::NoCap),
    };
    let completions = completions(api, fields)?;
    let stored = stored_state(fields, reserve, facts)?;
    let (server_tools, server_tool_tokens) = server_tools(fields, reserve)?;
    let (images, image_tokens, parts) = non_text_parts(fields, facts);
    let per_part = u64::from(
        reserve
            .per_non_text_part
            .map_or(facts.per_non_text_part, |p| p.max(facts.per_non_text_part)),
    );
    let has_tools = fields
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| !tools.is_empty());
    let overhead = u64::from(reserve.per_request)
        + u64::from(facts.per_request)
        + if has_tools {
            u64::from(facts.tool_prompt)
        } else {
            0
        };
    let part_tokens = parts.saturating_mul(per_part);
    let input = len
        .saturating_add(image_tokens)
        .saturating_add(part_tokens)
        .saturating_add(overhead)
        .saturating_add(stored)
        .saturating_add(server_tool_tokens);
    let output = cap.saturating_mul(completions);
    Ok(Reservation {
        prompt: len,
        images,
        image_tokens,
        parts,
        part_tokens,
        overhead,
        stored,
        server_tools,
        server_tool_tokens,
        completions,
        cap,
        input,
        output,
        total: input.saturating_add(output),
        write_cap,
    })
}

/// The cap written when the request names none.
pub fn default_cap(reserve: &Reserve, facts: &ModelFacts) -> u32 {
    reserve
        .default_output
        .map_or(facts.max_output, |d| d.min(facts.max_output))
        .min(reserve.max_output)
}

/// `body` with `field` set to `cap`, for the upstream.
pub fn with_cap(mut fields: Map<String, Value>, field: &str, cap: u64) -> Vec<u8> {
    fields.insert(field.to_owned(), Value::from(cap));
    // A map of JSON values always serializes.
    serde_json::to_vec(&Value::Object(fields)).unwrap_or_default()
}

/// The largest cap the request names, refused above the route's `max_output`.
fn named_cap(fields: &Map<String, Value>, reserve: &Reserve) -> Result<Option<u64>, EstimateError> {
    let mut cap: Option<u64> = None;
    for field in OUTPUT_CAP_FIELDS {
        match fields.get(field) {
            None | Some(Value::Null) => {}
            Some(value) => {
                let asked = value.as_u64().ok_or(EstimateError::BadCap { field })?;
                if asked > u64::from(reserve.max_output) {
                    return Err(EstimateError::CapTooLarge {
                        field,
                        asked,
                        max: reserve.max_output,
                    });
                }
                cap = Some(cap.map_or(asked, |c| c.max(asked)));
            }
        }
    }
    Ok(cap)
}

/// A positive integer field, 1 when absent.
fn count(fields: &Map<String, Value>, field: &'static str) -> Result<u64, EstimateError> {
    match fields.get(field) {
        None | Some(Value::Null) => Ok(1),
        Some(value) => match value.as_u64() {
            Some(n) if n > 0 => Ok(n),
            _ => Err(EstimateError::BadCount { field }),
        },
    }
}

/// How many completions the request generates, each up to the cap.
fn completions(api: Api, fields: &Map<String, Value>) -> Result<u64, EstimateError> {
    match api {
        Api::ChatCompletions => count(fields, "n"),
        Api::Completions => {
            let per_prompt = count(fields, "n")?.max(count(fields, "best_of")?);
            let prompts = match fields.get("prompt") {
                // An array of token ids is one prompt; of texts or token arrays, one each.
                Some(Value::Array(items)) if !items.iter().all(Value::is_number) => {
                    items.len().max(1) as u64
                }
                _ => 1,
            };
            Ok(per_prompt.saturating_mul(prompts))
        }
        // Unknown APIs: whichever multiplier they name, the largest governs.
        Api::Other => Ok(count(fields, "n")?.max(count(fields, "best_of")?)),
        _ => Ok(1),
    }
}

/// The stored-state charge, or the refusal naming the field.
fn stored_state(
    fields: &Map<String, Value>,
    reserve: &Reserve,
    facts: &ModelFacts,
) -> Result<u64, EstimateError> {
    let present = |field: &str| !matches!(fields.get(field), None | Some(Value::Null));
    let field = if present("previous_response_id") {
        Some("previous_response_id")
    } else if present("conversation") {
        Some("conversation")
    } else if matches!(fields.get("prompt"), Some(Value::Object(_))) {
        Some("prompt")
    } else if fields
        .get("input")
        .is_some_and(|input| has_type(input, |kind| kind == "item_reference"))
    {
        Some("input")
    } else {
        None
    };
    let Some(field) = field else { return Ok(0) };
    match reserve.stored_state {
        None => Err(EstimateError::StoredState { field }),
        Some(StoredState::Context) => Ok(u64::from(facts.context)),
        Some(StoredState::Tokens(n)) => Ok(u64::from(n)),
    }
}

/// Server-side tools: how many, and what they are charged; or the refusal naming the first.
fn server_tools(
    fields: &Map<String, Value>,
    reserve: &Reserve,
) -> Result<(u64, u64), EstimateError> {
    let mut found: Vec<(&'static str, String)> = Vec::new();
    if let Some(Value::Array(tools)) = fields.get("tools") {
        for tool in tools {
            match tool.get("type").and_then(Value::as_str) {
                None | Some("function" | "custom") => {}
                Some(kind) => found.push(("tools", kind.to_owned())),
            }
        }
    }
    if !matches!(fields.get("web_search_options"), None | Some(Value::Null)) {
        found.push(("web_search_options", "web_search".to_owned()));
    }
    if let Some(Value::Array(servers)) = fields.get("mcp_servers") {
        found.extend(servers.iter().map(|_| ("mcp_servers", "mcp".to_owned())));
    }
    match (found.first(), reserve.server_tool) {
        (None, _) => Ok((0, 0)),
        (Some((field, kind)), None) => Err(EstimateError::ServerTool {
            field,
            kind: kind.clone(),
        }),
        (Some(_), Some(each)) => {
            let n = found.len() as u64;
            Ok((n, n.saturating_mul(u64::from(each))))
        }
    }
}

/// Whether an object with a `type` that `wanted` accepts is anywhere in `value`.
fn has_type(value: &Value, wanted: impl Fn(&str) -> bool) -> bool {
    let mut stack = vec![value];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                if let Some(Value::String(kind)) = fields.get("type") {
                    if wanted(kind) {
                        return true;
                    }
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    false
}

/// Image parts, what they cost, and other non-text parts, anywhere in the body. Walked with
/// an explicit stack: serde_json already refused nesting deeper than its recursion limit. An
/// object of one of these `type`s counts wherever it is, so a look-alike only raises the bound.
fn non_text_parts(fields: &Map<String, Value>, facts: &ModelFacts) -> (u64, u64, u64) {
    let (mut images, mut image_tokens, mut parts) = (0u64, 0u64, 0u64);
    let mut stack: Vec<&Value> = fields.values().collect();
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                if let Some(Value::String(kind)) = fields.get("type") {
                    if IMAGE_PART_TYPES.contains(&kind.as_str()) {
                        images += 1;
                        image_tokens = image_tokens.saturating_add(u64::from(if is_low(fields) {
                            facts.image_low
                        } else {
                            facts.image_high
                        }));
                    } else if OTHER_PART_TYPES.contains(&kind.as_str()) {
                        parts += 1;
                    }
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    (images, image_tokens, parts)
}

/// `detail: "low"` on the part (Responses) or its `image_url` object (Chat Completions).
fn is_low(part: &Map<String, Value>) -> bool {
    let low = |v: Option<&Value>| v.and_then(Value::as_str) == Some("low");
    low(part.get("detail")) || low(part.get("image_url").and_then(|u| u.get("detail")))
}

#[cfg(test)]
mod tests;
