//! What a gRPC client is told when sluice refuses its call. The answer stays an HTTP `429`
//! (counted, logged and given RateLimit fields like any other), with `grpc-status: 14`
//! (UNAVAILABLE) and a `grpc-message` added: gRPC maps an HTTP 429 without a status to
//! UNAVAILABLE, and some clients read `grpc-status` from a non-200 answer while others ignore
//! it, so saying 14 makes every client see the same code.

use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// gRPC's UNAVAILABLE.
const UNAVAILABLE: &str = "14";

/// Whether the request is a gRPC call: `application/grpc`, or `application/grpc+proto` and
/// the like.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            let value = value.trim_start();
            value.len() >= 16
                && value[..16].eq_ignore_ascii_case("application/grpc")
                && matches!(value.as_bytes().get(16), None | Some(b'+' | b';'))
        })
}

/// Adds the gRPC status of a rate-limit refusal to a `429`.
pub fn mark_limited(headers: &mut HeaderMap, retry_after_secs: u64) {
    headers.insert(GRPC_STATUS, HeaderValue::from_static(UNAVAILABLE));
    // Visible ASCII and spaces only: nothing to percent-encode.
    let message = format!("rate limited by sluice; retry in {retry_after_secs} s");
    if let Ok(value) = HeaderValue::from_str(&message) {
        headers.insert(GRPC_MESSAGE, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        headers
    }

    #[test]
    fn grpc_content_types_are_recognised() {
        assert!(is_grpc(&headers("application/grpc")));
        assert!(is_grpc(&headers("application/grpc+proto")));
        assert!(is_grpc(&headers("Application/GRPC; charset=utf-8")));
        assert!(!is_grpc(&headers("application/grpc-web")));
        assert!(!is_grpc(&headers("application/json")));
        assert!(!is_grpc(&HeaderMap::new()));
    }
}
