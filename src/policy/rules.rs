//! Which options of a limit go together, as one table: each rule names the field it refuses,
//! the condition under which it does, and what the refusal says. `check_limit` evaluates the
//! table in order and refuses at the first rule broken, at the position of the value to fix
//! (file, line, column and field path, as every config error). Token and money budgets,
//! calendar quotas, shaping and keys all have their rules here, and nowhere else; what one
//! value alone may be is checked as the YAML is read (`config`), the shape of one `when:`
//! condition where it is compiled (`condition`).
//!
//! The order of the table is the order in which a limit breaking several rules hears about
//! them: what the limit counts first (requests, tokens or money), then its period, then the
//! rest.

use std::path::Path;

use crate::config::{
    ConfigError, KeyPart, LimitConfig, Position, RouteConfig, SettleFrom, Spanned, MAX_LEASE_MS,
    MAX_MAX_DELAY_MS, MIN_LEASE_MS,
};
use crate::limiter::calendar::Period;
use crate::limiter::Algorithm;
use crate::llm::config::{micro_amount, quota, reserve};
use crate::llm::Models;

use crate::limiter::thresholds::permille;

/// One limit as written, with what its rules read around it.
pub(super) struct Seen<'a> {
    pub limit: &'a LimitConfig,
    pub route: &'a RouteConfig,
    pub models: &'a Models,
}

/// Where a rule is broken: the position of the value to fix and, for a field written with
/// `[]`, the index of the list item.
pub struct At {
    position: Position,
    index: usize,
}

