//! A verifier's keys fetched from where its identity provider publishes them (`jwks_url`).
//!
//! One background task per URL and settings (on worker 0's runtime) does every fetch; a
//! request only reads the keys at hand (an `ArcSwapOption`, no lock) and, when its token
//! names a kid that is not among them, wakes the task (`Notify`, no wait): that request gets
//! the same 401 as with file keys, and a later one finds the new key once the refetch is in.
//! The task fetches at once at start, then after the lifetime the server's `Cache-Control:
//! max-age` (or `Expires`) gives, held within `min_refresh`..`max_refresh`; an unknown kid
//! brings the next fetch forward, but never closer than `min_refresh` to the previous one.
//! A fetch that fails (connection, TLS, a status other than 200, over [`MAX_JWKS_BYTES`],
//! over `fetch_timeout`, not a JWK set, no usable key, a repeated kid) changes nothing: the last
//! good set keeps serving, and the failure is logged and counted. Keys of the set sluice
//! cannot verify with (an encryption key, another type or curve) are left out, not refused:
//! the set is the provider's, published for every kind of client. Until a first fetch has
//! succeeded the verifier has no keys and its routes answer 503 (see `request::identify`).
//!
//! A reload that keeps a verifier's URL and settings keeps its fetcher (and so its keys):
//! fetchers are shared through a registry keyed by the SHA-256 of the settings. The task
//! ends once no policy version holds its fetcher any more.

use std::collections::HashMap;
use std::path::Path;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{
    HeaderValue, ACCEPT, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, DATE, EXPIRES, HOST, USER_AGENT,
};
use http::{HeaderMap, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec};
use rustls::pki_types::ServerName;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_rustls::TlsConnector;

use super::keyset::{parse_jwk_set, Unusable};
use super::KeySet;
use crate::config::{ConfigError, JwtConfig, Position, Spanned};

/// Largest JWK set body read; a larger one is refused (`too_large`) as soon as it is known
/// (from `Content-Length`, or while reading). Providers publish a few keys, a few KiB.
pub const MAX_JWKS_BYTES: usize = 1024 * 1024;
pub const DEFAULT_MIN_REFRESH: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_REFRESH: Duration = Duration::from_secs(600);
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// First retry after a failed fetch while there are no keys yet, doubled up to
/// `min_refresh`: a verifier whose routes answer 503 should not wait long for its keys.
const FIRST_RETRY: Duration = Duration::from_secs(1);
/// How often the task wakes to update the age gauge and notice it is no longer needed.
const TICK: Duration = Duration::from_secs(1);

/// The outcomes of `sluice_jwks_fetches_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A usable set (new or unchanged) is in force.
    Ok,
    /// The server answered with a status other than 200.
    Status,
    /// The body was larger than [`MAX_JWKS_BYTES`].
    TooLarge,
    /// The fetch took longer than `fetch_timeout`.
    Timeout,
    /// Not a usable JWK set (not JSON, a key sluice cannot use, a repeated kid, no key).
    BadSet,
    /// The connection or the TLS handshake failed, or the answer broke off.
    Network,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::Status,
        Outcome::TooLarge,
        Outcome::Timeout,
        Outcome::BadSet,
        Outcome::Network,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Status => "status",
            Outcome::TooLarge => "too_large",
            Outcome::Timeout => "timeout",
            Outcome::BadSet => "bad_set",
            Outcome::Network => "network",
        }
    }
}

/// Why a fetch gave no usable set.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error("the server answered {0}")]
    Status(StatusCode),
    #[error("the JWK set is larger than {MAX_JWKS_BYTES} bytes")]
    TooLarge,
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    #[error("not a usable JWK set: {0}")]
    BadSet(String),
    #[error("{0}")]
    Network(String),
}

impl FetchError {
    fn outcome(&self) -> Outcome {
        match self {
            FetchError::Status(_) => Outcome::Status,
            FetchError::TooLarge => Outcome::TooLarge,
            FetchError::Timeout(_) => Outcome::Timeout,
            FetchError::BadSet(_) => Outcome::BadSet,
            FetchError::Network(_) => Outcome::Network,
        }
    }
}

fn network(err: impl std::fmt::Display) -> FetchError {
    FetchError::Network(err.to_string())
}

/// The metric handles a fetcher counts into: `sluice_jwks_fetches_total{verifier, outcome}`
/// and `sluice_jwks_keys_age_seconds{verifier}`.
#[derive(Clone)]
pub struct JwksMetrics {
    pub fetches: IntCounterVec,
    pub age: GaugeVec,
}

