//! The `RateLimit-Policy` and `RateLimit` response fields, parsed strictly, and what a
//! client can tell from its side about how exactly a limit held.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One item of a `ratelimit-policy` or `ratelimit` structured field:
/// `"name";k=v;k=v`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitItem {
    pub name: String,
    pub params: BTreeMap<String, i64>,
}

impl LimitItem {
    pub fn param(&self, k: &str) -> i64 {
        *self
            .params
            .get(k)
            .unwrap_or_else(|| panic!("parameter {k} missing in {self:?}"))
    }
}

/// Parse a structured-field list like `"per-ip";q=5;w=60, "per-key";q=3;w=1`.
/// Panics (failing the test) on anything that is not this exact syntax.
pub fn parse_limit_field(value: &str) -> Vec<LimitItem> {
    value
        .split(", ")
        .map(|item| {
            let mut parts = item.split(';');
            let name = parts.next().unwrap();
            assert!(
                name.len() >= 2 && name.starts_with('"') && name.ends_with('"'),
                "limit name must be a quoted string in {value:?}"
            );
            let name = name[1..name.len() - 1].to_string();
            let params = parts
                .map(|p| {
                    let (k, v) = p
                        .split_once('=')
                        .unwrap_or_else(|| panic!("bad parameter {p:?} in {value:?}"));
                    let v: i64 = v
                        .parse()
                        .unwrap_or_else(|_| panic!("parameter {k} not an integer in {value:?}"));
                    (k.to_string(), v)
                })
                .collect();
            LimitItem { name, params }
        })
        .collect()
}

/// The shortest time that surely holds the decisions of `n` admissions, each known only to
/// have been decided between its request's sending and its answer: over every choice of `n`,
/// the latest answer less the earliest sending. `None` with fewer than `n`.
pub fn tightest_admissions(admissions: &[(Instant, Instant)], n: usize) -> Option<Duration> {
    admissions
        .iter()
        .filter_map(|&(first_sent, _)| {
            // With the earliest sending fixed, the best choice is the `n` earliest answers
            // among the requests sent no earlier.
            let mut answers: Vec<Instant> = admissions
                .iter()
                .filter(|&&(sent, _)| sent >= first_sent)
                .map(|&(_, answered)| answered)
                .collect();
            answers.sort();
            answers.get(n - 1).map(|&last| last - first_sent)
        })
        .min()
}
