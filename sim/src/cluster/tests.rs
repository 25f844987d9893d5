//! Tests of the replicas' timing: decode steps and their counts, K/V landing between
//! steps, prompts computed on decode, and speed changes mid-work.

use preheat_scaler::profile::Profile;

use super::*;

#[test]
fn decode_steps_at_the_batch_itl() {
    let p = Profile::default();
    let mut r = DecodeReplica::new(0.0);
    r.admit(
        0.0,
        Seq {
            req: 0,
            remaining: 10,
            kv_tokens: 100.0,
        },
    );
    r.admit(
        0.0,
        Seq {
            req: 1,
            remaining: 20,
            kv_tokens: 100.0,
        },
    );
    let itl2 = p.itl(2.0);
    assert!((r.next_event(0.0, &p) - 10.0 * itl2).abs() < 1e-9);
    let mut done = Vec::new();
    r.advance(1.0, &p, &mut Vec::new(), &mut done);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, 0);
    assert!((done[0].1 - 10.0 * itl2).abs() < 1e-9);
    assert_eq!(r.kv_used, 100.0);
    // The survivor continues alone, at batch-1 ITL.
    r.advance(1.0, &p, &mut Vec::new(), &mut done);
    assert_eq!(done.len(), 2);
    assert!((done[1].1 - (10.0 * itl2 + 10.0 * p.itl(1.0))).abs() < 1e-9);
}

#[test]
fn a_slowed_replica_finishes_the_rest_of_its_work_at_the_new_speed() {
    let p = Profile::default();
    let itl = p.itl(1.0);
    let mut d = DecodeReplica::new(0.0);
    d.admit(
        0.0,
        Seq {
            req: 0,
            remaining: 10,
            kv_tokens: 1.0,
        },
    );
    // Two and a half steps done at full speed, the rest at half.
    let t = 2.5 * itl;
    let mut done = Vec::new();
    d.advance(t, &p, &mut Vec::new(), &mut done);
    d.set_speed(t, 0.5);
    let end = d.next_event(t, &p);
    assert!((end - (t + 7.5 * 2.0 * itl)).abs() < 1e-12, "{end}");
    d.advance(end, &p, &mut Vec::new(), &mut done);
    assert_eq!(done.len(), 1);
    assert!((done[0].1 - end).abs() < 1e-12);

    let mut r = PrefillReplica::new(0.0, 4);
    r.enqueue(PrefillJob {
        req: 3,
        tokens: 100.0,
        service_s: 1.0,
    });
    assert_eq!(r.step(0.0, None), None);
    r.set_speed(0.25, 0.5);
    assert_eq!(r.next_event(0.25), 0.25 + 0.75 * 2.0);
    assert_eq!(r.step(1.75, None), Some(3));
}

#[test]
fn a_reservation_holds_room_in_the_cache_and_keeps_the_replica_from_idling() {
    let mut r = DecodeReplica::new(0.0).with_id(7);
    assert!(r.is_idle());
    r.reserve(60.0);
    // Reserved room counts against the cache, not the batch (the engine's
    // reservations hold blocks), and keeps the replica from going.
    assert!(!r.is_idle() && r.is_empty());
    assert_eq!(r.kv_held(), 60.0);
    assert!(r.fits(40.0, 4, 100.0) && !r.fits(41.0, 4, 100.0));
    assert!(r.fits(1.0, 1, 100.0));
    r.unreserve(60.0);
    r.admit(0.0, seq(1, 3));
    assert!(!r.is_idle() && r.kv_reserved() == 0.0);
    assert_eq!(r.id(), 7);
}

fn seq(req: usize, remaining: u32) -> Seq {
    Seq {
        req,
        remaining,
        kv_tokens: 10.0,
    }
}

