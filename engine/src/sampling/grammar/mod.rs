//! Structured outputs: a request's grammar (a JSON schema, a regular expression, a
//! list of choices or a Lark grammar) compiled by llguidance into a per-sequence
//! matcher that masks every token the grammar cannot take next.
//!
//! llguidance (over outlines-core) because it builds its lexer lazily, as tokens come,
//! instead of an automaton over the whole vocabulary per schema up front (by design; the
//! two were not compared here). Its mask cost per token is measured by `preheat bench
//! grammar` (BENCHMARKS.md).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{EngineError, Result};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grammar {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A JSON schema (`response_format: json_schema`, `guided_json`).
    JsonSchema(Value),
    /// A regular expression over the whole output (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (`guided_grammar`).
    Lark(String),
}

/// JSON without whitespace between tokens unless the schema asks otherwise (through
/// llguidance's `x-guidance` options): a small model held to "any JSON" otherwise
/// pads with newlines until `max_tokens`, a known failure of JSON modes.
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    s
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"})))
            }
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s)),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Choice(options) => {
                let alts: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The model's vocabulary as byte strings, for llguidance.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl toktrie::TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Grammars kept compiled: a request's `n` sequences, and the engine after the API
/// checked the grammar, start from a copy instead of compiling again.
const CACHED_GRAMMARS: usize = 32;
/// Larger grammars are compiled each time rather than kept (the cache stays small).
const MAX_CACHED_GRAMMAR_BYTES: usize = 64 << 10;

/// Compiles grammars for one tokenizer (built once per model, on first use).
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// Most recently used last.
    cache: std::sync::Mutex<std::collections::VecDeque<(String, Matcher)>>,
    /// Every token that ends generation: allowed together when the grammar allows
    /// its end (llguidance knows one EOS id).
    eos: Vec<u32>,
    /// Single-byte tokens (and their byte) in the order the closing path
    /// ([`Constraint::budget_check`]) tries them.
    closers: Arc<Vec<(u32, u8)>>,
}

/// The bytes that end a structure soonest, most eager first: close strings, objects
/// and arrays; go on to the next required member; end numbers; finish literals and
/// enum strings (letters); open only when nothing else is allowed (a required item);
/// then everything else.
fn closing_order() -> Vec<u8> {
    let mut order: Vec<u8> = b"\"}],:0123456789".to_vec();
    order.extend(b'a'..=b'z');
    order.extend(b'A'..=b'Z');
    order.extend(b".-_@/[{ ");
    for b in 0..=255u8 {
        if !order.contains(&b) {
            order.push(b);
        }
    }
    order
}

