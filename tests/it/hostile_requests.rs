//! Hostile requests: the limiter, the router and the upstream judge the same request (issue
//! 19, point 6). For each trick — a repeated identity field, `Connection` naming the identity,
//! a respelled method or HEAD for GET, HTTP/2 cookie crumbs — a test spends a limit, then
//! tries the trick, and expects the exact answer and an upstream that received nothing more.
//!
//! Every case runs over HTTP/1.1 and cleartext HTTP/2 (prior knowledge), against a real Redis
//! store and against the in-process store.

use crate::support;

use std::time::Duration;

use reqwest::Method;
use support::{
    metric_sum, parse_metrics, samples, Limit, Node, Policy, Route, Sluice, Store, StoreKind,
    Upstream, UpstreamSpec,
};

/// Every limited route allows 2 requests a minute per identity; `open` has no limit.
fn config(store: Policy, upstream: &str) -> Policy {
    let two = |key: &str| Limit::requests("two", 2, "1m").key([key]);
    store
        .upstream("api", UpstreamSpec::new(upstream).timeout("10s"))
        .route(
            Route::new("by-header", "/h")
                .upstream("api")
                .limit(two("header:x-api-key")),
        )
        .route(
            Route::new("by-query", "/q")
                .upstream("api")
                .limit(two("query:api_key")),
        )
        .route(
            Route::new("by-cookie", "/c")
                .upstream("api")
                .limit(two("cookie:session")),
        )
        .route(Route::new("tiers", "/t").upstream("api").limit(
            Limit::requests("free", 2, "1m").key(["header:x-user"]).set(
                "when",
                vec![Node::map([("header", "x-plan"), ("equals", "free")])],
            ),
        ))
        .route(
            Route::new("auth", "/auth")
                .methods(["POST"])
                .upstream("api")
                .limit(two("header:x-user")),
        )
        .route(
            Route::new("items", "/items")
                .methods(["GET"])
                .upstream("api")
                .limit(two("header:x-user")),
        )
        .route(Route::new("open", "/").upstream("api"))
}

async fn start(kind: StoreKind) -> (Store, Upstream, Sluice) {
    let store = Store::start(kind).await;
    let up = Upstream::start().await;
    let sluice = Sluice::start(&config(Policy::new().store(&store), &up.url())).await;
    (store, up, sluice)
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

const PROTOCOLS: [Proto; 2] = [Proto::H1, Proto::H2];

impl Proto {
    fn client(self) -> reqwest::Client {
        let builder = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30));
        match self {
            Proto::H1 => builder.http1_only(),
            Proto::H2 => builder.http2_prior_knowledge(),
        }
        .build()
        .expect("build reqwest client")
    }

    fn version(self) -> reqwest::Version {
        match self {
            Proto::H1 => reqwest::Version::HTTP_11,
            Proto::H2 => reqwest::Version::HTTP_2,
        }
    }

    /// Tells the identities of one protocol's run from the other's.
    fn tag(self) -> &'static str {
        match self {
            Proto::H1 => "h1",
            Proto::H2 => "h2",
        }
    }
}

/// What came back: the status, the problem's `detail` (or the body), the upstream's echo.
struct Answer {
    status: u16,
    problem: bool,
    body: String,
}

