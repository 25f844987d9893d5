//! A request's `tools`, `tool_choice` and `parallel_tool_calls` checked into [`Tools`],
//! and a message's `tool_calls` put in the form chat templates render.

use serde_json::{Value, json};

use super::formats::ToolFormat;
use super::{Function, ToolChoice, Tools};
use crate::{EngineError, Result};

/// Most tools one request may offer (OpenAI's limit).
const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit).
const MAX_NAME: usize = 64;

fn invalid(msg: impl Into<String>, param: &str) -> EngineError {
    EngineError::invalid(msg, param)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Validates `tools`, `tool_choice` and `parallel_tool_calls`; `template` is the
/// model's chat template. `None` when no tools are offered (then `tool_choice` may
/// only be `none` or `auto`).
pub(crate) fn parse(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
    parallel: Option<bool>,
    template: Option<&str>,
) -> Result<Option<Tools>> {
    let tools = tools.unwrap_or_default();
    if tools.is_empty() {
        return match choice {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
            Some(_) => Err(invalid(
                "tool_choice asks for a tool call, but no tools were given",
                "tool_choice",
            )),
        };
    }
    if tools.len() > MAX_TOOLS {
        return Err(invalid(
            format!("at most {MAX_TOOLS} tools, got {}", tools.len()),
            "tools",
        ));
    }
    let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
    let mut strict: Vec<bool> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let param = "tools";
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                format!("tools[{i}].type must be \"function\""),
                param,
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(format!("tools[{i}].function must be an object"), param))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if !valid_name(name) {
            return Err(invalid(
                format!(
                    "tools[{i}].function.name must be 1 to {MAX_NAME} letters, digits, '_' or '-', got {name:?}"
                ),
                param,
            ));
        }
        if functions.iter().any(|g| g.name == name) {
            return Err(invalid(
                format!("tools[{i}]: function {name:?} is given twice"),
                param,
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(invalid(
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                    param,
                ));
            }
        };
        functions.push(Function {
            name: name.to_owned(),
            parameters,
        });
        strict.push(f.get("strict") == Some(&Value::Bool(true)));
    }
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    format!(
                        "tool_choice must be none, auto, required or a named function, got {other:?}"
                    ),
                    "tool_choice",
                ));
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid(
                        "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}",
                        "tool_choice",
                    )
                })?;
            if !functions.iter().any(|f| f.name == name) {
                return Err(invalid(
                    format!("tool_choice names {name:?}, which is not among tools"),
                    "tool_choice",
                ));
            }
            ToolChoice::Named(name.to_owned())
        }
    };
    // `strict` promises arguments valid for the schema: kept by the grammar when a
    // call is forced; under `auto` the model's free text is not held to it.
    if choice == ToolChoice::Auto
        && let Some(i) = strict.iter().position(|s| *s)
    {
        return Err(invalid(
            format!(
                "tools[{i}].function.strict: arguments are held to the schema only when tool_choice is \"required\" or names the function"
            ),
            "tools",
        ));
    }
    let format = template.and_then(ToolFormat::of_template).ok_or_else(|| {
        invalid(
            "this model's chat template does not render tools in a format this server parses (Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]); serve it with --chat-template naming one that does",
            "tools",
        )
    })?;
    Ok(Some(Tools {
        raw: tools.to_vec(),
        functions,
        choice,
        parallel: parallel.unwrap_or(true),
        format,
    }))
}

/// A message's `tool_calls` as chat templates expect them: arguments as a JSON value
/// (templates write `arguments | tojson`), not OpenAI's JSON text (vLLM does the same).
pub(crate) fn template_calls(calls: &[Value], at: usize) -> Result<Vec<Value>> {
    let param = format!("messages[{at}].tool_calls");
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let f = c
                .get("function")
                .and_then(Value::as_object)
                .filter(|_| {
                    c.get("type").and_then(Value::as_str).unwrap_or("function") == "function"
                })
                .ok_or_else(|| {
                    invalid(
                        format!(
                            "{param}[{k}] must be {{\"type\": \"function\", \"function\": {{…}}}}"
                        ),
                        &param,
                    )
                })?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("{param}[{k}].function.name is missing"), &param))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                    invalid(
                        format!("{param}[{k}].function.arguments is not JSON: {e}"),
                        &param,
                    )
                })?,
                Some(v @ Value::Object(_)) => v.clone(),
                None | Some(Value::Null) => json!({}),
                Some(_) => {
                    return Err(invalid(
                        format!("{param}[{k}].function.arguments must be JSON text"),
                        &param,
                    ));
                }
            };
            let mut out = json!({
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            });
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                out["id"] = json!(id);
            }
            Ok(out)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_checks_every_field_and_the_template() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
        let hermes = Some("{% if tools %}<tool_call>{% endif %}");
        let ok = parse(
            Some(std::slice::from_ref(&tool)),
            Some(&json!("required")),
            None,
            hermes,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (ok.choice, ok.format, ok.parallel),
            (ToolChoice::Required, ToolFormat::Hermes, true)
        );
        let err = |tools: &[Value], choice: Option<Value>, template: Option<&str>| {
            let e = parse(Some(tools), choice.as_ref(), None, template).unwrap_err();
            match e {
                EngineError::InvalidRequest { param, .. } => param.unwrap_or_default(),
                other => panic!("{other:?}"),
            }
        };
        // A template that cannot render tools: refused, not ignored.
        assert_eq!(
            err(std::slice::from_ref(&tool), None, Some("{{ messages }}")),
            "tools"
        );
        assert_eq!(err(std::slice::from_ref(&tool), None, None), "tools");
        let strict = json!({"type": "function", "function": {"name": "f", "strict": true}});
        assert_eq!(err(std::slice::from_ref(&strict), None, hermes), "tools");
        assert!(parse(Some(&[strict]), Some(&json!("required")), None, hermes).is_ok());
        assert_eq!(err(&[json!({"type": "retrieval"})], None, hermes), "tools");
        assert_eq!(
            err(
                &[json!({"type": "function", "function": {"name": "a b"}})],
                None,
                hermes
            ),
            "tools"
        );
        assert_eq!(err(&[tool.clone(), tool.clone()], None, hermes), "tools");
        assert_eq!(
            err(std::slice::from_ref(&tool), Some(json!("always")), hermes),
            "tool_choice"
        );
        assert_eq!(
            err(
                std::slice::from_ref(&tool),
                Some(json!({"type": "function", "function": {"name": "g"}})),
                hermes
            ),
            "tool_choice"
        );
        let many = vec![tool; MAX_TOOLS + 1];
        assert_eq!(err(&many, None, hermes), "tools");
        // No tools: only the choices that ask for nothing.
        assert!(
            parse(None, Some(&json!("auto")), None, None)
                .unwrap()
                .is_none()
        );
        assert!(parse(Some(&[]), Some(&json!("required")), None, hermes).is_err());
    }

    #[test]
    fn template_calls_parse_arguments_text() {
        let calls = template_calls(
            &[json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}})],
            1,
        )
        .unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(calls[0]["id"], json!("c1"));
        let e = template_calls(&[json!({"function": {"name": "f", "arguments": "{x"}})], 3)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("messages[3].tool_calls[0].function.arguments"),
            "{e}"
        );
    }
}
