//! Tool calling through the API: `tools` rendered by a template that knows them, calls
//! forced by `tool_choice` always valid for the function's schema (sampled at
//! temperature 1 from random weights, which unconstrained write anything), the
//! model's text parsed into `tool_calls` whole and streamed alike, and a template that
//! cannot render tools refusing them by name.

use serde_json::{Value, json};

use preheat_testkit::model_fixture as fixture;

use super::server::Server;

/// A Hermes template as short as the tiny fixtures' 512-token context needs (the
/// full one, `smollm2_hermes_tools.jinja`, is checked against transformers in
/// `text.rs` and served to SmolLM2 in `tests/openai_client.rs`).
fn template() -> String {
    r#"{%- if tools %}<|im_start|>system
<tools>{% for t in tools %} {{ t.function.name }}{% endfor %}</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{%- if m.role == 'tool' %}
<tool_response>{{ m.content }}</tool_response>
{%- else %}
{{ m.content }}
{%- endif %}
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#
        .to_owned()
}

async fn server() -> Server {
    Server::start(fixture("llama-tiny"), |o| {
        o.chat_template = Some(template())
    })
    .await
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}},
    ])
}

fn chat(extra: Value, seed: u64) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 150, "temperature": 1.0, "seed": seed, "tools": tools()});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// `(name, arguments)` of a message's calls, arguments parsed.
fn calls(message: &Value) -> Vec<(String, Value)> {
    message["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    assert_eq!(c["type"], "function", "{c}");
                    assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
                    let args = c["function"]["arguments"].as_str().unwrap();
                    (
                        c["function"]["name"].as_str().unwrap().to_owned(),
                        serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}")),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn valid_weather(args: &Value) -> bool {
    let o = args.as_object().unwrap();
    o.len() == 2
        && o["city"].as_str().is_some_and(|c| c.chars().count() <= 12)
        && matches!(o["unit"].as_str(), Some("c" | "f"))
}

/// A stream's calls as a client assembles them (by `index`), its content and finish.
fn assemble(chunks: &[Value]) -> (Vec<(String, Value)>, String, String) {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut content = String::new();
    let mut finish = String::new();
    for c in chunks {
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        let d = &choice["delta"];
        content.push_str(d["content"].as_str().unwrap_or(""));
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((String::new(), String::new()));
            }
            calls[i]
                .0
                .push_str(tc["function"]["name"].as_str().unwrap_or(""));
            calls[i]
                .1
                .push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_owned();
        }
    }
    let calls = calls
        .into_iter()
        .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
        .collect();
    (calls, content, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_calls_are_valid_for_the_schema_whole_and_streamed() {
    let s = server().await;
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let required = json!({"tool_choice": "required", "parallel_tool_calls": false});
    for seed in 0..6 {
        let (st, r) = s
            .post("/v1/chat/completions", chat(named.clone(), seed))
            .await;
        assert_eq!(st, 200, "{r}");
        let m = &r["choices"][0]["message"];
        let c = calls(m);
        assert_eq!(c.len(), 1, "{r}");
        assert_eq!(c[0].0, "get_weather");
        assert!(valid_weather(&c[0].1), "{r}");
        assert_eq!(m["content"], Value::Null, "{r}");
        // OpenAI: a call forced by name finishes with "stop".
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let mut body = chat(named.clone(), seed);
        body["stream"] = json!(true);
        let (chunks, done) = s.stream("/v1/chat/completions", body).await;
        assert!(done);
        let (streamed, content, finish) = assemble(&chunks);
        assert_eq!(streamed, c, "seed {seed}: streamed calls differ");
        assert_eq!((content.as_str(), finish.as_str()), ("", "stop"));

        let (st, r) = s
            .post("/v1/chat/completions", chat(required.clone(), seed))
            .await;
        assert_eq!(st, 200, "{r}");
        let c = calls(&r["choices"][0]["message"]);
        assert_eq!(c.len(), 1, "parallel_tool_calls false: one call; {r}");
        match c[0].0.as_str() {
            "get_weather" => assert!(valid_weather(&c[0].1), "{r}"),
            "get_time" => assert_eq!(c[0].1, json!({}), "{r}"),
            other => panic!("{other}"),
        }
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_own_calls_are_parsed_under_auto() {
    let s = server().await;
    // What a model trained on the template writes, forced here with a regex (random
    // weights write nothing of the sort): parsed into tool_calls, not left as text.
    let two = r#"<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "c"\}\}\n</tool_call>"#;
    let auto = json!({"tool_choice": "auto", "guided_regex": two, "max_tokens": 300});
    let (st, r) = s.post("/v1/chat/completions", chat(auto.clone(), 1)).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        calls(&r["choices"][0]["message"]),
        vec![
            ("get_time".to_owned(), json!({})),
            (
                "get_weather".to_owned(),
                json!({"city": "Rome", "unit": "c"})
            )
        ],
        "{r}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    let ids: Vec<&str> = r["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_ne!(ids[0], ids[1]);
    let mut body = chat(auto.clone(), 1);
    body["stream"] = json!(true);
    let (chunks, _) = s.stream("/v1/chat/completions", body).await;
    assert_eq!(assemble(&chunks).0.len(), 2);
    // parallel_tool_calls false: the answer ends after its first call.
    let mut one = auto.clone();
    one["parallel_tool_calls"] = json!(false);
    let (_, r) = s.post("/v1/chat/completions", chat(one, 1)).await;
    assert_eq!(
        calls(&r["choices"][0]["message"]),
        vec![("get_time".to_owned(), json!({}))],
        "{r}"
    );
    // tool_choice none: the same text comes back as text.
    let none = json!({"tool_choice": "none", "guided_regex": two, "max_tokens": 300});
    let (_, r) = s.post("/v1/chat/completions", chat(none, 1)).await;
    let m = &r["choices"][0]["message"];
    assert!(m.get("tool_calls").is_none(), "{r}");
    assert!(
        m["content"].as_str().unwrap().starts_with("<tool_call>"),
        "{r}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // Plain text under auto stays content.
    let plain = json!({"tool_choice": "auto", "guided_regex": "It is sunny in Paris\\."});
    let (_, r) = s.post("/v1/chat/completions", chat(plain, 1)).await;
    assert_eq!(
        r["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
    assert!(
        r["choices"][0]["message"].get("tool_calls").is_none(),
        "{r}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_results_of_earlier_turns_reach_the_template() {
    let s = server().await;
    let turn = |with_result: bool| {
        let mut messages = vec![
            json!({"role": "user", "content": "Weather in Paris?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]}),
        ];
        if with_result {
            messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}));
        }
        json!({"model": "m", "messages": messages, "tools": tools(), "max_tokens": 1})
    };
    let (st, a) = s.post("/v1/chat/completions", turn(false)).await;
    assert_eq!(st, 200, "{a}");
    let (st, b) = s.post("/v1/chat/completions", turn(true)).await;
    assert_eq!(st, 200, "{b}");
    // The result's turn: "<|im_start|>user\n<tool_response>\n…\n</tool_response><|im_end|>\n".
    let grew = b["usage"]["prompt_tokens"].as_u64().unwrap()
        - a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(grew >= 10, "the tool result added {grew} prompt tokens");
    // The call itself is rendered too (its arguments as JSON, not a string of it).
    let mut no_call = turn(false);
    no_call["messages"][1] = json!({"role": "assistant", "content": ""});
    let (_, c) = s.post("/v1/chat/completions", no_call).await;
    let call = a["usage"]["prompt_tokens"].as_u64().unwrap()
        - c["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(call >= 10, "the call added {call} prompt tokens");
    // Arguments that are not JSON are refused naming the message.
    let mut bad = turn(false);
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = json!("{city: Paris");
    let (st, r) = s.post("/v1/chat/completions", bad).await;
    assert_eq!(
        (st, r["error"]["param"].as_str()),
        (400, Some("messages[1].tool_calls")),
        "{r}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_refused_by_name_where_they_cannot_be_honoured() {
    // llama-tiny's own template renders no tools.
    let plain = Server::start(fixture("llama-tiny"), |_| {}).await;
    let (st, r) = plain.post("/v1/chat/completions", chat(json!({}), 0)).await;
    assert_eq!(
        (st, r["error"]["param"].as_str()),
        (400, Some("tools")),
        "{r}"
    );
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--chat-template"),
        "{r}"
    );
    // ... but tool_choice none/auto with no tools asks for nothing.
    let mut body = chat(json!({"tool_choice": "auto"}), 0);
    body.as_object_mut().unwrap().remove("tools");
    assert_eq!(plain.post("/v1/chat/completions", body).await.0, 200);
    plain.stop().await;

    let s = server().await;
    for (extra, param) in [
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"}),
            "tool_choice",
        ),
    ] {
        let (st, r) = s.post("/v1/chat/completions", chat(extra.clone(), 0)).await;
        assert_eq!(
            (st, r["error"]["param"].as_str()),
            (400, Some(param)),
            "{extra}: {r}"
        );
    }
    // Completions has no tools.
    let (st, r) = s
        .post(
            "/v1/completions",
            json!({"model": "m", "prompt": "x", "tools": tools()}),
        )
        .await;
    assert_eq!(
        (st, r["error"]["param"].as_str()),
        (400, Some("tools")),
        "{r}"
    );
    s.stop().await;
}

/// Minimal templates in the Llama 3 JSON and Mistral styles (the tiny fixtures' context
/// is 512 tokens): what their markers make the server expect is what it forces and
/// parses.
fn llama3_template() -> String {
    r#"{%- if tools %}<|start_header_id|>ipython<|end_header_id|>{% for t in tools %} {{ t.function.name }}{% endfor %}<|python_tag|>
{% endif %}
{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"#
        .to_owned()
}

fn mistral_template() -> String {
    r#"{%- if tools %}[AVAILABLE_TOOLS]{% for t in tools %} {{ t.function.name }}{% endfor %}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}[INST]{{ m.content }}[/INST]{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}"#
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_and_mistral_formats_are_forced_and_parsed_too() {
    for template in [llama3_template(), mistral_template()] {
        let s = Server::start(fixture("llama-tiny"), |o| {
            o.chat_template = Some(template.clone())
        })
        .await;
        for seed in 0..3 {
            let body = chat(json!({"tool_choice": "required"}), seed);
            let (st, r) = s.post("/v1/chat/completions", body.clone()).await;
            assert_eq!(st, 200, "{r}");
            let c = calls(&r["choices"][0]["message"]);
            assert!(!c.is_empty(), "{template}: {r}");
            for (name, args) in &c {
                match name.as_str() {
                    "get_weather" => assert!(valid_weather(args), "{r}"),
                    "get_time" => assert_eq!(args, &json!({}), "{r}"),
                    other => panic!("{other}"),
                }
            }
            let mut body = body;
            body["stream"] = json!(true);
            let (chunks, _) = s.stream("/v1/chat/completions", body).await;
            assert_eq!(assemble(&chunks).0, c, "streamed alike");
        }
        s.stop().await;
    }
}

/// A checkpoint whose tokenizer_config.json names its templates (`default` and
/// `tool_use`, as Hermes 2 Pro and Command R ship them): chats with tools render with
/// `tool_use`, as transformers renders them; the others with `default`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_named_tool_use_template_renders_chats_with_tools() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("named-templates");
    std::fs::create_dir(&model).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(fixture("llama-tiny").join(f), model.join(f)).unwrap();
    }
    let mut tc: Value = serde_json::from_slice(
        &std::fs::read(fixture("llama-tiny").join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let default =
        std::fs::read_to_string(fixture("llama-tiny").join("chat_template.jinja")).unwrap();
    tc["chat_template"] = json!([
        {"name": "default", "template": default},
        {"name": "tool_use", "template": template()},
    ]);
    std::fs::write(model.join("tokenizer_config.json"), tc.to_string()).unwrap();
    let s = Server::start(model, |_| {}).await;
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let (st, r) = s.post("/v1/chat/completions", chat(named, 0)).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        calls(&r["choices"][0]["message"]),
        vec![("get_time".to_owned(), json!({}))],
        "{r}"
    );
    // Without tools: the default template (a shorter prompt than with the tools' list).
    let mut plain = chat(json!({}), 0);
    plain.as_object_mut().unwrap().remove("tools");
    plain["max_tokens"] = json!(1);
    let (_, p) = s.post("/v1/chat/completions", plain).await;
    let with_tools = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let without = p["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(with_tools > without, "{with_tools} vs {without}");
    s.stop().await;
}
