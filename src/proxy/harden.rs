//! Requests refused before routing, because forwarding them could mislead the upstream or
//! let a request slip past the route (and the limits) meant for it.

use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::Request;

/// Why a request was refused, as told to the client.
pub fn refusal<B>(request: &Request<B>) -> Option<&'static str> {
    let headers = request.headers();
    // RFC 9112 §6.3: a message with both is a smuggling attempt or a broken client.
    if headers.contains_key(TRANSFER_ENCODING) && headers.contains_key(CONTENT_LENGTH) {
        return Some("a request cannot have both Content-Length and Transfer-Encoding");
    }
    if has_dot_segment(request.uri().path()) {
        return Some("the path has `.` or `..` segments; send the normalized path");
    }
    None
}

/// `/api/../login` would match the `/api` route here and reach `/login` upstream after the
/// upstream normalizes it, escaping the limits of `/login`. Encoded dots count too.
fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(|segment| {
        let decoded = segment
            .to_ascii_lowercase()
            .replace("%2e", ".");
        decoded == "." || decoded == ".."
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments() {
        assert!(has_dot_segment("/api/../login"));
        assert!(has_dot_segment("/api/%2E%2e/login"));
        assert!(has_dot_segment("/./x"));
        assert!(!has_dot_segment("/a/b.c/..d/x"));
        assert!(!has_dot_segment("/"));
    }

    #[test]
    fn content_length_with_transfer_encoding() {
        let request = Request::post("/")
            .header("content-length", "5")
            .header("transfer-encoding", "chunked")
            .body(())
            .unwrap();
        assert!(refusal(&request).is_some());
    }
}
