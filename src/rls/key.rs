//! The store key of a rate limit service descriptor, built in this one file:
//! `{prefix}:rls:{domain}:{<entries>}:<unit><requests>[:<period>]`.
//!
//! The entries (`key=value` pairs, in the descriptor's order) are the Redis Cluster hash tag,
//! so every period of one descriptor lives in one slot. The domain, keys and values are written
//! by `limiter::key_text`, as the HTTP limits' values are: escaped where they would end the tag
//! or a segment (`{`, `}`, `:`, `=`, and `%`, `,`, `#`) when short and printable, otherwise
//! hashed, so two different descriptors never share a key and no value a client sends makes a
//! key segment longer than that bound. An entry matched by a wildcard with `share_threshold`
//! is written `key==pattern` instead of `key=value` (the pattern escaped as a value), so every
//! value it matches counts in one count, as envoyproxy/ratelimit writes the pattern in its key;
//! the second `=` cannot come from a client, whose values' `=` are escaped. The unit and limit are part of the key: a reload that
//! changes them starts a new count, as envoyproxy/ratelimit's keys do. Calendar and epoch
//! windows end with their period; every key expires with its window (the stores set it).

use std::fmt::Write as _;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use jiff::civil::Date;
use jiff::Timestamp;

use crate::limiter::calendar::{self, Period};
use crate::limiter::key_text;

use super::file::UnitName;
use super::rules::Counted;

/// The key of one descriptor's limit, without its period; `shared[i]`, when set, is written
/// for entry `i` instead of its value (see the module's doc).
pub fn store_key(
    prefix: &str,
    domain: &str,
    descriptor: &RateLimitDescriptor,
    shared: &[Option<String>],
    limit: Counted,
) -> String {
    let mut key = String::with_capacity(64);
    key.push_str(prefix);
    key.push_str(":rls:");
    escape_into(&mut key, domain);
    key.push_str(":{");
    for (index, entry) in descriptor.entries.iter().enumerate() {
        if index > 0 {
            key.push(',');
        }
        escape_into(&mut key, &entry.key);
        key.push('=');
        match shared.get(index).and_then(Option::as_deref) {
            Some(pattern) => {
                key.push('=');
                escape_into(&mut key, pattern);
            }
            None => escape_into(&mut key, &entry.value),
        }
    }
    let _ = write!(key, "}}:{}{}", limit.unit.label(), limit.requests);
    key
}

/// The separators of this key shape a text must not forge (`key_text` adds `%`, `,`, `#`).
const RESERVED: &[u8] = b"{}:=";

fn escape_into(out: &mut String, text: &str) {
    key_text::push_values(out, &[text], RESERVED);
}

/// Ends `key` with the calendar period (UTC) of `unit` that holds `now`, and answers the time
/// left in it: the window of a calendar count. A day, an ISO week and a month come from
/// sluice's calendar quotas; a year runs from 1 January. Shorter units are not calendar
/// periods and are not passed here; a clock beyond the calendar counts per second.
pub fn calendar_period(key: &mut String, unit: UnitName, now: Timestamp) -> Duration {
    key.push(':');
    let period = match unit {
        UnitName::Day => Period::Day,
        UnitName::Week => Period::Week,
        UnitName::Month => Period::Month,
        UnitName::Year => return year(key, now),
        UnitName::Second | UnitName::Minute | UnitName::Hour => {
            return epoch_window_at(key, unit, now)
        }
    };
    match calendar::span_at(period, &jiff::tz::TimeZone::UTC, now) {
        Ok(span) => {
            span.push_label(key);
            span.left_at(now)
        }
        Err(_) => beyond(key),
    }
}

fn year(key: &mut String, now: Timestamp) -> Duration {
    let utc = jiff::tz::TimeZone::UTC;
    let this = utc.to_datetime(now).date().year();
    let end = Date::new(this.saturating_add(1), 1, 1)
        .ok()
        .and_then(|date| utc.to_timestamp(date.at(0, 0, 0, 0)).ok());
    match end {
        Some(end) => {
            let _ = write!(key, "{this:04}");
            Duration::try_from(end.duration_since(now)).unwrap_or(Duration::from_secs(1))
        }
        None => beyond(key),
    }
}

fn beyond(key: &mut String) -> Duration {
    key.push_str("beyond-the-calendar");
    Duration::from_secs(1)
}

/// Ends `key` with the index of envoyproxy/ratelimit's window (fixed, aligned to the Unix
/// epoch, a month of 30 days) that holds `now`, and answers the time left in it.
pub fn epoch_window(key: &mut String, unit: UnitName, now: Timestamp) -> Duration {
    key.push(':');
    epoch_window_at(key, unit, now)
}

