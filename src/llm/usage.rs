//! What an LLM response says it consumed, read as the body streams past, in bounded memory.
//!
//! A JSON answer carries a top-level `usage` object; a streamed one (`text/event-stream`)
//! carries it in some events: OpenAI Chat Completions in its last chunk (`usage`, with
//! `stream_options.include_usage`), the Responses API in `response.completed`
//! (`response.usage`), Anthropic in `message_start` (`message.usage`, the input) and
//! `message_delta` (`usage`, the cumulative output). The scanner never holds the body: it
//! follows the JSON's nesting byte by byte (depth, strings, the keys of the first three
//! levels) and copies only the bytes of a `usage` object, at most `CAPTURE_MAX`; a larger
//! one is not read (no figure: the reservation is kept). Server-Sent Events are split into
//! fields as they arrive, with no line buffer: the `data` of each event is fed straight to a
//! fresh JSON scanner. So one response costs `CAPTURE_MAX` plus a few dozen bytes, whatever
//! the size of its body or of any one event.
//!
//! Each figure is the latest the response gave (Anthropic's `output_tokens` is cumulative);
//! the count is `total_tokens`, or input plus output, the larger when both are given, so a
//! provider that reports both never gets the smaller.

use serde::Deserialize;

mod decode;

pub use self::decode::DecodingScanner;

/// Most bytes of one `usage` object copied for parsing.
pub const CAPTURE_MAX: usize = 4096;
/// Nesting levels whose keys are followed (`message.usage` is at the second).
const TRACKED: usize = 3;
/// Longest key compared (the keys looked for are shorter).
const KEY_MAX: usize = 12;

/// The figures a response gave; `None` for one it did not give.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    pub total: Option<u64>,
    /// Of `input`, read from the provider's cache (OpenAI `*_tokens_details.cached_tokens`,
    /// Anthropic `cache_read_input_tokens`): priced at `cached_input`.
    pub cached: Option<u64>,
    /// Of `input`, written to the cache (Anthropic `cache_creation_input_tokens`): priced at
    /// `cache_write`.
    pub cache_write: Option<u64>,
}

impl Usage {
    /// The tokens consumed, when the response gave a whole figure.
    pub fn used(&self) -> Option<u64> {
        let parts = self
            .input
            .zip(self.output)
            .map(|(i, o)| i.saturating_add(o));
        match (self.total, parts) {
            (Some(total), Some(parts)) => Some(total.max(parts)),
            (total, parts) => total.or(parts),
        }
    }

    /// What the figures cost at `prices`, in micro-currency rounded up: each part at its
    /// price, and whatever the total says beyond input and output at the highest price.
    pub fn priced(&self, prices: &super::Prices) -> Option<u64> {
        let used = self.used()?;
        let (input, output) = (self.input.unwrap_or(0), self.output.unwrap_or(0));
        let cached = self.cached.unwrap_or(0).min(input);
        let written = self.cache_write.unwrap_or(0).min(input - cached);
        let plain = input - cached - written;
        let unknown = used.saturating_sub(input.saturating_add(output));
        let highest = prices.input.max(prices.output).max(prices.cache_write);
        let pico = u128::from(plain) * u128::from(prices.input)
            + u128::from(cached) * u128::from(prices.cached_input)
            + u128::from(written) * u128::from(prices.cache_write)
            + u128::from(output) * u128::from(prices.output)
            + u128::from(unknown) * u128::from(highest);
        Some(u64::try_from(pico.div_ceil(1_000_000)).unwrap_or(u64::MAX))
    }

    fn merge(&mut self, newer: Usage) {
        self.input = newer.input.or(self.input);
        self.output = newer.output.or(self.output);
        self.total = newer.total.or(self.total);
        self.cached = newer.cached.or(self.cached);
        self.cache_write = newer.cache_write.or(self.cache_write);
    }
}

/// The fields of a usage object, in every spelling read.
#[derive(Deserialize)]
struct RawUsage {
    total_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens_details: Option<Details>,
}

/// OpenAI's `prompt_tokens_details` / `input_tokens_details`.
#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

