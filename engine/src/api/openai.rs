//! OpenAI request bodies (with the vLLM extensions benchmarks use) and their
//! validation into engine requests.

use serde::Deserialize;
use serde_json::Value;

use crate::sampling::SamplingParams;
use crate::sampling::grammar::Grammar;
use crate::tokenizer::ChatMessage;
use crate::{EngineError, Result};

/// `prompt`: a string, a list of token ids, or a one-element list of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// vLLM's.
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string, OpenAI's form) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's.
    pub min_tokens: Option<i64>,
    /// Structured outputs: OpenAI's `{"type": "text" | "json_object" | "json_schema"}`.
    pub response_format: Option<Value>,
    /// vLLM's structured outputs.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// vLLM's newer form of the same: `{"json" | "regex" | "choice" | "grammar" |
    /// "json_object": …}`.
    pub structured_outputs: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Number of top logprobs per token (legacy completions form).
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    /// Sequences to generate, of which the `n` with the highest cumulative logprob
    /// are returned.
    pub best_of: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
    /// Every other field: checked by [`super::unread_fields`], never dropped. (After
    /// `common`: serde hands a flattened map only what the flattened structs before it
    /// did not take.)
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<RawMessage>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// Functions the model may call (see `super::tools`).
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
    /// As [`CompletionRequest::rest`].
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
pub struct RawMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    /// Handed to the chat template (as vLLM does).
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's calls (OpenAI's form: arguments as JSON text).
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// `refusal`, `audio`, …: checked by [`super::unread_fields::check_message`].
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

impl RawMessage {
    /// Content as text: a string, or the text parts of a content-part list.
    pub fn text(&self) -> Result<String> {
        match &self.content {
            Value::String(s) => Ok(s.clone()),
            Value::Null => Ok(String::new()),
            Value::Array(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p["type"].as_str(), p["text"].as_str()) {
                        (Some("text"), Some(t)) => out.push_str(t),
                        _ => {
                            return Err(EngineError::invalid(
                                "only text content parts are supported",
                                "messages",
                            ));
                        }
                    }
                }
                Ok(out)
            }
            _ => Err(EngineError::invalid(
                "message content must be a string or a list of parts",
                "messages",
            )),
        }
    }
}

pub fn to_messages(raw: &[RawMessage]) -> Result<Vec<ChatMessage>> {
    if raw.is_empty() {
        return Err(EngineError::invalid(
            "messages must not be empty",
            "messages",
        ));
    }
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            super::unread_fields::check_message(&m.rest, i)?;
            let tool_calls = match &m.tool_calls {
                Some(calls) if !calls.is_empty() => {
                    if m.role != "assistant" {
                        return Err(EngineError::invalid(
                            format!("messages[{i}].tool_calls: only assistant messages make calls"),
                            &format!("messages[{i}].tool_calls"),
                        ));
                    }
                    super::tools::template_calls(calls, i)?
                }
                _ => Vec::new(),
            };
            if m.tool_call_id.is_some() && m.role != "tool" {
                return Err(EngineError::invalid(
                    format!("messages[{i}].tool_call_id: only tool messages answer a call"),
                    &format!("messages[{i}].tool_call_id"),
                ));
            }
            Ok(ChatMessage {
                role: m.role.clone(),
                content: m.text()?,
                name: m.name.clone(),
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
            })
        })
        .collect()
}

/// The grammar the output must match, and the field that asked for it.
fn grammar(c: &Common) -> Result<Option<(Grammar, &'static str)>> {
    let mut asked: Vec<(Grammar, &'static str)> = Vec::new();
    if let Some(rf) = &c.response_format {
        let param = "response_format";
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => asked.push((Grammar::JsonObject, param)),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean())
                    .ok_or_else(|| {
                        EngineError::invalid(
                            "response_format json_schema needs json_schema.schema, a JSON schema object",
                            param,
                        )
                    })?;
                asked.push((Grammar::JsonSchema(schema.clone()), param));
            }
            other => {
                return Err(EngineError::invalid(
                    format!(
                        "response_format type must be text, json_object or json_schema, got {}",
                        other.map_or_else(|| "none".to_owned(), |t| format!("{t:?}"))
                    ),
                    param,
                ));
            }
        }
    }
    if let Some(s) = &c.guided_json {
        // vLLM takes the schema as an object or as its JSON text.
        let schema = match s {
            Value::String(text) => serde_json::from_str(text).map_err(|e| {
                EngineError::invalid(format!("guided_json is not JSON: {e}"), "guided_json")
            })?,
            v => v.clone(),
        };
        asked.push((Grammar::JsonSchema(schema), "guided_json"));
    }
    if let Some(r) = &c.guided_regex {
        asked.push((Grammar::Regex(r.clone()), "guided_regex"));
    }
    if let Some(choices) = &c.guided_choice {
        if choices.is_empty() || choices.len() > MAX_GUIDED_CHOICES {
            return Err(EngineError::invalid(
                format!(
                    "guided_choice needs 1 to {MAX_GUIDED_CHOICES} strings, got {}",
                    choices.len()
                ),
                "guided_choice",
            ));
        }
        asked.push((Grammar::Choice(choices.clone()), "guided_choice"));
    }
    if let Some(g) = &c.guided_grammar {
        asked.push((Grammar::Lark(g.clone()), "guided_grammar"));
    }
    if let Some(so) = &c.structured_outputs {
        asked.extend(structured_outputs(so)?);
    }
    if asked.len() > 1 {
        let names: Vec<&str> = asked.iter().map(|(_, p)| *p).collect();
        return Err(EngineError::invalid(
            format!(
                "only one structured-output field may be given, got {}",
                names.join(", ")
            ),
            asked[1].1,
        ));
    }
    Ok(asked.pop())
}

