//! The compiled view of envoyproxy/ratelimit's files: per domain a tree of descriptor rules,
//! and the lookup that finds the rule a request's descriptor falls under.
//!
//! The lookup follows envoyproxy/ratelimit's: walk the descriptor's entries in order; at each
//! level take the child whose `key` and exact `value` match, else the first wildcard value of
//! that `key`, in the order the file writes them, that matches, else the child with the `key`
//! and no `value`; the rule is the `rate_limit` of the node where the entries end. Any entry
//! without a child, or an end node without `rate_limit`, means no rule: the descriptor is
//! allowed and not counted.
//!
//! A wildcard value holds one or more `*`, anywhere (`prefix*`, `/api/*/action`, `a*b*c`),
//! each matching any run of characters, the empty one too; there is no escape, so a value
//! with a `*` is always a pattern. The order among wildcards is envoyproxy/ratelimit's
//! (config_impl.go: the first declared that matches wins, not the longest), so an earlier
//! `value1*` takes `value1abc` before a later `value1a*` would. It compares a pattern with
//! `key_value` written as one text, so a pattern could there match an entry of another key
//! whose name has a `_`; here a wildcard matches only values of its own `key`. Matching
//! splits the pattern at its `*`s once, when the file is read, and takes the first part as a
//! prefix, the last as a suffix and each middle one at its first place after the previous:
//! the first place is always as good as any later one, so nothing is tried twice and a match
//! costs one pass over the value (`str::find` is linear), whatever the pattern.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{ConfigError, Position, RlsAlgorithm, Spanned};

use super::file::{self, DescriptorRule, DomainFile, UnitName};

/// Every domain the service answers for.
#[derive(Debug, Default)]
pub struct Rules {
    domains: HashMap<String, Node>,
    /// The files the rules were read from (watched for reload).
    pub files: Vec<PathBuf>,
}

/// One level of a domain's tree.
#[derive(Debug, Default)]
struct Node {
    rule: Option<Arc<RlsRule>>,
    children: HashMap<String, Branch>,
}

/// The children of one node that share a `key`.
#[derive(Debug, Default)]
struct Branch {
    exact: HashMap<String, Node>,
    /// Values with a `*`, in the order the file writes them (the first match wins).
    wildcards: Vec<(Glob, Node)>,
    /// The child with no `value`: every value counts on its own.
    any: Option<Box<Node>>,
}

/// What applies to a descriptor that ends at a node with `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsRule {
    pub domain: String,
    /// `rate_limit.name`, empty when none.
    pub name: String,
    /// envoyproxy/ratelimit's stat key of the rule without its domain: `key_value.key2`.
    pub path: String,
    pub limit: RuleLimit,
    pub shadow: bool,
    /// Names of the rules this one replaces.
    pub replaces: Vec<String>,
    /// Per entry of a descriptor it applies to, the wildcard `value` written in the key
    /// instead of the entry's value (`share_threshold: true` on the level that entry matched);
    /// empty when no level shares.
    pub shared: Vec<Option<String>>,
    /// Where the rule is written, for `explain`.
    pub file: PathBuf,
    pub line: u64,
}

/// A rule's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleLimit {
    /// `unlimited: true`: OK, never counted.
    Unlimited,
    Counted(Counted),
}

/// A counted limit: `requests_per_unit` per `unit`, counted with `algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    pub requests: u32,
    pub unit: UnitName,
    pub algorithm: RlsAlgorithm,
}

