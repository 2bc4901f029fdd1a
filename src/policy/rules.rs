//! The rules of which limit options go together, checked with their positions.

use std::path::Path;

use crate::config::{ConfigError, KeyPart, LimitConfig, Position, RouteConfig, MAX_MAX_DELAY_MS};
use crate::limiter::Algorithm;

/// A `model` key part or condition reads the request body: only a token limit's, whose body
/// is read before the decision anyway. (Any other limit would make every request of its route
/// wait for its whole body.)
pub(super) fn check_model(
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    if limit.tokens.is_some() || limit.money.is_some() {
        return Ok(());
    }
    let why = "reads the JSON body's `model`, which only a token or money limit (`tokens:`, \
               `money:`) reads: its body is read before the decision anyway";
    if let Some(at) = limit.key.value.iter().position(|p| *p == KeyPart::Model) {
        return Err(ConfigError::invalid(
            file,
            Position::from(&limit.key),
            format!("{field}.key[{at}]"),
            format!("the key part `model` {why}"),
        ));
    }
    if let Some((at, when)) = limit
        .when
        .iter()
        .enumerate()
        .find(|(_, when)| when.value.model.is_some())
    {
        return Err(ConfigError::invalid(
            file,
            Position::from(when),
            format!("{field}.when[{at}].model"),
            format!("a `model` condition {why}"),
        ));
    }
    Ok(())
}

pub(super) fn delays(limit: &LimitConfig) -> bool {
    limit.delay().is_some()
}

/// `on_exceed`, `max_delay` and `count`: what each needs and what it cannot go with.
pub(super) fn check_shaping(
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    let refuse = |position: Position, name: &str, message: String| {
        Err(ConfigError::invalid(
            file,
            position,
            format!("{field}.{name}"),
            message,
        ))
    };
    if let Some(on_exceed) = limit.delay() {
        let at = Position::from(on_exceed);
        if !matches!(limit.algorithm(), Algorithm::SlidingLog | Algorithm::Gcra) {
            return refuse(
                at,
                "on_exceed",
                format!(
                    "`on_exceed: delay` needs an exact algorithm (sliding_log or gcra), not `{}`: \
                     its wait must say exactly when the request fits",
                    limit.algorithm().label()
                ),
            );
        }
        if limit.shadow {
            return refuse(
                at,
                "on_exceed",
                "a shadow limit never rejects, so it has nothing to delay".to_owned(),
            );
        }
        if let Some(when) = limit.when.first() {
            return refuse(
                Position::from(when),
                "when",
                "a limit with `on_exceed: delay` applies to every request of its route: \
                 remove `when:` (put the conditions on another route)"
                    .to_owned(),
            );
        }
        if let Some(count) = &limit.count {
            return refuse(
                Position::from(count),
                "count",
                "`count:` and `on_exceed: delay` cannot go on the same limit".to_owned(),
            );
        }
        let Some(max_delay) = &limit.max_delay else {
            return refuse(
                at,
                "on_exceed",
                "`on_exceed: delay` needs `max_delay` (the longest a request is held)".to_owned(),
            );
        };
        if max_delay.value.0.as_millis() > u128::from(MAX_MAX_DELAY_MS) {
            return refuse(
                Position::from(max_delay),
                "max_delay",
                format!(
                    "at most {} s: a held request keeps its connection open",
                    MAX_MAX_DELAY_MS / 1000
                ),
            );
        }
    } else if let Some(max_delay) = &limit.max_delay {
        return refuse(
            Position::from(max_delay),
            "max_delay",
            "`max_delay` applies with `on_exceed: delay` only".to_owned(),
        );
    }
    if let Some(count) = &limit.count {
        if count.value.status.is_empty() {
            return refuse(
                Position::from(count),
                "count.status",
                "list at least one status or class (e.g. [401, 403] or [5xx])".to_owned(),
            );
        }
    }
    Ok(())
}

