//! TLS, end to end, with certificates made at test time (rcgen) and real TLS clients (reqwest
//! over rustls, and `curl`):
//! - the listener: HTTPS over HTTP/1.1 and over HTTP/2 chosen through ALPN, rate limits over
//!   TLS, a client that never finishes its handshake is closed by the header-read timeout;
//! - certificate rotation: new handshakes get the new certificate, a connection opened before
//!   keeps working, a bad new pair keeps the old one serving (and is counted);
//! - mutual TLS (`tls.client_ca`): a client certificate of that CA required;
//! - keys in PKCS#8, PKCS#1 (RSA) and SEC1 (EC) PEM;
//! - https upstreams: trusted through `ca_file` (with SNI from the upstream host), refused when
//!   untrusted (502), mTLS with `client_cert`/`client_key` against an upstream that requires a
//!   client certificate;
//! - `sluice check` on each TLS field: unreadable, unparsable, mismatched, misplaced.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

use support::certs::{Ca, Leaf};
use support::{
    metric_sum, parse_metrics, sluice_check, wait_for, Limit, Policy, Route, Sluice, Upstream,
    UpstreamSpec,
};

// ---------------------------------------------------------------------------
// Certificates
// ---------------------------------------------------------------------------

/// The DER of the first certificate in `pem`: what a client sees as the peer certificate.
fn der_of(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec()
}

/// A directory holding the files of one test.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        Files {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

// ---------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------

/// A reqwest client over rustls that trusts only `ca` and reaches `localhost` at `addr`.
fn https_client(ca: &str, addr: SocketAddr) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .resolve("localhost", addr)
        .tls_info(true)
        .no_proxy()
        .timeout(Duration::from_secs(30))
}

/// The DER of the certificate the server presented on the connection of `response`.
fn peer_cert(response: &reqwest::Response) -> Vec<u8> {
    response
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|info| info.peer_certificate())
        .expect("TLS info with the peer certificate")
        .to_vec()
}

fn curl_path() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("curl"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`curl` is not on PATH; the TLS tests use it as a real TLS client. Install it \
                 with `apt-get install -y curl` (scripts/test.sh does this)"
            )
        })
}

/// `curl` to `https://localhost:PORT{path}` trusting `ca`; `version` is `--http2` or
/// `--http1.1`. Returns (status, the HTTP version curl used, body).
async fn curl(ca: &Path, port: u16, path: &str, version: &str) -> (u16, String, String) {
    let (ca, version, path) = (ca.to_owned(), version.to_owned(), path.to_owned());
    tokio::task::spawn_blocking(move || {
        let out = Command::new(curl_path())
            .args([
                "--silent",
                "--show-error",
                "--max-time",
                "20",
                "--noproxy",
                "*",
            ])
            .arg("--cacert")
            .arg(&ca)
            .arg("--resolve")
            .arg(format!("localhost:{port}:127.0.0.1"))
            .arg(&version)
            .args(["--write-out", "\n%{http_code} %{http_version}"])
            .arg(format!("https://localhost:{port}{path}"))
            .output()
            .expect("run curl");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "curl failed ({}): {}{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let (body, last) = stdout.rsplit_once('\n').expect("curl's --write-out line");
        let (code, http_version) = last.split_once(' ').expect("code and version");
        (
            code.parse().unwrap(),
            http_version.to_owned(),
            body.to_owned(),
        )
    })
    .await
    .unwrap()
}

/// A TLS sluice in front of a cleartext upstream: `/limited` admits 3 requests a minute per
/// client address, everything else is unlimited; `server` is a policy holding the test's
/// `server:` settings, if any.
async fn tls_sluice(files: &Files, upstream: &Upstream, server: Policy) -> Sluice {
    let policy = server
        .tls(&files.path("cert.pem"), &files.path("key.pem"))
        .upstream("api", upstream.url())
        .route(
            Route::new("limited", "/limited")
                .upstream("api")
                .limit(Limit::requests("per-ip", 3, "1m")),
        )
        .route(Route::new("default", "/").upstream("api"));
    Sluice::start(&policy).await
}

// ---------------------------------------------------------------------------
// The listener
// ---------------------------------------------------------------------------

