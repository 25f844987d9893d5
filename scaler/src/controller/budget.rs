//! The fleet's GPU budget (`fleet.max_gpus`), a stage of the tick between deciding and
//! acting, with no I/O. Every model's pools decide on their own; when what they want
//! adds up to more GPUs than the fleet has, each pool is granted replicas in this
//! order:
//!
//! 1. a pool with requests held and no replica serving (nobody can serve them) gets
//!    its first;
//! 2. every pool gets its floor (`min_replicas`);
//! 3. a pool with replicas that still wants one keeps one: taken to zero while busy,
//!    its requests would be held, it would be the next to wake, and the models would
//!    take turns at zero;
//! 4. a pool woken from zero keeps the replicas it has starting (taking them back
//!    would leave it at zero again; after the floors, so replicas that never start
//!    cannot crowd them out);
//! 5. the rest goes up to what each wants.
//!
//! Within each pass pools are taken by the same rank: requests held at zero first,
//! then the largest SLO deficit, then the model's `priority`, then the order of the
//! config. A pool granted less than it has loses replicas (the pods drain; none of
//! their requests is lost).

use std::cmp::Ordering;

/// GPUs one replica of the bundled engine holds: it runs one GPU per replica (it has
/// no tensor parallelism).
pub(super) const GPUS_PER_REPLICA: u32 = 1;

/// One pool's claim on the budget.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Claim {
    /// Replicas its policy wants.
    pub desired: u32,
    /// Its floor (`min_replicas`).
    pub min: u32,
    /// Replicas it has, serving or starting.
    pub current: u32,
    /// Requests are held for it and no replica of it serves.
    pub held_at_zero: bool,
    /// How far its SLO attainment falls short of its target (0 when met or unknown).
    pub slo_deficit: f64,
    pub priority: i32,
}

/// What is left of `max_gpus` for the pools once `parked` standbys hold
/// `standby_gpus` each.
pub(super) fn for_pools(max_gpus: u32, parked: u32, standby_gpus: u32) -> u32 {
    max_gpus.saturating_sub(parked.saturating_mul(standby_gpus))
}

/// The replicas granted to each claim, in order, within `max_gpus`.
pub(super) fn grant(claims: &[Claim], max_gpus: u32) -> Vec<u32> {
    let wanted: u64 = claims
        .iter()
        .map(|c| u64::from(c.desired) * u64::from(GPUS_PER_REPLICA))
        .sum();
    if wanted <= u64::from(max_gpus) {
        return claims.iter().map(|c| c.desired).collect();
    }
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&a, &b| rank(&claims[a], &claims[b]).then(a.cmp(&b)));
    let mut granted = vec![0u32; claims.len()];
    let mut left = max_gpus;
    let mut give = |i: usize, up_to: u32, granted: &mut [u32]| {
        while granted[i] < up_to && left >= GPUS_PER_REPLICA {
            granted[i] += 1;
            left -= GPUS_PER_REPLICA;
        }
    };
    for &i in &order {
        if claims[i].held_at_zero {
            give(i, claims[i].desired.min(1), &mut granted);
        }
    }
    for &i in &order {
        give(i, claims[i].desired.min(claims[i].min), &mut granted);
    }
    for &i in &order {
        let serving = u32::from(claims[i].current > 0);
        give(i, claims[i].desired.min(serving), &mut granted);
    }
    for &i in &order {
        if claims[i].held_at_zero {
            give(i, claims[i].desired.min(claims[i].current), &mut granted);
        }
    }
    for &i in &order {
        give(i, claims[i].desired, &mut granted);
    }
    granted
}

