//! The checks of a limit's `tokens:`, `reserve:` and `settle:` that the YAML types cannot
//! make alone, with their positions, and the token budget they compile to. Called by
//! `policy` for each limit.

use std::path::Path;

use super::{settles_exactly, Reserve, Settle, TokenBudget, MAX_SLIDING_LOG_TOKENS};
use crate::config::{
    ConfigError, LimitConfig, OnExceed, Position, ReserveConfig, SettleFrom,
    DEFAULT_PER_NON_TEXT_PART,
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
                 exactly: use `weighted_log` (the default of a token budget) or `sliding_log`",
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
    if let Some(on_exceed) = limit
        .on_exceed
        .as_ref()
        .filter(|o| o.value == OnExceed::Delay)
    {
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
