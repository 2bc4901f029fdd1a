//! Soft budgets that switch models: a token or money limit with `on_exceed: { switch_model:
//! M }` does not refuse a request it has no room for, but sends it on as a request for `M`
//! (the gateway's side is `crate::proxy::switch`). Here, the pure parts: the fallback a limit
//! names, and the body rewritten for it.
//!
//! The rewrite changes the one top-level `model` member's value and nothing else: every
//! other byte of the body is the client's, in its order, spacing and escapes, so the
//! upstream reads the request the client wrote, for another model. Re-serialising the parsed
//! body would reorder keys and respell numbers and strings; a byte-level rewrite cannot. The
//! body has been parsed before (`super::estimate::parse`: one JSON object, no key twice in
//! any object), so there is exactly one top-level `model`; the scanner still refuses
//! anything else rather than guess.

use std::ops::Range;

/// The model a soft limit sends a request to instead: as written in the policy (what the
/// upstream is sent), and normalised (what keys, conditions and the models table compare).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    pub model: String,
    pub normalised: String,
}

impl Fallback {
    /// The fallback `model` names (surrounding whitespace is not sent).
    pub fn new(model: &str) -> Fallback {
        Fallback {
            model: model.trim().to_owned(),
            normalised: crate::model::normalise(model),
        }
    }

    /// Whether `model` (a body's, normalised) is this model already: switching would change
    /// nothing, so the limit's refusal stands.
    pub fn is(&self, model: Option<&str>) -> bool {
        model == Some(self.normalised.as_str())
    }
}

/// Why a body's `model` cannot be rewritten (never for a body the estimate parsed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    #[error("the request body is not a JSON object")]
    NotObject,
    #[error("the request body names no `model` to switch")]
    NoModel,
    #[error("the request body names `model` more than once")]
    Repeated,
    #[error("the request body's `model` is not a string")]
    NotString,
}

