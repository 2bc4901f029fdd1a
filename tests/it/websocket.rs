//! WebSocket upgrades through sluice: a real WebSocket client (tokio-tungstenite) connects
//! through the real sluice binary to a real WebSocket echo server (tokio-tungstenite).
//! Frames (text, binary, one of 1 MiB) echo both ways; the upgrade request is what the limit
//! counts (N per window pass, the next gets 429 and no upgrade); a close or a disconnect on
//! either side reaches the other; an upstream that refuses the upgrade is answered as a plain
//! response; a silent tunnel is closed after `server.idle_timeout`.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use support::websocket::{Client, EchoServer, Ended};
use support::{metric_sum, parse_metrics, Limit, Policy, Route, Sluice, UpstreamSpec};

/// Generous bound on each step.
const STEP: Duration = Duration::from_secs(10);

fn config(upstream: SocketAddr, requests: u32, idle_timeout: &str) -> Policy {
    config_with(upstream, requests, idle_timeout, 10_000)
}

fn config_with(
    upstream: SocketAddr,
    requests: u32,
    idle_timeout: &str,
    max_connections: u32,
) -> Policy {
    Policy::new()
        .server("idle_timeout", idle_timeout)
        .server("max_connections", max_connections)
        .server("shutdown_grace", "3s")
        .upstream(
            "echo",
            UpstreamSpec::new(&format!("http://{upstream}")).timeout("10s"),
        )
        .route(
            Route::new("ws", "/ws")
                .upstream("echo")
                .limit(Limit::requests("upgrades", requests, "1m")),
        )
}

async fn connect(sluice: &Sluice, path: &str) -> Result<Client, WsError> {
    let url = format!("ws://127.0.0.1:{}{path}", sluice.addr().port());
    tokio::time::timeout(STEP, tokio_tungstenite::connect_async(url))
        .await
        .expect("handshake within the time bound")
        .map(|(ws, response)| {
            assert_eq!(response.status(), 101);
            ws
        })
}

/// The next message the client receives, within [`STEP`].
async fn receive(ws: &mut Client) -> Option<Result<Message, WsError>> {
    tokio::time::timeout(STEP, ws.next())
        .await
        .expect("a message within the time bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_echo_both_ways_and_a_close_reaches_the_upstream() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 10, "60s")).await;
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");

    let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    let messages = [
        Message::text("hello"),
        Message::binary(vec![0u8, 1, 2, 255]),
        Message::binary(big),
        Message::text("ünïcødé"),
    ];
    for message in &messages {
        ws.send(message.clone()).await.unwrap();
        let echoed = receive(&mut ws).await.expect("an echo").unwrap();
        assert!(echoed == *message, "echo differs ({} bytes)", echoed.len());
    }

    // The upstream got the upgrade fields sluice would otherwise remove.
    let upgrades = upstream.upgrades();
    assert_eq!(upgrades.len(), 1);
    assert_eq!(upgrades[0].0, "/ws/chat");
    assert!(
        upgrades[0].1.eq_ignore_ascii_case("websocket"),
        "{upgrades:?}"
    );
    assert!(
        upgrades[0].2.to_ascii_lowercase().contains("upgrade"),
        "{upgrades:?}"
    );

    ws.close(None).await.unwrap();
    // The upstream's answering Close comes back, then the end.
    loop {
        match receive(&mut ws).await {
            Some(Ok(Message::Close(_))) => {}
            Some(Ok(other)) => panic!("unexpected {other:?}"),
            Some(Err(_)) | None => break,
        }
    }
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::CloseFrame]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_request_is_what_is_limited() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 3, "60s")).await;
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(connect(&sluice, "/ws/chat").await.expect("upgrade"));
    }
    // Messages on open tunnels are not requests: they cost nothing.
    for ws in &mut open {
        for _ in 0..5 {
            ws.send(Message::text("again")).await.unwrap();
            assert_eq!(receive(ws).await.unwrap().unwrap(), Message::text("again"));
        }
    }
    match connect(&sluice, "/ws/chat").await {
        Err(WsError::Http(response)) => {
            assert_eq!(response.status(), 429);
            assert!(response.headers().contains_key("retry-after"));
            assert!(response.headers().get("upgrade").is_none());
        }
        Err(other) => panic!("expected a 429, got {other:?}"),
        Ok(_) => panic!("the fourth upgrade must be refused"),
    }
    assert_eq!(
        upstream.upgrades().len(),
        3,
        "the refused one never reached it"
    );

    let metrics = parse_metrics(
        &support::client()
            .get(format!("{}/metrics", sluice.admin_url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    let requests = |outcome: &str| {
        metric_sum(
            &metrics,
            "sluice_requests_total",
            &[("route", "ws"), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("forwarded"), 3.0);
    assert_eq!(requests("limited"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_from_the_upstream_reaches_the_client() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 10, "60s")).await;
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");
    ws.send(Message::text("close-me")).await.unwrap();
    match receive(&mut ws).await {
        Some(Ok(Message::Close(Some(frame)))) => {
            assert_eq!(frame.code, CloseCode::Away);
            assert_eq!(frame.reason.as_str(), "asked to");
        }
        other => panic!("expected the upstream's Close frame, got {other:?}"),
    }
    // tungstenite answered the Close; the stream then ends.
    if let Some(Ok(other)) = receive(&mut ws).await {
        panic!("unexpected {other:?} after the Close");
    }
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::ClosedByServer]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_is_seen_by_the_upstream() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 10, "60s")).await;
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");
    ws.send(Message::text("hi")).await.unwrap();
    assert_eq!(
        receive(&mut ws).await.unwrap().unwrap(),
        Message::text("hi")
    );
    // No Close frame: the TCP connection just goes.
    drop(ws);
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::Disconnected]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upgrade_is_passed_back_as_a_plain_response() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 10, "60s")).await;
    match connect(&sluice, "/ws/refused").await {
        Err(WsError::Http(response)) => {
            assert_eq!(response.status(), 403);
            // tungstenite hands over the raw bytes after the head (here chunked by sluice).
            let body = response.body().as_deref().unwrap_or_default();
            let body = String::from_utf8_lossy(body);
            assert!(body.contains("no upgrade here"), "{body:?}");
        }
        Err(other) => panic!("expected the upstream's 403, got {other:?}"),
        Ok(_) => panic!("the upstream refused this upgrade"),
    }
    assert!(upstream.upgrades().is_empty());
    // The refusal was a response like any other: the next upgrade goes through.
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");
    ws.send(Message::text("after")).await.unwrap();
    assert_eq!(
        receive(&mut ws).await.unwrap().unwrap(),
        Message::text("after")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tunnel_is_closed_after_the_idle_timeout() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config(upstream.addr, 10, "1s")).await;
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");
    // Traffic every 300 ms for 2.4 s keeps a tunnel with a 1 s idle timeout open.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        ws.send(Message::text("tick")).await.unwrap();
        assert_eq!(
            receive(&mut ws).await.unwrap().unwrap(),
            Message::text("tick")
        );
    }
    assert!(upstream.ended().is_empty(), "closed while in use");
    // Then silence: both sides are closed.
    let silent = Instant::now();
    match receive(&mut ws).await {
        Some(Err(_)) | None => {}
        Some(Ok(other)) => panic!("unexpected {other:?}"),
    }
    assert!(
        silent.elapsed() >= Duration::from_millis(900),
        "closed after {:?}, before the idle timeout",
        silent.elapsed()
    );
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::Disconnected]);
}

