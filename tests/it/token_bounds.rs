//! The reservation is a true upper bound of what the upstream can spend (issue 26, classes
//! 1–4), through a real sluice (two instances on one Redis, or one in process) and a fake LLM
//! API (`support::llm_upstream`) that charges like the real APIs and spends the most each
//! request allows. Hostile but legal clients send requests at once; for each class, the
//! tokens (and money) the upstream's own record says it spent within the window stay within
//! the limit, some requests are served, and every other one is refused with a precise
//! status (413, 422 or 429) and a problem body, the upstream receiving nothing for it.

use crate::support;

use serde_json::{json, Value};
use support::llm_upstream::priced_models;
use support::{
    client, Limit, LlmUpstream, Node, Policy, Route, Sluice, Store, StoreKind, UpstreamSpec,
};

const BUDGET: u64 = 20_000;

/// Sluice instances (two on Redis, one in process) with one route `/v1/` and `limit` (named
/// `budget`, its `reserve` set) per `x-api-key`; `models`: the policy's `models:` section,
/// if any.
struct Gateway {
    upstream: LlmUpstream,
    sluices: Vec<Sluice>,
    _store: Store,
}

/// A token budget named `budget`: `tokens` a minute, reserving at most `max_output` of output.
fn tokens(tokens: u32, max_output: u32) -> Limit {
    Limit::tokens("budget", tokens, "1m").reserve_max_output(max_output)
}

impl Gateway {
    async fn start(kind: StoreKind, limit: Limit, models: Option<Node>) -> Gateway {
        let upstream = LlmUpstream::start().await;
        let store = Store::start(kind).await;
        let mut policy = Policy::new().store(&store);
        if let Some(models) = models {
            policy = policy.set("models", models);
        }
        let policy = policy
            .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
            .route(
                Route::new("llm", "/v1/")
                    .upstream("llm")
                    .limit(limit.key(["header:x-api-key"])),
            );
        let instances = if store.redis.is_some() { 2 } else { 1 };
        let mut sluices = Vec::new();
        for _ in 0..instances {
            sluices.push(Sluice::start(&policy).await);
        }
        Gateway {
            upstream,
            sluices,
            _store: store,
        }
    }

