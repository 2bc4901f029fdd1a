//! Structured logs and request ids: JSON lines when asked, one line per rejected request that
//! names the identity only by a hash, and an `x-request-id` kept or made, passed to the
//! upstream and returned to the client.

mod support;

use support::{Sluice, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_request_ids_and_rejections_without_identities() {
    let upstream = Upstream::start().await;
    let yaml = format!(
        r#"log_format: json
upstreams:
  api: {{ url: "{}" }}
routes:
  - name: api
    match: {{ path_prefix: / }}
    upstream: api
    limits:
      - {{ name: per-key, key: ["header:x-api-key"], requests: 1, window: 1m }}
"#,
        upstream.url()
    );
    let sluice = Sluice::start(&yaml).await;
    let client = support::client();
    const SECRET: &str = "sk-live-very-secret-0001";
    let send = |id: Option<&str>| {
        let mut request = client
            .get(format!("{}/x", sluice.url()))
            .header("x-api-key", SECRET);
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send()
    };

    // A client-given id is kept: the upstream gets it, and the client gets it back.
    let first = send(Some("req-0001")).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(support::header(&first, "x-request-id"), "req-0001");
    let echoed: serde_json::Value = first.json().await.unwrap();
    assert_eq!(echoed["headers"]["x-request-id"][0], "req-0001");

    // Without one, sluice makes one; a rejection carries it too.
    let rejected = send(None).await.unwrap();
    assert_eq!(rejected.status(), 429);
    let made = support::header(&rejected, "x-request-id").to_owned();
    assert_eq!(made.len(), 32, "{made}");
    assert!(made.bytes().all(|b| b.is_ascii_hexdigit()));

    // The log: JSON lines, one of them for the rejection, naming route, limit, the
    // identity's hash, the wait and the request id, and never the API key.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let line = loop {
        let log = sluice.log();
        if let Some(line) = log.lines().find(|l| l.contains("sluice::rejected")) {
            break line.to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no rejection line:\n{log}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let event: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    let fields = &event["fields"];
    assert_eq!(fields["route"], "api", "{line}");
    assert_eq!(fields["limit"], "per-key", "{line}");
    assert_eq!(fields["retry_after"], 60, "{line}");
    assert_eq!(fields["request_id"], made.as_str(), "{line}");
    let identity = fields["identity"].as_str().expect("an identity hash");
    assert_eq!(identity.len(), 16);
    let log = sluice.log();
    assert!(!log.contains(SECRET), "the API key reached the log");
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "not a JSON line: {line}"
        );
    }
}
