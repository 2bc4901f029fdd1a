//! Graceful shutdown: on SIGTERM sluice stops accepting connections at once, lets the requests
//! in flight finish, and exits with success.

use crate::support;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use support::{Policy, Route, Sluice, Upstream};

/// How long the upstream takes to answer the request in flight: long enough that every check
/// of the drain happens while it is still running, even on a slow machine.
const SLOW_MS: u64 = 4000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_new_connections_while_requests_in_flight_finish() {
    let up = Upstream::start().await;
    let policy = Policy::new()
        .upstream("api", up.url())
        .route(Route::new("default", "/").upstream("api"));
    let mut sluice = Sluice::start(&policy).await;
    let slow = tokio::spawn({
        let url = format!("{}/slow/{SLOW_MS}", sluice.url());
        let client = support::client();
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

    // The listening socket is closed as soon as the signal is handled: connecting is refused
    // by the kernel rather than left waiting in the accept queue.
    loop {
        match tokio::net::TcpStream::connect(sluice.addr()).await {
            Err(err) if err.kind() == ErrorKind::ConnectionRefused => break,
            // A connection that reached the backlog just before the listener closed is reset
            // by the kernel; tokio reports that as the connect's error. The next one is refused.
            Err(err) if err.kind() == ErrorKind::ConnectionReset => {
                assert!(
                    signalled.elapsed() < Duration::from_secs(2),
                    "still reset after 2 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(err) => panic!("connecting during the drain failed oddly: {err}"),
            Ok(_) => {
                let since = signalled.elapsed();
                assert!(
                    since < Duration::from_secs(2),
                    "sluice still accepts TCP connections {since:?} after SIGTERM"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    // A new request, on a new client with no pooled connection, is refused too.
    let refused = support::client()
        .get(format!("{}/after", sluice.url()))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    match refused {
        Err(err) => assert!(
            err.is_connect(),
            "a new request during the drain must fail to connect, not {err:?}"
        ),
        Ok(r) => panic!("a new request during the drain got {}", r.status()),
    }
    // All of that happened during the drain.
    assert!(
        !slow.is_finished(),
        "the request in flight ended before the refusals were checked"
    );
    assert!(
        sluice.wait_exit(Duration::ZERO).await.is_none(),
        "sluice exited before the request in flight finished"
    );

    let response = slow
        .await
        .expect("request task")
        .expect("the request in flight gets its response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.expect("slow body"), "slow");
    let status = sluice
        .wait_exit(Duration::from_secs(8))
        .await
        .expect("sluice exits after draining");
    assert!(status.success(), "exit status {status}");
    let took = signalled.elapsed();
    assert!(
        took >= Duration::from_millis(SLOW_MS - 1000),
        "sluice exited after {took:?}, before the request in flight could finish"
    );
    assert_eq!(
        up.hits(),
        1,
        "nothing but the request in flight reached the upstream"
    );
}
