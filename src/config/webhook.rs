//! `webhook:`: where threshold notifications go (a limit's `notify: { at: [...] }`), and a
//! limit's `notify`. The shared secret that signs them is never in the file (a policy file is
//! committed, mounted from ConfigMaps, printed by `/admin/v1/config`), as with the admin
//! token: the file names the environment variable or the file that holds it.

use std::path::PathBuf;
use std::str::FromStr;

use http::uri::{Authority, Uri};
use serde::de::{Deserialize, Deserializer, Error as _};

use super::{ConfigDuration, EnvName, Positive, Spanned};

/// Default time one POST may take, from connecting to the receiver's answer.
pub const DEFAULT_WEBHOOK_TIMEOUT_MS: u64 = 5_000;
/// Default tries after the first one, on a connection error, a timeout or a 5xx.
pub const DEFAULT_WEBHOOK_RETRIES: u32 = 3;
/// Default wait before the first retry; each next one waits twice as long.
pub const DEFAULT_WEBHOOK_BACKOFF_MS: u64 = 1_000;
/// Default most notifications waiting to be sent; more are dropped and counted.
pub const DEFAULT_WEBHOOK_QUEUE: u32 = 1_024;

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// Where each notification is POSTed (`https://hooks.example.com/sluice`, or
    /// `http://host:port/path` on a private network).
    #[schemars(with = "WebhookUrl")]
    pub url: Spanned<WebhookUrl>,
    /// The environment variable holding the shared secret the `sluice-signature` header is
    /// made with (HMAC-SHA256); exactly one of `secret_env` and `secret_file`.
    #[schemars(with = "Option<EnvName>")]
    pub secret_env: Option<Spanned<EnvName>>,
    /// A file holding that secret (a mounted Kubernetes Secret); trailing line breaks are
    /// not part of it.
    #[schemars(with = "Option<PathBuf>")]
    pub secret_file: Option<Spanned<PathBuf>>,
    /// How long one POST may take, from connecting to the answer's status; 5s by default.
    #[serde(default = "default_timeout")]
    pub timeout: ConfigDuration,
    /// Tries after the first, on a connection error, a timeout or a 5xx answer (3 by
    /// default); then the notification is dropped, logged and counted as `failed`.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// The wait before the first retry (1s by default), doubled before each next one.
    #[serde(default = "default_backoff")]
    pub backoff: ConfigDuration,
    /// Most notifications waiting to be sent (1024 by default): past it, a new one is
    /// dropped and counted as `dropped`, never waited for by a request.
    #[serde(default = "default_queue")]
    pub queue: Positive,
    /// For an `https://` URL: a PEM bundle of the CAs that may sign the receiver's
    /// certificate; the Mozilla roots built into sluice when not given.
    #[schemars(with = "Option<PathBuf>")]
    pub ca_file: Option<Spanned<PathBuf>>,
}

/// A limit's `notify`: the fractions of its number (the identity's override when one is in
/// force) whose crossing is POSTed to `webhook:`, once per identity and window or period.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NotifyConfig {
    /// Fractions in (0, 1], ascending, at most 5 (`[0.5, 0.8, 1.0]`), to a thousandth.
    #[schemars(with = "Vec<f64>")]
    pub at: Vec<Spanned<f64>>,
}

/// The webhook's address: `https://` or `http://`, an authority, a path and query sent as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl {
    pub authority: Authority,
    /// Where to connect: the authority's host and port, the scheme's port (443, 80) when the
    /// URL names none.
    pub connect: String,
    /// Whether the POST goes over TLS (`https://`), the certificate checked for `host`.
    pub tls: bool,
    /// The host, as the receiver's certificate must name it.
    pub host: String,
    /// The path and query of the POST (`/` when the URL has none).
    pub path: String,
}

impl FromStr for WebhookUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let uri: Uri = text
            .parse()
            .map_err(|e| format!("`{text}` is not a URL: {e}"))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(format!(
                    "expected a URL like https://hooks.example.com/sluice, got `{text}`"
                ))
            }
        };
        let authority = uri
            .authority()
            .filter(|a| !a.as_str().contains('@'))
            .ok_or_else(|| format!("`{text}` names no host (or has credentials in it)"))?
            .clone();
        let path = uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let connect = format!("{}:{port}", authority.host());
        // The certificate names the host without an IPv6 literal's brackets.
        let host = authority.host().trim_matches(['[', ']']).to_owned();
        Ok(WebhookUrl {
            connect,
            tls,
            host,
            authority,
            path: if path.is_empty() {
                "/".to_owned()
            } else {
                path
            },
        })
    }
}

impl<'de> Deserialize<'de> for WebhookUrl {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(D::Error::custom)
    }
}

fn default_timeout() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_WEBHOOK_TIMEOUT_MS))
}

fn default_retries() -> u32 {
    DEFAULT_WEBHOOK_RETRIES
}

fn default_backoff() -> ConfigDuration {
    ConfigDuration(std::time::Duration::from_millis(DEFAULT_WEBHOOK_BACKOFF_MS))
}

fn default_queue() -> Positive {
    Positive(DEFAULT_WEBHOOK_QUEUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webhook_urls() {
        let url: WebhookUrl = "http://hooks.internal:8080/sluice?x=1"
            .parse()
            .expect("valid");
        assert_eq!(url.authority.as_str(), "hooks.internal:8080");
        assert_eq!(url.path, "/sluice?x=1");
        assert_eq!(url.connect, "hooks.internal:8080");
        let bare: WebhookUrl = "http://127.0.0.1:9".parse().expect("valid");
        assert_eq!(bare.path, "/");
        // No port: http's own (a socket address needs one).
        let default: WebhookUrl = "http://hooks.internal/sluice".parse().expect("valid");
        assert_eq!(default.connect, "hooks.internal:80");
        let v6: WebhookUrl = "http://[::1]/".parse().expect("valid");
        assert_eq!(v6.connect, "[::1]:80");
        let secure: WebhookUrl = "https://hooks.example.com/s".parse().expect("valid");
        assert_eq!(
            (secure.connect.as_str(), secure.tls, secure.host.as_str()),
            ("hooks.example.com:443", true, "hooks.example.com")
        );
        assert!(!default.tls);
        for bad in ["ftp://x", "x", "http://u:p@x/"] {
            assert!(bad.parse::<WebhookUrl>().is_err(), "{bad}");
        }
    }
}
