//! Rotary position embedding's inverse frequencies, with the model's scaling: the
//! table both backends rotate queries and keys with.

use preheat_snapshot::{ModelConfig, RopeScaling};

/// Rotary inverse frequencies, with the configured scaling applied.
#[must_use]
pub fn inv_freq(c: &ModelConfig) -> Vec<f32> {
    let d = c.head_dim as usize;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / d as f32))
        .collect();
    match &c.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / *factor as f32).collect(),
        Some(RopeScaling::Factors { factors }) => {
            base.iter().zip(factors).map(|(f, s)| f / s).collect()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, lo, hi) = (
                *factor as f32,
                *low_freq_factor as f32,
                *high_freq_factor as f32,
            );
            let old = *original_max_position_embeddings as f32;
            let (low_wavelen, high_wavelen) = (old / lo, old / hi);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut c = preheat_snapshot::synth::preset_config("llama-1b").unwrap();
        let scaled = inv_freq(&c);
        c.rope_scaling = None;
        let base = inv_freq(&c);
        assert_eq!(scaled[0], base[0], "highest frequency untouched");
        let last = base.len() - 1;
        assert!(
            (scaled[last] - base[last] / 32.0).abs() < 1e-12,
            "lowest divided by factor"
        );
    }
}
