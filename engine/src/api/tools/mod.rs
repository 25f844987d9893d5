//! Tool calling: a request's `tools` and `tool_choice` checked against what the
//! model's chat template can render, the grammar that forces a call when one is
//! required, and the model's text parsed back into `tool_calls` (whole or streamed).
//!
//! The call format is the one the chat template teaches the model, recognised from
//! the template's text: Hermes/Qwen (`<tool_call>{…}</tool_call>`), Llama 3 JSON
//! (`{"name": …, "parameters": …}`) or Mistral (`[TOOL_CALLS] [{…}]`). A template that
//! renders none of them cannot take `tools`: the request is refused naming the
//! field, never answered as if no tools had been offered.

mod calls;
mod formats;
mod grammar;
mod request;
mod stream;

use serde_json::Value;

pub(crate) use self::calls::{CallIds, Piece, ToolCall};
use self::formats::ToolFormat;
pub(crate) use self::request::{parse, template_calls};
pub(crate) use self::stream::ToolStream;

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    /// The model may not call a tool (its text is returned as it is).
    None,
    /// The model decides.
    Auto,
    /// The model must call at least one tool.
    Required,
    /// The model must call this function.
    Named(String),
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
struct Function {
    name: String,
    /// Its arguments' JSON schema.
    parameters: Value,
}

/// A request's validated tools.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tools {
    /// As sent, for the chat template.
    pub(crate) raw: Vec<Value>,
    functions: Vec<Function>,
    pub(crate) choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    parallel: bool,
    format: ToolFormat,
}

#[cfg(test)]
mod fixtures {
    use serde_json::json;

    use super::*;

    /// `get_weather` (a required `city`) and `get_time` (no arguments), offered in
    /// `format` under `choice`.
    pub(super) fn tools(format: ToolFormat, choice: ToolChoice) -> Tools {
        Tools {
            raw: Vec::new(),
            functions: vec![
                Function {
                    name: "get_weather".into(),
                    parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                },
                Function {
                    name: "get_time".into(),
                    parameters: json!({"type": "object", "properties": {}}),
                },
            ],
            choice,
            parallel: true,
            format,
        }
    }
}
