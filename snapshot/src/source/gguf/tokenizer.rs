//! Rebuilds a Hugging Face `tokenizer.json` from GGUF tokenizer metadata.
//!
//! Two GGUF tokenizer models exist in llama-family files: `gpt2` (byte-level BPE with
//! explicit merges: Llama 3, Qwen2, SmolLM) and `llama` (SentencePiece BPE with scores
//! and byte fallback: Llama 2, Mistral). The pre-tokenizer is chosen from
//! `tokenizer.ggml.pre`, mirroring the regexes llama.cpp uses for each name.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::parse::MetaValue;
use crate::writer::TokenizerData;
use crate::{Error, Result};

/// Token types of `tokenizer.ggml.token_type`.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The rebuilt tokenizer and the chat template that came with it.
#[derive(Debug)]
pub struct GgufTokenizer {
    pub data: TokenizerData,
    pub chat_template: Option<String>,
    /// `tokenizer.chat_template.tool_use` (llama.cpp's name for a named template).
    pub tool_use_template: Option<String>,
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(pre: &str) -> Value {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" | "deepseek-r1-qwen" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]})
        }
        // llama.cpp: "\p{N}" then the GPT-2 regex, i.e. single digits, then byte level.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
        }),
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        other => {
            tracing::warn!(
                pre = other,
                "unknown GGUF pre-tokenizer; using GPT-2 byte-level splitting"
            );
            byte_level(true)
        }
    }
}

fn strings(m: &BTreeMap<String, MetaValue>, key: &str) -> Result<Vec<String>> {
    m.get(key)
        .and_then(MetaValue::as_array)
        .ok_or_else(|| Error::InvalidGguf(format!("{key} missing")))?
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| Error::InvalidGguf(format!("{key} holds a non-string")))
        })
        .collect()
}

/// Builds the tokenizer from the `tokenizer.*` metadata of a GGUF file.
pub fn from_metadata(m: &BTreeMap<String, MetaValue>) -> Result<GgufTokenizer> {
    let model = m
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| Error::InvalidGguf("tokenizer.ggml.model missing".into()))?;
    let tokens = strings(m, "tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match m
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
    {
        Some(a) => a
            .iter()
            .map(|v| v.as_u64().map_or(1, |x| x as i64))
            .collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(Error::InvalidGguf(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let id = |k: &str| {
        m.get(k)
            .and_then(MetaValue::as_u64)
            .and_then(|i| tokens.get(i as usize).cloned())
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        // Duplicate strings exist in some vocabularies; the first id wins, as in HF.
        vocab.entry(t.clone()).or_insert(json!(i));
    }
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| **ty == CONTROL || **ty == USER_DEFINED)
        .map(|(i, (t, ty))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": *ty == CONTROL})
        })
        .collect();
    let tokenizer = match model {
        "gpt2" => {
            let merges = strings(m, "tokenizer.ggml.merges")?;
            let pre = m
                .get("tokenizer.ggml.pre")
                .and_then(MetaValue::as_str)
                .unwrap_or("default");
            json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added,
                "normalizer": null,
                "pre_tokenizer": pre_tokenizer(pre),
                "post_processor": null,
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                          "vocab": vocab, "merges": merges}
            })
        }
        "llama" => {
            let merges = match strings(m, "tokenizer.ggml.merges") {
                Ok(mg) => mg,
                Err(_) => sentencepiece_merges(&tokens, &types, m)?,
            };
            let add_prefix = m
                .get("tokenizer.ggml.add_space_prefix")
                .and_then(MetaValue::as_bool)
                .unwrap_or(true);
            let mut normalizers = Vec::new();
            if add_prefix {
                normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
            }
            normalizers.push(
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
            );
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if add_prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added,
                "normalizer": {"type": "Sequence", "normalizers": normalizers},
                "pre_tokenizer": null,
                "post_processor": null,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": id("tokenizer.ggml.unknown_token_id"),
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                          "vocab": vocab, "merges": merges}
            })
        }
        other => {
            return Err(Error::Unsupported(format!(
                "GGUF tokenizer model {other:?} (gpt2 and llama are supported)"
            )));
        }
    };
    let json = serde_json::to_vec(&tokenizer)
        .map_err(|e| Error::InvalidGguf(format!("tokenizer JSON: {e}")))?;
    Ok(GgufTokenizer {
        data: TokenizerData {
            json,
            bos_token: id("tokenizer.ggml.bos_token_id"),
            eos_token: id("tokenizer.ggml.eos_token_id"),
            add_bos_token: m
                .get("tokenizer.ggml.add_bos_token")
                .and_then(MetaValue::as_bool)
                .unwrap_or(model == "llama"),
        },
        chat_template: m
            .get("tokenizer.chat_template")
            .and_then(MetaValue::as_str)
            .map(str::to_owned),
        tool_use_template: m
            .get("tokenizer.chat_template.tool_use")
            .and_then(MetaValue::as_str)
            .map(str::to_owned),
    })
}

/// SentencePiece GGUFs carry scores instead of merges. Derive merges the way HF's
/// converter does: every split of a vocabulary piece into two vocabulary pieces is a
/// merge, ranked by the merged piece's score (higher first), then by the parts' ids.
fn sentencepiece_merges(
    tokens: &[String],
    types: &[i64],
    m: &BTreeMap<String, MetaValue>,
) -> Result<Vec<String>> {
    let scores: Vec<f64> = m
        .get("tokenizer.ggml.scores")
        .and_then(MetaValue::as_array)
        .ok_or_else(|| Error::InvalidGguf("llama tokenizer without merges or scores".into()))?
        .iter()
        .map(|v| v.as_f64().unwrap_or(0.0))
        .collect();
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types.get(*i) == Some(&1))
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges = Vec::new();
    for (merged, &mid) in &ids {
        for (cut, _) in merged.char_indices().skip(1) {
            let (a, b) = merged.split_at(cut);
            if let (Some(&ia), Some(&ib)) = (ids.get(a), ids.get(b)) {
                let score = scores.get(mid).copied().unwrap_or(0.0);
                merges.push((score, ia, ib, format!("{a} {b}")));
            }
        }
    }
    merges.sort_by(|x, y| {
        y.0.partial_cmp(&x.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(x.1.cmp(&y.1))
            .then(x.2.cmp(&y.2))
    });
    Ok(merges.into_iter().map(|m| m.3).collect())
}