/// The keys of one `jwks_url` verifier and how to fetch them.
pub struct Jwks {
    verifier: String,
    url: String,
    host: String,
    port: u16,
    path: Uri,
    host_field: HeaderValue,
    server_name: ServerName<'static>,
    tls: TlsConnector,
    min_refresh: Duration,
    max_refresh: Duration,
    timeout: Duration,
    current: ArcSwapOption<KeySet>,
    /// Woken by a request whose token names an unknown kid.
    kick: Notify,
    started: AtomicBool,
}

impl std::fmt::Debug for Jwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jwks")
            .field("url", &self.url)
            .field("has_keys", &self.current.load().is_some())
            .finish_non_exhaustive()
    }
}

/// The fetchers alive, by the SHA-256 of their verifier's name and fetch settings.
fn registry() -> &'static Mutex<HashMap<[u8; 32], Weak<Jwks>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<[u8; 32], Weak<Jwks>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Where a `jwks_url` points: its host and port, the path asked for, the `Host` field and
/// the TLS server name.
struct Endpoint {
    host: String,
    port: u16,
    path: Uri,
    host_field: HeaderValue,
    server_name: ServerName<'static>,
}

impl Endpoint {
    /// `url`, checked: an https URL with a host and no user information.
    fn of(url: &Spanned<String>, file: &Path, field: &str) -> Result<Endpoint, ConfigError> {
        let bad_url = |message: String| {
            ConfigError::invalid(
                file,
                Position::from(url),
                format!("{field}.jwks_url"),
                message,
            )
        };
        let uri: Uri = url
            .value
            .parse()
            .map_err(|err| bad_url(format!("not a URL: {err}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad_url(
                "the keys are fetched over TLS only: the URL starts with https://".to_owned(),
            ));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| bad_url("the URL has no host".to_owned()))?
            .clone();
        if authority.as_str().contains('@') {
            return Err(bad_url("the URL carries user information".to_owned()));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(443);
        let server_name = ServerName::try_from(host.clone())
            .map_err(|err| bad_url(format!("not a TLS server name: {host}: {err}")))?;
        let host_field = HeaderValue::from_str(authority.as_str())
            .map_err(|err| bad_url(format!("not a host: {err}")))?;
        let path = uri
            .path_and_query()
            .cloned()
            .map_or_else(|| Uri::from_static("/"), Uri::from);
        Ok(Endpoint {
            host,
            port,
            path,
            host_field,
            server_name: server_name.to_owned(),
        })
    }
}

/// A verifier's `min_refresh`, `max_refresh` and `fetch_timeout`, defaulted and checked.
fn refresh_bounds(
    config: &JwtConfig,
    file: &Path,
    field: &str,
) -> Result<(Duration, Duration, Duration), ConfigError> {
    let duration =
        |value: Option<crate::config::ConfigDuration>, default| value.map_or(default, |d| d.0);
    let min_refresh = duration(config.min_refresh, DEFAULT_MIN_REFRESH);
    let max_refresh = duration(config.max_refresh, DEFAULT_MAX_REFRESH);
    let timeout = duration(config.fetch_timeout, DEFAULT_FETCH_TIMEOUT);
    let at = Position::from(&config.name);
    if min_refresh < Duration::from_secs(1) || min_refresh > max_refresh {
        return Err(ConfigError::invalid(
            file,
            at,
            format!("{field}.min_refresh"),
            format!(
                "min_refresh ({min_refresh:?}) is at least 1s and at most max_refresh \
                 ({max_refresh:?})"
            ),
        ));
    }
    if timeout.is_zero() {
        return Err(ConfigError::invalid(
            file,
            at,
            format!("{field}.fetch_timeout"),
            "fetch_timeout cannot be zero",
        ));
    }
    Ok((min_refresh, max_refresh, timeout))
}

impl Jwks {
    /// The fetcher of verifier `config` (its `jwks_url` is `url`), checked; the one already
    /// alive for the same name and settings if there is one. Fetches nothing.
    pub fn from_config(
        config: &JwtConfig,
        url: &Spanned<String>,
        file: &Path,
        field: &str,
    ) -> Result<Arc<Jwks>, ConfigError> {
        let Endpoint {
            host,
            port,
            path,
            host_field,
            server_name,
        } = Endpoint::of(url, file, field)?;
        let (min_refresh, max_refresh, timeout) = refresh_bounds(config, file, field)?;
        let (client, tls_fingerprint) = crate::tls::upstream::fetch_client(
            config.jwks_ca_file.as_ref(),
            file,
            &format!("{field}.jwks_ca_file"),
        )?;
        let mut id = Sha256::new();
        for part in [
            config.name.value.as_str().as_bytes(),
            url.value.as_bytes(),
            &tls_fingerprint,
        ] {
            id.update((part.len() as u64).to_be_bytes());
            id.update(part);
        }
        for bound in [min_refresh, max_refresh, timeout] {
            id.update(bound.as_nanos().to_be_bytes());
        }
        let id: [u8; 32] = id.finalize().into();
        let mut registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.retain(|_, jwks| jwks.strong_count() > 0);
        if let Some(alive) = registry.get(&id).and_then(Weak::upgrade) {
            return Ok(alive);
        }
        let jwks = Arc::new(Jwks {
            verifier: config.name.value.as_str().to_owned(),
            url: url.value.clone(),
            host,
            port,
            path,
            host_field,
            server_name,
            tls: TlsConnector::from(client),
            min_refresh,
            max_refresh,
            timeout,
            current: ArcSwapOption::empty(),
            kick: Notify::new(),
            started: AtomicBool::new(false),
        });
        registry.insert(id, Arc::downgrade(&jwks));
        Ok(jwks)
    }

