//! Raw HTTP/1.1 over TCP, for tests that need the exact bytes on the wire: one request sent
//! verbatim and its response read ([`raw_http`]), and one client connection kept open
//! ([`Wire`]) for pipelined requests, framing conflicts, partial heads, and seeing when the
//! server closes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A parsed HTTP/1.1 response read from a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header (lowercased name, value), in wire order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == &name.to_ascii_lowercase())
            .map(|(_, v)| v.as_str())
    }

    pub fn has_header(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}

/// Send `request` verbatim to `addr` and read one response (Content-Length,
/// chunked, or until EOF). Times out after 10 s.
pub async fn raw_http(addr: SocketAddr, request: &str) -> RawResponse {
    tokio::time::timeout(Duration::from_secs(10), raw_http_inner(addr, request))
        .await
        .unwrap_or_else(|_| panic!("raw HTTP request to {addr} timed out:\n{request}"))
}

async fn raw_http_inner(addr: SocketAddr, request: &str) -> RawResponse {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 8192];
    // Read the head.
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        let n = s.read(&mut tmp).await.unwrap();
        assert!(
            n > 0,
            "connection closed before response head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&tmp[..n]);
    };
    let (status, headers) = parse_head(&buf[..head_end]);
    let mut rest = buf[head_end + 4..].to_vec();
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let body = if let Some(len) = get("content-length") {
        let len: usize = len.parse().unwrap();
        while rest.len() < len {
            let n = s.read(&mut tmp).await.unwrap();
            assert!(n > 0, "connection closed mid-body");
            rest.extend_from_slice(&tmp[..n]);
        }
        rest.truncate(len);
        rest
    } else if get("transfer-encoding")
        .map(|v| v.to_ascii_lowercase().contains("chunked"))
        .unwrap_or(false)
    {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&rest, b"\r\n") {
                    break i;
                }
                let n = s.read(&mut tmp).await.unwrap();
                assert!(n > 0, "connection closed in chunk size");
                rest.extend_from_slice(&tmp[..n]);
            };
            let size_str = String::from_utf8_lossy(&rest[..line_end]).into_owned();
            let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16)
                .unwrap_or_else(|_| panic!("bad chunk size {size_str:?}"));
            rest.drain(..line_end + 2);
            if size == 0 {
                break;
            }
            while rest.len() < size + 2 {
                let n = s.read(&mut tmp).await.unwrap();
                assert!(n > 0, "connection closed mid-chunk");
                rest.extend_from_slice(&tmp[..n]);
            }
            body.extend_from_slice(&rest[..size]);
            rest.drain(..size + 2);
        }
        body
    } else if status == 204 || status == 304 {
        Vec::new()
    } else {
        loop {
            let n = s.read(&mut tmp).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            rest.extend_from_slice(&tmp[..n]);
        }
        rest
    };
    RawResponse {
        status,
        headers,
        body,
    }
}

