//! Text in and out: tokenisation, chat templates, incremental detokenisation that never
//! splits a UTF-8 character across stream chunks, and stop strings.

use minijinja::{Environment, Value as JValue};
use preheat_snapshot::{Manifest, ModelCard, Snapshot};
use serde::Serialize;

use std::sync::{Arc, OnceLock};

use crate::sampling::grammar::GrammarCompiler;
use crate::{EngineError, Result};

/// A chat message as templates see it.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The participant's name (OpenAI's `name`), for templates that show it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's tool calls, arguments as JSON values (what templates
    /// expect; absent when there are none, so `if message.tool_calls` is false).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tokenizer as it travels between processes (a worker hands it to the gateway).
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct TokenizerParts {
    /// `tokenizer.json` text.
    pub json: String,
    pub template: Option<String>,
    /// The model's own template for chats with tools (absent from older workers).
    #[serde(default)]
    pub tool_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub add_bos: Option<u32>,
    pub eos_ids: Vec<u32>,
}

/// The model's tokenizer with its chat template and special tokens.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<String>,
    /// Renders chats that offer tools, where the model has such a template.
    tool_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: Option<u32>,
    eos_ids: Vec<u32>,
    /// Built on the first request with a grammar (its trie takes a pass over the
    /// vocabulary); an error is kept, not retried per request.
    grammar: OnceLock<std::result::Result<Arc<GrammarCompiler>, String>>,
}

impl Tokenizer {
    /// Loads the tokenizer embedded in a snapshot.
    pub fn from_snapshot(snap: &Snapshot) -> Result<Self> {
        Self::from_manifest(snap.manifest(), snap.tokenizer_json()?)
    }

    /// The tokenizer a model card describes (a gateway's, with no weights loaded).
    pub fn from_card(card: &ModelCard) -> Result<Self> {
        Self::from_manifest(&card.manifest, card.tokenizer_json.as_deref())
    }

    fn from_manifest(m: &Manifest, json: Option<&[u8]>) -> Result<Self> {
        let json =
            json.ok_or_else(|| EngineError::Tokenizer("the snapshot has no tokenizer".into()))?;
        let inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let sec = m.tokenizer.as_ref();
        let bos_token = sec.and_then(|t| t.bos_token.clone());
        let eos_token = sec.and_then(|t| t.eos_token.clone());
        let add_bos = if sec.is_some_and(|t| t.add_bos_token) {
            bos_token
                .as_deref()
                .and_then(|b| inner.token_to_id(b))
                .or(m.model.bos_token_id)
        } else {
            None
        };
        let mut eos_ids = m.model.eos_token_ids.clone();
        eos_ids.extend(&m.generation.eos_token_ids);
        if let Some(id) = eos_token.as_deref().and_then(|e| inner.token_to_id(e)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let template = m.chat_template.clone();
        let tool_template = m.tool_use_template.clone();
        for t in template.iter().chain(&tool_template) {
            // Fail at load, not on the first chat request.
            template_env(t)?;
        }
        Ok(Tokenizer {
            inner,
            template,
            tool_template,
            bos_token,
            eos_token,
            add_bos,
            eos_ids,
            grammar: OnceLock::new(),
        })
    }

    /// Everything needed to rebuild this tokenizer elsewhere.
    pub fn to_parts(&self) -> Result<TokenizerParts> {
        Ok(TokenizerParts {
            json: self
                .inner
                .to_string(false)
                .map_err(|e| EngineError::Tokenizer(e.to_string()))?,
            template: self.template.clone(),
            tool_template: self.tool_template.clone(),
            bos_token: self.bos_token.clone(),
            eos_token: self.eos_token.clone(),
            add_bos: self.add_bos,
            eos_ids: self.eos_ids.clone(),
        })
    }

    /// Rebuilds a tokenizer from [`Tokenizer::to_parts`].
    pub fn from_parts(p: TokenizerParts) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(p.json.as_bytes())
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        for t in p.template.iter().chain(&p.tool_template) {
            template_env(t)?;
        }
        Ok(Tokenizer {
            inner,
            template: p.template,
            tool_template: p.tool_template,
            bos_token: p.bos_token,
            eos_token: p.eos_token,
            add_bos: p.add_bos,
            eos_ids: p.eos_ids,
            grammar: OnceLock::new(),
        })
    }