/// `body` with its top-level `model` set to `model`, every other byte as it was.
pub fn with_model(body: &[u8], model: &str) -> Result<Vec<u8>, RewriteError> {
    let span = model_span(body)?.ok_or(RewriteError::NoModel)?;
    if body.get(span.start) != Some(&b'"') {
        return Err(RewriteError::NotString);
    }
    // A JSON string always serializes.
    let value = serde_json::to_vec(model).unwrap_or_default();
    let mut out = Vec::with_capacity(body.len() - span.len() + value.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(&value);
    out.extend_from_slice(&body[span.end..]);
    Ok(out)
}

/// The bytes of the top-level `model` member's value (its key decoded as a JSON reader
/// decodes it: `"mod\u0065l"` is `model`); `None` when the object has none.
fn model_span(body: &[u8]) -> Result<Option<Range<usize>>, RewriteError> {
    let mut at = Reader { bytes: body, at: 0 };
    at.skip_space();
    at.expect(b'{')?;
    at.skip_space();
    if at.peek() == Some(b'}') {
        return Ok(None);
    }
    let mut found = None;
    loop {
        at.skip_space();
        let key_start = at.at;
        at.string()?;
        let key: String =
            serde_json::from_slice(&body[key_start..at.at]).map_err(|_| RewriteError::NotObject)?;
        at.skip_space();
        at.expect(b':')?;
        at.skip_space();
        let value_start = at.at;
        at.value()?;
        if key == "model" {
            if found.is_some() {
                return Err(RewriteError::Repeated);
            }
            found = Some(value_start..at.at);
        }
        at.skip_space();
        match at.next() {
            Some(b',') => continue,
            Some(b'}') => return Ok(found),
            _ => return Err(RewriteError::NotObject),
        }
    }
}

/// A cursor over JSON bytes that skips values without decoding them.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn expect(&mut self, wanted: u8) -> Result<(), RewriteError> {
        match self.next() {
            Some(byte) if byte == wanted => Ok(()),
            _ => Err(RewriteError::NotObject),
        }
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.at += 1;
        }
    }

    /// A string, from its opening quote to just past its closing one.
    fn string(&mut self) -> Result<(), RewriteError> {
        self.expect(b'"')?;
        loop {
            match self.next() {
                Some(b'\\') => {
                    self.next().ok_or(RewriteError::NotObject)?;
                }
                Some(b'"') => return Ok(()),
                Some(_) => {}
                None => return Err(RewriteError::NotObject),
            }
        }
    }

    /// Any value: a string, an object or array (to its matching close), or a scalar.
    fn value(&mut self) -> Result<(), RewriteError> {
        match self.peek() {
            Some(b'"') => self.string(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        Some(b'"') => self.string()?,
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.at += 1;
                        }
                        Some(b'}' | b']') => {
                            depth -= 1;
                            self.at += 1;
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(_) => self.at += 1,
                        None => return Err(RewriteError::NotObject),
                    }
                }
            }
            Some(_) => {
                let start = self.at;
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n')
                ) {
                    self.at += 1;
                }
                if self.at == start {
                    return Err(RewriteError::NotObject);
                }
                Ok(())
            }
            None => Err(RewriteError::NotObject),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(body: &str) -> String {
        String::from_utf8(with_model(body.as_bytes(), "gpt-4o-mini").expect("rewritten"))
            .expect("UTF-8")
    }

    #[test]
    fn only_the_top_level_model_changes() {
        assert_eq!(
            rewritten(r#"{"model":"gpt-4o","max_tokens":10}"#),
            r#"{"model":"gpt-4o-mini","max_tokens":10}"#
        );
        // Spacing, order, escapes and nested `model` keys are the client's.
        let body = "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"model: \\\"x\\\" {[\"} ],\n\
                    \"tools\": [{\"model\": \"gpt-4o\"}], \"mod\\u0065l\"\t:\t\"GPT-4o\" , \"n\": 1e0 }";
        let out = rewritten(body);
        assert_eq!(
            out,
            body.replacen("\"GPT-4o\"", "\"gpt-4o-mini\"", 1),
            "the escaped key is the model; the nested one and the text are not"
        );
        let value: serde_json::Value = serde_json::from_str(&out).expect("still JSON");
        assert_eq!(value["model"], "gpt-4o-mini");
        assert_eq!(value["tools"][0]["model"], "gpt-4o");
        assert_eq!(
            rewritten(r#"{"a":{"model":"x"},"model":"a\"b\\","z":[1,{"q":"}"}]}"#),
            r#"{"a":{"model":"x"},"model":"gpt-4o-mini","z":[1,{"q":"}"}]}"#
        );
    }

    #[test]
    fn a_name_is_written_as_a_json_string() {
        let out = with_model(br#"{"model":"m"}"#, "we\"ird\u{e9}").expect("rewritten");
        let value: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!(value["model"], "we\"ird\u{e9}");
    }

    #[test]
    fn what_cannot_be_rewritten_is_refused() {
        let err = |body: &str| with_model(body.as_bytes(), "m").expect_err(body);
        assert_eq!(err(r#"{"n":1}"#), RewriteError::NoModel);
        assert_eq!(err("{}"), RewriteError::NoModel);
        assert_eq!(err(r#"{"model":"a","model":"b"}"#), RewriteError::Repeated);
        assert_eq!(
            err(r#"{"model":"a","mod\u0065l":"b"}"#),
            RewriteError::Repeated
        );
        assert_eq!(err(r#"{"model":7}"#), RewriteError::NotString);
        assert_eq!(err("[1]"), RewriteError::NotObject);
        assert_eq!(err(r#"{"model":"a""#), RewriteError::NotObject);
        assert_eq!(err(r#"{"model":"a"#), RewriteError::NotObject);
    }

    #[test]
    fn a_fallback_compares_normalised() {
        let fallback = Fallback::new(" GPT-4o-mini ");
        assert_eq!(fallback.model, "GPT-4o-mini");
        assert!(fallback.is(Some("gpt-4o-mini")));
        assert!(!fallback.is(Some("gpt-4o")));
        assert!(!fallback.is(None));
    }

    proptest::proptest! {
        /// Any object with a string `model`, however written by serde_json (escaped or not):
        /// the rewrite reads back as the same object with only `model` changed.
        #[test]
        fn the_rewrite_changes_only_the_model(
            fields in proptest::collection::btree_map("[a-z\"\\\\{}\\[\\]:, ]{0,6}", "[ -~\u{e9}]{0,8}", 0..6),
            model in "[ -~\u{e9}]{0,12}",
            to in "[a-z0-9.-]{1,12}",
        ) {
            let mut object = serde_json::Map::new();
            for (key, value) in &fields {
                object.insert(key.clone(), serde_json::json!({ "model": value, "v": [value] }));
            }
            object.insert("model".to_owned(), serde_json::Value::from(model));
            let body = serde_json::to_vec(&object).expect("JSON");
            let out = with_model(&body, &to).expect("rewritten");
            object.insert("model".to_owned(), serde_json::Value::from(to));
            let read: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
            proptest::prop_assert_eq!(read, serde_json::Value::Object(object));
        }
    }
}