fn epoch_window_at(key: &mut String, unit: UnitName, now: Timestamp) -> Duration {
    let length = unit.seconds() * 1_000_000;
    let at = u64::try_from(now.as_microsecond()).unwrap_or(0);
    let index = at / length;
    let _ = write!(key, "e{index}");
    Duration::from_micros(length - at % length)
}

/// What envoyproxy/ratelimit answers as `duration_until_reset` for any limit: the whole
/// seconds left in the epoch-aligned window of `unit` that holds `now` (1 ..= the unit).
pub fn epoch_seconds_left(unit: UnitName, now: Timestamp) -> Duration {
    let length = unit.seconds();
    let at = u64::try_from(now.as_second()).unwrap_or(0);
    Duration::from_secs(length - at % length)
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    use super::*;
    use crate::config::RlsAlgorithm;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        }
    }

    const LIMIT: Counted = Counted {
        requests: 5,
        unit: UnitName::Minute,
        algorithm: RlsAlgorithm::Exact,
    };

    #[test]
    fn distinct_descriptors_have_distinct_keys() {
        let a = store_key("sluice", "d", &descriptor(&[("a", "b,c=d")]), &[], LIMIT);
        let b = store_key(
            "sluice",
            "d",
            &descriptor(&[("a", "b"), ("c", "d")]),
            &[],
            LIMIT,
        );
        assert_ne!(a, b);
        assert_eq!(b, "sluice:rls:d:{a=b,c=d}:minute5");
        let tagged = store_key("sluice", "d", &descriptor(&[("k", "}{:")]), &[], LIMIT);
        assert_eq!(tagged, "sluice:rls:d:{k=%7D%7B%3A}:minute5");
    }

    #[test]
    fn a_shared_wildcard_is_one_key_a_client_cannot_write() {
        let shared = [None, Some("files/*".to_owned())];
        let key = |value: &str| {
            store_key(
                "sluice",
                "d",
                &descriptor(&[("user", "u"), ("path", value)]),
                &shared,
                LIMIT,
            )
        };
        assert_eq!(
            key("files/a.pdf"),
            "sluice:rls:d:{user=u,path==files/*}:minute5"
        );
        assert_eq!(key("files/a.pdf"), key("files/b.csv"));
        // A client's value `=files/*` is escaped: its own key, not the shared one.
        let forged = store_key(
            "sluice",
            "d",
            &descriptor(&[("user", "u"), ("path", "=files/*")]),
            &[],
            LIMIT,
        );
        assert_ne!(forged, key("files/a.pdf"));
        assert_eq!(
            store_key(
                "sluice",
                "d",
                &descriptor(&[("user", "u"), ("path", "files/a")]),
                &[],
                LIMIT
            ),
            "sluice:rls:d:{user=u,path=files/a}:minute5",
            "without share_threshold each value counts alone"
        );
    }

    /// Text made mostly of the characters the key gives a meaning to, and of what their
    /// escapes are written with (`%7B` is `{` escaped); with `wide`, some unicode, a NUL and
    /// long runs too, which are hashed.
    fn text(wide: bool) -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let special = proptest::sample::select(vec!['{', '}', ':', '%', ',', '=', '#', ' ']);
        let hex = proptest::sample::select(vec!['7', 'B', 'D', '3', 'A', '2', 'C', '5', 'a']);
        let c = if wide {
            prop_oneof![
                6 => special,
                3 => hex,
                1 => proptest::sample::select(vec!['\0', 'é', '😀', '\u{FFFF}']),
                1 => any::<char>(),
            ]
            .boxed()
        } else {
            prop_oneof![6 => special, 3 => hex, 1 => (0x20u8..=0x7e).prop_map(char::from)].boxed()
        };
        let most = if wide { 80 } else { 6 };
        proptest::collection::vec(c, 0..most).prop_map(|chars| chars.into_iter().collect())
    }

    /// A domain and a descriptor's entries (at least one: an empty descriptor is refused
    /// before it has a key).
    fn input(
        any: bool,
    ) -> impl proptest::strategy::Strategy<Value = (String, Vec<(String, String)>)> {
        (
            text(any),
            proptest::collection::vec((text(any), text(any)), 1..4),
        )
    }

    fn key_of((domain, entries): &(String, Vec<(String, String)>), limit: Counted) -> String {
        let pairs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        store_key("sluice", domain, &descriptor(&pairs), &[], limit)
    }

    /// One segment read back; `None` when it holds a character escaping keeps out of it.
    fn unescape(segment: &str) -> Option<String> {
        let mut out = String::new();
        let mut chars = segment.chars();
        while let Some(c) = chars.next() {
            match c {
                '%' => {
                    let hex: String = chars.by_ref().take(2).collect();
                    let byte = u8::from_str_radix(&hex, 16).ok()?;
                    out.push(char::from(byte));
                }
                '{' | '}' | ':' | ',' | '=' => return None,
                c => out.push(c),
            }
        }
        Some(out)
    }

    /// The key read back as the module's doc states its shape, without the unit and limit
    /// (`:minute5`, checked by the caller): the domain, then the entries in the one tag.
    fn read_back(key: &str) -> Option<(String, Vec<(String, String)>)> {
        let rest = key.strip_prefix("sluice:rls:")?;
        let (domain, rest) = rest.split_once(':')?;
        let (tag, rest) = rest.strip_prefix('{')?.split_once('}')?;
        if rest != ":minute5" {
            return None;
        }
        let entries = tag
            .split(',')
            .map(|entry| {
                let (k, v) = entry.split_once('=')?;
                Some((unescape(k)?, unescape(v)?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some((unescape(domain)?, entries))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Any short printable domain and entries, separators and escapes included, are read
        /// back whole from their key.
        #[test]
        fn a_key_reads_back_as_its_descriptor(input in input(false)) {
            let key = key_of(&input, LIMIT);
            proptest::prop_assert_eq!(read_back(&key), Some(input), "{}", key);
        }

        /// Two descriptors apart, drawn at random or written alike (two entries, and one
        /// whose value holds the `,` and `=` between them), never share a key.
        #[test]
        fn distinct_descriptors_never_share_a_key(
            a in input(true),
            b in input(true),
            at in proptest::prelude::any::<proptest::sample::Index>(),
        ) {
            proptest::prop_assert_eq!(a == b, key_of(&a, LIMIT) == key_of(&b, LIMIT));
            let (domain, mut entries) = a.clone();
            if entries.len() > 1 {
                let i = at.index(entries.len() - 1);
                let (k, v) = entries.remove(i + 1);
                entries[i].1 = format!("{},{k}={v}", entries[i].1);
                let alike = (domain, entries);
                proptest::prop_assert_ne!(key_of(&a, LIMIT), key_of(&alike, LIMIT));
            }
        }

        /// One hash tag, the entries, whatever they hold: every count of one descriptor (any
        /// unit, limit and period) lives in one Redis Cluster slot, and the tag is never
        /// empty (an empty one would hash the whole key).
        #[test]
        fn the_entries_are_the_one_hash_tag(input in input(true)) {
            let key = key_of(&input, LIMIT);
            // The domain and at most three entries' keys and values, each bounded, and separators.
            let longest = "sluice:rls:".len() + 7 * (3 * (key_text::MAX_RAW_VALUE + 1) + 2) + 8;
            proptest::prop_assert!(key.len() <= longest, "{}", &key);
            proptest::prop_assert!(key.bytes().all(|b| (0x21..=0x7E).contains(&b)), "{}", &key);
            proptest::prop_assert_eq!(key.matches('{').count(), 1, "{}", &key);
            proptest::prop_assert_eq!(key.matches('}').count(), 1, "{}", &key);
            let open = key.find('{').unwrap_or(0);
            let close = key.find('}').unwrap_or(0);
            proptest::prop_assert!(open + 1 < close, "{}", &key);
            let daily = Counted { requests: 9, unit: UnitName::Day, ..LIMIT };
            let mut other = key_of(&input, daily);
            let now: Timestamp = "2026-02-28T23:59:58Z".parse().expect("instant");
            calendar_period(&mut other, UnitName::Day, now);
            proptest::prop_assert_eq!(
                crate::limiter::slot_of(&key),
                crate::limiter::slot_of(&other),
                "{} and {}", &key, &other
            );
        }
    }

    #[test]
    fn calendar_and_epoch_windows() {
        let now: Timestamp = "2026-02-28T23:59:58Z".parse().expect("instant");
        let mut key = String::new();
        assert_eq!(
            calendar_period(&mut key, UnitName::Month, now),
            Duration::from_secs(2)
        );
        assert_eq!(key, ":2026-02");
        let mut key = String::new();
        assert_eq!(
            calendar_period(&mut key, UnitName::Year, now),
            Duration::from_secs(2 + 86_400 * 306)
        );
        assert_eq!(key, ":2026");
        let mut key = String::new();
        let left = epoch_window(&mut key, UnitName::Minute, now);
        assert_eq!(left, Duration::from_secs(2));
        assert_eq!(key, format!(":e{}", now.as_second() / 60));
        assert_eq!(
            epoch_seconds_left(UnitName::Minute, now),
            Duration::from_secs(2)
        );
        let boundary: Timestamp = "2026-03-01T00:00:00Z".parse().expect("instant");
        assert_eq!(
            epoch_seconds_left(UnitName::Hour, boundary),
            Duration::from_secs(3_600),
            "a whole window at its first second"
        );
    }
}
