//! GGUF files of the llama architecture family (llama, mistral, qwen2), converted to HF
//! tensor names and layouts: tensors dequantised, Q/K rows un-permuted, and the
//! tokenizer rebuilt from metadata as a `tokenizer.json`.

pub mod dequant;
pub mod parse;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use self::dequant::{GgmlType, dequantize};
use self::parse::{GgufHeader, MetaValue, TensorInfo};
use super::{ModelSource, TargetDtype, source_info};
use crate::config::{Architecture, ModelConfig, RopeScaling};
use crate::dtype::write_f32;
use crate::writer::{SnapshotBuilder, TensorSpec};
use crate::{DType, Error, Result};

/// An opened GGUF model file.
#[derive(Debug)]
pub struct GgufModel {
    path: PathBuf,
    map: Mmap,
    header: GgufHeader,
    config: ModelConfig,
    /// HF name → index into `header.tensors`.
    by_hf_name: BTreeMap<String, usize>,
    /// GGUF stores Q/K rows interleaved for its rotary layout (llama arch only).
    permuted_qk: bool,
}

/// Maps a GGUF tensor name to the HF name; `None` for names the engine does not use.
fn hf_name(gguf: &str) -> Option<String> {
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let layer: u64 = layer.parse().ok()?;
            let (base, suffix) = part.rsplit_once('.')?;
            let hf = match base {
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{hf}.{suffix}")
        }
    })
}

impl GgufModel {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map of a model file that is not modified during conversion.
        #[allow(unsafe_code)]
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::from_map(path, map)
    }

    fn from_map(path: &Path, map: Mmap) -> Result<Self> {
        let a = analyze(&map)?;
        Ok(GgufModel {
            path: path.to_path_buf(),
            map,
            header: a.header,
            config: a.config,
            by_hf_name: a.by_hf_name,
            permuted_qk: a.permuted_qk,
        })
    }

    #[must_use]
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    #[must_use]
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn info(&self, hf: &str) -> Result<&TensorInfo> {
        self.by_hf_name
            .get(hf)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| Error::NoSuchTensor(hf.to_owned()))
    }
}

/// What opening a GGUF image establishes, before any tensor data is read.
struct Analysis {
    header: GgufHeader,
    config: ModelConfig,
    by_hf_name: BTreeMap<String, usize>,
    permuted_qk: bool,
}

fn analyze(bytes: &[u8]) -> Result<Analysis> {
    let header = parse::parse(bytes)?;
    let arch = header
        .metadata
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .unwrap_or("")
        .to_owned();
    let architecture = match arch.as_str() {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        other => {
            return Err(Error::Unsupported(format!(
                "GGUF architecture {other:?} (llama, mistral, qwen2 are supported)"
            )));
        }
    };
    let mut by_hf_name = BTreeMap::new();
    let mut rope_freqs = None;
    let mut ignored = Vec::new();
    for (i, t) in header.tensors.iter().enumerate() {
        if t.name == "rope_freqs.weight" {
            rope_freqs = Some(i);
        } else if let Some(n) = hf_name(&t.name) {
            if by_hf_name.insert(n, i).is_some() {
                return Err(Error::InvalidGguf(format!("tensor {} twice", t.name)));
            }
        } else {
            ignored.push(t.name.clone());
        }
    }
    if !ignored.is_empty() {
        tracing::warn!(?ignored, "GGUF tensors the engine does not use are skipped");
    }
    let config = config_from_meta(
        &header,
        architecture,
        &arch,
        !by_hf_name.contains_key("lm_head.weight"),
        rope_freqs.map(|i| &header.tensors[i]),
        bytes,
    )?;
    Ok(Analysis {
        header,
        config,
        by_hf_name,
        permuted_qk: arch != "qwen2",
    })
}

/// Validates a whole GGUF image held in memory as conversion would (container, model
/// config, tokenizer rebuild) without converting tensors. The fuzz target's entry.
pub fn validate_bytes(bytes: &[u8]) -> Result<ModelConfig> {
    let a = analyze(bytes)?;
    tokenizer::from_metadata(&a.header.metadata)?;
    Ok(a.config)
}

