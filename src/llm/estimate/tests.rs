//! The bound for each API: every term of the rule at the top of `estimate.rs`, and property
//! tests that it covers what a provider may bill for any text, count and cap.

use super::*;
use crate::llm::models::{ModelFacts, Models};
use proptest::prelude::*;
use serde_json::json;

const RESERVE: Reserve = Reserve {
    default_output: None,
    max_output: 8192,
    per_non_text_part: None,
    per_request: 0,
    max_body: 1 << 20,
    stored_state: None,
    server_tool: None,
};

fn run(api: Api, body: &Value, reserve: &Reserve) -> Result<Reservation, EstimateError> {
    let bytes = serde_json::to_vec(body).unwrap();
    let fields = parse(&bytes)?;
    estimate(
        api,
        &fields,
        bytes.len() as u64,
        reserve,
        &Models::default(),
    )
}

fn len(body: &Value) -> u64 {
    serde_json::to_vec(body).unwrap().len() as u64
}

#[test]
fn the_api_is_read_from_the_path() {
    assert_eq!(Api::of_path("/v1/chat/completions"), Api::ChatCompletions);
    assert_eq!(
        Api::of_path("/openai/deployments/d/chat/completions"),
        Api::ChatCompletions
    );
    assert_eq!(Api::of_path("/v1/completions/"), Api::Completions);
    assert_eq!(Api::of_path("/v1/responses"), Api::Responses);
    assert_eq!(Api::of_path("/v1/embeddings"), Api::Embeddings);
    assert_eq!(Api::of_path("/v1/messages"), Api::AnthropicMessages);
    assert_eq!(Api::of_path("/v1/threads/t/runs"), Api::Unbounded);
    assert_eq!(Api::of_path("/v1/messages/batches"), Api::Unbounded);
    assert_eq!(Api::of_path("/v1/batches"), Api::Unbounded);
    assert_eq!(Api::of_path("/v1/other"), Api::Other);
}

#[test]
fn the_bound_is_bytes_plus_the_output_cap() {
    let body = json!({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100});
    let r = run(Api::ChatCompletions, &body, &RESERVE).unwrap();
    assert_eq!(r.prompt, len(&body));
    assert_eq!((r.cap, r.completions, r.output), (100, 1, 100));
    assert_eq!(r.total, len(&body) + 100);
    assert_eq!(r.write_cap, None);
}

#[test]
fn completions_multiply_the_cap_for_each_api() {
    let chat = json!({"messages":[],"max_completion_tokens":100,"n":16});
    assert_eq!(
        run(Api::ChatCompletions, &chat, &RESERVE).unwrap().output,
        1600
    );
    let legacy = json!({"prompt":"x","max_tokens":100,"n":2,"best_of":5});
    assert_eq!(
        run(Api::Completions, &legacy, &RESERVE).unwrap().output,
        500
    );
    let prompts = json!({"prompt":["a","b","c"],"max_tokens":100,"n":2});
    assert_eq!(
        run(Api::Completions, &prompts, &RESERVE).unwrap().output,
        600
    );
    let token_prompts = json!({"prompt":[[1,2],[3]],"max_tokens":100});
    assert_eq!(
        run(Api::Completions, &token_prompts, &RESERVE)
            .unwrap()
            .output,
        200
    );
    let one_token_prompt = json!({"prompt":[1,2,3],"max_tokens":100});
    assert_eq!(
        run(Api::Completions, &one_token_prompt, &RESERVE)
            .unwrap()
            .output,
        100
    );
    // `n` means nothing to Responses or Anthropic: they generate one.
    let responses = json!({"input":"x","max_output_tokens":100,"n":5});
    assert_eq!(
        run(Api::Responses, &responses, &RESERVE).unwrap().output,
        100
    );
    for bad in [
        json!({"n":0,"max_tokens":1}),
        json!({"n":"2","max_tokens":1}),
    ] {
        assert_eq!(
            run(Api::ChatCompletions, &bad, &RESERVE),
            Err(EstimateError::BadCount { field: "n" })
        );
    }
    // Embeddings generate nothing.
    let embed = json!({"input":["a","b"],"model":"e"});
    let r = run(Api::Embeddings, &embed, &RESERVE).unwrap();
    assert_eq!((r.output, r.total, r.write_cap), (0, len(&embed), None));
}

