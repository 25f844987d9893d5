//! The simulator's prediction of a measured run: the same requests, profile, start
//! times and policies, actuated as `up` actuates them; and how far off it is.

use anyhow::bail;
use preheat_scaler::policy::PoolPolicy;
use preheat_sim::trace::TraceRequest;
use preheat_sim::{Actuation, SimConfig, StartClass};

use super::report::{Missed, PoolComparison, Report};
use super::saved_run::SavedRun;
use crate::serve::{self, Outcome, Planned};

/// Predicted replica-seconds may be off by this fraction of the measured …
const REPLICA_SECONDS_TOLERANCE: f64 = 0.20;
/// … and predicted attainment by this many percentage points. A miss means the model
/// needs fixing, not these.
const ATTAINMENT_TOLERANCE_POINTS: f64 = 5.0;

/// The host's capacity is known to a few percent only: this machine is shared, and
/// the measured profile moves by more than this between runs. Predicted attainment is
/// also given with this fraction fewer and more worker slots. Where those two differ
/// by more than the tolerance, the load sits at the host's capacity and a miss says
/// as much about that noise as about the model.
pub(super) const HOST_SLOTS_SENSITIVITY: f64 = 0.05;

/// How many workers run at full speed together on the measured machine: the cores the
/// stack's own processes left them on average (`stack_cores`), over each worker's
/// compute threads. At least a tenth of one.
fn host_slots(stack_cores: f64, host_cores: usize, worker_threads: usize) -> f64 {
    ((host_cores as f64 - stack_cores) / worker_threads.max(1) as f64).max(0.1)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    preheat_scaler::percentile::percentile(&mut v, 0.5)
}

/// A request's prompt and output tokens as the server counted them (its usage), else
/// as planned.
fn counted(p: &Planned, o: &Outcome) -> (u32, u32) {
    let n = |v: Option<u64>, planned: u32| v.and_then(|n| u32::try_from(n).ok()).unwrap_or(planned);
    (
        n(o.prompt_tokens, p.input_tokens),
        n(o.completion_tokens, p.output_tokens),
    )
}

/// The requests as they were sent: when, and how many tokens the server counted.
fn trace_of(planned: &[Planned], outcomes: &[Outcome]) -> Vec<TraceRequest> {
    let mut t: Vec<TraceRequest> = planned
        .iter()
        .zip(outcomes)
        .map(|(p, o)| {
            let (input_tokens, output_tokens) = counted(p, o);
            TraceRequest {
                t: o.sent_at,
                input_tokens,
                output_tokens,
                blocks: Vec::new(),
            }
        })
        .collect();
    t.sort_by(|a, b| a.t.total_cmp(&b.t));
    t
}

/// Whether a request was answered within the SLOs as the simulator counts them.
fn attained(o: &Outcome, input_tokens: u32, prefill: &PoolPolicy, decode: &PoolPolicy) -> bool {
    o.ok && o
        .ttft
        .is_some_and(|t| t <= prefill.ttft_slo_for(f64::from(input_tokens)) + 1e-9)
        && o.itl.is_none_or(|i| i <= decode.slo_itl_s + 1e-9)
}

/// ∫ replicas dt over [0, end] of a step function sampled at `samples` (each value
/// holds until the next sample; before the first, the pools are at their first value).
fn replica_seconds(
    samples: &[(f64, u32, u32)],
    end: f64,
    pick: fn(&(f64, u32, u32)) -> u32,
) -> f64 {
    let mut total = 0.0;
    for (i, s) in samples.iter().enumerate() {
        let from = if i == 0 { 0.0 } else { s.0.min(end) };
        let to = samples.get(i + 1).map_or(end, |n| n.0.min(end));
        total += f64::from(pick(s)) * (to - from).max(0.0);
    }
    total
}

fn compare(
    pool: &'static str,
    measured: &[(f64, u32, u32)],
    predicted: &[(f64, u32, u32)],
    end: f64,
    pick: fn(&(f64, u32, u32)) -> u32,
) -> PoolComparison {
    let m = replica_seconds(measured, end, pick);
    let p = replica_seconds(predicted, end, pick);
    let error = (m > 0.0).then(|| (p - m) / m);
    let max = |v: &[(f64, u32, u32)]| v.iter().filter(|s| s.0 <= end).map(pick).max().unwrap_or(0);
    PoolComparison {
        pool,
        measured_replica_s: m,
        predicted_replica_s: p,
        error,
        within_tolerance: error.map_or(p == 0.0, |e| e.abs() <= REPLICA_SECONDS_TOLERANCE),
        measured_max: max(measured),
        predicted_max: max(predicted),
    }
}

