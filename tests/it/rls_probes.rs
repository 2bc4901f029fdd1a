//! The rate limit service's listener as Envoy Gateway's ratelimit Deployment uses it: mutual
//! TLS (`rls.tls.client_ca`; a client without a certificate, or with one from another CA,
//! fails its handshake; a rotated CA bundle verifies new handshakes without a restart), and
//! the probes (`grpc.health.v1.Health` on the gRPC port, `GET /healthcheck` on the admin
//! listener) while serving, while draining, and with the store down on a fail-closed config.
//! The client is Python's grpcio (not sluice's code); the health call is the raw
//! `grpc.health.v1` message, so no extra Python package is needed.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::certs::{Ca, Leaf};
use support::{client, free_port, Redis, Sluice};

/// args: target, then `rls` (one ShouldRateLimit call) or `health` (one Health/Check of the
/// whole server). TLS when `RLS_CA` is set, with a client certificate when `RLS_CERT` and
/// `RLS_KEY` are. Prints the overall code or the serving status; exits non-zero on an error.
const CLIENT: &str = r#"
import os, sys, grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
read = lambda name: open(os.environ[name], "rb").read() if name in os.environ else None
if "RLS_CA" in os.environ:
    creds = grpc.ssl_channel_credentials(read("RLS_CA"), read("RLS_KEY"), read("RLS_CERT"))
    channel = grpc.secure_channel(sys.argv[1], creds)
else:
    channel = grpc.insecure_channel(sys.argv[1])
if sys.argv[2] == "rls":
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    request = rls_pb2.RateLimitRequest(domain="api")
    request.descriptors.add().entries.add(key="user", value="u")
    answer = stub.ShouldRateLimit(request, timeout=5)
    print(rls_pb2.RateLimitResponse.Code.Name(answer.overall_code))
else:
    # HealthCheckRequest{service: ""} is empty; the answer's field 1 is the status.
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
    answer = check(b"", timeout=5)
    print({b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(answer, repr(answer)))
"#;

const RULES: &str =
    "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

/// Runs [`CLIENT`] against `target`; its output, or its error.
fn call(target: &str, mode: &str, env: &[(&str, &Path)]) -> Result<String, String> {
    let out = Command::new(support::envoy::tool("python3"))
        .args(["-c", CLIENT, target, mode])
        .envs(env.iter().map(|(name, path)| (*name, path.as_os_str())))
        .output()
        .expect("run python");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).expect("write");
    path
}

/// A client certificate's files.
fn client_files(dir: &Path, name: &str, leaf: &Leaf) -> (PathBuf, PathBuf) {
    (
        write(dir, &format!("{name}.crt"), &leaf.cert),
        write(dir, &format!("{name}.key"), &leaf.key),
    )
}

#[tokio::test]
async fn mutual_tls_admits_only_certificates_of_the_client_ca_and_follows_its_rotation() {
    let dir = tempfile::tempdir().expect("dir");
    let d = dir.path();
    let (server_ca, clients_ca, other_ca) = (
        Ca::new("server CA"),
        Ca::new("Envoy Gateway clients"),
        Ca::new("someone else"),
    );
    let server_ca_file = write(d, "server-ca.pem", &server_ca.pem());
    let leaf = server_ca.server("sluice rls");
    let (cert, key) = (
        write(d, "rls.crt", &leaf.cert),
        write(d, "rls.key", &leaf.key),
    );
    let client_ca = write(d, "client-ca.pem", &clients_ca.pem());
    let (good_cert, good_key) = client_files(d, "good", &clients_ca.client("envoy"));
    let (other_cert, other_key) = client_files(d, "other", &other_ca.client("envoy"));
    let rules = write(d, "ratelimit.yaml", RULES);
    let port = free_port();
    let _sluice = Sluice::start(&format!(
        "rls:\n  listen: 127.0.0.1:{port}\n  config: [{}]\n  tls: {{ cert: {}, key: {}, client_ca: {} }}\nroutes: []\n",
        rules.display(),
        cert.display(),
        key.display(),
        client_ca.display()
    ))
    .await;
    let target = format!("localhost:{port}");
    let with = |cert: &Path, key: &Path| {
        call(
            &target,
            "rls",
            &[
                ("RLS_CA", &server_ca_file),
                ("RLS_CERT", cert),
                ("RLS_KEY", key),
            ],
        )
    };
    assert_eq!(with(&good_cert, &good_key).as_deref(), Ok("OK"));
    let without = call(&target, "rls", &[("RLS_CA", &server_ca_file)]);
    assert!(without.is_err(), "no client certificate: {without:?}");
    let other = with(&other_cert, &other_key);
    assert!(other.is_err(), "a certificate of another CA: {other:?}");

    // The CA bundle rotated to the other CA: its clients get in, the old CA's no longer.
    support::replace_file(&client_ca, &other_ca.pem());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while with(&other_cert, &other_key).is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rotated client CA was not taken up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let old = with(&good_cert, &good_key);
    assert!(old.is_err(), "a certificate of the rotated-out CA: {old:?}");

    // A bundle that is not PEM is refused; the one in force keeps verifying.
    support::replace_file(&client_ca, "not a certificate\n");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(with(&other_cert, &other_key).as_deref(), Ok("OK"));
    assert!(with(&good_cert, &good_key).is_err());
}

