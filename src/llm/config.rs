//! A limit's `tokens:`, `money:`, `reserve:` and `settle:` compiled to its token budget, and
//! the policy's `models:` table checked (with positions) and compiled. Which of a limit's
//! options go with a budget is one of the rules of `policy::rules`. Called by `policy`.

use std::path::Path;
use std::sync::Arc;

use super::estimate::StoredState;
use super::models::{ModelFacts, Models, Prices};
use super::{Reserve, TokenBudget, Unit, UsageFrom};
use crate::config::{
    Config, ConfigError, ContextWord, LimitConfig, ModelConfig, Position, ReserveConfig,
    SettleFrom, StoredStateConfig,
};
use crate::config::{DEFAULT_RESERVE_MAX_BODY, DEFAULT_RESERVE_MAX_OUTPUT};
/// Micro-units of a currency in one unit: a money limit counts micro-currency, so that the
/// store's integer costs (a `u32` per check) hold up to 4,294.967295 of it.
pub const MICRO: f64 = 1_000_000.0;

/// The limit's quota, in its unit: `requests`, `tokens` or micro-currency (0 only for a limit
/// the rules refused).
pub fn quota(limit: &LimitConfig) -> u32 {
    if let Some(money) = &limit.money {
        return micro_amount(money.value).unwrap_or(0);
    }
    limit
        .requests
        .as_ref()
        .or(limit.tokens.as_ref())
        .or(limit.concurrent.as_ref())
        .map_or(0, |quota| quota.value.0)
}

/// An amount in micro-units, if it is positive, has at most 6 decimals and fits a `u32`.
pub(crate) fn micro_amount(amount: f64) -> Option<u32> {
    let micro = amount * MICRO;
    let rounded = micro.round();
    if !micro.is_finite() || rounded < 1.0 || (micro - rounded).abs() > 1e-6 * micro.max(1.0) {
        return None;
    }
    if rounded > f64::from(u32::MAX) {
        return None;
    }
    Some(rounded as u32)
}

/// The policy's `models:` table, checked: non-empty patterns, prices finite and not negative.
pub fn models(config: &Config, file: &Path) -> Result<Arc<Models>, ConfigError> {
    let mut entries = Vec::with_capacity(config.models.len());
    for (index, model) in config.models.iter().enumerate() {
        entries.push((model.pattern.value.clone(), facts_of(model, file, index)?));
    }
    Ok(Arc::new(Models::new(entries)))
}

fn facts_of(model: &ModelConfig, file: &Path, index: usize) -> Result<ModelFacts, ConfigError> {
    let field = format!("models[{index}]");
    if model.pattern.value.is_empty() {
        return Err(ConfigError::invalid(
            file,
            Position::from(&model.pattern),
            format!("{field}.match"),
            "an empty pattern matches no model: name one, or `*` for every model",
        ));
    }
    let unknown = ModelFacts::UNKNOWN;
    let prices = match &model.prices {
        None => None,
        Some(prices) => {
            let price = |name: &str, per_million: f64| {
                if (0.0..1e9).contains(&per_million) {
                    // Per million tokens × 10⁶ = pico-currency per token, rounded up.
                    Ok((per_million * MICRO).ceil() as u64)
                } else {
                    Err(ConfigError::invalid(
                        file,
                        Position::from(prices),
                        format!("{field}.prices.{name}"),
                        format!("a price per million tokens is a number from 0, got {per_million}"),
                    ))
                }
            };
            let input = price("input", prices.value.input)?;
            Some(Prices {
                currency: prices.value.currency.clone(),
                input,
                cached_input: prices
                    .value
                    .cached_input
                    .map_or(Ok(input), |c| price("cached_input", c))?,
                // Anthropic bills a cache write at up to 2× the input price (1-hour cache).
                cache_write: prices
                    .value
                    .cache_write
                    .map_or(Ok(input.saturating_mul(2)), |c| price("cache_write", c))?,
                output: price("output", prices.value.output)?,
            })
        }
    };
    Ok(ModelFacts {
        image_low: model.per_image.map_or(unknown.image_low, |i| i.low),
        image_high: model.per_image.map_or(unknown.image_high, |i| i.high),
        per_non_text_part: model.per_non_text_part.unwrap_or(unknown.per_non_text_part),
        per_request: model.per_request.unwrap_or(unknown.per_request),
        tool_prompt: model.tool_prompt.unwrap_or(unknown.tool_prompt),
        context: model.context.map_or(unknown.context, |c| c.0),
        max_output: model.max_output.map_or(unknown.max_output, |c| c.0),
        prices,
    })
}