/// What a refusal says: a fixed text, or one made from the limit and where it broke the rule.
pub enum Says<Made> {
    Text(&'static str),
    Made(Made),
}

/// A rule: `field` (under the limit's or route's path; `[]` takes the index `broken` gives)
/// is refused with `says` wherever `broken` finds the rule broken.
pub struct Rule<Broken, Made> {
    pub field: &'static str,
    pub broken: Broken,
    pub says: Says<Made>,
}

/// A rule of one limit's options.
type LimitRule = Rule<fn(&Seen<'_>) -> Option<At>, fn(&Seen<'_>, &At) -> String>;

/// A rule of a route's options.
type RouteRule = Rule<fn(&RouteConfig) -> Option<At>, fn(&RouteConfig, &At) -> String>;

/// The rules of one limit's options, in the order a limit hears of them.
const LIMIT_RULES: &[LimitRule] = &[
    // What a limit counts: exactly one of `requests`, `tokens` or `money` in a period, or
    // `concurrent` requests at once.
    Rule {
        field: "concurrent",
        broken: |s| {
            let l = s.limit;
            let other = l.requests.is_some() || l.tokens.is_some() || l.money.is_some();
            l.concurrent.as_ref().filter(|_| other).map(at)
        },
        says: Says::Text(
            "a limit counts requests at once (`concurrent`) or in a period (`requests`, \
             `tokens`, `money`), not both: write two limits",
        ),
    },
    Rule {
        field: "concurrent",
        broken: |s| {
            let l = s.limit;
            let concurrent = l.concurrent.as_ref()?;
            (l.window.is_some() || l.quota.is_some()).then(|| at(concurrent))
        },
        says: Says::Text(
            "a concurrency limit has no period: a request holds its place until its answer \
             ends; remove `window`/`quota` (`lease` sets how soon a dead instance's places \
             come back)",
        ),
    },
    Rule {
        field: "algorithm",
        broken: |s| {
            s.limit
                .algorithm
                .as_ref()
                .filter(|_| s.limit.concurrent.is_some())
                .map(at)
        },
        says: Says::Text("a concurrency limit counts leases in its own way: remove `algorithm`"),
    },
    Rule {
        field: "cost",
        broken: |s| {
            s.limit
                .cost
                .as_ref()
                .filter(|_| s.limit.concurrent.is_some())
                .map(at)
        },
        says: Says::Text(
            "a request in flight holds one place of a concurrency limit: remove `cost`",
        ),
    },
    Rule {
        field: "count",
        broken: |s| {
            s.limit
                .count
                .as_ref()
                .filter(|_| s.limit.concurrent.is_some())
                .map(at)
        },
        says: Says::Text(
            "a concurrency limit's place comes back when the request ends, whatever its \
             status: remove `count`",
        ),
    },
    Rule {
        field: "lease",
        broken: |s| {
            s.limit
                .lease
                .as_ref()
                .filter(|_| s.limit.concurrent.is_none())
                .map(at)
        },
        says: Says::Text("`lease` applies to a concurrency limit (`concurrent:`) only"),
    },
    Rule {
        field: "lease",
        broken: |s| {
            let lease = s.limit.lease.as_ref()?;
            let ms = lease.value.0.as_millis();
            (ms < u128::from(MIN_LEASE_MS) || ms > u128::from(MAX_LEASE_MS)).then(|| at(lease))
        },
        says: Says::Made(|_, _| {
            format!(
                "from {} s to {} s: it is renewed every quarter of it, and a dead instance's \
                 places come back after it",
                MIN_LEASE_MS / 1000,
                MAX_LEASE_MS / 1000
            )
        }),
    },
    Rule {
        field: "money",
        broken: |s| {
            let other = s.limit.requests.as_ref().or(s.limit.tokens.as_ref());
            s.limit.money.as_ref().and(other).map(at)
        },
        says: Says::Text("a limit counts one of `requests`, `tokens` or `money`"),
    },
    Rule {
        field: "money",
        broken: |s| {
            let money = s.limit.money.as_ref()?;
            micro_amount(money.value).is_none().then(|| at(money))
        },
        says: Says::Made(|s, _| {
            format!(
                "an amount from 0.000001 to 4294.967295 with at most 6 decimals (the store \
                 counts micro-units in 32 bits), got {}",
                s.limit.money.as_ref().map_or(0.0, |m| m.value)
            )
        }),
    },
    Rule {
        field: "currency",
        broken: |s| {
            s.limit
                .money
                .as_ref()
                .filter(|_| s.limit.currency.is_none())
                .map(at)
        },
        says: Says::Text("`money:` needs `currency:` (the currency of the models' `prices`)"),
    },
    Rule {
        field: "currency",
        broken: |s| {
            s.limit.money.as_ref()?;
            let currency = s.limit.currency.as_ref()?;
            (!s.models.priced_in(&currency.value)).then(|| at(currency))
        },
        says: Says::Made(|s, _| {
            format!(
                "no entry of `models:` has `prices` in {}: a money limit prices each request \
                 at its model's prices",
                s.limit.currency.as_ref().map_or("", |c| c.value.as_str())
            )
        }),
    },
    Rule {
        field: "currency",
        broken: |s| {
            s.limit
                .currency
                .as_ref()
                .filter(|_| s.limit.money.is_none())
                .map(at)
        },
        says: Says::Text("`currency:` belongs to a money limit (`money:`)"),
    },
    Rule {
        field: "tokens",
        broken: |s| {
            s.limit
                .tokens
                .as_ref()
                .filter(|_| s.limit.requests.is_some())
                .map(at)
        },
        says: Says::Text("a limit counts `requests` or `tokens`, not both"),
    },
    Rule {
        field: "requests",
        broken: |s| {
            let l = s.limit;
            let none = l.requests.is_none()
                && l.tokens.is_none()
                && l.money.is_none()
                && l.concurrent.is_none();
            none.then(|| at(&l.name))
        },
        says: Says::Text(
            "a limit needs `requests:` (or `tokens:` for an LLM token budget, `money:` for one \
             in money, `concurrent:` for requests at once)",
        ),
    },
    Rule {
        field: "reserve",
        broken: |s| {
            s.limit
                .reserve
                .as_ref()
                .filter(|_| s.limit.requests.is_some())
                .map(at)
        },
        says: Says::Text(
            "`reserve:` belongs to a token budget: say `tokens:` instead of `requests:`",
        ),
    },
    Rule {
        field: "settle",
        broken: |s| {
            s.limit
                .settle
                .as_ref()
                .filter(|_| s.limit.requests.is_some())
                .map(at)
        },
        says: Says::Text(
            "`settle:` belongs to a token budget: say `tokens:` instead of `requests:`",
        ),
    },
    // A token or money budget: reserved up front, the unused part given back.
    Rule {
        field: "tokens",
        broken: |s| tokens_at(s).filter(|_| !s.limit.algorithm().traits().settles_exactly),
        says: Says::Made(cannot_give_back),
    },
    Rule {
        field: "money",
        broken: |s| money_at(s).filter(|_| !s.limit.algorithm().traits().settles_exactly),
        says: Says::Made(cannot_give_back),
    },
    Rule {
        field: "tokens",
        broken: |s| tokens_at(s).filter(|_| too_many_for_a_log(s)),
        says: Says::Made(|s, _| too_many_entries(s, "tokens")),
    },
    Rule {
        field: "money",
        broken: |s| money_at(s).filter(|_| too_many_for_a_log(s)),
        says: Says::Made(|s, _| too_many_entries(s, "money")),
    },
    Rule {
        field: "cost",
        broken: |s| s.limit.cost.as_ref().filter(|_| budget(s.limit)).map(at),
        says: Says::Text(
            "a token budget's cost is its reservation (`reserve:`), not a fixed `cost:`",
        ),
    },
    Rule {
        field: "on_exceed",
        broken: |s| s.limit.delay().filter(|_| budget(s.limit)).map(at),
        says: Says::Text(
            "a token budget cannot delay: a request is refused when its reservation does not fit",
        ),
    },
    // Soft budgets: `on_exceed: { switch_model: M }` sends a refused request to `M`, once.
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| !budget(s.limit)),
        says: Says::Text(
            "`switch_model` needs a token or money limit (`tokens:` or `money:`): only a route \
             whose body is read before the decision can send a request to another model",
        ),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| fallback(s).is_some_and(|m| m.trim().is_empty())),
        says: Says::Text("`switch_model` names the model to send the request to"),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| s.limit.shadow),
        says: Says::Text("a shadow limit never refuses, so it never switches a model"),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| only_the_fallback(s)),
        says: Says::Made(|s, _| {
            format!(
                "this limit applies only to `{}`, the model it switches to: switching would \
                 change nothing",
                fallback(s).unwrap_or_default().trim()
            )
        }),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| same_budget(s)),
        says: Says::Made(|s, _| {
            format!(
                "the fallback `{}` would be counted in this limit's own budget, which is spent \
                 when it switches: key the limit by `model` (`key: [..., model]`) or give it a \
                 `when: [{{ model: [...] }}]` the fallback does not match",
                fallback(s).unwrap_or_default().trim()
            )
        }),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| unpriced_by(s).is_some()),
        says: Says::Made(|s, _| {
            let (limit, currency) = unpriced_by(s).unwrap_or_default();
            format!(
                "no entry of `models:` has prices in {currency} for `{}`, the model this limit \
                 switches to: limit `{limit}` of this route counts money in {currency}, and a \
                 switched request must be priced",
                fallback(s).unwrap_or_default().trim()
            )
        }),
    },
    Rule {
        field: "on_exceed",
        broken: |s| switch_at(s).filter(|_| chained_by(s).is_some()),
        says: Says::Made(|s, _| {
            let (limit, to) = chained_by(s).unwrap_or_default();
            format!(
                "limit `{limit}` of this route applies to `{}`, the model this limit switches \
                 to, and switches it on to `{to}`: a request is switched once, so chains and \
                 loops are refused; make `{limit}` a hard limit or keep it off the fallback",
                fallback(s).unwrap_or_default().trim()
            )
        }),
    },
    Rule {
        field: "count",
        broken: |s| s.limit.count.as_ref().filter(|_| budget(s.limit)).map(at),
        says: Says::Text(
            "a token budget counts what the response says it used, not by status: remove `count:`",
        ),
    },
    Rule {
        field: "reserve",
        broken: |s| {
            let tokens = s.limit.tokens.as_ref()?;
            let smallest = smallest_reservation(s.limit);
            (smallest > u64::from(tokens.value.0)).then(|| reserve_at(s))?
        },
        says: Says::Made(|s, _| {
            format!(
                "`per_request` plus the output cap written when a request names none \
                 (`default_output`, else `max_output`: {}) is above `tokens` ({}): no request \
                 naming no cap could ever fit",
                smallest_reservation(s.limit),
                quota(s.limit)
            )
        }),
    },
    Rule {
        field: "reserve.default_output",
        broken: |s| {
            if !budget(s.limit) {
                return None;
            }
            let reserve = reserve(s.limit);
            let default = reserve.default_output?;
            (default > reserve.max_output).then(|| reserve_at(s))?
        },
        says: Says::Made(|s, _| {
            format!(
                "above `max_output` ({}): a request naming no cap would be refused",
                reserve(s.limit).max_output
            )
        }),
    },
    Rule {
        field: "settle.header",
        broken: |s| {
            let settle = s.limit.settle.as_ref().filter(|_| budget(s.limit))?;
            let wrong = settle.value.from == SettleFrom::Header && settle.value.header.is_none();
            wrong.then(|| at(settle))
        },
        says: Says::Text(
            "`from: header` needs `header:`, the response header naming the tokens used",
        ),
    },
    Rule {
        field: "settle.header",
        broken: |s| {
            let settle = s.limit.settle.as_ref().filter(|_| budget(s.limit))?;
            let wrong = settle.value.from == SettleFrom::Usage && settle.value.header.is_some();
            wrong.then(|| at(settle))
        },
        says: Says::Text("`header:` applies with `from: header` only"),
    },
    // The period: a rolling `window` or a calendar `quota`, which is a limit of its own kind.
    Rule {
        field: "window",
        broken: |s| {
            let none = s.limit.quota.is_none() && s.limit.window.is_none();
            let periodic = s.limit.concurrent.is_none();
            (none && periodic).then(|| at(&s.limit.name))
        },
        says: Says::Text(
            "a limit needs a `window` (rolling, e.g. `60s`) or a calendar `quota` (`day`, \
             `week` or `month`)",
        ),
    },
    Rule {
        field: "time_zone",
        broken: |s| {
            s.limit
                .time_zone
                .as_ref()
                .filter(|_| s.limit.quota.is_none())
                .map(at)
        },
        says: Says::Text(
            "`time_zone` applies to a calendar `quota` only (a rolling `window` has no calendar)",
        ),
    },
    Rule {
        field: "quota",
        broken: |s| {
            s.limit
                .quota
                .as_ref()
                .filter(|_| s.limit.window.is_some())
                .map(at)
        },
        says: Says::Made(|s, _| {
            format!(
                "a limit has either a rolling `window` or a calendar `quota`, not both: remove \
                 `window` for {} requests per {}",
                quota(s.limit),
                period(s.limit)
            )
        }),
    },
    Rule {
        field: "algorithm",
        broken: |s| {
            s.limit
                .algorithm
                .as_ref()
                .filter(|_| s.limit.quota.is_some())
                .map(at)
        },
        says: Says::Text(
            "a calendar `quota` counts exactly in its own way (one counter per period): remove \
             `algorithm`",
        ),
    },
    Rule {
        field: "burst",
        broken: |s| {
            s.limit
                .burst
                .as_ref()
                .filter(|_| s.limit.quota.is_some())
                .map(at)
        },
        says: Says::Made(|_, _| {
            format!(
                "`burst` applies to `algorithm: {}` only, not to a calendar `quota`",
                Algorithm::labels_with(|t| t.burst)
            )
        }),
    },
    Rule {
        field: "on_exceed",
        broken: |s| s.limit.delay().filter(|_| s.limit.quota.is_some()).map(at),
        says: Says::Made(|s, _| {
            format!(
                "a calendar `quota` cannot delay a request: room comes back only when the {} \
                 ends",
                period(s.limit)
            )
        }),
    },
    Rule {
        field: "time_zone",
        broken: |s| {
            let zone = s
                .limit
                .time_zone
                .as_ref()
                .filter(|_| s.limit.quota.is_some())?;
            jiff::tz::TimeZone::get(&zone.value)
                .is_err()
                .then(|| at(zone))
        },
        says: Says::Made(|s, _| {
            let zone = s.limit.time_zone.as_ref().map_or("", |z| z.value.as_str());
            let err = jiff::tz::TimeZone::get(zone).err();
            format!(
                "unknown time zone `{zone}`: name an IANA zone such as `Europe/Berlin` or `UTC` \
                 ({})",
                err.map(|e| e.to_string()).unwrap_or_default()
            )
        }),
    },
    // What a request costs: `burst` and `cost`.
    Rule {
        field: "burst",
        broken: |s| {
            let burst = s.limit.burst.as_ref()?;
            (!s.limit.algorithm().traits().burst).then(|| at(burst))
        },
        says: Says::Made(|s, _| {
            format!(
                "`burst` applies to `algorithm: {}` only, not `{}`",
                Algorithm::labels_with(|t| t.burst),
                s.limit.algorithm().label()
            )
        }),
    },
    Rule {
        field: "cost",
        broken: |s| {
            let cost = s.limit.cost.as_ref()?;
            (cost.value.0 > most_at_once(s.limit).0).then(|| at(cost))
        },
        says: Says::Made(|s, _| {
            let (most, what) = most_at_once(s.limit);
            format!(
                "a cost of {} can never be admitted: it is above `{what}` ({most})",
                s.limit.cost.as_ref().map_or(0, |c| c.value.0)
            )
        }),
    },
    // Keys: a `param:NAME` part names a `{NAME}` segment of the route's path prefix.
    Rule {
        field: "key[]",
        broken: |s| {
            let params = path_params(s.route);
            first_key_part(
                s.limit,
                |part| matches!(part, KeyPart::Param(name) if !params.contains(&name.as_str())),
            )
        },
        says: Says::Made(|s, at| {
            let name = match &s.limit.key.value[at.index] {
                KeyPart::Param(name) => name.as_str(),
                _ => "",
            };
            format!(
                "the route's path prefix `{}` has no `{{{name}}}` segment",
                s.route.matcher.path_prefix.0
            )
        }),
    },
    // Shaping: `on_exceed: delay` holds a request until it fits, up to `max_delay`.
    Rule {
        field: "on_exceed",
        broken: |s| {
            let exact = s.limit.algorithm().traits().delays_in_store;
            let concurrent = s.limit.concurrent.is_some();
            s.limit.delay().filter(|_| !exact && !concurrent).map(at)
        },
        says: Says::Made(|s, _| {
            format!(
                "`on_exceed: delay` needs an exact algorithm ({}), not `{}`: its wait must \
                 say exactly when the request fits",
                Algorithm::labels_with(|t| t.delays_in_store),
                s.limit.algorithm().label()
            )
        }),
    },
    Rule {
        field: "on_exceed",
        broken: |s| s.limit.delay().filter(|_| s.limit.shadow).map(at),
        says: Says::Text("a shadow limit never rejects, so it has nothing to delay"),
    },
    Rule {
        field: "when",
        broken: |s| s.limit.delay().and(s.limit.when.first()).map(at),
        says: Says::Text(
            "a limit with `on_exceed: delay` applies to every request of its route: remove \
             `when:` (put the conditions on another route)",
        ),
    },
    Rule {
        field: "count",
        broken: |s| s.limit.delay().and(s.limit.count.as_ref()).map(at),
        says: Says::Text("`count:` and `on_exceed: delay` cannot go on the same limit"),
    },
    Rule {
        field: "on_exceed",
        broken: |s| {
            s.limit
                .delay()
                .filter(|_| s.limit.max_delay.is_none())
                .map(at)
        },
        says: Says::Text("`on_exceed: delay` needs `max_delay` (the longest a request is held)"),
    },
    Rule {
        field: "max_delay",
        broken: |s| {
            let max_delay = s.limit.max_delay.as_ref()?;
            let long = max_delay.value.0.as_millis() > u128::from(MAX_MAX_DELAY_MS);
            s.limit.delay().filter(|_| long).map(|_| at(max_delay))
        },
        says: Says::Made(|_, _| {
            format!(
                "at most {} s: a held request keeps its connection open",
                MAX_MAX_DELAY_MS / 1000
            )
        }),
    },
    Rule {
        field: "max_delay",
        broken: |s| {
            s.limit
                .max_delay
                .as_ref()
                .filter(|_| s.limit.delay().is_none())
                .map(at)
        },
        says: Says::Text("`max_delay` applies with `on_exceed: delay` only"),
    },
    Rule {
        field: "count.status",
        broken: |s| {
            s.limit
                .count
                .as_ref()
                .filter(|c| c.value.status.is_empty())
                .map(at)
        },
        says: Says::Text("list at least one status or class (e.g. [401, 403] or [5xx])"),
    },
    // Threshold notifications: on a use counted in a window or a period, at fractions a
    // store can mark apart (thousandths), few enough to ride in one flags slot.
    Rule {
        field: "notify",
        broken: |s| {
            let notify = s.limit.notify.as_ref()?;
            // An algorithm that takes a burst keeps a rate, not a count of use.
            let counts = s.limit.concurrent.is_none() && !s.limit.algorithm().traits().burst;
            (!counts).then(|| at(notify))
        },
        says: Says::Made(|_, _| {
            format!(
                "`notify` counts use in a window or a period: a concurrency limit (places held \
                 now) and `algorithm: {}` (a rate, no count) have none to cross",
                Algorithm::labels_with(|t| t.burst)
            )
        }),
    },
    Rule {
        field: "notify.at",
        broken: |s| {
            let notify = s.limit.notify.as_ref()?;
            let n = notify.value.at.len();
            (n == 0 || n > crate::limiter::thresholds::MAX).then(|| at(notify))
        },
        says: Says::Made(|_, _| {
            format!(
                "list 1 to {} fractions of the limit, like [0.5, 0.8, 1.0]",
                crate::limiter::thresholds::MAX
            )
        }),
    },
    Rule {
        field: "notify.at[]",
        broken: |s| {
            let at_list = &s.limit.notify.as_ref()?.value.at;
            let index = at_list
                .iter()
                .position(|f| !(f.value > 0.0 && f.value <= 1.0) || permille(f.value) == 0)?;
            Some(at_item(&at_list[index], index))
        },
        says: Says::Made(|s, at| {
            let value = s
                .limit
                .notify
                .as_ref()
                .and_then(|n| n.value.at.get(at.index))
                .map_or(0.0, |f| f.value);
            format!("a fraction of the limit above 0 and at most 1 (to a thousandth), got {value}")
        }),
    },
    Rule {
        field: "notify.at[]",
        broken: |s| {
            let at_list = &s.limit.notify.as_ref()?.value.at;
            // The first fraction not below the next one.
            let index = (1..at_list.len())
                .find(|&i| permille(at_list[i].value) <= permille(at_list[i - 1].value))?
                - 1;
            Some(at_item(&at_list[index], index))
        },
        says: Says::Text(
            "list the fractions in ascending order, each once (to a thousandth): \
             [0.5, 0.8, 1.0]",
        ),
    },
    // Client networks: a prefix fits its address; 0 would be `key: []` said obscurely.
    Rule {
        field: "ipv6_prefix",
        broken: |s| prefix_outside(&s.limit.ipv6_prefix, 128),
        says: Says::Made(|s, _| prefix_message(&s.limit.ipv6_prefix, 128)),
    },
    Rule {
        field: "ipv4_prefix",
        broken: |s| prefix_outside(&s.limit.ipv4_prefix, 32),
        says: Says::Made(|s, _| prefix_message(&s.limit.ipv4_prefix, 32)),
    },
    // The body's `model` is read only for a budget, whose body is read before the decision
    // anyway (any other limit would make every request of its route wait for its body).
    Rule {
        field: "key[]",
        broken: |s| {
            first_key_part(s.limit, |part| *part == KeyPart::Model).filter(|_| !sees_model(s))
        },
        says: Says::Made(|_, _| format!("the key part `model` {READS_MODEL}")),
    },
    Rule {
        field: "when[].model",
        broken: |s| {
            let index = s.limit.when.iter().position(|w| w.value.model.is_some())?;
            (!sees_model(s)).then(|| at_item(&s.limit.when[index], index))
        },
        says: Says::Made(|_, _| format!("a `model` condition {READS_MODEL}")),
    },
    // A JWT's claims are read only on a route that verifies its token.
    Rule {
        field: "key[]",
        broken: |s| {
            first_key_part(s.limit, |part| matches!(part, KeyPart::Jwt(_)))
                .filter(|_| s.route.jwt.is_none())
        },
        says: Says::Text(
            "a `jwt:` key part needs a verified token: give the route `jwt: { verifier: NAME }`",
        ),
    },
    Rule {
        field: "when[].jwt",
        broken: |s| {
            let index = s.limit.when.iter().position(|w| w.value.jwt.is_some())?;
            s.route
                .jwt
                .is_none()
                .then(|| at_item(&s.limit.when[index], index))
        },
        says: Says::Text(
            "a `jwt` condition needs a verified token: give the route `jwt: { verifier: NAME }`",
        ),
    },
];

