//! Envoy's rate limit service through a real Envoy: Envoy's `ratelimit` filter asks sluice
//! (`rls:`) over gRPC, and the test upstream records what Envoy let through. The rule files
//! are envoyproxy/ratelimit's, and the cases are its README's: N pass with Envoy's
//! `x-ratelimit-*` headers and N+1 gets Envoy's 429; shadow mode, `replaces`, wildcards,
//! `unlimited` and the month unit; two sluices behind two Envoys on one Redis stay exact under
//! concurrency. A Python gRPC client built from Envoy's published protos (not sluice's code)
//! calls the service directly for what Envoy's filter does not send (check-only calls with
//! `hits_addend: 0`, a descriptor's own `limit`).

use crate::support;

use std::path::Path;

use support::envoy::{python, Envoy};
use support::policy::{Node, Policy};
use support::{client, free_port, header, Redis, Sluice, Upstream};

/// A sluice whose rate limit service listens on a free port with the envoyproxy/ratelimit
/// file `rules` (written to `dir`), on `policy`'s store, with `extra` fields of `rls:`.
async fn sluice_rls(
    dir: &Path,
    rules: &str,
    policy: Policy,
    extra: Vec<(&str, Node)>,
) -> (Sluice, u16) {
    let file = dir.join("ratelimit.yaml");
    std::fs::write(&file, rules).expect("write rules");
    let port = free_port();
    let policy = policy.set("rls", rls_section(port, &file, extra));
    (Sluice::start(&policy).await, port)
}

/// The `rls:` section: the service on `port`, serving the rule file `file`, and `extra`.
fn rls_section(port: u16, file: &Path, extra: Vec<(&str, Node)>) -> Node {
    let mut fields = vec![
        ("listen", Node::from(format!("127.0.0.1:{port}"))),
        ("config", Node::from([file.display().to_string()])),
    ];
    fields.extend(extra);
    Node::map(fields)
}

/// `rate_limits` of Envoy's route: one descriptor from the `x-user` header, one from
/// `x-kind` + `x-user`, one from the remote address when `x-by-address` is sent.
const ACTIONS: &str = r#"                  - actions:
                    - request_headers: {header_name: x-user, descriptor_key: user}
                  - actions:
                    - request_headers: {header_name: x-kind, descriptor_key: kind}
                    - request_headers: {header_name: x-user, descriptor_key: user}
                  - actions:
                    - request_headers: {header_name: x-by-address, descriptor_key: by_address}
                    - remote_address: {}
"#;

async fn get(envoy: &Envoy, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = client().get(format!("{}/x", envoy.url()));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("envoy answers")
}

const USERS: &str = "
domain: users
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_user}
";

