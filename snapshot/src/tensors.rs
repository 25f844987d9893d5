//! The tensors of a Llama-family model: their (Hugging Face) names and the shapes its
//! config implies. The one table the engine's backends load from, conversions check
//! a checkpoint against, and synthetic models are written from.

use crate::config::ModelConfig;

/// A tensor's name and shape (`[rows, cols]` for a matrix, `[n]` for a vector).
pub type Named = (String, Vec<u64>);

/// One decoder layer's tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerTensors {
    pub input_norm: Named,
    pub q: Named,
    pub k: Named,
    pub v: Named,
    pub o: Named,
    pub post_norm: Named,
    pub gate: Named,
    pub up: Named,
    pub down: Named,
    /// Present in a checkpoint when its config declares attention biases (Qwen2).
    pub q_bias: Named,
    pub k_bias: Named,
    pub v_bias: Named,
}

impl LayerTensors {
    /// Layer `l` of a model with config `c`.
    #[must_use]
    pub fn of(c: &ModelConfig, l: u64) -> Self {
        let (h, q, kv, ff) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        );
        let p = format!("model.layers.{l}");
        let t = |suffix: &str, shape: Vec<u64>| (format!("{p}.{suffix}"), shape);
        LayerTensors {
            input_norm: t("input_layernorm.weight", vec![h]),
            q: t("self_attn.q_proj.weight", vec![q, h]),
            k: t("self_attn.k_proj.weight", vec![kv, h]),
            v: t("self_attn.v_proj.weight", vec![kv, h]),
            o: t("self_attn.o_proj.weight", vec![h, q]),
            post_norm: t("post_attention_layernorm.weight", vec![h]),
            gate: t("mlp.gate_proj.weight", vec![ff, h]),
            up: t("mlp.up_proj.weight", vec![ff, h]),
            down: t("mlp.down_proj.weight", vec![h, ff]),
            q_bias: t("self_attn.q_proj.bias", vec![q]),
            k_bias: t("self_attn.k_proj.bias", vec![kv]),
            v_bias: t("self_attn.v_proj.bias", vec![kv]),
        }
    }

    /// The layer's weights in checkpoint order, then its biases when `with_bias`.
    #[must_use]
    pub fn list(self, with_bias: bool) -> Vec<Named> {
        let mut v = vec![
            self.input_norm,
            self.q,
            self.k,
            self.v,
            self.o,
            self.post_norm,
            self.gate,
            self.up,
            self.down,
        ];
        if with_bias {
            v.extend([self.q_bias, self.k_bias, self.v_bias]);
        }
        v
    }
}

/// The token embedding table.
#[must_use]
pub fn embed(c: &ModelConfig) -> Named {
    (
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, c.hidden_size],
    )
}

/// The final norm.
#[must_use]
pub fn final_norm(c: &ModelConfig) -> Named {
    ("model.norm.weight".into(), vec![c.hidden_size])
}

/// The output projection (absent when tied to the embedding).
#[must_use]
pub fn lm_head(c: &ModelConfig) -> Named {
    ("lm_head.weight".into(), vec![c.vocab_size, c.hidden_size])
}

/// Every tensor a checkpoint of `c` holds, in the order snapshots are written:
/// embedding, each layer (biases when the config declares them), final norm, and
/// `lm_head` unless `tied`.
#[must_use]
pub fn all(c: &ModelConfig, tied: bool) -> Vec<Named> {
    let mut v = vec![embed(c)];
    for l in 0..c.num_hidden_layers {
        v.extend(LayerTensors::of(c, l).list(c.attention_bias));
    }
    v.push(final_norm(c));
    if !tied {
        v.push(lm_head(c));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qwen_shaped_layer_lists_its_biases_after_its_weights() {
        let mut c = crate::synth::preset_config("tiny").unwrap();
        c.attention_bias = true;
        let names: Vec<String> = all(&c, false).into_iter().map(|t| t.0).collect();
        assert_eq!(names.first().unwrap(), "model.embed_tokens.weight");
        assert_eq!(names.last().unwrap(), "lm_head.weight");
        let layer0: Vec<&str> = names[1..13].iter().map(String::as_str).collect();
        assert_eq!(layer0[0], "model.layers.0.input_layernorm.weight");
        assert_eq!(
            layer0[9..],
            [
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"
            ]
        );
        assert_eq!(names.len(), 1 + 12 * c.num_hidden_layers as usize + 2);
    }
}