/// The rules of a route's options that read its limits, checked after them.
const ROUTE_RULES: &[RouteRule] = &[Rule {
    field: "max_delayed",
    broken: |route| {
        let max_delayed = route.max_delayed.as_ref()?;
        (!route.limits.iter().any(delays)).then(|| at(max_delayed))
    },
    says: Says::Text("`max_delayed` needs a limit with `on_exceed: delay` in this route"),
}];

/// Refuses a limit (at `field`, `routes[i].limits[j]`) at the first of its rules it breaks.
pub(super) fn check_limit(seen: &Seen, file: &Path, field: &str) -> Result<(), ConfigError> {
    first_broken(LIMIT_RULES, seen, file, field)
}

/// Refuses a route (at `field`, `routes[i]`) at the first of its rules it breaks.
pub(super) fn check_route(
    route: &RouteConfig,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError> {
    first_broken(ROUTE_RULES, route, file, field)
}

/// The one evaluation of a table: the first rule broken, as a config error.
fn first_broken<T, Broken, Made>(
    rules: &[Rule<Broken, Made>],
    seen: &T,
    file: &Path,
    field: &str,
) -> Result<(), ConfigError>
where
    Broken: Fn(&T) -> Option<At>,
    Made: Fn(&T, &At) -> String,
{
    for rule in rules {
        if let Some(at) = (rule.broken)(seen) {
            let name = rule.field.replacen("[]", &format!("[{}]", at.index), 1);
            let message = match &rule.says {
                Says::Text(text) => (*text).to_owned(),
                Says::Made(made) => made(seen, &at),
            };
            return Err(ConfigError::invalid(
                file,
                at.position,
                format!("{field}.{name}"),
                message,
            ));
        }
    }
    Ok(())
}

/// Whether a limit holds requests with `on_exceed: delay`.
pub(super) fn delays(limit: &LimitConfig) -> bool {
    limit.delay().is_some()
}

fn at<T>(spanned: &Spanned<T>) -> At {
    At {
        position: Position::from(spanned),
        index: 0,
    }
}

/// Item `index` of a list, at the position of `spanned` (the list's, or the item's).
fn at_item<T>(spanned: &Spanned<T>, index: usize) -> At {
    At {
        position: Position::from(spanned),
        index,
    }
}

/// Where the first of the limit's key parts that `is` stands: a rule about one kind of key
/// part points at the first of its kind.
fn first_key_part(limit: &LimitConfig, is: impl Fn(&KeyPart) -> bool) -> Option<At> {
    let index = limit.key.value.iter().position(is)?;
    Some(at_item(&limit.key, index))
}

/// Where the limit says `on_exceed: { switch_model: ... }`.
fn switch_at(s: &Seen) -> Option<At> {
    s.limit.switch_model().map(|(on_exceed, _)| at(on_exceed))
}

/// The model the limit switches to, as written.
fn fallback<'a>(s: &Seen<'a>) -> Option<&'a str> {
    s.limit.switch_model().map(|(_, model)| model)
}