#[test]
fn without_a_cap_the_cap_to_write_is_named_for_each_api() {
    let reserve = Reserve {
        default_output: Some(300),
        ..RESERVE
    };
    for (api, field) in [
        (Api::ChatCompletions, "max_completion_tokens"),
        (Api::Completions, "max_tokens"),
        (Api::Responses, "max_output_tokens"),
        (Api::AnthropicMessages, "max_tokens"),
    ] {
        let r = run(api, &json!({"model":"m","n":2}), &reserve).unwrap();
        assert_eq!(r.write_cap, Some(field), "{api:?}");
        assert_eq!(r.cap, 300);
    }
    // No default: the model's own maximum, within the route's max_output.
    let r = run(Api::Responses, &json!({"input":"x"}), &RESERVE).unwrap();
    assert_eq!(r.cap, 8192);
    let models = Models::new(vec![(
        "small".into(),
        ModelFacts {
            max_output: 1000,
            ..ModelFacts::UNKNOWN
        },
    )]);
    let body = br#"{"model":"small","input":"x"}"#;
    let r = estimate(Api::Responses, &parse(body).unwrap(), 30, &RESERVE, &models).unwrap();
    assert_eq!(r.cap, 1000);
    assert_eq!(
        run(Api::Other, &json!({"x":1}), &RESERVE),
        Err(EstimateError::NoCap)
    );
    // The written body names the cap and keeps everything else.
    let fields = parse(br#"{"model":"m","input":"x","max_output_tokens":null}"#).unwrap();
    let written: Value =
        serde_json::from_slice(&with_cap(fields, "max_output_tokens", 77)).unwrap();
    assert_eq!(
        written,
        json!({"model":"m","input":"x","max_output_tokens":77})
    );
}

#[test]
fn a_cap_above_the_maximum_or_not_a_count_is_refused() {
    let err = run(Api::ChatCompletions, &json!({"max_tokens":9000}), &RESERVE).unwrap_err();
    assert_eq!(
        err,
        EstimateError::CapTooLarge {
            field: "max_tokens",
            asked: 9000,
            max: 8192
        }
    );
    assert_eq!(err.status(), 413);
    for bad in [
        json!({"max_tokens":-1}),
        json!({"max_tokens":"5"}),
        json!({"max_tokens":1.5}),
    ] {
        assert_eq!(
            run(Api::ChatCompletions, &bad, &RESERVE),
            Err(EstimateError::BadCap {
                field: "max_tokens"
            })
        );
    }
    assert!(matches!(parse(b"{"), Err(EstimateError::NotJson(_))));
    assert_eq!(parse(b"[1]"), Err(EstimateError::NotObject));
}

#[test]
fn images_are_charged_by_detail_and_other_parts_by_the_larger_figure() {
    let openai = json!({"max_tokens":1,"messages":[{"role":"user","content":[
        {"type":"text","text":"what is this"},
        {"type":"image_url","image_url":{"url":"https://x/a.png","detail":"low"}},
        {"type":"image_url","image_url":{"url":"https://x/b.png"}},
        {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},
        {"type":"file","file":{"file_id":"f1"}}]}]});
    let r = run(Api::ChatCompletions, &openai, &RESERVE).unwrap();
    assert_eq!((r.images, r.parts), (2, 2));
    assert_eq!(r.image_tokens, 2_833 + 48_169);
    assert_eq!(r.part_tokens, 2 * 5_200_000);
    assert_eq!(r.total, len(&openai) + 2_833 + 48_169 + 2 * 5_200_000 + 1);
    let anthropic = json!({"max_tokens":5,"messages":[{"role":"user","content":[
        {"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBO"}},
        {"type":"document","source":{"type":"url","url":"https://x/a.pdf"}}]}]});
    let r = run(Api::AnthropicMessages, &anthropic, &RESERVE).unwrap();
    assert_eq!((r.images, r.parts), (1, 1));
    let responses = json!({"model":"m","max_output_tokens":1,"input":[{"role":"user","content":[
        {"type":"input_image","image_url":"data:...","detail":"low"},
        {"type":"input_file","file_id":"f"}]}]});
    let small = Models::new(vec![(
        "*".into(),
        ModelFacts {
            per_non_text_part: 100,
            ..ModelFacts::UNKNOWN
        },
    )]);
    let bytes = serde_json::to_vec(&responses).unwrap();
    let route = Reserve {
        per_non_text_part: Some(1600),
        ..RESERVE
    };
    let r = estimate(Api::Responses, &parse(&bytes).unwrap(), 1, &route, &small).unwrap();
    assert_eq!((r.image_tokens, r.part_tokens), (2_833, 1600));
}