/// Digits and letters repeat forever in a number or a `[a-z]+`: after one of them the
/// closer moves on to another class when one is allowed.
fn repeating_class(b: u8) -> Option<u8> {
    if b.is_ascii_digit() {
        Some(0)
    } else if b.is_ascii_alphabetic() {
        Some(1)
    } else {
        None
    }
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` (`json`: its `tokenizer.json`).
    pub fn new(tokenizer: &tokenizers::Tokenizer, json: &str, eos: &[u32]) -> Result<Self> {
        let err = |e: String| EngineError::Tokenizer(format!("structured outputs: {e}"));
        let value: Value = serde_json::from_str(json).map_err(|e| err(e.to_string()))?;
        // llguidance asserts on token names it does not expect: a model file must not
        // take the server down, so a panic there is this tokenizer's error.
        let words =
            std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&value))
                .map_err(|_| err("unreadable vocabulary".into()))?
                .map_err(|e| err(e.to_string()))?;
        let vocab = words.len().max(tokenizer.get_vocab_size(true));
        let mut words = words;
        words.resize(vocab, Vec::new());
        let eos_id = *eos
            .first()
            .ok_or_else(|| err("the model names no EOS token".into()))?;
        let info = TokRxInfo::new(vocab as u32, eos_id);
        let trie = TokTrie::from(&info, &words);
        let closers: Vec<(u32, u8)> = closing_order()
            .into_iter()
            .filter_map(|b| Some((trie.token_id(&[b])?, b)))
            .collect();
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            cache: std::sync::Mutex::default(),
            eos: eos.to_vec(),
            closers: Arc::new(closers),
        })
    }

    /// A fresh matcher for one sequence; a grammar that does not compile is the
    /// request's error, naming `param`.
    pub fn compile(&self, g: &Grammar, param: &str) -> Result<Constraint> {
        let key = serde_json::to_string(g).unwrap_or_default();
        let cacheable = !key.is_empty() && key.len() <= MAX_CACHED_GRAMMAR_BYTES;
        if cacheable {
            let mut cache = self
                .cache
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
                let hit = cache.remove(i).expect("found at i");
                let matcher = hit.1.deep_clone();
                cache.push_back(hit);
                return Ok(self.constraint(matcher));
            }
        }
        let parser = self
            .factory
            .create_parser(g.top_level())
            .map_err(|e| EngineError::invalid(format!("{param}: {e}"), param))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(EngineError::invalid(format!("{param}: {e}"), param));
        }
        if cacheable {
            let mut cache = self
                .cache
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if cache.len() >= CACHED_GRAMMARS {
                cache.pop_front();
            }
            cache.push_back((key, matcher.deep_clone()));
        }
        Ok(self.constraint(matcher))
    }

    fn constraint(&self, matcher: Matcher) -> Constraint {
        Constraint {
            matcher,
            eos: self.eos.clone(),
            closers: Arc::clone(&self.closers),
            closed_for_budget: false,
        }
    }
}

/// Longest closing path looked for (tokens): within this budget every token is
/// checked; a structure that needs more is cut.
const MAX_CLOSING: usize = 64;

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
    closers: Arc<Vec<(u32, u8)>>,
    /// A token was replaced to end within `max_tokens`.
    closed_for_budget: bool,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

/// Tokens the grammar allows next.
#[derive(Debug)]
pub struct Allowed(SimpleVob);

impl Allowed {
    /// Only `token` (one the grammar allows, forced).
    #[must_use]
    pub fn only(token: u32, vocab: usize) -> Self {
        let mut v = SimpleVob::alloc(vocab.max(token as usize + 1));
        v.allow_token(token);
        Allowed(v)
    }

    #[must_use]
    pub fn contains(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets the logit of every token not allowed to -inf.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.contains(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

impl Constraint {
    /// What may come next: the grammar's tokens, and every EOS token once the grammar
    /// may end (only EOS once it must).
    pub fn allowed(&mut self) -> Result<Allowed> {
        let mut mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| EngineError::Internal(format!("structured outputs: {e}")))?;
        if self.eos.first().is_some_and(|&e| mask.is_allowed(e)) {
            for &e in &self.eos {
                if (e as usize) < mask.len() {
                    mask.allow_token(e);
                }
            }
        }
        Ok(Allowed(mask))
    }

    /// Advances past `token` (which [`Constraint::allowed`] allowed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.eos.contains(&token) {
            // A grammar that cannot go on has already stopped: the end is its end.
            if self.matcher.is_stopped() {
                return Ok(());
            }
            // llguidance knows one EOS id; any of the model's means the same.
            let eos = self.eos[0];
            return self
                .matcher
                .consume_token(eos)
                .map_err(|e| EngineError::Internal(format!("structured outputs: {e}")));
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| EngineError::Internal(format!("structured outputs: {e}")))
    }

    /// The grammar is complete and allows nothing more.
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The model sampled `token` with `remaining` tokens of budget left (this one
    /// included): `None` keeps it; `Some(t)` is the token to put in its place because
    /// after the model's one no end of the grammar fits in what is left, so the output
    /// still ends complete when `max_tokens` comes (OpenAI's and vLLM's JSON modes cut
    /// it open). The way to an end is found greedily, single bytes most closing first
    /// (`"`, `}`, `]`, `,`, digits, letters…) with the grammar's forced text in its own
    /// tokens; EOS once the grammar may end. A pure function of the state, the budget
    /// and the token, so a decode worker resuming a prefill worker's sequence decides
    /// as a colocated engine would.
    pub fn budget_check(&mut self, token: u32, remaining: usize) -> Option<u32> {
        if remaining > MAX_CLOSING + 1 || self.matcher.is_stopped() || self.eos.contains(&token) {
            return None;
        }
        // Probes run on clones (sharing the lexer's caches): an error in one is "no way
        // to an end", never the request's.
        let mut after = self.matcher.clone();
        if after.try_consume_tokens(&[token]).ok() != Some(1) {
            return None;
        }
        if self.close_path(&after, remaining - 1).is_some() {
            return None;
        }
        let path = self.close_path(&self.matcher, remaining)?;
        self.closed_for_budget = true;
        Some(path.first().copied().unwrap_or(self.eos[0]))
    }

    /// A token was replaced to end the output within the budget.
    #[must_use]
    pub fn closed_for_budget(&self) -> bool {
        self.closed_for_budget
    }

    /// Tokens from `m`'s state to one where the grammar may end, at most `limit`: the
    /// shortest of the greedy walks that start as if the text so far ended in
    /// punctuation, a digit or a letter (a number or a word may end now, or go on).
    fn close_path(&self, m: &Matcher, limit: usize) -> Option<Vec<u32>> {
        [None, Some(0), Some(1)]
            .into_iter()
            .filter_map(|prev| self.walk_to_end(&mut m.clone(), limit, prev))
            .min_by_key(Vec::len)
    }

    fn walk_to_end(&self, m: &mut Matcher, limit: usize, prev: Option<u8>) -> Option<Vec<u32>> {
        let mut path = Vec::new();
        let mut prev = prev;
        loop {
            let limit = limit.min(MAX_CLOSING);
            if path.len() > limit {
                return None;
            }
            if m.is_stopped() || m.is_accepting().ok()? {
                return Some(path);
            }
            if path.len() == limit {
                return None;
            }
            // Text the grammar forces (a key, a tag), in its own tokens.
            let forced = m.consume_ff_tokens();
            if m.is_error() {
                return None;
            }
            if !forced.is_empty() {
                path.extend(forced);
                prev = None;
                continue;
            }
            let mut first = None;
            let mut pick = None;
            for &(t, b) in self.closers.iter() {
                if m.validate_tokens(&[t]).ok() != Some(1) {
                    continue;
                }
                first.get_or_insert(t);
                if prev.is_some() && repeating_class(b) == prev {
                    continue;
                }
                pick = Some((t, b));
                break;
            }
            let t = match (pick, first) {
                (Some((t, b)), _) => {
                    prev = repeating_class(b);
                    t
                }
                (None, Some(t)) => t,
                // Only longer tokens go on (llguidance may hold a lexeme to its
                // canonical tokens): the first of them.
                (None, None) => {
                    prev = None;
                    let mask = m.compute_mask().ok()?;
                    (0..mask.len() as u32).find(|&t| mask.is_allowed(t))?
                }
            };
            m.consume_token(t).ok()?;
            path.push(t);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