/// `GET /healthcheck` on the admin listener: its status and body.
async fn healthcheck(sluice: &Sluice) -> (u16, String) {
    let response = client()
        .get(format!("{}/healthcheck", sluice.admin_url()))
        .send()
        .await
        .expect("admin answers");
    let status = response.status().as_u16();
    (status, response.text().await.expect("body"))
}

#[tokio::test]
async fn the_probes_say_serving_until_the_drain_and_not_serving_during_it() {
    let dir = tempfile::tempdir().expect("dir");
    let rules = write(dir.path(), "ratelimit.yaml", RULES);
    let port = free_port();
    let mut sluice = Sluice::start(&format!(
        "server:\n  shutdown_delay: 4s\nrls:\n  listen: 127.0.0.1:{port}\n  config: [{}]\nroutes: []\n",
        rules.display()
    ))
    .await;
    let target = format!("127.0.0.1:{port}");
    assert_eq!(healthcheck(&sluice).await, (200, "OK".to_owned()));
    assert_eq!(call(&target, "health", &[]).as_deref(), Ok("SERVING"));

    sluice.terminate();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (status, body) = healthcheck(&sluice).await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("shutting down"), "{body}");
    assert_eq!(call(&target, "health", &[]).as_deref(), Ok("NOT_SERVING"));
    // Still answering rate limit calls while the load balancers take it out.
    assert_eq!(call(&target, "rls", &[]).as_deref(), Ok("OK"));
    assert!(sluice.wait_exit(Duration::from_secs(20)).await.is_some());
}

#[tokio::test]
async fn a_store_down_fails_the_probes_only_when_answers_fail_closed() {
    let dir = tempfile::tempdir().expect("dir");
    let rules = write(dir.path(), "ratelimit.yaml", RULES);
    let mut redis = Redis::start().await;
    let store = support::redis_store_yaml(&redis.url());
    let start = |on_store_error: &str| {
        let port = free_port();
        let yaml = format!(
            "{store}rls:\n  listen: 127.0.0.1:{port}\n  config: [{}]\n  on_store_error: {on_store_error}\nroutes: []\n",
            rules.display()
        );
        async move { (Sluice::start(&yaml).await, format!("127.0.0.1:{port}")) }
    };
    let (deny, deny_target) = start("deny").await;
    let (allow, allow_target) = start("allow").await;
    deny.expect_store_faults();
    allow.expect_store_faults();
    assert_eq!(healthcheck(&deny).await.0, 200);
    assert_eq!(call(&deny_target, "health", &[]).as_deref(), Ok("SERVING"));

    redis.stop();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while call(&deny_target, "health", &[]).as_deref() != Ok("NOT_SERVING") {
        assert!(tokio::time::Instant::now() < deadline, "still SERVING");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, body) = healthcheck(&deny).await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("store"), "{body}");
    // `allow` answers without the store: still serving.
    assert_eq!(healthcheck(&allow).await, (200, "OK".to_owned()));
    assert_eq!(call(&allow_target, "health", &[]).as_deref(), Ok("SERVING"));

    redis.restart().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while healthcheck(&deny).await.0 != 200 {
        assert!(tokio::time::Instant::now() < deadline, "not serving again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
