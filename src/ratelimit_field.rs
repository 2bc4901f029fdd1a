//! The syntax of the `RateLimit-Policy` and `RateLimit` fields: a structured-field list
//! (RFC 9651) with one item per limit. Kept apart from `response` so that `policy` can build
//! its `RateLimit-Policy` value once per config without depending on the request path.

use std::fmt::Write as _;
use std::time::Duration;

use http::header::HeaderValue;

use crate::config::Name;

/// Whole seconds, rounded up: a client that waits this long is never early.
pub fn ceil_seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// One item per limit: the limit's name as a string, then integer parameters. Names are
/// restricted (see `config::Name`) so they need no escaping inside the quotes.
pub fn limit_items<'a>(
    items: impl Iterator<Item = (&'a Name, [(char, u64); 2])>,
) -> Option<HeaderValue> {
    let mut field = String::with_capacity(64);
    for (index, (name, params)) in items.enumerate() {
        if index > 0 {
            field.push_str(", ");
        }
        let _ = write!(field, "\"{name}\"");
        for (key, value) in params {
            let _ = write!(field, ";{key}={value}");
        }
    }
    HeaderValue::from_str(&field).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_seconds(Duration::from_millis(1)), 1);
        assert_eq!(ceil_seconds(Duration::from_secs(2)), 2);
        assert_eq!(ceil_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(ceil_seconds(Duration::ZERO), 0);
    }
}
