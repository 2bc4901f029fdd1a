//! Per-core serving (`server.workers`), against a real sluice: with two workers, the
//! connections are spread over both listeners and each worker serves its own; the
//! `max_connections` bound is one bound over all workers, not one per worker; and the
//! config refuses a worker count of 0 or a word other than `auto`, at its position.

use crate::support;

use std::time::{Duration, Instant};

use support::wire::{NoResponse, Wire};
use support::{metric_sum, parse_metrics, Policy, Route, Sluice, Upstream, UpstreamSpec};

/// Generous bound for one answer on a shared 2-core machine.
const WITHIN: Duration = Duration::from_secs(10);

/// `server` adds the test's `server:` settings.
fn config(up: &str, server: impl FnOnce(Policy) -> Policy) -> Policy {
    server(Policy::new())
        .upstream(
            "api",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("10s"),
        )
        .route(Route::new("default", "/").upstream("api"))
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes()
}

/// Connections accepted by `worker`, from `sluice_worker_connections_total`.
async fn accepted_by(sluice: &Sluice, worker: &str) -> f64 {
    let all = parse_metrics(&sluice.metrics().await);
    metric_sum(
        &all,
        "sluice_worker_connections_total",
        &[("worker", worker)],
    )
}

/// 40 connections, each with one request: the kernel spreads them over the two workers'
/// listeners by their source ports, so both serve some (all 40 on one would happen with
/// probability 2^-39 if they were spread at random, and always if only one listened).
#[tokio::test]
async fn with_two_workers_both_accept_and_serve_connections() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url(), |p| p.server("workers", 2))).await;
    for i in 0..40 {
        let mut wire = Wire::connect(sluice.addr()).await;
        wire.send(&get(&format!("/spread/{i}"))).await.unwrap();
        let response = wire.response(WITHIN).await;
        assert_eq!(response.status, 200, "{response:?}");
    }
    let (first, second) = (
        accepted_by(&sluice, "0").await,
        accepted_by(&sluice, "1").await,
    );
    println!("worker 0 accepted {first}, worker 1 accepted {second}");
    assert_eq!(first + second, 40.0);
    assert!(first > 0.0 && second > 0.0, "{first} and {second}");
    assert_eq!(accepted_by(&sluice, "2").await, 0.0, "only two workers");
    assert_eq!(up.hits(), 40);
}

/// `max_connections: 3` with two workers: three held connections (spread over both workers)
/// fill the bound, and new connections, whichever worker's listener they land on, are not
/// served until one of the three closes.
#[tokio::test]
async fn max_connections_bounds_all_workers_together() {
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url(), |p| {
        p.server("workers", 2).server("max_connections", 3)
    }))
    .await;
    let mut held = Vec::new();
    for i in 0..3 {
        let mut wire = Wire::connect(sluice.addr()).await;
        wire.send(&get(&format!("/held/{i}"))).await.unwrap();
        assert_eq!(wire.response(WITHIN).await.status, 200);
        held.push(wire);
    }
    // Several waiting connections, so that both workers' listeners get some.
    let mut waiting = Vec::new();
    for i in 0..6 {
        let mut wire = Wire::connect(sluice.addr()).await;
        wire.send(&get(&format!("/waiting/{i}"))).await.unwrap();
        waiting.push(wire);
    }
    for wire in &mut waiting {
        assert_eq!(
            wire.try_response(Duration::from_millis(300)).await.err(),
            Some(NoResponse::Timeout),
            "a connection past the bound of three is not served"
        );
    }
    let all = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(&all, "sluice_open_connections", &[("listener", "gateway")]),
        3.0
    );
    assert_eq!(up.hits(), 3);

    // Each closed connection frees one slot, for one waiting connection, wherever it waits.
    let released = Instant::now();
    drop(held);
    let mut served = 0;
    let deadline = Instant::now() + WITHIN;
    while served < waiting.len() && Instant::now() < deadline {
        for wire in waiting.iter_mut() {
            if let Ok(response) = wire.try_response(Duration::from_millis(20)).await {
                assert_eq!(response.status, 200);
                served += 1;
            }
        }
        // Served connections stay open and hold their slots: close them to free the next.
        if served >= 3 {
            break;
        }
    }
    assert_eq!(
        served, 3,
        "three slots freed, three waiting connections served"
    );
    println!(
        "three served {:?} after the slots freed",
        released.elapsed()
    );
}

#[test]
fn a_worker_count_of_zero_or_a_word_is_refused_at_its_position() {
    let dir = tempfile::tempdir().unwrap();
    for (value, message) in [
        ("0", "got 0"),
        ("many", "got \"many\""),
        ("2000", "got 2000"),
    ] {
        let path = dir.path().join("sluice.yaml");
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:3\nserver:\n  workers: {value}\n{}",
            "upstreams:\n  api:\n    url: http://127.0.0.1:2\nroutes:\n  - name: d\n    match:\n      path_prefix: /\n    upstream: api\n"
        );
        std::fs::write(&path, yaml).unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "workers: {value} accepted");
        assert!(stderr.contains("server.workers"), "{stderr}");
        assert!(stderr.contains(":4:"), "line 4 named: {stderr}");
        assert!(stderr.contains(message), "{stderr}");
    }
    for value in ["auto", "1", "4"] {
        let path = dir.path().join("ok.yaml");
        std::fs::write(
            &path,
            format!("listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:3\nserver:\n  workers: {value}\nupstreams:\n  api:\n    url: http://127.0.0.1:2\nroutes:\n  - name: d\n    match:\n      path_prefix: /\n    upstream: api\n"),
        )
        .unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "workers: {value}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
