//! Fleet traces: many models' requests in one Mooncake JSONL file, each line naming
//! its `model`. Made from any single-model trace by [`generate`] (`preheat trace
//! fleet`): popularity follows Zipf; each model alternates active stretches, whose
//! arrivals follow the base trace from a random offset thinned to the model's rate,
//! with idle ones, the less popular the longer idle (the tail idles for hours). Each
//! model's prefix blocks are its own.

use std::path::Path;

use serde::Deserialize;

use crate::day::SplitMix;
use crate::trace::{TraceError, TraceRequest};

/// One request of a fleet trace: the model it names (an index into the trace's
/// model list) and the request.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetRequest {
    pub model: usize,
    pub req: TraceRequest,
}

/// A fleet trace: its model names (in order of first appearance, or as generated)
/// and its requests, sorted by arrival (the first at 0 once read back).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetTrace {
    pub models: Vec<String>,
    pub requests: Vec<FleetRequest>,
}

/// How [`generate`] shapes a fleet.
#[derive(Clone, Debug, PartialEq)]
#[must_use]
pub struct FleetShape {
    pub models: usize,
    pub hours: f64,
    /// Zipf exponent of the models' popularity (model `i` gets a share ∝ 1/(i+1)^s).
    pub zipf: f64,
    pub seed: u64,
    /// Mean length of an active stretch, seconds.
    pub active_mean_s: f64,
}

impl Default for FleetShape {
    fn default() -> Self {
        FleetShape {
            models: 12,
            hours: 3.0,
            zipf: 1.1,
            seed: 1,
            active_mean_s: 1200.0,
        }
    }
}

/// The most models a generated fleet may have (names `m000`..; the simulator's
/// per-model tables stay small).
pub const MAX_MODELS: usize = 1000;

impl FleetShape {
    /// Every problem with the shape, at once.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut e = Vec::new();
        if !(1..=MAX_MODELS).contains(&self.models) {
            e.push(format!(
                "models {}: between 1 and {MAX_MODELS}",
                self.models
            ));
        }
        if !(self.hours.is_finite() && self.hours > 0.0 && self.hours <= 24.0 * 14.0) {
            e.push(format!("hours {}: between 0 and 336", self.hours));
        }
        if !(self.zipf.is_finite() && (0.0..=4.0).contains(&self.zipf)) {
            e.push(format!("zipf {}: between 0 and 4", self.zipf));
        }
        if !(self.active_mean_s.is_finite() && self.active_mean_s >= 1.0) {
            e.push(format!(
                "active stretch {} s: at least 1 s",
                self.active_mean_s
            ));
        }
        e
    }

    /// Each model's share of the fleet's requests (Zipf, summing to 1).
    #[must_use]
    pub fn shares(&self) -> Vec<f64> {
        let w: Vec<f64> = (0..self.models)
            .map(|i| 1.0 / ((i + 1) as f64).powf(self.zipf))
            .collect();
        let sum: f64 = w.iter().sum();
        w.into_iter().map(|x| x / sum).collect()
    }

    /// Share of the time model `i` is active: the most popular always, the others in
    /// proportion to their popularity, none below 2% (the tail idles for hours between
    /// stretches of the mean length).
    fn duty(shares: &[f64], i: usize) -> f64 {
        (shares[i] / shares[0]).clamp(0.02, 1.0)
    }
}

/// The name of model `i` among `n`: `m` and the index, zero-padded to the width of
/// the largest (`m00`..`m11`).
#[must_use]
pub fn model_name(i: usize, n: usize) -> String {
    let width = n.saturating_sub(1).max(1).to_string().len().max(2);
    format!("m{i:0width$}")
}

/// The most requests a generated fleet trace may hold (its expected size, the base
/// trace's rate over `hours`): past it, a base trace too dense or hours too many.
pub const MAX_REQUESTS: f64 = 20e6;