fn config_from_meta(
    h: &GgufHeader,
    architecture: Architecture,
    arch: &str,
    tied: bool,
    rope_freqs: Option<&TensorInfo>,
    bytes: &[u8],
) -> Result<ModelConfig> {
    let m = &h.metadata;
    let get = |k: &str| m.get(&format!("{arch}.{k}"));
    let mut errs = Vec::new();
    let mut req = |k: &str| match get(k).and_then(MetaValue::as_u64) {
        Some(v) => v,
        None => {
            errs.push(format!("{arch}.{k} missing"));
            0
        }
    };
    let hidden_size = req("embedding_length");
    let num_hidden_layers = req("block_count");
    let intermediate_size = req("feed_forward_length");
    let num_attention_heads = req("attention.head_count");
    let max_position_embeddings = req("context_length");
    let num_key_value_heads = get("attention.head_count_kv")
        .and_then(MetaValue::as_u64)
        .unwrap_or(num_attention_heads);
    let head_dim = get("attention.key_length")
        .or_else(|| get("rope.dimension_count"))
        .and_then(MetaValue::as_u64)
        .unwrap_or(hidden_size.checked_div(num_attention_heads).unwrap_or(0));
    let tokens = m.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array);
    let vocab_size = get("vocab_size")
        .and_then(MetaValue::as_u64)
        .or(tokens.map(|t| t.len() as u64))
        .unwrap_or_else(|| {
            errs.push(format!("{arch}.vocab_size missing and no tokenizer tokens"));
            0
        });
    let mut rope_scaling = match get("rope.scaling.type").and_then(MetaValue::as_str) {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling::Linear {
            factor: get("rope.scaling.factor")
                .and_then(MetaValue::as_f64)
                .unwrap_or(1.0),
        }),
        Some(other) => {
            errs.push(format!("rope scaling {other:?} is not supported"));
            None
        }
    };
    if let Some(t) = rope_freqs {
        if t.ty != GgmlType::F32 || t.numel() != head_dim / 2 {
            errs.push(format!(
                "rope_freqs: expected {} f32 values, found {} of {:?}",
                head_dim / 2,
                t.numel(),
                t.ty
            ));
        } else {
            let factors = bytes[t.start..t.start + t.len]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            rope_scaling = Some(RopeScaling::Factors { factors });
        }
    }
    if !errs.is_empty() {
        return Err(Error::InvalidConfig(errs));
    }
    let id = |k: &str| {
        m.get(k)
            .and_then(MetaValue::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    };
    let cfg = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: get("attention.layer_norm_rms_epsilon")
            .and_then(MetaValue::as_f64)
            .unwrap_or(1e-5),
        rope_theta: get("rope.freq_base")
            .and_then(MetaValue::as_f64)
            .unwrap_or(10000.0),
        rope_scaling,
        max_position_embeddings,
        tie_word_embeddings: tied,
        attention_bias: architecture == Architecture::Qwen2,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
        sliding_window: None,
        source_dtype: None,
    };
    cfg.validate()?;
    Ok(cfg)
}

impl ModelSource for GgufModel {
    fn builder(&self, target: TargetDtype) -> Result<SnapshotBuilder> {
        let mut b = SnapshotBuilder::new(self.config.clone(), source_info("gguf", &self.path));
        let tok = tokenizer::from_metadata(&self.header.metadata)?;
        b.chat_template = tok.chat_template.clone();
        b.tool_use_template = tok.tool_use_template.clone();
        b.tokenizer = Some(tok.data);
        for (hf, &i) in &self.by_hf_name {
            let t = &self.header.tensors[i];
            let dtype = match (target, t.ty) {
                (TargetDtype::To(d), _) => d,
                (TargetDtype::Keep, GgmlType::F16) => DType::F16,
                (TargetDtype::Keep, GgmlType::BF16) => DType::BF16,
                (TargetDtype::Keep, _) => DType::F32,
            };
            b.tensors.push(TensorSpec {
                name: hf.clone(),
                dtype,
                shape: t.shape(),
            });
        }
        b.tensors.sort_by_key(|s| super::engine_order(&s.name));
        Ok(b)
    }

    fn read_tensor(&self, spec: &TensorSpec, out: &mut Vec<u8>) -> Result<()> {
        let t = self.info(&spec.name)?;
        let src = &self.map[t.start..t.start + t.len];
        let n = t.numel() as usize;
        let start = out.len();
        out.resize(start + n * spec.dtype.size(), 0);
        // Dequantise in row-aligned pieces to keep the f32 scratch small.
        let row = t.dims[0] as usize;
        let (be, bb) = t.ty.block();
        let rows_per_piece = (1 << 16) / row.max(1) + 1;
        let mut scratch = vec![0f32; rows_per_piece * row];
        let row_bytes = row / be as usize * bb as usize;
        for (k, piece) in src.chunks(rows_per_piece * row_bytes).enumerate() {
            let elems = piece.len() / row_bytes * row;
            let y = &mut scratch[..elems];
            dequantize(t.ty, piece, y);
            let o = start + k * rows_per_piece * row * spec.dtype.size();
            write_f32(y, spec.dtype, &mut out[o..o + elems * spec.dtype.size()]);
        }
        let is_qk =
            spec.name.contains("self_attn.q_proj") || spec.name.contains("self_attn.k_proj");
        if self.permuted_qk && is_qk {
            let heads = if spec.name.contains("q_proj") {
                self.config.num_attention_heads
            } else {
                self.config.num_key_value_heads
            };
            unpermute_rows(
                &mut out[start..],
                heads as usize,
                spec.dtype.size() * n / t.shape()[0] as usize,
            )?;
        }
        Ok(())
    }
}

/// Undoes llama.cpp's conversion permute of Q/K rows. Within each head, HF keeps the
/// two rotary halves apart (rows `i*half + j`); GGUF interleaves them (rows `2*j + i`).
fn unpermute_rows(data: &mut [u8], heads: usize, row_bytes: usize) -> Result<()> {
    let rows = data.len() / row_bytes.max(1);
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(Error::InvalidGguf(format!(
            "cannot un-permute {rows} rows over {heads} heads"
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let src = data.to_vec();
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let to = h * hd + i * half + j;
                let from = h * hd + 2 * j + i;
                data[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&src[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_q.bias").unwrap(),
            "model.layers.12.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert!(hf_name("blk.x.attn_q.weight").is_none());
        assert!(hf_name("mystery").is_none());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, hd/2, cols).swapaxes(1, 2). Build the permuted
        // order of row ids for 2 heads of head_dim 4 and check we recover 0..8.
        let (heads, hd) = (2usize, 4usize);
        let mut permuted = Vec::new();
        for h in 0..heads {
            for j in 0..hd / 2 {
                for i in 0..2 {
                    permuted.push((h * hd + i * hd / 2 + j) as u8);
                }
            }
        }
        unpermute_rows(&mut permuted, heads, 1).unwrap();
        assert_eq!(permuted, (0..8).collect::<Vec<u8>>());
        assert!(unpermute_rows(&mut [0u8; 6], 4, 1).is_err());
    }
}