impl Rules {
    /// Reads and compiles the files `entries` name (relative to `file`, the sluice config).
    pub fn load(
        entries: &[Spanned<PathBuf>],
        algorithm: RlsAlgorithm,
        file: &Path,
    ) -> Result<Rules, ConfigError> {
        let mut rules = Rules {
            files: file::paths(entries, file, "rls.config")?,
            ..Rules::default()
        };
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        for path in rules.files.clone() {
            let parsed = file::read(&path)?;
            let domain = parsed.domain.value.clone();
            let refuse = |message: String| {
                ConfigError::invalid(&path, (&parsed.domain).into(), "domain", message)
            };
            if domain.is_empty() {
                return Err(refuse("a domain must not be empty".into()));
            }
            if let Some(other) = seen.insert(domain.clone(), path.clone()) {
                return Err(refuse(format!(
                    "domain `{domain}` is already defined in {}",
                    other.display()
                )));
            }
            let node = compile_domain(&parsed, algorithm, &path)?;
            rules.domains.insert(domain, node);
        }
        Ok(rules)
    }

    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The rule a descriptor with these `(key, value)` entries falls under, if any.
    pub fn find<'a, I>(&self, domain: &str, entries: I) -> Option<&Arc<RlsRule>>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut node = self.domains.get(domain)?;
        let mut any = false;
        for (key, value) in entries {
            any = true;
            node = node.children.get(key)?.find(value)?;
        }
        if !any {
            return None;
        }
        node.rule.as_ref()
    }

    /// How many domains and rules there are, for `sluice check`'s summary.
    pub fn count(&self) -> (usize, usize) {
        let rules = self.domains.values().map(Node::rules).sum();
        (self.domains.len(), rules)
    }
}

impl Branch {
    fn find(&self, value: &str) -> Option<&Node> {
        if let Some(node) = self.exact.get(value) {
            return Some(node);
        }
        let wildcard = self
            .wildcards
            .iter()
            .find(|(glob, _)| glob.matches(value))
            .map(|(_, node)| node);
        wildcard.or(self.any.as_deref())
    }
}

/// A descriptor value with one or more `*`, split at them when the file is read.
#[derive(Debug)]
struct Glob {
    /// The value as written.
    text: String,
    /// The literal runs around the `*`s: at least two, any of them empty.
    parts: Vec<String>,
}

impl Glob {
    /// The pattern `text` writes; `None` without a `*` (an exact value).
    fn new(text: &str) -> Option<Glob> {
        if !text.contains('*') {
            return None;
        }
        Some(Glob {
            text: text.to_owned(),
            parts: text.split('*').map(str::to_owned).collect(),
        })
    }

