//! How a value a client sent is written into a store key, for the HTTP limits
//! (`request::store_key`) and the rate limit service's descriptors (`rls::key`) alike: raw and
//! escaped when short and printable, otherwise as `#` and a hash, so no client can make a key
//! long, unreadable, or equal to another value's.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

/// Longest value, in bytes, written into a key as it came; longer values are hashed.
pub const MAX_RAW_VALUE: usize = 64;

/// Hex digits of the truncated SHA-256 written for a hashed value (128 bits).
pub const HASH_HEX_DIGITS: usize = 32;

/// Writes `values` (several count as one identity, in the order sent, joined by `,`): raw
/// when short and printable, with `%`, `,`, `#` and each of the key's own separators
/// `reserved` escaped (`%XX`, as are spaces), so a value cannot forge a separator, the join,
/// or the mark of a hashed value; otherwise `#` and a SHA-256 of the values truncated to
/// [`HASH_HEX_DIGITS`] hex digits. At most `3 * (MAX_RAW_VALUE + 1)` bytes either way.
pub fn push_values<V: AsRef<[u8]>>(key: &mut String, values: &[V], reserved: &[u8]) {
    let total: usize = values.iter().map(|v| v.as_ref().len() + 1).sum();
    let printable = values
        .iter()
        .all(|v| v.as_ref().iter().all(|b| (0x20..=0x7E).contains(b)));
    if printable && total <= MAX_RAW_VALUE + 1 {
        for (index, value) in values.iter().enumerate() {
            if index > 0 {
                key.push(',');
            }
            push_escaped(key, value.as_ref(), reserved);
        }
    } else {
        let mut hasher = Sha256::new();
        for value in values {
            // Length-prefixed, so no two lists of values hash the same input.
            hasher.update((value.as_ref().len() as u64).to_be_bytes());
            hasher.update(value.as_ref());
        }
        key.push('#');
        for byte in &hasher.finalize()[..HASH_HEX_DIGITS / 2] {
            let _ = write!(key, "{byte:02x}");
        }
    }
}

fn push_escaped(key: &mut String, bytes: &[u8], reserved: &[u8]) {
    for &byte in bytes {
        if matches!(byte, b'%' | b',' | b'#') || reserved.contains(&byte) {
            let _ = write!(key, "%{byte:02X}");
        } else if (0x21..=0x7E).contains(&byte) {
            key.push(char::from(byte));
        } else {
            let _ = write!(key, "%{byte:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(values: &[&[u8]], reserved: &[u8]) -> String {
        let mut key = String::new();
        push_values(&mut key, values, reserved);
        key
    }

    #[test]
    fn short_printable_values_are_escaped_and_others_hashed() {
        assert_eq!(written(&[b"a b%,#:"], b":"), "a%20b%25%2C%23%3A");
        assert_eq!(written(&[b"a", b"b"], b""), "a,b");
        assert_eq!(written(&[&[b'k'; MAX_RAW_VALUE]], b"").len(), MAX_RAW_VALUE);
        for hashed in [
            written(&[&[b'k'; MAX_RAW_VALUE + 1]], b""),
            written(&["caf\u{e9}".as_bytes()], b""),
            written(&[b"\0"], b""),
        ] {
            assert!(hashed.starts_with('#'), "{hashed}");
            assert_eq!(hashed.len(), HASH_HEX_DIGITS + 1, "{hashed}");
        }
    }
}
