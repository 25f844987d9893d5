//! The normalised model configuration stored in every manifest, and its parsers from
//! Hugging Face `config.json` (both the old top-level `rope_theta` form and the new
//! `rope_parameters` form) and `generation_config.json`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{DType, Error, Result};

/// Model families the engine implements. All are pre-norm decoder-only transformers
/// with RMSNorm, RoPE (rotate-half layout), GQA and a SiLU-gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

/// How rotary position frequencies are scaled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1+ frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    },
    /// Position interpolation: positions divided by `factor`.
    Linear { factor: f64 },
    /// Explicit per-frequency divisors (`head_dim / 2` of them), as GGUF files of
    /// llama3-scaled models store them in `rope_freqs.weight`.
    Factors { factors: Vec<f32> },
}

/// Everything the engine needs to build the model, independent of the source format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: u64,
    /// `lm_head` shares the embedding matrix (no `lm_head.weight` tensor stored).
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; Llama with `attention_bias`).
    pub attention_bias: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_ids: Vec<u32>,
    #[serde(default)]
    pub sliding_window: Option<u64>,
    /// The dtype the checkpoint was published in (informational).
    #[serde(default)]
    pub source_dtype: Option<DType>,
}

/// Sampling defaults from `generation_config.json`; absent fields stay `None`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationDefaults {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_sample: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos_token_ids: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
}

