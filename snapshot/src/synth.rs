//! Synthetic snapshots: real model shapes, deterministic random weights. They exercise
//! loading, packing and the engine at full size without shipping real weights.
//!
//! Weights are N(0, 0.02²) like a freshly initialised transformer (so packed-encoding
//! ratios resemble trained bf16 weights, whose exponents are similarly concentrated),
//! norms are 1. Every element depends only on (seed, tensor index, position), never on
//! the thread count, so a preset always produces the same bytes.

use std::path::Path;

use serde_json::json;

use crate::config::{Architecture, ModelConfig, RopeScaling};
use crate::dtype::write_f32;
use crate::manifest::SourceInfo;
use crate::progress::Progress;
use crate::writer::{SnapshotBuilder, TensorSpec, TokenizerData, WriteSummary};
use crate::{DType, Error, Result};

/// The named shapes.
pub const PRESETS: &[&str] = &["tiny", "llama-1b"];

/// The model config of a preset.
pub fn preset_config(name: &str) -> Result<ModelConfig> {
    let base = |vocab, hidden, inter, layers, heads, kv| ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: false,
        attention_bias: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        sliding_window: None,
        source_dtype: Some(DType::BF16),
    };
    match name {
        // The shapes of the llama-tiny reference fixture.
        "tiny" => {
            let mut c = base(512, 64, 176, 2, 4, 2);
            c.source_dtype = Some(DType::F32);
            c.bos_token_id = Some(256);
            c.eos_token_ids = vec![257];
            Ok(c)
        }
        // Llama-3.2-1B: 16 layers, GQA 32/8, tied embeddings, llama3 rope scaling.
        "llama-1b" => {
            let mut c = base(128_256, 2048, 8192, 16, 32, 8);
            c.rope_theta = 500_000.0;
            c.rope_scaling = Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            });
            c.max_position_embeddings = 131_072;
            c.tie_word_embeddings = true;
            c.bos_token_id = Some(128_000);
            c.eos_token_ids = vec![128_001];
            Ok(c)
        }
        other => Err(Error::Unsupported(format!(
            "synthetic preset {other:?} (known: {})",
            PRESETS.join(", ")
        ))),
    }
}

/// Tensor list of a Llama-shaped model in engine order ([`crate::tensors::all`]).
#[must_use]
pub fn llama_tensors(c: &ModelConfig, dtype: DType) -> Vec<TensorSpec> {
    crate::tensors::all(c, c.tie_word_embeddings)
        .into_iter()
        .map(|(name, shape)| TensorSpec { name, dtype, shape })
        .collect()
}

/// GPT-2's reversible byte → printable-character map used by byte-level BPE.
fn byte_to_char(b: u8) -> char {
    let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable {
        char::from(b)
    } else {
        let rank = (0..b)
            .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
            .count() as u32;
        char::from_u32(256 + rank).expect("valid code point")
    }
}

