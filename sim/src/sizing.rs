//! Fixed sizes found from the whole trace: `static-peak`'s hindsight search, and the
//! replicas a deployment already serving the trace's opening load would have.

use crate::autoscalers::Static;
use crate::config::SimConfig;
use crate::replay::Sim;
use crate::trace::TraceRequest;

/// The fewest fixed (prefill, decode) replicas meeting 99% SLO attainment on the whole
/// trace: prefill sized with decode plentiful, then decode with that prefill, then both
/// raised together if the pair falls short; the maxima when nothing reaches 99%.
pub(crate) fn static_peak(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    const TARGET: f64 = 0.99;
    let run = |p: u32, d: u32| {
        Sim::new(cfg, trace, Box::new(Static(p)), Box::new(Static(d)))
            .run()
            .slo_attainment
    };
    let (mp, md) = (cfg.prefill.max_replicas, cfg.decode.max_replicas);
    let smallest = |max: u32, ok: &dyn Fn(u32) -> bool| {
        let (mut lo, mut hi) = (1, max);
        if !ok(hi) {
            return max;
        }
        while lo < hi {
            let mid = (lo + hi) / 2;
            if ok(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    };
    let plenty_d = md.min(16);
    let p = smallest(mp, &|p| run(p, plenty_d) >= TARGET);
    let d = smallest(md, &|d| run(p, d) >= TARGET);
    let (mut p, mut d) = (p, d);
    while run(p, d) < TARGET && (p < mp || d < md) {
        p = (p + 1).min(mp);
        d = (d + 1).min(md);
    }
    (p, d)
}

/// Replicas a deployment already serving the trace's opening load would have: the
/// first minute's prompt tokens/s over one replica's rate at 70%, and its concurrent
/// sequences (Little's law) over one replica's batch at the ITL SLO. Every dynamic
/// policy starts from here, so none pays for a trace that opens at full load.
pub(crate) fn warm_start(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let first: Vec<&TraceRequest> = trace.iter().take_while(|r| r.t < 60.0).collect();
    if first.is_empty() {
        return (1, 1);
    }
    let n = first.len() as f64;
    let tokens: f64 = first.iter().map(|r| f64::from(r.input_tokens)).sum();
    let out: f64 = first.iter().map(|r| f64::from(r.output_tokens)).sum();
    let p = cfg.profile.prefill_rate(tokens / n);
    let prefill = (tokens / 60.0 / (0.7 * p)).ceil().max(1.0);
    let batch = cfg.profile.max_batch_at(cfg.decode.slo_itl_s);
    let seqs = out / 60.0 * cfg.profile.itl(batch);
    let decode = (seqs / batch).ceil().max(1.0);
    let cap = |x: f64, max: u32| (x as u32).clamp(1, max.max(1));
    (
        cap(prefill, cfg.prefill.max_replicas),
        cap(decode, cfg.decode.max_replicas),
    )
}
