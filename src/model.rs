//! The `model` a JSON request body names, for the limits that read it (a `model` key part, a
//! `when: { model: [...] }` condition): providers set their quotas per model, so a route can
//! give the large model 30k tokens a minute and the small one 200k, per key.
//!
//! A name is normalised before it is used as a key or compared: surrounding whitespace
//! removed and letters lower-cased. The model ids of OpenAI and Anthropic are lower-case
//! ASCII; an upstream that accepts another spelling of an id means the same model by it, and
//! one that refuses it spends nothing. Folding either way costs the client nothing it is owed,
//! while keeping the spellings apart would give `GPT-4o` and ` gpt-4o` buckets of their own.
//! Two names the upstream may read as one model that this folding does not join (an alias
//! and the dated snapshot it points to, `gpt-4o` and `gpt-4o-2024-08-06`) are joined by a
//! pattern in the policy (`gpt-4o*`), not here.
//!
//! The body is read with serde_json, so an escaped spelling (`"gpt\u002d4o"`) is the name it
//! decodes to, as the upstream reads it; a body naming `model` twice has no single reading
//! (JSON parsers differ on which one wins) and is refused.

use std::borrow::Cow;

/// Why a body's model cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("the request body is not a JSON object with a string `model` ({0})")]
    Json(String),
    #[error("the request body names `model` more than once, which parsers read differently")]
    Repeated,
}

/// A name as keys and conditions compare it: trimmed, lower-cased.
pub fn normalise(name: &str) -> String {
    name.trim().to_lowercase()
}

/// The normalised `model` of a JSON body; `None` when the body names none.
pub fn read(body: &[u8]) -> Result<Option<String>, ModelError> {
    #[derive(serde::Deserialize)]
    struct Named<'a> {
        #[serde(borrow, default)]
        model: Option<Cow<'a, str>>,
    }
    match serde_json::from_slice::<Named<'_>>(body) {
        Ok(named) => Ok(named.model.map(|model| normalise(&model))),
        Err(err) if err.to_string().starts_with("duplicate field `model`") => {
            Err(ModelError::Repeated)
        }
        Err(err) => Err(ModelError::Json(err.to_string())),
    }
}

/// A name or a prefix (`gpt-4o*`) of the policy, normalised like a body's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    Exact(String),
    Prefix(String),
}

impl Pattern {
    /// Reads `gpt-4o` or `gpt-4o*`; a `*` anywhere but at the end is refused.
    pub fn parse(text: &str) -> Result<Pattern, String> {
        let text = normalise(text);
        let (stem, prefix) = match text.strip_suffix('*') {
            Some(stem) => (stem, true),
            None => (text.as_str(), false),
        };
        if stem.contains('*') {
            return Err(format!(
                "`{text}`: a model pattern is a name, or a prefix ending in `*`"
            ));
        }
        if stem.is_empty() && !prefix {
            return Err("a model name is not empty".to_owned());
        }
        Ok(if prefix {
            Pattern::Prefix(stem.to_owned())
        } else {
            Pattern::Exact(stem.to_owned())
        })
    }

    /// Whether `model` (normalised) is this name or starts with this prefix.
    pub fn matches(&self, model: &str) -> bool {
        match self {
            Pattern::Exact(name) => model == name,
            Pattern::Prefix(stem) => model.starts_with(stem.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_normalises() {
        assert_eq!(
            read(br#"{"model":" GPT-4o ","messages":[]}"#),
            Ok(Some("gpt-4o".to_owned()))
        );
        assert_eq!(
            read(br#"{"model":"gpt\u002d4o"}"#),
            Ok(Some("gpt-4o".to_owned())),
            "an escape decodes to the name the upstream reads"
        );
        assert_eq!(read(br#"{"input":"x"}"#), Ok(None));
        assert_eq!(
            read(br#"{"model":"gpt-4o-mini","model":"gpt-4o"}"#),
            Err(ModelError::Repeated)
        );
        assert!(matches!(read(br#"{"model":7}"#), Err(ModelError::Json(_))));
        assert!(matches!(read(b"[1]"), Err(ModelError::Json(_))));
    }

    #[test]
    fn patterns() {
        let large = Pattern::parse("GPT-4o*").expect("a prefix");
        assert!(large.matches("gpt-4o-2024-08-06"));
        assert!(large.matches("gpt-4o-mini"), "a prefix is a prefix");
        assert!(!large.matches("gpt-4"));
        let exact = Pattern::parse("gpt-4o").expect("a name");
        assert!(exact.matches("gpt-4o"));
        assert!(!exact.matches("gpt-4o-mini"));
        assert!(Pattern::parse("gpt*4o").is_err());
        assert!(Pattern::parse("").is_err());
    }

    /// `text` as a JSON string, each character written as itself or as a `\u` escape
    /// (surrogate pairs beyond the BMP), as `escape[i]` says.
    fn spell(text: &str, escape: &[bool]) -> String {
        let mut out = String::from("\"");
        for (i, c) in text.chars().enumerate() {
            let plain = !matches!(c, '"' | '\\' | '\u{0}'..='\u{1f}');
            if plain && !escape.get(i).copied().unwrap_or(false) {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        out.push('"');
        out
    }

    proptest::proptest! {
        /// However the body spells the key and the name (escapes, case, surrounding
        /// space, other fields around it), `read` gives the one normalised name the
        /// upstream reads; naming `model` twice, in any spelling, is refused.
        #[test]
        fn every_spelling_reads_as_one_name(
            name in "[ \\t]{0,2}[A-Za-z0-9._:/-]{1,12}[\u{e9}\u{130}\u{1F600}]?[ ]{0,2}",
            escape_name in proptest::collection::vec(proptest::bool::ANY, 20),
            escape_key in proptest::collection::vec(proptest::bool::ANY, 5),
            before in proptest::bool::ANY,
            twice in proptest::bool::ANY,
        ) {
            let key = spell("model", &escape_key);
            let value = spell(&name, &escape_name);
            let other = r#""messages":[{"role":"user","content":"model"}]"#;
            let body = match (before, twice) {
                (_, true) => format!(r#"{{"model":"x",{other},{key}:{value}}}"#),
                (true, false) => format!("{{{other},{key}:{value}}}"),
                (false, false) => format!("{{{key}:{value},{other}}}"),
            };
            let got = read(body.as_bytes());
            if twice {
                proptest::prop_assert_eq!(got, Err(ModelError::Repeated), "{}", body);
            } else {
                proptest::prop_assert_eq!(got, Ok(Some(normalise(&name))), "{}", body);
            }
        }
    }
}