/// vLLM's `structured_outputs` object: one constraint, its other options refused by
/// name (they would change the grammar: whitespace, fallbacks, structural tags).
fn structured_outputs(
    so: &serde_json::Map<String, Value>,
) -> Result<Option<(Grammar, &'static str)>> {
    const P: &str = "structured_outputs";
    let inv = |m: String| EngineError::invalid(m, P);
    let mut asked = Vec::new();
    for (k, v) in so {
        if v.is_null() {
            continue;
        }
        let g = match k.as_str() {
            "json" => Grammar::JsonSchema(match v {
                Value::String(text) => serde_json::from_str(text)
                    .map_err(|e| inv(format!("structured_outputs.json is not JSON: {e}")))?,
                v => v.clone(),
            }),
            "regex" => Grammar::Regex(
                v.as_str()
                    .ok_or_else(|| inv("structured_outputs.regex must be a string".into()))?
                    .to_owned(),
            ),
            "choice" => {
                let c: Vec<String> = serde_json::from_value(v.clone()).map_err(|_| {
                    inv("structured_outputs.choice must be a list of strings".into())
                })?;
                if c.is_empty() || c.len() > MAX_GUIDED_CHOICES {
                    return Err(inv(format!(
                        "structured_outputs.choice needs 1 to {MAX_GUIDED_CHOICES} strings, got {}",
                        c.len()
                    )));
                }
                Grammar::Choice(c)
            }
            "grammar" => Grammar::Lark(
                v.as_str()
                    .ok_or_else(|| inv("structured_outputs.grammar must be a string".into()))?
                    .to_owned(),
            ),
            "json_object" if v == &Value::Bool(true) => Grammar::JsonObject,
            "json_object" => continue,
            other => {
                return Err(inv(format!(
                    "structured_outputs.{other} is not supported by this server (json, regex, choice, grammar and json_object are)"
                )));
            }
        };
        asked.push(g);
    }
    if asked.len() > 1 {
        return Err(inv(
            "structured_outputs may give only one of json, regex, choice, grammar, json_object"
                .into(),
        ));
    }
    Ok(asked.pop().map(|g| (g, P)))
}

/// Most strings `guided_choice` may list.
pub const MAX_GUIDED_CHOICES: usize = 256;

/// Most choices (`n`, `best_of`) one request may ask for. Each is a sequence queued
/// like a request of its own: on a decode worker each takes a running slot and its own
/// copy of the prompt's K/V (only the prefill worker shares them), and a worker refuses
/// what it cannot start at once, so `n` stays well under the default `max_running` (64);
/// a colocated engine also refuses more than it runs at once.
pub const MAX_CHOICES: usize = 16;

/// How many sequences a request runs and how many of them it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choices {
    /// Returned.
    pub n: usize,
    /// Generated (`>= n`); the `n` with the highest cumulative logprob are returned.
    pub best_of: usize,
}

/// Validates `n` and (completions') `best_of`.
pub fn choices(c: &Common, best_of: Option<i64>) -> Result<Choices> {
    let count = |v: i64, name: &str| {
        usize::try_from(v)
            .ok()
            .filter(|v| (1..=MAX_CHOICES).contains(v))
            .ok_or_else(|| {
                EngineError::invalid(
                    format!("{name} must be between 1 and {MAX_CHOICES}, got {v}"),
                    name,
                )
            })
    };
    let n = c.n.map_or(Ok(1), |v| count(v, "n"))?;
    let best_of = best_of.map_or(Ok(n), |v| count(v, "best_of"))?;
    if best_of < n {
        return Err(EngineError::invalid(
            format!("best_of must be at least n ({n}), got {best_of}"),
            "best_of",
        ));
    }
    // Which sequences win is known only once all have finished.
    if c.stream && best_of > n {
        return Err(EngineError::invalid(
            "best_of greater than n cannot be streamed",
            "best_of",
        ));
    }
    Ok(Choices { n, best_of })
}

/// A request's sampling parameters, built once from its fields.
#[derive(Debug)]
pub(crate) struct Sampling {
    pub(crate) params: SamplingParams,
    /// The field that asked for `params.grammar`, named when it does not compile.
    pub(crate) grammar_field: Option<&'static str>,
    /// The client gave no `max_tokens`: chat's default needs the prompt's length,
    /// known only after the cheaper checks.
    default_max: bool,
}