    /// Whether `value` is the first part, anything, each middle part in order with anything
    /// between, and the last part.
    fn matches(&self, value: &str) -> bool {
        let Some((first, rest)) = self.parts.split_first() else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return false;
        };
        // The suffix is taken from what the prefix leaves, so the two never overlap.
        let Some(mut between) = value
            .strip_prefix(first.as_str())
            .and_then(|rest| rest.strip_suffix(last.as_str()))
        else {
            return false;
        };
        for part in middle {
            // The first place a part fits leaves the most room for the parts after it.
            match between.find(part.as_str()) {
                Some(at) => between = &between[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

impl Node {
    fn rules(&self) -> usize {
        let own = usize::from(self.rule.is_some());
        let below: usize = self
            .children
            .values()
            .map(|branch| {
                branch.exact.values().map(Node::rules).sum::<usize>()
                    + branch
                        .wildcards
                        .iter()
                        .map(|(_, n)| n.rules())
                        .sum::<usize>()
                    + branch.any.as_ref().map_or(0, |n| n.rules())
            })
            .sum();
        own + below
    }
}

fn compile_domain(
    parsed: &DomainFile,
    algorithm: RlsAlgorithm,
    path: &Path,
) -> Result<Node, ConfigError> {
    let mut root = Node::default();
    let at = Walk {
        domain: &parsed.domain.value,
        algorithm,
        path,
    };
    at.children(&mut root, &parsed.descriptors, "descriptors", "", &[])?;
    Ok(root)
}

/// What compiling one domain carries down its tree.
struct Walk<'a> {
    domain: &'a str,
    algorithm: RlsAlgorithm,
    path: &'a Path,
}

impl Walk<'_> {
    fn children(
        &self,
        node: &mut Node,
        rules: &[DescriptorRule],
        field: &str,
        stat: &str,
        shared: &[Option<String>],
    ) -> Result<(), ConfigError> {
        for (index, rule) in rules.iter().enumerate() {
            let field = format!("{field}[{index}]");
            let key = &rule.key.value;
            if key.is_empty() {
                return Err(self.refuse(
                    (&rule.key).into(),
                    &format!("{field}.key"),
                    "a descriptor key must not be empty",
                ));
            }
            let mut child = Node::default();
            let own = match &rule.value {
                Some(value) => format!("{key}_{}", value.value),
                None => key.clone(),
            };
            let stat = if stat.is_empty() {
                own
            } else {
                format!("{stat}.{own}")
            };
            // A node is reached through one wildcard or none at each level above it, so which
            // entries share is known here, once, for every rule at or below it.
            let pattern = rule.value.as_ref().filter(|v| v.value.contains('*'));
            if rule.share_threshold && pattern.is_none() {
                return Err(self.refuse(
                    (&rule.key).into(),
                    &format!("{field}.share_threshold"),
                    "share_threshold needs a wildcard `value` (one with `*`): only the values a pattern matches can share its count",
                ));
            }
            let mut shared = shared.to_vec();
            shared.push(
                pattern
                    .filter(|_| rule.share_threshold)
                    .map(|v| v.value.clone()),
            );
            child.rule = self.rule(rule, &field, &stat, &shared)?;
            self.children(
                &mut child,
                &rule.descriptors,
                &format!("{field}.descriptors"),
                &stat,
                &shared,
            )?;
            let branch = node.children.entry(key.clone()).or_default();
            let duplicate = match &rule.value {
                None => branch.any.replace(Box::new(child)).is_some(),
                Some(value) => match Glob::new(&value.value) {
                    Some(glob) => {
                        let taken = branch.wildcards.iter().any(|(g, _)| g.text == glob.text);
                        branch.wildcards.push((glob, child));
                        taken
                    }
                    None => branch.exact.insert(value.value.clone(), child).is_some(),
                },
            };
            if duplicate {
                return Err(self.refuse(
                    (&rule.key).into(),
                    &format!("{field}.key"),
                    &format!("the descriptor `{}` is defined twice at this level", stat),
                ));
            }
        }
        Ok(())
    }

    fn rule(
        &self,
        rule: &DescriptorRule,
        field: &str,
        stat: &str,
        shared: &[Option<String>],
    ) -> Result<Option<Arc<RlsRule>>, ConfigError> {
        let Some(spanned) = &rule.rate_limit else {
            return Ok(None);
        };
        let limit = &spanned.value;
        let field = format!("{field}.rate_limit");
        let position: Position = spanned.into();
        let counted = match (limit.unlimited, &limit.unit, &limit.requests_per_unit) {
            (true, None, None) => RuleLimit::Unlimited,
            (true, _, _) => {
                return Err(self.refuse(
                    position,
                    &field,
                    "an `unlimited` rate limit takes no `unit` or `requests_per_unit`",
                ))
            }
            (false, Some(unit), Some(requests)) => {
                // 0 is envoyproxy/ratelimit's block list (its README's example 3): every
                // matching descriptor is OVER_LIMIT, decided without the store (`decide`).
                RuleLimit::Counted(Counted {
                    requests: requests.value,
                    unit: unit.value,
                    algorithm: limit.algorithm.unwrap_or(self.algorithm),
                })
            }
            (false, _, _) => {
                return Err(self.refuse(
                    position,
                    &field,
                    "a rate limit needs `unit` and `requests_per_unit`, or `unlimited: true`",
                ))
            }
        };
        Ok(Some(Arc::new(RlsRule {
            domain: self.domain.to_owned(),
            name: limit
                .name
                .as_ref()
                .map(|n| n.value.clone())
                .unwrap_or_default(),
            path: stat.to_owned(),
            limit: counted,
            shadow: rule.shadow_mode,
            replaces: limit.replaces.iter().map(|r| r.name.clone()).collect(),
            file: self.path.to_owned(),
            line: position.line,
            shared: if shared.iter().any(Option::is_some) {
                shared.to_vec()
            } else {
                Vec::new()
            },
        })))
    }

    fn refuse(&self, position: Position, field: &str, message: &str) -> ConfigError {
        ConfigError::invalid(self.path, position, field, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(yaml: &str) -> Result<Rules, ConfigError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rules.yaml");
        std::fs::write(&path, yaml).expect("write");
        let sluice = dir.path().join("sluice.yaml");
        let entry: Vec<Spanned<PathBuf>> =
            crate::config::parse_as("[rules.yaml]", &sluice).expect("list");
        Rules::load(&entry, RlsAlgorithm::Exact, &sluice)
    }

    const README: &str = "
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
  - key: key1
    value: value1*
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key1
    value: value1a*
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key1
    value: value1ab
    rate_limit: {unit: minute, requests_per_unit: 40}
  - key: key1
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: internal
    rate_limit: {unlimited: true}
  - key: nolimit
";

    fn requests(rules: &Rules, entries: &[(&str, &str)]) -> Option<u32> {
        match rules.find("messaging", entries.iter().copied())?.limit {
            RuleLimit::Counted(c) => Some(c.requests),
            RuleLimit::Unlimited => Some(u32::MAX),
        }
    }

    #[test]
    fn the_most_specific_rule_wins() {
        let rules = rules(README).expect("valid");
        let at = |e: &[(&str, &str)]| requests(&rules, e);
        assert_eq!(
            at(&[("message_type", "marketing"), ("to_number", "1")]),
            Some(5)
        );
        assert_eq!(at(&[("to_number", "1")]), Some(100));
        // message_type alone ends at a node without rate_limit.
        assert_eq!(at(&[("message_type", "marketing")]), None);
        assert_eq!(
            at(&[("key1", "value1ab")]),
            Some(40),
            "exact before wildcard"
        );
        assert_eq!(
            at(&[("key1", "value1abc")]),
            Some(20),
            "the first wildcard written, though value1a* is longer"
        );
        assert_eq!(at(&[("key1", "value1x")]), Some(20));
        assert_eq!(at(&[("key1", "other")]), Some(10), "key without value");
        assert_eq!(at(&[("internal", "x")]), Some(u32::MAX));
        assert_eq!(at(&[("nolimit", "x")]), None);
        assert_eq!(at(&[("unknown", "x")]), None);
        assert_eq!(rules.find("other", [("to_number", "1")]), None);
        let rule = rules.find(
            "messaging",
            [("message_type", "marketing"), ("to_number", "1")],
        );
        assert_eq!(
            rule.map(|r| r.path.as_str()),
            Some("message_type_marketing.to_number")
        );
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let err = rules("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n")
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("rules.yaml:5:13") && err.contains("unit") && err.contains("fortnight"),
            "{err}"
        );
        let err =
            rules("domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n")
                .expect_err("refused")
                .to_string();
        assert!(
            err.contains("rules.yaml:5:7: descriptors[0].rate_limit"),
            "{err}"
        );
        let err = rules("domain: d\ndescriptors:\n  - key: a\n  - key: a\n")
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("descriptors[1].key") && err.contains("twice"),
            "{err}"
        );
        let err = rules(
            "domain: d\ndescriptors:\n  - key: a\n    value: x*y\n  - key: a\n    value: x*y\n",
        )
        .expect_err("refused")
        .to_string();
        assert!(
            err.contains("descriptors[1].key") && err.contains("a_x*y") && err.contains("twice"),
            "{err}"
        );
    }

    #[test]
    fn a_zero_limit_loads_and_negative_or_fractional_ones_do_not() {
        let zero = "domain: d\ndescriptors:\n  - key: ip\n    value: 50.0.0.5\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n";
        let loaded = rules(zero).expect("the README's block list loads");
        let rule = loaded.find("d", [("ip", "50.0.0.5")]).expect("a rule");
        assert!(
            matches!(rule.limit, RuleLimit::Counted(Counted { requests: 0, .. })),
            "{rule:?}"
        );
        for bad in ["-1", "1.5", "ten"] {
            let err =
                rules(&zero.replace("requests_per_unit: 0", &format!("requests_per_unit: {bad}")))
                    .expect_err(bad)
                    .to_string();
            assert!(
                err.contains("rules.yaml:7:26") && err.contains("requests_per_unit"),
                "{bad}: {err}"
            );
        }
    }

    const GLOBS: &str = "
domain: g
descriptors:
  - key: path
    value: /api/*/action
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*/resource/*/action
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /api/v1/action
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: path
    value: '*.pdf'
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: path
    value: /api/*
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 6}
  - key: other_path
    value: '*'
    rate_limit: {unit: minute, requests_per_unit: 7}
";

    #[test]
    fn a_wildcard_anywhere_first_written_first_then_the_key_alone() {
        let loaded = rules(GLOBS).expect("valid");
        let at = |value: &str| match loaded.find("g", [("path", value)]).map(|r| r.limit) {
            Some(RuleLimit::Counted(c)) => Some(c.requests),
            _ => None,
        };
        assert_eq!(
            at("/api/v1/action"),
            Some(3),
            "an exact value before any wildcard"
        );
        assert_eq!(at("/api/v2/action"), Some(1), "a middle wildcard");
        assert_eq!(at("/api//action"), Some(1), "`*` matches the empty run");
        assert_eq!(
            at("/api/v2/resource/9/action"),
            Some(1),
            "/api/*/action is written first and matches too (`*` spans slashes)"
        );
        assert_eq!(
            at("/api/v2/other"),
            Some(5),
            "not /api/*/action: its suffix differs"
        );
        assert_eq!(at("/files/a.pdf"), Some(4), "a leading wildcard");
        assert_eq!(at("/api/a.pdf"), Some(4), "*.pdf is written before /api/*");
        assert_eq!(
            at("/api/action"),
            Some(5),
            "the prefix and suffix never overlap"
        );
        assert_eq!(at("/home"), Some(6), "no wildcard matches: the key alone");
        // Only the values of its own key: path_* would match other_path_x as one text.
        assert_eq!(
            loaded
                .find("g", [("other_path", "x")])
                .map(|r| r.path.as_str()),
            Some("other_path_*")
        );
    }

    /// What `*` means, the slow way: every split tried.
    fn reference(pattern: &[u8], value: &[u8]) -> bool {
        match pattern.split_first() {
            None => value.is_empty(),
            Some((b'*', rest)) => (0..=value.len()).any(|skip| reference(rest, &value[skip..])),
            Some((c, rest)) => value.first() == Some(c) && reference(rest, &value[1..]),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4096))]

        /// Patterns and values over a two-letter alphabet (so parts repeat and overlap) match
        /// as the reference says.
        #[test]
        fn a_glob_matches_as_every_split_would(pattern in "[ab*]{1,8}", value in "[ab]{0,10}") {
            let expected = reference(pattern.as_bytes(), value.as_bytes());
            let matched = match Glob::new(&pattern) {
                Some(glob) => glob.matches(&value),
                None => pattern == value,
            };
            proptest::prop_assert_eq!(matched, expected, "{} against {}", pattern, value);
        }
    }

    #[test]
    fn pathological_patterns_match_in_one_pass() {
        let long = "a".repeat(200_000);
        let started = std::time::Instant::now();
        for pattern in ["*a*a*a*a*b", "*a*a*a*a*a*a*a*a*a*a*", "a*a*a*a*ab*"] {
            let glob = Glob::new(pattern).expect("a pattern");
            let expected = !pattern.contains('b');
            assert_eq!(glob.matches(&long), expected, "{pattern}");
        }
        let glob = Glob::new(&format!("*{}b*", "a".repeat(1_000))).expect("a pattern");
        assert!(!glob.matches(&long));
        // A backtracking matcher takes minutes on these; one pass takes microseconds.
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(2), "{took:?}");
    }

    #[test]
    fn share_threshold_needs_a_wildcard() {
        let err = rules("domain: d\ndescriptors:\n  - key: a\n    value: exact\n    share_threshold: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n")
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("rules.yaml:3:10")
                && err.contains("descriptors[0].share_threshold")
                && err.contains("wildcard"),
            "{err}"
        );
        let loaded = rules("domain: d\ndescriptors:\n  - key: a\n    value: x*\n    share_threshold: true\n    descriptors:\n      - key: b\n        rate_limit: {unit: hour, requests_per_unit: 1}\n")
            .expect("a wildcard may share");
        let rule = loaded.find("d", [("a", "xy"), ("b", "z")]).expect("a rule");
        assert_eq!(rule.shared, [Some("x*".to_owned()), None]);
    }
}
