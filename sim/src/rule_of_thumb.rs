//! Pool sizes by rule of thumb from a minute of requests (its prompt rate against a
//! replica's at 70%, Little's law for the batch), without a replay: where a run's pools
//! start, and the first guess of `static-peak`'s search.

use crate::config::SimConfig;
use crate::trace::TraceRequest;

/// What the trace's busiest minute would need by [`minute_need`]: the fixed-size
/// search's first guess.
pub(crate) fn busiest_minute_need(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let mut need = (1, 1);
    let mut start = 0;
    while start < trace.len() {
        let minute = (trace[start].t / 60.0).floor();
        let end = start
            + trace[start..]
                .iter()
                .take_while(|r| (r.t / 60.0).floor() == minute)
                .count();
        let (p, d) = minute_need(cfg, &trace[start..end]);
        need = (need.0.max(p), need.1.max(d));
        start = end.max(start + 1);
    }
    need
}

/// Replicas a deployment already serving the trace's opening load would have: the
/// first minute's prompt tokens/s over one replica's rate at 70%, and its concurrent
/// sequences (Little's law) over one replica's batch at the ITL SLO. Every dynamic
/// policy starts from here, so none pays for a trace that opens at full load.
pub(crate) fn warm_start(cfg: &SimConfig, trace: &[TraceRequest]) -> (u32, u32) {
    let first = trace.iter().take_while(|r| r.t < 60.0).count();
    minute_need(cfg, &trace[..first])
}

/// Replicas a minute of requests needs: its prompt tokens/s over one replica's rate at
/// 70%, and its concurrent sequences (Little's law) over one replica's batch at the
/// ITL SLO; (1, 1) for an empty minute.
fn minute_need(cfg: &SimConfig, minute: &[TraceRequest]) -> (u32, u32) {
    if minute.is_empty() {
        return (1, 1);
    }
    // The prefill pool's prompts: those computed on decode never reach it.
    let (n, tokens) = minute
        .iter()
        .filter(|r| !cfg.prefills_on_decode(r))
        .fold((0.0f64, 0.0f64), |(n, t), r| {
            (n + 1.0, t + f64::from(r.input_tokens))
        });
    let out: f64 = minute.iter().map(|r| f64::from(r.output_tokens)).sum();
    let p = cfg.profile.prefill_rate(tokens / n.max(1.0));
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
