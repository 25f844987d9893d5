//! What a run serves at fixed sizes: latencies, the prefix cache, KV room, shared
//! hosts, batched prefill, prompts computed on decode, and KV reserved ahead.

use super::*;

#[test]
fn light_load_on_enough_replicas_meets_every_slo() {
    let c = cfg();
    // 1 req/s of 2k tokens: an eighth of one prefill replica.
    let trace = steady(0.0, 100, 1.0, 2048, 50);
    let r = run_fixed(&c, &trace, 1, 1);
    assert_eq!(r.unfinished, 0);
    assert_eq!(r.slo_attainment, 1.0, "{r:?}");
    // TTFT is the bare prefill time: 2048 tokens at 16k tokens/s.
    assert!((r.ttft_p50 - 0.128).abs() < 1e-6, "{}", r.ttft_p50);
    // Fixed replicas cost replicas × (time until the last request finishes).
    let end = 99.0 + 0.128 + 49.0 * c.profile.itl(1.0);
    assert!(
        (r.gpu_seconds - 2.0 * end).abs() < 0.5,
        "{} vs {}",
        r.gpu_seconds,
        2.0 * end
    );
}

#[test]
fn overload_misses_the_ttft_slo_and_more_replicas_fix_it() {
    let c = cfg();
    // 40k prompt tokens/s: 2.5 replicas' worth.
    let trace = steady(0.0, 600, 0.05, 2048, 10);
    let one = run_fixed(&c, &trace, 1, 1);
    let four = run_fixed(&c, &trace, 4, 1);
    assert!(one.slo_attainment < 0.5, "{}", one.slo_attainment);
    assert!(four.slo_attainment > 0.99, "{}", four.slo_attainment);
    assert!(one.ttft_p99 > 10.0 * four.ttft_p99);
}

#[test]
fn same_input_same_report() {
    let c = cfg();
    let trace = steady(0.0, 300, 0.2, 3000, 40);
    let a = run_policy("preheat", &c, &trace).unwrap();
    let b = run_policy("preheat", &c, &trace).unwrap();
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
}

#[test]
fn shared_prefixes_hit_the_cache() {
    let c = cfg();
    let trace: Vec<TraceRequest> = (0..40)
        .map(|i| TraceRequest {
            t: f64::from(i),
            input_tokens: 4096,
            output_tokens: 4,
            // Every request shares the first 6 of its 8 blocks.
            blocks: (0..6)
                .chain([100 + 2 * i as u64, 101 + 2 * i as u64])
                .collect(),
        })
        .collect();
    let r = run_fixed(&c, &trace, 2, 1);
    // First request misses everything; the rest hit 6 of 8 blocks.
    let want = 39.0 * 6.0 * 512.0 / (40.0 * 4096.0);
    assert!(
        (r.prefix_hit_rate - want).abs() < 1e-9,
        "{}",
        r.prefix_hit_rate
    );
}

#[test]
fn kv_capacity_bounds_decode_admission() {
    let mut c = cfg();
    c.profile.kv_tokens = 10_000.0;
    // Each sequence holds 4,100 tokens: two fit, the third waits.
    let trace = steady(0.0, 3, 0.0, 4000, 101);
    let r = run_fixed(&c, &trace, 3, 1);
    assert_eq!(r.unfinished, 0);
    assert!(r.itl_p99 > 1.5 * r.itl_p50, "the third waited: {r:?}");
}

#[test]
fn on_a_shared_host_busy_replicas_split_its_speed() {
    // Two prompts at once on two prefill replicas: each alone in its own GPU, or both
    // on one host whose whole speed the profile measured (each at half speed).
    let mut c = cfg();
    let trace = steady(0.0, 2, 0.0, 2048, 2);
    let own = run_fixed(&c, &trace, 2, 1);
    assert!((own.ttft_p99 - 0.128).abs() < 1e-6, "{}", own.ttft_p99);
    c.shared_host = Some(1.0);
    let shared = run_fixed(&c, &trace, 2, 1);
    assert!(
        (shared.ttft_p99 - 0.256).abs() < 1e-6,
        "{}",
        shared.ttft_p99
    );
    // Two slots hold both at full speed.
    c.shared_host = Some(2.0);
    let roomy = run_fixed(&c, &trace, 2, 1);
    assert!((roomy.ttft_p99 - 0.128).abs() < 1e-6, "{}", roomy.ttft_p99);
    // A lone prompt runs at full speed even on one slot.
    c.shared_host = Some(1.0);
    let alone = run_fixed(&c, &steady(0.0, 1, 0.0, 2048, 1), 2, 1);
    assert!((alone.ttft_p99 - 0.128).abs() < 1e-6, "{}", alone.ttft_p99);
}

