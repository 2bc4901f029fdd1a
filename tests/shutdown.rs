//! Graceful shutdown: on SIGTERM sluice stops accepting connections, lets the requests in
//! flight finish, and exits with success.

mod support;

use std::time::{Duration, Instant};

use support::{Sluice, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_finish() {
    let up = Upstream::start().await;
    let yaml = format!(
        r#"upstreams:
  api: {{ url: "{}" }}
routes:
  - name: default
    match: {{ path_prefix: / }}
    upstream: api
"#,
        up.url()
    );
    let mut sluice = Sluice::start(&yaml).await;
    let client = support::client();
    let slow = tokio::spawn({
        let url = format!("{}/slow/1500", sluice.url());
        let client = client.clone();
        async move { client.get(url).send().await }
    });
    // Let the slow request reach the upstream before the signal.
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.hits() == 0 {
        assert!(Instant::now() < deadline, "the slow request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let signalled = Instant::now();
    sluice.terminate();

    let response = slow
        .await
        .expect("request task")
        .expect("the request in flight gets its response");
    assert_eq!(response.status(), 200);
    let status = sluice
        .wait_exit(Duration::from_secs(8))
        .await
        .expect("sluice exits after draining");
    assert!(status.success(), "exit status {status}");
    let took = signalled.elapsed();
    assert!(
        took >= Duration::from_millis(1000),
        "sluice exited after {took:?}, before the request in flight could finish"
    );

    let refused = support::client()
        .get(format!("{}/after", sluice.url()))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    assert!(refused.is_err(), "no new connections after shutdown");
}
