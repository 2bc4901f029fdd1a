//! Soft budgets that switch models (issue 36, part 5), through the real binary, on Redis and
//! in process, with the fake LLM API (`support::llm_upstream`) as ground truth: its own record
//! of the model each request asked it for and what it spent.
//!
//! One route, money per API key: `big` (4,000 µUSD a minute on `gpt-4o`, past it
//! `on_exceed: { switch_model: gpt-4o-mini }`) and `small` (500 µUSD a minute on
//! `gpt-4o-mini*`, hard). A request of 22 prompt tokens and a cap of 100 reserves 1,213 µUSD at
//! gpt-4o's prices and spends 1,055; at gpt-4o-mini's, it reserves about 74 and spends 64.
//! So `big` admits 3 (3,165 spent, and 3,165 + 1,213 > 4,000); the next requests reach the
//! upstream as gpt-4o-mini, priced at its rates, and `small` admits 7 of them (6 × 64 + 74 ≤
//! 500 < 7 × 64 + 74) before its own 429. A reservation priced at gpt-4o's rates (1,213) could
//! never fit `small` at all.

use crate::support;

use serde_json::{json, Value};
use support::{
    client, metric_sum, parse_metrics, sluice_check, write_config, Limit, LlmUpstream, Node,
    Policy, Route, Sluice, Store, StoreKind, UpstreamSpec,
};

const SWITCHED: &str = "sluice-model-switched";

/// gpt-4o-mini and gpt-4o at OpenAI's list prices (USD per million tokens), as the fake bills.
fn models() -> Node {
    let priced = |pattern: &str, input: f64, output: f64| {
        Node::map([
            ("match", Node::from(pattern)),
            ("max_output", Node::from(16384)),
            (
                "prices",
                Node::map([
                    ("currency", Node::from("USD")),
                    ("input", Node::from(input)),
                    ("output", Node::from(output)),
                ]),
            ),
        ])
    };
    Node::Seq(vec![
        priced("gpt-4o-mini*", 0.15, 0.60),
        priced("gpt-4o", 2.50, 10.0),
    ])
}

fn on_model(patterns: Vec<&str>) -> Vec<Node> {
    vec![Node::map([("model", patterns)])]
}

fn policy(store: &Store, upstream: &LlmUpstream) -> Policy {
    Policy::new()
        .store(store)
        .set("models", models())
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("chat", "/v1/")
                .upstream("llm")
                .limit(
                    Limit::money("big", 0.004, "USD", "1m")
                        .key(["header:authorization"])
                        .when(on_model(vec!["gpt-4o"]))
                        .set(
                            "on_exceed",
                            Node::map([("switch_model", Node::from("gpt-4o-mini"))]),
                        ),
                )
                .limit(
                    Limit::money("small", 0.0005, "USD", "1m")
                        .key(["header:authorization"])
                        .when(on_model(vec!["gpt-4o-mini*"])),
                ),
        )
}

fn chat(model: &str) -> String {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 100,
    })
    .to_string()
}

/// An answer read to its end: a token answer is settled before its end reaches the client, so
/// a client that reads it whole and sends its next request finds the unused reservation back
/// (one dropped unread may keep it whole).
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: bytes::Bytes,
}

async fn send(sluice: &Sluice, key: &str, body: String) -> Answer {
    let answer = client()
        .post(format!("{}/v1/chat/completions", sluice.url()))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("an answer");
    Answer {
        status: answer.status().as_u16(),
        headers: answer.headers().clone(),
        body: answer.bytes().await.expect("the whole answer"),
    }
}

fn header(answer: &Answer, name: &str) -> Option<String> {
    answer
        .headers
        .get(name)
        .map(|v| v.to_str().expect("text").to_owned())
}

/// What the fake bills one request of `chat()` at `input`/`output` USD per million tokens:
/// 22 prompt tokens (3 + 14 bytes of text + 1 for the cap's number + 4 for the message) and
/// the cap of 100.
fn billed(input: f64, output: f64) -> f64 {
    22.0 * input + 100.0 * output
}

