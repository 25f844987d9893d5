//! Per-replica capacity: what one prefill or decode replica can do at the SLOs.
//! `preheat engine profile` measures it on a real engine; the shipped default
//! describes a GPU-class replica.

use serde::{Deserialize, Serialize};

/// Capacity of one replica of each pool, and how long replicas take to start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Where the numbers come from (shown in logs and reports).
    pub source: String,
    /// Prefill throughput in prompt tokens/s, by prompt length: (length, tokens/s),
    /// ascending in length; interpolated linearly, clamped at the ends.
    pub prefill_tokens_per_s: Vec<(f64, f64)>,
    /// Decode inter-token latency in seconds by running batch size: (batch, seconds).
    pub decode_itl_s: Vec<(f64, f64)>,
    /// The same, measured again with longer contexts (`None` in profiles that predate
    /// it, and in the default: the ITL is then taken as independent of context).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_itl_long: Option<ContextItl>,
    /// KV-cache capacity of one decode replica, in tokens.
    pub kv_tokens: f64,
    /// Seconds from "start a replica" to serving, by how warm its node is.
    pub startup_s: Startup,
}

/// Decode ITL by batch size with every sequence's context `context` tokens long,
/// against `decode_itl_s` measured at `short_context`: a step's attention reads the
/// whole context, so between and beyond the two the ITL is taken as linear in it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContextItl {
    pub short_context: f64,
    pub context: f64,
    pub itl_s: Vec<(f64, f64)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Startup {
    pub cold: f64,
    pub staged: f64,
    pub hot: f64,
    pub standby: f64,
}

impl Default for Profile {
    /// An 8B Llama-class model in bf16 on one H100-class GPU under vLLM. The figures
    /// are representative values from public vLLM benchmark reports, not measured by
    /// this project: replace them with `preheat engine profile` output for real use.
    fn default() -> Self {
        Profile {
            source: "default: 8B bf16 model on one H100-class GPU (public vLLM figures, not measured here)".into(),
            prefill_tokens_per_s: vec![(128.0, 9_000.0), (512.0, 14_000.0), (2048.0, 16_000.0), (8192.0, 12_000.0), (32768.0, 7_000.0)],
            decode_itl_s: vec![(1.0, 0.008), (16.0, 0.011), (64.0, 0.018), (128.0, 0.028), (256.0, 0.048)],
            decode_itl_long: None,
            kv_tokens: 450_000.0,
            startup_s: Startup { cold: 300.0, staged: 60.0, hot: 20.0, standby: 2.0 },
        }
    }
}

fn interp(table: &[(f64, f64)], x: f64) -> f64 {
    match table {
        [] => 0.0,
        [(_, y)] => *y,
        _ => {
            if x <= table[0].0 {
                return table[0].1;
            }
            for w in table.windows(2) {
                let ((x0, y0), (x1, y1)) = (w[0], w[1]);
                if x <= x1 {
                    return y0 + (y1 - y0) * (x - x0) / (x1 - x0).max(f64::EPSILON);
                }
            }
            table[table.len() - 1].1
        }
    }
}

impl Profile {
    /// Reads and validates a profile JSON file; every problem at once.
    pub fn from_file(path: &std::path::Path) -> crate::Result<Self> {
        let at = |e: String| {
            crate::ScalerError::Config(vec![format!("profile {}: {e}", path.display())])
        };
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        let p: Profile = serde_json::from_str(&text).map_err(|e| at(e.to_string()))?;
        p.validate().map_err(|errs| at(errs.join("; ")))?;
        Ok(p)
    }

    /// Prompt tokens/s of one prefill replica for prompts of `len` tokens.
    #[must_use]
    pub fn prefill_rate(&self, len: f64) -> f64 {
        interp(&self.prefill_tokens_per_s, len)
    }

    /// Inter-token latency of one decode replica at `batch` running sequences.
    #[must_use]
    pub fn itl(&self, batch: f64) -> f64 {
        interp(&self.decode_itl_s, batch)
    }

    /// Inter-token latency at `batch` running sequences whose contexts (prompt and
    /// tokens generated) average `context` tokens: `itl(batch)` without a long-context
    /// table, and never below it.
    #[must_use]
    pub fn itl_at(&self, batch: f64, context: f64) -> f64 {
        let short = self.itl(batch);
        let Some(l) = &self.decode_itl_long else {
            return short;
        };
        let long = interp(&l.itl_s, batch);
        let span = (l.context - l.short_context).max(f64::EPSILON);
        let f = ((context - l.short_context) / span).max(0.0);
        (short + (long - short) * f).max(short)
    }