/// `ipv6_prefix` and `ipv4_prefix` must fit their address. A prefix of 0 would make every
/// client one bucket, which `key: []` says plainly.
pub(super) fn check_prefixes(
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    for (name, prefix, bits) in [
        ("ipv6_prefix", &limit.ipv6_prefix, 128),
        ("ipv4_prefix", &limit.ipv4_prefix, 32),
    ] {
        if let Some(prefix) = prefix {
            if !(1..=bits).contains(&prefix.value) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(prefix),
                    format!("{field}.{name}"),
                    format!(
                        "a prefix length from 1 to {bits} bits, got {} (for one bucket for \
                         every client, use `key: []`)",
                        prefix.value
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A `param:NAME` key part must name a `{NAME}` segment of the route's path prefix.
pub(super) fn check_params(
    route: &RouteConfig,
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    let prefix = &route.matcher.path_prefix.0;
    let params: Vec<&str> = prefix
        .split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .collect();
    for (index, part) in limit.key.value.iter().enumerate() {
        if let KeyPart::Param(name) = part {
            if !params.contains(&name.as_str()) {
                return Err(ConfigError::invalid(
                    file,
                    Position::from(&limit.key),
                    format!("{field}.key[{index}]"),
                    format!("the route's path prefix `{prefix}` has no `{{{name}}}` segment"),
                ));
            }
        }
    }
    Ok(())
}

/// A cost the limit could never admit is refused: above `requests`, or for GCRA above `burst`.
/// A `burst` on another algorithm is refused too, since it would be silently ignored.
pub(super) fn check_cost(limit: &LimitConfig, file: &Path, field: &str) -> Result<(), ConfigError> {
    if let Some(burst) = &limit.burst {
        if limit.algorithm() != Algorithm::Gcra {
            return Err(ConfigError::invalid(
                file,
                Position::from(burst),
                format!("{field}.burst"),
                format!(
                    "`burst` applies to `algorithm: gcra` only, not `{}`",
                    limit.algorithm().label()
                ),
            ));
        }
    }
    let Some(cost) = &limit.cost else {
        return Ok(());
    };
    let (most, what) = match (&limit.burst, limit.algorithm()) {
        (Some(burst), Algorithm::Gcra) => (burst.value.0, "burst"),
        _ => (crate::llm::config::quota(limit), "requests"),
    };
    if cost.value.0 > most {
        return Err(ConfigError::invalid(
            file,
            Position::from(cost),
            format!("{field}.cost"),
            format!(
                "a cost of {} can never be admitted: it is above `{what}` ({most})",
                cost.value.0
            ),
        ));
    }
    Ok(())
}

/// A calendar quota (`quota:`) is a limit of its own kind: exactly one of `window` and
/// `quota`; `time_zone` only with a quota, naming a zone of the bundled tz database; and none
/// of what shapes a rolling window (`algorithm`, `burst`, `on_exceed: delay`).
pub(super) fn check_quota(
    limit: &LimitConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    let refuse = |position: Position, name: &str, message: String| {
        Err(ConfigError::invalid(
            file,
            position,
            format!("{field}.{name}"),
            message,
        ))
    };
    let Some(quota) = &limit.quota else {
        if limit.window.is_none() {
            return refuse(
                Position::from(&limit.name),
                "window",
                "a limit needs a `window` (rolling, e.g. `60s`) or a calendar `quota` (`day`, \
                 `week` or `month`)"
                    .to_owned(),
            );
        }
        if let Some(zone) = &limit.time_zone {
            return refuse(
                Position::from(zone),
                "time_zone",
                "`time_zone` applies to a calendar `quota` only (a rolling `window` has no \
                 calendar)"
                    .to_owned(),
            );
        }
        return Ok(());
    };
    let period = crate::limiter::calendar::Period::from(quota.value).label();
    if limit.window.is_some() {
        return refuse(
            Position::from(quota),
            "quota",
            format!(
                "a limit has either a rolling `window` or a calendar `quota`, not both: remove \
                 `window` for {} requests per {period}",
                crate::llm::config::quota(limit)
            ),
        );
    }
    if let Some(algorithm) = &limit.algorithm {
        return refuse(
            Position::from(algorithm),
            "algorithm",
            "a calendar `quota` counts exactly in its own way (one counter per period): \
             remove `algorithm`"
                .to_owned(),
        );
    }
    if let Some(burst) = &limit.burst {
        return refuse(
            Position::from(burst),
            "burst",
            "`burst` applies to `algorithm: gcra` only, not to a calendar `quota`".to_owned(),
        );
    }
    if let Some(on_exceed) = limit.delay() {
        return refuse(
            Position::from(on_exceed),
            "on_exceed",
            format!(
                "a calendar `quota` cannot delay a request: room comes back only when the \
                 {period} ends"
            ),
        );
    }
    if let Some(zone) = &limit.time_zone {
        if let Err(err) = jiff::tz::TimeZone::get(&zone.value) {
            return refuse(
                Position::from(zone),
                "time_zone",
                format!(
                    "unknown time zone `{}`: name an IANA zone such as `Europe/Berlin` or \
                     `UTC` ({err})",
                    zone.value
                ),
            );
        }
    }
    Ok(())
}