#[tokio::test]
async fn envoy_admits_n_with_its_headers_and_answers_429_to_the_next() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = Redis::start().await;
    let (sluice, rls) =
        sluice_rls(dir.path(), USERS, Policy::new().store_redis(&redis), vec![]).await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start("users", rls, upstream.addr().port(), ACTIONS).await;
    for expected in [2, 1, 0] {
        let resp = get(&envoy, &[("x-user", "alice")]).await;
        assert_eq!(resp.status(), 200, "request {} of 3", 3 - expected);
        assert_eq!(
            header(&resp, "x-ratelimit-limit"),
            "3, 3;w=60;name=\"per_user\""
        );
        assert_eq!(header(&resp, "x-ratelimit-remaining"), expected.to_string());
        let reset: u64 = header(&resp, "x-ratelimit-reset")
            .parse()
            .expect("reset seconds");
        assert!((1..=60).contains(&reset), "reset {reset}");
    }
    let over = get(&envoy, &[("x-user", "alice")]).await;
    assert_eq!(over.status(), 429);
    assert_eq!(header(&over, "x-envoy-ratelimited"), "true");
    assert_eq!(header(&over, "x-ratelimit-remaining"), "0");
    // Another user has a count of its own.
    assert_eq!(get(&envoy, &[("x-user", "bob")]).await.status(), 200);
    assert_eq!(upstream.hits(), 4, "the upstream saw alice's 3 and bob's 1");
    let metrics = sluice.metrics().await;
    assert!(
        metrics.contains(
            "ratelimit_service_rate_limit_over_limit{descriptor=\"user\",domain=\"users\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn two_sluices_behind_two_envoys_on_one_redis_stay_exact() {
    let _heavy = support::heavy().await;
    let dir = tempfile::tempdir().expect("dir");
    let redis = Redis::start().await;
    let rules = "domain: users\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 25}\n";
    let (sluice_a, rls_a) =
        sluice_rls(dir.path(), rules, Policy::new().store_redis(&redis), vec![]).await;
    let (sluice_b, rls_b) =
        sluice_rls(dir.path(), rules, Policy::new().store_redis(&redis), vec![]).await;
    let upstream = Upstream::start().await;
    let up = upstream.addr().port();
    let envoy_a = Envoy::start("users", rls_a, up, ACTIONS).await;
    let envoy_b = Envoy::start("users", rls_b, up, ACTIONS).await;
    let mut calls = Vec::new();
    for i in 0..80 {
        let url = if i % 2 == 0 {
            envoy_a.url()
        } else {
            envoy_b.url()
        };
        calls.push(tokio::spawn(async move {
            client()
                .get(format!("{url}/x"))
                .header("x-user", "carol")
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
    }
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.expect("task").expect("answer"));
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (25, 55), "statuses {statuses:?}");
    assert_eq!(upstream.hits(), 25, "the upstream saw exactly the limit");
    drop((sluice_a, sluice_b));
}

/// envoyproxy/ratelimit's README cases, one file.
const README: &str = r#"
domain: readme
descriptors:
  # Shadow mode: over the limit is counted and reported, but the answer is OK.
  - key: user
    value: shadowed
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  # Wildcard: every value starting with "team-" has its own count of 2.
  - key: user
    value: team-*
    rate_limit: {unit: minute, requests_per_unit: 2}
  # Unlimited: never limited, never counted.
  - key: user
    value: internal
    rate_limit: {unlimited: true}
  # A month: a calendar month here, not 30 days.
  - key: user
    value: monthly
    rate_limit: {unit: month, requests_per_unit: 2}
  # replaces: a kind+user rule named "vip" replaces the per-user rule "base".
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1, name: base}
  - key: kind
    value: vip
    descriptors:
      - key: user
        rate_limit:
          unit: minute
          requests_per_unit: 3
          replaces: [{name: base}]
"#;

#[tokio::test]
async fn the_readme_cases_through_envoy() {
    let dir = tempfile::tempdir().expect("dir");
    let (sluice, rls) = sluice_rls(dir.path(), README, Policy::new(), vec![]).await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start("readme", rls, upstream.addr().port(), ACTIONS).await;
    let statuses = |user: &'static str, kind: Option<&'static str>, n: usize| {
        let envoy = &envoy;
        async move {
            let mut out = Vec::new();
            for _ in 0..n {
                let mut headers = vec![("x-user", user)];
                if let Some(kind) = kind {
                    headers.push(("x-kind", kind));
                }
                out.push(get(envoy, &headers).await.status().as_u16());
            }
            out
        }
    };
    assert_eq!(
        statuses("shadowed", None, 3).await,
        [200, 200, 200],
        "shadow mode"
    );
    assert_eq!(
        statuses("team-a", None, 3).await,
        [200, 200, 429],
        "wildcard"
    );
    assert_eq!(
        statuses("team-b", None, 3).await,
        [200, 200, 429],
        "a wildcard counts each value"
    );
    assert_eq!(statuses("internal", None, 5).await, [200; 5], "unlimited");
    assert_eq!(statuses("monthly", None, 3).await, [200, 200, 429], "month");
    assert_eq!(
        statuses("dave", None, 2).await,
        [200, 429],
        "base: 1 per minute"
    );
    // With kind=vip, the rule "vip" replaces "base": 3, not 1.
    assert_eq!(
        statuses("erin", Some("vip"), 4).await,
        [200, 200, 200, 429],
        "replaces"
    );
    let metrics = sluice.metrics().await;
    assert!(
        metrics.contains("ratelimit_service_rate_limit_shadow_mode{descriptor=\"user_shadowed\",domain=\"readme\"} 2"),
        "{metrics}"
    );
    assert_eq!(upstream.hits(), 3 + 2 + 2 + 5 + 2 + 1 + 3);
}

/// The Python client: one ShouldRateLimit call per JSON argument
/// (`{"domain":..,"descriptors":[{"entries":[[k,v]],"hits_addend":n,"limit":[rpu,unit]}],
/// "hits_addend":n}`), printing per call `overall codes remaining reset_seconds name`.
const CLIENT: &str = r#"
import json, sys, grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
import os
ca = os.environ.get("RLS_CA")
channel = (grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials(open(ca, "rb").read()))
           if ca else grpc.insecure_channel(sys.argv[1]))