impl Answer {
    fn detail(&self) -> String {
        let json: serde_json::Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("a JSON body, not {:?}: {e}", self.body));
        json["detail"].as_str().unwrap_or_default().to_owned()
    }

    /// The values of `name` the upstream received, one per field line.
    fn upstream_saw(&self, name: &str) -> Vec<String> {
        let echo: serde_json::Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("the upstream's echo, not {:?}: {e}", self.body));
        echo["headers"][name]
            .as_array()
            .map(|values| {
                values
                    .iter()
                    .map(|v| v.as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Sends `method path` with `fields` (each its own field line, in order).
async fn send(
    proto: Proto,
    client: &reqwest::Client,
    sluice: &Sluice,
    method: &str,
    path: &str,
    fields: &[(&str, &str)],
) -> Answer {
    let method = Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client.request(method.clone(), format!("{}{path}", sluice.url()));
    for (name, value) in fields {
        request = request.header(*name, *value);
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{proto:?} {method} {path}: {e}"));
    assert_eq!(response.version(), proto.version(), "{method} {path}");
    let status = response.status().as_u16();
    let problem = response
        .headers()
        .get("content-type")
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/problem+json"));
    let body = response.text().await.unwrap();
    Answer {
        status,
        problem,
        body,
    }
}

/// Spends the 2 requests of an identity and checks the third is refused with 429.
async fn spend(
    proto: Proto,
    client: &reqwest::Client,
    sluice: &Sluice,
    method: &str,
    path: &str,
    fields: &[(&str, &str)],
) {
    for i in 1..=2 {
        let answer = send(proto, client, sluice, method, path, fields).await;
        assert_eq!(
            answer.status, 200,
            "{proto:?} {method} {path} #{i}: {}",
            answer.body
        );
    }
    let third = send(proto, client, sluice, method, path, fields).await;
    assert_eq!(
        third.status, 429,
        "{proto:?} {method} {path}: the limit is spent"
    );
}

/// The answer is a 400 problem whose detail names `named`.
fn assert_refused(answer: &Answer, named: &str, what: &str) {
    assert_eq!(answer.status, 400, "{what}: {}", answer.body);
    assert!(answer.problem, "{what}: problem+json");
    let detail = answer.detail();
    assert!(
        detail.contains(named),
        "{what}: the detail names {named}: {detail}"
    );
}

/// `sluice_refused_requests_total{reason}`, which must be exported.
async fn refused(sluice: &Sluice, reason: &str) -> f64 {
    let all = parse_metrics(&sluice.metrics().await);
    let labels = [("reason", reason)];
    assert_eq!(
        samples(&all, "sluice_refused_requests_total", &labels).len(),
        1,
        "the series of reason {reason} is exported"
    );
    metric_sum(&all, "sluice_refused_requests_total", &labels)
}

// ---------------------------------------------------------------------------
// 1. Repeated identity fields
// ---------------------------------------------------------------------------

async fn repeated_identity_fields(kind: StoreKind) {
    let (_store, up, sluice) = start(kind).await;
    let mut refusals = 0.0;
    for proto in PROTOCOLS {
        let client = proto.client();
        let tag = proto.tag();
        let key = format!("A-{tag}");
        let junk = format!("junk-{tag}");

        spend(proto, &client, &sluice, "GET", "/h", &[("x-api-key", &key)]).await;
        let query = format!("/q?api_key={key}");
        spend(proto, &client, &sluice, "GET", &query, &[]).await;
        let cookie = format!("session={key}");
        spend(proto, &client, &sluice, "GET", "/c", &[("cookie", &cookie)]).await;
        let tier = [("x-user", key.as_str()), ("x-plan", "free")];
        spend(proto, &client, &sluice, "GET", "/t", &tier).await;
        let hits = up.hits();

        for pair in [[&key, &junk], [&junk, &key]] {
            let fields = [("x-api-key", pair[0].as_str()), ("x-api-key", pair[1])];
            let answer = send(proto, &client, &sluice, "GET", "/h", &fields).await;
            assert_refused(&answer, "x-api-key", &format!("{proto:?} {fields:?}"));
        }
        for query in [
            format!("/q?api_key={key}&api_key={junk}"),
            format!("/q?api_key={junk}&api_key={key}"),
            // Another spelling of the same name is the same parameter.
            format!("/q?api_key={key}&api%5Fkey={junk}"),
        ] {
            let answer = send(proto, &client, &sluice, "GET", &query, &[]).await;
            assert_refused(&answer, "api_key", &format!("{proto:?} {query}"));
        }
        let one_field = format!("session={key}; session={junk}");
        let two_fields = [
            ("cookie", format!("session={junk}")),
            ("cookie", cookie.clone()),
        ];
        for fields in [
            vec![("cookie", one_field.as_str())],
            two_fields.iter().map(|(n, v)| (*n, v.as_str())).collect(),
        ] {
            let answer = send(proto, &client, &sluice, "GET", "/c", &fields).await;
            assert_refused(&answer, "session", &format!("{proto:?} {fields:?}"));
        }
        // A field a `when:` reads counts as much as a key part.
        let plans = [
            ("x-user", key.as_str()),
            ("x-plan", "paid"),
            ("x-plan", "free"),
        ];
        let answer = send(proto, &client, &sluice, "GET", "/t", &plans).await;
        assert_refused(&answer, "x-plan", &format!("{proto:?} two x-plan"));
        refusals += 8.0;
        assert_eq!(up.hits(), hits, "{proto:?}: no trick reached the upstream");

        // A list-based field no limit reads may repeat, and a spent key stays spent with it.
        let fresh = format!("B-{tag}");
        let accepts = [
            ("x-api-key", fresh.as_str()),
            ("accept", "text/html"),
            ("accept", "*/*"),
        ];
        let answer = send(proto, &client, &sluice, "GET", "/h", &accepts).await;
        assert_eq!(answer.status, 200, "{proto:?}: {}", answer.body);
        assert_eq!(answer.upstream_saw("accept").len(), 2, "{}", answer.body);
        let accepts = [
            ("x-api-key", key.as_str()),
            ("accept", "a/b"),
            ("accept", "*/*"),
        ];
        let answer = send(proto, &client, &sluice, "GET", "/h", &accepts).await;
        assert_eq!(answer.status, 429, "{proto:?}");
        assert_eq!(up.hits(), hits + 1);
    }
    assert_eq!(refused(&sluice, "repeated_field").await, refusals);
}

#[tokio::test]
async fn repeated_identity_fields_redis() {
    repeated_identity_fields(StoreKind::Redis).await;
}

#[tokio::test]
async fn repeated_identity_fields_memory() {
    repeated_identity_fields(StoreKind::Memory).await;
}

// ---------------------------------------------------------------------------
// 2. `Connection` naming the identity
// ---------------------------------------------------------------------------

/// One HTTP/1.1 request written as it is on the wire, on its own connection.
async fn raw(sluice: &Sluice, head: &str) -> support::RawResponse {
    support::raw_http(sluice.addr(), &format!("{head}\r\nHost: x\r\n\r\n")).await
}

fn assert_raw_refused(response: &support::RawResponse, named: &str, what: &str) {
    let body = String::from_utf8_lossy(&response.body);
    assert_eq!(response.status, 400, "{what}: {body}");
    assert!(
        response
            .header("content-type")
            .is_some_and(|ct| ct.starts_with("application/problem+json")),
        "{what}: {response:?}"
    );
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let detail = json["detail"].as_str().unwrap();
    assert!(detail.contains(named), "{what}: names {named}: {detail}");
}

async fn connection_naming_the_identity(kind: StoreKind) {
    let (_store, up, sluice) = start(kind).await;

    // HTTP/1.1: refused with 400 before anything reads the request.
    let h1 = Proto::H1.client();
    spend(Proto::H1, &h1, &sluice, "GET", "/h", &[("x-api-key", "A")]).await;
    spend(
        Proto::H1,
        &h1,
        &sluice,
        "GET",
        "/c",
        &[("cookie", "session=A")],
    )
    .await;
    let hits = up.hits();
    let tricks = [
        (
            "GET /h HTTP/1.1\r\nConnection: x-api-key\r\nx-api-key: A",
            "x-api-key",
        ),
        // A fresh key each time would be a fresh bucket: the trick itself.
        (
            "GET /h HTTP/1.1\r\nConnection: x-api-key\r\nx-api-key: random-1",
            "x-api-key",
        ),
        (
            "GET /h HTTP/1.1\r\nConnection: close, X-Api-Key\r\nx-api-key: random-2",
            "x-api-key",
        ),
        (
            "GET /h HTTP/1.1\r\nConnection: keep-alive\r\nConnection: x-api-key\r\nx-api-key: r3",
            "x-api-key",
        ),
        (
            "GET /c HTTP/1.1\r\nConnection: cookie\r\nCookie: session=random",
            "cookie",
        ),
        (
            "GET /h HTTP/1.1\r\nConnection: host\r\nx-api-key: A",
            "host",
        ),
        (
            "GET /t HTTP/1.1\r\nConnection: x-plan\r\nx-plan: free\r\nx-user: U",
            "x-plan",
        ),
    ];
    for (head, named) in tricks {
        let response = raw(&sluice, head).await;
        assert_raw_refused(&response, named, head);
    }
    assert_eq!(up.hits(), hits, "no trick reached the upstream");
    assert_eq!(
        refused(&sluice, "connection_field").await,
        tricks.len() as f64
    );

    // A field the policy does not read is removed before anything reads the request, and the
    // identity is still the one counted.
    let response = raw(
        &sluice,
        "GET /h HTTP/1.1\r\nConnection: x-other\r\nx-other: 1\r\nx-api-key: A",
    )
    .await;
    assert_eq!(response.status, 429, "{response:?}");
    let response = raw(
        &sluice,
        "GET /open HTTP/1.1\r\nConnection: x-other\r\nx-other: 1",
    )
    .await;
    assert_eq!(response.status, 200, "{response:?}");
    let echo: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    assert!(echo["headers"].get("x-other").is_none(), "{echo}");
    assert!(echo["headers"].get("connection").is_none(), "{echo}");
    assert_eq!(up.hits(), hits + 1);

    // HTTP/2 has no `Connection` (RFC 9113 §8.2.2): a request carrying one is malformed and
    // its stream is reset before sluice sees it.
    for (path, field, value) in [("/h", "x-api-key", "A"), ("/c", "cookie", "session=random")] {
        let outcome = raw_h2::request(
            sluice.addr(),
            path,
            &[("connection", field), (field, value)],
        )
        .await;
        assert_eq!(
            outcome,
            raw_h2::Outcome::Reset(raw_h2::PROTOCOL_ERROR),
            "{path}"
        );
    }
    assert_eq!(
        up.hits(),
        hits + 1,
        "nothing over HTTP/2 reached the upstream"
    );
    // The raw client itself is sound: without `connection`, the same request is answered.
    let outcome = raw_h2::request(sluice.addr(), "/h", &[("x-api-key", "raw-h2")]).await;
    assert_eq!(outcome, raw_h2::Outcome::Status(200));
    assert_eq!(up.hits(), hits + 2);
}

#[tokio::test]
async fn connection_naming_the_identity_redis() {
    connection_naming_the_identity(StoreKind::Redis).await;
}

#[tokio::test]
async fn connection_naming_the_identity_memory() {
    connection_naming_the_identity(StoreKind::Memory).await;
}

// ---------------------------------------------------------------------------
// 3. Method spelling and HEAD
// ---------------------------------------------------------------------------

async fn method_spelling_and_head(kind: StoreKind) {
    let (_store, up, sluice) = start(kind).await;
    for proto in PROTOCOLS {
        let client = proto.client();
        let user = format!("U-{}", proto.tag());
        let fields = [("x-user", user.as_str())];
        spend(proto, &client, &sluice, "POST", "/auth", &fields).await;
        spend(proto, &client, &sluice, "GET", "/items", &fields).await;
        let hits = up.hits();

        for method in ["post", "Post", "pOST"] {
            let answer = send(proto, &client, &sluice, method, "/auth", &fields).await;
            assert_refused(&answer, method, &format!("{proto:?} {method} /auth"));
        }
        let answer = send(proto, &client, &sluice, "get", "/items", &fields).await;
        assert_refused(&answer, "get", &format!("{proto:?} get /items"));
        // HEAD runs the GET handler upstream: the spent GET limit holds for it.
        let answer = send(proto, &client, &sluice, "HEAD", "/items", &fields).await;
        assert_eq!(answer.status, 429, "{proto:?} HEAD /items");
        assert_eq!(up.hits(), hits, "{proto:?}: no trick reached the upstream");

        // HEAD is counted in the GET limit's bucket.
        let other = format!("V-{}", proto.tag());
        let fields = [("x-user", other.as_str())];
        for _ in 0..2 {
            let answer = send(proto, &client, &sluice, "HEAD", "/items", &fields).await;
            assert_eq!(answer.status, 200, "{proto:?} HEAD /items");
        }
        let answer = send(proto, &client, &sluice, "GET", "/items", &fields).await;
        assert_eq!(
            answer.status, 429,
            "{proto:?}: two HEADs spent the GET limit"
        );
        // A method that is not a standard one in any case is the upstream's business.
        let answer = send(proto, &client, &sluice, "purge", "/items", &fields).await;
        assert_eq!(answer.status, 200, "{proto:?} purge /items goes to `open`");
        assert_eq!(up.hits(), hits + 3);
    }
    assert_eq!(refused(&sluice, "method_spelling").await, 8.0);
}

#[tokio::test]
async fn method_spelling_and_head_redis() {
    method_spelling_and_head(StoreKind::Redis).await;
}

#[tokio::test]
async fn method_spelling_and_head_memory() {
    method_spelling_and_head(StoreKind::Memory).await;
}

// ---------------------------------------------------------------------------
// 4. Cookie crumbs
// ---------------------------------------------------------------------------

async fn cookie_crumbs(kind: StoreKind) {
    let (_store, up, sluice) = start(kind).await;
    for proto in PROTOCOLS {
        let client = proto.client();
        let tag = proto.tag();
        let spent = format!("S-{tag}");
        let joined = format!("theme=dark; session={spent}");
        spend(proto, &client, &sluice, "GET", "/c", &[("cookie", &joined)]).await;
        let hits = up.hits();

        // The same cookies in crumbs, in either order: the same, spent, bucket.
        let session = format!("session={spent}");
        for crumbs in [
            [("cookie", "theme=dark"), ("cookie", session.as_str())],
            [("cookie", session.as_str()), ("cookie", "theme=dark")],
        ] {
            let answer = send(proto, &client, &sluice, "GET", "/c", &crumbs).await;
            assert_eq!(answer.status, 429, "{proto:?} {crumbs:?}");
        }
        assert_eq!(up.hits(), hits, "{proto:?}: no crumbs reached the upstream");

        // A fresh session in crumbs reaches the upstream as one Cookie line, joined with "; ".
        let fresh = format!("session=F-{tag}");
        let crumbs = [
            ("cookie", "theme=dark"),
            ("cookie", fresh.as_str()),
            ("cookie", "lang=en"),
        ];
        let answer = send(proto, &client, &sluice, "GET", "/c", &crumbs).await;
        assert_eq!(answer.status, 200, "{proto:?}: {}", answer.body);
        assert_eq!(
            answer.upstream_saw("cookie"),
            [format!("theme=dark; {fresh}; lang=en")],
            "{proto:?}"
        );
        // ... and counts in the bucket of that session.
        let answer = send(proto, &client, &sluice, "GET", "/c", &[("cookie", &fresh)]).await;
        assert_eq!(answer.status, 200, "{proto:?}");
        let answer = send(proto, &client, &sluice, "GET", "/c", &crumbs).await;
        assert_eq!(answer.status, 429, "{proto:?}: the third of session F");

        // The session named in two crumbs is a repeated field.
        let twice = [("cookie", fresh.as_str()), ("cookie", "session=junk")];
        let answer = send(proto, &client, &sluice, "GET", "/c", &twice).await;
        assert_refused(&answer, "session", &format!("{proto:?} {twice:?}"));
        assert_eq!(up.hits(), hits + 2, "{proto:?}");
    }
}

#[tokio::test]
async fn cookie_crumbs_redis() {
    cookie_crumbs(StoreKind::Redis).await;
}

#[tokio::test]
async fn cookie_crumbs_memory() {
    cookie_crumbs(StoreKind::Memory).await;
}

// ---------------------------------------------------------------------------
// `sluice explain` tells the same
// ---------------------------------------------------------------------------

/// `sluice explain` refuses what the gateway refuses, with the same detail, and routes HEAD
/// where GET goes.
#[test]
fn explain_refuses_the_same_requests() {
    let yaml = format!(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{}",
        config(Policy::new(), "http://127.0.0.1:3000").to_yaml()
    );
    let file = support::write_config(&yaml);
    let path = file.path().to_str().unwrap();
    let explain = |args: &[&str]| {
        let mut all = vec!["explain", "--config", path];
        all.extend_from_slice(args);
        let out = support::run_sluice(&all, Duration::from_secs(10));
        assert!(out.status.success(), "{args:?}: {}", out.stderr);
        out.stdout
    };
    for (args, refusal) in [
        (
            &["post", "/auth"][..],
            "refused:    400 Bad Request: the method `post` is `POST`",
        ),
        (
            &["GET", "/h", "-H", "x-api-key: a", "-H", "x-api-key: b"][..],
            "refused:    400 Bad Request: the header x-api-key appears more than once",
        ),
        (
            &["GET", "/q?api_key=a&api_key=b"][..],
            "refused:    400 Bad Request: the query parameter api_key appears more than once",
        ),
        (
            &[
                "GET",
                "/c",
                "-H",
                "cookie: session=a",
                "-H",
                "cookie: session=b",
            ][..],
            "refused:    400 Bad Request: the cookie session appears more than once",
        ),
        (
            &[
                "GET",
                "/h",
                "-H",
                "connection: x-api-key",
                "-H",
                "x-api-key: a",
            ][..],
            "refused:    400 Bad Request: the Connection header names x-api-key",
        ),
    ] {
        let out = explain(args);
        assert!(out.contains(refusal), "{args:?}:\n{out}");
        assert!(!out.contains("store key:"), "{args:?}:\n{out}");
    }
    let out = explain(&["HEAD", "/items", "-H", "x-user: u"]);
    assert!(out.contains("route:      items"), "{out}");
    assert!(
        out.contains("store key: sluice:items:two:{h:x-user=u}"),
        "{out}"
    );
}

/// A bare HTTP/2 client that writes its own frames, for the requests a well-behaved client
/// library refuses to send (a `connection` field). Header fields are sent as HPACK literals
/// without indexing or Huffman coding (RFC 7541 §6.2.2), so the encoding is exact.
mod raw_h2 {
    use std::net::SocketAddr;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    const END_STREAM: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    const ACK: u8 = 0x1;
    pub const PROTOCOL_ERROR: u32 = 0x1;

    /// How the server ended stream 1.
    #[derive(Debug, PartialEq, Eq)]
    pub enum Outcome {
        /// A response with this status.
        Status(u16),
        /// RST_STREAM with this error code.
        Reset(u32),
        /// GOAWAY with this error code.
        GoAway(u32),
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut out = len.to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn string(out: &mut Vec<u8>, text: &str) {
        assert!(text.len() < 127, "short strings only");
        out.push(text.len() as u8);
        out.extend_from_slice(text.as_bytes());
    }

    /// `GET path` on stream 1 with `fields`, and how the server answered.
    pub async fn request(addr: SocketAddr, path: &str, fields: &[(&str, &str)]) -> Outcome {
        // :method GET and :scheme http are static table entries 2 and 6; :authority (1) and
        // :path (4) are literals with an indexed name.
        let mut block = vec![0x82, 0x86, 0x01];
        string(&mut block, "x");
        block.push(0x04);
        string(&mut block, path);
        for (name, value) in fields {
            block.push(0x00);
            string(&mut block, name);
            string(&mut block, value);
        }
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        hello.extend(frame(HEADERS, END_STREAM | END_HEADERS, 1, &block));
        stream.write_all(&hello).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), read_outcome(&mut stream))
            .await
            .expect("the server ends stream 1 within 10 s")
    }

    async fn read_outcome(stream: &mut TcpStream) -> Outcome {
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.expect("a frame header");
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            stream
                .read_exact(&mut payload)
                .await
                .expect("a frame payload");
            let code = |at: usize| u32::from_be_bytes(payload[at..at + 4].try_into().unwrap());
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    stream
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .unwrap();
                }
                RST_STREAM if id == 1 => return Outcome::Reset(code(0)),
                GOAWAY => return Outcome::GoAway(code(4)),
                HEADERS if id == 1 => return Outcome::Status(status(&payload, flags)),
                _ => {}
            }
        }
    }

    /// The `:status` of a response header block, for the statuses HPACK's static table holds
    /// (200, 204, 206, 304, 400, 404, 500), which servers send as one indexed byte.
    fn status(block: &[u8], flags: u8) -> u16 {
        const PADDED: u8 = 0x8;
        const PRIORITY: u8 = 0x20;
        let at = usize::from(flags & PADDED != 0) + if flags & PRIORITY != 0 { 5 } else { 0 };
        match block[at] {
            0x88 => 200,
            0x89 => 204,
            0x8a => 206,
            0x8b => 304,
            0x8c => 400,
            0x8d => 404,
            0x8e => 500,
            other => panic!("not an indexed static :status ({other:#x}): {block:?}"),
        }
    }
}