/// Advances `r` from `t` event by event until it is empty: the tokens and gaps it
/// counted, its lengthened gaps as (count, seconds), and the time it ended.
fn run_dry(
    r: &mut DecodeReplica,
    mut t: f64,
    first: &mut Vec<(usize, f64)>,
    done: &mut Vec<(usize, f64)>,
) -> (f64, f64, Vec<(f64, f64)>, f64) {
    let p = Profile::default();
    let (mut tokens, mut gaps, mut long) = (0.0, 0.0, Vec::new());
    while !r.is_empty() {
        t = r.next_event(t, &p);
        let s = r.advance(t, &p, first, done);
        assert!(s.gaps == 0.0 || s.gap_s > 0.0, "{s:?}");
        tokens += s.tokens;
        gaps += s.gaps + s.long_gaps;
        if s.long_gaps > 0.0 {
            long.push((s.long_gaps, s.long_gap_s));
        }
    }
    (tokens, gaps, long, t)
}

#[test]
fn kv_handed_over_mid_step_lands_when_the_step_ends_and_decodes_from_the_next() {
    let p = Profile::default();
    let step = p.itl(1.0);
    let (mut first, mut done) = (Vec::new(), Vec::new());
    // Idle: it lands at once, and its first decode step starts now.
    let mut idle = DecodeReplica::new(0.0);
    assert_eq!(idle.resume(0.3, seq(0, 2), &p), 0.3);
    let (tokens, gaps, _, end) = run_dry(&mut idle, 0.3, &mut first, &mut done);
    assert_eq!((tokens, gaps), (2.0, 2.0));
    assert!((end - (0.3 + 2.0 * step)).abs() < 1e-12, "{end}");
    // Into a step under way: the engine imports between steps, so the first token
    // streams when that step ends, and the sequence's own tokens come from the next
    // step on; the step under way gives no token or gap of its own.
    let mut r = DecodeReplica::new(0.0);
    r.admit(0.0, seq(1, 1));
    let at = r.resume(0.5 * step, seq(2, 3), &p);
    // (The step under way is timed at the batch with it.)
    assert!((at - p.itl(2.0)).abs() < 1e-12, "{at}");
    done.clear();
    let (tokens, gaps, _, _) = run_dry(&mut r, 0.5 * step, &mut first, &mut done);
    assert_eq!((tokens, gaps), (1.0 + 3.0, 1.0 + 3.0));
    let ended = done.iter().find(|d| d.0 == 2).unwrap().1;
    // Sequence 1 ends with the step under way; 2 decodes alone after it.
    let expected = at + 3.0 * step;
    assert!(
        (ended - expected).abs() < 1e-9,
        "{ended} against {expected}"
    );
}

#[test]
fn kv_never_lands_before_it_is_handed_over() {
    // Steps that grow steeply with the context: `advance` times the steps short of
    // an event at their own (shorter) context, so the clock can trail the present
    // by more than a step; and a short newcomer shortens the batch's mean context.
    use preheat_scaler::profile::ContextItl;
    let p = Profile {
        decode_itl_long: Some(ContextItl {
            short_context: 8.0,
            context: 2048.0,
            itl_s: vec![(1.0, 0.2), (256.0, 0.4)],
        }),
        ..Profile::default()
    };
    let long = |req| Seq {
        req,
        remaining: 400,
        kv_tokens: 4_000.0,
    };
    let mut r = DecodeReplica::new(0.0);
    r.admit(0.0, long(0));
    r.admit(0.0, long(1));
    let (mut first, mut done) = (Vec::new(), Vec::new());
    let mut t = 0.0;
    // Long strides with no event between: tens of steps each.
    for _ in 0..6 {
        t += 13.7;
        r.advance(t, &p, &mut first, &mut done);
        let mut probe = r.clone();
        let at = probe.resume(t, seq(9, 3), &p);
        assert!(at >= t, "landed at {at}, handed over at {t}");
        assert!(at <= t + p.itl_at(3.0, 4_000.0) + 1e-9, "{at} at {t}");
    }
    // An idle replica's prompt pass under way: it lands when the pass ends.
    let mut passing = DecodeReplica::new(0.0);
    passing.admit_prefilling(1.0, seq(3, 2), 0.5);
    assert_eq!(passing.resume(1.2, seq(4, 2), &p), 1.5);
}

