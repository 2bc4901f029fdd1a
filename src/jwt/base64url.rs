//! Unpadded base64url (RFC 7515 §2), the encoding of a JWT's three parts and of a JWK's
//! numbers: decoding only, strict, so a token has one spelling.

/// Decodes unpadded base64url (RFC 7515 §2); `None` on any other character, on padding,
/// or on a length no encoding produces.
pub fn base64url(text: &[u8]) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return None,
        } as u32)
    };
    if text.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.chunks(4) {
        let mut bits = 0u32;
        for &c in chunk {
            bits = (bits << 6) | value(c)?;
        }
        let bytes = bits.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(&bytes[1..4]),
            // 18 bits: two bytes and two zero bits.
            3 => {
                if bits & 0x3 != 0 {
                    return None;
                }
                out.extend_from_slice(&(bits >> 2).to_be_bytes()[2..4]);
            }
            // 12 bits: one byte and four zero bits.
            _ => {
                if bits & 0xF != 0 {
                    return None;
                }
                out.push((bits >> 4) as u8);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_decodes_what_rfc_4648_encodes() {
        assert_eq!(base64url(b"").as_deref(), Some(&b""[..]));
        assert_eq!(base64url(b"Zg").as_deref(), Some(&b"f"[..]));
        assert_eq!(base64url(b"Zm8").as_deref(), Some(&b"fo"[..]));
        assert_eq!(base64url(b"Zm9v").as_deref(), Some(&b"foo"[..]));
        assert_eq!(base64url(b"Zm9vYg").as_deref(), Some(&b"foob"[..]));
        assert_eq!(base64url(b"-_8").as_deref(), Some(&[0xfb, 0xff][..]));
        assert_eq!(base64url(b"Zm9v="), None, "padding");
        assert_eq!(base64url(b"Zm+v"), None, "not the URL alphabet");
        assert_eq!(base64url(b"Zh"), None, "non-zero trailing bits");
        assert_eq!(base64url(b"Z"), None);
    }

    /// The RFC 4648 §5 encoding, unpadded, written plainly for the property below.
    fn encode(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let mut bits = 0u32;
            for (i, &b) in chunk.iter().enumerate() {
                bits |= u32::from(b) << (16 - 8 * i);
            }
            for i in 0..=chunk.len() {
                out.push(ALPHABET[((bits >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    proptest::proptest! {
        /// Whatever a client sends as a token part: every encoding decodes back to its bytes,
        /// and a text with a character outside the URL alphabet (padding, `+`, `/`, spaces,
        /// anything non-ASCII) is refused, never decoded to something.
        #[test]
        fn decodes_every_encoding_and_refuses_every_other_character(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
            noise in "[^A-Za-z0-9_-]",
            at in 0usize..100,
        ) {
            let text = encode(&bytes);
            proptest::prop_assert_eq!(base64url(text.as_bytes()), Some(bytes));
            let mut spoiled = text.clone();
            spoiled.insert_str(at.min(text.len()), &noise);
            proptest::prop_assert_eq!(base64url(spoiled.as_bytes()), None);
        }
    }
}
