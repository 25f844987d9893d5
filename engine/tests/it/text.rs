//! Tokenizer behaviour on the reference fixtures: chat templates render as transformers
//! renders them, and streaming detokenisation never splits a character.

use preheat_testkit::model_fixture;

use preheat_engine::model::open_model;
use preheat_engine::tokenizer::{ChatMessage, IncrementalDetokenizer, Tokenizer};

fn tokenizer(name: &str) -> Tokenizer {
    let p = model_fixture(name);
    let (snap, _) = open_model(&p).unwrap();
    Tokenizer::from_snapshot(&snap).unwrap()
}

#[test]
fn chat_template_renders_like_transformers() {
    let p = model_fixture("llama-tiny").join("reference.json");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    let ex = &r["chat_template_example"];
    let msgs: Vec<ChatMessage> = serde_json::from_value(ex["messages"].clone()).unwrap();
    let t = tokenizer("llama-tiny");
    assert_eq!(
        t.apply_chat_template(&msgs, None, true).unwrap(),
        ex["rendered"].as_str().unwrap()
    );
}

/// A template with tools, calls and tool results (and SmolLM2's own, without tools)
/// renders as transformers renders it (`testdata/chat_templates/make_reference.py`):
/// jinja2's block trimming, its `tojson` layout, tool calls' arguments as values.
#[test]
fn tool_template_renders_like_transformers() {
    let dir = preheat_testkit::testdata().join("chat_templates");
    let src = std::fs::read_to_string(dir.join("smollm2_hermes_tools.jinja")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_slice(
        &std::fs::read(dir.join("smollm2_hermes_tools.reference.json")).unwrap(),
    )
    .unwrap();
    let t = tokenizer("llama-tiny").with_chat_template(src).unwrap();
    for c in &cases {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let tools: Option<Vec<serde_json::Value>> =
            serde_json::from_value(c["tools"].clone()).unwrap();
        assert_eq!(
            t.apply_chat_template(&msgs, tools.as_deref(), true)
                .unwrap(),
            c["rendered"].as_str().unwrap()
        );
    }
}

#[test]
fn prompts_encode_to_the_reference_ids() {
    for model in ["llama-tiny", "qwen2-tiny"] {
        let p = model_fixture(model).join("reference.json");
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        let t = tokenizer(model);
        for c in r["cases"].as_array().unwrap() {
            let want: Vec<u32> = c["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                t.encode(c["prompt"].as_str().unwrap()).unwrap(),
                want,
                "{model}"
            );
        }
    }
}

#[test]
fn incremental_detokenisation_never_splits_characters() {
    let t = tokenizer("llama-tiny");
    let text = "naïve café — 東京 🚀 done";
    let ids = t.encode(text).unwrap();
    assert!(
        ids.len() > text.chars().count(),
        "multi-byte characters span several byte tokens here"
    );
    let mut d = IncrementalDetokenizer::default();
    let mut out = String::new();
    let mut deltas = 0;
    for n in 1..=ids.len() {
        let delta = d.next(&t, &ids[..n]).unwrap();
        assert!(
            !delta.contains('\u{FFFD}'),
            "a partial character leaked: {delta:?}"
        );
        deltas += usize::from(!delta.is_empty());
        out.push_str(&delta);
    }
    out.push_str(&d.flush(&t, &ids).unwrap());
    assert_eq!(out, text);
    assert!(deltas > 5);
}
