//! The calls in a model's text: one call's JSON object, or Llama 3's and Mistral's
//! lists of them, read into numbered [`ToolCall`]s with ids unique to their choice.

use serde_json::{Map, Value, json};

use super::formats::ToolFormat;

/// The ids given to one choice's calls: unique per request and choice.
#[derive(Clone, Debug)]
pub(crate) struct CallIds {
    base: u64,
}

impl CallIds {
    /// Ids for the calls of choice `index` of request `request` (its response id).
    #[must_use]
    pub(crate) fn new(request: &str, index: usize) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut seed = request.as_bytes().to_vec();
        seed.extend_from_slice(&(index as u64).to_le_bytes());
        seed.extend_from_slice(&nanos.to_le_bytes());
        CallIds {
            base: xxhash_rust::xxh3::xxh3_64(&seed),
        }
    }

    fn id(&self, k: usize) -> String {
        format!("call_{:016x}{k:02x}", self.base)
    }
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    /// Its position among this choice's calls.
    pub(super) index: usize,
    pub(super) id: String,
    pub(super) name: String,
    /// The arguments as JSON text (OpenAI's form).
    pub(super) arguments: String,
}

impl ToolCall {
    /// As `message.tool_calls[i]` (whole answers; streamed deltas add `index`).
    #[must_use]
    pub(crate) fn to_json(&self, with_index: bool) -> Value {
        let mut v = json!({
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if with_index && let Some(o) = v.as_object_mut() {
            o.insert("index".into(), json!(self.index));
        }
        v
    }
}

/// What the model's text turned into, piece by piece.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Piece {
    Content(String),
    Call(ToolCall),
}

/// One choice's calls so far: numbered in order, and cut to the first under
/// `parallel_tool_calls: false`.
#[derive(Debug)]
pub(super) struct Calls {
    ids: CallIds,
    /// Calls parsed so far.
    pub(super) count: usize,
    /// `parallel_tool_calls: false`: calls after the first are not the answer's.
    single: bool,
}

impl Calls {
    pub(super) fn new(ids: CallIds, single: bool) -> Self {
        Calls {
            ids,
            count: 0,
            single,
        }
    }

    /// One call's JSON object, `{"name": …, "<args>": {…}}`: `None` when it does not
    /// parse, `Some(None)` when it does but is a call beyond the one allowed.
    pub(super) fn one_call(&mut self, text: &str, args_key: &str) -> Option<Option<Piece>> {
        let v: Value = serde_json::from_str(text.trim()).ok()?;
        let o = v.as_object()?;
        o.get("name")?.as_str()?;
        if self.single && self.count >= 1 {
            return Some(None);
        }
        let call = self.call_of(o, args_key)?;
        Some(Some(Piece::Call(call)))
    }

    fn call_of(&mut self, o: &Map<String, Value>, args_key: &str) -> Option<ToolCall> {
        let name = o.get("name")?.as_str()?.to_owned();
        let args = o
            .get(args_key)
            .or_else(|| o.get("arguments"))
            .or_else(|| o.get("parameters"));
        // Some models write the arguments as a JSON string already, or leave out
        // those of a function that takes none.
        let arguments = match args {
            None => "{}".to_owned(),
            Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            Some(_) => return None,
        };
        let index = self.count;
        self.count += 1;
        Some(ToolCall {
            index,
            id: self.ids.id(index),
            name,
            arguments,
        })
    }

    /// Llama 3 (`{…}; {…}`) or Mistral (`[{…}, …]`) calls: all of them or none.
    pub(super) fn many(&mut self, text: &str, format: ToolFormat) -> Option<Vec<Piece>> {
        let objects: Vec<Value> = match format {
            ToolFormat::Mistral => match serde_json::from_str::<Value>(text).ok()? {
                Value::Array(a) if !a.is_empty() => a,
                _ => return None,
            },
            _ => {
                let mut all = Vec::new();
                for part in split_top_level(text, ';') {
                    all.push(serde_json::from_str::<Value>(part.trim()).ok()?);
                }
                all
            }
        };
        let key = if format == ToolFormat::Llama3Json {
            "parameters"
        } else {
            "arguments"
        };
        let first = self.count;
        let mut out = Vec::new();
        if objects.is_empty() {
            return None;
        }
        let keep = if self.single { 1 } else { objects.len() };
        for o in objects.iter().take(keep) {
            match o.as_object().and_then(|o| self.call_of(o, key)) {
                Some(c) => out.push(Piece::Call(c)),
                None => {
                    self.count = first;
                    return None;
                }
            }
        }
        Some(out)
    }
}

/// Splits `text` at `sep` outside JSON strings, objects and arrays.
fn split_top_level(text: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut in_str, mut escaped, mut start) = (0i32, false, false, 0);
    for (i, c) in text.char_indices() {
        if in_str {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}