    /// The compiler of structured-output grammars for this vocabulary.
    pub fn grammar(&self) -> Result<Arc<GrammarCompiler>> {
        self.grammar
            .get_or_init(|| {
                let json = self
                    .inner
                    .to_string(false)
                    .map_err(|e| format!("structured outputs: {e}"))?;
                GrammarCompiler::new(&self.inner, &json, &self.eos_ids)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(EngineError::Tokenizer)
    }

    /// Token ids that end generation unless the request ignores EOS.
    #[must_use]
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes `text`, adding BOS when the model wants it and the text lacks it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(bos) = self.add_bos
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Encodes text that already carries its special tokens (a rendered chat).
    pub fn encode_no_bos(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// The token's string form (for logprobs).
    #[must_use]
    pub fn id_to_token(&self, id: u32) -> String {
        self.decode(&[id]).unwrap_or_default()
    }

    /// This tokenizer with `template` as its chat template (an operator's
    /// `--chat-template`, e.g. one that renders tools); checked here, not on the first
    /// chat request.
    pub fn with_chat_template(mut self, template: String) -> Result<Self> {
        template_env(&template)?;
        self.template = Some(template);
        // The operator's template renders every chat, tools or not.
        self.tool_template = None;
        Ok(self)
    }

    /// The source of the template that renders a chat (`tools`: one that offers
    /// tools; the model's `tool_use` template where it has one).
    #[must_use]
    pub fn chat_template(&self, tools: bool) -> Option<&str> {
        match (tools, &self.tool_template) {
            (true, Some(t)) => Some(t),
            _ => self.template.as_deref(),
        }
    }

    /// Renders a chat with the model's template; `tools` (OpenAI's `tools` entries)
    /// are handed to it as Hugging Face's `apply_chat_template(tools=…)` does.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self.chat_template(tools.is_some()).ok_or_else(|| {
            EngineError::invalid(
                "this model has no chat template; use /v1/completions",
                "messages",
            )
        })?;
        let env = template_env(t)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| EngineError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => JValue::from(minijinja::value::Serde(messages)),
            tools => tools.map(|t| JValue::from(minijinja::value::Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| EngineError::invalid(format!("chat template: {e}"), "messages"))
    }
}

fn template_env(src: &str) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    // As transformers compiles chat templates: a block tag's own line leaves no
    // newline or indentation behind.
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| EngineError::Template(e.to_string()))?,
    );
    // Templates written for Python Jinja call str methods (.strip(), .startswith()…).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<JValue, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_filter("tojson", tojson);
    env.add_template_owned("chat".to_owned(), src.to_owned())
        .map_err(|e| EngineError::Template(e.to_string()))?;
    Ok(env)
}

/// Hugging Face's `tojson` (Python's `json.dumps` layout), not minijinja's.
fn tojson(
    v: JValue,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<JValue, minijinja::Error> {
    let bad = |e: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e);
    let json = serde_json::to_value(&v).map_err(|e| bad(format!("tojson: {e}")))?;
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        None => None,
        Some(s) if s.len() == 2 => Some((s[0].clone(), s[1].clone())),
        Some(_) => return Err(bad("tojson: separators must be two strings".into())),
    };
    let style = crate::python_json::Style {
        indent: kwargs.get::<Option<usize>>("indent")?,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    Ok(JValue::from_safe_string(crate::python_json::dumps(
        &json, &style,
    )))
}

/// Turns a growing list of token ids into text deltas. Decoding a window of recent
/// tokens (not one token at a time) keeps multi-token characters and tokenizer-level
/// spacing right; a delta ending in U+FFFD is held back until the character completes.
#[derive(Debug, Default)]
pub struct IncrementalDetokenizer {
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// The new text after `ids` grew (ids holds every generated token so far).
    pub fn next(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&ids[self.prefix_offset..])?;
        self.prefix_offset = ids.len();
        self.read_offset = ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_owned())
    }
}

/// Holds back text that could be the start of a stop string, and cuts at a match.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to emit now.
    Emit(String),
    /// A stop string matched: emit this text (before the stop) and finish.
    Stopped(String),
}

impl StopMatcher {
    #[must_use]
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Emit(delta.to_owned());
        }
        self.pending.push_str(delta);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_owned();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for k in (1..s.len().min(self.pending.len() + 1)).rev() {
                if self.pending.is_char_boundary(self.pending.len() - k)
                    && self.pending.ends_with(&s[..k.min(s.len())])
                    && s.is_char_boundary(k)
                {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_owned();
        self.pending.drain(..cut);
        StopOutcome::Emit(out)
    }

    /// Text still held back when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_across_chunks() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("hello E"), StopOutcome::Emit("hello ".into()));
        assert_eq!(m.push("N"), StopOutcome::Emit(String::new()));
        assert_eq!(m.push("Dx"), StopOutcome::Stopped(String::new()));
        let mut m = StopMatcher::new(vec!["ab".into()]);
        assert_eq!(m.push("xa"), StopOutcome::Emit("x".into()));
        assert_eq!(m.push("c"), StopOutcome::Emit("ac".into()));
        assert_eq!(m.push("zzab tail"), StopOutcome::Stopped("zz".into()));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), StopOutcome::Emit("caf".into()));
        assert_eq!(m.flush(), "é");
    }
}