async fn open_connections(sluice: &Sluice) -> f64 {
    let text = support::client()
        .get(format!("{}/metrics", sluice.admin_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metric_sum(
        &parse_metrics(&text),
        "sluice_open_connections",
        &[("listener", "gateway")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_keeps_its_connection_slot_until_it_closes() {
    let upstream = EchoServer::start().await;
    let sluice = Sluice::start(&config_with(upstream.addr, 10, "60s", 2)).await;
    let mut first = connect(&sluice, "/ws/chat").await.expect("upgrade");
    let mut second = connect(&sluice, "/ws/chat").await.expect("upgrade");
    for ws in [&mut first, &mut second] {
        ws.send(Message::text("up")).await.unwrap();
        assert_eq!(receive(ws).await.unwrap().unwrap(), Message::text("up"));
    }
    assert_eq!(open_connections(&sluice).await, 2.0);
    // Both slots are held by tunnels: a third connection waits in the backlog.
    let url = format!("ws://127.0.0.1:{}/ws/chat", sluice.addr().port());
    let mut third = tokio::spawn(tokio_tungstenite::connect_async(url));
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut third)
            .await
            .is_err(),
        "a third connection was served past max_connections = 2"
    );
    drop(first);
    let (mut third, _) = tokio::time::timeout(STEP, third)
        .await
        .expect("the third connection is served once a tunnel closes")
        .unwrap()
        .expect("upgrade");
    third.send(Message::text("in")).await.unwrap();
    assert_eq!(
        receive(&mut third).await.unwrap().unwrap(),
        Message::text("in")
    );
    drop(second);
    drop(third);
    let deadline = Instant::now() + STEP;
    while open_connections(&sluice).await != 0.0 {
        assert!(
            Instant::now() < deadline,
            "closed tunnels still counted open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_shutdown_an_open_websocket_gets_the_grace_period_then_is_cut() {
    let upstream = EchoServer::start().await;
    let mut sluice = Sluice::start(&config(upstream.addr, 10, "60s")).await;
    let mut ws = connect(&sluice, "/ws/chat").await.expect("upgrade");
    sluice.terminate();
    // Well within the grace period (3 s), and long after a sluice with nothing to wait for
    // has exited, the WebSocket still works.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ws.send(Message::text("still here")).await.unwrap();
    assert_eq!(
        receive(&mut ws).await.unwrap().unwrap(),
        Message::text("still here")
    );
    let status = sluice
        .wait_exit(STEP)
        .await
        .expect("sluice exits once the grace period is over, an open WebSocket or not");
    assert!(status.success(), "{status}");
    match receive(&mut ws).await {
        Some(Err(_)) | None => {}
        Some(Ok(other)) => panic!("unexpected {other:?}"),
    }
    assert_eq!(upstream.wait_ended(1).await, vec![Ended::Disconnected]);
}