/// A byte-level tokenizer (one token per byte, ids 0..256) with BOS/EOS and ChatML
/// markers right after: valid for any text, and loadable by `tokenizers`.
#[must_use]
pub fn byte_tokenizer(bos_id: u32, specials: &[&str]) -> TokenizerData {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_to_char(b).to_string(), json!(b));
    }
    let added: Vec<_> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            vocab.insert((*s).to_owned(), json!(bos_id as usize + i));
            json!({"id": bos_id as usize + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    TokenizerData {
        json: serde_json::to_vec(&tok).expect("static JSON serialises"),
        bos_token: specials.first().map(|s| (*s).to_owned()),
        eos_token: specials.get(1).map(|s| (*s).to_owned()),
        add_bos_token: true,
    }
}

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// SplitMix64: tiny, fast, and good enough for synthetic weights.
fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Elements generated per independent RNG stream.
const BLOCK: usize = 1 << 16;

/// Fills `out` with N(0, std²) samples (Box–Muller) from stream `(seed, tensor, block)`.
fn normal_block(seed: u64, tensor: usize, block: usize, std: f32, out: &mut [f32]) {
    let mut s = seed
        ^ (tensor as u64).wrapping_mul(0xA24B_AED4_963E_E407)
        ^ (block as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25);
    for pair in out.chunks_mut(2) {
        let a = splitmix(&mut s);
        let u1 = ((a >> 40) as f32 + 1.0) / (1u64 << 24) as f32; // (0, 1]
        let u2 = (a & 0xFF_FFFF) as f32 / (1u64 << 24) as f32;
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let (sn, cs) = (std::f32::consts::TAU * u2).sin_cos();
        pair[0] = r * cs;
        if pair.len() > 1 {
            pair[1] = r * sn;
        }
    }
}

/// Appends the synthetic values of tensor `index` to `out`, using `threads` threads.
fn fill_tensor(seed: u64, index: usize, spec: &TensorSpec, threads: usize, out: &mut Vec<u8>) {
    let n: usize = spec.shape.iter().product::<u64>() as usize;
    let es = spec.dtype.size();
    out.resize(n * es, 0);
    if spec.shape.len() == 1 {
        let ones = vec![1f32; n];
        write_f32(&ones, spec.dtype, out);
        return;
    }
    let blocks: Vec<(usize, &mut [u8])> = out.chunks_mut(BLOCK * es).enumerate().collect();
    let per = blocks.len().div_ceil(threads.max(1));
    let mut groups: Vec<Vec<(usize, &mut [u8])>> = Vec::new();
    let mut it = blocks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per.max(1)).collect());
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                let mut tmp = vec![0f32; BLOCK];
                for (b, dst) in group {
                    let t = &mut tmp[..dst.len() / es];
                    normal_block(seed, index, b, 0.02, t);
                    write_f32(t, spec.dtype, dst);
                }
            });
        }
    });
}

/// Options for [`synthesize`].
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct SynthOptions {
    pub dtype: DType,
    pub seed: u64,
    pub threads: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            dtype: DType::BF16,
            seed: 0,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// Writes the synthetic snapshot of `preset` to `dest`.
pub fn synthesize(
    preset: &str,
    dest: &Path,
    opts: SynthOptions,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    let cfg = preset_config(preset)?;
    let bos = cfg.bos_token_id.unwrap_or(256);
    let mut b = SnapshotBuilder::new(
        cfg.clone(),
        SourceInfo {
            kind: "synthetic".into(),
            name: format!("{preset} seed={}", opts.seed),
        },
    );
    b.tokenizer = Some(byte_tokenizer(
        bos,
        &[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|im_start|>",
            "<|im_end|>",
        ],
    ));
    b.chat_template = Some(CHATML.to_owned());
    b.tensors = llama_tensors(&cfg, opts.dtype);
    b.write(
        dest,
        |i, spec, out| {
            fill_tensor(opts.seed, i, spec, opts.threads, out);
            Ok(())
        },
        progress,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_1b_has_the_real_parameter_count() {
        let c = preset_config("llama-1b").unwrap();
        let n: u64 = llama_tensors(&c, DType::BF16)
            .iter()
            .map(|t| t.shape.iter().product::<u64>())
            .sum();
        assert_eq!(n, 1_235_814_400);
    }

    #[test]
    fn values_do_not_depend_on_thread_count() {
        let spec = TensorSpec {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![300, 1000],
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        fill_tensor(7, 3, &spec, 1, &mut a);
        fill_tensor(7, 3, &spec, 5, &mut b);
        assert_eq!(a, b);
        let vals: Vec<f32> = a
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mean = vals.iter().sum::<f32>() / vals.len() as f32;
        let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / vals.len() as f32;
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 1e-3, "std {}", var.sqrt());
    }

    #[test]
    fn byte_map_is_a_bijection() {
        let set: std::collections::HashSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(set.len(), 256);
        assert_eq!(byte_to_char(b' '), 'Ġ');
    }
}
