//! Request fields the server does not act on: refused by name, never dropped.
//!
//! A client that asks for `bad_words` or `use_beam_search` and gets a plain answer
//! back has a wrong answer that looks right.
//! So every field of the OpenAI chat and completions APIs (and of the vLLM extensions
//! clients send) that [`super::openai`] does not read is either harmless here —
//! metadata, or the value that asks for nothing (`best_of: 1`, `functions: []`,
//! `function_call: "none"`; clients such as LangChain send those by
//! default) — or answered with a 400 whose `param` names it. Fields nobody defined get
//! OpenAI's own answer: "Unrecognized request argument supplied".

use serde_json::{Map, Value};

use crate::{EngineError, Result};

/// Which endpoint a body was sent to (a few fields exist on one only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// What a field the server does not read may hold.
#[derive(Clone, Copy)]
enum Allowed {
    /// Anything: it describes the request and changes no output (`user`, `metadata`).
    Any,
    /// Only the value that asks for nothing (or null).
    Neutral(fn(&Value) -> bool),
}

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}
fn is_true(v: &Value) -> bool {
    v == &Value::Bool(true)
}
fn empty(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
        || v.as_object().is_some_and(Map::is_empty)
        || v.as_str() == Some("")
}
fn never(_: &Value) -> bool {
    false
}
/// With no functions offered, asking the model to choose among them asks for nothing.
fn no_function_call(v: &Value) -> bool {
    matches!(v.as_str(), Some("none" | "auto"))
}
fn text_only(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text")))
}
fn llguidance_backend(v: &Value) -> bool {
    matches!(v.as_str(), Some("auto" | "guidance" | "llguidance"))
}
fn default_tier(v: &Value) -> bool {
    matches!(v.as_str(), Some("auto" | "default"))
}

/// Fields of both endpoints that [`super::openai`] does not read, and what they may hold.
const SHARED: &[(&str, Allowed)] = &[
    // Metadata: identifies or labels the request, changes nothing in the answer.
    ("user", Allowed::Any),
    ("metadata", Allowed::Any),
    ("safety_identifier", Allowed::Any),
    ("prompt_cache_key", Allowed::Any),
    ("request_id", Allowed::Any),
    ("service_tier", Allowed::Neutral(default_tier)),
    // Nothing is stored for later retrieval.
    ("store", Allowed::Neutral(is_false)),
    // Sampling controls not implemented yet: only their "off" value.
    ("bad_words", Allowed::Neutral(empty)),
    ("allowed_token_ids", Allowed::Neutral(never)),
    ("use_beam_search", Allowed::Neutral(is_false)),
    ("length_penalty", Allowed::Neutral(one)),
    ("prompt_logprobs", Allowed::Neutral(never)),
    ("truncate_prompt_tokens", Allowed::Neutral(never)),
    ("include_stop_str_in_output", Allowed::Neutral(is_false)),
    ("skip_special_tokens", Allowed::Neutral(is_true)),
    ("spaces_between_special_tokens", Allowed::Neutral(is_true)),
    ("priority", Allowed::Neutral(zero)),
    // Structured outputs run on llguidance (vLLM's `guidance` backend): asking for
    // another backend is refused.
    (
        "guided_decoding_backend",
        Allowed::Neutral(llguidance_backend),
    ),
];

/// Chat only.
const CHAT: &[(&str, Allowed)] = &[
    // The deprecated form of `tools` / `tool_choice` (read by `super::tools`).
    ("functions", Allowed::Neutral(empty)),
    ("function_call", Allowed::Neutral(no_function_call)),
    ("modalities", Allowed::Neutral(text_only)),
    ("audio", Allowed::Neutral(never)),
    ("prediction", Allowed::Neutral(never)),
    ("reasoning_effort", Allowed::Neutral(never)),
    ("verbosity", Allowed::Neutral(never)),
    ("web_search_options", Allowed::Neutral(never)),
    ("echo", Allowed::Neutral(is_false)),
    // Read by the completions API; on chat (a vLLM extension there) only 1.
    ("best_of", Allowed::Neutral(one)),
    ("continue_final_message", Allowed::Neutral(is_false)),
    ("chat_template", Allowed::Neutral(never)),
    ("chat_template_kwargs", Allowed::Neutral(empty)),
    ("documents", Allowed::Neutral(never)),
];

