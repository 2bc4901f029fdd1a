//! The reservation of an LLM request: an upper bound of the tokens it can consume, computed
//! from its buffered JSON body without a tokenizer. Pure: the same bytes give the same bound.
//!
//! The bound is `per_request + body bytes + per_non_text_part × non-text parts + output cap`:
//! - The prompt's tokens are at most the body's length in bytes. The tokenizers of these
//!   APIs are byte-level BPE: every token covers at least one byte of the text, so a text of
//!   n bytes is at most n tokens. Every prompt text is in the body, and JSON escaping only
//!   makes it longer (`\n` is two bytes for one). The chat template wraps each message in a
//!   few tokens (OpenAI counts 3 per message and 3 to prime the reply); the JSON around a
//!   message (`{"role":"","content":""},`, 25 bytes before the role's name) is longer, and
//!   the request's own envelope (`{"model":"","messages":[]}`) covers the priming.
//! - What the bytes do not bound: a part that is not text (an image, a file, audio) is
//!   charged by what it shows, not by its bytes, so each one is charged `per_non_text_part`,
//!   whether it is given by URL, by id or inline as base64 (its base64 bytes are in the body
//!   and counted too, which only raises the bound). A system prompt the provider adds on its
//!   side (Anthropic adds a few hundred tokens when tools are given) is not in the body
//!   either: `per_request` is there for it.
//! - The output is at most the request's cap (`max_tokens`, `max_completion_tokens` or
//!   `max_output_tokens`, the largest if several), `default_output` when it names none; a
//!   cap above `max_output` is refused, not lowered (the upstream would honour the request's
//!   own cap, not ours).

use serde_json::Value;

/// How a token limit reserves: its `reserve:` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    /// Output cap assumed when the request names none.
    pub default_output: u32,
    /// Largest output cap a request may name.
    pub max_output: u32,
    /// Charged for each image, file, audio or document part.
    pub per_non_text_part: u32,
    /// Charged once per request: what the provider adds that is not in the body.
    pub per_request: u32,
    /// Largest request body read (bytes).
    pub max_body: u64,
}

/// The output cap fields, OpenAI's and Anthropic's spellings.
pub const OUTPUT_CAP_FIELDS: [&str; 3] =
    ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// The `type` of a content part that is not text, in the OpenAI (Chat Completions,
/// Responses) and Anthropic spellings.
pub const NON_TEXT_PART_TYPES: [&str; 10] = [
    "image_url",
    "input_image",
    "image",
    "file",
    "input_file",
    "input_audio",
    "audio",
    "document",
    "video",
    "video_url",
];

/// The parts of one reservation, for the problem bodies and `explain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Upper bound of the prompt's text tokens: the body's length in bytes.
    pub prompt: u64,
    /// Non-text parts found, each charged `per_non_text_part`.
    pub non_text_parts: u64,
    /// The output cap reserved.
    pub output: u64,
    /// Everything: the check's cost.
    pub total: u64,
}

/// Why a request body cannot be reserved for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    #[error("the request body is not JSON: {0}")]
    NotJson(String),
    #[error("the request body is not a JSON object")]
    NotObject,
    #[error("`{field}` must be a non-negative integer")]
    BadCap { field: &'static str },
    #[error("`{field}` asks for {asked} output tokens; this route allows at most {max}")]
    CapTooLarge {
        field: &'static str,
        asked: u64,
        max: u32,
    },
}

/// The reservation of `body` under `reserve`.
pub fn estimate(body: &[u8], reserve: &Reserve) -> Result<Reservation, EstimateError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| EstimateError::NotJson(e.to_string()))?;
    let Value::Object(fields) = &value else {
        return Err(EstimateError::NotObject);
    };
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
    let output = cap.unwrap_or(u64::from(reserve.default_output));
    let prompt = body.len() as u64;
    let non_text_parts = count_non_text_parts(&value);
    let total = u64::from(reserve.per_request)
        .saturating_add(prompt)
        .saturating_add(non_text_parts.saturating_mul(u64::from(reserve.per_non_text_part)))
        .saturating_add(output);
    Ok(Reservation {
        prompt,
        non_text_parts,
        output,
        total,
    })
}