stub = rls_pb2_grpc.RateLimitServiceStub(channel)
for arg in sys.argv[2:]:
    call = json.loads(arg)
    request = rls_pb2.RateLimitRequest(domain=call["domain"], hits_addend=call.get("hits_addend", 0))
    for d in call["descriptors"]:
        descriptor = request.descriptors.add()
        for k, v in d["entries"]:
            descriptor.entries.add(key=k, value=v)
        if "hits_addend" in d:
            descriptor.hits_addend.value = d["hits_addend"]
        if "limit" in d:
            descriptor.limit.requests_per_unit = d["limit"][0]
            descriptor.limit.unit = d["limit"][1]
    answer = stub.ShouldRateLimit(request, timeout=5)
    codes = ",".join(rls_pb2.RateLimitResponse.Code.Name(s.code) for s in answer.statuses)
    remaining = ",".join(str(s.limit_remaining) for s in answer.statuses)
    reset = ",".join(str(s.duration_until_reset.seconds) for s in answer.statuses)
    names = ",".join(s.current_limit.name for s in answer.statuses)
    print(rls_pb2.RateLimitResponse.Code.Name(answer.overall_code), codes, remaining, reset, names or "-")
"#;

#[tokio::test]
async fn a_python_grpc_client_checks_without_counting_and_decides_all_or_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = Redis::start().await;
    let rules = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2, name: u}\n  - key: org\n    rate_limit: {unit: hour, requests_per_unit: 5, name: o}\n";
    let (_sluice, rls) =
        sluice_rls(dir.path(), rules, Policy::new().store_redis(&redis), vec![]).await;
    let target = format!("127.0.0.1:{rls}");
    let user = r#"{"domain":"api","descriptors":[{"entries":[["user","a"]]}]}"#;
    let check_only =
        r#"{"domain":"api","descriptors":[{"entries":[["user","a"]],"hits_addend":0}]}"#;
    let both = r#"{"domain":"api","descriptors":[{"entries":[["org","x"]]},{"entries":[["user","b"]],"hits_addend":3}]}"#;
    let org = r#"{"domain":"api","descriptors":[{"entries":[["org","x"]]}]}"#;
    let overridden = r#"{"domain":"api","descriptors":[{"entries":[["any","z"]],"limit":[1,3]}]}"#;
    let out = python(
        CLIENT,
        &[
            &target, check_only, user, check_only, user, check_only, user, both, org, overridden,
            overridden,
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 10, "{out}");
    // Checking does not count: two real hits still fit after the checks.
    assert!(
        lines[0].starts_with("OK OK 2 "),
        "a check before any hit: {out}"
    );
    assert!(lines[1].starts_with("OK OK 1 "), "{out}");
    assert!(lines[2].starts_with("OK OK 1 "), "{out}");
    assert!(lines[3].starts_with("OK OK 0 "), "{out}");
    assert!(
        lines[4].starts_with("OK OK 0 "),
        "a check at the limit is OK: {out}"
    );
    assert!(lines[5].starts_with("OVER_LIMIT OVER_LIMIT 0 "), "{out}");
    // All or nothing: user b's 3 hits exceed 2, so org x's hit is not recorded either.
    assert!(
        lines[6].starts_with("OVER_LIMIT OK,OVER_LIMIT 5,0 "),
        "{out}"
    );
    assert!(
        lines[7].starts_with("OK OK 4 "),
        "org x counted once only: {out}"
    );
    // A descriptor's own limit (1 per hour) applies without a rule.
    assert!(
        lines[8].starts_with("OK OK 0 ") && lines[8].ends_with(" -"),
        "{out}"
    );
    assert!(lines[9].starts_with("OVER_LIMIT OVER_LIMIT 0 "), "{out}");
}

/// A block list as envoyproxy/ratelimit's README writes one: a limit of 0 for one value under
/// a per-value limit for every other.
const BLOCK_LIST: &str = "
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: user
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0, name: blocked}
";