#[tokio::test]
async fn https_over_http1_and_http2_through_alpn_with_reqwest_and_curl() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let leaf = ca.server("sluice one");
    files.write("cert.pem", &leaf.cert);
    files.write("key.pem", &leaf.key);
    let ca_path = files.write("ca.pem", &ca.pem());
    let sluice = tls_sluice(&files, &upstream, Policy::new()).await;

    // reqwest offers h2 and http/1.1 through ALPN; sluice picks h2.
    let h2 = https_client(&ca.pem(), sluice.addr()).build().unwrap();
    let response = h2
        .get(format!(
            "https://localhost:{}/users/1",
            sluice.addr().port()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(peer_cert(&response), der_of(&leaf.cert));
    let echoed: serde_json::Value = response.json().await.unwrap();
    assert_eq!(echoed["path"], "/users/1");
    // The upstream is told the client came over TLS.
    assert_eq!(echoed["headers"]["x-forwarded-proto"][0], "https");

    let h1 = https_client(&ca.pem(), sluice.addr())
        .http1_only()
        .build()
        .unwrap();
    let response = h1
        .get(format!(
            "https://localhost:{}/users/2",
            sluice.addr().port()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), reqwest::Version::HTTP_11);

    let port = sluice.addr().port();
    let (status, version, body) = curl(&ca_path, port, "/users/3", "--http2").await;
    assert_eq!((status, version.as_str()), (200, "2"), "{body}");
    assert!(body.contains("/users/3"), "{body}");
    let (status, version, _) = curl(&ca_path, port, "/users/4", "--http1.1").await;
    assert_eq!((status, version.as_str()), (200, "1.1"));

    // A client that does not trust the CA gets no answer at all, and the upstream sees nothing.
    let untrusting = https_client(&Ca::new("other CA").pem(), sluice.addr())
        .build()
        .unwrap();
    let hits = upstream.hits();
    let refused = untrusting
        .get(format!("https://localhost:{port}/users/5"))
        .send()
        .await;
    assert!(
        refused.is_err(),
        "a client that trusts another CA connected"
    );
    assert_eq!(upstream.hits(), hits);
}

#[tokio::test]
async fn with_client_ca_the_listener_admits_only_clients_with_a_certificate_of_that_ca() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let leaf = ca.server("sluice one");
    let (clients, stranger) = (Ca::new("clients CA"), Ca::new("stranger CA"));
    let policy = Policy::new()
        .mtls(
            &files.write("cert.pem", &leaf.cert),
            &files.write("key.pem", &leaf.key),
            &files.write("clients.pem", &clients.pem()),
        )
        .upstream("api", upstream.url())
        .route(Route::new("default", "/").upstream("api"));
    let sluice = Sluice::start(&policy).await;
    let url = format!("https://localhost:{}/users/1", sluice.addr().port());
    let with = |identity: Option<&Leaf>| {
        let mut builder = https_client(&ca.pem(), sluice.addr());
        if let Some(leaf) = identity {
            let pem = format!("{}{}", leaf.cert, leaf.key);
            builder = builder.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
        }
        let client = builder.build().unwrap();
        let url = url.clone();
        async move { client.get(url).send().await.map(|r| r.status()) }
    };
    assert_eq!(
        with(Some(&clients.client("app"))).await.ok(),
        Some(StatusCode::OK)
    );
    let hits = upstream.hits();
    assert!(with(None).await.is_err(), "no client certificate");
    assert!(
        with(Some(&stranger.client("app"))).await.is_err(),
        "a certificate of another CA"
    );
    assert_eq!(upstream.hits(), hits);
}