impl RawUsage {
    fn usage(&self) -> Usage {
        // Anthropic's `input_tokens` leaves out the cached ones, which count too.
        let anthropic = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        let input = if anthropic.iter().any(Option::is_some) {
            Some(
                anthropic
                    .iter()
                    .flatten()
                    .fold(0u64, |a, &b| a.saturating_add(b)),
            )
        } else {
            self.prompt_tokens
        };
        let details = self
            .prompt_tokens_details
            .as_ref()
            .or(self.input_tokens_details.as_ref());
        Usage {
            input,
            output: self.output_tokens.or(self.completion_tokens),
            total: self.total_tokens,
            cached: self
                .cache_read_input_tokens
                .or(details.and_then(|d| d.cached_tokens)),
            cache_write: self.cache_creation_input_tokens,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Usage,
    /// `message` (Anthropic's `message_start`) or `response` (OpenAI's `response.completed`).
    Wrapper,
    Other,
}

/// Finds the usage objects of one JSON text fed in pieces.
#[derive(Debug, Clone)]
pub struct JsonScan {
    depth: usize,
    containers: [Container; TRACKED],
    keys: [Key; TRACKED],
    expect_key: bool,
    in_string: bool,
    escaped: bool,
    string_is_key: bool,
    key: [u8; KEY_MAX],
    /// Bytes of the key so far; past `KEY_MAX`, it matches nothing.
    key_len: usize,
    capture: Option<Vec<u8>>,
    capture_depth: usize,
    capture_overflow: bool,
    found: Usage,
}

impl Default for JsonScan {
    fn default() -> Self {
        JsonScan {
            depth: 0,
            containers: [Container::Array; TRACKED],
            keys: [Key::Other; TRACKED],
            expect_key: false,
            in_string: false,
            escaped: false,
            string_is_key: false,
            key: [0; KEY_MAX],
            key_len: 0,
            capture: None,
            capture_depth: 0,
            capture_overflow: false,
            found: Usage::default(),
        }
    }
}

impl JsonScan {
    pub fn feed(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.byte(byte);
        }
    }

    /// The usage this text has given so far.
    pub fn found(&self) -> Usage {
        self.found
    }

    fn byte(&mut self, b: u8) {
        if let Some(capture) = &mut self.capture {
            if capture.len() < CAPTURE_MAX {
                capture.push(b);
            } else {
                self.capture_overflow = true;
            }
        }
        if self.in_string {
            self.string_byte(b);
            return;
        }
        match b {
            b'"' => {
                self.in_string = true;
                self.string_is_key = self.expect_key;
                self.key_len = 0;
            }
            b'{' => {
                if self.capture.is_none() && self.usage_starts_here() {
                    let mut capture = Vec::with_capacity(256);
                    capture.push(b'{');
                    self.capture = Some(capture);
                    self.capture_depth = self.depth + 1;
                    self.capture_overflow = false;
                }
                self.open(Container::Object);
            }
            b'[' => self.open(Container::Array),
            b'}' | b']' => {
                if self.depth == self.capture_depth {
                    self.end_capture();
                }
                self.depth = self.depth.saturating_sub(1);
                self.expect_key = false;
            }
            b',' => self.expect_key = self.in_object(),
            b':' => self.expect_key = false,
            _ => {}
        }
    }

    fn string_byte(&mut self, b: u8) {
        if self.escaped {
            self.escaped = false;
        } else if b == b'\\' {
            self.escaped = true;
        } else if b == b'"' {
            self.in_string = false;
            if self.string_is_key && (1..=TRACKED).contains(&self.depth) {
                self.keys[self.depth - 1] = match &self.key[..self.key_len.min(KEY_MAX)] {
                    _ if self.key_len > KEY_MAX => Key::Other,
                    b"usage" => Key::Usage,
                    b"message" | b"response" => Key::Wrapper,
                    _ => Key::Other,
                };
            }
            return;
        }
        // An escaped key is compared as written, so it matches none of ours.
        if self.string_is_key {
            if self.key_len < KEY_MAX {
                self.key[self.key_len] = b;
            }
            self.key_len = self.key_len.saturating_add(1);
        }
    }

    fn open(&mut self, container: Container) {
        self.depth = self.depth.saturating_add(1);
        if (1..=TRACKED).contains(&self.depth) {
            self.containers[self.depth - 1] = container;
            self.keys[self.depth - 1] = Key::Other;
        }
        self.expect_key = container == Container::Object;
    }

    fn in_object(&self) -> bool {
        (1..=TRACKED).contains(&self.depth) && self.containers[self.depth - 1] == Container::Object
    }

    /// Whether an object opening now is the value of `usage`, `message.usage` or
    /// `response.usage`.
    fn usage_starts_here(&self) -> bool {
        let object = |depth: usize| self.containers[depth - 1] == Container::Object;
        match self.depth {
            1 => object(1) && self.keys[0] == Key::Usage,
            2 => {
                object(1) && object(2) && self.keys[0] == Key::Wrapper && self.keys[1] == Key::Usage
            }
            _ => false,
        }
    }

    fn end_capture(&mut self) {
        let Some(bytes) = self.capture.take() else {
            return;
        };
        self.capture_depth = 0;
        if self.capture_overflow {
            return;
        }
        if let Ok(raw) = serde_json::from_slice::<RawUsage>(&bytes) {
            self.found.merge(raw.usage());
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Nothing of this line yet: a line end here ends the event.
    Start,
    /// Reading the field name.
    Field,
    /// After `data:`, where one space is skipped.
    DataStart,
    Data,
    /// After `event:`: the event's name, kept to tell the stream's last event.
    Name,
    /// A field other than `data` and `event` (or a comment): skipped.
    Ignore,
}

/// The names of the events that end a stream (Anthropic's `message_stop`, the Responses
/// API's terminal events), and the data of Chat Completions' last one: after them the
/// answer's usage is whole.
const LAST_EVENTS: [&[u8]; 4] = [
    b"message_stop",
    b"response.completed",
    b"response.incomplete",
    b"response.failed",
];
const LAST_DATA: &[u8] = b"[DONE]";

/// Finds the usage of a Server-Sent Events stream fed in pieces.
#[derive(Debug, Clone)]
pub struct SseScan {
    line: Line,
    field: [u8; 5],
    field_len: usize,
    after_cr: bool,
    event_has_data: bool,
    event: JsonScan,
    found: Usage,
    /// The event's name (`event:`), as far as `name` holds it.
    name: [u8; 20],
    name_len: usize,
    /// The start of the event's data, enough to tell `[DONE]`.
    head: [u8; 7],
    head_len: usize,
    /// The stream's last event has been dispatched.
    ended: bool,
}

impl Default for SseScan {
    fn default() -> Self {
        SseScan {
            line: Line::Start,
            field: [0; 5],
            field_len: 0,
            after_cr: false,
            event_has_data: false,
            event: JsonScan::default(),
            found: Usage::default(),
            name: [0; 20],
            name_len: 0,
            head: [0; 7],
            head_len: 0,
            ended: false,
        }
    }
}

impl SseScan {
    pub fn feed(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.byte(byte);
        }
    }

    /// The usage of the events dispatched so far (an event counts once a blank line ends it,
    /// as a browser's EventSource would see it).
    pub fn found(&self) -> Usage {
        self.found
    }

    /// Whether the stream's last event (`data: [DONE]`, `message_stop`, a terminal
    /// `response.*`) has been dispatched: the usage is whole, whatever bytes follow.
    pub fn ended(&self) -> bool {
        self.ended
    }

    fn byte(&mut self, b: u8) {
        if std::mem::take(&mut self.after_cr) && b == b'\n' {
            return;
        }
        if b == b'\r' || b == b'\n' {
            self.after_cr = b == b'\r';
            self.end_line();
            return;
        }
        match self.line {
            Line::Start | Line::Field => {
                self.line = Line::Field;
                if b == b':' {
                    self.line = if self.is_data() {
                        self.start_data();
                        Line::DataStart
                    } else if &self.field[..self.field_len] == b"event" {
                        self.name_len = 0;
                        Line::Name
                    } else {
                        Line::Ignore
                    };
                } else if self.field_len < self.field.len() {
                    self.field[self.field_len] = b;
                    self.field_len += 1;
                } else {
                    self.line = Line::Ignore;
                }
            }
            Line::DataStart => {
                self.line = Line::Data;
                if b != b' ' {
                    self.data_byte(b);
                }
            }
            Line::Data => self.data_byte(b),
            Line::Name => {
                let skip = self.name_len == 0 && b == b' ';
                if !skip && self.name_len < self.name.len() {
                    self.name[self.name_len] = b;
                }
                if !skip {
                    // Counted past the buffer, so a longer name never matches.
                    self.name_len += 1;
                }
            }
            Line::Ignore => {}
        }
    }

    fn data_byte(&mut self, b: u8) {
        if self.head_len < self.head.len() {
            self.head[self.head_len] = b;
        }
        self.head_len += 1;
        self.event.byte(b);
    }

    /// Whether the event being dispatched is the stream's last.
    fn is_last(&self) -> bool {
        let name = &self.name[..self.name_len.min(self.name.len())];
        let named = self.name_len <= self.name.len() && LAST_EVENTS.contains(&name);
        let data = &self.head[..self.head_len.min(self.head.len())];
        named || (self.head_len == LAST_DATA.len() && data == LAST_DATA)
    }

    fn is_data(&self) -> bool {
        &self.field[..self.field_len] == b"data"
    }

    /// Data lines of one event are joined with a line feed (whitespace to JSON).
    fn start_data(&mut self) {
        if self.event_has_data {
            self.event.byte(b'\n');
        }
        self.event_has_data = true;
    }

    fn end_line(&mut self) {
        match self.line {
            Line::Start => {
                if self.event_has_data {
                    self.found.merge(self.event.found());
                    self.ended |= self.is_last();
                }
                self.event = JsonScan::default();
                self.event_has_data = false;
                self.name_len = 0;
                self.head_len = 0;
            }
            // `data` alone is a data line with an empty value.
            Line::Field if self.is_data() => self.start_data(),
            _ => {}
        }
        self.line = Line::Start;
        self.field_len = 0;
    }
}

/// The scanner for one response body: Server-Sent Events for `text/event-stream`, else one
/// JSON text.
#[derive(Debug, Clone)]
pub enum UsageScanner {
    Json(JsonScan),
    Sse(SseScan),
}

impl UsageScanner {
    pub fn for_content_type(content_type: Option<&[u8]>) -> UsageScanner {
        let event_stream = content_type.is_some_and(|value| {
            value.split(|&b| b == b';').next().is_some_and(|essence| {
                essence
                    .trim_ascii()
                    .eq_ignore_ascii_case(b"text/event-stream")
            })
        });
        if event_stream {
            UsageScanner::Sse(SseScan::default())
        } else {
            UsageScanner::Json(JsonScan::default())
        }
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        match self {
            UsageScanner::Json(scan) => scan.feed(bytes),
            UsageScanner::Sse(scan) => scan.feed(bytes),
        }
    }

    /// Whether a stream's last event has passed (never for a JSON answer, whole only at its
    /// end).
    pub fn ended(&self) -> bool {
        match self {
            UsageScanner::Json(_) => false,
            UsageScanner::Sse(scan) => scan.ended(),
        }
    }

    /// What the body has given so far; at its end, what it consumed.
    pub fn usage(&self) -> Usage {
        match self {
            UsageScanner::Json(scan) => scan.found(),
            UsageScanner::Sse(scan) => scan.found(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn json(text: &str) -> Usage {
        let mut scan = UsageScanner::for_content_type(Some(b"application/json"));
        scan.feed(text.as_bytes());
        scan.usage()
    }

    fn sse(text: &str) -> Usage {
        let mut scan = UsageScanner::for_content_type(Some(b"text/event-stream; charset=utf-8"));
        scan.feed(text.as_bytes());
        scan.usage()
    }

    /// Whether the scanner saw a stream's last event once `text` was fed.
    fn ended(text: &str) -> bool {
        let mut scan = UsageScanner::for_content_type(Some(b"text/event-stream"));
        scan.feed(text.as_bytes());
        scan.ended()
    }

    #[test]
    fn a_streams_last_event_is_known_when_it_is_dispatched() {
        assert!(ended(OPENAI_SSE));
        assert!(ended(ANTHROPIC_SSE));
        assert!(ended(RESPONSES_SSE));
        // Not before its blank line, nor for other events or data that only starts so.
        assert!(!ended(
            "data: [DONE]
"
        ));
        assert!(!ended(
            "data: [DONE]x

"
        ));
        assert!(!ended(
            "event: message_stop_not
data: {}

"
        ));
        assert!(!ended(
            "event: content_block_delta
data: {}

"
        ));
        assert!(!ended(
            "event: response.created
data: {}

"
        ));
        // Fed a byte at a time, as frames may split it: known at the blank line's `\r`, the
        // next to last byte.
        let mut scan = UsageScanner::for_content_type(Some(b"text/event-stream"));
        let known = ANTHROPIC_SSE.bytes().position(|byte| {
            scan.feed(&[byte]);
            scan.ended()
        });
        assert_eq!(known, Some(ANTHROPIC_SSE.len() - 2));
        let mut json = UsageScanner::for_content_type(Some(b"application/json"));
        json.feed(OPENAI_JSON.as_bytes());
        assert!(!json.ended(), "a JSON answer is whole only at its end");
    }

    const OPENAI_JSON: &str = r#"{"id":"c1","choices":[{"message":{"role":"assistant","content":"the \"usage\": {\"total_tokens\": 1}"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":0}}}"#;
    const ANTHROPIC_JSON: &str = r#"{"id":"m","type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":7}}"#;
    const OPENAI_SSE: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}\n\ndata: [DONE]\n\n";
    const ANTHROPIC_SSE: &str = "event: message_start\r\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\nevent: content_block_delta\r\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"x\"}}\r\n\r\nevent: message_delta\r\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":15}}\r\n\r\nevent: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n";
    const RESPONSES_SSE: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"usage\":{\"total_tokens\":1}}],\"usage\":{\"input_tokens\":8,\"output_tokens\":9,\"total_tokens\":17}}}\n\n";

    #[test]
    fn cached_and_written_input_are_kept_apart_and_priced_each_at_its_price() {
        let prices = crate::llm::Prices {
            currency: "USD".into(),
            input: 3_000_000,
            cached_input: 300_000,
            cache_write: 6_000_000,
            output: 15_000_000,
        };
        // Anthropic: 10 uncached + 5 read + 20 written, 7 out.
        let anthropic = json(
            r#"{"usage":{"input_tokens":10,"cache_read_input_tokens":5,"cache_creation_input_tokens":20,"output_tokens":7}}"#,
        );
        assert_eq!(
            (anthropic.input, anthropic.cached, anthropic.cache_write),
            (Some(35), Some(5), Some(20))
        );
        // 10 × 3 + 5 × 0.3 + 20 × 6 + 7 × 15 = 30 + 1.5 + 120 + 105 = 256.5 → 257 µ.
        assert_eq!(anthropic.priced(&prices), Some(257));
        // OpenAI: the cached tokens are part of the prompt's.
        let openai = json(
            r#"{"usage":{"prompt_tokens":100,"completion_tokens":10,"total_tokens":110,"prompt_tokens_details":{"cached_tokens":60}}}"#,
        );
        assert_eq!(openai.cached, Some(60));
        // 40 × 3 + 60 × 0.3 + 10 × 15 = 120 + 18 + 150 = 288.
        assert_eq!(openai.priced(&prices), Some(288));
        let responses = json(
            r#"{"usage":{"input_tokens":100,"output_tokens":10,"total_tokens":110,"input_tokens_details":{"cached_tokens":100}}}"#,
        );
        assert_eq!(responses.priced(&prices), Some(30 + 150));
        // A total beyond the parts, or a total alone, at the highest price.
        let total = Usage {
            total: Some(10),
            ..Usage::default()
        };
        assert_eq!(total.priced(&prices), Some(150));
        assert_eq!(Usage::default().priced(&prices), None);
    }

    #[test]
    fn json_answers_in_each_spelling() {
        assert_eq!(json(OPENAI_JSON).used(), Some(42));
        assert_eq!(json(ANTHROPIC_JSON).used(), Some(22));
        assert_eq!(
            json(r#"{"usage":{"input_tokens":2,"output_tokens":3,"total_tokens":5}}"#).used(),
            Some(5)
        );
    }

    #[test]
    fn only_the_top_level_usage_counts() {
        assert_eq!(
            json(r#"{"data":{"usage":{"total_tokens":5}}}"#).used(),
            None
        );
        assert_eq!(json(r#"[{"usage":{"total_tokens":5}}]"#).used(), None);
        assert_eq!(json(r#"{"usage":"5"}"#).used(), None);
        assert_eq!(json(r#"{"usage":{"total_tokens":-5}}"#).used(), None);
        assert_eq!(json(r#"not json at all"#).used(), None);
    }

    #[test]
    fn the_larger_of_total_and_parts_counts() {
        assert_eq!(
            json(r#"{"usage":{"prompt_tokens":20,"completion_tokens":30,"total_tokens":10}}"#)
                .used(),
            Some(50)
        );
        assert_eq!(json(r#"{"usage":{"prompt_tokens":20}}"#).used(), None);
    }

    #[test]
    fn event_streams_in_each_spelling() {
        assert_eq!(sse(OPENAI_SSE).used(), Some(7));
        assert_eq!(sse(ANTHROPIC_SSE).used(), Some(40));
        assert_eq!(sse(RESPONSES_SSE).used(), Some(17));
    }

    #[test]
    fn an_unfinished_event_or_no_usage_gives_no_figure() {
        assert_eq!(sse("data: {\"usage\":{\"total_tokens\":7}}\n").used(), None);
        assert_eq!(
            sse("data: {\"choices\":[]}\n\ndata: [DONE]\n\n").used(),
            None
        );
        // A data line split in two is one JSON text.
        assert_eq!(
            sse("data: {\"usage\":\ndata: {\"total_tokens\":7}}\n\n").used(),
            Some(7)
        );
    }

    #[test]
    fn a_usage_object_past_the_capture_bound_is_not_read() {
        let padding = "x".repeat(CAPTURE_MAX);
        let body = format!(r#"{{"usage":{{"pad":"{padding}","total_tokens":5}}}}"#);
        assert_eq!(json(&body).used(), None);
        // Memory stays bounded whatever the body's size around it.
        let big = format!(
            r#"{{"content":"{}","usage":{{"total_tokens":5}}}}"#,
            "y".repeat(1 << 20)
        );
        assert_eq!(json(&big).used(), Some(5));
    }

    proptest! {
        // However the body is cut into frames, the figure is the same as read whole.
        #[test]
        fn any_chunking_reads_the_same(
            which in 0usize..5,
            cuts in proptest::collection::vec(0usize..2000, 0..12),
        ) {
            let (text, event_stream) = [
                (OPENAI_JSON, false), (ANTHROPIC_JSON, false), (OPENAI_SSE, true),
                (ANTHROPIC_SSE, true), (RESPONSES_SSE, true),
            ][which];
            let whole = if event_stream { sse(text) } else { json(text) };
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
            cuts.sort_unstable();
            let content_type: &[u8] = if event_stream { b"text/event-stream" } else { b"application/json" };
            let mut scan = UsageScanner::for_content_type(Some(content_type));
            let mut at = 0;
            for cut in cuts.into_iter().chain([text.len()]) {
                scan.feed(&text.as_bytes()[at..cut]);
                at = cut;
            }
            prop_assert_eq!(scan.usage(), whole);
            prop_assert!(whole.used().is_some());
        }

        // Random figures are read back exactly, from any content around them.
        #[test]
        fn random_figures_are_read_back(input in 0u64..1_000_000, output in 0u64..1_000_000, text in "[ -~]{0,300}") {
            let body = serde_json::json!({"choices":[{"message":{"content": text}}],
                "usage": {"prompt_tokens": input, "completion_tokens": output}}).to_string();
            prop_assert_eq!(json(&body).used(), Some(input + output));
            let event = format!("data: {body}\n\n");
            prop_assert_eq!(sse(&event).used(), Some(input + output));
        }
    }
}
