//! The official OpenAI and Anthropic Python SDKs (installed by `scripts/test-tools.sh`) against
//! sluice's refusals, as an application would call them: each waits as sluice tells it
//! (`retry-after-ms`), and stops waiting where it should (`x-should-retry: false` when the
//! wait is longer than `should_retry_within`, 120 s by default), showing sluice's words.
//! Counted at sluice: how many attempts each SDK made.

use crate::support;

use serde_json::Value;
use support::llm_upstream::LlmUpstream;
use support::{Limit, Policy, Route, Sluice, UpstreamSpec};

/// Calls the API once through `sdk` (`openai` or `anthropic`) asking for at most `cap` output
/// tokens, with at most two retries, as an application would; what happened, as JSON: `ok`, `elapsed` (s), `message` on an error.
const CALL: &str = r#"
import json, os, sys, time
sdk, base, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.monotonic()
try:
    if sdk == "openai":
        import openai
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=2,
                               default_headers={"x-api-key": "customer"})
        client.chat.completions.create(model="gpt-4o-mini", max_tokens=cap,
                                       messages=[{"role": "user", "content": "hi"}])
        error = None
    else:
        import anthropic
        client = anthropic.Anthropic(base_url=base, api_key="customer", max_retries=2)
        client.messages.create(model="claude-sonnet-4-5", max_tokens=cap,
                               messages=[{"role": "user", "content": "hi"}])
        error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"ok": error is None, "elapsed": time.monotonic() - start, "message": error}))
"#;

async fn call(sdk: &str, sluice: &Sluice, max_tokens: u32) -> Value {
    // An SDK that sleeps for what a day quota says would sleep for hours: bounded at 30 s
    // (coreutils' `timeout` exits 124).
    let mut command = std::process::Command::new("timeout");
    command
        .arg("30")
        .arg(support::envoy::tool("python3"))
        .arg("-c")
        .arg(CALL)
        .arg(sdk)
        .arg(sluice.url())
        .arg(max_tokens.to_string());
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the runner")
        .expect("run python");
    assert!(
        out.status.success(),
        "the {sdk} SDK's call failed ({}; 124: still waiting after 30 s):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script's JSON")
}

async fn refusals(sluice: &Sluice) -> f64 {
    let metrics = support::parse_metrics(&sluice.metrics().await);
    support::metric_sum(&metrics, "sluice_requests_total", &[("outcome", "limited")])
}

async fn gateway(up: &LlmUpstream, limit: Limit) -> Sluice {
    let policy = Policy::new()
        .set("models", support::llm_upstream::priced_models())
        .upstream("llm", UpstreamSpec::new(&up.url()).timeout("10s"))
        .route(
            Route::new("llm", "/v1/")
                .upstream("llm")
                .limit(limit.key(["header:x-api-key"])),
        );
    Sluice::start(&policy).await
}

/// A day's token budget of 5,000 mostly spent by a call of 4,000 output tokens (the fake
/// upstream spends the whole cap): the next such call's wait is hours. Both SDKs raise at once with
/// sluice's explanation after one attempt, instead of retrying (OpenAI) or sleeping for
/// hours (Anthropic sleeps whatever `Retry-After` says). Seeded (`x-should-retry: true`):
/// Anthropic's SDK is still asleep at the 30 s bound (OpenAI's 3.57 gives up on its own past
/// a 120 s `Retry-After`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_day_budget_is_not_waited_for() {
    for sdk in ["openai", "anthropic"] {
        let up = LlmUpstream::start().await;
        let sluice = gateway(&up, Limit::tokens_quota("daily", 5000, "day")).await;
        let first = call(sdk, &sluice, 4000).await;
        assert_eq!(first["ok"], true, "{sdk}: {first}");
        let refused = call(sdk, &sluice, 4000).await;
        assert_eq!(refused["ok"], false, "{sdk}: {refused}");
        let message = refused["message"].as_str().unwrap_or_default();
        assert!(message.contains("RateLimitError"), "{sdk}: {message}");
        assert!(
            message.contains("quota `daily`"),
            "{sdk}: sluice's words shown: {message}"
        );
        assert!(
            refused["elapsed"].as_f64().unwrap_or(99.0) < 5.0,
            "{sdk}: {refused}"
        );
        assert_eq!(refusals(&sluice).await, 1.0, "{sdk}: one attempt, no retry");
    }
}

/// A short wait (one call per 10 s): each SDK sleeps what `retry-after-ms` says, retries once
/// and succeeds. (Each call starts a Python process whose SDK import can take seconds on a
/// busy machine: with a window of 2 s the second call once arrived after the window.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_wait_is_waited_for_and_retried_once() {
    for sdk in ["openai", "anthropic"] {
        let up = LlmUpstream::start().await;
        let sluice = gateway(&up, Limit::requests("per-10s", 1, "10s")).await;
        assert_eq!(call(sdk, &sluice, 100).await["ok"], true, "{sdk}");
        let second = call(sdk, &sluice, 100).await;
        assert_eq!(second["ok"], true, "{sdk}: {second}");
        let elapsed = second["elapsed"].as_f64().unwrap_or_default();
        assert!((1.0..16.0).contains(&elapsed), "{sdk}: waited {elapsed} s");
        assert_eq!(
            refusals(&sluice).await,
            1.0,
            "{sdk}: one refusal, then success"
        );
    }
}