#[test]
fn the_tool_prompt_and_per_request_are_added_once() {
    let reserve = Reserve {
        per_request: 400,
        ..RESERVE
    };
    let body = json!({"max_tokens":1,"tools":[{"name":"f","input_schema":{}},{"type":"function","function":{"name":"g"}}]});
    let r = run(Api::AnthropicMessages, &body, &reserve).unwrap();
    assert_eq!(r.overhead, 400 + 530);
    assert_eq!(r.total, len(&body) + 400 + 530 + 1);
    let none = json!({"max_tokens":1,"tools":[]});
    assert_eq!(
        run(Api::AnthropicMessages, &none, &reserve)
            .unwrap()
            .overhead,
        400
    );
}

#[test]
fn stored_state_is_refused_unless_the_route_charges_it() {
    for (body, field) in [
        (
            json!({"input":"x","previous_response_id":"resp_1"}),
            "previous_response_id",
        ),
        (json!({"input":"x","conversation":"conv_1"}), "conversation"),
        (json!({"prompt":{"id":"pmpt_1"}}), "prompt"),
        (
            json!({"input":[{"type":"item_reference","id":"msg_1"}]}),
            "input",
        ),
    ] {
        let err = run(Api::Responses, &body, &RESERVE).unwrap_err();
        assert_eq!(err, EstimateError::StoredState { field }, "{body}");
        assert_eq!(err.status(), 422);
        assert!(err.to_string().contains(field));
        let context = Reserve {
            stored_state: Some(StoredState::Context),
            ..RESERVE
        };
        assert_eq!(
            run(Api::Responses, &body, &context).unwrap().stored,
            2_097_152
        );
        let figure = Reserve {
            stored_state: Some(StoredState::Tokens(50_000)),
            ..RESERVE
        };
        let r = run(Api::Responses, &body, &figure).unwrap();
        assert_eq!(r.total, len(&body) + 50_000 + 8192);
    }
    // A legacy prompt (text) is not stored state; a null reference is none.
    let fine = json!({"prompt":"hi","previous_response_id":null,"max_tokens":1});
    assert_eq!(run(Api::Completions, &fine, &RESERVE).unwrap().stored, 0);
}