    /// Largest batch whose ITL stays within `slo`.
    #[must_use]
    pub fn max_batch_at(&self, slo: f64) -> f64 {
        let last = self.decode_itl_s.last().map_or(1.0, |p| p.0);
        // Step through the table with interpolation; fine-grained enough for sizing.
        let mut best = 1.0;
        let mut b = 1.0;
        while b <= last {
            if self.itl(b) <= slo {
                best = b;
            }
            b += 1.0;
        }
        best
    }

    /// Checks the tables; every problem at once.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        for (name, t) in [
            ("prefill_tokens_per_s", &self.prefill_tokens_per_s),
            ("decode_itl_s", &self.decode_itl_s),
        ] {
            if t.is_empty() {
                errs.push(format!("{name} is empty"));
            }
            if t.windows(2).any(|w| w[1].0 <= w[0].0) {
                errs.push(format!("{name} must be ascending in its first column"));
            }
            if t.iter()
                .any(|p| !(p.0.is_finite() && p.1.is_finite() && p.1 > 0.0))
            {
                errs.push(format!("{name} holds a non-positive or non-finite value"));
            }
        }
        if let Some(l) = &self.decode_itl_long {
            let t = &l.itl_s;
            if t.is_empty() || t.windows(2).any(|w| w[1].0 <= w[0].0) {
                errs.push("decode_itl_long.itl_s must be non-empty and ascending".into());
            }
            if t.iter()
                .any(|p| !(p.0.is_finite() && p.1.is_finite() && p.1 > 0.0))
            {
                errs.push("decode_itl_long.itl_s holds a non-positive or non-finite value".into());
            }
            if !(l.short_context.is_finite()
                && l.short_context > 0.0
                && l.context.is_finite()
                && l.context > l.short_context)
            {
                errs.push("decode_itl_long needs 0 < short_context < context".into());
            }
        }
        if !(self.kv_tokens.is_finite() && self.kv_tokens > 0.0) {
            errs.push("kv_tokens must be > 0".into());
        }
        let s = &self.startup_s;
        if [s.cold, s.staged, s.hot, s.standby]
            .iter()
            .any(|v| !(v.is_finite() && *v >= 0.0))
        {
            errs.push("startup_s values must be >= 0".into());
        }
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_itl_grows_with_the_context_only_where_the_profile_measured_it() {
        let mut p = Profile::default();
        // Without the long-context table, the context changes nothing.
        assert_eq!(p.itl_at(16.0, 5_000.0).to_bits(), p.itl(16.0).to_bits());
        p.decode_itl_long = Some(ContextItl {
            short_context: 8.0,
            context: 256.0,
            itl_s: vec![(1.0, 0.010), (16.0, 0.015)],
        });
        assert!(p.validate().is_ok());
        // At the short context, the short table; at the long one, the long table;
        // halfway, halfway; beyond, on the same line; never below the short table.
        assert!((p.itl_at(16.0, 8.0) - 0.011).abs() < 1e-12);
        assert!((p.itl_at(16.0, 256.0) - 0.015).abs() < 1e-12);
        assert!((p.itl_at(16.0, 132.0) - 0.013).abs() < 1e-12);
        assert!((p.itl_at(16.0, 504.0) - 0.019).abs() < 1e-12);
        assert!((p.itl_at(16.0, 1.0) - 0.011).abs() < 1e-12);
        // Old profile files, without the table, still read.
        let old = r#"{"source":"s","prefill_tokens_per_s":[[16,100]],"decode_itl_s":[[1,0.02]],
            "kv_tokens":1000,"startup_s":{"cold":1,"staged":1,"hot":1,"standby":1}}"#;
        let read: Profile = serde_json::from_str(old).unwrap();
        assert!(read.decode_itl_long.is_none());
        p.decode_itl_long.as_mut().unwrap().context = 4.0;
        assert!(p.validate().is_err());
    }

    #[test]
    fn default_profile_is_valid_and_monotone_where_it_matters() {
        let p = Profile::default();
        p.validate().unwrap();
        assert_eq!(p.prefill_rate(10.0), 9_000.0);
        assert!((p.prefill_rate(1280.0) - 15_000.0).abs() < 1e-6);
        assert_eq!(
            p.max_batch_at(0.005),
            1.0,
            "nothing meets an impossible SLO but one sequence"
        );
        assert_eq!(p.max_batch_at(0.018), 64.0);
        assert!(p.max_batch_at(0.05) >= 256.0);
    }
}
