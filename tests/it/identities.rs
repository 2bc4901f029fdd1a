//! Identities taken from the request cannot make store keys large, unreadable or ambiguous:
//! long and binary header values become a fixed-length hash, short printable ones stay
//! readable with the key's separators escaped, and every identity keeps its own bucket.

use crate::support;

use support::{Limit, Policy, Redis, Route, Sluice};

async fn start(redis: &Redis) -> Sluice {
    let policy = Policy::new()
        .store_redis(redis)
        .server("max_header_bytes", "512KiB")
        .route(
            Route::new("api", "/")
                .respond(200, "ok")
                .limit(Limit::requests("per-key", 1, "1m").key(["header:x-api-key"])),
        );
    Sluice::start(&policy).await
}

/// Sends a request with `x-api-key` set to `value`, as raw bytes.
async fn with_key(sluice: &Sluice, value: &[u8]) -> u16 {
    let mut request = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-api-key: ".to_vec();
    request.extend_from_slice(value);
    request.extend_from_slice(b"\r\n\r\n");
    status_of(sluice, &request).await
}

/// Sends raw bytes (header values above 0x7F included) and reads the status of the answer.
async fn status_of(sluice: &Sluice, request: &[u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(sluice.addr()).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut response),
    )
    .await
    .expect("a response within 10 s")
    .unwrap();
    let status = response
        .split(|&b| b == b' ')
        .nth(1)
        .and_then(|s| std::str::from_utf8(s).ok())
        .and_then(|s| s.parse().ok());
    status.unwrap_or_else(|| panic!("no status in {:?}", String::from_utf8_lossy(&response)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_binary_and_separator_laden_identities_keep_their_own_bounded_keys() {
    let redis = Redis::start().await;
    let sluice = start(&redis).await;

    let long_a = vec![b'a'; 200_000];
    let mut long_b = long_a.clone();
    *long_b.last_mut().unwrap() = b'b';
    let identities: Vec<Vec<u8>> = vec![
        long_a,
        long_b,
        b"caf\xc3\xa9-\xff\xfe".to_vec(),
        b"caf\xc3\xa9-\xff\xfd".to_vec(),
        b"a|b}{c,#d%".to_vec(),
        b"a|b}{c,#d%25".to_vec(),
        b"plain-key-1".to_vec(),
    ];
    for identity in &identities {
        assert_eq!(with_key(&sluice, identity).await, 200, "first request");
    }
    for identity in &identities {
        assert_eq!(
            with_key(&sluice, identity).await,
            429,
            "the second request of one identity is limited"
        );
    }

    let keys = redis.keys().await;
    assert_eq!(
        keys.len(),
        identities.len(),
        "one bucket per identity: {keys:?}"
    );
    let prefix = "sluice-test:api:per-key:{h:x-api-key=";
    for key in &keys {
        assert!(key.starts_with(prefix), "{key}");
        assert!(key.ends_with('}'), "{key}");
        assert_eq!(key.matches('{').count(), 1, "{key}");
        assert_eq!(key.matches('}').count(), 1, "{key}");
        assert!(key.len() <= prefix.len() + 200, "a bounded key: {key}");
        assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{key}");
    }
    let hashed: Vec<&String> = keys.iter().filter(|k| k.contains("=#")).collect();
    assert_eq!(
        hashed.len(),
        4,
        "the long and binary values are hashed: {keys:?}"
    );
    for key in hashed {
        // `#`, 32 hex digits, `}`.
        assert_eq!(key.len(), prefix.len() + 34, "{key}");
    }
    assert!(keys.contains(&format!("{prefix}plain-key-1}}")), "{keys:?}");
    assert!(
        keys.contains(&format!("{prefix}a%7Cb%7D%7Bc%2C%23d%25}}")),
        "separators escaped: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_raw_bound_is_64_bytes() {
    let redis = Redis::start().await;
    let sluice = start(&redis).await;
    assert_eq!(with_key(&sluice, &[b'k'; 64]).await, 200);
    assert_eq!(with_key(&sluice, &[b'k'; 65]).await, 200);
    let keys = redis.keys().await;
    assert!(
        keys.iter().any(|k| k.contains(&"k".repeat(64))),
        "64 bytes stay readable: {keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.contains("=#")),
        "65 bytes are hashed: {keys:?}"
    );
}