#[test]
fn server_tools_are_refused_unless_the_route_charges_each() {
    for (api, body, kind) in [
        (
            Api::Responses,
            json!({"tools":[{"type":"web_search"}]}),
            "web_search",
        ),
        (
            Api::Responses,
            json!({"tools":[{"type":"file_search","vector_store_ids":["v"]}]}),
            "file_search",
        ),
        (
            Api::Responses,
            json!({"tools":[{"type":"mcp","server_url":"u"}]}),
            "mcp",
        ),
        (
            Api::Responses,
            json!({"tools":[{"type":"code_interpreter"}]}),
            "code_interpreter",
        ),
        (
            Api::Responses,
            json!({"tools":[{"type":"image_generation"}]}),
            "image_generation",
        ),
        (
            Api::AnthropicMessages,
            json!({"tools":[{"type":"web_search_20250305","name":"web_search"}]}),
            "web_search_20250305",
        ),
        (
            Api::AnthropicMessages,
            json!({"tools":[{"type":"web_fetch_20250910","name":"web_fetch"}]}),
            "web_fetch_20250910",
        ),
        (
            Api::AnthropicMessages,
            json!({"tools":[{"type":"code_execution_20250825","name":"c"}]}),
            "code_execution_20250825",
        ),
        (
            Api::ChatCompletions,
            json!({"web_search_options":{}}),
            "web_search",
        ),
        (
            Api::AnthropicMessages,
            json!({"mcp_servers":[{"type":"url","url":"u"}]}),
            "mcp",
        ),
    ] {
        let mut body = body;
        body["max_tokens"] = json!(10);
        let err = run(api, &body, &RESERVE).unwrap_err();
        assert!(
            matches!(&err, EstimateError::ServerTool { kind: k, .. } if k == kind),
            "{body}: {err:?}"
        );
        assert_eq!(err.status(), 422);
        let charged = Reserve {
            server_tool: Some(20_000),
            ..RESERVE
        };
        let r = run(api, &body, &charged).unwrap();
        assert_eq!(
            (r.server_tools, r.server_tool_tokens),
            (1, 20_000),
            "{body}"
        );
    }
    assert_eq!(
        run(Api::Unbounded, &json!({}), &RESERVE),
        Err(EstimateError::UnboundedEndpoint)
    );
}

#[test]
fn a_price_is_the_bound_at_the_model_prices_rounded_up() {
    let prices = Prices {
        currency: "USD".into(),
        input: 150_000,
        cached_input: 75_000,
        cache_write: 300_000,
        output: 600_000,
    };
    let r = Reservation {
        input: 1_000,
        output: 3,
        ..Reservation::default()
    };
    // 1000 × 0.15 µ + 3 × 0.6 µ = 150 + 1.8 → 152.
    assert_eq!(r.price(&prices, false), 152);
    // Asking for caching: the input at the cache-write price, 300 + 1.8 → 302.
    assert_eq!(r.price(&prices, true), 302);
}

/// What a provider bills at most for a request, counted from its parts the way the fake
/// upstream of the integration tests does: each text byte a token, each completion its cap.
fn billed_at_most(text: &str, images: u64, cap: u64, completions: u64) -> u64 {
    text.len() as u64 + images * u64::from(ModelFacts::UNKNOWN.image_high) + cap * completions
}

proptest! {
    // Chat Completions: the bound covers every text byte, every image and `n` caps.
    #[test]
    fn chat_bound_covers_what_is_billed(text in ".{0,200}", cap in 0u64..8192, images in 0u64..4, n in 1u64..20) {
        let mut content = vec![json!({"type":"text","text": text})];
        content.extend((0..images).map(|_| json!({"type":"image_url","image_url":{"url":"u"}})));
        let body = json!({"messages":[{"role":"user","content":content}],"max_completion_tokens":cap,"n":n});
        let r = run(Api::ChatCompletions, &body, &RESERVE).unwrap();
        prop_assert!(r.total >= billed_at_most(&text, images, cap, n));
    }

    // Legacy Completions: every prompt of an array, times max(n, best_of).
    #[test]
    fn completions_bound_covers_what_is_billed(prompts in proptest::collection::vec(".{0,40}", 1..10), cap in 0u64..4000, n in 1u64..4, extra in 0u64..4) {
        let best_of = n + extra;
        let body = json!({"prompt":prompts,"max_tokens":cap,"n":n,"best_of":best_of});
        let r = run(Api::Completions, &body, &RESERVE).unwrap();
        let text: String = prompts.concat();
        prop_assert!(r.total >= billed_at_most(&text, 0, cap, best_of * prompts.len() as u64));
    }

    // Responses and Anthropic: no cap named means the written cap is reserved.
    #[test]
    fn responses_and_messages_bound_covers_the_written_cap(text in ".{0,200}", default in 1u32..8192) {
        let reserve = Reserve { default_output: Some(default), ..RESERVE };
        for (api, body) in [
            (Api::Responses, json!({"input": text})),
            (Api::AnthropicMessages, json!({"messages":[{"role":"user","content":text}],"tools":[{"name":"t","input_schema":{}}]})),
        ] {
            let r = run(api, &body, &reserve).unwrap();
            prop_assert_eq!(r.cap, u64::from(default));
            prop_assert!(r.write_cap.is_some());
            let tool_prompt = if api == Api::AnthropicMessages { 530 } else { 0 };
            prop_assert!(r.total >= billed_at_most(&text, 0, u64::from(default), 1) + tool_prompt);
        }
    }

    // Embeddings: the input bytes, nothing generated.
    #[test]
    fn embeddings_bound_covers_every_input(inputs in proptest::collection::vec(".{0,40}", 1..10)) {
        let body = json!({"input":inputs,"model":"e"});
        let r = run(Api::Embeddings, &body, &RESERVE).unwrap();
        prop_assert!(r.total >= inputs.concat().len() as u64);
        prop_assert_eq!(r.output, 0);
    }
}

