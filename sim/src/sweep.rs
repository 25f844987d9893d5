//! Comparisons over more than one setting: each policy's frontier (its knob swept:
//! what each attainment costs), and every policy again per start-up time.

use serde::Serialize;

use crate::config::SimConfig;
use crate::registry::{RunSpec, UnknownPolicy, knob, policy_list, run_many, setting};
use crate::report::PolicyReport;
use crate::trace::TraceRequest;

/// One run's outcome, small enough to tabulate and plot.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub policy: String,
    /// The knob setting; `None` for the references.
    pub knob: Option<f64>,
    pub slo_attainment: f64,
    pub gpu_seconds: f64,
    pub max_prefill_replicas: u32,
    pub max_decode_replicas: u32,
}

impl From<&PolicyReport> for Point {
    fn from(r: &PolicyReport) -> Self {
        Point {
            policy: r.name.clone(),
            knob: r.knob,
            slo_attainment: r.slo_attainment,
            gpu_seconds: r.gpu_seconds,
            max_prefill_replicas: r.max_prefill_replicas,
            max_decode_replicas: r.max_decode_replicas,
        }
    }
}

impl Point {
    /// Whether `self` reaches `other`'s attainment at no more GPU time: what "a
    /// baseline does as well" means for the frontier target.
    #[must_use]
    pub fn matches_or_beats(&self, other: &Point) -> bool {
        self.slo_attainment >= other.slo_attainment && self.gpu_seconds <= other.gpu_seconds
    }
}

/// Every policy's points with its knob swept, and the references.
#[derive(Clone, Debug, Serialize)]
pub struct Frontier {
    pub points: Vec<Point>,
    /// `preheat` at its configured (shipped) setting.
    pub preheat: Option<Point>,
    /// Points of causal baselines that reach `preheat`'s attainment at no more GPU
    /// time (empty: `preheat` is not beaten by any setting of any baseline).
    pub beaten_by: Vec<Point>,
}

/// References: they know the trace, so they are not candidates to beat `preheat`.
const REFERENCES: [&str; 2] = ["static-peak", "clairvoyant"];

/// Sweeps each named policy's knob (references run once).
pub fn frontier(
    names: &[String],
    cfg: &SimConfig,
    trace: &[TraceRequest],
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Frontier, UnknownPolicy> {
    let mut specs = Vec::new();
    let mut shipped = None;
    for policy in policy_list(names)? {
        let unswept = RunSpec {
            policy: policy.clone(),
            knob: None,
            cfg: cfg.clone(),
        };
        match knob(&policy) {
            Some(k) => {
                // The setting that runs without a sweep: preheat's configured headroom,
                // a baseline's default.
                let own = setting(&unswept);
                if policy == "preheat" {
                    shipped = Some(own);
                }
                for &v in k.sweep {
                    specs.push(RunSpec {
                        knob: Some(v),
                        ..unswept.clone()
                    });
                }
                if own.is_none_or(|o| !k.sweep.contains(&o)) {
                    specs.push(unswept);
                }
            }
            None => specs.push(unswept),
        }
    }
    let points: Vec<Point> = run_many(&specs, cfg, trace, progress)?
        .iter()
        .map(Point::from)
        .collect();
    let preheat = shipped.and_then(|own| {
        points
            .iter()
            .find(|p| p.policy == "preheat" && p.knob == own)
            .cloned()
    });
    let beaten_by = preheat.as_ref().map_or_else(Vec::new, |me| {
        points
            .iter()
            .filter(|p| p.policy != "preheat" && !REFERENCES.contains(&p.policy.as_str()))
            .filter(|p| p.matches_or_beats(me))
            .cloned()
            .collect()
    });
    Ok(Frontier {
        points,
        preheat,
        beaten_by,
    })
}

/// Every named policy per start-up time.
#[derive(Clone, Debug, Serialize)]
pub struct StartupSweep {
    /// (start-up seconds, each policy's point).
    pub rows: Vec<(f64, Vec<Point>)>,
}

/// Reruns every named policy with replicas starting in each of `startups` seconds.
pub fn startup_sweep(
    names: &[String],
    cfg: &SimConfig,
    trace: &[TraceRequest],
    startups: &[f64],
    progress: &(dyn Fn(&str) + Sync),
) -> Result<StartupSweep, UnknownPolicy> {
    let list = policy_list(names)?;
    let mut specs = Vec::new();
    for &s in startups {
        for policy in &list {
            specs.push(RunSpec {
                policy: policy.clone(),
                knob: None,
                cfg: cfg.clone().with_startup_s(s),
            });
        }
    }
    let reports = run_many(&specs, cfg, trace, progress)?;
    let rows = startups
        .iter()
        .zip(reports.chunks(list.len().max(1)))
        .map(|(&s, rs)| (s, rs.iter().map(Point::from).collect()))
        .collect();
    Ok(StartupSweep { rows })
}