#[test]
fn each_step_counts_the_tokens_and_gaps_the_engine_would() {
    let p = Profile::default();
    let mut r = DecodeReplica::new(0.0);
    let (mut first, mut done) = (Vec::new(), Vec::new());
    // Prefilled elsewhere: 5 tokens here, each with a gap (the first from the
    // import, where the engine takes the shipped first token in).
    r.admit(0.0, seq(0, 5));
    // A prompt computed here while a step is under way: no token in that step, its
    // first token (counted as one) in the next, then 3 tokens with a gap each.
    let at = 0.5 * p.itl(1.0);
    r.admit_prefilling(at, seq(1, 3), 0.01);
    let (tokens, gaps, long, t) = run_dry(&mut r, at, &mut first, &mut done);
    assert_eq!(first.len(), 1);
    assert_eq!(done.len(), 2);
    assert_eq!((tokens, gaps), (5.0 + 3.0, 5.0 + 3.0));
    // The step computing the prompt is the one decoding sequence's gap made longer
    // by the prompt's compute; no other gap is.
    assert_eq!(long.len(), 1, "{long:?}");
    assert_eq!(long[0].0, 1.0);
    assert!((long[0].1 - (p.itl(2.0) + 0.01)).abs() < 1e-12, "{long:?}");
    // An idle replica computes a prompt alone, then decodes: each token after the
    // first has a gap.
    let mut idle = DecodeReplica::new(0.0);
    idle.admit_prefilling(t, seq(2, 4), 0.01);
    let (tokens, gaps, long, _) = run_dry(&mut idle, t, &mut first, &mut done);
    assert_eq!((tokens, gaps), (4.0, 4.0));
    assert!(long.is_empty(), "{long:?}");
}

#[test]
fn regression_a_one_token_answer_took_a_gap_from_a_later_sequence() {
    let p = Profile::default();
    let mut r = DecodeReplica::new(0.0);
    let (mut first, mut done) = (Vec::new(), Vec::new());
    // Nothing to generate after the first token: done without a step.
    r.admit(0.0, seq(0, 0));
    assert_eq!(
        r.advance(0.0, &p, &mut first, &mut done),
        Stepped::default()
    );
    assert_eq!(done.len(), 1);
    r.admit(0.0, seq(1, 2));
    let (tokens, gaps, _, _) = run_dry(&mut r, 0.0, &mut first, &mut done);
    assert_eq!((tokens, gaps), (2.0, 2.0));
}