/// The status and the (lower-cased name, value) header fields of a response head, without
/// its final blank line.
fn parse_head(head: &[u8]) -> (u16, Vec<(String, String)>) {
    let head = String::from_utf8_lossy(head);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, v) = l.split_once(':').expect("header line");
            (n.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    (status, headers)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One client connection, with what has been read but not yet parsed.
pub struct Wire {
    stream: TcpStream,
    buf: Vec<u8>,
    /// The server closed the connection (EOF or reset).
    closed: bool,
}

/// Why [`Wire::try_response`] returned no response.
#[derive(Debug, PartialEq, Eq)]
pub enum NoResponse {
    /// Nothing complete arrived in time; the connection is still open.
    Timeout,
    /// The server closed the connection first.
    Closed,
}

impl Wire {
    pub async fn connect(addr: SocketAddr) -> Wire {
        let stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        let _ = stream.set_nodelay(true);
        Wire {
            stream,
            buf: Vec::new(),
            closed: false,
        }
    }

    /// Writes `bytes`; an error (the server already closed) is returned, not a panic.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Sends `POST path` with `fields` (each ending in CRLF) and `body`, in two writes 50 ms
    /// apart: the head, then the body, so that the server reads the head alone and the body
    /// arrives after it, as from a client that waits for `100 Continue` or a slow one. An
    /// error (the server already closed) is returned, not a panic.
    pub async fn post_body_after_head(
        &mut self,
        path: &str,
        fields: &str,
        body: &[u8],
    ) -> std::io::Result<()> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{fields}content-length: {}\r\n\r\n",
            body.len()
        );
        self.send(head.as_bytes()).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.send(body).await
    }

    /// The next response, or a panic if none arrives whole within `within`.
    pub async fn response(&mut self, within: Duration) -> RawResponse {
        match self.try_response(within).await {
            Ok(response) => response,
            Err(why) => panic!(
                "no whole response within {within:?} ({why:?}); received: {:?}",
                String::from_utf8_lossy(&self.buf)
            ),
        }
    }

    /// The next response, if one arrives whole within `within`.
    pub async fn try_response(&mut self, within: Duration) -> Result<RawResponse, NoResponse> {
        let deadline = Instant::now() + within;
        loop {
            if let Some((response, used)) = parse_response(&self.buf, self.closed) {
                self.buf.drain(..used);
                return Ok(response);
            }
            if self.closed {
                return Err(NoResponse::Closed);
            }
            if !self.read_until(deadline).await {
                return Err(NoResponse::Timeout);
            }
        }
    }

    /// Waits for the server to close the connection; how long it took, or `None` if it is
    /// still open after `within`. Bytes that arrive meanwhile are kept for [`Self::rest`].
    pub async fn closed_within(&mut self, within: Duration) -> Option<Duration> {
        let start = Instant::now();
        let deadline = start + within;
        while !self.closed {
            if !self.read_until(deadline).await {
                return None;
            }
        }
        Some(start.elapsed())
    }

    /// Whether the server has closed the connection (as far as has been read).
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Bytes received and not parsed as a response.
    pub fn rest(&self) -> &[u8] {
        &self.buf
    }

    /// Reads once, before `deadline`; false if the deadline passed first.
    async fn read_until(&mut self, deadline: Instant) -> bool {
        let mut tmp = [0u8; 16 * 1024];
        let read = tokio::time::timeout_at(deadline.into(), self.stream.read(&mut tmp)).await;
        match read {
            Err(_) => false,
            Ok(Ok(0)) | Ok(Err(_)) => {
                self.closed = true;
                true
            }
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }
}

/// Every response in `bytes`, read to the server's close.
pub fn parse_responses(mut bytes: &[u8]) -> Vec<RawResponse> {
    let mut responses = Vec::new();
    while let Some((response, used)) = parse_response(bytes, true) {
        responses.push(response);
        bytes = &bytes[used..];
    }
    responses
}

/// One whole response at the start of `buf` and how many bytes it took; `closed`: no more
/// bytes will come, so a body without framing ends here.
fn parse_response(buf: &[u8], closed: bool) -> Option<(RawResponse, usize)> {
    let head_end = find(buf, b"\r\n\r\n")?;
    let (status, headers) = parse_head(&buf[..head_end]);
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let body_start = head_end + 4;
    let rest = &buf[body_start..];
    let (body, used) = if let Some(len) = get("content-length") {
        let len: usize = len.parse().expect("content-length");
        (rest.get(..len)?.to_vec(), len)
    } else if get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        parse_chunked(rest)?
    } else if status == 204 || status == 304 || status < 200 {
        (Vec::new(), 0)
    } else if closed {
        (rest.to_vec(), rest.len())
    } else {
        return None;
    };
    let response = RawResponse {
        status,
        headers,
        body,
    };
    Some((response, body_start + used))
}

/// A whole chunked body (without trailers) and how many bytes it took.
fn parse_chunked(mut rest: &[u8]) -> Option<(Vec<u8>, usize)> {
    let total = rest.len();
    let mut body = Vec::new();
    loop {
        let line_end = find(rest, b"\r\n")?;
        let line = String::from_utf8_lossy(&rest[..line_end]).into_owned();
        let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {line:?}"));
        rest = &rest[line_end + 2..];
        if size == 0 {
            rest = rest.strip_prefix(b"\r\n")?;
            return Some((body, total - rest.len()));
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}
