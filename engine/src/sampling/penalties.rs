//! The penalties and biases a request may ask for, applied to a copy of the logits
//! before sampling, in vLLM's order: `logit_bias` (added) and `min_tokens` (EOS and
//! `stop_token_ids` impossible until that many tokens were generated) first, then the
//! repetition penalty (over prompt and output tokens: a positive logit is divided by it,
//! a negative one multiplied — transformers' `RepetitionPenaltyLogitsProcessor`), then
//! frequency and presence penalties (over output tokens:
//! `logit −= frequency · count + presence · [count > 0]`, OpenAI's formula). Logprobs
//! stay those of the model's own distribution, as vLLM reports them by default.
//!
//! What they read of a sequence ([`State`]) is kept up to date as tokens are appended,
//! not rebuilt from the whole prompt at every step.

use std::collections::{HashMap, HashSet};

use super::SamplingParams;

/// What the penalties need of one sequence: the distinct tokens of its prompt and
/// output (repetition penalty), each output token's count (frequency and presence),
/// and how many were generated. Only what the request's parameters use is kept.
#[derive(Clone, Debug, Default)]
pub struct State {
    seen: Option<HashSet<u32>>,
    counts: Option<HashMap<u32, u32>>,
    generated: usize,
}

impl State {
    /// The state of a sequence with `prompt` and nothing generated yet.
    #[must_use]
    pub fn new(p: &SamplingParams, prompt: &[u32]) -> Self {
        State {
            seen: (p.repetition_penalty != 1.0).then(|| prompt.iter().copied().collect()),
            counts: (p.frequency_penalty != 0.0 || p.presence_penalty != 0.0).then(HashMap::new),
            generated: 0,
        }
    }

    /// Tokens generated so far.
    #[must_use]
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Records a generated token.
    pub fn push(&mut self, token: u32) {
        self.generated += 1;
        if let Some(s) = &mut self.seen {
            s.insert(token);
        }
        if let Some(c) = &mut self.counts {
            *c.entry(token).or_default() += 1;
        }
    }
}

impl SamplingParams {
    /// Whether any penalty, bias or (with `generated` tokens so far) `min_tokens`
    /// changes the next logits.
    #[must_use]
    pub fn adjusts_logits(&self, generated: usize) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || generated < self.min_tokens
    }
}

/// Applies `p`'s biases, `min_tokens` and penalties to `logits` in place, for a
/// sequence in `state`; `eos` are the model's end-of-sequence ids.
pub fn apply(logits: &mut [f32], p: &SamplingParams, state: &State, eos: &[u32]) {
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if state.generated < p.min_tokens {
        let stops = eos
            .iter()
            .filter(|_| !p.ignore_eos)
            .chain(&p.stop_token_ids);
        for &t in stops {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if let Some(seen) = &state.seen {
        let r = p.repetition_penalty;
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if let Some(counts) = &state.counts {
        for (&t, &n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' processors, written out the way its code does them (gather the
    /// scores of the ids, transform, scatter back), for comparison.
    fn hf_repetition(scores: &[f32], ids: &[u32], penalty: f32) -> Vec<f32> {
        let mut out = scores.to_vec();
        let gathered: Vec<f32> = ids.iter().map(|&i| scores[i as usize]).collect();
        for (&i, s) in ids.iter().zip(gathered) {
            out[i as usize] = if s < 0.0 { s * penalty } else { s / penalty };
        }
        out
    }

    /// OpenAI's documented formula, per token of the vocabulary.
    fn openai_penalties(scores: &[f32], generated: &[u32], freq: f32, pres: f32) -> Vec<f32> {
        (0..scores.len())
            .map(|j| {
                let c = generated.iter().filter(|&&t| t as usize == j).count() as f32;
                scores[j] - c * freq - if c > 0.0 { pres } else { 0.0 }
            })
            .collect()
    }

    const LOGITS: [f32; 8] = [2.0, -1.0, 0.5, -0.25, 3.0, 0.0, -2.0, 1.5];

    fn run(p: &SamplingParams, prompt: &[u32], generated: &[u32]) -> Vec<f32> {
        let mut state = State::new(p, prompt);
        for &t in generated {
            state.push(t);
        }
        let mut l = LOGITS.to_vec();
        apply(&mut l, p, &state, &[7]);
        l
    }

    #[test]
    fn repetition_penalty_is_transformers_over_prompt_and_output() {
        let p = SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        };
        let (prompt, generated) = ([0, 1, 1, 5], [4, 6, 0]);
        let ids: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        assert_eq!(
            run(&p, &prompt, &generated),
            hf_repetition(&LOGITS, &ids, 1.3)
        );
        // A penalty below 1 rewards repeats, the same way.
        let p = SamplingParams {
            repetition_penalty: 0.5,
            ..SamplingParams::default()
        };
        assert_eq!(
            run(&p, &prompt, &generated),
            hf_repetition(&LOGITS, &ids, 0.5)
        );
    }

    #[test]
    fn frequency_and_presence_count_output_tokens_only() {
        let p = SamplingParams {
            frequency_penalty: 0.4,
            presence_penalty: -0.3,
            ..SamplingParams::default()
        };
        let (prompt, generated) = ([2, 2, 3], [4, 4, 4, 1, 2]);
        let want = openai_penalties(&LOGITS, &generated, 0.4, -0.3);
        let got = run(&p, &prompt, &generated);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // The prompt's 3 is untouched: only output tokens count.
        assert_eq!(got[3], LOGITS[3]);
    }

    #[test]
    fn logit_bias_adds_and_min_tokens_holds_eos_and_stop_ids_back() {
        let p = SamplingParams {
            logit_bias: vec![(1, 100.0), (4, -100.0)],
            min_tokens: 2,
            stop_token_ids: vec![3],
            ..SamplingParams::default()
        };
        let got = run(&p, &[0], &[5]);
        assert_eq!(got[1], LOGITS[1] + 100.0);
        assert_eq!(got[4], LOGITS[4] - 100.0);
        assert_eq!((got[7], got[3]), (f32::NEG_INFINITY, f32::NEG_INFINITY));
        // Two generated: EOS and stop ids are allowed again.
        let got = run(&p, &[0], &[5, 5]);
        assert_eq!((got[7], got[3]), (LOGITS[7], LOGITS[3]));
        // Out-of-vocabulary ids change nothing (the API refuses them before).
        let p = SamplingParams {
            logit_bias: vec![(99, 5.0)],
            ..SamplingParams::default()
        };
        assert_eq!(run(&p, &[0], &[]), LOGITS.to_vec());
        assert!(!SamplingParams::default().adjusts_logits(0));
    }

    #[test]
    fn the_bias_comes_before_the_repetition_penalty_as_in_vllm() {
        // Logit -1 of a repeated token, bias +5, penalty 1.3: (-1 + 5) / 1.3.
        let p = SamplingParams {
            logit_bias: vec![(1, 5.0)],
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        };
        let got = run(&p, &[1], &[]);
        assert!((got[1] - (LOGITS[1] + 5.0) / 1.3).abs() < 1e-6, "{got:?}");
        // min_tokens counts only while it matters.
        let m = SamplingParams {
            min_tokens: 2,
            ..SamplingParams::default()
        };
        assert!(m.adjusts_logits(1) && !m.adjusts_logits(2));
    }
}
