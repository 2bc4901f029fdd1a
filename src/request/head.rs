//! Reading the head, first for every request: refuse a head that is too large, rewrite the
//! path to its one canonical spelling (see `crate::path`), then make the head the one reading
//! the router, the limiter and the upstream share (`super::one_reading`), before anything
//! routes on it.
//!
//! The HTTP parser enforces twice these limits on its own (a bare 431 and a closed
//! connection, see `server`); within that, this phase answers with a precise status and a
//! problem+json body, and counts the refusal.
//!
//! Framing conflicts (RFC 9112 §6.3) never get this far: hyper answers 400 to conflicting
//! Content-Length values, and for Transfer-Encoding with Content-Length it drops the length
//! and reads the chunked body, then closes the connection, so what is forwarded is framed one
//! way only.

use http::request::Parts;
use http::uri::{PathAndQuery, Uri};
use http::StatusCode;

use super::{one_reading, Why};
use crate::config::ServerConfig;
use crate::metrics::Refusal;
use crate::path;
use crate::policy::Policy;

/// The request-head limits of `server:` in the config, in bytes and fields.
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    pub max_request_line: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
}

impl HeadLimits {
    pub fn new(config: &ServerConfig) -> HeadLimits {
        let bytes = |size: crate::config::ByteSize| usize::try_from(size.0).unwrap_or(usize::MAX);
        HeadLimits {
            max_request_line: bytes(config.max_request_line),
            max_header_bytes: bytes(config.max_header_bytes),
            max_headers: config.max_headers.0 as usize,
        }
    }
}

/// Reads a request's head: its limits, its canonical path, its one reading under `policy`.
pub fn read(head: &mut Parts, limits: &HeadLimits, policy: &Policy) -> Result<(), Why> {
    admit_head(head, limits)?;
    Ok(one_reading::prepare(head, policy)?)
}

/// Checks the head against `limits`, then puts the canonical path in the request's URI.
fn admit_head(request: &mut Parts, limits: &HeadLimits) -> Result<(), Why> {
    // `GET /path?query HTTP/1.1`: the method, the target and the version with their spaces.
    let target = request
        .uri
        .path_and_query()
        .map_or(1, |pq| pq.as_str().len())
        + request.uri.authority().map_or(0, |a| a.as_str().len());
    let request_line = request.method.as_str().len() + 1 + target + 9;
    if request_line > limits.max_request_line {
        return Err(Why::Unreadable {
            status: StatusCode::URI_TOO_LONG,
            detail: format!(
                "the request line is {request_line} bytes; at most {} are accepted",
                limits.max_request_line
            ),
            reason: Refusal::RequestLine,
        });
    }
    let headers = &request.headers;
    if headers.len() > limits.max_headers {
        return Err(Why::Unreadable {
            status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            detail: format!(
                "the request has {} header fields; at most {} are accepted",
                headers.len(),
                limits.max_headers
            ),
            reason: Refusal::HeaderCount,
        });
    }
    // As on the wire: `name: value` and CRLF.
    let header_bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if header_bytes > limits.max_header_bytes {
        return Err(Why::Unreadable {
            status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            detail: format!(
                "the header fields take {header_bytes} bytes; at most {} are accepted",
                limits.max_header_bytes
            ),
            reason: Refusal::HeaderBytes,
        });
    }
    canonicalize(request).map_err(|detail| Why::Unreadable {
        status: StatusCode::BAD_REQUEST,
        detail,
        reason: Refusal::Path,
    })
}

/// Replaces the request's path with its canonical form, keeping the query as sent. Most paths
/// are canonical already and cost no allocation.
fn canonicalize(request: &mut Parts) -> Result<(), String> {
    let uri = &request.uri;
    let canonical = match path::normalize(uri.path()) {
        Ok(std::borrow::Cow::Borrowed(_)) => return Ok(()),
        Ok(std::borrow::Cow::Owned(canonical)) => canonical,
        Err(err) => return Err(err.to_string()),
    };
    let path_and_query = match uri.query() {
        Some(query) => format!("{canonical}?{query}"),
        None => canonical,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(
        PathAndQuery::try_from(path_and_query)
            .map_err(|e| format!("the normalized path is not a valid URI path: {e}"))?,
    );
    request.uri =
        Uri::from_parts(parts).map_err(|e| format!("the normalized URI is not valid: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HeadLimits = HeadLimits {
        max_request_line: 64,
        max_header_bytes: 100,
        max_headers: 3,
    };

    fn request(target: &str) -> Parts {
        http::Request::get(target).body(()).unwrap().into_parts().0
    }

    fn refusal(why: Why) -> (StatusCode, Refusal) {
        match why {
            Why::Unreadable { status, reason, .. } => (status, reason),
            other => panic!("not a refusal: {other:?}"),
        }
    }

    #[test]
    fn the_canonical_path_replaces_the_sent_one_and_the_query_is_kept() {
        let mut r = request("http://api.example//%6Cogin?next=%2F%2e%2e");
        assert!(admit_head(&mut r, &LIMITS).is_ok());
        assert_eq!(r.uri, "http://api.example/login?next=%2F%2e%2e");
    }

    #[test]
    fn limits_answer_their_own_status() {
        let long = format!("/{}", "a".repeat(60));
        let refused = refusal(admit_head(&mut request(&long), &LIMITS).err().unwrap());
        assert_eq!(refused.0, StatusCode::URI_TOO_LONG);

        let mut many = request("/");
        for name in ["a", "b", "c", "d"] {
            many.headers.insert(name, "1".parse().unwrap());
        }
        let refused = refusal(admit_head(&mut many, &LIMITS).err().unwrap());
        assert_eq!(refused.0, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert!(matches!(refused.1, Refusal::HeaderCount));

        let mut big = request("/");
        big.headers.insert("x", "v".repeat(96).parse().unwrap());
        let refused = refusal(admit_head(&mut big, &LIMITS).err().unwrap());
        assert!(matches!(refused.1, Refusal::HeaderBytes));
        big.headers.insert("x", "v".repeat(95).parse().unwrap());
        assert!(
            admit_head(&mut big, &LIMITS).is_ok(),
            "exactly at the limit"
        );
    }

    #[test]
    fn an_ambiguous_path_is_a_400() {
        let refused = refusal(admit_head(&mut request("/a%2Fb"), &LIMITS).err().unwrap());
        assert_eq!(refused.0, StatusCode::BAD_REQUEST);
    }
}