#[test]
fn a_shared_host_slows_busy_replicas_by_its_measured_slowdown_too() {
    // Two slots hold two prompts at full speed by the core count; a host measured 25%
    // slower than that with two computing stretches both, and leaves one alone as is.
    let mut c = cfg();
    c.shared_host = Some(2.0);
    c.shared_host_slowdown = vec![(2.0, 1.25), (4.0, 1.5)];
    let both = run_fixed(&c, &steady(0.0, 2, 0.0, 2048, 2), 2, 1);
    assert!((both.ttft_p99 - 0.16).abs() < 1e-6, "{}", both.ttft_p99);
    let alone = run_fixed(&c, &steady(0.0, 1, 0.0, 2048, 1), 2, 1);
    assert!((alone.ttft_p99 - 0.128).abs() < 1e-6, "{}", alone.ttft_p99);
    // Slots to spare do not hide it: the slowdown was measured beyond the cores.
    c.shared_host = Some(4.0);
    let roomy = run_fixed(&c, &steady(0.0, 2, 0.0, 2048, 2), 2, 1);
    assert!((roomy.ttft_p99 - 0.16).abs() < 1e-6, "{}", roomy.ttft_p99);
}

#[test]
fn a_batching_prefill_computes_queued_prompts_together() {
    // Three 128-token prompts at once on one replica: one at a time they finish at
    // 1, 2 and 3 × 128 / rate(128); batched (a 512-token budget), the first runs alone
    // (the replica was idle) and the other two together at the rate of 256 tokens.
    let mut c = cfg();
    let p = &c.profile;
    let (one, two) = (128.0 / p.prefill_rate(128.0), 256.0 / p.prefill_rate(256.0));
    let trace = steady(0.0, 3, 0.0, 128, 1);
    let serial = run_fixed(&c, &trace, 1, 1);
    assert!(
        (serial.ttft_p99 - 3.0 * one).abs() < 1e-9,
        "{}",
        serial.ttft_p99
    );
    c.prefill_batch_tokens = Some(512.0);
    let batched = run_fixed(&c, &trace, 1, 1);
    assert_eq!(batched.unfinished, 0);
    assert!(
        (batched.ttft_p99 - (one + two)).abs() < 1e-9,
        "{}",
        batched.ttft_p99
    );
    // A budget below two prompts fills each pass with the head of the next prompt
    // (the second and 72 tokens of the third, then the third's last 56): the same
    // work, so the last first token comes when it did one prompt at a time.
    c.prefill_batch_tokens = Some(200.0);
    let tight = run_fixed(&c, &trace, 1, 1);
    assert!(
        (tight.ttft_p99 - 3.0 * one).abs() < 1e-9,
        "{}",
        tight.ttft_p99
    );
}

/// The engine's scheduler fills every forward pass to its token budget with chunks of
/// the prompts queued next; the simulator batched whole prompts only. Two 200-token
/// prompts with a 256-token budget went one after the other, each first token a
/// pass early, so a queue of `up`'s prompts gave first tokens sooner in the model
/// than in the engine.
#[test]
fn regression_the_simulated_prefill_batched_only_whole_prompts() {
    let mut c = cfg();
    c.prefill_batch_tokens = Some(256.0);
    let first_tokens = |input: u32, n: usize| {
        let trace = steady(0.0, n, 0.0, input, 1);
        Sim::new(&c, &trace, Box::new(Static(1)), Box::new(Static(1))).run_first_tokens()
    };
    let near = |got: &[f64], want: &[f64]| {
        got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9)
    };
    // Four at once: the first alone (the replica was idle); then the second with 56
    // tokens of the third, the third's other 144 with 112 of the fourth, the fourth's
    // last 88. Each chunk carries its share of its prompt's time.
    let one = 200.0 / c.profile.prefill_rate(200.0);
    let got = first_tokens(200, 4);
    let want = [1.0, 2.28, 3.56, 4.0].map(|k| k * one);
    assert!(near(&got, &want), "{got:?} against {want:?}");
    // A prompt longer than the budget leaves its last pass's room to the next one:
    // 300 tokens, then 300 and 212 of the next (two passes of 256), then its 88.
    let one = 300.0 / c.profile.prefill_rate(300.0);
    let got = first_tokens(300, 3);
    let want = [1.0, 2.0 + 212.0 / 300.0, 3.0].map(|k| k * one);
    assert!(near(&got, &want), "{got:?} against {want:?}");
}

#[test]
fn short_prompts_prefilled_on_decode_need_no_prefill_replica_and_slow_its_steps() {
    let mut c = cfg();
    let short = steady(0.0, 5, 1.0, 16, 4);
    // Through the prefill pool, nothing moves without a prefill replica.
    assert_eq!(run_fixed(&c, &short, 0, 1).unfinished, 5);
    c.local_prefill_below = Some(32);
    let local = run_fixed(&c, &short, 0, 1);
    assert_eq!(local.unfinished, 0);
    let prefill_s = 16.0 / c.profile.prefill_rate(16.0);
    assert!(
        (local.ttft_p99 - prefill_s).abs() < 1e-9,
        "{}",
        local.ttft_p99
    );
    // A prompt at the threshold still goes to the prefill pool.
    assert_eq!(
        run_fixed(&c, &steady(0.0, 2, 1.0, 32, 4), 0, 1).unfinished,
        2
    );

    // A long request decoding when a short prompt joins its replica: one of its steps
    // is longer by the short prompt's compute. A one-token answer through the prefill
    // pool never reaches decode; computed on decode, it counts in the batch for the
    // step under way (from its admission) and its own.
    let mut trace = steady(0.0, 1, 0.0, 2048, 51);
    trace.extend(steady(0.5, 1, 0.0, 16, 1));
    c.local_prefill_below = None;
    let apart = run_fixed(&c, &trace, 1, 1);
    c.local_prefill_below = Some(32);
    let joined = run_fixed(&c, &trace, 1, 1);
    let batch_two = c.profile.itl(2.0) - c.profile.itl(1.0);
    let expected = (prefill_s + 2.0 * batch_two) / 50.0;
    assert!(
        (joined.itl_p99 - apart.itl_p99 - expected).abs() < 1e-9,
        "{} vs {} (+{expected})",
        joined.itl_p99,
        apart.itl_p99
    );
}

