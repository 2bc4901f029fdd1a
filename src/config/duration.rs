//! Human-written durations (`50ms`, `30s`, `1m`, `2h`, `1d`) as they appear in the policy file.
//!
//! A bare number is refused on purpose: `window: 60` could mean seconds or milliseconds, and
//! a limit that is silently a thousand times too strict is worse than an error.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{Deserialize, Deserializer};

/// A non-zero duration read from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigDuration(pub Duration);

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("expected a duration like 30s (units: ms, s, m, h, d), got `{0}`{hint}", hint = spelled(.0))]
    Malformed(String),
    #[error("a duration must be greater than zero, got `{0}`")]
    Zero(String),
    #[error("duration `{0}` is too long")]
    Overflow(String),
}

/// For a duration written in words or with a space (`1 minute`, `30 secs`, `2 hours`), "did
/// you mean" with the unit sluice reads (`1m`).
fn spelled(text: &str) -> String {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, word) = trimmed.split_at(split);
    let word = word.trim().to_ascii_lowercase();
    // No number, or no unit at all (a bare number is refused on purpose: no guess).
    if number.is_empty() || word.is_empty() {
        return String::new();
    }
    let unit = match word.as_str() {
        "ms" | "msec" | "msecs" | "millisecond" | "milliseconds" => "ms",
        "s" | "sec" | "secs" | "second" | "seconds" => "s",
        "m" | "min" | "mins" | "minute" | "minutes" => "m",
        "h" | "hr" | "hrs" | "hour" | "hours" => "h",
        "d" | "day" | "days" => "d",
        _ => return String::new(),
    };
    format!("; did you mean `{number}{unit}`?")
}

impl FromStr for ConfigDuration {
    type Err = DurationError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let malformed = || DurationError::Malformed(text.to_owned());
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(malformed)?;
        let (number, unit) = trimmed.split_at(split);
        if number.is_empty() {
            return Err(malformed());
        }
        let value: u64 = number
            .parse()
            .map_err(|_| DurationError::Overflow(text.to_owned()))?;
        let millis_per_unit: u64 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(malformed()),
        };
        let millis = value
            .checked_mul(millis_per_unit)
            .ok_or_else(|| DurationError::Overflow(text.to_owned()))?;
        if millis == 0 {
            return Err(DurationError::Zero(text.to_owned()));
        }
        Ok(ConfigDuration(Duration::from_millis(millis)))
    }
}

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ConfigDuration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration like 30s (units: ms, s, m, h, d)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "a duration needs a unit (ms, s, m, h, d), got `{v}`"
                )))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Err(E::custom(format!(
                    "a duration needs a unit (ms, s, m, h, d), got `{v}`"
                )))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn parse(text: &str) -> Result<Duration, DurationError> {
        text.parse::<ConfigDuration>().map(|d| d.0)
    }

    /// Every unit with its length in milliseconds.
    const UNITS: [(&str, u64); 5] = [
        ("ms", 1),
        ("s", 1_000),
        ("m", 60_000),
        ("h", 3_600_000),
        ("d", 86_400_000),
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_text_parses_or_is_refused(text in any::<String>()) {
            let _ = parse(&text);
        }

        /// Digits then anything: the shape of a duration, so the parser gets past the number.
        #[test]
        fn any_text_after_digits_parses_or_is_refused(text in "[0-9]{0,24}\\PC{0,4}") {
            let _ = parse(&text);
        }

        /// A number and a unit, written with any leading zeros and surrounding spaces, is
        /// exactly that many units, or refused as zero or too long.
        #[test]
        fn a_number_and_a_unit_read_back_exactly(
            value in prop_oneof![any::<u64>(), 0u64..100_000],
            (unit, millis_per_unit) in prop::sample::select(&UNITS[..]),
            zeros in 0usize..4,
            spaces in 0usize..3,
        ) {
            let pad = " ".repeat(spaces);
            let text = format!("{pad}{}{value}{unit}{pad}", "0".repeat(zeros));
            let expected = match value.checked_mul(millis_per_unit) {
                None => Err(DurationError::Overflow(text.clone())),
                Some(0) => Err(DurationError::Zero(text.clone())),
                Some(millis) => Ok(Duration::from_millis(millis)),
            };
            prop_assert_eq!(parse(&text), expected);
        }
    }

    #[test]
    fn every_unit() {
        assert_eq!(parse("50ms"), Ok(Duration::from_millis(50)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse("1d"), Ok(Duration::from_secs(86_400)));
    }

    #[test]
    fn refuses_what_is_ambiguous_or_empty() {
        assert!(matches!(parse("thirty"), Err(DurationError::Malformed(_))));
        let said = |text: &str| parse(text).unwrap_err().to_string();
        assert!(said("1 minute").ends_with("got `1 minute`; did you mean `1m`?"));
        assert!(said("30 secs").ends_with("; did you mean `30s`?"));
        assert!(said("2hours").ends_with("; did you mean `2h`?"));
        assert!(said("500 ms").ends_with("; did you mean `500ms`?"));
        assert!(said("1 day").ends_with("; did you mean `1d`?"));
        assert!(said("thirty").ends_with("got `thirty`"));
        assert!(said("60").ends_with("got `60`"));
        assert!(matches!(parse("60"), Err(DurationError::Malformed(_))));
        assert!(matches!(parse("s"), Err(DurationError::Malformed(_))));
        assert!(matches!(parse("1.5s"), Err(DurationError::Malformed(_))));
        assert!(matches!(
            parse("10 parsecs"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(parse("0s"), Err(DurationError::Zero(_))));
        assert!(matches!(
            parse("99999999999999999999d"),
            Err(DurationError::Overflow(_))
        ));
    }
}
