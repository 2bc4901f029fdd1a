//! The checks of a limit's `tokens:`, `reserve:` and `settle:` that the YAML types cannot
//! make alone, with their positions, and the token budget they compile to. Called by
//! `policy` for each limit.

use std::path::Path;

use super::{settles_exactly, Reserve, Settle, TokenBudget, MAX_SLIDING_LOG_TOKENS};
use crate::config::{
    ConfigError, LimitConfig, Position, ReserveConfig, SettleFrom, DEFAULT_PER_NON_TEXT_PART,
};
use crate::config::{DEFAULT_RESERVE_MAX_BODY, DEFAULT_RESERVE_MAX_OUTPUT, DEFAULT_RESERVE_OUTPUT};
use crate::limiter::Algorithm;

/// The limit's quota, in its unit: `requests` or `tokens` (0 only for a limit `check`
/// refused).
pub fn quota(limit: &LimitConfig) -> u32 {
    limit
        .requests
        .as_ref()
        .or(limit.tokens.as_ref())
        .map_or(0, |quota| quota.value.0)
}

/// Refuses what cannot go with a token budget, or a token budget's parts without one.
pub fn check(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    let refuse = |position: Position, name: &str, message: String| {
        Err(ConfigError::invalid(
            file,
            position,
            format!("{field}.{name}"),
            message,
        ))
    };
    let tokens = match (&limit.requests, &limit.tokens) {
        (Some(_), Some(tokens)) => {
            return refuse(
                Position::from(tokens),
                "tokens",
                "a limit counts `requests` or `tokens`, not both".to_owned(),
            )
        }
        (None, None) => {
            return refuse(
                Position::from(&limit.name),
                "requests",
                "a limit needs `requests:` (or `tokens:` for an LLM token budget)".to_owned(),
            )
        }
        (Some(_), None) => {
            for (name, position) in [
                ("reserve", limit.reserve.as_ref().map(Position::from)),
                ("settle", limit.settle.as_ref().map(Position::from)),
            ] {
                if let Some(position) = position {
                    return refuse(
                        position,
                        name,
                        format!("`{name}:` belongs to a token budget: say `tokens:` instead of `requests:`"),
                    );
                }
            }
            return Ok(());
        }
        (None, Some(tokens)) => tokens,
    };
    let at = Position::from(tokens);
    let algorithm = limit.algorithm();
    if !settles_exactly(algorithm) {
        return refuse(
            at,
            "tokens",
            format!(
                "a token budget gives back what a request did not use, which `{}` cannot do \
                 exactly: use `weighted_log` (the default of a token budget), `sliding_log` or \
                 a calendar `quota`",
                algorithm.label()
            ),
        );
    }
    if algorithm == Algorithm::SlidingLog && tokens.value.0 > MAX_SLIDING_LOG_TOKENS {
        return refuse(
            at,
            "tokens",
            format!(
                "at most {MAX_SLIDING_LOG_TOKENS} tokens on a sliding_log: its log keeps one \
                 entry per token; leave `algorithm:` out for `weighted_log` (one entry per \
                 request), or use a calendar quota"
            ),
        );
    }
    if let Some(cost) = &limit.cost {
        return refuse(
            Position::from(cost),
            "cost",
            "a token budget's cost is its reservation (`reserve:`), not a fixed `cost:`".to_owned(),
        );
    }
    if let Some(on_exceed) = limit.delay() {
        return refuse(
            Position::from(on_exceed),
            "on_exceed",
            "a token budget cannot delay: a request is refused when its reservation does not fit"
                .to_owned(),
        );
    }
    if let Some(count) = &limit.count {
        return refuse(
            Position::from(count),
            "count",
            "a token budget counts what the response says it used, not by status: remove `count:`"
                .to_owned(),
        );
    }
    let reserve = limit
        .reserve
        .as_ref()
        .map_or_else(default_reserve, |r| reserve_of(&r.value));
    let reserve_at = limit.reserve.as_ref().map_or(at, Position::from);
    let smallest = u64::from(reserve.per_request) + u64::from(reserve.default_output);
    if smallest > u64::from(tokens.value.0) {
        return refuse(
            reserve_at,
            "reserve",
            format!(
                "`per_request` plus `default_output` ({smallest}) is above `tokens` ({}): \
                 no request naming no cap could ever fit",
                tokens.value.0
            ),
        );
    }
    if reserve.default_output > reserve.max_output {
        return refuse(
            reserve_at,
            "reserve.default_output",
            format!(
                "above `max_output` ({}): a request naming no cap would be refused",
                reserve.max_output
            ),
        );
    }
    if let Some(settle) = &limit.settle {
        match (settle.value.from, &settle.value.header) {
            (SettleFrom::Header, None) => {
                return refuse(
                    Position::from(settle),
                    "settle.header",
                    "`from: header` needs `header:`, the response header naming the tokens used"
                        .to_owned(),
                )
            }
            (SettleFrom::Usage, Some(_)) => {
                return refuse(
                    Position::from(settle),
                    "settle.header",
                    "`header:` applies with `from: header` only".to_owned(),
                )
            }
            _ => {}
        }
    }
    Ok(())
}

/// The token budget of a limit `check` accepted; `None` for a limit counted in requests.
pub fn budget(limit: &LimitConfig) -> Option<TokenBudget> {
    limit.tokens.as_ref()?;
    let reserve = limit
        .reserve
        .as_ref()
        .map_or_else(default_reserve, |r| reserve_of(&r.value));
    let settle = match limit
        .settle
        .as_ref()
        .map(|s| (s.value.from, &s.value.header))
    {
        Some((SettleFrom::Header, Some(header))) => Settle::Header(header.0.clone()),
        _ => Settle::Usage,
    };
    Some(TokenBudget { reserve, settle })
}

fn reserve_of(config: &ReserveConfig) -> Reserve {
    Reserve {
        default_output: config.default_output.0,
        max_output: config.max_output.0,
        per_non_text_part: config.per_non_text_part,
        per_request: config.per_request,
        max_body: config.max_body.0,
    }
}

fn default_reserve() -> Reserve {
    Reserve {
        default_output: DEFAULT_RESERVE_OUTPUT,
        max_output: DEFAULT_RESERVE_MAX_OUTPUT,
        per_non_text_part: DEFAULT_PER_NON_TEXT_PART,
        per_request: 0,
        max_body: DEFAULT_RESERVE_MAX_BODY,
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
        Policy::compile(&config, Path::new("p.yaml"), &UpstreamTlsSet::default())
            .map_err(|e| e.to_string())
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
        assert_eq!(budget.reserve.default_output, 512);
        assert_eq!(budget.reserve.per_request, 100);
        assert_eq!(budget.reserve.max_output, 4096);
        assert_eq!(
            budget.settle,
            super::Settle::Header(http::HeaderName::from_static("x-tokens-used"))
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
