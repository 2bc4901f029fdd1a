//! A client holding an IPv6 /64 is one client: `client_ip` key parts count IPv6 addresses by
//! their network (`ipv6_prefix`, /64 by default), IPv4 ones by `ipv4_prefix` (/32), and an
//! IPv4-mapped IPv6 address as the IPv4 client. Shown through the real sluice binary, on
//! Redis and in process, over HTTP/1.1 and HTTP/2, with client addresses forwarded by a
//! trusted proxy (the test's loopback connection) in `X-Forwarded-For`; and by `sluice
//! check` (a prefix out of range is refused at its position) and `sluice explain`.

use crate::support;

use std::time::Duration;

use support::{
    run_sluice, sluice_check, write_config, Limit, Policy, Route, Sluice, Store, StoreKind,
    Upstream,
};

/// `/a`: 2 requests a minute per client with the default prefixes; `/wide`: the same with
/// IPv6 grouped by /48 and IPv4 by /24.
fn config(store: &Store, upstream: &str) -> Policy {
    Policy::new()
        .store(store)
        .set("trusted_proxies", ["127.0.0.1"])
        .upstream("api", upstream)
        .route(
            Route::new("a", "/a")
                .upstream("api")
                .limit(Limit::requests("per-ip", 2, "1m")),
        )
        .route(
            Route::new("wide", "/wide").upstream("api").limit(
                Limit::requests("per-net", 2, "1m")
                    .set("ipv6_prefix", 48)
                    .set("ipv4_prefix", 24),
            ),
        )
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

fn client(proto: Proto) -> reqwest::Client {
    let builder = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30));
    match proto {
        Proto::H1 => builder.http1_only(),
        Proto::H2 => builder.http2_prior_knowledge(),
    }
    .build()
    .expect("client")
}

/// The statuses of GETs of `path`, one per forwarded client address, in order.
async fn statuses(
    client: &reqwest::Client,
    sluice: &Sluice,
    path: &str,
    from: &[&str],
) -> Vec<u16> {
    let mut out = Vec::new();
    for ip in from {
        let response = client
            .get(format!("{}{path}", sluice.url()))
            .header("x-forwarded-for", *ip)
            .send()
            .await
            .expect("a response");
        out.push(response.status().as_u16());
    }
    out
}

async fn addresses_group_by_prefix(kind: StoreKind) {
    let store = Store::start(kind).await;
    let upstream = Upstream::start().await;
    for proto in [Proto::H1, Proto::H2] {
        if let Some(redis) = &store.redis {
            redis.cmd(&["FLUSHALL"]).await;
        }
        let sluice = Sluice::start(&config(&store, &upstream.url())).await;
        let client = client(proto);
        // Three addresses of one /64 share its 2 requests; the next /64 has its own.
        let same_64 = [
            "2001:db8:1:2::1",
            "2001:db8:1:2:ffff:ffff:ffff:ffff",
            "2001:db8:1:2:abcd::9",
        ];
        assert_eq!(
            statuses(&client, &sluice, "/a", &same_64).await,
            [200, 200, 429],
            "{proto:?} {kind:?}: one /64 is one client"
        );
        assert_eq!(
            statuses(
                &client,
                &sluice,
                "/a",
                &["2001:db8:1:3::1", "2001:db8:1:3::2"]
            )
            .await,
            [200, 200],
            "{proto:?} {kind:?}: another /64 is another client"
        );
        // Rejected again, from yet another address of the spent /64 (the deny cache, where
        // the store has one, is keyed by the same network).
        assert_eq!(
            statuses(&client, &sluice, "/a", &["2001:db8:1:2::77"]).await,
            [429],
            "{proto:?} {kind:?}"
        );
        // The IPv4-mapped spelling is the IPv4 client: one bucket for both forms.
        assert_eq!(
            statuses(
                &client,
                &sluice,
                "/a",
                &["192.0.2.7", "::ffff:192.0.2.7", "192.0.2.7", "192.0.2.8"]
            )
            .await,
            [200, 200, 429, 200],
            "{proto:?} {kind:?}: ::ffff:192.0.2.7 is 192.0.2.7, and 192.0.2.8 apart"
        );
        // A configured /48 groups wider: three /64s of one /48 share a bucket.
        assert_eq!(
            statuses(
                &client,
                &sluice,
                "/wide",
                &[
                    "2001:db8:5:1::1",
                    "2001:db8:5:2::1",
                    "2001:db8:5:ffff::1",
                    "2001:db8:6::1"
                ]
            )
            .await,
            [200, 200, 429, 200],
            "{proto:?} {kind:?}: /48"
        );
        assert_eq!(
            statuses(
                &client,
                &sluice,
                "/wide",
                &[
                    "198.51.100.1",
                    "::ffff:198.51.100.200",
                    "198.51.100.99",
                    "198.51.101.1"
                ]
            )
            .await,
            [200, 200, 429, 200],
            "{proto:?} {kind:?}: IPv4 /24, the mapped form included"
        );
        if let Some(redis) = &store.redis {
            // Redis decided on the networks' keys, and no address has a key of its own.
            let mut keys = redis.keys().await;
            keys.sort();
            assert_eq!(
                keys,
                [
                    "sluice-test:a:per-ip:{ip=192.0.2.7}",
                    "sluice-test:a:per-ip:{ip=192.0.2.8}",
                    "sluice-test:a:per-ip:{ip=2001:db8:1:2::/64}",
                    "sluice-test:a:per-ip:{ip=2001:db8:1:3::/64}",
                    "sluice-test:wide:per-net:{ip=198.51.100.0/24}",
                    "sluice-test:wide:per-net:{ip=198.51.101.0/24}",
                    "sluice-test:wide:per-net:{ip=2001:db8:5::/48}",
                    "sluice-test:wide:per-net:{ip=2001:db8:6::/48}",
                ],
                "{proto:?}"
            );
        }
    }
}