#[tokio::test]
async fn rate_limits_hold_over_tls_on_http1_and_http2() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let leaf = ca.server("sluice");
    files.write("cert.pem", &leaf.cert);
    files.write("key.pem", &leaf.key);
    let sluice = tls_sluice(&files, &upstream, Policy::new()).await;
    let url = format!("https://localhost:{}/limited", sluice.addr().port());
    let h2 = https_client(&ca.pem(), sluice.addr()).build().unwrap();
    let h1 = https_client(&ca.pem(), sluice.addr())
        .http1_only()
        .build()
        .unwrap();
    let mut statuses = Vec::new();
    for i in 0..6 {
        let client = if i % 2 == 0 { &h2 } else { &h1 };
        let response = client.get(&url).send().await.unwrap();
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            assert!(response.headers().contains_key("retry-after"));
        }
        statuses.push(response.status().as_u16());
    }
    // One limit for the client address, whichever protocol it arrives over.
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_closed_by_the_header_read_timeout() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let leaf = ca.server("sluice");
    files.write("cert.pem", &leaf.cert);
    files.write("key.pem", &leaf.key);
    let sluice = tls_sluice(
        &files,
        &upstream,
        Policy::new()
            .server("header_read_timeout", "1s")
            .server("max_connections", 2),
    )
    .await;

    // One client sends nothing, the other the first bytes of a ClientHello and no more.
    let started = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(sluice.addr()).await.unwrap();
    let mut partial = tokio::net::TcpStream::connect(sluice.addr()).await.unwrap();
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    for stream in [&mut silent, &mut partial] {
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a stalled handshake was not closed in 10 s");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "closed before the header-read timeout: {:?}",
        started.elapsed()
    );
    let metrics = parse_metrics(&sluice.metrics().await);
    assert!(metric_sum(&metrics, "sluice_tls_handshake_errors_total", &[]) >= 2.0);

    // Both slots (max_connections: 2) are free again: a real client gets through.
    let client = https_client(&ca.pem(), sluice.addr()).build().unwrap();
    let response = client
        .get(format!("https://localhost:{}/", sluice.addr().port()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

#[tokio::test]
async fn a_rotated_certificate_serves_new_connections_and_open_ones_keep_working() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let first = ca.server("sluice first");
    let cert = files.write("cert.pem", &first.cert);
    let key = files.write("key.pem", &first.key);
    let sluice = tls_sluice(&files, &upstream, Policy::new()).await;
    let url = format!("https://localhost:{}/", sluice.addr().port());

    // An HTTP/2 connection opened before the rotation, and kept.
    let before = https_client(&ca.pem(), sluice.addr()).build().unwrap();
    let response = before.get(&url).send().await.unwrap();
    assert_eq!(peer_cert(&response), der_of(&first.cert));

    let second = ca.server("sluice second");
    support::replace_file(&key, &second.key);
    support::replace_file(&cert, &second.cert);
    wait_for(Duration::from_secs(10), "the new certificate", || async {
        let fresh = https_client(&ca.pem(), sluice.addr()).build().unwrap();
        match fresh.get(&url).send().await {
            Ok(response) => peer_cert(&response) == der_of(&second.cert),
            Err(_) => false,
        }
    })
    .await;

    // The old connection is still open and still answers.
    for _ in 0..3 {
        let response = before.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(peer_cert(&response), der_of(&first.cert));
    }
    let metrics = parse_metrics(&sluice.metrics().await);
    assert!(
        metric_sum(
            &metrics,
            "sluice_tls_cert_reloads_total",
            &[("result", "ok")]
        ) >= 1.0
    );
    assert!(sluice.log().contains("TLS certificate reloaded"));
}

#[tokio::test]
async fn a_bad_new_certificate_is_refused_and_the_old_one_keeps_serving() {
    let (ca, files, upstream) = (Ca::new("test CA"), Files::new(), Upstream::start().await);
    let good = ca.server("sluice good");
    let cert = files.write("cert.pem", &good.cert);
    let key = files.write("key.pem", &good.key);
    let sluice = tls_sluice(&files, &upstream, Policy::new()).await;
    let url = format!("https://localhost:{}/", sluice.addr().port());
    let errors = |text: &str| {
        metric_sum(
            &parse_metrics(text),
            "sluice_tls_cert_reloads_total",
            &[("result", "error")],
        )
    };
    assert_eq!(errors(&sluice.metrics().await), 0.0);

    // Not PEM at all, then a valid certificate whose key is another one's.
    let other = ca.server("sluice other");
    let bad_pairs = [
        ("not a certificate\n".to_owned(), good.key.clone()),
        (other.cert.clone(), good.key.clone()),
    ];
    for (round, (bad_cert, bad_key)) in bad_pairs.iter().enumerate() {
        support::replace_file(&key, bad_key);
        support::replace_file(&cert, bad_cert);
        let want = (round + 1) as f64;
        wait_for(
            Duration::from_secs(10),
            "the refusal to be counted",
            || async { errors(&sluice.metrics().await) >= want },
        )
        .await;
        let fresh = https_client(&ca.pem(), sluice.addr()).build().unwrap();
        let response = fresh.get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(peer_cert(&response), der_of(&good.cert), "round {round}");
    }
    assert!(sluice.log().contains("new TLS certificate refused"));

    // A good pair after the bad ones is taken.
    support::replace_file(&key, &other.key);
    wait_for(Duration::from_secs(10), "the good pair", || async {
        let fresh = https_client(&ca.pem(), sluice.addr()).build().unwrap();
        match fresh.get(&url).send().await {
            Ok(response) => peer_cert(&response) == der_of(&other.cert),
            Err(_) => false,
        }
    })
    .await;
    // Each version of the pair is tried once, however many times the files were looked at
    // meanwhile (four times a second): two refusals, one rotation.
    let text = sluice.metrics().await;
    let loaded = metric_sum(
        &parse_metrics(&text),
        "sluice_tls_cert_reloads_total",
        &[("result", "ok")],
    );
    assert_eq!((errors(&text), loaded), (2.0, 1.0), "{text}");
}

/// Runs `openssl` with `args`, panicking with how to install it when it is missing.
fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `openssl` ({e}); install it with `apt-get install -y openssl`")
        });
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[tokio::test]
async fn keys_in_pkcs1_rsa_and_sec1_ec_pem_serve() {
    let (ca, upstream) = (Ca::new("test CA"), Upstream::start().await);
    // openssl writes the key; rcgen certifies it; openssl rewrites it in the legacy formats.
    let work = Files::new();
    let rsa_pkcs8 = openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
    ]);
    let rsa_path = work.write("rsa-pkcs8.pem", &String::from_utf8(rsa_pkcs8).unwrap());
    let rsa_pkcs1 = openssl(&["rsa", "-traditional", "-in", rsa_path.to_str().unwrap()]);
    let ec_pkcs8 = ca.server("unused").key;
    let ec_path = work.write("ec-pkcs8.pem", &ec_pkcs8);
    let ec_sec1 = openssl(&["ec", "-in", ec_path.to_str().unwrap()]);
    let cases = [
        (
            "RSA PRIVATE KEY",
            std::fs::read_to_string(&rsa_path).unwrap(),
            rsa_pkcs1,
        ),
        ("EC PRIVATE KEY", ec_pkcs8, ec_sec1),
    ];
    for (label, pkcs8, legacy) in cases {
        let legacy = String::from_utf8(legacy).unwrap();
        assert!(legacy.contains(&format!("BEGIN {label}")), "{legacy}");
        let leaf = ca.server_with_key(label, rcgen::KeyPair::from_pem(&pkcs8).unwrap());
        let files = Files::new();
        files.write("cert.pem", &leaf.cert);
        files.write("key.pem", &legacy);
        let sluice = tls_sluice(&files, &upstream, Policy::new()).await;
        let client = https_client(&ca.pem(), sluice.addr()).build().unwrap();
        let response = client
            .get(format!("https://localhost:{}/", sluice.addr().port()))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{label}");
        assert_eq!(peer_cert(&response), der_of(&leaf.cert), "{label}");
    }
}

