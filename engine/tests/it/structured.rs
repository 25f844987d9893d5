//! Structured outputs (`response_format`, vLLM's `guided_*`): what comes back matches
//! what was asked for, sampled at temperature 1 from a model with random weights
//! (which, unconstrained, emits arbitrary tokens), streamed or whole; what cannot
//! compile is refused naming its field.

use serde_json::{Value, json};

use preheat_testkit::model_fixture as fixture;

use super::server::Server;

fn chat(extra: Value, seed: u64) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Answer."}],
        "max_tokens": 64, "temperature": 1.0, "seed": seed});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn content(r: &Value) -> &str {
    r["choices"][0]["message"]["content"].as_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guided_outputs_match_their_choice_regex_and_schema() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    let choices = ["yes", "no", "maybe later"];
    let schema = json!({"type": "object", "properties": {
            "answer": {"type": "string", "enum": ["yes", "no"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "n"], "additionalProperties": false});
    let mut seen = std::collections::HashSet::new();
    for seed in 0..10 {
        let (st, r) = s
            .post(
                "/v1/chat/completions",
                chat(json!({"guided_choice": choices}), seed),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        assert!(choices.contains(&content(&r)), "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        seen.insert(content(&r).to_owned());

        let (_, r) = s
            .post(
                "/v1/chat/completions",
                chat(json!({"guided_regex": "[0-9]{1,3}-[a-c]{2}"}), seed),
            )
            .await;
        let t = content(&r);
        let (num, letters) = t.split_once('-').unwrap_or_else(|| panic!("{r}"));
        assert!(
            (1..=3).contains(&num.len()) && num.bytes().all(|b| b.is_ascii_digit()),
            "{t}"
        );
        assert!(
            letters.len() == 2 && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)),
            "{t}"
        );

        let rf = json!({"type": "json_schema", "json_schema": {"name": "a", "strict": true, "schema": schema}});
        let (_, r) = s
            .post(
                "/v1/chat/completions",
                chat(json!({"response_format": rf}), seed),
            )
            .await;
        let v: Value = serde_json::from_str(content(&r)).unwrap_or_else(|e| panic!("{e}: {r}"));
        assert!(
            ["yes", "no"].contains(&v["answer"].as_str().unwrap()),
            "{v}"
        );
        assert!((0..=9).contains(&v["n"].as_i64().unwrap()), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }
    assert!(
        seen.len() > 1,
        "ten seeds all chose {seen:?}: the grammar left no choice"
    );
    // vLLM's newer `structured_outputs` object asks for the same.
    for seed in 0..3 {
        let (st, r) = s
            .post(
                "/v1/chat/completions",
                chat(json!({"structured_outputs": {"choice": choices}}), seed),
            )
            .await;
        assert_eq!(st, 200, "{r}");
        assert!(choices.contains(&content(&r)), "{r}");
    }

    // Completions too, and streamed: the pieces join into one of the choices.
    let (_, r) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 16, "temperature": 1.0, "seed": 3,
                   "guided_choice": choices}),
        )
        .await;
    assert!(
        choices.contains(&r["choices"][0]["text"].as_str().unwrap()),
        "{r}"
    );
    let mut body = chat(json!({"guided_choice": choices, "stream": true}), 4);
    body["n"] = json!(2);
    let (chunks, done) = s.stream("/v1/chat/completions", body).await;
    assert!(done);
    let mut text = [String::new(), String::new()];
    let mut reasons = Vec::new();
    for c in &chunks {
        let ch = &c["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str() {
            text[ch["index"].as_u64().unwrap() as usize].push_str(t);
        }
        if let Some(r) = ch["finish_reason"].as_str() {
            reasons.push(r.to_owned());
        }
    }
    for t in &text {
        assert!(choices.contains(&t.as_str()), "{t:?}");
    }
    assert_eq!(reasons, ["stop", "stop"]);
    // A complete grammar ends the answer even before min_tokens, with ignore_eos.
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            chat(
                json!({"guided_choice": ["yes", "no"], "min_tokens": 10, "ignore_eos": true}),
                1,
            ),
        )
        .await;
    assert!(["yes", "no"].contains(&content(&r)), "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    s.stop().await;
}

/// Every answer parses, also when `max_tokens` comes first: the grammar's shortest
/// end is forced in time and the answer finishes with `length`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_answers_parse_even_when_max_tokens_cuts_them() {
    let s = Server::start(fixture("qwen2-tiny"), |_| {}).await;
    let schema = json!({"type": "object", "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"}},
        "required": ["name", "tags", "n"], "additionalProperties": false});
    let rf = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}});
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    for seed in 0..6 {
        for (extra, max) in [
            (json!({"response_format": {"type": "json_object"}}), 200),
            (json!({"response_format": {"type": "json_object"}}), 12),
            (json!({"response_format": rf}), 30),
        ] {
            let mut body = chat(extra, seed);
            body["max_tokens"] = json!(max);
            let (st, r) = s.post("/v1/chat/completions", body.clone()).await;
            assert_eq!(st, 200, "{r}");
            let t = content(&r);
            let v: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t} ({body})"));
            assert!(v.is_object(), "{t}");
            let reason = r["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_owned();
            let used = r["usage"]["completion_tokens"].as_u64().unwrap();
            assert!(used <= max, "{used} > {max}");
            if reason == "length" {
                assert!(used + 3 >= max, "cut at {used} of {max} tokens: {t}");
            }
            *reasons.entry(reason).or_default() += 1;
            // Streamed alike.
            body["stream"] = json!(true);
            let (chunks, _) = s.stream("/v1/chat/completions", body).await;
            let streamed: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                .collect();
            assert_eq!(streamed, t);
        }
    }
    // Random weights at temperature 1 run into the budget in most answers.
    assert!(reasons.get("length").is_some_and(|&n| n > 3), "{reasons:?}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammars_that_do_not_compile_are_refused_by_field() {
    let s = Server::start(fixture("llama-tiny"), |_| {}).await;
    for (extra, param) in [
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (
            json!({"guided_grammar": "start: undefined_rule"}),
            "guided_grammar",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
        ),
    ] {
        let (st, r) = s.post("/v1/chat/completions", chat(extra.clone(), 0)).await;
        assert_eq!(st, 400, "{extra} → {r}");
        assert_eq!(r["error"]["param"], param, "{extra} → {r}");
    }
    // `text` asks for nothing.
    let (st, r) = s
        .post(
            "/v1/chat/completions",
            chat(
                json!({"response_format": {"type": "text"}, "max_tokens": 2}),
                0,
            ),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    s.stop().await;
}