    /// The keys at hand; `None` until a first fetch has succeeded.
    pub fn current(&self) -> Option<Arc<KeySet>> {
        self.current.load_full()
    }

    /// A token named a kid that is not among the keys at hand: the fetch task is woken (it
    /// decides whether `min_refresh` allows a refetch now). Never waits.
    pub fn unknown_kid(&self) {
        self.kick.notify_one();
    }

    /// Starts the fetch task on the current tokio runtime, once per fetcher.
    pub fn start(self: &Arc<Self>, metrics: &JwksMetrics) {
        if self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.started.store(false, Ordering::SeqCst);
            tracing::error!(verifier = %self.verifier, "no runtime to fetch the JWK set on");
            return;
        };
        let counters: Vec<IntCounter> = Outcome::ALL
            .iter()
            .map(|outcome| {
                metrics
                    .fetches
                    .with_label_values(&[self.verifier.as_str(), outcome.label()])
            })
            .collect();
        let age = metrics.age.with_label_values(&[self.verifier.as_str()]);
        runtime.spawn(run(Arc::downgrade(self), counters, age));
    }

    /// One fetch, bounded by `fetch_timeout`: the body and its lifetime from the headers.
    async fn fetch(&self) -> Result<(Bytes, Option<Duration>), FetchError> {
        tokio::time::timeout(self.timeout, self.fetch_unbounded())
            .await
            .map_err(|_| FetchError::Timeout(self.timeout))?
    }

    async fn fetch_unbounded(&self) -> Result<(Bytes, Option<Duration>), FetchError> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|err| network(format!("cannot connect: {err}")))?;
        let tls = self
            .tls
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|err| network(format!("TLS: {err}")))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(network)?;
        let request = Request::get(self.path.clone())
            .header(HOST, self.host_field.clone())
            .header(ACCEPT, "application/json, application/jwk-set+json")
            .header(USER_AGENT, concat!("sluice/", env!("CARGO_PKG_VERSION")))
            .header(CONNECTION, "close")
            .body(Empty::<Bytes>::new())
            .map_err(network)?;
        // The connection is driven here, beside the request and its body, rather than by a
        // task of its own: a stalled server then holds nothing once the timeout drops this.
        let mut connection = pin!(connection);
        let mut connection_done = false;
        let response = {
            let mut sent = pin!(sender.send_request(request));
            loop {
                tokio::select! {
                    response = &mut sent => break response.map_err(network)?,
                    ended = &mut connection, if !connection_done => {
                        connection_done = true;
                        ended.map_err(network)?;
                    }
                }
            }
        };
        let (head, mut body) = response.into_parts();
        if head.status != StatusCode::OK {
            return Err(FetchError::Status(head.status));
        }
        let declared = head
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > MAX_JWKS_BYTES as u64) {
            return Err(FetchError::TooLarge);
        }
        let mut bytes = Vec::new();
        loop {
            tokio::select! {
                frame = body.frame() => match frame {
                    None => break,
                    Some(Err(err)) => return Err(network(err)),
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            if bytes.len() + data.len() > MAX_JWKS_BYTES {
                                return Err(FetchError::TooLarge);
                            }
                            bytes.extend_from_slice(&data);
                        }
                    }
                },
                ended = &mut connection, if !connection_done => {
                    connection_done = true;
                    ended.map_err(network)?;
                }
            }
        }
        Ok((
            Bytes::from(bytes),
            lifetime(&head.headers, SystemTime::now()),
        ))
    }

    /// The next fetch's delay after a good one that said `lifetime`.
    fn refresh_after(&self, lifetime: Option<Duration>) -> Duration {
        lifetime
            .unwrap_or(self.max_refresh)
            .clamp(self.min_refresh, self.max_refresh)
    }
}

