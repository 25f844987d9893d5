//! Which models come first when a node cannot hold them all: the most recently
//! wanted. Pure: the agent's refresh feeds it what the store recorded.

use std::collections::BTreeMap;

use crate::config::ModelSpec;

/// `models`, the most recently wanted first (never wanted: in the configured order,
/// after the others).
pub(super) fn models_by_want(
    models: &[ModelSpec],
    wanted: &BTreeMap<String, f64>,
) -> Vec<ModelSpec> {
    let mut out: Vec<(usize, &ModelSpec)> = models.iter().enumerate().collect();
    out.sort_by(|(i, a), (j, b)| {
        let (ta, tb) = (
            wanted.get(&a.name).copied().unwrap_or(0.0),
            wanted.get(&b.name).copied().unwrap_or(0.0),
        );
        tb.total_cmp(&ta).then(i.cmp(j))
    });
    out.into_iter().map(|(_, m)| m.clone()).collect()
}

/// Each pool's share of the node's standby budget: (pool, model, count) taken in the
/// order their models were wanted (`order`, most recent first), each up to its
/// count, until the budget is spent. No budget: every pool its count.
pub(super) fn standby_shares<'a>(
    pools: &[(&'a str, &str, u32)],
    order: &[&str],
    budget: Option<u32>,
) -> BTreeMap<&'a str, u32> {
    let mut ranked: Vec<&(&str, &str, u32)> = pools.iter().collect();
    ranked.sort_by_key(|(_, model, _)| order.iter().position(|m| m == model).unwrap_or(usize::MAX));
    let mut left = budget.unwrap_or(u32::MAX);
    ranked
        .into_iter()
        .map(|&(pool, _, count)| {
            let share = count.min(left);
            left -= share;
            (pool, share)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{models_by_want, standby_shares};

    #[test]
    fn the_most_recently_wanted_come_first_and_the_never_wanted_keep_their_order() {
        let spec = |name: &str| crate::config::ModelSpec {
            name: name.to_owned(),
            source: crate::Source::Path(format!("/m/{name}.preheat").into()),
            hot: true,
        };
        let models = [spec("a"), spec("b"), spec("c"), spec("d")];
        let wanted = [
            ("c".to_owned(), 20.0),
            ("a".to_owned(), 10.0),
            ("d".to_owned(), 0.0),
        ]
        .into_iter()
        .collect();
        let order: Vec<String> = models_by_want(&models, &wanted)
            .into_iter()
            .map(|m| m.name)
            .collect();
        assert_eq!(order, ["c", "a", "b", "d"]);
    }

    #[test]
    fn the_standby_budget_goes_to_the_most_recently_wanted_models_first() {
        let pools = [
            ("a-decode", "a", 2),
            ("b-prefill", "b", 1),
            ("b-decode", "b", 2),
            ("c-decode", "c", 1),
        ];
        // b wanted last, then c; a never.
        let order = ["b", "c", "a"];
        let shares = standby_shares(&pools, &order, Some(4));
        assert_eq!(shares["b-prefill"] + shares["b-decode"], 3);
        assert_eq!(shares["c-decode"], 1);
        assert_eq!(shares["a-decode"], 0, "{shares:?}");
        // No budget: every pool its count.
        let all = standby_shares(&pools, &order, None);
        assert_eq!(all.values().sum::<u32>(), 6);
        // A budget of zero parks none.
        assert!(
            standby_shares(&pools, &order, Some(0))
                .values()
                .all(|&n| n == 0)
        );
    }
}