/// What the answers on a token route carry for clients that parse them: OpenAI's
/// `x-ratelimit-*-tokens` and `-requests` fields on an admitted answer; on a refusal,
/// `retry-after-ms` agreeing with `Retry-After`, `x-should-retry: true` for a short wait, and
/// the explanation in a top-level `message` equal to `detail`. A spent day quota of tokens
/// says its unit and is not worth waiting for (`x-should-retry: false`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_answers_carry_what_clients_read() {
    let up = LlmUpstream::start().await;
    let policy = Policy::new()
        .set("models", support::llm_upstream::priced_models())
        .upstream("llm", UpstreamSpec::new(&up.url()).timeout("10s"))
        .route(
            Route::new("llm", "/v1/")
                .upstream("llm")
                .limit(Limit::tokens("tokens", 5000, "1m").key(["header:x-api-key"]))
                .limit(Limit::requests("requests", 2, "1m").key(["header:x-api-key"])),
        )
        .route(
            Route::new("daily", "/daily/")
                .upstream("llm")
                .limit(Limit::tokens_quota("day", 5000, "day").key(["header:x-api-key"])),
        );
    let sluice = Sluice::start(&policy).await;
    let client = support::client();
    let send = |path: &str, max_tokens: u64| {
        client
            .post(format!("{}{path}", sluice.url()))
            .header("x-api-key", "k")
            .header("content-type", "application/json")
            .body(
                serde_json::json!({
                    "model": "gpt-4o-mini",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": max_tokens,
                })
                .to_string(),
            )
            .send()
    };
    let ok = send("/v1/chat/completions", 100).await.expect("an answer");
    assert_eq!(ok.status(), 200);
    let header = |response: &reqwest::Response, name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    assert_eq!(
        header(&ok, "x-ratelimit-limit-tokens").as_deref(),
        Some("5000")
    );
    let left: u32 = header(&ok, "x-ratelimit-remaining-tokens")
        .unwrap_or_default()
        .parse()
        .expect("a number");
    assert!((4000..5000).contains(&left), "{left}");
    assert!(header(&ok, "x-ratelimit-reset-tokens").is_some_and(|t| t.ends_with('s')));
    assert_eq!(
        header(&ok, "x-ratelimit-limit-requests").as_deref(),
        Some("2")
    );
    assert_eq!(
        header(&ok, "x-ratelimit-remaining-requests").as_deref(),
        Some("1")
    );
    assert_eq!(
        send("/v1/chat/completions", 100)
            .await
            .expect("an answer")
            .status(),
        200
    );

    let refused = send("/v1/chat/completions", 100).await.expect("an answer");
    assert_eq!(refused.status(), 429);
    let seconds: u64 = header(&refused, "retry-after")
        .unwrap_or_default()
        .parse()
        .expect("seconds");
    let ms: u64 = header(&refused, "retry-after-ms")
        .unwrap_or_default()
        .parse()
        .expect("ms");
    assert_eq!(ms.div_ceil(1000), seconds, "{ms} ms and {seconds} s");
    assert_eq!(header(&refused, "x-should-retry").as_deref(), Some("true"));
    let body: Value = refused.json().await.expect("problem+json");
    assert_eq!(body["message"], body["detail"], "{body}");

    // Spent within a few calls (the day's 5,000 tokens, 4,000 asked each time).
    let mut spent = None;
    for _ in 0..4 {
        let answer = send("/daily/chat/completions", 4000)
            .await
            .expect("an answer");
        if answer.status() == 429 {
            spent = Some(answer);
            break;
        }
        assert_eq!(answer.status(), 200);
    }
    let spent = spent.expect("the day's budget refuses within four calls");
    assert_eq!(
        header(&spent, "x-should-retry").as_deref(),
        Some("false"),
        "hours away"
    );
    let body: Value = spent.json().await.expect("problem+json");
    assert_eq!(body["unit"], "tokens", "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("5000 tokens per day"),
        "{body}"
    );
}

/// The upstream's own `429` (the provider's rate limit) gives the reservation back at once:
/// providers do not bill a refused request. A budget of 5,000 a minute, a request reserving
/// about 4,000 refused by the upstream, then another such request: admitted. Seeded: a 429
/// kept like any answer without a figure refuses the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_429_gives_the_reservation_back() {
    let up = LlmUpstream::start().await;
    let sluice = gateway(&up, Limit::tokens("minute", 5000, "1m")).await;
    let client = support::client();
    let send = |sim: Value| {
        client
            .post(format!("{}/v1/chat/completions", sluice.url()))
            .header("x-api-key", "k")
            .header("content-type", "application/json")
            .body(support::llm_upstream::chat_body(4000, sim))
            .send()
    };
    let refused = send(serde_json::json!({ "status": 429, "mode": "none" }))
        .await
        .expect("an answer");
    assert_eq!(refused.status(), 429, "the upstream's own refusal");
    assert!(
        refused.headers().get("x-should-retry").is_none(),
        "the upstream's answer"
    );
    let next = send(serde_json::json!({ "usage": 4000 }))
        .await
        .expect("an answer");
    assert_eq!(
        next.status(),
        200,
        "the refused request's reservation was given back"
    );
}