/// `key` spelled with each character whose bit is set in `mask` written as a `\uXXXX` escape:
/// the same key to every JSON reader.
fn spelled(key: &str, mask: u32) -> String {
    key.chars()
        .enumerate()
        .map(|(i, c)| {
            if mask & (1 << (i % 32)) != 0 {
                format!("\\u{:04x}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// An Anthropic Messages body whose keys are spelled by `masks` (one per key, in order).
fn messages_body(masks: &[u32; 9]) -> String {
    let k = |i: usize, key: &str| spelled(key, masks[i]);
    format!(
        r#"{{"{}":"claude-x","{}":300,"{}":[{{"{}":"user","{}":[{{"{}":"text","{}":"hello","{}":{{"{}":"ephemeral"}}}}]}}]}}"#,
        k(0, "model"),
        k(1, "max_tokens"),
        k(2, "messages"),
        k(3, "role"),
        k(4, "content"),
        k(5, "type"),
        k(6, "text"),
        k(7, "cache_control"),
        k(8, "type"),
    )
}

proptest! {
    /// Every JSON spelling of every key the estimator reads gives the same reservation (but
    /// for the terms bounded by the body's length, which a longer spelling raises) and the
    /// same answer to whether the body asks for caching: the estimator reads keys decoded, as
    /// the provider does.
    #[test]
    fn every_spelling_of_a_key_reserves_the_same(masks in proptest::array::uniform9(any::<u32>())) {
        let plain = messages_body(&[0; 9]);
        let spelt = messages_body(&masks);
        let reserve = |body: &str| {
            let fields = parse(body.as_bytes()).expect("valid JSON");
            let r = estimate(Api::AnthropicMessages, &fields, 0, &RESERVE, &Models::default())
                .expect("reservable");
            (model_of(&fields).map(str::to_owned), asks_caching(&fields), r)
        };
        let (model, caches, a) = reserve(&plain);
        let (model2, caches2, b) = reserve(&spelt);
        prop_assert_eq!(model, model2);
        prop_assert!(caches && caches2, "both ask for caching: {}", spelt);
        prop_assert_eq!((a.cap, a.completions, a.images, a.parts, a.overhead), (b.cap, b.completions, b.images, b.parts, b.overhead));
        prop_assert_eq!(a.total, b.total, "{}", spelt);
    }
}

#[test]
fn a_key_named_twice_in_one_object_is_refused() {
    for body in [
        r#"{"model":"cheap","model":"dear","max_tokens":10}"#,
        r#"{"model":"a","max_tokens":10,"max_tokens":100000}"#,
        r#"{"model":"a","messages":[{"role":"user","content":"x","content":"y"}]}"#,
        r#"{"model":"a","mo\u0064el":"b"}"#,
    ] {
        assert!(
            matches!(parse(body.as_bytes()), Err(EstimateError::RepeatedKey(_))),
            "{body}"
        );
    }
    assert_eq!(
        parse(br#"{"model":"a","max_tokens":10,"max_tokens":1}"#)
            .unwrap_err()
            .to_string(),
        "the request body names `max_tokens` more than once in one object, which JSON readers \
         read differently (the first or the last): it has no single reading to reserve for"
    );
    assert_eq!(
        EstimateError::RepeatedKey("model".into()).status(),
        http::StatusCode::BAD_REQUEST
    );
}