// ---------------------------------------------------------------------------
// https upstreams
// ---------------------------------------------------------------------------

/// An HTTPS upstream on 127.0.0.1: answers every request 200 with `secure client-cert=BOOL`,
/// and notes the SNI name of each handshake. With `client_ca`, it requires a client
/// certificate issued by that CA.
struct TlsUpstream {
    addr: SocketAddr,
    sni: Arc<Mutex<Vec<Option<String>>>>,
    task: JoinHandle<()>,
}

impl TlsUpstream {
    async fn start(leaf: &Leaf, client_ca: Option<&Ca>) -> TlsUpstream {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                roots.add(ca.issuer.der().clone()).unwrap();
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .unwrap();
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let chain = vec![CertificateDer::from_pem_slice(leaf.cert.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
        let config = builder.with_single_cert(chain, key).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sni = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sni);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, seen) = (acceptor.clone(), Arc::clone(&seen));
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(stream).await else {
                        return;
                    };
                    let session = stream.get_ref().1;
                    let client_cert = session.peer_certificates().is_some();
                    seen.lock()
                        .unwrap()
                        .push(session.server_name().map(str::to_owned));
                    let service = service_fn(move |_request| async move {
                        let body = format!("secure client-cert={client_cert}");
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                            body,
                        ))))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        TlsUpstream { addr, sni, task }
    }

    /// `https://localhost:PORT`, so that the upstream's SNI and verified name is `localhost`.
    fn url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Asserts a 502 problem+json answer and returns it.
async fn assert_bad_gateway(response: reqwest::Response) {
    assert_eq!(response.status(), 502);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("application/problem+json"),
        "{content_type}"
    );
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(problem["status"], 502, "{problem}");
}

