//! The whole token story at once, measured from the upstream's own record (issue 26's
//! concurrent run): two sluice instances on one Redis, 44 clients, every API the bound knows
//! (Chat Completions as JSON and as events with and without `include_usage`, legacy
//! Completions with several completions, Responses as JSON and as events, Embeddings,
//! Anthropic Messages as JSON and as events), caps named and not, images, tools, and answers
//! that stop at a random share of what they may generate. One route carries a token budget
//! and a money budget, decided together. The fake LLM API charges like the real ones: the
//! tokens and micro-USD it spent for the requests admitted within any window stay within
//! each limit, every refusal is a problem with a precise status, and the run prints the
//! busiest window and the average use of each budget (the README's Measured paragraph).

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::llm_upstream::priced_models;
use support::llm_upstream::FINISH_HEADER;
use support::{client, Limit, LlmUpstream, Policy, Route, Sluice, Store, StoreKind, UpstreamSpec};

const TOKENS: u64 = 20_000;
const MICRO_USD: f64 = 40_000.0;
const WINDOW: Duration = Duration::from_secs(5);
const CLIENTS: u64 = 44;
const RUN: Duration = Duration::from_secs(12);

/// The `n`th request of client `c`: an API, a path and a body, chosen by a fixed mix so the
/// run is the same every time.
fn request(c: u64, n: u64) -> (&'static str, Value) {
    let pick = (c * 31 + n * 17) % 10;
    let cap = 100 + (c * 7919 + n * 104_729) % 1400;
    let text = "Tell me about rivers. ".repeat(1 + ((c + n) % 20) as usize);
    match pick {
        0 => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], "max_tokens": cap}),
        ),
        1 => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "stream": true, "stream_options": {"include_usage": true},
                   "messages": [{"role": "user", "content": text}], "max_completion_tokens": cap, "n": 2}),
        ),
        // No usage in the stream: the reservation is kept.
        2 => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "stream": true, "messages": [{"role": "user", "content": text}], "max_tokens": cap / 4}),
        ),
        // No cap: sluice writes the route's.
        3 => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]}]}),
        ),
        4 => (
            "/v1/completions",
            json!({"model": "gpt-4o-mini", "prompt": [text.clone(), "and lakes"], "max_tokens": cap / 4, "n": 2}),
        ),
        5 => (
            "/v1/responses",
            json!({"model": "gpt-4o-mini", "input": text, "max_output_tokens": cap}),
        ),
        6 => (
            "/v1/responses",
            json!({"model": "gpt-4o-mini", "stream": true, "input": [{"role": "user", "content": text}]}),
        ),
        7 => (
            "/v1/embeddings",
            json!({"model": "gpt-4o-mini", "input": text}),
        ),
        8 => (
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "max_tokens": cap / 2, "messages": [{"role": "user", "content": text}],
                   "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]}),
        ),
        _ => (
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "max_tokens": cap / 2, "stream": true,
                   "messages": [{"role": "user", "content": text}]}),
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_at_once_stays_within_tokens_and_money() {
    let _heavy = support::heavy().await;
    let upstream = LlmUpstream::start().await;
    let store = Store::start(StoreKind::Redis).await;
    let policy = Policy::new()
        .store(&store)
        .set("models", priced_models())
        .upstream("llm", UpstreamSpec::new(&upstream.url()).timeout("10s"))
        .route(
            Route::new("llm", "/v1/")
                .upstream("llm")
                .limit(
                    Limit::tokens("tpm", TOKENS as u32, "5s")
                        .key(["header:x-api-key"])
                        .reserve_max_output(3000),
                )
                .limit(
                    Limit::money("spend", MICRO_USD / 1e6, "USD", "5s")
                        .key(["header:x-api-key"])
                        .reserve_max_output(3000),
                ),
        );
    let sluices = [Sluice::start(&policy).await, Sluice::start(&policy).await];
    let urls: Vec<String> = sluices.iter().map(Sluice::url).collect();
    let c = client();
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let c = c.clone();
            let base = urls[id as usize % urls.len()].clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut n = 0;
                while started.elapsed() < RUN && n < 500 {
                    n += 1;
                    let (path, body) = request(id, n);
                    let finish = 5 + (id * 13 + n * 29) % 96;
                    let answer = c
                        .post(format!("{base}{path}"))
                        .header("x-api-key", "team")
                        .header("content-type", "application/json")
                        .header(FINISH_HEADER, finish.to_string())
                        .body(body.to_string())
                        .send()
                        .await
                        .expect("an answer");
                    let status = answer.status().as_u16();
                    let problem =
                        support::header(&answer, "content-type") == "application/problem+json";
                    let text = answer.text().await.expect("the whole answer");
                    assert!(
                        status == 200 || (problem && matches!(status, 413 | 422 | 429)),
                        "{path}: status {status}: {text}"
                    );
                    statuses.push(status);
                    if status == 429 {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                statuses
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.extend(task.await.expect("a client"));
    }
    let elapsed = started.elapsed();
    let served = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    let other = statuses.len() - served - limited;
    let answers = upstream.answers();
    assert_eq!(
        answers.len(),
        served,
        "the upstream answered exactly the requests served"
    );
    // A request reaches the upstream after its admission, within `margin` on a loaded
    // machine: the requests arriving within WINDOW - margin were admitted within one window.
    let margin = Duration::from_millis(500);
    let (tokens, money) = upstream.busiest(WINDOW - margin);
    assert!(
        tokens <= TOKENS,
        "the upstream spent {tokens} tokens within {:?}; the limit is {TOKENS}",
        WINDOW - margin
    );
    assert!(
        money <= MICRO_USD,
        "the upstream spent {money:.0} µUSD within {:?}; the limit is {MICRO_USD}",
        WINDOW - margin
    );
    // The average use: the spend within a window, averaged over windows starting every
    // 250 ms from the first request to the last whole window of the run.
    let (mut windows, mut token_use, mut money_use) = (0.0, 0.0, 0.0);
    let mut from = started;
    while from + WINDOW <= started + elapsed {
        let within = answers
            .iter()
            .filter(|a| a.at >= from && a.at < from + WINDOW);
        token_use += within.clone().map(|a| a.usage).sum::<u64>() as f64 / TOKENS as f64;
        money_use += within.map(|a| a.micro_usd).sum::<f64>() / MICRO_USD;
        windows += 1.0;
        from += Duration::from_millis(250);
    }
    token_use /= windows;
    money_use /= windows;
    // Settlement gives back what answers did not use: the budgets are well used, not only
    // safe. (Reservations alone, never settled, would leave most of each window idle.)
    assert!(
        token_use.max(money_use) > 0.4,
        "average use: {:.0} % of the tokens, {:.0} % of the money",
        token_use * 100.0,
        money_use * 100.0
    );
    eprintln!(
        "mixed run: {} requests from {CLIENTS} clients over {elapsed:.1?}: {served} served, \
         {limited} refused with 429, {other} with 413/422; busiest {:?}: {tokens} of {TOKENS} \
         tokens, {money:.0} of {MICRO_USD} µUSD; average use {:.0} % of the tokens, {:.0} % \
         of the money",
        statuses.len(),
        WINDOW - margin,
        token_use * 100.0,
        money_use * 100.0
    );
}