/// The `model` conditions of a limit, each a list of patterns (one must match); patterns
/// that do not parse are refused where conditions compile.
fn model_conditions(limit: &LimitConfig) -> Vec<Vec<crate::model::Pattern>> {
    limit
        .when
        .iter()
        .filter_map(|w| w.value.model.as_ref())
        .map(|models| {
            models
                .iter()
                .filter_map(|m| crate::model::Pattern::parse(m).ok())
                .collect()
        })
        .collect()
}

/// Whether `limit` applies to a request for `model` (normalised), as far as its `model`
/// conditions say (a limit without one applies to every model).
fn applies_to_model(limit: &LimitConfig, model: &str) -> bool {
    model_conditions(limit)
        .iter()
        .all(|patterns| patterns.iter().any(|p| p.matches(model)))
}

/// Whether one of the limit's `model` conditions names the fallback alone.
fn only_the_fallback(s: &Seen) -> bool {
    let Some(model) = fallback(s).map(crate::model::normalise) else {
        return false;
    };
    let only = crate::model::Pattern::Exact(model);
    model_conditions(s.limit)
        .iter()
        .any(|patterns| !patterns.is_empty() && patterns.iter().all(|p| *p == only))
}

/// Whether the fallback's request would be counted under the same store key as the request
/// the limit refused: the key does not read the model and the conditions let it in.
fn same_budget(s: &Seen) -> bool {
    let Some(model) = fallback(s).map(crate::model::normalise) else {
        return false;
    };
    !s.limit.key.value.contains(&KeyPart::Model) && applies_to_model(s.limit, &model)
}

