//! Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, with a
//! per-request seed so the same seed gives the same output, and logprobs; penalties and
//! biases first ([`penalties`]).

pub mod grammar;
pub mod penalties;

/// Sampling controls of one request (OpenAI + vLLM fields).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top logprobs to return per token (`None`: no logprobs).
    pub logprobs: Option<usize>,
    /// OpenAI's: subtracted once from the logit of every token already generated.
    #[serde(default)]
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per occurrence in the generated tokens.
    #[serde(default)]
    pub frequency_penalty: f32,
    /// vLLM's (transformers'): divides positive, multiplies negative logits of tokens
    /// in the prompt or output; 1 = off.
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// EOS and `stop_token_ids` cannot end the sequence before this many tokens.
    #[serde(default)]
    pub min_tokens: usize,
    /// What the output must match (structured outputs).
    #[serde(default)]
    pub grammar: Option<grammar::Grammar>,
}

fn one() -> f32 {
    1.0
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            grammar: None,
        }
    }
}

/// At most this many `logit_bias` entries (each applied per token on the engine thread).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// At most this many stop strings, each of at most [`MAX_STOP_BYTES`]: every
/// generated token is checked against each of them on the engine thread. A client
/// gives at most [`MAX_CLIENT_STOP`] (as OpenAI); the server adds its own (a single
/// tool call's closing tag).
pub const MAX_STOP: usize = 8;
pub const MAX_CLIENT_STOP: usize = 4;
pub const MAX_STOP_BYTES: usize = 256;
/// At most this many `stop_token_ids` (checked per token, like stop strings).
pub const MAX_STOP_TOKEN_IDS: usize = 128;
/// Most top logprobs per token (as OpenAI's `top_logprobs`).
pub const MAX_LOGPROBS: usize = 20;

impl SamplingParams {
    /// The bounds every request is held to, wherever it enters (the OpenAI API, or a
    /// peer's `/internal/*` and KV requests): a request outside them is refused by
    /// the name of the field, never clamped.
    pub fn check(&self) -> crate::Result<()> {
        let inv = |m: String, p: &str| Err(crate::EngineError::invalid(m, p));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return inv(
                format!("temperature must be >= 0, got {}", self.temperature),
                "temperature",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return inv(
                format!("top_p must be in (0, 1], got {}", self.top_p),
                "top_p",
            );
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return inv(
                format!("min_p must be in [0, 1], got {}", self.min_p),
                "min_p",
            );
        }
        if self.max_tokens == 0 {
            return inv("max_tokens must be at least 1".into(), "max_tokens");
        }
        if let Some(n) = self.logprobs
            && n > MAX_LOGPROBS
        {
            return inv(
                format!("logprobs must be at most {MAX_LOGPROBS}, got {n}"),
                "logprobs",
            );
        }
        if self.stop.len() > MAX_STOP {
            return inv(
                format!("at most {MAX_STOP} stop strings, got {}", self.stop.len()),
                "stop",
            );
        }
        if let Some(s) = self
            .stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return inv(
                format!(
                    "each stop string must be 1 to {MAX_STOP_BYTES} bytes, got {}",
                    s.len()
                ),
                "stop",
            );
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return inv(format!("{name} must be in [-2, 2], got {v}"), name);
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return inv(
                format!(
                    "repetition_penalty must be > 0, got {}",
                    self.repetition_penalty
                ),
                "repetition_penalty",
            );
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return inv(
                format!(
                    "at most {MAX_LOGIT_BIAS} logit_bias entries, got {}",
                    self.logit_bias.len()
                ),
                "logit_bias",
            );
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return inv(
                format!("logit_bias values must be in [-100, 100], got {b} for token {t}"),
                "logit_bias",
            );
        }
        if self.min_tokens > self.max_tokens {
            return inv(
                format!(
                    "min_tokens ({}) must not exceed max_tokens ({})",
                    self.min_tokens, self.max_tokens
                ),
                "min_tokens",
            );
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return inv(
                format!(
                    "at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {}",
                    self.stop_token_ids.len()
                ),
                "stop_token_ids",
            );
        }
        Ok(())
    }

    /// Token ids the request names must index the model's vocabulary of `vocab`.
    pub fn check_vocab(&self, vocab: usize) -> crate::Result<()> {
        if let Some((t, _)) = self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return Err(crate::EngineError::invalid(
                format!("logit_bias names token id {t}, outside the vocabulary (size {vocab})"),
                "logit_bias",
            ));
        }
        Ok(())
    }
}