#[tokio::test]
async fn a_zero_limit_is_over_limit_through_envoy_without_the_store() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = Redis::start().await;
    let (sluice, rls) = sluice_rls(
        dir.path(),
        BLOCK_LIST,
        Policy::new().store_redis(&redis),
        vec![],
    )
    .await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start("edge", rls, upstream.addr().port(), ACTIONS).await;
    for _ in 0..3 {
        let resp = get(&envoy, &[("x-user", "50.0.0.5")]).await;
        assert_eq!(
            resp.status(),
            429,
            "the blocked value, from its first request"
        );
        assert_eq!(header(&resp, "x-envoy-ratelimited"), "true");
        assert_eq!(header(&resp, "x-ratelimit-remaining"), "0");
    }
    assert_eq!(upstream.hits(), 0, "nothing reached the upstream");
    assert_eq!(get(&envoy, &[("x-user", "50.0.0.1")]).await.status(), 200);
    let keys = redis.keys().await;
    assert!(
        keys.iter().all(|k| !k.contains("50.0.0.5")) && keys.iter().any(|k| k.contains("50.0.0.1")),
        "only the counted value has a key: {keys:?}"
    );
    let metrics = sluice.metrics().await;
    for stat in ["total_hits", "over_limit"] {
        let line = format!(
            "ratelimit_service_rate_limit_{stat}{{descriptor=\"user_50.0.0.5\",domain=\"edge\"}} 3"
        );
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    // The status fields, as envoyproxy/ratelimit answers them: the limit of 0 by name, none
    // remaining, the rest of the second.
    let call = r#"{"domain":"edge","descriptors":[{"entries":[["user","50.0.0.5"]]}]}"#;
    let out = python(CLIENT, &[&format!("127.0.0.1:{rls}"), call]);
    assert_eq!(out.trim(), "OVER_LIMIT OVER_LIMIT 0 1 blocked", "{out}");
}

#[tokio::test]
async fn a_shared_wildcard_counts_every_value_it_matches_once_through_envoy() {
    let dir = tempfile::tempdir().expect("dir");
    let redis = Redis::start().await;
    let rules = "
domain: edge
descriptors:
  - key: user
    value: shared-*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: user
    value: own-*
    rate_limit: {unit: minute, requests_per_unit: 2}
";
    let (_sluice, rls) =
        sluice_rls(dir.path(), rules, Policy::new().store_redis(&redis), vec![]).await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start("edge", rls, upstream.addr().port(), ACTIONS).await;
    let mut statuses = Vec::new();
    for user in [
        "shared-a", "shared-b", "shared-c", "own-a", "own-b", "own-c",
    ] {
        statuses.push(get(&envoy, &[("x-user", user)]).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 200, 200, 200]);
}

/// One call for `user=<user>` in domain `api` through the Python client: `overall remaining`.
fn call_user(rls: u16, user: &str) -> String {
    let call = format!(r#"{{"domain":"api","descriptors":[{{"entries":[["user","{user}"]]}}]}}"#);
    let out = python(CLIENT, &[&format!("127.0.0.1:{rls}"), &call]);
    let fields: Vec<&str> = out.split_whitespace().collect();
    format!("{} {}", fields[0], fields[2])
}

#[tokio::test]
async fn a_month_is_a_calendar_month() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("ratelimit.yaml");
    std::fs::write(&file, "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: month, requests_per_unit: 1}\n").expect("write");
    let port = free_port();
    let policy = Policy::new().set("rls", rls_section(port, &file, vec![]));
    // 3 s before February: a 30-day window (envoyproxy/ratelimit's month) would not end there.
    let started = std::time::Instant::now();
    let _sluice = Sluice::start_with_env(
        &policy,
        &[("SLUICE_TEST_CLOCK_START", "2026-01-31T23:59:57Z")],
    )
    .await;
    assert_eq!(call_user(port, "m"), "OK 0");
    assert_eq!(call_user(port, "m"), "OVER_LIMIT 0");
    let february = started + std::time::Duration::from_millis(3_500);
    tokio::time::sleep_until(february.into()).await;
    assert_eq!(call_user(port, "m"), "OK 0", "a new month, a new count");
}

