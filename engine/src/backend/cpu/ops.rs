//! Elementwise and normalisation kernels of the Llama block, in f32.

/// RMSNorm over each row of `x` (`rows × w.len()`), as transformers computes it:
/// `x · rsqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let h = w.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let ss: f32 = super::matmul::dot(xr, xr);
        let scale = 1.0 / (ss / h as f32 + eps).sqrt();
        for ((o, xv), wv) in or.iter_mut().zip(xr).zip(w) {
            *o = wv * (xv * scale);
        }
    }
}

/// `gate ← silu(gate) · up`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Applies rotate-half RoPE in place to `x` (`rows × heads × head_dim`), row `i` at
/// position `positions[i]`.
pub fn rope(x: &mut [f32], positions: &[u32], heads: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    let hd = half * 2;
    let mut cos = vec![0f32; half];
    let mut sin = vec![0f32; half];
    for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
        for i in 0..half {
            // f32 product then f32 cos/sin, as transformers computes the tables.
            let (s, c) = (p as f32 * inv_freq[i]).sin_cos();
            cos[i] = c;
            sin[i] = s;
        }
        for head in row.chunks_exact_mut(hd) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_is_a_rotation() {
        let inv = vec![1.0, 0.5];
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        let norm0: f32 = x.iter().map(|v| v * v).sum();
        rope(&mut x, &[3], 1, &inv);
        let norm1: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm0 - norm1).abs() < 1e-4);
        let mut y = vec![1.0, 2.0, 3.0, 4.0];
        rope(&mut y, &[0], 1, &inv);
        assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0], "position 0 is the identity");
    }
}