/// The simulator's prediction of a measured run, and how far off it is.
pub(super) fn predict(run: SavedRun) -> anyhow::Result<Report> {
    let SavedRun {
        planned,
        measured: m,
        profile: measured_profile,
        prefill,
        decode,
        standbys,
        interval_s,
        window_s,
        prefill_batch_tokens,
        disagg_min_tokens,
        ..
    } = run;
    if m.replicas.is_empty() {
        bail!("the run has no replica counts to compare with");
    }
    let of = |standby: bool| {
        median(
            m.starts
                .iter()
                .filter(|s| (s.source == "standby") == standby)
                .map(|s| s.seconds)
                .collect(),
        )
    };
    let (start_s, promote_s) = (of(false), of(true));
    let mut profile = measured_profile;
    if let Some(s) = start_s {
        profile.startup_s.hot = s;
    }
    if let Some(s) = promote_s {
        profile.startup_s.standby = s;
    }
    let mut cfg = SimConfig::new(prefill.clone(), decode.clone(), profile.clone());
    cfg.start = if standbys > 0 {
        StartClass::Standby
    } else {
        StartClass::Hot
    };
    cfg.standbys = standbys;
    cfg.actuation = Actuation::Direct;
    cfg.interval_s = interval_s;
    cfg.window_s = window_s;
    cfg.sample_s = 1.0;
    // `up` starts idle, with every worker on this one machine. The profile was
    // measured with the threads each worker has, so that many fit side by side in the
    // cores the gateway, scaler and load generator leave.
    cfg.warm_start = false;
    let stack_cores = m.stack_cpu_s.map_or(0.0, |c| c / m.window_s.max(1e-9));
    let slots = host_slots(stack_cores, m.host_cores, m.worker_threads);
    cfg.shared_host = Some(slots);
    cfg.shared_host_slowdown = m
        .host_slowdown
        .iter()
        .map(|&(k, f)| (f64::from(k), f))
        .collect();
    // `up`'s workers batch queued prompts up to their default token budget.
    cfg.prefill_batch_tokens = Some(prefill_batch_tokens);
    // `up`'s gateway has decode workers compute prompts shorter than its default
    // `--disagg-min-tokens` themselves.
    cfg.local_prefill_below = Some(disagg_min_tokens);
    let trace = trace_of(&planned, &m.outcomes);
    let prefilled_on_decode = trace.iter().filter(|r| cfg.prefills_on_decode(r)).count();
    tracing::info!("simulating the same run");
    let predicted = preheat_sim::run_policy("preheat", &cfg, &trace)?;
    let attainment_with = |f: f64| -> anyhow::Result<f64> {
        let mut c = cfg.clone();
        c.shared_host = Some(slots * f);
        Ok(preheat_sim::run_policy("preheat", &c, &trace)?.slo_attainment)
    };
    let predicted_attainment_band = (
        attainment_with(1.0 - HOST_SLOTS_SENSITIVITY)?,
        attainment_with(1.0 + HOST_SLOTS_SENSITIVITY)?,
    );

    let missed: Vec<Missed> = m
        .outcomes
        .iter()
        .zip(&planned)
        .filter_map(|(o, p)| {
            let (prompt_tokens, completion_tokens) = counted(p, o);
            (!attained(o, prompt_tokens, &prefill, &decode)).then_some(Missed {
                sent_at: o.sent_at,
                prompt_tokens,
                completion_tokens,
                ttft: o.ttft,
                itl: o.itl,
                ok: o.ok,
            })
        })
        .collect();
    let ok = m.outcomes.len() - missed.len();
    let n = m.outcomes.len().max(1);
    let measured_attainment = ok as f64 / n as f64;
    let pools = vec![
        compare(
            "prefill",
            &m.replicas,
            &predicted.timeline,
            m.window_s,
            |s| s.1,
        ),
        compare(
            "decode",
            &m.replicas,
            &predicted.timeline,
            m.window_s,
            |s| s.2,
        ),
    ];
    let attainment_error_points = (predicted.slo_attainment - measured_attainment) * 100.0;
    let within_tolerance = attainment_error_points.abs() <= ATTAINMENT_TOLERANCE_POINTS
        && pools.iter().all(|p| p.within_tolerance);
    let pcts = |v: &mut Vec<f64>| {
        (
            preheat_scaler::percentile::percentile(v, 0.5),
            preheat_scaler::percentile::percentile(v, 0.99),
        )
    };
    let answered = || m.outcomes.iter().filter(|o| o.ok);
    let measured_ttft = pcts(&mut answered().filter_map(|o| o.ttft).collect());
    let measured_itl = pcts(&mut answered().filter_map(|o| o.itl).collect());
    let report = Report {
        requests: m.outcomes.len(),
        failed: m.outcomes.iter().filter(|o| !o.ok).count(),
        errors: m
            .up_exited
            .iter()
            .cloned()
            .chain(serve::first_errors(&m.outcomes))
            .collect(),
        window_s: m.window_s,
        profile_source: profile.source.clone(),
        starts: m.starts,
        sim_start_s: profile.startup_s.hot,
        sim_promote_s: profile.startup_s.standby,
        sim_start_measured: start_s.is_some(),
        stack_cores,
        host_slots: slots,
        host_slowdown: m.host_slowdown.clone(),
        prefilled_on_decode,
        disagg_min_tokens,
        measured_attainment,
        predicted_attainment: predicted.slo_attainment,
        predicted_attainment_band,
        attainment_error_points,
        measured_ttft,
        predicted_ttft: (predicted.ttft_p50, predicted.ttft_p99),
        measured_itl,
        predicted_itl: (predicted.itl_p50, predicted.itl_p99),
        pools,
        missed,
        replica_s_tolerance: REPLICA_SECONDS_TOLERANCE,
        attainment_tolerance_points: ATTAINMENT_TOLERANCE_POINTS,
        within_tolerance,
        measured: m.replicas,
        predicted: predicted
            .timeline
            .iter()
            .copied()
            .filter(|s| s.0 <= m.window_s)
            .collect(),
    };
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_seconds_integrate_a_step_function_over_the_window() {
        let s = [(0.5, 0, 1), (10.0, 2, 1), (20.0, 1, 0)];
        // prefill: 0 until 10, 2 until 20, 1 until 25.
        assert_eq!(replica_seconds(&s, 25.0, |x| x.1), 25.0);
        // decode: 1 until 20 (the first sample holds from 0), 0 after.
        assert_eq!(replica_seconds(&s, 25.0, |x| x.2), 20.0);
        // Samples after the window do not count.
        assert_eq!(replica_seconds(&s, 15.0, |x| x.1), 10.0);
        assert_eq!(replica_seconds(&[], 15.0, |x| x.1), 0.0);
    }

    #[test]
    fn errors_are_relative_to_the_measured_side() {
        let m = [(0.0, 2, 0)];
        let p = [(0.0, 1, 0), (5.0, 3, 0)];
        let c = compare("prefill", &m, &p, 10.0, |x| x.1);
        assert_eq!((c.measured_replica_s, c.predicted_replica_s), (20.0, 20.0));
        assert_eq!(c.error, Some(0.0));
        assert_eq!((c.measured_max, c.predicted_max), (2, 3));
        let idle = compare("decode", &m, &p, 10.0, |x| x.2);
        assert_eq!(idle.error, None);
        // A pool only the prediction ran is a miss, not a pass.
        let phantom = compare("decode", &[(0.0, 0, 0)], &[(0.0, 0, 1)], 10.0, |x| x.2);
        assert_eq!(phantom.error, None);
        assert!(!phantom.within_tolerance);
        assert!(idle.within_tolerance && c.within_tolerance);
    }

    #[test]
    fn attainment_counts_like_the_simulator() {
        let policy = PoolPolicy {
            slo_ttft_s: 1.0,
            slo_ttft_ref_tokens: 100.0,
            slo_itl_s: 0.05,
            ..PoolPolicy::default()
        };
        let o = |ttft: f64, itl: Option<f64>| Outcome {
            ok: true,
            ttft: Some(ttft),
            itl,
            ..Outcome::default()
        };
        // A 300-token prompt has three times the TTFT target.
        assert!(attained(&o(2.5, Some(0.01)), 300, &policy, &policy));
        assert!(!attained(&o(2.5, Some(0.01)), 100, &policy, &policy));
        assert!(!attained(&o(0.5, Some(0.06)), 100, &policy, &policy));
        assert!(attained(&o(0.5, None), 100, &policy, &policy));
        let failed = Outcome {
            ok: false,
            ..o(0.1, None)
        };
        assert!(!attained(&failed, 100, &policy, &policy));
    }

    #[test]
    fn the_simulated_itl_histogram_has_the_engines_buckets() {
        assert_eq!(
            preheat_sim::ITL_BUCKETS.as_slice(),
            preheat_engine::metrics::ITL_BUCKETS
        );
    }

    /// The simulator's decode KV is the running sequences' own; the real scaler sees
    /// it as usage less the engine's reservations, read by the name the engine writes.
    #[test]
    fn the_scaler_reads_the_engines_reserved_kv_by_name() {
        use preheat_engine::metrics::{EngineMetrics, Role};
        let m = EngineMetrics::new("m", Role::Decode);
        m.kv_usage.set(0.5);
        m.kv_reserved.set(0.375);
        let r = preheat_scaler::signals::exposition::parse(&m.render(), Some("m")).unwrap();
        assert_eq!((r.kv_usage, r.kv_reserved), (Some(0.5), Some(0.375)));
    }
}