/// The token budget of a limit the rules (`policy::rules`) accepted; `None` for a limit counted in requests.
pub fn budget(limit: &LimitConfig, models: &Arc<Models>) -> Option<TokenBudget> {
    let unit = match (&limit.tokens, &limit.money, &limit.currency) {
        (Some(_), _, _) => Unit::Tokens,
        (None, Some(_), Some(currency)) => Unit::Money {
            currency: currency.value.clone(),
            label: format!("micro{}", currency.value),
        },
        _ => return None,
    };
    let reserve = reserve(limit);
    let usage_from = match limit
        .settle
        .as_ref()
        .map(|s| (s.value.from, &s.value.header))
    {
        Some((SettleFrom::Header, Some(header))) => UsageFrom::Header(header.0.clone()),
        _ => UsageFrom::Usage,
    };
    Some(TokenBudget {
        reserve,
        usage_from,
        unit,
        models: Arc::clone(models),
        switch_to: limit
            .switch_model()
            .map(|(_, model)| super::switch::Fallback::new(model)),
    })
}

/// A limit's `reserve:`, its defaults filled in.
pub(crate) fn reserve(limit: &LimitConfig) -> Reserve {
    limit
        .reserve
        .as_ref()
        .map_or_else(default_reserve, |r| reserve_of(&r.value))
}

fn reserve_of(config: &ReserveConfig) -> Reserve {
    Reserve {
        default_output: config.default_output.map(|d| d.0),
        max_output: config.max_output.0,
        per_non_text_part: config.per_non_text_part,
        per_request: config.per_request,
        max_body: config.max_body.0,
        stored_state: config.stored_state.as_ref().map(|s| match s.value {
            StoredStateConfig::Tokens(n) => StoredState::Tokens(n),
            StoredStateConfig::Word(ContextWord::Context) => StoredState::Context,
        }),
        server_tool: config.server_tool,
    }
}