#[test]
fn prompts_computed_on_decode_do_not_size_the_prefill_pool() {
    // The real prefill scaler reads its prompt rate from the prefill workers' metrics;
    // a prompt a decode worker computed is counted there, not here.
    let mut c = cfg();
    c.prefill.min_replicas = 0;
    c.decode.min_replicas = 0;
    c.warm_start = false;
    let short = steady(0.0, 600, 0.1, 16, 20);
    let through_prefill = run_policy("preheat", &c, &short).unwrap();
    assert!(through_prefill.max_prefill_replicas > 0);
    c.local_prefill_below = Some(32);
    let on_decode = run_policy("preheat", &c, &short).unwrap();
    assert_eq!(on_decode.unfinished, 0);
    assert_eq!(on_decode.max_prefill_replicas, 0, "{on_decode:?}");
    assert!(on_decode.max_decode_replicas > 0);
}

#[test]
fn decode_steps_slow_with_the_context_where_the_profile_measured_it() {
    use preheat_scaler::profile::ContextItl;
    let mut c = cfg();
    let short = steady(0.0, 4, 0.0, 64, 101);
    let long = steady(0.0, 4, 0.0, 4096, 101);
    // Without the long-context table, the context changes no step.
    let flat = (run_fixed(&c, &short, 4, 1), run_fixed(&c, &long, 4, 1));
    assert!((flat.0.itl_p50 - flat.1.itl_p50).abs() < 1e-12, "{flat:?}");
    c.profile.decode_itl_long = Some(ContextItl {
        short_context: 8.0,
        context: 2048.0,
        itl_s: vec![(1.0, 0.016), (16.0, 0.022)],
    });
    let (s, l) = (run_fixed(&c, &short, 4, 1), run_fixed(&c, &long, 4, 1));
    // Four sequences of 4096-token prompts generating 100 tokens after the first,
    // together: the line through (8, itl(4)) and (2048, long(4)), at their mean
    // context halfway, 4096 + 1 + 50.
    let at = |ctx: f64| {
        let (a, b) = (c.profile.itl(4.0), 0.016 + (0.022 - 0.016) * 3.0 / 15.0);
        a + (b - a) * (ctx - 8.0) / 2040.0
    };
    // The step time is re-read at every event (each second, here) at the context
    // then: within the first and last step's, and near the halfway one.
    for (r, first) in [(&l, 4097.0), (&s, 65.0)] {
        let (lo, mid, hi) = (at(first), at(first + 50.0), at(first + 100.0));
        assert!(
            r.itl_p50 > lo && r.itl_p50 < hi && (r.itl_p50 - mid).abs() < 1e-3 * mid,
            "{} not near {mid} in ({lo}, {hi})",
            r.itl_p50
        );
    }
    assert!(l.itl_p50 > 1.9 * flat.1.itl_p50);
}

#[test]
fn a_prompt_lands_on_the_decode_replica_that_reserved_its_kv_when_it_went_to_prefill() {
    // The gateway picks a request's decode worker, which reserves the prompt's blocks,
    // before the prompt goes to prefill. A long prompt arriving first reserves on one
    // decode replica; four short ones right after see it held and all reserve on the
    // other, and land there once prefilled, though the first is still prefilling then
    // and the first replica holds nothing running. Picked only when each prompt is done
    // (as the simulator did), they split two and two.
    let mut c = cfg();
    c.profile.prefill_tokens_per_s = vec![(1.0, 1_000.0)];
    c.profile.decode_itl_s = vec![(1.0, 0.01), (2.0, 0.02), (4.0, 0.04)];
    c.profile.kv_tokens = 100_000.0;
    // 8,002 KV tokens reserved, more than the four others' 4 × 1,501.
    let mut trace = steady(0.0, 1, 0.0, 8_000, 2);
    trace.extend(steady(0.001, 4, 0.0, 1_000, 501));
    let r = run_fixed(&c, &trace, 2, 2);
    assert_eq!(r.unfinished, 0);
    // The four decode together, at 0.04 s a step with all four, for most of their
    // tokens (mean ITL p50 0.034 s); split two and two it was 0.016 s.
    assert!(r.itl_p50 > 0.03, "ITL p50 {}", r.itl_p50);
}
