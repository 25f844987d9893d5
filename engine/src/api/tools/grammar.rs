//! The grammar that forces a call when `tool_choice` requires one: each call held to
//! its function's schema and laid out as the model's format writes it.

use serde_json::{Value, json};

use super::formats::ToolFormat;
use super::{Function, ToolChoice, Tools};
use crate::sampling::grammar::Grammar;

/// One call's JSON as the format writes it, held to the function's schema.
fn call_schema(format: ToolFormat, f: &Function) -> Value {
    let args = match format {
        ToolFormat::Llama3Json => "parameters",
        ToolFormat::Hermes | ToolFormat::Mistral => "arguments",
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": f.name}, args: f.parameters},
        "required": ["name", args],
        "additionalProperties": false,
    })
}

impl Tools {
    /// The grammar that forces a valid call (`required` or a named function); `None`
    /// when the model chooses.
    #[must_use]
    pub(crate) fn grammar(&self) -> Option<Grammar> {
        let candidates: Vec<&Function> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let schemas: Vec<Value> = candidates
            .iter()
            .map(|f| call_schema(self.format, f))
            .collect();
        let mut one = if schemas.len() == 1 {
            schemas.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": schemas})
        };
        // Laid out as chat templates render calls (Python's `json.dumps`: ", " and
        // ": "), the form the model saw; no other whitespace (a small model held to a
        // schema otherwise pads with it).
        if let Some(o) = one.as_object_mut() {
            o.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
        let call = format!("%json {one}");
        // A named function is one call; `required` may make several unless
        // `parallel_tool_calls` is false.
        let many = self.parallel && matches!(self.choice, ToolChoice::Required);
        let lark = match self.format {
            ToolFormat::Hermes => {
                let rep = if many { "+" } else { "" };
                format!("start: (\"<tool_call>\\n\" call \"\\n</tool_call>\"){rep}\ncall: {call}\n")
            }
            ToolFormat::Llama3Json => {
                let rest = if many { " (\"; \" call)*" } else { "" };
                format!("start: call{rest}\ncall: {call}\n")
            }
            ToolFormat::Mistral => {
                let rest = if many { " (\", \" call)*" } else { "" };
                format!("start: \"[TOOL_CALLS] [\" call{rest} \"]\"\ncall: {call}\n")
            }
        };
        Some(Grammar::Lark(lark))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tools::fixtures::tools;
    use crate::api::tools::{CallIds, Piece};

    #[test]
    fn forced_calls_are_valid_calls_of_the_named_functions() {
        use crate::sampling::grammar::tests::accepts;
        let weather = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        let time = r#"{"name": "get_time", "arguments": {}}"#;
        let hermes = |c: &str| format!("<tool_call>\n{c}\n</tool_call>");
        let g = tools(ToolFormat::Hermes, ToolChoice::Required)
            .grammar()
            .unwrap();
        assert!(accepts(&g, &hermes(weather)));
        assert!(
            accepts(&g, &(hermes(weather) + &hermes(time))),
            "parallel calls"
        );
        assert!(!accepts(
            &g,
            &hermes(r#"{"name": "get_wether", "arguments": {"city": "Paris"}}"#)
        ));
        assert!(
            !accepts(&g, &hermes(r#"{"name": "get_weather", "arguments": {}}"#)),
            "city is required"
        );
        assert!(
            !accepts(&g, &hermes(r#"{"name":"get_time","arguments":{}}"#)),
            "laid out as templates render calls"
        );
        assert!(!accepts(&g, "Sure!"), "required means a call");
        let named = tools(ToolFormat::Hermes, ToolChoice::Named("get_time".into()))
            .grammar()
            .unwrap();
        assert!(accepts(&named, &hermes(time)));
        assert!(!accepts(&named, &hermes(weather)));
        assert!(
            !accepts(&named, &(hermes(time) + &hermes(time))),
            "a named function is one call"
        );
        let mut serial = tools(ToolFormat::Hermes, ToolChoice::Required);
        serial.parallel = false;
        assert!(!accepts(
            &serial.grammar().unwrap(),
            &(hermes(weather) + &hermes(time))
        ));
        let llama = tools(ToolFormat::Llama3Json, ToolChoice::Required)
            .grammar()
            .unwrap();
        assert!(accepts(
            &llama,
            r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}"#
        ));
        let mistral = tools(ToolFormat::Mistral, ToolChoice::Named("get_weather".into()))
            .grammar()
            .unwrap();
        assert!(accepts(&mistral, &format!("[TOOL_CALLS] [{weather}]")));
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
        ] {
            assert!(tools(format, ToolChoice::Auto).grammar().is_none());
        }
    }

    #[test]
    fn a_forced_call_cut_by_max_tokens_still_closes() {
        use crate::sampling::grammar::tests::run_to_budget;
        let g = tools(ToolFormat::Hermes, ToolChoice::Named("get_weather".into()))
            .grammar()
            .unwrap();
        let (text, closed) = run_to_budget(
            &g,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"guf",
            30,
        );
        assert!(closed, "{text}");
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        let mut s = t.stream(CallIds::new("t", 0));
        let mut p = s.push(&text);
        p.extend(s.finish());
        assert!(
            matches!(p.as_slice(), [Piece::Call(c)] if c.name == "get_weather"),
            "{text}: {p:?}"
        );
    }
}
