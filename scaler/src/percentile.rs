//! Percentiles of samples for reports (the simulator's, the benchmarks'): the nearest
//! rank on the sorted samples, rank = round((n − 1) · q). Histograms have
//! [`crate::signals::exposition::quantile`] instead.

/// The `q` percentile (0–1) of `v`, which it sorts; `None` when empty.
#[must_use]
pub fn percentile(v: &mut [f64], q: f64) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    of_sorted(v, q)
}

/// The `q` percentile of samples already sorted ascending; `None` when empty.
#[must_use]
pub fn of_sorted(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let i = (last as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted.get(i.min(last)).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&mut v, 0.5), Some(3.0));
        assert_eq!(percentile(&mut v, 0.0), Some(1.0));
        assert_eq!(percentile(&mut v, 1.0), Some(5.0));
        assert_eq!(percentile(&mut v, 0.99), Some(5.0));
        // Two samples: the median is the upper one (round half away from zero).
        assert_eq!(of_sorted(&[1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(percentile(&mut [], 0.5), None);
        assert_eq!(of_sorted(&[7.0], 2.0), Some(7.0));
    }
}
