//! Micro-benchmarks of the per-request work that does not touch the network: routing among
//! 100 routes, path normalization, and building a limit's store key.
//!
//! `cargo bench --bench hot_path`. The target from the performance issue: a route match
//! under 1 µs with 100 routes.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, HeaderValue, Method};

use sluice::metrics::Metrics;
use sluice::policy::Policy;
use sluice::tls::UpstreamTlsSet;

/// 100 routes, `/svc00/...` to `/svc98/...` with two limits each, then a catch-all.
fn policy() -> Policy {
    let mut yaml = String::from("listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:9090\nroutes:\n");
    for n in 0..99 {
        yaml.push_str(&format!(
            "  - name: svc{n:02}\n    match: {{ path_prefix: /svc{n:02}/api, methods: [GET, POST] }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: per-key, key: [\"header:x-api-key\"], requests: 100, window: 1m }}\n      - {{ name: per-ip, key: [client_ip], requests: 1000, window: 1m }}\n"
        ));
    }
    yaml.push_str(
        "  - name: default\n    match: { path_prefix: / }\n    respond: { status: 404 }\n",
    );
    let config = sluice::config::parse(&yaml, Path::new("bench.yaml")).expect("a valid policy");
    let metrics = Metrics::new().expect("metrics");
    Policy::compile(&config, Path::new("bench.yaml"), &UpstreamTlsSet::default())
        .expect("a valid policy")
        .metered(&metrics)
}

fn routing(c: &mut Criterion) {
    let policy = policy();
    let mut group = c.benchmark_group("route among 100");
    for (name, path) in [
        ("first", "/svc00/api/users/42"),
        ("middle", "/svc50/api/users/42"),
        ("last limited", "/svc98/api/users/42"),
        ("catch-all", "/other/page"),
        ("upper case", "/SVC98/API/users/42"),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                policy
                    .route(black_box(&Method::GET), black_box(path))
                    .is_some()
            })
        });
    }
    group.finish();
}

fn normalization(c: &mut Criterion) {
    let mut group = c.benchmark_group("normalize path");
    for (name, path) in [
        ("canonical", "/svc50/api/users/42/orders"),
        ("encoded", "//svc50/%61pi/users/%34%32/orders"),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| sluice::path::normalize(black_box(path)).map(|p| p.len()))
        });
    }
    group.finish();
}

fn keys(c: &mut Criterion) {
    let policy = policy();
    let route = policy.route(&Method::GET, "/svc50/api/x").expect("a route");
    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", HeaderValue::from_static("k-0123456789abcdef"));
    headers.insert("user-agent", HeaderValue::from_static("bench/1.0"));
    let mut request = http::Request::get("/svc50/api/x")
        .body(())
        .expect("a request");
    *request.headers_mut() = headers;
    let (head, ()) = request.into_parts();
    let peer = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9));
    c.bench_function("plan of two limits", |b| {
        b.iter(|| {
            sluice::plan::plan(&policy, black_box(route), black_box(&head), peer)
                .checks
                .len()
        })
    });
}

criterion_group!(benches, routing, normalization, keys);
criterion_main!(benches);
