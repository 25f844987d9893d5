//! `y = x · Wᵀ` for weights stored row-major as `[out, in]` in f32, f16 or bf16.
//!
//! Two regimes: with few token rows (decode) the product is memory-bound, so each
//! weight row is read once, widened in cache and dotted with every token row, in
//! parallel over weight rows; with many rows (prefill) it is compute-bound and goes to
//! the `gemm` crate, widening 16-bit weights one panel at a time.

use multiversion::multiversion;
use rayon::prelude::*;

use crate::backend::weights::{Elems, Weight, bf16_to_f32, f16_to_f32};

/// Token rows from which the gemm path wins over the matvec path.
pub const GEMM_MIN_ROWS: usize = 8;
/// Weight rows widened at once on the gemm path (bounded scratch per panel).
const PANEL_ROWS: usize = 2048;
/// Weight rows per parallel task on the matvec path.
const TASK_ROWS: usize = 16;

/// Dot product with 16 independent accumulators, so it vectorises without
/// reassociating float additions.
#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "aarch64+neon"))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let mut s = 0f32;
    for v in acc {
        s += v;
    }
    s + tail
}

/// `y += a * x` (axpy), vectorised.
#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "aarch64+neon"))]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `y[t × out] = x[t × in] · Wᵀ`.
pub fn linear(x: &[f32], t: usize, w: &Weight, y: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "linear: input is not t × in");
    assert_eq!(y.len(), t * n, "linear: output is not t × out");
    // A step may want no rows (a prompt chunk that samples nothing): nothing to do.
    if t == 0 {
        return;
    }
    if t >= GEMM_MIN_ROWS {
        linear_gemm(x, t, w, y);
    } else {
        linear_matvec(x, t, w, y);
    }
}

fn linear_matvec(x: &[f32], t: usize, w: &Weight, y: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    // Tasks own disjoint row ranges of a transposed output, [out × t].
    let mut yt = vec![0f32; n * t];
    yt.par_chunks_mut(TASK_ROWS * t).enumerate().for_each_init(
        || {
            vec![
                0f32;
                if matches!(w.elems(), Elems::F32(_)) {
                    0
                } else {
                    k
                }
            ]
        },
        |scratch, (task, out)| {
            let r0 = task * TASK_ROWS;
            for (i, o) in out.chunks_mut(t).enumerate() {
                let r = r0 + i;
                let row: &[f32] = match w.elems() {
                    Elems::F32(all) => &all[r * k..(r + 1) * k],
                    Elems::F16(all) => {
                        f16_to_f32(&all[r * k..(r + 1) * k], scratch);
                        scratch
                    }
                    Elems::BF16(all) => {
                        bf16_to_f32(&all[r * k..(r + 1) * k], scratch);
                        scratch
                    }
                };
                for (ti, v) in o.iter_mut().enumerate() {
                    *v = dot(&x[ti * k..(ti + 1) * k], row);
                }
            }
        },
    );
    for r in 0..n {
        for ti in 0..t {
            y[ti * n + r] = yt[r * t + ti];
        }
    }
}

fn linear_gemm(x: &[f32], t: usize, w: &Weight, y: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    if let Elems::F32(all) = w.elems() {
        gemm_xwt(x, all, y, t, k, n, n, 0);
        return;
    }
    let mut panel = vec![0f32; PANEL_ROWS.min(n) * k];
    for r0 in (0..n).step_by(PANEL_ROWS) {
        let r1 = (r0 + PANEL_ROWS).min(n);
        let p = &mut panel[..(r1 - r0) * k];
        // Widen in parallel: one row per task is plenty of work.
        p.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
            w.rows_to_f32(r0 + i, r0 + i + 1, row);
        });
        gemm_xwt(x, p, y, t, k, r1 - r0, n, r0);
    }
}

/// `y[:, col0..col0+n] = x[m × k] · w[n × k]ᵀ`, with `y` of row stride `y_stride`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_xwt(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    y_stride: usize,
    col0: usize,
) {
    assert!(x.len() >= m * k, "gemm: lhs too short");
    assert!(w.len() >= n * k, "gemm: rhs too short");
    assert!(col0 + n <= y_stride, "gemm: columns exceed the row");
    assert!(
        m == 0 || y.len() >= (m - 1) * y_stride + col0 + n,
        "gemm: dst too short"
    );
    if m == 0 || n == 0 {
        return;
    }
    let par = if m * n * k >= 1 << 18 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above bound every element the strides below reach: lhs
    // (i, kk) at i*k + kk < m*k; rhs (kk, j) at j*k + kk < n*k (Wᵀ read through
    // strides, W itself row-major); dst (i, j) at i*y_stride + col0 + j within `y`.
    // The three slices are distinct borrows, so dst aliases neither input.
    #[allow(unsafe_code)]
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr().add(col0),
            1,
            y_stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|kk| x[i * k + kk] * w[j * k + kk]).sum();
            }
        }
        y
    }

    #[test]
    fn gemm_matches_naive_including_panels() {
        let (m, k, n) = (9, 33, 70);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 11) as f32 - 5.0).collect();
        let mut y = vec![0f32; m * n];
        gemm_xwt(&x, &w[..30 * k], &mut y, m, k, 30, n, 0);
        gemm_xwt(&x, &w[30 * k..], &mut y, m, k, 40, n, 30);
        assert_eq!(y, naive(&x, m, &w, n, k));
    }

    #[test]
    fn dot_handles_tails() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b = vec![2f32; 37];
        assert_eq!(dot(&a, &b), (0..37).sum::<i32>() as f32 * 2.0);
    }
}