fn default_reserve() -> Reserve {
    Reserve {
        default_output: None,
        max_output: DEFAULT_RESERVE_MAX_OUTPUT,
        per_non_text_part: None,
        per_request: 0,
        max_body: DEFAULT_RESERVE_MAX_BODY,
        stored_state: None,
        server_tool: None,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::limiter::Algorithm;
    use crate::policy::Policy;
    use crate::tls::UpstreamTlsSet;

    fn compile(limit: &str) -> Result<crate::policy::Compiled, String> {
        compile_with("window: 1m", limit)
    }

    /// `period`: the limit's `window:` or `quota:` line.
    fn compile_with(period: &str, limit: &str) -> Result<crate::policy::Compiled, String> {
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nroutes:\n  - name: chat\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n      - name: tpm\n        key: []\n        {period}\n{limit}"
        );
        let config = crate::config::parse(&yaml, Path::new("p.yaml")).map_err(|e| e.to_string())?;
        Policy::compile_without_jwt(&config, Path::new("p.yaml"), &UpstreamTlsSet::default())
            .map_err(|e| e.to_string())
    }

    /// A policy with `models` (the section's lines) before its one route.
    fn compile_models(models: &str, limit: &str) -> Result<crate::policy::Compiled, String> {
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{models}routes:\n  - name: chat\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n      - name: spend\n        key: []\n        window: 1m\n{limit}"
        );
        let config = crate::config::parse(&yaml, Path::new("p.yaml")).map_err(|e| e.to_string())?;
        Policy::compile_without_jwt(&config, Path::new("p.yaml"), &UpstreamTlsSet::default())
            .map_err(|e| e.to_string())
    }

    const PRICED: &str = "models:\n  - match: \"m-*\"\n    per_image: { low: 10, high: 20 }\n    max_output: 1000\n    prices: { currency: USD, input: 0.15, output: 0.6 }\n";

    #[test]
    fn a_money_limit_counts_micro_currency_at_the_models_prices() {
        let compiled =
            compile_models(PRICED, "        money: 12.5\n        currency: USD\n").unwrap();
        let limit = &compiled.routes[0].limits[0];
        assert_eq!(limit.spec.requests, 12_500_000);
        assert_eq!(limit.spec.algorithm, Algorithm::WeightedLog);
        assert!(limit.spec.returnable);
        let budget = limit.tokens.as_ref().unwrap();
        assert_eq!(budget.unit.label(), "microUSD");
        let facts = budget.models.lookup(Some("m-1"));
        assert_eq!(
            (facts.image_low, facts.image_high, facts.max_output),
            (10, 20, 1000)
        );
        let prices = facts.prices.as_ref().unwrap();
        // Per million tokens × 10⁶: pico-USD per token; cached defaults to input, cache
        // writes to twice it.
        assert_eq!(
            (
                prices.input,
                prices.cached_input,
                prices.cache_write,
                prices.output
            ),
            (150_000, 150_000, 300_000, 600_000)
        );
        assert_eq!(budget.models.lookup(Some("other")).prices, None);
    }

    #[test]
    fn a_soft_budget_names_its_fallback_as_written() {
        let compiled = compile_models(
            PRICED,
            "        money: 1\n        currency: USD\n        when: [{ model: [m-big] }]\n        on_exceed: { switch_model: \" M-Small \" }\n",
        )
        .unwrap();
        let budget = compiled.routes[0].limits[0].tokens.as_ref().unwrap();
        let fallback = budget.switch_to.as_ref().expect("a fallback");
        assert_eq!(
            (fallback.model.as_str(), fallback.normalised.as_str()),
            ("M-Small", "m-small")
        );
        assert!(crate::llm::describe(budget).contains("sent to model `M-Small` instead"));
    }

    #[test]
    fn what_a_money_limit_or_a_model_cannot_be_is_refused_with_its_position() {
        let err = |models: &str, limit: &str| {
            compile_models(models, limit)
                .err()
                .unwrap_or_else(|| panic!("accepted: {limit}"))
        };
        let e = err(PRICED, "        money: 5\n");
        assert!(
            e.contains("limits[0].currency") && e.contains("needs `currency:`"),
            "{e}"
        );
        let e = err(PRICED, "        tokens: 5000\n        currency: USD\n");
        assert!(e.contains("limits[0].currency"), "{e}");
        let e = err(
            PRICED,
            "        tokens: 5000\n        money: 5\n        currency: USD\n",
        );
        assert!(e.contains("limits[0].money") && e.contains("one of"), "{e}");
        for amount in ["5000", "0", "0.0000001", "-1"] {
            let e = err(
                PRICED,
                &format!("        money: {amount}\n        currency: USD\n"),
            );
            assert!(
                e.contains("limits[0].money") && e.contains("32 bits"),
                "{amount}: {e}"
            );
        }
        let e = err(PRICED, "        money: 5\n        currency: EUR\n");
        assert!(
            e.contains("p.yaml:17:") && e.contains("no entry of `models:` has `prices` in EUR"),
            "{e}"
        );
        let e = err("models:\n  - match: \"\"\n", "        tokens: 5000\n");
        assert!(
            e.contains("p.yaml:4:") && e.contains("models[0].match"),
            "{e}"
        );
        let e = err(
            "models:\n  - match: m\n    prices: { currency: USD, input: -1, output: 1 }\n",
            "        tokens: 5000\n",
        );
        assert!(e.contains("models[0].prices.input"), "{e}");
        let e = err(
            "models:\n  - match: m\n    per_image: 5\n",
            "        tokens: 5000\n",
        );
        assert!(e.contains("per_image"), "{e}");
    }

    fn refused(limit: &str, field: &str, line: usize) -> String {
        let err = compile(limit)
            .err()
            .unwrap_or_else(|| panic!("accepted:\n{limit}"));
        assert!(err.contains(&format!("p.yaml:{line}:")), "{err}");
        assert!(err.contains(field), "{err}");
        err
    }

    #[test]
    fn a_token_budget_compiles_to_weighted_log_with_its_rules() {
        let compiled = compile(
            "        tokens: 40000\n        reserve: { default_output: 512, per_request: 100 }\n        settle: { from: header, header: x-tokens-used }\n",
        )
        .unwrap();
        let limit = &compiled.routes[0].limits[0];
        assert_eq!(limit.spec.algorithm, Algorithm::WeightedLog);
        assert_eq!(limit.spec.requests, 40000);
        assert!(limit.spec.returnable);
        let budget = limit.tokens.as_ref().unwrap();
        assert_eq!(budget.reserve.default_output, Some(512));
        assert_eq!(budget.reserve.per_request, 100);
        assert_eq!(budget.reserve.max_output, 4096);
        assert_eq!(
            budget.usage_from,
            super::UsageFrom::Header(http::HeaderName::from_static("x-tokens-used"))
        );
    }

    #[test]
    fn a_monthly_token_quota_is_a_calendar_limit() {
        let compiled = compile_with("quota: month", "        tokens: 10000000\n").unwrap();
        let limit = &compiled.routes[0].limits[0];
        assert_eq!(limit.spec.algorithm, Algorithm::Calendar);
        assert!(limit.tokens.is_some());
    }

    #[test]
    fn what_cannot_go_with_a_token_budget_is_refused_with_its_position() {
        refused(
            "        tokens: 100\n        requests: 5\n",
            "routes[0].limits[0].tokens",
            11,
        );
        refused("        cost: 5\n", "routes[0].limits[0].requests", 8);
        refused(
            "        requests: 5\n        reserve: {}\n",
            "limits[0].reserve",
            12,
        );
        refused(
            "        tokens: 5000\n        algorithm: gcra\n",
            "limits[0].tokens",
            11,
        );
        refused(
            "        tokens: 5000\n        algorithm: fixed_window\n",
            "limits[0].tokens",
            11,
        );
        let err = refused(
            "        tokens: 1000001\n        algorithm: sliding_log\n",
            "limits[0].tokens",
            11,
        );
        assert!(err.contains("one entry per token"), "{err}");
        assert!(compile("        tokens: 1000000\n        algorithm: sliding_log\n").is_ok());
        refused(
            "        tokens: 5000\n        cost: 10\n",
            "limits[0].cost",
            12,
        );
        refused(
            "        tokens: 5000\n        on_exceed: delay\n        max_delay: 1s\n",
            "limits[0].on_exceed",
            12,
        );
        refused(
            "        tokens: 5000\n        count: { status: [2xx] }\n",
            "limits[0].count",
            12,
        );
        refused("        tokens: 500\n", "limits[0].reserve", 11);
        refused(
            "        tokens: 5000\n        reserve: { default_output: 900, max_output: 800 }\n",
            "reserve.default_output",
            12,
        );
        refused(
            "        tokens: 5000\n        settle: { from: header }\n",
            "settle.header",
            12,
        );
        refused(
            "        tokens: 5000\n        settle: { header: x-used }\n",
            "settle.header",
            12,
        );
    }
}