/// Objects anywhere in `value` whose `type` names a non-text part. Walked with an explicit
/// stack: serde_json already refused nesting deeper than its recursion limit.
fn count_non_text_parts(value: &Value) -> u64 {
    let mut count = 0;
    let mut stack = vec![value];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                if let Some(Value::String(kind)) = fields.get("type") {
                    if NON_TEXT_PART_TYPES.contains(&kind.as_str()) {
                        count += 1;
                    }
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const RESERVE: Reserve = Reserve {
        default_output: 1024,
        max_output: 8192,
        per_non_text_part: 1500,
        per_request: 0,
        max_body: 1 << 20,
    };

    #[test]
    fn the_bound_is_bytes_plus_the_output_cap() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100}"#;
        let r = estimate(body, &RESERVE).unwrap();
        assert_eq!(r.prompt, body.len() as u64);
        assert_eq!(r.output, 100);
        assert_eq!(r.total, body.len() as u64 + 100);
    }

    #[test]
    fn the_default_applies_without_a_cap_and_the_largest_cap_wins() {
        let body = br#"{"messages":[]}"#;
        assert_eq!(estimate(body, &RESERVE).unwrap().output, 1024);
        let body = br#"{"max_tokens":10,"max_completion_tokens":300,"max_output_tokens":null}"#;
        assert_eq!(estimate(body, &RESERVE).unwrap().output, 300);
        let body = br#"{"input":"x","max_output_tokens":7}"#;
        assert_eq!(estimate(body, &RESERVE).unwrap().output, 7);
    }

    #[test]
    fn a_cap_above_the_maximum_or_not_a_count_is_refused() {
        let err = estimate(br#"{"max_tokens":9000}"#, &RESERVE).unwrap_err();
        assert_eq!(
            err,
            EstimateError::CapTooLarge {
                field: "max_tokens",
                asked: 9000,
                max: 8192
            }
        );
        for bad in [
            r#"{"max_tokens":-1}"#,
            r#"{"max_tokens":"5"}"#,
            r#"{"max_tokens":1.5}"#,
        ] {
            assert!(matches!(
                estimate(bad.as_bytes(), &RESERVE),
                Err(EstimateError::BadCap {
                    field: "max_tokens"
                })
            ));
        }
        assert!(matches!(
            estimate(b"{", &RESERVE),
            Err(EstimateError::NotJson(_))
        ));
        assert_eq!(estimate(b"[1]", &RESERVE), Err(EstimateError::NotObject));
    }

    #[test]
    fn each_non_text_part_is_charged_in_both_spellings() {
        let openai = br#"{"messages":[{"role":"user","content":[
            {"type":"text","text":"what is this"},
            {"type":"image_url","image_url":{"url":"https://x/a.png"}},
            {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},
            {"type":"file","file":{"file_id":"f1"}}]}],"max_tokens":1}"#;
        let r = estimate(openai, &RESERVE).unwrap();
        assert_eq!(r.non_text_parts, 3);
        assert_eq!(r.total, openai.len() as u64 + 3 * 1500 + 1);
        let anthropic = br#"{"max_tokens":5,"messages":[{"role":"user","content":[
            {"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBO"}},
            {"type":"document","source":{"type":"url","url":"https://x/a.pdf"}},
            {"type":"text","text":"compare"}]}]}"#;
        assert_eq!(estimate(anthropic, &RESERVE).unwrap().non_text_parts, 2);
        let responses = br#"{"input":[{"role":"user","content":[
            {"type":"input_text","text":"hi"},{"type":"input_image","image_url":"data:..."},
            {"type":"input_file","file_id":"f"}]}]}"#;
        assert_eq!(estimate(responses, &RESERVE).unwrap().non_text_parts, 2);
    }

    #[test]
    fn per_request_is_added_once() {
        let reserve = Reserve {
            per_request: 400,
            ..RESERVE
        };
        let body = br#"{"max_tokens":1}"#;
        assert_eq!(
            estimate(body, &reserve).unwrap().total,
            400 + body.len() as u64 + 1
        );
    }

    proptest! {
        // The bound never falls below the text's bytes plus the cap, whatever the text
        // (escapes, multi-byte characters) and however many images.
        #[test]
        fn the_bound_covers_every_text_byte(text in ".{0,200}", cap in 0u32..8192, images in 0usize..5) {
            let mut content = vec![serde_json::json!({"type":"text","text": text})];
            content.extend((0..images).map(|_| serde_json::json!({"type":"image_url","image_url":{"url":"u"}})));
            let body = serde_json::to_vec(&serde_json::json!({
                "messages":[{"role":"user","content":content}],
                "max_completion_tokens": cap,
            })).unwrap();
            let r = estimate(&body, &RESERVE).unwrap();
            prop_assert!(r.total >= text.len() as u64 + u64::from(cap) + images as u64 * 1500);
            prop_assert_eq!(r.non_text_parts, images as u64);
            prop_assert_eq!(r.output, u64::from(cap));
        }
    }
}