/// The first money limit of the route (name, currency) that finds no price for the fallback
/// in its currency: this limit, or one that could apply to the switched request.
fn unpriced_by<'a>(s: &Seen<'a>) -> Option<(&'a str, &'a str)> {
    let model = fallback(s)?;
    let normalised = crate::model::normalise(model);
    let facts = s.models.lookup(Some(model));
    s.route.limits.iter().find_map(|limit| {
        let currency = limit.currency.as_ref().filter(|_| limit.money.is_some())?;
        let priced = facts
            .prices
            .as_ref()
            .is_some_and(|p| p.currency == currency.value);
        let involved = std::ptr::eq(limit, s.limit) || applies_to_model(limit, &normalised);
        (!priced && involved).then(|| (limit.name.value.as_str(), currency.value.as_str()))
    })
}

/// Another limit of the route (name, its fallback) that applies to this limit's fallback and
/// would switch it on to another model.
fn chained_by<'a>(s: &Seen<'a>) -> Option<(&'a str, &'a str)> {
    let model = crate::model::normalise(fallback(s)?);
    s.route.limits.iter().find_map(|limit| {
        let (_, to) = limit.switch_model()?;
        // One that switches to the same fallback never switches a request already for it.
        let onwards = !std::ptr::eq(limit, s.limit) && crate::model::normalise(to) != model;
        (onwards && applies_to_model(limit, &model)).then(|| (limit.name.value.as_str(), to))
    })
}