async fn switches_when_the_budget_is_spent(kind: StoreKind) {
    let store = Store::start(kind).await;
    let upstream = LlmUpstream::start().await;
    let sluice = Sluice::start(&policy(&store, &upstream)).await;

    for n in 0..3 {
        let answer = send(&sluice, "team", chat("gpt-4o")).await;
        assert_eq!(answer.status, 200, "gpt-4o request {n}");
        assert_eq!(header(&answer, SWITCHED), None, "not switched yet");
    }
    // Spent: the next request goes to gpt-4o-mini. Its body is the client's bytes, only the
    // value of its `model` changed, whatever the spelling of the key and the spaces.
    let spelled = "{ \"messages\" : [{\"role\":\"user\",\"content\":\"Say something.\"}],\n  \"mod\\u0065l\" :  \"GPT-4o\" , \"max_tokens\": 100 }";
    let answer = send(&sluice, "team", spelled.to_owned()).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        header(&answer, SWITCHED).as_deref(),
        Some("gpt-4o -> gpt-4o-mini")
    );
    let policy_field = header(&answer, "ratelimit-policy").unwrap_or_default();
    assert!(
        policy_field.contains("\"small\"") && !policy_field.contains("\"big\""),
        "decided against the fallback's limits: {policy_field}"
    );
    let received = upstream.bodies().last().cloned().expect("a body");
    assert_eq!(
        String::from_utf8_lossy(&received),
        spelled.replacen("\"GPT-4o\"", "\"gpt-4o-mini\"", 1),
        "the body forwarded is the client's, with its model switched"
    );
    let mut switched = 1;
    let refused = loop {
        let answer = send(&sluice, "team", chat("gpt-4o")).await;
        if answer.status != 200 {
            break answer;
        }
        assert_eq!(
            header(&answer, SWITCHED).as_deref(),
            Some("gpt-4o -> gpt-4o-mini")
        );
        switched += 1;
        assert!(switched < 50, "the fallback's budget never refused");
    };
    assert_eq!(refused.status, 429, "the fallback's own budget is hard");
    assert_eq!(
        header(&refused, SWITCHED).as_deref(),
        Some("gpt-4o -> gpt-4o-mini"),
        "a refused switched request says it was switched"
    );
    let problem: Value = serde_json::from_slice(&refused.body).expect("a problem body");
    assert_eq!(problem["limit"], "small", "{problem}");
    assert_eq!(
        switched, 7,
        "small admits 7 requests priced at gpt-4o-mini's rates"
    );
    // Asked for the fallback directly: the same spent budget, not switched.
    let direct = send(&sluice, "team", chat("gpt-4o-mini")).await;
    assert_eq!(direct.status, 429);
    assert_eq!(header(&direct, SWITCHED), None);
    // Naming `model` twice, in any spelling, is refused before anything is decided.
    let twice = r#"{"model":"gpt-4o-mini","mod\u0065l":"gpt-4o","max_tokens":100,"messages":[]}"#;
    assert_eq!(send(&sluice, "team", twice.to_owned()).await.status, 400);
    // Another key: its own budgets.
    let other = send(&sluice, "other", chat("gpt-4o")).await;
    assert_eq!(other.status, 200);
    assert_eq!(header(&other, SWITCHED), None);

    // The upstream's record: the model it was asked for, and what it spent at its rates.
    let asked = upstream.models();
    let answers = upstream.answers();
    let team = &answers[..10];
    assert_eq!(
        asked,
        [vec!["gpt-4o"; 3], vec!["gpt-4o-mini"; 7], vec!["gpt-4o"]].concat(),
        "nothing refused reached the upstream"
    );
    for answer in &team[..3] {
        assert!(
            (answer.micro_usd - billed(2.5, 10.0)).abs() < 1e-6,
            "{answer:?}"
        );
    }
    for answer in &team[3..] {
        assert!(
            (answer.micro_usd - billed(0.15, 0.60)).abs() < 1e-6,
            "{answer:?}"
        );
    }
    let big: f64 = team[..3].iter().map(|a| a.micro_usd).sum();
    let small: f64 = team[3..].iter().map(|a| a.micro_usd).sum();
    assert!(big <= 4000.0 && small <= 500.0, "{big} {small}");

    // A streamed request switched too, settled from its events.
    for _ in 0..3 {
        assert_eq!(send(&sluice, "streams", chat("gpt-4o")).await.status, 200);
    }
    let mut streamed: Value = serde_json::from_str(&chat("gpt-4o")).expect("JSON");
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let answer = send(&sluice, "streams", streamed.to_string()).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        header(&answer, SWITCHED).as_deref(),
        Some("gpt-4o -> gpt-4o-mini")
    );
    assert!(header(&answer, "content-type")
        .unwrap_or_default()
        .starts_with("text/event-stream"));
    let events = String::from_utf8_lossy(&answer.body).into_owned();
    assert!(
        events.contains("\"usage\"") && events.ends_with("data: [DONE]\n\n"),
        "{events}"
    );
    assert_eq!(
        upstream.models().last().map(String::as_str),
        Some("gpt-4o-mini")
    );

    let metrics = parse_metrics(&sluice.metrics().await);
    let labels = [("route", "chat"), ("limit", "big"), ("to", "gpt-4o-mini")];
    assert_eq!(
        metric_sum(&metrics, "sluice_model_switches_total", &labels),
        9.0,
        "7 switched and admitted, 1 switched and refused, 1 streamed"
    );
    // Settled at gpt-4o-mini's prices: `small` was charged what the upstream billed (64
    // µUSD, rounded up, for each of the 8 admitted), not gpt-4o's.
    let settled = metric_sum(
        &metrics,
        "sluice_tokens_settled_total",
        &[("route", "chat"), ("limit", "small")],
    );
    assert_eq!(settled, 8.0 * 64.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_when_the_budget_is_spent_redis() {
    switches_when_the_budget_is_spent(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switches_when_the_budget_is_spent_memory() {
    switches_when_the_budget_is_spent(StoreKind::Memory).await;
}

/// A refusal by a hard limit is a 429 even when a soft limit refused too: `calls` (3 requests
/// a minute, any model) and `big` both have no room for the fourth gpt-4o request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_limit_refusing_too_is_not_switched() {
    let store = Store::start(StoreKind::Redis).await;
    let upstream = LlmUpstream::start().await;
    let soft = Limit::money("big", 0.004, "USD", "1m")
        .key(["header:authorization"])
        .when(on_model(vec!["gpt-4o"]))
        .set(
            "on_exceed",
            Node::map([("switch_model", Node::from("gpt-4o-mini"))]),
        );
    let yaml = Policy::new()
        .store(&store)
        .set("models", models())
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("chat", "/v1/")
                .upstream("llm")
                .limit(soft)
                .limit(Limit::requests("calls", 3, "1m").key(["header:authorization"])),
        );
    let sluice = Sluice::start(&yaml).await;
    for _ in 0..3 {
        assert_eq!(send(&sluice, "team", chat("gpt-4o")).await.status, 200);
    }
    let refused = send(&sluice, "team", chat("gpt-4o")).await;
    assert_eq!(refused.status, 429);
    assert_eq!(header(&refused, SWITCHED), None, "not switched");
    assert_eq!(upstream.models(), vec!["gpt-4o"; 3]);
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "sluice_model_switches_total", &[("limit", "big")]),
        0.0
    );
}

