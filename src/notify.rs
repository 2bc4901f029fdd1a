//! Threshold notifications: a limit's `notify: { at: [...] }` POSTed to `webhook:`, signed.
//!
//! The store decides which notifications there are (`limiter::thresholds`): the decision that
//! crosses a threshold marks it in the same atomic step, so exactly one instance learns of each
//! crossing. That instance hands it to [`Notifier::send`], which never waits: the notification
//! goes into a bounded queue (`webhook.queue`; full, it is dropped and counted), and one task
//! POSTs the queue's notifications in order, each bounded by `webhook.timeout`, retried after
//! a connection error, a timeout or a 5xx answer up to `webhook.retries` times with a doubling
//! backoff, then dropped, logged and counted. Nothing of this runs on a request's task.
//!
//! Each POST carries `sluice-signature: t=<unix seconds>,v1=<hex HMAC-SHA256>`, the HMAC over
//! `<t>.<body>` with the shared secret: a receiver recomputes it, compares in constant time and
//! refuses a `t` too far from its clock, so a captured POST cannot be replayed later.

use std::pin::pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HOST, USER_AGENT};
use http::{Request, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use prometheus::IntCounter;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::config::{WebhookConfig, WebhookUrl};
use crate::limiter::{Check, Decision};
use crate::metrics::Metrics;
use crate::policy::Limit;

/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "sluice-signature";

/// One threshold crossed: the JSON body of its POST.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Notification {
    /// The identity, as `sluice explain` and the admin API write it (`h:x-api-key=k1`).
    pub identity: String,
    pub route: String,
    pub limit: String,
    /// The fraction crossed (`0.8`).
    pub threshold: f64,
    /// The limit's number in force when it was crossed: the identity's override, if any.
    pub quota: u64,
    /// Whether `quota` is the identity's override rather than the policy's number.
    pub overridden: bool,
    /// Used and remaining after the crossing request, in `unit`.
    pub used: u64,
    pub remaining: u64,
    /// `requests`, `tokens`, or a money budget's micro-units (`microUSD`).
    pub unit: String,
    /// A money budget's currency.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// A calendar quota's period (`2026-11`); a rolling window's length instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_seconds: Option<u64>,
    /// When the crossing request was admitted, RFC 3339 UTC by this instance's clock.
    pub at: String,
}

/// `sluice_notifications_total`, one counter per outcome.
#[derive(Clone)]
struct Outcomes {
    sent: IntCounter,
    retried: IntCounter,
    failed: IntCounter,
    dropped: IntCounter,
}

/// The hand-off from the request path to the sender task. Without `webhook:` it holds no
/// queue and sends nothing (no limit can say `notify` then).
pub struct Notifier {
    queue: Option<mpsc::Sender<Notification>>,
    dropped: IntCounter,
}

/// Why the webhook's sender could not start: its secret, or its TLS client.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("webhook.secret_env names the environment variable `{0}`, which is not set or empty: set it to the webhook's shared secret")]
    Env(String),
    #[error("webhook.secret_file: cannot read {0}: {1}")]
    File(String, std::io::Error),
    #[error("webhook.secret_file {0} is empty")]
    EmptyFile(String),
    #[error("webhook: give the shared secret as exactly one of `secret_env` and `secret_file`")]
    NotOne,
    /// The `https://` client could not be built (`webhook.ca_file`, the host's name).
    #[error("{0}")]
    Tls(String),
}

impl Notifier {
    /// A notifier that sends nothing (no `webhook:`).
    pub fn off(metrics: &Metrics) -> Notifier {
        Notifier {
            queue: None,
            dropped: outcomes(metrics).dropped,
        }
    }