impl ModelConfig {
    /// Checks the invariants the engine relies on; reports every violation at once.
    pub fn validate(&self) -> Result<()> {
        let mut errs = Vec::new();
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                errs.push(format!("{name} must be > 0"));
            }
        }
        if self.num_key_value_heads != 0
            && !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            errs.push(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            errs.push(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            errs.push(format!("rms_norm_eps {} must be > 0", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            errs.push(format!("rope_theta {} must be > 0", self.rope_theta));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidConfig(errs))
        }
    }

    /// The Hugging Face `config.json` this config reads back from.
    pub fn to_hf_json(&self) -> Result<Value> {
        let (arch, ty) = match self.architecture {
            Architecture::Llama => ("LlamaForCausalLM", "llama"),
            Architecture::Mistral => ("MistralForCausalLM", "mistral"),
            Architecture::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        };
        let mut v = serde_json::json!({
            "architectures": [arch],
            "model_type": ty,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "eos_token_id": self.eos_token_ids,
        });
        if let Some(b) = self.bos_token_id {
            v["bos_token_id"] = b.into();
        }
        if let Some(d) = self.source_dtype {
            v["torch_dtype"] = match d {
                DType::F32 => "float32",
                DType::F16 => "float16",
                DType::BF16 => "bfloat16",
            }
            .into();
        }
        match self.sliding_window {
            Some(w) => v["sliding_window"] = w.into(),
            None => v["use_sliding_window"] = false.into(),
        }
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                v["rope_scaling"] = serde_json::json!({
                    "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                });
            }
            Some(RopeScaling::Linear { factor }) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": factor});
            }
            Some(RopeScaling::Factors { .. }) => {
                return Err(Error::Unsupported(
                    "rope scaling by explicit factors has no config.json form".into(),
                ));
            }
        }
        Ok(v)
    }

    /// Parses a Hugging Face `config.json`. Missing or malformed fields are collected and
    /// reported together.
    pub fn from_hf_json(v: &Value) -> Result<Self> {
        let mut errs = Vec::new();
        let arch_name = v["architectures"]
            .get(0)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| v["model_type"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let architecture = match arch_name.as_str() {
            "LlamaForCausalLM" | "llama" => Some(Architecture::Llama),
            "MistralForCausalLM" | "mistral" => Some(Architecture::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => Some(Architecture::Qwen2),
            other => {
                errs.push(format!(
                    "architecture {other:?} is not supported (Llama, Mistral, Qwen2)"
                ));
                None
            }
        };
        let mut req = |key: &str| -> u64 {
            match v.get(key).and_then(Value::as_u64) {
                Some(x) => x,
                None => {
                    errs.push(format!("{key} missing or not a non-negative integer"));
                    0
                }
            }
        };
        let vocab_size = req("vocab_size");
        let hidden_size = req("hidden_size");
        let intermediate_size = req("intermediate_size");
        let num_hidden_layers = req("num_hidden_layers");
        let num_attention_heads = req("num_attention_heads");
        let num_key_value_heads = v["num_key_value_heads"]
            .as_u64()
            .unwrap_or(num_attention_heads);
        let head_dim = match v.get("head_dim") {
            Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
            _ if num_attention_heads > 0 => hidden_size / num_attention_heads,
            _ => 0,
        };
        let rms_norm_eps = v["rms_norm_eps"].as_f64().unwrap_or(1e-6);
        // New form: everything under `rope_parameters`; old form: `rope_theta` at the top
        // level and an optional `rope_scaling` object.
        let rope_obj = if v["rope_parameters"].is_object() {
            &v["rope_parameters"]
        } else {
            &v["rope_scaling"]
        };
        let rope_theta = rope_obj["rope_theta"]
            .as_f64()
            .or_else(|| v["rope_theta"].as_f64())
            .unwrap_or(10000.0);
        let rope_scaling = match parse_rope_scaling(rope_obj) {
            Ok(s) => s,
            Err(e) => {
                errs.push(e);
                None
            }
        };
        let max_position_embeddings = v["max_position_embeddings"].as_u64().unwrap_or(4096);
        let tie_word_embeddings = v["tie_word_embeddings"].as_bool().unwrap_or(false);
        let attention_bias = architecture == Some(Architecture::Qwen2)
            || v["attention_bias"].as_bool().unwrap_or(false);
        let source_dtype = v["torch_dtype"]
            .as_str()
            .or_else(|| v["dtype"].as_str())
            .and_then(|s| DType::parse(s, "config dtype").ok());
        let sliding_window = if v["use_sliding_window"].as_bool() == Some(false) {
            None
        } else {
            v["sliding_window"].as_u64()
        };
        if !errs.is_empty() {
            return Err(Error::InvalidConfig(errs));
        }
        let cfg = ModelConfig {
            architecture: architecture.expect("checked above"),
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            attention_bias,
            bos_token_id: v["bos_token_id"]
                .as_u64()
                .and_then(|x| u32::try_from(x).ok()),
            eos_token_ids: token_ids(&v["eos_token_id"]),
            sliding_window,
            source_dtype,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn parse_rope_scaling(o: &Value) -> std::result::Result<Option<RopeScaling>, String> {
    if !o.is_object() {
        return Ok(None);
    }
    let ty = o["rope_type"].as_str().or_else(|| o["type"].as_str());
    let f = |k: &str| {
        o[k].as_f64()
            .ok_or_else(|| format!("rope scaling field {k} missing"))
    };
    match ty {
        None | Some("default") => Ok(None),
        Some("llama3") => Ok(Some(RopeScaling::Llama3 {
            factor: f("factor")?,
            low_freq_factor: f("low_freq_factor")?,
            high_freq_factor: f("high_freq_factor")?,
            original_max_position_embeddings: o["original_max_position_embeddings"]
                .as_u64()
                .ok_or("rope scaling field original_max_position_embeddings missing")?,
        })),
        Some("linear") => Ok(Some(RopeScaling::Linear {
            factor: f("factor")?,
        })),
        Some(other) => Err(format!("rope scaling type {other:?} is not supported")),
    }
}

/// `eos_token_id` is an int or a list of ints in HF configs.
fn token_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

impl GenerationDefaults {
    /// Parses `generation_config.json`, ignoring fields the engine does not use.
    #[must_use]
    pub fn from_hf_json(v: &Value) -> Self {
        GenerationDefaults {
            temperature: v["temperature"].as_f64(),
            top_p: v["top_p"].as_f64(),
            top_k: v["top_k"].as_u64(),
            do_sample: v["do_sample"].as_bool(),
            eos_token_ids: token_ids(&v["eos_token_id"]),
            max_new_tokens: v["max_new_tokens"].as_u64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "tie_word_embeddings": true, "eos_token_id": [128001, 128008, 128009],
            "torch_dtype": "bfloat16"
        })
    }

    #[test]
    fn old_form_llama3_scaling() {
        let mut v = base();
        v["rope_theta"] = json!(500000.0);
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.source_dtype, Some(DType::BF16));
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 32.0)
        );
    }

    #[test]
    fn new_form_rope_parameters() {
        let mut v = base();
        v["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        v["rope_parameters"] = json!({"rope_theta": 1e6, "rope_type": "default"});
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!((c.rope_theta, c.rope_scaling), (1e6, None));
    }

    #[test]
    fn qwen2_has_qkv_bias() {
        let mut v = base();
        v["architectures"] = json!(["Qwen2ForCausalLM"]);
        assert!(ModelConfig::from_hf_json(&v).unwrap().attention_bias);
    }

    #[test]
    fn all_errors_reported_at_once() {
        let v = json!({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}});
        let Err(Error::InvalidConfig(errs)) = ModelConfig::from_hf_json(&v) else {
            panic!("expected config errors");
        };
        let all = errs.join("\n");
        for needle in ["GPT2LMHeadModel", "vocab_size", "num_hidden_layers", "yarn"] {
            assert!(all.contains(needle), "{needle} missing in {all}");
        }
    }

    #[test]
    fn invariants_checked() {
        let mut v = base();
        v["num_key_value_heads"] = json!(5);
        assert!(matches!(
            ModelConfig::from_hf_json(&v),
            Err(Error::InvalidConfig(_))
        ));
    }
}