#[tokio::test]
async fn rule_files_reload_with_the_policy_and_check_names_their_lines() {
    let dir = tempfile::tempdir().expect("dir");
    let rules = |n: u32| {
        format!("domain: api\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {n}}}\n")
    };
    let (sluice, rls) = sluice_rls(dir.path(), &rules(1), Policy::new(), vec![]).await;
    assert_eq!(call_user(rls, "r"), "OK 0");
    assert_eq!(call_user(rls, "r"), "OVER_LIMIT 0");
    support::replace_file(&dir.path().join("ratelimit.yaml"), &rules(3));
    support::wait_for(
        std::time::Duration::from_secs(10),
        "the rule file's reload",
        || async { call_user(rls, "r2") == "OK 2" },
    )
    .await;
    // A broken rule file is refused with its place; the rules in force stay.
    support::replace_file(&dir.path().join("ratelimit.yaml"), "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n");
    let (status, _, stderr) = support::sluice_check(sluice.config_path());
    assert!(!status.success());
    assert!(
        stderr.contains(
            "ratelimit.yaml:4:24: descriptors[0].rate_limit.unit: unknown unit `fortnight`"
        ),
        "{stderr}"
    );
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        call_user(rls, "r3"),
        "OK 2",
        "the last good rules still serve"
    );
    support::replace_file(&dir.path().join("ratelimit.yaml"), &rules(3));
    let out = support::run_sluice(
        &[
            "explain-rls",
            "--config",
            sluice.config_path().to_str().expect("utf-8"),
            "api",
            "user=alice",
            "other=x",
        ],
        std::time::Duration::from_secs(20),
    );
    assert!(out.status.success(), "{}", out.stderr);
    assert!(
        out.stdout.contains("rule user (")
            && out
                .stdout
                .contains("limit: 3 per minute, counted with sliding_log"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("store key: sluice:rls:api:{user=alice}:minute3"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("descriptor 1: other=x\n  no rule applies"),
        "{}",
        out.stdout
    );
}

#[tokio::test]
async fn a_failed_store_answers_as_on_store_error_says() {
    let dir = tempfile::tempdir().expect("dir");
    let mut redis = Redis::start().await;
    let rules = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let (sluice, rls) = sluice_rls(
        dir.path(),
        rules,
        Policy::new().store_redis(&redis),
        vec![("on_store_error", "deny".into())],
    )
    .await;
    sluice.expect_store_faults();
    assert_eq!(call_user(rls, "f"), "OK 4");
    redis.stop();
    assert_eq!(
        call_user(rls, "f"),
        "OVER_LIMIT 0",
        "deny: OVER_LIMIT without the store"
    );
    let metrics = sluice.metrics().await;
    assert!(
        metrics
            .contains("sluice_store_fallback_decisions_total{action=\"deny\",route=\"rls:api\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_service_speaks_tls_when_rls_tls_is_set() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = support::certs::Ca::new("rls test CA");
    let leaf = ca.server("sluice rls");
    let (cert, key, ca_file) = (
        dir.path().join("rls.crt"),
        dir.path().join("rls.key"),
        dir.path().join("ca.pem"),
    );
    std::fs::write(&cert, &leaf.cert).expect("cert");
    std::fs::write(&key, &leaf.key).expect("key");
    std::fs::write(&ca_file, ca.pem()).expect("ca");
    let tls = Node::map([
        ("cert", cert.display().to_string()),
        ("key", key.display().to_string()),
    ]);
    let rules = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let (_sluice, rls) = sluice_rls(dir.path(), rules, Policy::new(), vec![("tls", tls)]).await;
    let call = r#"{"domain":"api","descriptors":[{"entries":[["user","t"]]}]}"#;
    let out = support::envoy::python_with_env(
        CLIENT,
        &[&format!("localhost:{rls}"), call, call, call],
        &[("RLS_CA", ca_file.to_str().expect("utf-8"))],
    );
    let overall: Vec<&str> = out
        .lines()
        .map(|line| line.split(' ').next().unwrap_or(""))
        .collect();
    assert_eq!(overall, ["OK", "OK", "OVER_LIMIT"], "{out}");
    // A cleartext client gets no answer from the TLS listener.
    let cleartext = std::process::Command::new(support::envoy::tools_dir().join("bin/python3"))
        .args(["-c", CLIENT, &format!("127.0.0.1:{rls}"), call])
        .output()
        .expect("python");
    assert!(
        !cleartext.status.success(),
        "h2c on the TLS listener answered"
    );
}
