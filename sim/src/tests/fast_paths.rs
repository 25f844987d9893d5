//! The replay's fast paths (the prefill pool alone, a run stopped once it cannot reach
//! its target) against full runs of the same trace.

use super::*;

/// A trace with bursts and lulls, shared prefixes, prompts short enough to be computed
/// on decode, and long answers: what the fast paths below must not change.
fn mixed_trace(n: usize) -> Vec<TraceRequest> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |m: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            // 20 s bursts at 25 req/s between 20 s lulls at 2 req/s.
            t += if (i / 500) % 2 == 0 { 0.04 } else { 0.5 };
            let input = if next(5) == 0 {
                8 + next(20) as u32
            } else {
                512 + next(12_000) as u32
            };
            let shared = next(4);
            let own = u64::from(input / 512);
            TraceRequest {
                t,
                input_tokens: input,
                output_tokens: 1 + next(400) as u32,
                blocks: (0..own)
                    .map(|b| {
                        if b < 3 {
                            shared * 10 + b
                        } else {
                            1_000 + i as u64 * 64 + b
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

#[test]
fn the_prefill_pool_alone_gives_the_prompt_completions_of_a_full_run() {
    // As `clairvoyant`'s bisection runs it: replicas ready at once, per-minute
    // schedules that scale both pools up and down (draining, retiring, prefix-index
    // slots released and taken again), batched prefill and not.
    let mut c = cfg().with_startup_s(0.0);
    c.local_prefill_below = Some(32);
    let trace = mixed_trace(3000);
    let minutes = (trace.last().unwrap().t / 60.0) as usize + 1;
    let mut compared = 0;
    for (batch, shift) in [(None, 0), (Some(4096.0), 1), (None, 2)] {
        c.prefill_batch_tokens = batch;
        let prefill: Vec<u32> = (0..minutes)
            .map(|m| 1 + ((m + shift) * 7 % 5) as u32)
            .collect();
        let decode: Vec<u32> = (0..minutes)
            .map(|m| 1 + ((m + shift) * 3 % 4) as u32)
            .collect();
        let sim = |d: &[u32]| {
            Sim::new(
                &c,
                &trace,
                Box::new(clairvoyant::Plan::per_minute(prefill.clone())),
                Box::new(clairvoyant::Plan::per_minute(d.to_vec())),
            )
        };
        let full = sim(&decode).run_prompts_done();
        let alone = sim(&vec![1; minutes]).prefill_only().run_first_tokens();
        // A decode step of the largest batch (this profile times no context), made
        // longer by the longest prompt a decode replica computes in one.
        let longest_step =
            c.profile.itl(c.max_batch() as f64) + 32.0 / c.profile.prefill_rate(32.0);
        for (i, r) in trace.iter().enumerate() {
            if c.prefills_on_decode(r) {
                continue;
            }
            let (done, first) = full[i];
            assert_eq!(
                done.to_bits(),
                alone[i].to_bits(),
                "request {i}: {done} against {} (batching {batch:?})",
                alone[i]
            );
            // Its first token waits, at most, for the decode step under way.
            assert!(
                first >= done && first <= done + longest_step + 1e-9,
                "request {i}: first token {first}, prompt done {done}"
            );
            compared += 1;
        }
    }
    assert!(compared > 5000, "{compared}");
}

#[test]
fn a_run_stopped_short_of_its_target_is_one_that_would_have_missed_it() {
    let mut c = cfg();
    c.local_prefill_below = Some(32);
    let trace = mixed_trace(3000);
    let (mut stopped, mut ran) = (0, 0);
    for p in 1..=8 {
        for d in [1, 3] {
            let full = run_fixed(&c, &trace, p, d);
            let sim = Sim::new(&c, &trace, Box::new(Static(p)), Box::new(Static(d)));
            match sim.run_unless_below(0.99) {
                None => {
                    stopped += 1;
                    assert!(full.slo_attainment < 0.99, "{p}/{d}: {full:?}");
                }
                Some(r) => {
                    ran += 1;
                    assert_eq!(r.slo_attainment.to_bits(), full.slo_attainment.to_bits());
                    // Never stopped at its own attainment: a miss is counted once, and
                    // only for a request the report counts as missed too.
                    let own = Sim::new(&c, &trace, Box::new(Static(p)), Box::new(Static(d)));
                    assert!(
                        own.run_unless_below(full.slo_attainment).is_some(),
                        "{p}/{d}"
                    );
                    assert_eq!(r.gpu_seconds.to_bits(), full.gpu_seconds.to_bits());
                    assert_eq!(r.ttft_p99.to_bits(), full.ttft_p99.to_bits());
                }
            }
        }
    }
    assert!(stopped > 0 && ran > 0, "stopped {stopped}, ran {ran}");
}