/// Whether the limit is a token or money budget.
fn budget(limit: &LimitConfig) -> bool {
    limit.tokens.is_some() || limit.money.is_some()
}

/// Whether the limit is decided with the body's `model` known: a budget, or a concurrency
/// limit on a route whose budget has the body read before the decision (per model at once).
fn sees_model(s: &Seen) -> bool {
    budget(s.limit) || (s.limit.concurrent.is_some() && s.route.limits.iter().any(budget))
}

fn tokens_at(s: &Seen) -> Option<At> {
    s.limit.tokens.as_ref().map(at)
}

fn money_at(s: &Seen) -> Option<At> {
    s.limit
        .money
        .as_ref()
        .filter(|_| s.limit.tokens.is_none())
        .map(at)
}

fn cannot_give_back(s: &Seen, _: &At) -> String {
    format!(
        "a token budget gives back what a request did not use, which `{}` cannot do exactly: \
         leave `algorithm:` out for `{}` (the default of a token budget), or use one of the \
         algorithms that settle exactly: {}",
        s.limit.algorithm().label(),
        Algorithm::FOR_BUDGETS.label(),
        Algorithm::labels_with(|t| t.settles_exactly)
    )
}

/// An algorithm that keeps one entry per unit counted holds at most its row's `max_units`.
fn too_many_for_a_log(s: &Seen) -> bool {
    s.limit
        .algorithm()
        .traits()
        .max_units
        .is_some_and(|most| quota(s.limit) > most)
}