/// `sluice check` refuses a switch where it makes no sense, naming the field and why.
#[test]
fn check_refuses_switches_that_make_no_sense() {
    let models = "models:\n  - match: \"gpt-4o-mini*\"\n    prices: { currency: USD, input: 0.15, output: 0.6 }\n  - match: gpt-4o\n    prices: { currency: USD, input: 2.5, output: 10 }\n";
    for (limits, says) in [
        (
            "      - { name: l, key: [client_ip], requests: 5, window: 1m, on_exceed: { switch_model: gpt-4o-mini } }\n",
            "needs a token or money limit",
        ),
        (
            "      - { name: l, key: [client_ip], tokens: 9000, window: 1m, on_exceed: { switch_model: gpt-4o-mini } }\n",
            "counted in this limit's own budget",
        ),
        (
            "      - { name: l, key: [client_ip], tokens: 9000, window: 1m, when: [{ model: [\"gpt-4o*\"] }], on_exceed: { switch_model: gpt-4o-mini } }\n",
            "counted in this limit's own budget",
        ),
        (
            "      - { name: l, key: [client_ip, model], tokens: 9000, window: 1m, when: [{ model: [gpt-4o-mini] }], on_exceed: { switch_model: gpt-4o-mini } }\n",
            "switching would change nothing",
        ),
        (
            "      - { name: l, key: [client_ip], money: 1, currency: USD, window: 1m, when: [{ model: [gpt-4o] }], on_exceed: { switch_model: o1-mini } }\n",
            "no entry of `models:` has prices in USD for `o1-mini`",
        ),
        (
            "      - { name: l, key: [client_ip], money: 1, currency: USD, window: 1m, when: [{ model: [gpt-4o] }], on_exceed: { switch_model: gpt-4o-mini } }\n      - { name: m, key: [client_ip], money: 1, currency: USD, window: 1m, when: [{ model: [gpt-4o-mini] }], on_exceed: { switch_model: gpt-4o } }\n",
            "chains and loops are refused",
        ),
    ] {
        let yaml = format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{models}upstreams:\n  u: {{ url: \"http://127.0.0.1:9\" }}\nroutes:\n  - name: r\n    match: {{ path_prefix: / }}\n    upstream: u\n    limits:\n{limits}"
        );
        let file = write_config(&yaml);
        let (status, _, stderr) = sluice_check(file.path());
        assert!(!status.success(), "{limits}");
        assert!(
            stderr.contains("routes[0].limits[0].on_exceed") && stderr.contains(says),
            "{limits}: {stderr}"
        );
    }
    let fine = format!(
        "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{models}upstreams:\n  u: {{ url: \"http://127.0.0.1:9\" }}\nroutes:\n  - name: r\n    match: {{ path_prefix: / }}\n    upstream: u\n    limits:\n      - {{ name: l, key: [client_ip], money: 1, currency: USD, window: 1m, when: [{{ model: [gpt-4o] }}], on_exceed: {{ switch_model: gpt-4o-mini }} }}\n      - {{ name: m, key: [client_ip, model], tokens: 90000, window: 1m, on_exceed: {{ switch_model: gpt-4o-mini }} }}\n"
    );
    let file = write_config(&fine);
    let (status, stdout, stderr) = sluice_check(file.path());
    assert!(status.success(), "{stdout}{stderr}");
}
