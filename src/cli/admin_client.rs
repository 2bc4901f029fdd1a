//! The admin API as the commands that talk to a running sluice call it: plain HTTP/1.1 to
//! `--admin http://host:port`, the bearer token from `--token-file` or `SLUICE_ADMIN_TOKEN`,
//! and `X-Sluice-Admin: 1` on every call (the header the admin API asks of changes, which a
//! web page cannot send).

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Full};
use tokio::net::TcpStream;

/// The environment variable holding the admin token when no `--token-file` is given.
pub const TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";

/// How long one call may take, connection included.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What went wrong calling the admin API.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("--admin `{0}`: expected http://host:port")]
    Address(String),
    #[error("cannot read the token file {file}: {source}")]
    TokenFile {
        file: String,
        source: std::io::Error,
    },
    #[error("cannot reach the admin API at {address}: {reason}")]
    Unreachable { address: String, reason: String },
    #[error("the admin API answered {status}: {detail}")]
    Refused { status: StatusCode, detail: String },
    #[error("the admin API's answer is not JSON: {0}")]
    NotJson(String),
}

/// Where the admin API is and how to authenticate to it.
pub struct AdminClient {
    base: Uri,
    token: Option<String>,
}

impl AdminClient {
    /// `admin`: `http://host:port`; the token from `token_file`, else from `SLUICE_ADMIN_TOKEN`
    /// (none: the admin API must be on loopback without a token).
    pub fn new(admin: &str, token_file: Option<&Path>) -> Result<AdminClient, AdminError> {
        let base: Uri = admin
            .trim_end_matches('/')
            .parse()
            .map_err(|_| AdminError::Address(admin.to_owned()))?;
        if base.scheme_str() != Some("http") || base.authority().is_none() {
            return Err(AdminError::Address(admin.to_owned()));
        }
        let token = match token_file {
            Some(file) => Some(
                std::fs::read_to_string(file)
                    .map_err(|source| AdminError::TokenFile {
                        file: file.display().to_string(),
                        source,
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()),
        };
        Ok(AdminClient { base, token })
    }

    /// Calls `method` on `path_and_query` (from `/admin/v1/...`) with `body`; the answer's
    /// JSON, or the problem it answered with.
    pub async fn call(
        &self,
        method: Method,
        path_and_query: &str,
        body: Bytes,
    ) -> Result<serde_json::Value, AdminError> {
        tokio::time::timeout(CALL_TIMEOUT, self.call_once(method, path_and_query, body))
            .await
            .unwrap_or_else(|_| {
                Err(self.unreachable(format!("no answer within {}s", CALL_TIMEOUT.as_secs())))
            })
    }

    async fn call_once(
        &self,
        method: Method,
        path_and_query: &str,
        body: Bytes,
    ) -> Result<serde_json::Value, AdminError> {
        let authority = self
            .base
            .authority()
            .map(|a| a.as_str())
            .unwrap_or_default();
        let port = self.base.port_u16().unwrap_or(80);
        let host = self
            .base
            .host()
            .unwrap_or_default()
            .trim_matches(['[', ']']);
        let stream = TcpStream::connect((host, port))
            .await
            .map_err(|err| self.unreachable(err.to_string()))?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|err| self.unreachable(err.to_string()))?;
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(http::header::HOST, authority)
            .header("x-sluice-admin", "1")
            .header(http::header::CONTENT_TYPE, "application/x-ndjson");
        if let Some(token) = &self.token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Full::new(body))
            .map_err(|err| self.unreachable(err.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|err| self.unreachable(err.to_string()))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|err| self.unreachable(err.to_string()))?
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|_| AdminError::NotJson(String::from_utf8_lossy(&bytes).into_owned()))?;
        if status.is_success() {
            return Ok(json);
        }
        let mut detail = json["detail"].as_str().unwrap_or("").to_owned();
        if let Some(errors) = json["errors"].as_array() {
            for error in errors {
                detail.push_str(&format!(
                    "\n  line {}: {}",
                    error["line"],
                    error["error"].as_str().unwrap_or("")
                ));
            }
        }
        Err(AdminError::Refused { status, detail })
    }

    fn unreachable(&self, reason: String) -> AdminError {
        AdminError::Unreachable {
            address: self.base.to_string(),
            reason,
        }
    }
}