fn too_many_entries(s: &Seen, unit: &str) -> String {
    let traits = s.limit.algorithm().traits();
    format!(
        "at most {} ({unit}) on a {}: it keeps one entry per token (or micro-unit of money); \
         leave `algorithm:` out for `{}` (one entry per request), or use a calendar quota",
        traits.max_units.unwrap_or_default(),
        traits.label,
        Algorithm::FOR_BUDGETS.label(),
    )
}

/// The least a request naming no output cap reserves: `per_request` and the cap written.
fn smallest_reservation(limit: &LimitConfig) -> u64 {
    let reserve = reserve(limit);
    let written = reserve.default_output.unwrap_or(reserve.max_output);
    u64::from(reserve.per_request) + u64::from(written)
}

/// At `reserve:` when written, else at the budget.
fn reserve_at(s: &Seen) -> Option<At> {
    match &s.limit.reserve {
        Some(reserve) => Some(at(reserve)),
        None => tokens_at(s).or_else(|| money_at(s)),
    }
}

/// The most one request can ever be admitted for: `burst` where the algorithm takes one, else
/// the quota.
fn most_at_once(limit: &LimitConfig) -> (u32, &'static str) {
    match (&limit.burst, limit.algorithm()) {
        (Some(burst), algorithm) if algorithm.traits().burst => (burst.value.0, "burst"),
        _ => (quota(limit), "requests"),
    }
}

/// The calendar period of a limit with `quota:`, as a word.
fn period(limit: &LimitConfig) -> &'static str {
    limit
        .quota
        .as_ref()
        .map_or("", |quota| Period::from(quota.value).label())
}

/// The `{NAME}` segments of the route's path prefix.
fn path_params(route: &RouteConfig) -> Vec<&str> {
    route
        .matcher
        .path_prefix
        .0
        .split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .collect()
}

fn prefix_outside(prefix: &Option<Spanned<u32>>, bits: u32) -> Option<At> {
    prefix
        .as_ref()
        .filter(|prefix| !(1..=bits).contains(&prefix.value))
        .map(at)
}

fn prefix_message(prefix: &Option<Spanned<u32>>, bits: u32) -> String {
    format!(
        "a prefix length from 1 to {bits} bits, got {} (for one bucket for every client, use \
         `key: []`)",
        prefix.as_ref().map_or(0, |p| p.value)
    )
}

