//! JSON text as Python's `json.dumps` writes it: what Hugging Face's chat templates
//! get from `tojson` (transformers registers its own filter: `", "` and `": "`
//! separators, keys in their order, non-ASCII kept). minijinja's built-in `tojson`
//! writes compact, HTML-escaped JSON, so a tool's schema would reach the model in a
//! form it was not trained on.

use serde_json::Value;

/// How to write it (`json.dumps`' keyword arguments that templates use).
#[derive(Clone, Debug, Default)]
pub struct Style {
    /// Pretty-printed with this many spaces per level (`indent=`).
    pub indent: Option<usize>,
    /// `(item, key)` separators; `None`: Python's default for the indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
    /// Non-ASCII as `\uXXXX` escapes.
    pub ensure_ascii: bool,
}

/// `json.dumps(v, …)`.
#[must_use]
pub fn dumps(v: &Value, style: &Style) -> String {
    let (item, key) = match &style.separators {
        Some((i, k)) => (i.clone(), k.clone()),
        // Python drops the space after "," when indenting (it ends the line).
        None if style.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    write(v, style, &item, &key, 0, &mut out);
    out
}

fn newline(style: &Style, depth: usize, out: &mut String) {
    if let Some(n) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn string(s: &str, style: &Style, out: &mut String) {
    let quoted = serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned());
    if style.ensure_ascii {
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    } else {
        out.push_str(&quoted);
    }
}

fn write(v: &Value, style: &Style, item: &str, key: &str, depth: usize, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => string(s, style, out),
        Value::Array(a) if a.is_empty() => out.push_str("[]"),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(style, depth + 1, out);
                write(x, style, item, key, depth + 1, out);
            }
            newline(style, depth, out);
            out.push(']');
        }
        Value::Object(o) if o.is_empty() => out.push_str("{}"),
        Value::Object(o) => {
            let mut entries: Vec<(&String, &Value)> = o.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(style, depth + 1, out);
                string(k, style, out);
                out.push_str(key);
                write(x, style, item, key, depth + 1, out);
            }
            newline(style, depth, out);
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // Expected strings are Python 3's `json.dumps` output for the same values.
    #[test]
    fn matches_python_json_dumps() {
        let v = json!({"type": "function", "function": {"name": "f", "parameters": {"b": [1, 2.5], "a": {}}, "d": "é<>\n"}});
        assert_eq!(
            dumps(&v, &Style::default()),
            r#"{"type": "function", "function": {"name": "f", "parameters": {"b": [1, 2.5], "a": {}}, "d": "é<>\n"}}"#
        );
        let indented = Style {
            indent: Some(2),
            ..Style::default()
        };
        assert_eq!(
            dumps(&json!({"a": [1, {"b": null}], "c": []}), &indented),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": []\n}"
        );
        let ascii = Style {
            ensure_ascii: true,
            sort_keys: true,
            ..Style::default()
        };
        assert_eq!(
            dumps(&json!({"z": "é😀", "a": true}), &ascii),
            r#"{"a": true, "z": "\u00e9\ud83d\ude00"}"#
        );
    }
}