/// How long the answer with `headers` may be used from `now`: `Cache-Control: max-age`
/// (`no-cache`/`no-store`: zero), else `Expires` (against the server's `Date` when it sends
/// one, so the two clocks need not agree); `None` when neither says.
pub fn lifetime(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    if let Some(control) = text(CACHE_CONTROL) {
        for directive in control.split(',') {
            let directive = directive.trim().to_ascii_lowercase();
            if directive == "no-cache" || directive == "no-store" {
                return Some(Duration::ZERO);
            }
            if let Some(seconds) = directive.strip_prefix("max-age=") {
                if let Ok(seconds) = seconds.trim_matches('"').parse::<u64>() {
                    return Some(Duration::from_secs(seconds));
                }
            }
        }
    }
    let date = |value: &str| {
        jiff::fmt::rfc2822::parse(value)
            .ok()
            .map(|zoned| zoned.timestamp())
    };
    let expires = date(text(EXPIRES)?)?;
    let base = match text(DATE).and_then(date) {
        Some(served) => served,
        None => jiff::Timestamp::try_from(now).ok()?,
    };
    let seconds = expires.as_second() - base.as_second();
    Some(Duration::from_secs(u64::try_from(seconds).unwrap_or(0)))
}

/// The fetch task of one fetcher, until no policy holds it.
async fn run(jwks: Weak<Jwks>, counters: Vec<IntCounter>, age: Gauge) {
    let mut next = Instant::now();
    let mut last_attempt: Option<Instant> = None;
    let mut last_good: Option<Instant> = None;
    let mut last_hash: Option<[u8; 32]> = None;
    let mut generation = 0u64;
    let mut failures = 0u32;
    loop {
        let Some(jwks) = jwks.upgrade() else {
            return;
        };
        let now = Instant::now();
        if now >= next {
            last_attempt = Some(now);
            let fetched = jwks.fetch().await.and_then(|(body, lifetime)| {
                let hash: [u8; 32] = Sha256::digest(&body).into();
                if last_hash == Some(hash) {
                    return Ok((None, lifetime));
                }
                let (keys, skipped) =
                    parse_jwk_set(&body, Unusable::Skip).map_err(FetchError::BadSet)?;
                Ok((Some((keys, skipped, hash)), lifetime))
            });
            let outcome = match fetched {
                Ok((changed, lifetime)) => {
                    if let Some((keys, skipped, hash)) = changed {
                        generation += 1;
                        tracing::info!(
                            verifier = %jwks.verifier,
                            url = %jwks.url,
                            keys = keys.len(),
                            left_out = %skipped.join("; "),
                            generation,
                            "JWK set fetched"
                        );
                        jwks.current
                            .store(Some(Arc::new(KeySet { keys, generation })));
                        last_hash = Some(hash);
                    }
                    last_good = Some(Instant::now());
                    failures = 0;
                    next = Instant::now() + jwks.refresh_after(lifetime);
                    Outcome::Ok
                }
                Err(err) => {
                    failures = failures.saturating_add(1);
                    let retry = if jwks.current.load().is_some() {
                        jwks.min_refresh
                    } else {
                        FIRST_RETRY
                            .saturating_mul(1 << failures.min(16).saturating_sub(1))
                            .min(jwks.min_refresh)
                    };
                    tracing::warn!(
                        verifier = %jwks.verifier,
                        url = %jwks.url,
                        error = %err,
                        retry_in_ms = retry.as_millis() as u64,
                        keys = if jwks.current.load().is_some() { "the last good set keeps serving" } else { "none yet: the verifier's routes answer 503" },
                        "cannot fetch the JWK set"
                    );
                    next = Instant::now() + retry;
                    err.outcome()
                }
            };
            if let Some(counter) = Outcome::ALL
                .iter()
                .position(|o| *o == outcome)
                .and_then(|i| counters.get(i))
            {
                counter.inc();
            }
        }
        if let Some(good) = last_good {
            age.set(good.elapsed().as_secs_f64());
        }
        let wait = next.saturating_duration_since(Instant::now()).min(TICK);
        let kicked = {
            let notified = jwks.kick.notified();
            tokio::select! {
                () = notified => true,
                () = tokio::time::sleep(wait) => false,
            }
        };
        if kicked {
            // At most one fetch per min_refresh, whatever the tokens name.
            let allowed = last_attempt.map_or(Instant::now(), |at| at + jwks.min_refresh);
            if allowed < next {
                next = allowed.max(Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetime_reads_max_age_then_expires() {
        let mut headers = HeaderMap::new();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(lifetime(&headers, now), None);
        headers.insert(
            EXPIRES,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        headers.insert(
            DATE,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:18:00 GMT"),
        );
        assert_eq!(lifetime(&headers, now), Some(Duration::from_secs(600)));
        headers.remove(DATE);
        assert_eq!(lifetime(&headers, now), Some(Duration::ZERO), "in the past");
        headers.insert(
            CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=3600, must-revalidate"),
        );
        assert_eq!(lifetime(&headers, now), Some(Duration::from_secs(3600)));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        assert_eq!(lifetime(&headers, now), Some(Duration::ZERO));
    }
}