const READS_MODEL: &str = "reads the JSON body's `model`, which only a token or money limit \
                           (`tokens:`, `money:`), or a concurrency limit on a route with one, \
                           reads: its body is read before the decision anyway";

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// One limit for each rule, in the table's order, that breaks that rule first (its other
    /// options are fine): a rule dropped or added without its example fails here.
    const BREAKS: &[&str] = &[
        "concurrent: 5, requests: 5, window: 1m",
        "concurrent: 5, window: 1m",
        "concurrent: 5, algorithm: gcra",
        "concurrent: 5, cost: 2",
        "concurrent: 5, count: { status: [5xx] }",
        "requests: 5, window: 1m, lease: 5s",
        "concurrent: 5, lease: 100ms",
        "requests: 5, money: 1, currency: USD, window: 1m",
        "money: 0.0000001, currency: USD, window: 1m",
        "money: 1, window: 1m",
        "money: 1, currency: EUR, window: 1m",
        "requests: 5, currency: USD, window: 1m",
        "requests: 5, tokens: 100, window: 1m",
        "window: 1m",
        "requests: 5, window: 1m, reserve: { max_output: 10 }",
        "requests: 5, window: 1m, settle: { from: usage }",
        "tokens: 100000, window: 1m, algorithm: gcra",
        "money: 1, currency: USD, window: 1m, algorithm: gcra",
        "tokens: 2000000, window: 1m, algorithm: sliding_log",
        "money: 2, currency: USD, window: 1m, algorithm: sliding_log",
        "tokens: 100000, window: 1m, cost: 2",
        "tokens: 100000, window: 1m, algorithm: sliding_log, on_exceed: delay, max_delay: 1s",
        "requests: 5, window: 1m, on_exceed: { switch_model: m2 }",
        "tokens: 100000, window: 1m, key: [model], on_exceed: { switch_model: \" \" }",
        "tokens: 100000, window: 1m, key: [model], shadow: true, on_exceed: { switch_model: m2 }",
        "tokens: 100000, window: 1m, key: [model], when: [{ model: [M2] }], on_exceed: { switch_model: m2 }",
        "tokens: 100000, window: 1m, when: [{ model: [m1, m2*] }], on_exceed: { switch_model: m2 }",
        // A second limit of the route, after the first: money in a currency `m2` has no price in.
        "tokens: 100000, window: 1m, key: [model], on_exceed: { switch_model: m2 } }\n      - { name: l2, key: [], money: 1, currency: EUR, window: 1m",
        // A second limit that switches the fallback on.
        "tokens: 100000, window: 1m, key: [model], on_exceed: { switch_model: m2 } }\n      - { name: l2, key: [], tokens: 100000, window: 1m, when: [{ model: [m2] }], on_exceed: { switch_model: m3 }",
        "tokens: 100000, window: 1m, count: { status: [5xx] }",
        "tokens: 100, window: 1m",
        "tokens: 100000, window: 1m, reserve: { default_output: 50, max_output: 10 }",
        "tokens: 100000, window: 1m, settle: { from: header }",
        "tokens: 100000, window: 1m, settle: { from: usage, header: x-used }",
        "requests: 5",
        "requests: 5, window: 1m, time_zone: UTC",
        "requests: 5, window: 1m, quota: day",
        "requests: 5, quota: day, algorithm: gcra",
        "requests: 5, quota: day, burst: 2",
        "requests: 5, quota: day, on_exceed: delay, max_delay: 1s",
        "requests: 5, quota: day, time_zone: Mars/Base",
        "requests: 5, window: 1m, burst: 2",
        "requests: 5, window: 1m, cost: 6",
        "requests: 5, window: 1m, key: [\"param:user\"]",
        "requests: 5, window: 1m, algorithm: fixed_window, on_exceed: delay, max_delay: 1s",
        "requests: 5, window: 1m, shadow: true, on_exceed: delay, max_delay: 1s",
        "requests: 5, window: 1m, on_exceed: delay, max_delay: 1s, when: [{ method: [GET] }]",
        "requests: 5, window: 1m, on_exceed: delay, max_delay: 1s, count: { status: [5xx] }",
        "requests: 5, window: 1m, on_exceed: delay",
        "requests: 5, window: 1m, on_exceed: delay, max_delay: 1h",
        "requests: 5, window: 1m, max_delay: 1s",
        "requests: 5, window: 1m, count: { status: [] }",
        "concurrent: 5, notify: { at: [0.5] }",
        "requests: 5, window: 1m, notify: { at: [] }",
        "requests: 5, window: 1m, notify: { at: [1.5, 0.5] }",
        "requests: 5, window: 1m, notify: { at: [0.8, 0.5] }",
        "requests: 5, window: 1m, ipv6_prefix: 0",
        "requests: 5, window: 1m, ipv4_prefix: 33",
        "requests: 5, window: 1m, key: [model]",
        "requests: 5, window: 1m, when: [{ model: [gpt-4] }]",
        "requests: 5, window: 1m, key: [\"jwt:sub\"]",
        "requests: 5, window: 1m, when: [{ jwt: sub, present: true }]",
    ];

    /// `look` at the first limit of `config`'s first route as the rules see it.
    fn with_first_limit<T>(config: &crate::config::Config, look: impl FnOnce(&Seen) -> T) -> T {
        let models = crate::llm::config::models(config, Path::new("t.yaml")).expect("valid");
        let route = &config.routes[0];
        look(&Seen {
            limit: &route.limits[0],
            route,
            models: &models,
        })
    }

    /// The rules' verdict on that limit, named as `compile` names it.
    fn check_first_limit(seen: &Seen) -> Result<(), ConfigError> {
        check_limit(seen, Path::new("t.yaml"), "routes[0].limits[0]")
    }

    fn config(options: &str) -> crate::config::Config {
        let key = if options.contains("key:") {
            ""
        } else {
            "key: [], "
        };
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\nmodels:\n  - match: \"*\"\n    \
             prices: {{ currency: USD, input: 1, output: 1 }}\nroutes:\n  - name: r\n    \
             match: {{ path_prefix: \"/t/{{tenant}}\" }}\n    respond: {{ status: 200 }}\n    \
             limits:\n      - {{ name: l, {key}{options} }}\n"
        );
        crate::config::parse(&yaml, Path::new("t.yaml")).expect("parses")
    }

    #[test]
    fn each_rule_is_the_first_broken_by_its_example() {
        assert_eq!(BREAKS.len(), LIMIT_RULES.len(), "one example per rule");
        for (index, options) in BREAKS.iter().enumerate() {
            let (first, err) = with_first_limit(&config(options), |seen| {
                let first = LIMIT_RULES
                    .iter()
                    .position(|rule| (rule.broken)(seen).is_some());
                (first, check_first_limit(seen))
            });
            assert_eq!(
                first,
                Some(index),
                "`{options}` breaks rule {first:?} first"
            );
            let err = err.expect_err("refused").to_string();
            let field = LIMIT_RULES[index].field.replacen("[]", "[0]", 1);
            assert!(
                err.contains(&format!("routes[0].limits[0].{field}")),
                "{err}"
            );
            assert!(err.starts_with("t.yaml:11:"), "the limit's line: {err}");
        }
        let fine = config("requests: 5, window: 1m, key: [\"param:tenant\"]");
        assert!(with_first_limit(&fine, check_first_limit).is_ok());
    }

    /// A rule about one kind of key part points at the first part of that kind, not at the
    /// key's first part.
    #[test]
    fn a_key_part_rule_points_at_the_first_part_of_its_kind() {
        for (key, says) in [
            (
                r#"["param:tenant", "param:user", "param:team"]"#,
                "has no `{user}` segment",
            ),
            ("[client_ip, model, model]", "the key part `model` reads"),
            (
                r#"[client_ip, "jwt:sub", "jwt:org"]"#,
                "a `jwt:` key part needs",
            ),
        ] {
            let config = config(&format!("requests: 5, window: 1m, key: {key}"));
            let err = with_first_limit(&config, check_first_limit)
                .expect_err("refused")
                .to_string();
            assert!(
                err.contains("routes[0].limits[0].key[1]") && err.contains(says),
                "`key: {key}`: {err}"
            );
        }
    }
}
