//! Per-model facts a reservation needs and the body cannot say: what one image or one other
//! non-text part costs, what the provider adds to every request or to a request with tools,
//! the context window, the model's own largest output, and optionally its prices. The
//! policy's top-level `models:` table lists them by name or glob pattern, matched against the
//! body's `model` (first match wins); a model no entry matches gets [`ModelFacts::UNKNOWN`],
//! figures at or above what the providers we know publish, each with its source below.

/// Facts about one model (or a family a pattern names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    /// One image part with `detail: "low"`.
    pub image_low: u32,
    /// One image part with any other detail (`high`, `auto`, none).
    pub image_high: u32,
    /// One file, audio, video or document part.
    pub per_non_text_part: u32,
    /// Added to every request (a system prompt of the provider's own).
    pub per_request: u32,
    /// Added when the request gives `tools` (Anthropic's tool-use system prompt).
    pub tool_prompt: u32,
    /// The context window: what `reserve.stored_state: context` charges.
    pub context: u32,
    /// The model's own largest output: what it may generate when the request names no cap.
    pub max_output: u32,
    /// Prices, for a limit counted in money.
    pub prices: Option<Prices>,
}

/// A model's prices, each in pico-currency per token (= micro-currency per million tokens),
/// so that a cost in micro-currency is `tokens × price / 10⁶`, exactly, in integers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prices {
    /// ISO 4217 code (or any name the operator uses), compared with a money limit's.
    pub currency: String,
    pub input: u64,
    pub cached_input: u64,
    /// Input written to the cache (Anthropic bills it at 1.25× or 2× the input price).
    pub cache_write: u64,
    pub output: u64,
}

impl ModelFacts {
    /// A model the table does not list. Each figure is at least what the providers publish:
    /// - `image_high` 48,169: gpt-4o-mini bills a high-detail image at 2,833 + 5,667 per
    ///   512-px tile, and an image scaled into 2048×2048 with its short side at 768 px has at
    ///   most 2 × 4 tiles (OpenAI, "Images and vision", calculating costs:
    ///   <https://platform.openai.com/docs/guides/images-vision#calculating-costs>); gpt-4o is
    ///   85 + 170 per tile (1,445), Claude about (w × h) / 750, at most about 1,600
    ///   (<https://docs.anthropic.com/en/docs/build-with-claude/vision#evaluate-image-size>).
    /// - `image_low` 2,833: gpt-4o-mini's low-detail image (same OpenAI page).
    /// - `per_non_text_part` 5,200,000: a file part may be a PDF of up to 100 pages, each
    ///   billed as its text and an image of the page (OpenAI "File inputs"; Anthropic "PDF
    ///   support": 1,500–3,000 text tokens per page plus the page image); 100 × (48,169 +
    ///   3,000) rounded up. Far above any sensible budget, so a file part on an unlisted model
    ///   is refused: list the model with its own figure.
    /// - `tool_prompt` 530: the largest tool-use system prompt Anthropic publishes (Claude 3
    ///   Opus, `tool_choice` auto; 346 for Claude 4 models;
    ///   <https://docs.anthropic.com/en/docs/agents-and-tools/tool-use/overview#pricing>).
    /// - `context` 2,097,152: the largest context window offered (Gemini 1.5 Pro, 2M).
    /// - `max_output` 128,000: the largest output cap offered (OpenAI gpt-5 family 128,000;
    ///   Claude 3.7 Sonnet with its 128k beta).
    pub const UNKNOWN: ModelFacts = ModelFacts {
        image_low: 2_833,
        image_high: 48_169,
        per_non_text_part: 5_200_000,
        per_request: 0,
        tool_prompt: 530,
        context: 2_097_152,
        max_output: 128_000,
        prices: None,
    };
}

/// The policy's `models:` table, compiled: patterns in the order written.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Models {
    entries: Vec<(String, ModelFacts)>,
}

impl Models {
    /// The table, its patterns normalised like every reading of a body's model
    /// (`crate::model::normalise`): a key, a condition and this table read one name.
    pub fn new(entries: Vec<(String, ModelFacts)>) -> Models {
        let entries = entries
            .into_iter()
            .map(|(pattern, facts)| (crate::model::normalise(&pattern), facts))
            .collect();
        Models { entries }
    }

    /// The facts of the first entry whose pattern matches `model` (normalised: a respelling
    /// the upstream may accept finds the same entry); [`ModelFacts::UNKNOWN`] when none does
    /// or the body names no model.
    pub fn lookup(&self, model: Option<&str>) -> &ModelFacts {
        model
            .map(crate::model::normalise)
            .and_then(|model| {
                self.entries
                    .iter()
                    .find(|(pattern, _)| glob_matches(pattern, &model))
            })
            .map_or(&ModelFacts::UNKNOWN, |(_, facts)| facts)
    }

    /// Whether some entry has prices in `currency`.
    pub fn priced_in(&self, currency: &str) -> bool {
        self.entries.iter().any(|(_, facts)| {
            facts
                .prices
                .as_ref()
                .is_some_and(|p| p.currency == currency)
        })
    }
}

/// `pattern` against `name`: `*` matches any run of characters (none included), every other
/// character itself; both sides already normalised by [`Models`].
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_by_star_only() {
        assert!(glob_matches("gpt-4o-mini*", "gpt-4o-mini-2024-07-18"));
        assert!(glob_matches("gpt-4o-mini*", "gpt-4o-mini"));
        assert!(!glob_matches("gpt-4o-mini*", "gpt-4o"));
        assert!(glob_matches("claude-*-4*", "claude-sonnet-4-5"));
        assert!(!glob_matches("claude-*-4*", "claude-3-haiku"));
        assert!(glob_matches("*", "anything"));
        assert!(glob_matches("exact", "exact"));
        assert!(!glob_matches("exact", "exactly"));
        assert!(!glob_matches("a*a", "a"));
    }

    #[test]
    fn the_first_match_wins_and_the_rest_is_unknown() {
        let small = ModelFacts {
            image_high: 1,
            ..ModelFacts::UNKNOWN
        };
        let models = Models::new(vec![
            ("m-small*".into(), small),
            ("m-*".into(), ModelFacts::UNKNOWN),
        ]);
        assert_eq!(models.lookup(Some("m-small-1")).image_high, 1);
        assert_eq!(models.lookup(Some("m-large")), &ModelFacts::UNKNOWN);
        assert_eq!(models.lookup(None), &ModelFacts::UNKNOWN);
    }

    #[test]
    fn a_respelled_name_finds_its_entry() {
        let small = ModelFacts {
            image_high: 1,
            ..ModelFacts::UNKNOWN
        };
        let models = Models::new(vec![("GPT-4o-mini*".into(), small)]);
        for name in ["gpt-4o-mini", "GPT-4O-MINI", " gpt-4o-mini-2024-07-18 "] {
            assert_eq!(models.lookup(Some(name)).image_high, 1, "{name}");
        }
    }
}
