//! Tool calling: a request's `tools` and `tool_choice` checked against what the
//! model's chat template can render, the grammar that forces a call when one is
//! required, and the model's text parsed back into `tool_calls` (whole or streamed).
//!
//! The call format is the one the chat template teaches the model, recognised from
//! the template's text: Hermes/Qwen (`<tool_call>{…}</tool_call>`), Llama 3 JSON
//! (`{"name": …, "parameters": …}`) or Mistral (`[TOOL_CALLS] [{…}]`). A template that
//! renders none of them cannot take `tools`: the request is refused naming the
//! field, never answered as if no tools had been offered.

use serde_json::{Map, Value, json};

use crate::sampling::grammar::Grammar;
use crate::{EngineError, Result};

/// Most tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit).
const MAX_NAME: usize = 64;

/// How the model writes a call, as its chat template teaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call
    /// (NousResearch Hermes, Qwen 2/2.5/3).
    Hermes,
    /// A bare JSON object `{"name": …, "parameters": {…}}`, calls separated by `;`,
    /// optionally after `<|python_tag|>` (Llama 3.1–3.3).
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]` (Mistral).
    Mistral,
}

impl ToolFormat {
    /// The format a chat template renders tool calls in; `None` when it renders none
    /// this module parses.
    #[must_use]
    pub fn of_template(template: &str) -> Option<Self> {
        if !template.contains("tools") {
            return None;
        }
        if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
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
pub struct Function {
    pub name: String,
    /// Its arguments' JSON schema.
    pub parameters: Value,
}

/// A request's validated tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// As sent, for the chat template.
    pub raw: Vec<Value>,
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
    pub format: ToolFormat,
}

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
pub fn parse(
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
    pub fn grammar(&self) -> Option<Grammar> {
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

    /// Parses tool calls from the model's text (`None` choice: none are looked for).
    #[must_use]
    pub fn stream(&self, call_ids: CallIds) -> ToolStream {
        ToolStream {
            format: (self.choice != ToolChoice::None).then_some(self.format),
            ids: call_ids,
            buf: String::new(),
            mode: Mode::Undecided,
            calls: 0,
            single: !self.parallel,
        }
    }

    /// Stop strings that end the answer after its one call when
    /// `parallel_tool_calls` is false (Hermes: the call's closing tag; the parser
    /// takes the unclosed block).
    #[must_use]
    pub fn stops(&self) -> Vec<String> {
        match (self.parallel, &self.choice, self.format) {
            (false, ToolChoice::Auto, ToolFormat::Hermes) => vec![HERMES_CLOSE.to_owned()],
            _ => Vec::new(),
        }
    }
}

/// The ids given to one choice's calls: unique per request and choice.
#[derive(Clone, Debug)]
pub struct CallIds {
    base: u64,
}

impl CallIds {
    /// Ids for the calls of choice `index` of request `request` (its response id).
    #[must_use]
    pub fn new(request: &str, index: usize) -> Self {
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
pub struct ToolCall {
    /// Its position among this choice's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI's form).
    pub arguments: String,
}

impl ToolCall {
    /// As `message.tool_calls[i]` (whole answers; streamed deltas add `index`).
    #[must_use]
    pub fn to_json(&self, with_index: bool) -> Value {
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
pub enum Piece {
    Content(String),
    Call(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace seen yet (Llama 3 / Mistral: a call starts the answer).
    Undecided,
    /// Plain text; Hermes still watches for `<tool_call>`.
    Content,
    /// Inside calls: held until they parse.
    Calls,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Turns one choice's text deltas into content deltas and whole tool calls. Content
/// that might begin a call is held back until it is known not to; calls are sent once
/// complete (each as one delta with its full arguments). Text that looked like a call
/// but does not parse is returned as content: nothing the model wrote is dropped.
#[derive(Debug)]
pub struct ToolStream {
    /// `None`: `tool_choice: none`, the text passes through.
    format: Option<ToolFormat>,
    ids: CallIds,
    buf: String,
    mode: Mode,
    calls: usize,
    /// `parallel_tool_calls: false`: calls after the first are not the answer's.
    single: bool,
}

impl ToolStream {
    /// Calls parsed so far.
    #[must_use]
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Takes the next text delta.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let Some(format) = self.format else {
            return content(text.to_owned());
        };
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match (format, self.mode) {
                (_, Mode::Undecided) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    let start = match format {
                        ToolFormat::Hermes => Start::No,
                        ToolFormat::Llama3Json => call_start(t, PYTHON_TAG, "{"),
                        ToolFormat::Mistral => call_start(t, MISTRAL_TAG, "[{"),
                    };
                    self.mode = match start {
                        // Not known yet: wait for more text.
                        Start::Maybe => return out,
                        Start::Yes => Mode::Calls,
                        Start::No => Mode::Content,
                    };
                }
                (ToolFormat::Hermes, Mode::Content) => {
                    match self.buf.find(HERMES_OPEN) {
                        Some(at) => {
                            let before = self.buf[..at].trim_end().to_owned();
                            self.buf.drain(..at);
                            out.extend(content(before));
                            self.mode = Mode::Calls;
                        }
                        None => {
                            // Hold back trailing whitespace and a partial marker.
                            let keep = held_back(&self.buf, HERMES_OPEN);
                            let send: String = self.buf.drain(..keep).collect();
                            out.extend(content(send));
                            return out;
                        }
                    }
                }
                (ToolFormat::Hermes, Mode::Calls) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    if !t.starts_with(HERMES_OPEN) {
                        if HERMES_OPEN.starts_with(t) {
                            return out;
                        }
                        // Text after the calls: content again.
                        self.mode = Mode::Content;
                        continue;
                    }
                    let Some(end) = t.find(HERMES_CLOSE) else {
                        return out;
                    };
                    let block = t[HERMES_OPEN.len()..end].to_owned();
                    let whole = t[..end + HERMES_CLOSE.len()].to_owned();
                    let skip = self.buf.len() - t.len() + end + HERMES_CLOSE.len();
                    self.buf.drain(..skip);
                    match self.one_call(&block, "arguments") {
                        Some(call) => out.extend(call),
                        None => out.push(Piece::Content(whole)),
                    }
                }
                // Llama 3 and Mistral: the whole answer is calls or it is not.
                (_, Mode::Calls) => return out,
                (_, Mode::Content) => {
                    let send = std::mem::take(&mut self.buf);
                    out.extend(content(send));
                    return out;
                }
            }
        }
    }

    /// The end of the text: whatever was held back, as calls or as content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let Some(format) = self.format else {
            return Vec::new();
        };
        let rest = std::mem::take(&mut self.buf);
        match (format, self.mode) {
            (ToolFormat::Hermes, Mode::Calls) => {
                // Whitespace after the last call is no content.
                let t = rest.trim();
                if t.is_empty() {
                    return Vec::new();
                }
                // A last block the model did not close (it stopped at EOS, or a stop
                // string or `max_tokens` cut the closing tag).
                if let Some(block) = t.strip_prefix(HERMES_OPEN) {
                    let block = strip_partial_suffix(block.trim_end(), HERMES_CLOSE);
                    if let Some(call) = self.one_call(block, "arguments") {
                        return call.into_iter().collect();
                    }
                }
                content(rest)
            }
            (ToolFormat::Llama3Json, Mode::Calls) => {
                let t = rest.trim();
                let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t);
                self.many(t, ToolFormat::Llama3Json)
                    .unwrap_or_else(|| content(rest))
            }
            (ToolFormat::Mistral, Mode::Calls) => {
                let t = rest.trim();
                let t = t.strip_prefix(MISTRAL_TAG).unwrap_or(t);
                self.many(t, ToolFormat::Mistral)
                    .unwrap_or_else(|| content(rest))
            }
            (_, _) => content(rest),
        }
    }

    /// One call's JSON object, `{"name": …, "<args>": {…}}`: `None` when it does not
    /// parse, `Some(None)` when it does but is a call beyond the one allowed.
    fn one_call(&mut self, text: &str, args_key: &str) -> Option<Option<Piece>> {
        let v: Value = serde_json::from_str(text.trim()).ok()?;
        let o = v.as_object()?;
        o.get("name")?.as_str()?;
        if self.single && self.calls >= 1 {
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
        let index = self.calls;
        self.calls += 1;
        Some(ToolCall {
            index,
            id: self.ids.id(index),
            name,
            arguments,
        })
    }

    /// Llama 3 (`{…}; {…}`) or Mistral (`[{…}, …]`) calls: all of them or none.
    fn many(&mut self, text: &str, format: ToolFormat) -> Option<Vec<Piece>> {
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
        let first = self.calls;
        let mut out = Vec::new();
        if objects.is_empty() {
            return None;
        }
        let keep = if self.single { 1 } else { objects.len() };
        for o in objects.iter().take(keep) {
            match o.as_object().and_then(|o| self.call_of(o, key)) {
                Some(c) => out.push(Piece::Call(c)),
                None => {
                    self.calls = first;
                    return None;
                }
            }
        }
        Some(out)
    }
}

fn content(s: String) -> Vec<Piece> {
    if s.is_empty() {
        Vec::new()
    } else {
        vec![Piece::Content(s)]
    }
}

/// Whether an answer (`t`, leading whitespace trimmed) is calls.
enum Start {
    Yes,
    No,
    Maybe,
}

/// `t` begins with `tag`, or with `open` (`{` or `[{`, whitespace between allowed)
/// followed by `"name"`; `Maybe` while it is a strict prefix of either.
fn call_start(t: &str, tag: &str, open: &str) -> Start {
    if t.starts_with(tag) {
        return Start::Yes;
    }
    let tag_prefix = tag.starts_with(t);
    // Walk `open` then `"name"`, skipping whitespace between them.
    let want: Vec<char> = open.chars().chain("\"name\"".chars()).collect();
    let open_len = open.chars().count();
    let mut i = 0;
    for c in t.chars() {
        if i == want.len() {
            return Start::Yes;
        }
        if c.is_whitespace() && i > 0 && i <= open_len {
            continue;
        }
        if c != want[i] {
            return if tag_prefix { Start::Maybe } else { Start::No };
        }
        i += 1;
    }
    if i == want.len() {
        Start::Yes
    } else {
        Start::Maybe
    }
}

/// `s` without a trailing partial `tag` (a cut closing tag).
fn strip_partial_suffix<'a>(s: &'a str, tag: &str) -> &'a str {
    for k in (1..=tag.len()).rev() {
        if s.len() >= k && s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]) {
            return s[..s.len() - k].trim_end();
        }
    }
    s
}

/// How much of `buf` can be sent as content: all but trailing whitespace and a
/// trailing partial `tag` (which might become a call).
fn held_back(buf: &str, tag: &str) -> usize {
    let mut end = buf.len();
    for k in (1..tag.len()).rev() {
        if buf.len() >= k
            && buf.is_char_boundary(buf.len() - k)
            && tag.starts_with(&buf[buf.len() - k..])
        {
            end = buf.len() - k;
            break;
        }
    }
    buf[..end].trim_end().len()
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

/// A message's `tool_calls` as chat templates expect them: arguments as a JSON value
/// (templates write `arguments | tojson`), not OpenAI's JSON text (vLLM does the same).
pub fn template_calls(calls: &[Value], at: usize) -> Result<Vec<Value>> {
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

    fn tools(format: ToolFormat, choice: ToolChoice) -> Tools {
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

    fn run(t: &Tools, pieces: &[&str]) -> Vec<Piece> {
        let mut s = t.stream(CallIds::new("test", 0));
        let mut out: Vec<Piece> = pieces.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish());
        // Adjacent content pieces joined: what a client assembles.
        let mut joined: Vec<Piece> = Vec::new();
        for p in out {
            match (joined.last_mut(), p) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    fn call(p: &Piece) -> (&str, Value) {
        match p {
            Piece::Call(c) => (c.name.as_str(), serde_json::from_str(&c.arguments).unwrap()),
            Piece::Content(t) => panic!("content {t:?}, not a call"),
        }
    }

    /// Every way of cutting the text into deltas gives the same pieces.
    fn all_splits(t: &Tools, text: &str) -> Vec<Piece> {
        let whole = run(t, &[text]);
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for &(i, _) in &chars {
            let split = run(t, &[&text[..i], &text[i..]]);
            assert_eq!(split, strip_ids(&whole, &split), "split at {i} of {text:?}");
        }
        let by_char: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = by_char.iter().map(String::as_str).collect();
        let chars_run = run(t, &refs);
        assert_eq!(chars_run, strip_ids(&whole, &chars_run));
        whole
    }

    /// `whole` with the call ids of `like` (ids carry a timestamp).
    fn strip_ids(whole: &[Piece], like: &[Piece]) -> Vec<Piece> {
        whole
            .iter()
            .zip(
                like.iter()
                    .chain(std::iter::repeat(&Piece::Content(String::new()))),
            )
            .map(|(w, l)| match (w, l) {
                (Piece::Call(a), Piece::Call(b)) => Piece::Call(ToolCall {
                    id: b.id.clone(),
                    ..a.clone()
                }),
                (w, _) => w.clone(),
            })
            .collect()
    }

    #[test]
    fn hermes_calls_are_parsed_whole_and_streamed() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let p = all_splits(&t, text);
        assert_eq!(p.len(), 3, "{p:?}");
        assert_eq!(p[0], Piece::Content("Let me check.".into()));
        assert_eq!(call(&p[1]), ("get_weather", json!({"city": "Paris"})));
        assert_eq!(call(&p[2]), ("get_time", json!({})));
        let (Piece::Call(a), Piece::Call(b)) = (&p[1], &p[2]) else {
            unreachable!()
        };
        assert_eq!((a.index, b.index), (0, 1));
        assert_ne!(a.id, b.id);
    }

    #[test]
    fn hermes_text_without_calls_passes_through_unchanged() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        for text in [
            "The weather is <b>fine</b> today.",
            "a < b and <tool",
            "  spaced  ",
        ] {
            let p = all_splits(&t, text);
            assert_eq!(p, vec![Piece::Content(text.into())], "{text:?}");
        }
    }

    #[test]
    fn hermes_block_that_does_not_parse_is_content() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        let text =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>";
        assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
        // Unclosed at the end: parsed if it is complete JSON, else content.
        let open = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}";
        assert_eq!(call(&all_splits(&t, open)[0]).0, "get_time");
        let cut = "<tool_call>\n{\"name\": \"get_ti";
        assert_eq!(all_splits(&t, cut), vec![Piece::Content(cut.into())]);
    }

    #[test]
    fn llama3_json_calls_and_plain_answers() {
        let t = tools(ToolFormat::Llama3Json, ToolChoice::Auto);
        let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo; Norway\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
        let p = all_splits(&t, text);
        assert_eq!(
            call(&p[0]),
            ("get_weather", json!({"city": "Oslo; Norway"}))
        );
        assert_eq!(call(&p[1]), ("get_time", json!({})));
        let plain = "It is sunny {probably}.";
        assert_eq!(all_splits(&t, plain), vec![Piece::Content(plain.into())]);
        let brace = "{not json";
        assert_eq!(all_splits(&t, brace), vec![Piece::Content(brace.into())]);
    }

    #[test]
    fn mistral_calls_with_and_without_the_tag() {
        let t = tools(ToolFormat::Mistral, ToolChoice::Auto);
        for text in [
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
            // The tag is a special token: decoding without special tokens drops it.
            " [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
        ] {
            let p = all_splits(&t, text);
            assert_eq!(p.len(), 1, "{p:?}");
            assert_eq!(call(&p[0]), ("get_weather", json!({"city": "Rome"})));
        }
        let plain = "[1, 2] are numbers";
        assert_eq!(all_splits(&t, plain), vec![Piece::Content(plain.into())]);
    }

    /// A stream that begins like a call but is not one is sent as it comes, not held
    /// to the end.
    #[test]
    fn answers_that_only_begin_like_calls_stream_at_once() {
        for (format, text) in [
            (ToolFormat::Llama3Json, "<b>bold</b> text"),
            (ToolFormat::Llama3Json, "{x} is a set"),
            (ToolFormat::Mistral, "[a link](http://x) here"),
            (ToolFormat::Mistral, "[ {not a call"),
        ] {
            let t = tools(format, ToolChoice::Auto);
            let mut s = t.stream(CallIds::new("t", 0));
            let mut sent = String::new();
            for c in text.chars() {
                for p in s.push(&c.to_string()) {
                    let Piece::Content(c) = p else {
                        panic!("{p:?}")
                    };
                    sent.push_str(&c);
                }
            }
            assert!(
                sent.len() + 4 >= text.len(),
                "{format:?} held {text:?} back: sent {sent:?}"
            );
            assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
        }
    }

    #[test]
    fn leftovers_after_calls_and_cut_tags() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        // Whitespace after the calls is no content.
        let p = all_splits(
            &t,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n\n",
        );
        assert_eq!(p.len(), 1, "{p:?}");
        // A closing tag cut short, arguments left out: still the call.
        let p = all_splits(&t, "<tool_call>\n{\"name\": \"get_time\"}\n</tool_ca");
        assert_eq!(call(&p[0]), ("get_time", json!({})));
        // One call allowed: a later block that is no call stays content.
        let mut single = tools(ToolFormat::Hermes, ToolChoice::Auto);
        single.parallel = false;
        let p = all_splits(
            &single,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><tool_call>[1]</tool_call>",
        );
        assert!(
            matches!(p.as_slice(), [Piece::Call(_), Piece::Content(_)]),
            "{p:?}"
        );
    }

    #[test]
    fn tool_choice_none_returns_the_text_as_is() {
        let t = tools(ToolFormat::Hermes, ToolChoice::None);
        let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
    }

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
    fn formats_are_recognised_from_templates() {
        assert_eq!(
            ToolFormat::of_template("{% for tool in tools %}<tool_call>"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}[TOOL_CALLS]"),
            Some(ToolFormat::Mistral)
        );
        assert_eq!(
            ToolFormat::of_template("tools ... <|python_tag|>"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::of_template("<|im_start|>{{ m.content }}"), None);
    }

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