    /// Sends every request at once (instances in turn). Returns the statuses and the bodies
    /// (a refusal's problem body).
    async fn send_all(&self, requests: Vec<(&str, Value)>) -> Vec<(u16, String)> {
        let c = client();
        let tasks: Vec<_> = requests
            .into_iter()
            .enumerate()
            .map(|(n, (path, body))| {
                let url = format!("{}{path}", self.sluices[n % self.sluices.len()].url());
                let c = c.clone();
                tokio::spawn(async move {
                    let answer = c
                        .post(url)
                        .header("x-api-key", "hostile")
                        .header("content-type", "application/json")
                        .body(body.to_string())
                        .send()
                        .await
                        .expect("an answer");
                    let status = answer.status().as_u16();
                    let is_problem =
                        support::header(&answer, "content-type") == "application/problem+json";
                    let text = answer.text().await.expect("a body");
                    if status != 200 && !is_problem {
                        return (status, format!("(not a problem body) {text}"));
                    }
                    (status, text)
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("a client"));
        }
        answers
    }

    /// The ground truth: everything the upstream spent (all within one window of 1 min) stays
    /// within `budget`, and the upstream answered exactly the requests sluice let through.
    fn assert_within(&self, answers: &[(u16, String)], budget: u64, what: &str) -> u64 {
        let served = answers.iter().filter(|(status, _)| *status == 200).count();
        assert!(served > 0, "{what}: nothing was served: {answers:?}");
        let spent: u64 = self.upstream.answers().iter().map(|a| a.usage).sum();
        assert!(
            spent <= budget,
            "{what}: the upstream spent {spent} tokens in one window; the limit is {budget}"
        );
        assert_eq!(
            self.upstream.bodies().len(),
            served,
            "{what}: the upstream received exactly the requests served"
        );
        for (status, text) in answers {
            assert!(
                matches!(status, 200 | 413 | 422 | 429) && !text.starts_with("(not a problem"),
                "{what}: status {status}: {text}"
            );
        }
        eprintln!("{what}: {served} served, {spent} of {budget} tokens spent");
        spent
    }
}

fn chat(model: &str, text: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

/// Class 1: one request, several completions (Chat `n`, legacy `n` and `best_of`, an array
/// of prompts): the cap is multiplied where the API multiplies.
async fn several_completions_stay_within_the_budget(kind: StoreKind) {
    let gw = Gateway::start(kind, tokens(20000, 2000), None).await;
    let mut requests = Vec::new();
    for n in 0..12 {
        let mut body = chat("gpt-4o-mini", "Tell me a story.");
        body["n"] = json!(16);
        body["max_completion_tokens"] = json!(300);
        requests.push(("/v1/chat/completions", body));
        let prompts: Vec<String> = (0..20).map(|i| format!("Prompt {n}.{i}")).collect();
        requests.push((
            "/v1/completions",
            json!({"model": "gpt-3.5-turbo-instruct", "prompt": prompts, "max_tokens": 200}),
        ));
        requests.push((
            "/v1/completions",
            json!({"model": "gpt-3.5-turbo-instruct", "prompt": "Once", "max_tokens": 1000, "n": 2, "best_of": 8}),
        ));
    }
    let answers = gw.send_all(requests).await;
    gw.assert_within(&answers, BUDGET, "several completions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_completions_stay_within_the_budget_redis() {
    several_completions_stay_within_the_budget(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_completions_stay_within_the_budget_memory() {
    several_completions_stay_within_the_budget(StoreKind::Memory).await;
}

/// Class 2: no output cap in the body: sluice writes the cap it reserved (each API's field),
/// with a correct length, so the upstream cannot use the model's own maximum.
async fn a_missing_cap_is_written_and_holds(kind: StoreKind) {
    let gw = Gateway::start(kind, tokens(20000, 3000), None).await;
    let mut requests = Vec::new();
    for _ in 0..6 {
        requests.push((
            "/v1/chat/completions",
            chat("gpt-4o-mini", "Go on forever."),
        ));
        requests.push((
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "Go on forever."}),
        ));
        requests.push((
            "/v1/completions",
            json!({"model": "gpt-3.5-turbo-instruct", "prompt": "Go on"}),
        ));
        requests.push((
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Go on."}], "stream": true}),
        ));
    }
    let answers = gw.send_all(requests).await;
    gw.assert_within(&answers, BUDGET, "no cap");
    for body in gw.upstream.bodies() {
        let body: Value = serde_json::from_slice(&body).expect("JSON forwarded");
        let cap = ["max_completion_tokens", "max_output_tokens", "max_tokens"]
            .iter()
            .find_map(|field| body[field].as_u64());
        assert_eq!(
            cap,
            Some(3000),
            "the reserved cap is in the forwarded body: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_cap_is_written_and_holds_redis() {
    a_missing_cap_is_written_and_holds(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_cap_is_written_and_holds_memory() {
    a_missing_cap_is_written_and_holds(StoreKind::Memory).await;
}

/// Class 3: input that is not in the body. Refused, naming the field, when the route does
/// not charge it; within the budget when it does.
async fn input_held_by_the_provider_is_refused_or_charged(kind: StoreKind) {
    let gw = Gateway::start(kind, tokens(20000, 2000), None).await;
    gw.upstream.store("resp_big", 50_000);
    gw.upstream.store("conv_big", 50_000);
    let cases = [
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "More.", "previous_response_id": "resp_big", "max_output_tokens": 100}),
            "previous_response_id",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "More.", "conversation": "conv_big", "max_output_tokens": 100}),
            "conversation",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "prompt": {"id": "pmpt_1"}, "max_output_tokens": 100}),
            "prompt",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "News?", "tools": [{"type": "web_search"}], "max_output_tokens": 100}),
            "web_search",
        ),
        (
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": "News?"}],
                   "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}),
            "web_search_20250305",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-search-preview", "messages": [], "web_search_options": {}, "max_tokens": 100}),
            "web_search_options",
        ),
        (
            "/v1/threads/runs",
            json!({"assistant_id": "asst_1"}),
            "Assistants",
        ),
    ];
    for (path, body, field) in cases {
        let answers = gw.send_all(vec![(path, body)]).await;
        let (status, problem) = &answers[0];
        assert_eq!(*status, 422, "{field}: {problem}");
        assert!(
            problem.contains(field),
            "the detail names `{field}`: {problem}"
        );
    }
    assert!(gw.upstream.bodies().is_empty(), "nothing was forwarded");
    // A route that charges stored state and server tools: a chain of responses and searches
    // stays within its budget.
    let budget = 100_000;
    let reserve = Node::map([
        ("max_output", 2000),
        ("stored_state", 12000),
        ("server_tool", 25000),
    ]);
    let limit = Limit::tokens("budget", 100_000, "1m").set("reserve", reserve);
    let gw = Gateway::start(kind, limit, None).await;
    let first = gw
        .send_all(vec![(
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "Start.", "max_output_tokens": 1000}),
        )])
        .await;
    let id: Value = serde_json::from_str(&first[0].1).expect("a response");
    let mut previous = id["id"].as_str().expect("an id").to_owned();
    for _ in 0..3 {
        let next = gw
            .send_all(vec![(
                "/v1/responses",
                json!({"model": "gpt-4o", "input": "More.", "previous_response_id": previous, "max_output_tokens": 1000}),
            )])
            .await;
        assert_eq!(next[0].0, 200, "{}", next[0].1);
        let answer: Value = serde_json::from_str(&next[0].1).expect("a response");
        previous = answer["id"].as_str().expect("an id").to_owned();
    }
    let searches = (0..6)
        .map(|_| {
            (
                "/v1/messages",
                json!({"model": "claude-sonnet-4-5", "max_tokens": 500, "messages": [{"role": "user", "content": "News?"}],
                       "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            )
        })
        .collect();
    let mut answers = first;
    answers.extend(gw.send_all(searches).await);
    // The chain's requests were sent one at a time: add them to what is checked.
    let served_chain = 3;
    let spent: u64 = gw.upstream.answers().iter().map(|a| a.usage).sum();
    assert!(spent <= budget, "charged: spent {spent} of {budget}");
    assert_eq!(
        gw.upstream.bodies().len(),
        answers.iter().filter(|(s, _)| *s == 200).count() + served_chain
    );
}

/// `stored_state: context` charges the model's context window from `models:`: a chain on a
/// stored response larger than the window stays within the budget.
async fn stored_state_charged_at_the_context_window(kind: StoreKind) {
    let models = Node::Seq(vec![Node::map([
        ("match", Node::from("gpt-4o*")),
        ("per_image", Node::map([("low", 85), ("high", 1445)])),
        ("context", Node::from(128_000)),
    ])]);
    let reserve = Node::map([
        ("max_output", Node::from(2000)),
        ("stored_state", Node::from("context")),
    ]);
    let limit = Limit::tokens("budget", 300_000, "1m").set("reserve", reserve);
    let gw = Gateway::start(kind, limit, Some(models)).await;
    gw.upstream.store("resp_huge", 1_000_000);
    let requests = (0..6)
        .map(|_| {
            (
                "/v1/responses",
                json!({"model": "gpt-4o", "input": "Go on.", "previous_response_id": "resp_huge", "max_output_tokens": 1000}),
            )
        })
        .collect();
    let answers = gw.send_all(requests).await;
    let spent = gw.assert_within(&answers, 300_000, "stored state at the context");
    assert!(spent > 128_000, "two chained requests fit: {spent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_state_charged_at_the_context_window_redis() {
    stored_state_charged_at_the_context_window(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_state_charged_at_the_context_window_memory() {
    stored_state_charged_at_the_context_window(StoreKind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_held_by_the_provider_is_refused_or_charged_redis() {
    input_held_by_the_provider_is_refused_or_charged(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_held_by_the_provider_is_refused_or_charged_memory() {
    input_held_by_the_provider_is_refused_or_charged(StoreKind::Memory).await;
}

/// Class 4: images and tool prompts at what the providers charge, with the defaults for an
/// unknown model and with a `models:` table.
async fn images_and_tool_prompts_are_charged_what_providers_charge(kind: StoreKind) {
    let image = |url: &str, detail: &str| json!({"type": "image_url", "image_url": {"url": url, "detail": detail}});
    let vision = |model: &str, detail: &str, images: usize| {
        let mut content = vec![json!({"type": "text", "text": "What is this?"})];
        content.extend((0..images).map(|i| image(&format!("https://x/{i}.png"), detail)));
        json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 50})
    };
    let tools = json!({"model": "claude-3-opus-20240229", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}],
                       "tools": [{"name": "f", "input_schema": {"type": "object"}}]});
    // No table: an unknown model's image costs what gpt-4o-mini charges at most.
    let gw = Gateway::start(kind, tokens(20000, 2000), None).await;
    let mut requests = Vec::new();
    for _ in 0..4 {
        requests.push(("/v1/chat/completions", vision("gpt-4o-mini", "low", 2)));
        requests.push(("/v1/chat/completions", vision("gpt-4o-mini", "high", 1)));
        requests.push(("/v1/messages", tools.clone()));
    }
    let answers = gw.send_all(requests).await;
    gw.assert_within(&answers, BUDGET, "defaults");
    assert!(
        answers
            .iter()
            .any(|(s, p)| *s == 413 && p.contains("for 1 images")),
        "a high-detail image on gpt-4o-mini can never fit 20,000: {answers:?}"
    );
    // A table listing gpt-4o's figures: many more of its images fit, still within the budget.
    let models = Node::Seq(vec![
        Node::map([
            ("match", Node::from("gpt-4o-2*")),
            ("per_image", Node::map([("low", 85), ("high", 1445)])),
            ("tool_prompt", Node::from(0)),
        ]),
        Node::map([
            ("match", Node::from("claude-3-opus*")),
            ("tool_prompt", Node::from(530)),
        ]),
    ]);
    let gw = Gateway::start(kind, tokens(20000, 2000), Some(models)).await;
    let requests = (0..16)
        .map(|_| {
            (
                "/v1/chat/completions",
                vision("gpt-4o-2024-08-06", "high", 4),
            )
        })
        .chain((0..4).map(|_| ("/v1/messages", tools.clone())))
        .collect();
    let answers = gw.send_all(requests).await;
    let spent = gw.assert_within(&answers, BUDGET, "gpt-4o table");
    assert!(
        spent > BUDGET / 2,
        "the table's figures let the budget be used: {spent}"
    );
    // Only requests with tools: each one's tool prompt is billed on top of its body.
    let gw = Gateway::start(kind, tokens(20000, 2000), None).await;
    let mut many_tools = tools.clone();
    many_tools["max_tokens"] = json!(1000);
    let requests = (0..24)
        .map(|_| ("/v1/messages", many_tools.clone()))
        .collect();
    let answers = gw.send_all(requests).await;
    gw.assert_within(&answers, BUDGET, "tool prompts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_and_tool_prompts_are_charged_what_providers_charge_redis() {
    images_and_tool_prompts_are_charged_what_providers_charge(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_and_tool_prompts_are_charged_what_providers_charge_memory() {
    images_and_tool_prompts_are_charged_what_providers_charge(StoreKind::Memory).await;
}

/// A budget in money: 0.05 USD a minute, priced at each model's prices. What the upstream
/// spent at those prices stays within it; the unit shows in the RateLimit fields; a model
/// without prices is refused (422) before anything is forwarded.
async fn a_money_budget_holds_at_the_models_prices(kind: StoreKind) {
    let gw = Gateway::start(
        kind,
        Limit::money("budget", 0.05, "USD", "1m").reserve_max_output(4000),
        Some(priced_models()),
    )
    .await;
    let answer = client()
        .post(format!("{}/v1/chat/completions", gw.sluices[0].url()))
        .header("x-api-key", "probe")
        .body(chat("gpt-4o-mini", "Hi").to_string())
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status(), 200);
    assert_eq!(
        support::header(&answer, "ratelimit-policy"),
        "\"budget\";q=50000;w=60;qu=\"microUSD\""
    );
    answer.bytes().await.expect("the answer");
    let probe_spent = gw.upstream.answers()[0].micro_usd;
    let mut requests = Vec::new();
    for _ in 0..10 {
        requests.push((
            "/v1/chat/completions",
            chat("gpt-4o-mini", "Write at length."),
        ));
        requests.push((
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "max_tokens": 1000, "messages": [{"role": "user", "content": "Write."}]}),
        ));
    }
    // Two waves: the second finds what the first was settled to, priced.
    let mut answers = gw.send_all(requests.clone()).await;
    answers.extend(gw.send_all(requests).await);
    let served = answers.iter().filter(|(s, _)| *s == 200).count();
    assert!(served > 0, "{answers:?}");
    let spent: f64 = gw
        .upstream
        .answers()
        .iter()
        .map(|a| a.micro_usd)
        .sum::<f64>()
        - probe_spent;
    assert!(
        spent <= 50_000.0,
        "the upstream spent {spent} µUSD in one window; the limit is 50,000"
    );
    let (_, refused) = answers
        .iter()
        .find(|(s, _)| *s == 429)
        .expect("the second wave finds the budget spent");
    let problem: Value = serde_json::from_str(refused).expect("a problem");
    assert_eq!(problem["unit"], "microUSD", "{problem}");
    let metrics = support::parse_metrics(&gw.sluices[0].metrics().await);
    let reserved = support::metric_sum(
        &metrics,
        "sluice_tokens_reserved_total",
        &[("limit", "budget"), ("unit", "microUSD")],
    );
    assert!(
        reserved > 0.0,
        "the metrics count micro-USD under unit=\"microUSD\""
    );
    let before = gw.upstream.bodies().len();
    let unpriced = gw
        .send_all(vec![("/v1/chat/completions", chat("gpt-4o", "Hi"))])
        .await;
    assert_eq!(unpriced[0].0, 422, "{}", unpriced[0].1);
    assert!(unpriced[0].1.contains("gpt-4o"), "{}", unpriced[0].1);
    assert_eq!(gw.upstream.bodies().len(), before);
    eprintln!("money: {served} served, {spent:.0} of 50000 µUSD spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_money_budget_holds_at_the_models_prices_redis() {
    a_money_budget_holds_at_the_models_prices(StoreKind::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_money_budget_holds_at_the_models_prices_memory() {
    a_money_budget_holds_at_the_models_prices(StoreKind::Memory).await;
}