#[test]
fn a_prompt_computed_on_decode_gives_its_first_token_when_its_step_ends() {
    let p = Profile::default();
    let (itl1, itl2) = (p.itl(1.0), p.itl(2.0));
    let seq = |req, remaining| Seq {
        req,
        remaining,
        kv_tokens: 10.0,
    };
    let (mut first, mut done) = (Vec::new(), Vec::new());
    // Idle: the step is the prompt alone, then a token a step.
    let mut r = DecodeReplica::new(0.0);
    r.admit_prefilling(1.0, seq(0, 3), 0.1);
    r.advance(r.next_event(1.0, &p), &p, &mut first, &mut done);
    assert_eq!(first, vec![(0, 1.1)]);
    r.advance(r.next_event(1.1, &p), &p, &mut first, &mut done);
    assert_eq!(done.len(), 1);
    assert!((done[0].1 - (1.1 + 3.0 * itl1)).abs() < 1e-12, "{done:?}");
    assert!((r.busy_s - (0.1 + 3.0 * itl1)).abs() < 1e-12);

    // Busy: the prompt joins the step after the one under way, which is longer by
    // its compute for the sequence already running too.
    let (mut first, mut done) = (Vec::new(), Vec::new());
    let mut r = DecodeReplica::new(0.0);
    r.admit(0.0, seq(0, 10));
    let t = 2.5 * itl1;
    r.advance(t, &p, &mut first, &mut done);
    r.admit_prefilling(t, seq(1, 2), 0.1);
    let at = r.next_event(t, &p);
    assert!((at - (2.0 * itl1 + 0.1 + 2.0 * itl2)).abs() < 1e-12, "{at}");
    // Nothing is handed out before its time.
    r.advance(at - 1e-6, &p, &mut first, &mut done);
    assert!(first.is_empty());
    r.advance(at, &p, &mut first, &mut done);
    assert_eq!(first, vec![(1, at)]);
    while !r.is_empty() {
        let at = r.next_event(at, &p);
        r.advance(at, &p, &mut first, &mut done);
    }
    let b_done = 2.0 * itl1 + 0.1 + 4.0 * itl2;
    assert_eq!(done[0].0, 1);
    assert!((done[0].1 - b_done).abs() < 1e-12);
    assert_eq!(done[1].0, 0);
    assert!((done[1].1 - (b_done + 4.0 * itl1)).abs() < 1e-12);

    // A second prompt arriving during an idle replica's prompt pass joins the
    // next pass: the first one's first token is not held back by it.
    let (mut first, mut done) = (Vec::new(), Vec::new());
    let mut r = DecodeReplica::new(0.0);
    r.admit_prefilling(1.0, seq(0, 1), 0.1);
    r.admit_prefilling(1.05, seq(1, 1), 0.1);
    let at = r.next_event(1.05, &p);
    assert!((at - 1.1).abs() < 1e-12, "{at}");
    r.advance(at, &p, &mut first, &mut done);
    assert_eq!(first, vec![(0, at)]);
    let second = r.next_event(at, &p);
    assert!((second - (1.1 + itl2 + 0.1)).abs() < 1e-12, "{second}");
    // Nothing before its time; then the second's first token, in the step that
    // gave the first one its second token; then the second's second, alone.
    r.advance(second - 1e-3, &p, &mut first, &mut done);
    assert_eq!((first.len(), done.len()), (1, 0));
    r.advance(second, &p, &mut first, &mut done);
    assert_eq!((first[1].0, &done[..]), (1, &[(0, second)][..]));
    let last = r.next_event(second, &p);
    assert!((last - (second + itl1)).abs() < 1e-12, "{last}");
    r.advance(last, &p, &mut first, &mut done);
    assert_eq!(done[1].0, 1);
    assert!((r.busy_s - (0.1 + itl2 + 0.1 + itl1)).abs() < 1e-12);

    // The compute still to come runs at the replica's speed.
    let mut r = DecodeReplica::new(0.0);
    r.admit_prefilling(0.0, seq(2, 1), 0.2);
    r.set_speed(0.1, 0.5);
    assert!((r.next_event(0.1, &p) - 0.3).abs() < 1e-12);
}

#[test]
fn regression_decode_stalled_when_its_next_completion_was_a_day_and_more_away() {
    // Past a day and a half of simulated time, `(due - clock) / itl` rounds below
    // the steps that `next_event` promised: `advance` at that event took no step,
    // the event stayed due, and the replay spun for ever (a 40-hour trace never
    // finished). Every event a replica reports must be one `advance` reaches.
    let p = Profile::default();
    for i in 0..2_000u32 {
        let start = 100_000.0 + f64::from(i) * 37.123_456_789;
        let mut r = DecodeReplica::new(start);
        for (req, remaining) in [(0, 1 + i % 97), (1, 3 + i % 389)] {
            r.admit(
                start,
                Seq {
                    req,
                    remaining,
                    kv_tokens: 10.0,
                },
            );
        }
        let mut done = Vec::new();
        while !r.is_empty() {
            let at = r.next_event(start, &p);
            let before = done.len();
            r.advance(at, &p, &mut Vec::new(), &mut done);
            assert!(
                done.len() > before,
                "clock {start}: no completion at its own event {at}"
            );
        }
    }
    // Nothing to generate: done at once, not a step that never comes.
    let mut r = DecodeReplica::new(5.0);
    let seq = Seq {
        req: 7,
        remaining: 0,
        kv_tokens: 1.0,
    };
    r.admit(5.0, seq);
    let mut done = Vec::new();
    r.advance(r.next_event(5.0, &p), &p, &mut Vec::new(), &mut done);
    assert_eq!(done, vec![(7, 5.0)]);
}