/// Which of two claims is served first.
fn rank(a: &Claim, b: &Claim) -> Ordering {
    b.held_at_zero
        .cmp(&a.held_at_zero)
        .then(b.slo_deficit.total_cmp(&a.slo_deficit))
        .then(b.priority.cmp(&a.priority))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(desired: u32) -> Claim {
        Claim {
            desired,
            ..Claim::default()
        }
    }

    #[test]
    fn parked_standbys_on_gpus_come_off_the_budget_first() {
        assert_eq!(for_pools(8, 3, 1), 5);
        assert_eq!(for_pools(8, 3, 0), 8, "parked off the counted GPUs");
        assert_eq!(
            for_pools(2, 3, 1),
            0,
            "more parked than the budget: none left"
        );
        let c = [claim(3), claim(3)];
        assert_eq!(grant(&c, for_pools(6, 2, 1)), [3, 1]);
    }

    #[test]
    fn within_the_budget_every_pool_gets_what_it_wants() {
        let c = [claim(2), claim(3)];
        assert_eq!(grant(&c, 5), [2, 3]);
        assert_eq!(grant(&c, 0), [0, 0], "no GPU left");
    }

    #[test]
    fn a_model_held_at_zero_gets_its_first_replica_before_busier_ones_grow() {
        let busy = Claim {
            slo_deficit: 0.2,
            priority: 5,
            ..claim(4)
        };
        let woken = Claim {
            held_at_zero: true,
            ..claim(2)
        };
        // Held at zero ranks first: it gets what it wants, the busy pool the rest.
        assert_eq!(grant(&[busy.clone(), woken.clone()], 4), [2, 2]);
        // A floor does not keep it out: its first replica comes before floors.
        let floored = Claim {
            min: 4,
            ..busy.clone()
        };
        assert_eq!(grant(&[floored, woken], 4), [3, 1]);
        // Without requests held, the busier, higher-priority pool comes first.
        assert_eq!(grant(&[busy, claim(2)], 4), [4, 0]);
    }

    #[test]
    fn a_busy_pool_keeps_one_replica_when_a_model_at_zero_wakes() {
        // The cluster run's scenario m: a budget of 3, alpha and beta busy (each far
        // short of its SLO), gamma asked for at zero. Before, the deepest deficit
        // took everything gamma left (beta 2, alpha 0): alpha went to zero under
        // load, its requests were held, and the models took turns at zero.
        let busy = |current, deficit| Claim {
            current,
            slo_deficit: deficit,
            ..claim(3)
        };
        let woken = Claim {
            held_at_zero: true,
            ..claim(1)
        };
        assert_eq!(grant(&[busy(2, 0.98), busy(1, 0.99), woken], 3), [1, 1, 1]);
        // A pool with replicas that wants none any more gives them up.
        let idle = Claim {
            current: 2,
            ..claim(0)
        };
        assert_eq!(grant(&[idle, busy(1, 0.5)], 2), [0, 2]);
        // Floors first: a floor of 2 is held even where that leaves a busier pool
        // none of the budget.
        let floored = Claim {
            min: 2,
            ..busy(2, 0.1)
        };
        assert_eq!(grant(&[floored, busy(1, 0.9)], 2), [2, 0]);
    }

    #[test]
    fn replicas_starting_for_held_requests_are_not_taken_back() {
        let busy = Claim {
            slo_deficit: 0.3,
            ..claim(4)
        };
        // Two replicas starting, none serving yet, requests held.
        let starting = Claim {
            current: 2,
            held_at_zero: true,
            ..claim(2)
        };
        assert_eq!(grant(&[busy, starting], 3), [1, 2]);
    }

    #[test]
    fn replicas_that_never_start_cannot_crowd_out_another_pools_floor() {
        let floored = Claim { min: 2, ..claim(2) };
        // Three starting (a crash loop, say), none serving, requests held.
        let stuck = Claim {
            current: 3,
            held_at_zero: true,
            ..claim(3)
        };
        assert_eq!(grant(&[floored, stuck], 3), [2, 1]);
    }

    #[test]
    fn floors_come_before_growth_then_deficit_then_priority() {
        let floor = Claim { min: 2, ..claim(3) };
        let short = Claim {
            slo_deficit: 0.05,
            ..claim(3)
        };
        let important = Claim {
            priority: 1,
            ..claim(3)
        };
        // 6 GPUs: the floor's 2, then the SLO deficit's 3, then priority's 1.
        assert_eq!(
            grant(&[floor.clone(), short.clone(), important.clone()], 6),
            [2, 3, 1]
        );
        // Equal in all: the config's order.
        assert_eq!(grant(&[claim(2), claim(2)], 3), [2, 1]);
    }

    #[test]
    fn nothing_is_granted_past_the_budget_whatever_the_floors() {
        let c = [Claim { min: 3, ..claim(3) }, Claim { min: 3, ..claim(3) }];
        let g = grant(&c, 4);
        assert_eq!(g.iter().sum::<u32>(), 4);
        assert_eq!(g, [3, 1]);
    }
}