impl Sampling {
    /// The grammar to compile, with the field that asked for it.
    pub(crate) fn grammar(&self) -> Option<(Grammar, &'static str)> {
        self.params.grammar.clone().zip(self.grammar_field)
    }

    /// Sets `max_tokens` to `max` unless the client gave it; checked again, as
    /// `min_tokens` may not exceed it.
    pub(crate) fn default_max_tokens(&mut self, max: usize) -> Result<()> {
        if self.default_max {
            self.params.max_tokens = max;
            self.params.check()?;
        }
        Ok(())
    }
}

/// Validates sampling fields; `logprobs` is the number of top logprobs wanted,
/// `default_max` the `max_tokens` when the client gives none.
pub(crate) fn sampling(c: &Common, logprobs: Option<i64>, default_max: usize) -> Result<Sampling> {
    let inv = |m: String, p: &str| EngineError::invalid(m, p);
    if c.stream_options.is_some() && !c.stream {
        return Err(inv(
            "stream_options is only allowed when stream is true".into(),
            "stream_options",
        ));
    }
    let asked_max = c.max_completion_tokens.or(c.max_tokens);
    let max_tokens = match asked_max {
        None => default_max,
        Some(m) if m < 1 => {
            return Err(inv(
                format!("max_tokens must be at least 1, got {m}"),
                "max_tokens",
            ));
        }
        Some(m) => {
            usize::try_from(m).map_err(|_| inv("max_tokens is too large".into(), "max_tokens"))?
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(inv(
            format!("temperature must be >= 0, got {temperature}"),
            "temperature",
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(inv(
            format!("top_p must be in (0, 1], got {top_p}"),
            "top_p",
        ));
    }
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(inv(
            format!("min_p must be in [0, 1], got {min_p}"),
            "min_p",
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(inv(
                format!("top_k must be -1 or positive, got {k}"),
                "top_k",
            ));
        }
    };
    let logprobs = match logprobs {
        None => None,
        Some(n) if (0..=20).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(inv(
                format!("logprobs must be between 0 and 20, got {n}"),
                "logprobs",
            ));
        }
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.len() > crate::sampling::MAX_CLIENT_STOP {
        return Err(inv(
            format!(
                "at most {} stop strings, got {}",
                crate::sampling::MAX_CLIENT_STOP,
                stop.len()
            ),
            "stop",
        ));
    }
    let logit_bias = c
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, v)| {
            let t = k.trim().parse::<u32>().map_err(|_| {
                inv(
                    format!("logit_bias keys must be token ids, got {k:?}"),
                    "logit_bias",
                )
            })?;
            Ok((t, *v as f32))
        })
        .collect::<Result<Vec<_>>>()?;
    // "1" and "01" name one token: refused rather than summed past the limit.
    let mut ids: Vec<u32> = logit_bias.iter().map(|(t, _)| *t).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(inv(
            format!("logit_bias names token {} twice", w[0]),
            "logit_bias",
        ));
    }
    let min_tokens = match c.min_tokens {
        None => 0,
        Some(m) => usize::try_from(m)
            .map_err(|_| inv(format!("min_tokens must be >= 0, got {m}"), "min_tokens"))?,
    };
    let (grammar, grammar_field) = grammar(c)?.unzip();
    let params = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        seed: c.seed.map(|s| s as u64),
        max_tokens,
        stop,
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
        logprobs,
        presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0) as f32,
        logit_bias,
        min_tokens,
        grammar,
    };
    params.check()?;
    Ok(Sampling {
        params,
        grammar_field,
        default_max: asked_max.is_none(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn common(v: Value) -> Common {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_default_max_tokens_is_set_once_the_prompt_is_known() {
        let mut given = sampling(&common(json!({"max_tokens": 7})), None, 512).unwrap();
        given.default_max_tokens(100).unwrap();
        assert_eq!(given.params.max_tokens, 7);
        // Until the prompt's length is known, the default given stands in.
        let mut left = sampling(&common(json!({"min_tokens": 300})), None, 512).unwrap();
        assert_eq!(left.params.max_tokens, 512);
        let e = left.default_max_tokens(200).unwrap_err();
        assert!(
            e.to_string()
                .contains("min_tokens (300) must not exceed max_tokens (200)"),
            "{e}"
        );
        left.params.min_tokens = 0;
        left.default_max_tokens(200).unwrap();
        assert_eq!(left.params.max_tokens, 200);
    }

    #[test]
    fn the_grammar_comes_with_the_field_that_asked_for_it() {
        let s = sampling(&common(json!({"guided_regex": "a+"})), None, 16).unwrap();
        assert_eq!(
            s.grammar(),
            Some((Grammar::Regex("a+".into()), "guided_regex"))
        );
        assert_eq!(s.params.grammar, Some(Grammar::Regex("a+".into())));
        let none = sampling(&common(json!({})), None, 16).unwrap();
        assert_eq!(none.grammar(), None);
    }
}