/// The chosen token and, when asked for, its logprob and the top alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// SplitMix64 stream: small, fast, and reproducible from a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6A09_E667_F3BC_C909)
    }

    /// A fresh seed for requests that gave none.
    #[must_use]
    pub fn entropy() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Rng::new(t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed))
    }

    /// The generator's state, to continue the same stream elsewhere (KV transfer).
    #[must_use]
    pub fn state(&self) -> u64 {
        self.0
    }

    /// A generator continuing from [`Rng::state`].
    #[must_use]
    pub fn from_state(state: u64) -> Self {
        Rng(state)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// Picks the next token from `logits`.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> Sampled {
    sample_adjusted(logits, logits, p, rng)
}

/// Picks the next token of a sequence in `state` from the model's `logits`, after the
/// request's biases, `min_tokens` and penalties ([`penalties`]) and among the tokens
/// its grammar allows ([`grammar`]); logprobs are the model's own.
pub fn sample_with_state(
    logits: &[f32],
    p: &SamplingParams,
    rng: &mut Rng,
    state: &penalties::State,
    eos: &[u32],
    allowed: Option<&grammar::Allowed>,
) -> Sampled {
    if allowed.is_none() && !p.adjusts_logits(state.generated()) {
        return sample(logits, p, rng);
    }
    let mut adjusted = logits.to_vec();
    penalties::apply(&mut adjusted, p, state, eos);
    if let Some(a) = allowed {
        a.apply(&mut adjusted);
        // Biases, penalties or min_tokens removed all the grammar allows (only EOS was
        // left, say): the grammar wins over all of them for this token (its raw logits,
        // masked), or the output would break it.
        if adjusted.iter().all(|l| *l == f32::NEG_INFINITY) {
            adjusted.copy_from_slice(logits);
            a.apply(&mut adjusted);
        }
        if adjusted.iter().all(|l| *l == f32::NEG_INFINITY) {
            // Nothing allowed at all (cannot happen with a sound grammar): sample as
            // if unconstrained; the matcher refuses the token and the request ends
            // with that error.
            adjusted.copy_from_slice(logits);
        }
    }
    sample_adjusted(&adjusted, logits, p, rng)
}

