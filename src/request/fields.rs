//! Readers of the request's fields as the limits read them: the values of a query
//! parameter (percent-decoded) and of a cookie (in every `Cookie` field), and the one-reading
//! rule's question, whether a field the route reads is sent more than once. The store key
//! (`store_key`) and the one-reading rules (`one_reading`) read fields through these alone, so
//! they never read a request two ways.

use http::header::COOKIE;
use http::{HeaderMap, Uri};

use crate::policy::Field;

/// The first of `fields` that the request carries more than once: two header field lines,
/// two query parameters of one (decoded) name, or one cookie name twice in the `Cookie`
/// field(s). A list-based header nobody reads for a limit is not looked at.
pub fn repeated_field<'f>(
    fields: &'f [Field],
    uri: &Uri,
    headers: &HeaderMap,
) -> Option<&'f Field> {
    fields.iter().find(|field| match field {
        Field::Header(name) => headers.get_all(name).iter().nth(1).is_some(),
        Field::Query(name) => query_values(uri, name).nth(1).is_some(),
        Field::Cookie(name) => cookie_values(headers, name).nth(1).is_some(),
    })
}

/// The values of query parameter `name`, percent-decoded (`+` as a space, as forms encode
/// it), so `?key=abc` and `?key=%61bc`, which the upstream reads alike, are one identity.
pub fn query_values<'a>(uri: &'a Uri, name: &'a str) -> impl Iterator<Item = Vec<u8>> + 'a {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(move |pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key) == name.as_bytes()).then(|| percent_decode(value))
        })
}

pub fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = |i: usize| bytes.get(i).and_then(|b| char::from(*b).to_digit(16));
        match (bytes[index], hex(index + 1), hex(index + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                index += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                index += 1;
            }
            (byte, _, _) => {
                out.push(byte);
                index += 1;
            }
        }
    }
    out
}

/// The values of cookie `name` in every `Cookie` field, quotes removed.
pub fn cookie_values<'a>(
    headers: &'a HeaderMap,
    name: &'a str,
) -> impl Iterator<Item = &'a [u8]> + 'a {
    headers
        .get_all(COOKIE)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let pair = pair.trim_ascii();
            let at = pair.iter().position(|&b| b == b'=')?;
            let (key, value) = (&pair[..at], &pair[at + 1..]);
            (key.trim_ascii() == name.as_bytes()).then(|| {
                let value = value.trim_ascii();
                value
                    .strip_prefix(b"\"")
                    .and_then(|v| v.strip_suffix(b"\""))
                    .unwrap_or(value)
            })
        })
}