/// A fleet trace shaped by `shape` from the single-model trace `base` (sorted, first
/// at 0, as [`crate::trace::load`] gives it). The fleet's mean rate is the base trace's;
/// a model's rate while active is its share of that over its duty. Seeded. Refused,
/// with every problem, for a bad shape or a trace that would be too large.
pub fn generate(base: &[TraceRequest], shape: &FleetShape) -> Result<FleetTrace, Vec<String>> {
    let mut problems = shape.problems();
    if base.is_empty() {
        problems.push("the base trace holds no requests".into());
    }
    // A base trace spanning under a second is read as a second long.
    let span = base.last().map_or(0.0, |r| r.t).max(1.0);
    let base_rate = base.len() as f64 / span;
    let end = shape.hours * 3600.0;
    let expected = base_rate * end;
    if expected > MAX_REQUESTS {
        problems.push(format!(
            "the fleet would hold about {expected:.0} requests ({base_rate:.1} req/s over {} h), more than {MAX_REQUESTS:.0}: fewer hours, or a sparser base trace",
            shape.hours
        ));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let mut out = FleetTrace {
        models: (0..shape.models)
            .map(|i| model_name(i, shape.models))
            .collect(),
        requests: Vec::new(),
    };
    // Each model's blocks renumbered densely into a range of its own: model m's copy
    // of the base's k-th distinct block is m × distinct + k (no overflow for any id).
    let mut dense = std::collections::HashMap::new();
    for b in base.iter().flat_map(|r| r.blocks.iter()) {
        let next = dense.len() as u64;
        dense.entry(*b).or_insert(next);
    }
    let distinct = dense.len() as u64;
    let shares = shape.shares();
    let mut rng = SplitMix::new(shape.seed);
    for (m, share) in shares.iter().enumerate() {
        let duty = FleetShape::duty(&shares, m);
        // Requests/s while active; above the base rate, several offsets overlaid.
        let rate = share * base_rate / duty;
        let copies = (rate / base_rate).ceil().max(1.0);
        let keep = rate / (base_rate * copies);
        let idle_mean = shape.active_mean_s * (1.0 - duty) / duty;
        // Active at the start with the chance of its duty, else idle first.
        let mut t = if rng.unit() < duty {
            0.0
        } else {
            rng.exp(idle_mean)
        };
        while t < end {
            let stretch = if duty >= 1.0 {
                end
            } else {
                rng.exp(shape.active_mean_s)
            };
            let stop = (t + stretch).min(end);
            for _ in 0..copies as usize {
                let offset = rng.unit() * span;
                let first = base.partition_point(|r| r.t < offset);
                // Walk the base trace from the offset, wrapping around its end.
                let mut at = t;
                let mut k = first;
                let mut prev = offset;
                loop {
                    let r = &base[k % base.len()];
                    let gap = if k == first {
                        r.t - offset
                    } else if k % base.len() == 0 {
                        r.t + (span - prev).max(0.0)
                    } else {
                        r.t - prev
                    };
                    at += gap.max(0.0);
                    prev = r.t;
                    if at >= stop {
                        break;
                    }
                    if rng.unit() < keep {
                        let mut req = r.clone();
                        req.t = at;
                        for b in &mut req.blocks {
                            *b = m as u64 * distinct + dense[b];
                        }
                        out.requests.push(FleetRequest { model: m, req });
                    }
                    k += 1;
                }
            }
            t = stop;
            if duty < 1.0 {
                t += rng.exp(idle_mean);
            }
        }
    }
    out.requests.sort_by(|a, b| a.req.t.total_cmp(&b.req.t));
    Ok(out)
}

/// Writes a fleet trace as Mooncake JSONL with a `model` field per line.
pub fn write_jsonl(trace: &FleetTrace, out: &mut impl std::io::Write) -> std::io::Result<()> {
    for r in &trace.requests {
        let line = serde_json::json!({
            "timestamp": (r.req.t * 1000.0).round() as u64,
            "model": trace.models[r.model],
            "input_length": r.req.input_tokens,
            "output_length": r.req.output_tokens,
            "hash_ids": r.req.blocks,
        });
        writeln!(out, "{line}")?;
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetLine {
    timestamp: f64,
    model: String,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a fleet trace. With `known`, a line naming a model not in it is refused,
/// naming the line; the trace's model list is then `known` itself.
pub fn load(path: &Path, known: Option<&[String]>) -> Result<FleetTrace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text, &path.display().to_string(), known)
}

/// Parses fleet trace text; `name` labels errors.
pub fn parse(text: &str, name: &str, known: Option<&[String]>) -> Result<FleetTrace, TraceError> {
    let mut trace = FleetTrace {
        models: known.map(<[String]>::to_vec).unwrap_or_default(),
        requests: Vec::new(),
    };
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |msg: String| TraceError::Parse {
            path: name.to_owned(),
            line: i + 1,
            msg,
        };
        let l: FleetLine = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        let req = crate::trace::mooncake_request(
            l.timestamp,
            l.input_length,
            l.output_length,
            l.hash_ids,
        )
        .map_err(err)?;
        let model = match trace.models.iter().position(|m| *m == l.model) {
            Some(m) => m,
            None if known.is_some() => {
                return Err(err(format!(
                    "model {:?} is not in the fleet ({})",
                    l.model,
                    trace.models.join(", ")
                )));
            }
            None => {
                trace.models.push(l.model);
                trace.models.len() - 1
            }
        };
        trace.requests.push(FleetRequest { model, req });
    }
    if trace.requests.is_empty() {
        return Err(TraceError::Empty(name.to_owned()));
    }
    trace.requests.sort_by(|a, b| a.req.t.total_cmp(&b.req.t));
    let t0 = trace.requests[0].req.t;
    for r in &mut trace.requests {
        r.req.t -= t0;
    }
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A base trace: one request a second for 100 s, a block each.
    fn base() -> Vec<TraceRequest> {
        (0..100)
            .map(|i| TraceRequest {
                t: f64::from(i),
                input_tokens: 100 + i,
                output_tokens: 10,
                blocks: vec![u64::from(i)],
            })
            .collect()
    }

    fn shape() -> FleetShape {
        FleetShape {
            models: 8,
            hours: 6.0,
            zipf: 1.1,
            seed: 7,
            active_mean_s: 600.0,
        }
    }

    #[test]
    fn popularity_follows_zipf_and_the_tail_idles_for_hours() {
        let t = generate(&base(), &shape()).unwrap();
        let mut count = vec![0usize; 8];
        for r in &t.requests {
            count[r.model] += 1;
        }
        // The fleet's rate is the base trace's (1/s over 6 h), within noise.
        let total = t.requests.len() as f64;
        assert!((total / 21_600.0 - 1.0).abs() < 0.25, "{total}");
        // The most popular model has the most requests, and more than the last by far.
        assert_eq!(count.iter().max(), Some(&count[0]), "{count:?}");
        assert!(count[0] > 5 * count[7], "{count:?}");
        // The least popular model's longest gap is hours.
        let times: Vec<f64> = t
            .requests
            .iter()
            .filter(|r| r.model == 7)
            .map(|r| r.req.t)
            .collect();
        let longest_gap = times
            .windows(2)
            .map(|w| w[1] - w[0])
            .chain([times.first().copied().unwrap_or(21_600.0)])
            .fold(0.0, f64::max);
        assert!(longest_gap > 3600.0, "{longest_gap}");
    }

    #[test]
    fn each_model_has_its_own_blocks_and_the_trace_is_seeded() {
        let t = generate(&base(), &shape()).unwrap();
        let mut owner = std::collections::HashMap::new();
        for r in &t.requests {
            for b in &r.req.blocks {
                assert_eq!(*owner.entry(*b).or_insert(r.model), r.model, "block {b}");
            }
        }
        assert_eq!(t, generate(&base(), &shape()).unwrap());
        assert_ne!(
            t,
            generate(&base(), &FleetShape { seed: 8, ..shape() }).unwrap()
        );
    }

    #[test]
    fn written_and_read_back_it_is_the_same_trace() {
        let t = generate(&base(), &shape()).unwrap();
        let mut buf = Vec::new();
        write_jsonl(&t, &mut buf).unwrap();
        let back = parse(std::str::from_utf8(&buf).unwrap(), "t", Some(&t.models)).unwrap();
        assert_eq!(back.requests.len(), t.requests.len());
        let t0 = t.requests[0].req.t;
        for (a, b) in back.requests.iter().zip(&t.requests) {
            assert_eq!(a.model, b.model);
            assert!((a.req.t - (b.req.t - t0)).abs() < 1e-3);
            assert_eq!(a.req.blocks, b.req.blocks);
        }
    }

    #[test]
    fn a_line_naming_a_model_the_fleet_lacks_is_refused_naming_the_line() {
        let text = "{\"timestamp\": 0, \"model\": \"a\", \"input_length\": 5, \"output_length\": 2}\n\
                    {\"timestamp\": 9, \"model\": \"zz\", \"input_length\": 5, \"output_length\": 2}\n";
        let known = ["a".to_owned()];
        let e = parse(text, "f.jsonl", Some(&known))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("f.jsonl:2:") && e.contains("\"zz\""), "{e}");
        // Without a fleet, the models are the trace's own.
        assert_eq!(parse(text, "f", None).unwrap().models, ["a", "zz"]);
        // A line without its model is refused too.
        let e = parse(
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 2}",
            "f",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("model"), "{e}");
    }

    #[test]
    fn bad_shapes_are_refused_all_at_once() {
        let p = FleetShape {
            models: 0,
            hours: -1.0,
            zipf: f64::NAN,
            ..FleetShape::default()
        }
        .problems();
        assert_eq!(p.len(), 3, "{p:?}");
    }

    #[test]
    fn huge_block_ids_and_a_base_trace_of_one_instant_are_handled() {
        // Ids near u64::MAX are renumbered, never overflowed.
        let mut b = base();
        b[0].blocks = vec![u64::MAX, u64::MAX - 1];
        let t = generate(&b, &shape()).unwrap();
        assert!(
            t.requests
                .iter()
                .all(|r| r.req.blocks.iter().all(|&x| x < 8 * 101))
        );
        // Every request at one instant: read as one second, far too dense for hours.
        let same: Vec<TraceRequest> = (0..50_000)
            .map(|_| TraceRequest {
                t: 0.0,
                ..base()[0].clone()
            })
            .collect();
        let e = generate(&same, &shape()).unwrap_err();
        assert!(e[0].contains("sparser"), "{e:?}");
        // An empty base and a bad shape are refused, every problem at once.
        let e = generate(
            &[],
            &FleetShape {
                active_mean_s: 0.0,
                ..shape()
            },
        )
        .unwrap_err();
        assert_eq!(e.len(), 2, "{e:?}");
    }

    #[test]
    fn the_shipped_example_reads_with_its_fleets_models() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
        let fleet = crate::fleet_config::Fleet::load(&root.join("fleets/example.yaml")).unwrap();
        let names: Vec<String> = fleet.models.iter().map(|m| m.name.clone()).collect();
        let t = load(&root.join("traces/fleet_example.jsonl"), Some(&names)).unwrap();
        assert_eq!(t.models, names);
        assert_eq!(t.requests.len(), 19_545);
    }

    #[test]
    fn names_sort_as_numbers() {
        assert_eq!(model_name(3, 12), "m03");
        assert_eq!(model_name(3, 200), "m003");
    }
}