#[tokio::test]
async fn https_upstreams_are_verified_against_ca_file_and_mtls_presents_the_client_cert() {
    let (server_ca, client_ca, stranger_ca) = (
        Ca::new("upstream CA"),
        Ca::new("client CA"),
        Ca::new("stranger CA"),
    );
    let files = Files::new();
    let ca_file = files.write("upstream-ca.pem", &server_ca.pem());
    let client = client_ca.client("sluice client");
    let client_cert = files.write("client.pem", &client.cert);
    let client_key = files.write("client-key.pem", &client.key);

    let plain_tls = TlsUpstream::start(&server_ca.server("upstream"), None).await;
    let mtls = TlsUpstream::start(&server_ca.server("mtls upstream"), Some(&client_ca)).await;
    let stranger = TlsUpstream::start(&stranger_ca.server("stranger"), None).await;
    let policy = Policy::new()
        .upstream(
            "trusted",
            UpstreamSpec::new(&plain_tls.url()).ca_file(&ca_file),
        )
        .upstream(
            "mtls-without-cert",
            UpstreamSpec::new(&mtls.url()).ca_file(&ca_file),
        )
        .upstream(
            "mtls",
            UpstreamSpec::new(&mtls.url())
                .ca_file(&ca_file)
                .client_cert(&client_cert, &client_key),
        )
        .upstream("untrusted", stranger.url())
        .route(Route::new("trusted", "/trusted").upstream("trusted"))
        .route(Route::new("anon", "/anon").upstream("mtls-without-cert"))
        .route(Route::new("mtls", "/mtls").upstream("mtls"))
        .route(Route::new("untrusted", "/untrusted").upstream("untrusted"));
    let sluice = Sluice::start(&policy).await;
    let http = support::client();

    let response = http
        .get(format!("{}/trusted/x", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "secure client-cert=false");
    assert_eq!(
        plain_tls.sni.lock().unwrap().as_slice(),
        [Some("localhost".to_owned())],
        "SNI is the upstream URL's host"
    );

    let response = http
        .get(format!("{}/mtls/x", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "secure client-cert=true");

    let response = http
        .get(format!("{}/anon/x", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_bad_gateway(response).await;

    let response = http
        .get(format!("{}/untrusted/x", sluice.url()))
        .send()
        .await
        .unwrap();
    assert_bad_gateway(response).await;
    assert!(
        stranger.sni.lock().unwrap().is_empty(),
        "the untrusted upstream completed a handshake"
    );

    let metrics = parse_metrics(&sluice.metrics().await);
    let errors = |upstream: &str, kind: &str| {
        metric_sum(
            &metrics,
            "sluice_upstream_errors_total",
            &[("upstream", upstream), ("kind", kind)],
        )
    };
    assert_eq!(errors("untrusted", "connect"), 1.0);
    assert_eq!(errors("trusted", "connect"), 0.0);
    assert_eq!(errors("mtls", "connect") + errors("mtls", "other"), 0.0);
    // Under TLS 1.3 the server refuses the missing client certificate after the client's side
    // of the handshake, with the first response: still a failed handshake, so `connect`.
    assert_eq!(errors("mtls-without-cert", "connect"), 1.0);
    assert_eq!(errors("mtls-without-cert", "other"), 0.0);
}

// ---------------------------------------------------------------------------
// sluice check
// ---------------------------------------------------------------------------

/// `sluice check` on `yaml` (in `files`' directory): the error line.
fn check_error(files: &Files, yaml: &str) -> String {
    let path = files.write("sluice.yaml", yaml);
    let (status, stdout, stderr) = sluice_check(&path);
    assert!(!status.success(), "accepted:\n{yaml}\n{stdout}");
    stderr
}

const HEAD: &str = "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\n";
const ROUTES: &str =
    "routes:\n  - name: all\n    match:\n      path_prefix: /\n    respond:\n      status: 200\n";

#[test]
fn check_accepts_a_tls_config_with_relative_paths() {
    let (ca, files) = (Ca::new("test CA"), Files::new());
    let leaf = ca.server("sluice");
    files.write("cert.pem", &leaf.cert);
    files.write("key.pem", &leaf.key);
    files.write("ca.pem", &ca.pem());
    let client = ca.client("client");
    files.write("client.pem", &client.cert);
    files.write("client-key.pem", &client.key);
    let yaml = format!(
        "{HEAD}tls:\n  cert: cert.pem\n  key: key.pem\nupstreams:\n  api:\n    url: https://localhost:8443\n    ca_file: ca.pem\n    client_cert: client.pem\n    client_key: client-key.pem\n{ROUTES}"
    );
    let path = files.write("sluice.yaml", &yaml);
    let (status, stdout, stderr) = sluice_check(&path);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(", tls)"), "{stdout}");
}

#[test]
fn the_example_config_checks_with_its_certificate_files_in_place() {
    let (ca, files) = (Ca::new("test CA"), Files::new());
    let leaf = ca.server("sluice");
    std::fs::create_dir(files.path("tls")).unwrap();
    files.write("tls/cert.pem", &leaf.cert);
    files.write("tls/key.pem", &leaf.key);
    let example =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/tls.yaml"))
            .unwrap();
    let path = files.write("tls.yaml", &example);
    let (status, stdout, stderr) = sluice_check(&path);
    assert!(status.success(), "{stdout}{stderr}");
    assert!(stdout.contains(", tls)"), "{stdout}");
}

#[test]
fn check_names_the_file_line_column_and_field_of_each_bad_tls_setting() {
    let (ca, files) = (Ca::new("test CA"), Files::new());
    let leaf = ca.server("sluice");
    let other = ca.server("other");
    files.write("cert.pem", &leaf.cert);
    files.write("key.pem", &leaf.key);
    files.write("other-key.pem", &other.key);
    files.write(
        "garbage.pem",
        "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
    );
    files.write("empty.pem", "nothing here\n");
    let config = files.path("sluice.yaml");
    let config = config.display();
    let listener =
        |cert: &str, key: &str| format!("{HEAD}tls:\n  cert: {cert}\n  key: {key}\n{ROUTES}");
    // (config, expected line:column: field, expected words)
    let cases = [
        (
            listener("missing.pem", "key.pem"),
            "4:9: tls.cert",
            "cannot read",
        ),
        (
            listener("cert.pem", "missing.pem"),
            "5:8: tls.key",
            "cannot read",
        ),
        (listener("garbage.pem", "key.pem"), "4:9: tls.cert", "not valid PEM"),
        (
            listener("empty.pem", "key.pem"),
            "4:9: tls.cert",
            "no PEM `CERTIFICATE` section",
        ),
        (
            listener("cert.pem", "empty.pem"),
            "5:8: tls.key",
            "no PEM private key",
        ),
        (
            listener("cert.pem", "other-key.pem"),
            "5:8: tls.key",
            "does not belong to the certificate",
        ),
        (
            format!("{HEAD}tls:\n  cert: cert.pem\n  key: key.pem\n  client_ca: empty.pem\n{ROUTES}"),
            "6:14: tls.client_ca",
            "no PEM `CERTIFICATE` section",
        ),
        (
            format!("{HEAD}tls:\n  cert: cert.pem\n  key: key.pem\n  client_ca: missing.pem\n{ROUTES}"),
            "6:14: tls.client_ca",
            "cannot read",
        ),
        (
            format!("{HEAD}upstreams:\n  api:\n    url: https://localhost\n    ca_file: empty.pem\n{ROUTES}"),
            "6:14: upstreams.api.ca_file",
            "no PEM `CERTIFICATE` section",
        ),
        (
            format!("{HEAD}upstreams:\n  api:\n    url: http://localhost\n    ca_file: cert.pem\n{ROUTES}"),
            "6:14: upstreams.api.ca_file",
            "only an https:// upstream",
        ),
        (
            format!("{HEAD}upstreams:\n  api:\n    url: https://localhost\n    client_cert: cert.pem\n{ROUTES}"),
            "6:18: upstreams.api.client_cert",
            "needs `client_key`",
        ),
        (
            format!("{HEAD}upstreams:\n  api:\n    url: https://localhost\n    client_cert: cert.pem\n    client_key: other-key.pem\n{ROUTES}"),
            "7:17: upstreams.api.client_key",
            "does not belong to the certificate",
        ),
    ];
    for (yaml, at, words) in cases {
        let stderr = check_error(&files, &yaml);
        assert!(
            stderr.contains(&format!("error: {config}:{at}: ")) && stderr.contains(words),
            "expected `{at}` and `{words}` for:\n{yaml}\ngot: {stderr}"
        );
    }
}