#[tokio::test]
async fn ipv6_clients_count_by_prefix_redis() {
    addresses_group_by_prefix(StoreKind::Redis).await;
}

#[tokio::test]
async fn ipv6_clients_count_by_prefix_memory() {
    addresses_group_by_prefix(StoreKind::Memory).await;
}

const CHECKED: &str = r#"listen: 127.0.0.1:8080
admin_listen: 127.0.0.1:9090
upstreams:
  api: { url: "http://127.0.0.1:3000" }
routes:
  - name: a
    match: { path_prefix: / }
    upstream: api
    limits:
      - name: per-ip
        key: [client_ip]
        requests: 10
        window: 1m
        PREFIX
"#;

#[test]
fn check_refuses_a_prefix_out_of_range_at_its_position() {
    for (setting, field, bound) in [
        ("ipv6_prefix: 129", "ipv6_prefix", "1 to 128"),
        ("ipv6_prefix: 0", "ipv6_prefix", "1 to 128"),
        ("ipv4_prefix: 33", "ipv4_prefix", "1 to 32"),
    ] {
        let yaml = CHECKED.replace("PREFIX", setting);
        let file = write_config(&yaml);
        let path = file.path().to_str().unwrap();
        let (status, _, stderr) = sluice_check(file.path());
        assert_eq!(status.code(), Some(1), "{setting}: {stderr}");
        let line = yaml.lines().position(|l| l.contains(setting)).unwrap() + 1;
        let column = yaml.lines().nth(line - 1).unwrap().find(':').unwrap() + 3;
        let expected = format!("{path}:{line}:{column}: routes[0].limits[0].{field}");
        assert!(stderr.contains(&expected), "{expected}\n{stderr}");
        assert!(stderr.contains(bound), "{setting}: {stderr}");
    }
    let file = write_config(&CHECKED.replace("PREFIX", "ipv6_prefix: 56\n        ipv4_prefix: 24"));
    let (status, _, stderr) = sluice_check(file.path());
    assert!(status.success(), "{stderr}");
}

#[test]
fn explain_shows_the_network_a_client_counts_as() {
    let file = write_config(&CHECKED.replace("PREFIX", "ipv6_prefix: 56"));
    let path = file.path().to_str().unwrap();
    let explain = |from: &str| {
        let out = run_sluice(
            &["explain", "--config", path, "GET", "/", "--from", from],
            Duration::from_secs(10),
        );
        assert!(out.status.success(), "{}", out.stderr);
        out.stdout
    };
    let out = explain("2001:db8:1:2ff::9");
    for line in [
        "    client address counted as 2001:db8:1:200::/56 (IPv6 grouped by /56, IPv4 by /32: ipv6_prefix, ipv4_prefix)",
        "    store key: sluice:a:per-ip:{ip=2001:db8:1:200::/56}",
    ] {
        assert!(out.contains(line), "{line}\n{out}");
    }
    let out = explain("::ffff:192.0.2.7");
    assert!(
        out.contains("    store key: sluice:a:per-ip:{ip=192.0.2.7}"),
        "{out}"
    );
}
