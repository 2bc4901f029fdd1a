//! Bodies are streamed, not buffered: a 50 MB upload and a 50 MB download pass
//! through intact while sluice's peak resident memory stays far below 50 MB.

use crate::support;

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use support::{pattern_chunk, pattern_matches, Policy, Route, Sluice, Upstream, UpstreamSpec};

const SIZE: u64 = 50 * 1024 * 1024;
/// How much sluice's peak RSS may grow over a 50 MB transfer. Buffering the
/// body would add about 50 MB; streaming it adds a few buffers. The bound is
/// on growth, not on the absolute figure, which moves with the binary's size.
const MAX_GROWTH_KB: u64 = 12 * 1024;

fn config(up: &str) -> Policy {
    Policy::new()
        .upstream(
            "api",
            UpstreamSpec::new(up).connect_timeout("2s").timeout("60s"),
        )
        .route(Route::new("default", "/").upstream("api"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_50mb_is_streamed() {
    let _heavy = support::heavy().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url())).await;
    let before = sluice.peak_rss_kb();

    let chunk = pattern_chunk();
    let chunks = SIZE.div_ceil(chunk.len() as u64);
    let stream = futures_util::stream::iter(0..chunks).map(move |i| {
        let start = i * chunk.len() as u64;
        let len = std::cmp::min(chunk.len() as u64, SIZE - start) as usize;
        Ok::<Bytes, std::io::Error>(chunk.slice(..len))
    });
    let r = support::client()
        .post(format!("{}/upload", sluice.url()))
        .timeout(Duration::from_secs(120))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .expect("upload through sluice");
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers().get("x-pattern-ok").map(|v| v.to_str().unwrap()),
        Some("true"),
        "upload bytes arrived corrupted or out of order"
    );
    let count: u64 = r.text().await.unwrap().trim().parse().unwrap();
    assert_eq!(count, SIZE, "upstream received every byte");

    let peak = sluice.peak_rss_kb();
    println!("sluice peak RSS: {before} kB at start, {peak} kB after a 50 MB upload");
    assert!(
        peak.saturating_sub(before) < MAX_GROWTH_KB,
        "sluice peak RSS grew {} kB (from {before} to {peak}) >= {MAX_GROWTH_KB} kB: the upload was buffered",
        peak.saturating_sub(before)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_50mb_is_streamed() {
    let _heavy = support::heavy().await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(&up.url())).await;
    let before = sluice.peak_rss_kb();

    let r = support::client()
        .get(format!("{}/download/{SIZE}", sluice.url()))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("download through sluice");
    assert_eq!(r.status(), 200);
    let mut stream = r.bytes_stream();
    let mut received: u64 = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("download body chunk");
        assert!(
            pattern_matches(received, &chunk),
            "download corrupted in the {} bytes at offset {received}",
            chunk.len()
        );
        received += chunk.len() as u64;
    }
    assert_eq!(received, SIZE, "client received every byte");

    let peak = sluice.peak_rss_kb();
    println!("sluice peak RSS: {before} kB at start, {peak} kB after a 50 MB download");
    assert!(
        peak.saturating_sub(before) < MAX_GROWTH_KB,
        "sluice peak RSS grew {} kB (from {before} to {peak}) >= {MAX_GROWTH_KB} kB: the download was buffered",
        peak.saturating_sub(before)
    );
}