/// Chooses from `choose` and reports logprobs of `report`.
fn sample_adjusted(choose: &[f32], report: &[f32], p: &SamplingParams, rng: &mut Rng) -> Sampled {
    let logits = report;
    let token = if p.temperature <= 0.0 || p.top_k == 1 {
        argmax(choose)
    } else {
        sample_stochastic(choose, p, rng)
    };
    let (logprob, top) = match p.logprobs {
        None => (None, Vec::new()),
        Some(n) => {
            // Logprobs of the model's own distribution, as vLLM reports by default.
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
            let mut top: Vec<(u32, f32)> = Vec::new();
            if n > 0 {
                let mut idx: Vec<usize> = (0..logits.len()).collect();
                let n = n.min(idx.len());
                idx.select_nth_unstable_by(n - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
                idx.truncate(n);
                idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                top = idx
                    .into_iter()
                    .map(|i| (i as u32, logits[i] - lse))
                    .collect();
            }
            (Some(logits[token] - lse), top)
        }
    };
    Sampled {
        token: token as u32,
        logprob,
        top,
    }
}

fn sample_stochastic(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> usize {
    let inv_t = 1.0 / p.temperature;
    // Candidates sorted by logit, cut by top-k first (cheap), then probabilities.
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if p.top_k > 0 && p.top_k < idx.len() {
        idx.select_nth_unstable_by(p.top_k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        idx.truncate(p.top_k);
    }
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let max = logits[idx[0]] * inv_t;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| f64::from(logits[i] * inv_t - max).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    for q in &mut probs {
        *q /= sum;
    }
    let mut keep = probs.len();
    if p.min_p > 0.0 {
        let floor = f64::from(p.min_p) * probs[0];
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut n = 0;
        for q in &probs[..keep] {
            acc += q;
            n += 1;
            if acc >= f64::from(p.top_p) {
                break;
            }
        }
        keep = n.max(1);
    }
    let total: f64 = probs[..keep].iter().sum();
    let mut r = rng.uniform() * total;
    for (k, q) in probs[..keep].iter().enumerate() {
        if r < *q {
            return idx[k];
        }
        r -= q;
    }
    idx[keep - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bound_is_refused_by_its_field() {
        let ok = SamplingParams::default();
        assert!(ok.check().is_ok());
        let field = |p: SamplingParams| match p.check() {
            Err(crate::EngineError::InvalidRequest { param, .. }) => param.unwrap(),
            other => panic!("accepted: {other:?}"),
        };
        let with = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p
        };
        assert_eq!(
            field(with(&|p| p.stop = vec!["x".into(); MAX_STOP + 1])),
            "stop"
        );
        assert_eq!(field(with(&|p| p.stop = vec!["x".repeat(257)])), "stop");
        assert_eq!(field(with(&|p| p.stop = vec![String::new()])), "stop");
        assert_eq!(
            field(with(&|p| p.stop_token_ids = vec![1; 129])),
            "stop_token_ids"
        );
        assert_eq!(field(with(&|p| p.logprobs = Some(10_000))), "logprobs");
        assert_eq!(field(with(&|p| p.temperature = f32::NAN)), "temperature");
        assert_eq!(field(with(&|p| p.top_p = 0.0)), "top_p");
        assert_eq!(field(with(&|p| p.min_p = 2.0)), "min_p");
        assert_eq!(field(with(&|p| p.max_tokens = 0)), "max_tokens");
        assert!(with(&|p| p.stop = vec!["y".repeat(256); 4]).check().is_ok());
    }

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_and_filters() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut rng = Rng::new(1);
        assert_eq!(sample(&logits, &params(0.0), &mut rng).token, 1);
        let top1 = SamplingParams {
            top_k: 1,
            ..params(1.0)
        };
        assert_eq!(sample(&logits, &top1, &mut rng).token, 1);
        // min_p 0.99 keeps only the top token; top_p tiny keeps only the top token.
        let mp = SamplingParams {
            min_p: 0.99,
            ..params(1.0)
        };
        let tp = SamplingParams {
            top_p: 0.01,
            ..params(1.0)
        };
        for _ in 0..50 {
            assert_eq!(sample(&logits, &mp, &mut rng).token, 1);
            assert_eq!(sample(&logits, &tp, &mut rng).token, 1);
        }
        // top_k 2 never picks the two unlikely tokens.
        let tk = SamplingParams {
            top_k: 2,
            ..params(5.0)
        };
        for _ in 0..200 {
            assert!(matches!(sample(&logits, &tk, &mut rng).token, 1 | 2));
        }
    }

    #[test]
    fn same_seed_same_draws_and_distribution_is_right() {
        let logits = [0.0f32, (3.0f32).ln()];
        let p = params(1.0);
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..100)
                .map(|_| sample(&logits, &p, &mut r).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
        let mut r = Rng::new(7);
        let ones = (0..20_000)
            .filter(|_| sample(&logits, &p, &mut r).token == 1)
            .count();
        let frac = ones as f64 / 20_000.0;
        assert!((frac - 0.75).abs() < 0.02, "P(1) = {frac}, expected 0.75");
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let p = SamplingParams {
            logprobs: Some(2),
            ..params(0.0)
        };
        let s = sample(&logits, &p, &mut Rng::new(0));
        let lse = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        assert!((s.logprob.unwrap() - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