/// Completions only.
const COMPLETIONS: &[(&str, Allowed)] = &[("suffix", Allowed::Neutral(empty))];

/// Fields of a chat message besides `role` and `content`.
const MESSAGE: &[(&str, Allowed)] = &[
    ("function_call", Allowed::Neutral(never)),
    ("refusal", Allowed::Neutral(never)),
    ("audio", Allowed::Neutral(never)),
];

/// Refuses the first field of `rest` (what the body held beyond the fields read)
/// that would change the answer, naming it.
pub fn check(rest: &Map<String, Value>, endpoint: Endpoint) -> Result<()> {
    let own = match endpoint {
        Endpoint::Chat => CHAT,
        Endpoint::Completions => COMPLETIONS,
    };
    check_in(rest, &[SHARED, own], "")
}

/// The same for the extra fields of message `i`.
pub fn check_message(rest: &Map<String, Value>, i: usize) -> Result<()> {
    check_in(rest, &[MESSAGE], &format!("messages[{i}]."))
}

fn check_in(rest: &Map<String, Value>, tables: &[&[(&str, Allowed)]], prefix: &str) -> Result<()> {
    for (k, v) in rest {
        let rule = tables
            .iter()
            .flat_map(|t| t.iter())
            .find(|(name, _)| name == k)
            .map(|(_, a)| *a);
        let name = format!("{prefix}{k}");
        match rule {
            None => {
                return Err(EngineError::invalid(
                    format!("Unrecognized request argument supplied: {name}"),
                    &name,
                ));
            }
            Some(Allowed::Any) => {}
            Some(Allowed::Neutral(ok)) => {
                if !(v.is_null() || ok(v)) {
                    return Err(EngineError::invalid(
                        format!(
                            "{name} is not supported by this server (only its default value is accepted); the request was not run"
                        ),
                        &name,
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(body: Value, e: Endpoint) -> Option<String> {
        match check(body.as_object().unwrap(), e) {
            Ok(()) => None,
            Err(EngineError::InvalidRequest { param, .. }) => param,
            Err(other) => panic!("{other}"),
        }
    }

    #[test]
    fn defaults_pass_and_anything_else_is_refused_by_name() {
        let neutral = json!({"best_of": 1, "bad_words": [], "use_beam_search": false,
            "functions": [], "function_call": "none", "user": "u1",
            "store": false, "n_unused": null});
        // `n_unused` is unknown: refused even when null.
        assert_eq!(
            param(neutral.clone(), Endpoint::Chat).as_deref(),
            Some("n_unused")
        );
        let mut neutral = neutral;
        neutral.as_object_mut().unwrap().remove("n_unused");
        assert_eq!(param(neutral, Endpoint::Chat), None);
        for (k, v) in [
            ("best_of", json!(3)),
            ("bad_words", json!(["x"])),
            (
                "functions",
                json!([{"name": "f", "parameters": {"type": "object"}}]),
            ),
            ("function_call", json!({"name": "f"})),
            ("guided_decoding_backend", json!("xgrammar")),
            ("store", json!(true)),
            ("temprature", json!(0.2)),
        ] {
            assert_eq!(
                param(json!({ k: v }), Endpoint::Chat).as_deref(),
                Some(k),
                "{k}"
            );
        }
        // Each endpoint's own fields only.
        assert_eq!(
            param(json!({"suffix": "x"}), Endpoint::Completions).as_deref(),
            Some("suffix")
        );
        assert_eq!(
            param(json!({"tools": []}), Endpoint::Completions).as_deref(),
            Some("tools")
        );
        let e = check_message(
            json!({"function_call": {"name": "f"}}).as_object().unwrap(),
            2,
        )
        .unwrap_err();
        assert!(e.to_string().contains("messages[2].function_call"), "{e}");
    }
}