    /// Reads the secret and starts the sender task on the current runtime.
    pub fn start(config: &WebhookConfig, metrics: &Metrics) -> Result<Notifier, SecretError> {
        let secret = read_secret(config)?;
        let tls = if config.url.value.tls {
            let (client, _) = crate::tls::upstream::fetch_client(
                config.ca_file.as_ref(),
                std::path::Path::new("the config file"),
                "webhook.ca_file",
            )
            .map_err(|err| SecretError::Tls(err.to_string()))?;
            let name = ServerName::try_from(config.url.value.host.clone())
                .map_err(|err| SecretError::Tls(format!("webhook.url's host: {err}")))?;
            Some((TlsConnector::from(client), name))
        } else {
            None
        };
        let outcomes = outcomes(metrics);
        let (queue, receiver) = mpsc::channel(config.queue.0 as usize);
        let sender = Sender {
            url: config.url.value.clone(),
            tls,
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret),
            timeout: config.timeout.0,
            retries: config.retries,
            backoff: config.backoff.0,
            outcomes: outcomes.clone(),
        };
        tokio::spawn(sender.run(receiver));
        Ok(Notifier {
            queue: Some(queue),
            dropped: outcomes.dropped,
        })
    }

    /// Queues the notifications of the thresholds `decision` crossed (`Decision::crossed`),
    /// never waiting: a full queue drops them, counted.
    pub fn crossed<'a>(
        &self,
        route: &str,
        limits: impl Iterator<Item = (&'a Limit, &'a Check)>,
        decision: &Decision,
    ) {
        if decision.crossed.is_empty() {
            return;
        }
        let at = jiff::Timestamp::now().to_string();
        for (((limit, check), &bits), state) in limits.zip(&decision.crossed).zip(&decision.limits)
        {
            if bits == 0 {
                continue;
            }
            let Some(state) = state else { continue };
            let quota = u64::from(state.overridden.unwrap_or(check.spec.requests));
            let remaining = u64::from(state.remaining);
            for (index, permille) in check.spec.notify.permille().enumerate() {
                if bits & 1 << index == 0 {
                    continue;
                }
                let (currency, unit) = match limit.tokens.as_ref().map(|t| &t.unit) {
                    Some(crate::llm::Unit::Money { currency, label }) => {
                        (Some(currency.clone()), label.clone())
                    }
                    _ => (None, limit.unit().to_owned()),
                };
                let period = check
                    .key
                    .find("}:")
                    .map(|at| check.key[at + 2..].to_owned());
                self.send(Notification {
                    identity: crate::limiter::overrides::identity_of(&check.key).to_owned(),
                    route: route.to_owned(),
                    limit: limit.name.to_string(),
                    threshold: f64::from(permille) / 1000.0,
                    quota,
                    overridden: state.overridden.is_some(),
                    used: quota.saturating_sub(remaining),
                    remaining,
                    unit,
                    currency,
                    window_seconds: period.is_none().then(|| limit.spec.window.as_secs()),
                    period,
                    at: at.clone(),
                });
            }
        }
    }

    /// Queues one notification, never waiting: a full queue drops it, counted.
    pub fn send(&self, notification: Notification) {
        let Some(queue) = &self.queue else { return };
        if let Err(err) = queue.try_send(notification) {
            self.dropped.inc();
            if let mpsc::error::TrySendError::Full(dropped) = err {
                tracing::warn!(route = %dropped.route, limit = %dropped.limit, threshold = dropped.threshold, "the webhook's queue is full: notification dropped");
            }
        }
    }
}

fn outcomes(metrics: &Metrics) -> Outcomes {
    let counter = |outcome: &str| metrics.store.notifications.with_label_values(&[outcome]);
    Outcomes {
        sent: counter("sent"),
        retried: counter("retried"),
        failed: counter("failed"),
        dropped: counter("dropped"),
    }
}

fn read_secret(config: &WebhookConfig) -> Result<Vec<u8>, SecretError> {
    match (&config.secret_env, &config.secret_file) {
        (Some(name), None) => {
            let name = name.value.as_str();
            std::env::var_os(name)
                .filter(|value| !value.is_empty())
                .map(|value| value.into_encoded_bytes())
                .ok_or_else(|| SecretError::Env(name.to_owned()))
        }
        (None, Some(path)) => {
            let shown = path.value.display().to_string();
            let mut bytes =
                std::fs::read(&path.value).map_err(|err| SecretError::File(shown.clone(), err))?;
            while bytes.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
                bytes.pop();
            }
            if bytes.is_empty() {
                return Err(SecretError::EmptyFile(shown));
            }
            Ok(bytes)
        }
        _ => Err(SecretError::NotOne),
    }
}

/// The signature header's value for `body` sent at `unix` seconds: `t=<unix>,v1=<hex HMAC of
/// "<unix>.<body>">`.
pub fn signature(key: &ring::hmac::Key, unix: u64, body: &[u8]) -> String {
    let mut context = ring::hmac::Context::with_key(key);
    context.update(unix.to_string().as_bytes());
    context.update(b".");
    context.update(body);
    let tag = context.sign();
    let mut text = format!("t={unix},v1=");
    for byte in tag.as_ref() {
        text.push_str(&format!("{byte:02x}"));
    }
    text
}

/// The task that POSTs the queue's notifications, one at a time.
struct Sender {
    url: WebhookUrl,
    /// For an `https://` URL: the client and the name the certificate must have.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    key: ring::hmac::Key,
    timeout: Duration,
    retries: u32,
    backoff: Duration,
    outcomes: Outcomes,
}

