//! Requests refused before routing, because forwarding them could mislead the upstream or
//! let a request slip past the route (and the limits) meant for it.
//!
//! Framing conflicts (RFC 9112 §6.3) never get this far: hyper answers 400 to conflicting
//! Content-Length values, and for Transfer-Encoding with Content-Length it drops the length
//! and reads the chunked body, then closes the connection, so what is forwarded is framed one
//! way only.

use http::Request;

/// Why a request was refused, as told to the client.
pub fn refusal<B>(request: &Request<B>) -> Option<&'static str> {
    if has_dot_segment(request.uri().path()) {
        return Some("the path has `.` or `..` segments; send the normalized path");
    }
    None
}

/// `/api/../login` would match the `/api` route here and reach `/login` upstream after the
/// upstream normalizes it, escaping the limits of `/login`. Encoded dots count too.
fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(|segment| {
        let decoded = segment.to_ascii_lowercase().replace("%2e", ".");
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
}
