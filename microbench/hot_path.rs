//! Micro-benchmarks of the per-request work that does not touch the network: routing among
//! 100 routes, path normalization, building a limit's store key, verifying a JWT with each
//! algorithm (the identify phase's cost per request on a route with `jwt:`), and the
//! in-process store's decision: for a known identity, and for a new identity in a full store
//! (the eviction path).
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
    Policy::compile_without_jwt(&config, Path::new("bench.yaml"), &UpstreamTlsSet::default())
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
    let now = sluice::request::Now::read().calendar;
    c.bench_function("plan of two limits", |b| {
        b.iter(|| {
            sluice::request::checks::from_head(
                &policy,
                black_box(route),
                black_box(&head),
                peer,
                None,
                now,
            )
            .limits
            .len()
        })
    });
}

/// The in-process store's decision of one sliding-log limit: an identity it already tracks
/// (the common case), and a new identity each time in a store at its `max_keys` (each one
/// evicts another).
fn local_store(c: &mut Criterion) {
    use futures_util::FutureExt;
    use sluice::limiter::{Algorithm, Check, Spec, Store};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let _entered = runtime.enter();
    let metrics = Metrics::new().expect("metrics");
    let max_keys = 10_000;
    let store = Store::local(max_keys, &metrics);
    let mut check = Check {
        key: String::from("sluice:api:per-key:{k-0}"),
        spec: Spec {
            algorithm: Algorithm::SlidingLog,
            requests: u32::MAX,
            window: std::time::Duration::from_millis(1),
            cost: 1,
            ..Spec::default()
        },
    };
    let mut group = c.benchmark_group("local store decide");
    group.bench_function("known identity", |b| {
        b.iter(|| {
            store
                .decide(std::slice::from_ref(black_box(&check)))
                .now_or_never()
                .map(|d| d.map(|d| d.admitted))
        })
    });
    check.spec.window = std::time::Duration::from_secs(3600);
    let mut n = 0u64;
    group.bench_function("new identity, full store", |b| {
        b.iter(|| {
            n += 1;
            check.key.clear();
            let _ = std::fmt::Write::write_fmt(
                &mut check.key,
                format_args!("sluice:api:per-key:{{k-{n}}}"),
            );
            store
                .decide(std::slice::from_ref(black_box(&check)))
                .now_or_never()
                .map(|d| d.map(|d| d.admitted))
        })
    });
    group.finish();
    assert!(
        n as usize > max_keys,
        "the full-store case filled the store: {n} identities"
    );
}

/// A signer of bench tokens and the verifier of its public half.
fn jwt_pair(algorithm: sluice::jwt::JwtAlgorithm) -> (sluice::jwt::Verifier, String) {
    use ring::rand::SystemRandom;
    use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
    use rustls::pki_types::pem::PemObject;
    use sluice::jwt::{JwtAlgorithm, Key, Material};

    let rng = SystemRandom::new();
    let b64 = |bytes: &[u8]| {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n =
                chunk.iter().fold(0u32, |n, &b| (n << 8) | u32::from(b)) << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            }
        }
        out
    };
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        + 3600;
    let header = format!(r#"{{"alg":"{}","typ":"JWT"}}"#, algorithm.name());
    let claims = format!(
        r#"{{"iss":"https://auth.example/","aud":"api","sub":"user-1234","plan":"paid","exp":{exp}}}"#
    );
    let signed = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
    let (material, sig) = match algorithm {
        JwtAlgorithm::RS256 => {
            let pem = include_bytes!("../tests/it/support/jwt/rsa-1.key.pem");
            let der = rustls::pki_types::PrivatePkcs8KeyDer::from_pem_slice(pem).expect("PKCS#8");
            let key = RsaKeyPair::from_pkcs8(der.secret_pkcs8_der()).expect("RSA");
            let mut sig = vec![0; key.public().modulus_len()];
            key.sign(
                &signature::RSA_PKCS1_SHA256,
                &rng,
                signed.as_bytes(),
                &mut sig,
            )
            .expect("sign");
            let parts: signature::RsaPublicKeyComponents<Vec<u8>> = key.public().into();
            (
                Material::RsaParts {
                    n: parts.n,
                    e: parts.e,
                },
                sig,
            )
        }
        JwtAlgorithm::ES256 => {
            let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
            let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("generate");
            let key = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("EC");
            let sig = key.sign(&rng, signed.as_bytes()).expect("sign");
            (
                Material::Public(key.public_key().as_ref().to_vec()),
                sig.as_ref().to_vec(),
            )
        }
        JwtAlgorithm::EdDSA => {
            let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).expect("generate");
            let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("Ed25519");
            let sig = key.sign(signed.as_bytes()).as_ref().to_vec();
            (Material::Public(key.public_key().as_ref().to_vec()), sig)
        }
        JwtAlgorithm::HS256 => {
            let secret = [7u8; 32];
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
            let sig = ring::hmac::sign(&key, signed.as_bytes()).as_ref().to_vec();
            (Material::Hmac(key), sig)
        }
    };
    let verifier = sluice::jwt::Verifier::new(
        "auth".parse().expect("a name"),
        "https://auth.example/".to_owned(),
        vec!["api".to_owned()],
        sluice::jwt::KeySource::Fixed(std::sync::Arc::new(sluice::jwt::KeySet {
            keys: vec![Key {
                kid: None,
                algorithm,
                material,
            }],
            generation: 0,
        })),
        sluice::config::TokenFrom::default(),
        std::time::Duration::from_secs(30),
        sluice::jwt::DEFAULT_TOKEN_CACHE,
    );
    (verifier, format!("{signed}.{}", b64(&sig)))
}

fn jwt(c: &mut Criterion) {
    use sluice::jwt::JwtAlgorithm;
    let mut group = c.benchmark_group("verify a JWT");
    for algorithm in [
        JwtAlgorithm::RS256,
        JwtAlgorithm::ES256,
        JwtAlgorithm::EdDSA,
        JwtAlgorithm::HS256,
    ] {
        let (verifier, token) = jwt_pair(algorithm);
        let now = std::time::SystemTime::now();
        let keys = verifier.key_set().expect("fixed keys");
        verifier
            .verify_with(&keys, &token, now)
            .expect("a valid token");
        group.bench_function(algorithm.name(), |b| {
            b.iter(|| verifier.verify_with(black_box(&keys), black_box(&token), now))
        });
        // The same token again, as a client sends it on each request: a hash and a lookup.
        verifier.verify(&token, now).expect("a valid token");
        group.bench_function(format!("{} cached", algorithm.name()), |b| {
            b.iter(|| verifier.verify(black_box(&token), now))
        });
    }
    group.finish();
}

criterion_group!(benches, routing, normalization, keys, jwt, local_store);
criterion_main!(benches);