/// What one try came to.
enum Tried {
    Sent,
    /// A connection error, a timeout or a 5xx: worth another try.
    Again(String),
    /// An answer another try would not change (4xx and the like).
    Refused(StatusCode),
}

impl Sender {
    async fn run(self, mut receiver: mpsc::Receiver<Notification>) {
        while let Some(notification) = receiver.recv().await {
            self.deliver(&notification).await;
        }
    }

    async fn deliver(&self, notification: &Notification) {
        let body = match serde_json::to_vec(notification) {
            Ok(body) => Bytes::from(body),
            Err(err) => {
                self.outcomes.failed.inc();
                tracing::error!(error = %err, "cannot write a notification");
                return;
            }
        };
        let mut wait = self.backoff;
        for attempt in 0..=self.retries {
            if attempt > 0 {
                self.outcomes.retried.inc();
                tokio::time::sleep(wait).await;
                wait = wait.saturating_mul(2);
            }
            let tried = tokio::time::timeout(self.timeout, self.post(body.clone()))
                .await
                .unwrap_or_else(|_| Tried::Again(format!("no answer within {:?}", self.timeout)));
            match tried {
                Tried::Sent => {
                    self.outcomes.sent.inc();
                    return;
                }
                Tried::Refused(status) => {
                    self.outcomes.failed.inc();
                    tracing::warn!(route = %notification.route, limit = %notification.limit, identity = %notification.identity, threshold = notification.threshold, %status, "the webhook refused a notification; dropped");
                    return;
                }
                Tried::Again(why) => {
                    tracing::debug!(attempt, error = %why, "webhook try failed");
                    if attempt == self.retries {
                        self.outcomes.failed.inc();
                        tracing::warn!(route = %notification.route, limit = %notification.limit, identity = %notification.identity, threshold = notification.threshold, tries = attempt + 1, error = %why, "could not deliver a notification; dropped");
                    }
                }
            }
        }
    }

    /// One POST on a connection of its own (notifications are rare: no pool to keep).
    async fn post(&self, body: Bytes) -> Tried {
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let signed = signature(&self.key, unix, &body);
        let tcp = match TcpStream::connect(self.url.connect.as_str()).await {
            Ok(tcp) => tcp,
            Err(err) => return Tried::Again(format!("cannot connect: {err}")),
        };
        let request = Request::post(self.url.path.as_str())
            .header(HOST, self.url.authority.as_str())
            .header(CONTENT_TYPE, "application/json")
            .header(USER_AGENT, concat!("sluice/", env!("CARGO_PKG_VERSION")))
            .header(CONNECTION, "close")
            .header(SIGNATURE_HEADER, signed)
            .body(Full::new(body));
        let request = match request {
            Ok(request) => request,
            Err(err) => return Tried::Again(err.to_string()),
        };
        match &self.tls {
            None => exchange(TokioIo::new(tcp), request).await,
            Some((connector, name)) => match connector.connect(name.clone(), tcp).await {
                Ok(tls) => exchange(TokioIo::new(tls), request).await,
                Err(err) => Tried::Again(format!("TLS with {}: {err}", self.url.host)),
            },
        }
    }
}

/// One request and its answer's status on the connection `io`, driven beside it as the JWK
/// fetch does (nothing outlives the caller's timeout).
async fn exchange<T>(io: T, request: Request<Full<Bytes>>) -> Tried
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = match hyper::client::conn::http1::handshake(io).await {
        Ok(pair) => pair,
        Err(err) => return Tried::Again(err.to_string()),
    };
    // Driven beside the request, as the JWK fetch does: nothing outlives the timeout.
    let mut connection = pin!(connection);
    let mut connection_done = false;
    let mut sent = pin!(sender.send_request(request));
    let response = loop {
        tokio::select! {
            response = &mut sent => break response,
            ended = &mut connection, if !connection_done => {
                connection_done = true;
                if let Err(err) = ended {
                    return Tried::Again(err.to_string());
                }
            }
        }
    };
    match response {
        Ok(response) if response.status().is_success() => Tried::Sent,
        Ok(response) if response.status().is_server_error() => {
            Tried::Again(format!("answered {}", response.status()))
        }
        Ok(response) => Tried::Refused(response.status()),
        Err(err) => Tried::Again(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_the_time_and_the_body() {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"s3cret");
        let header = signature(&key, 1_700_000_000, b"{}");
        let expected = ring::hmac::sign(&key, b"1700000000.{}");
        let hex: String = expected
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(header, format!("t=1700000000,v1={hex}"));
        assert_ne!(header, signature(&key, 1_700_000_001, b"{}"));
    }
}
