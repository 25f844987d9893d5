//! GGML tensor types and their dequantisation to f32.
//!
//! Each routine follows ggml's reference C implementation (`dequantize_row_*` in
//! ggml-quants.c), including the order of float operations, so results are bit-exact
//! with llama.cpp and with gguf-py's numpy dequantiser.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl GgmlType {
    #[must_use]
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    #[must_use]
    pub const fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }

    /// Bytes of a tensor of `numel` elements whose rows have `row_len` elements; `None`
    /// when rows are not a whole number of blocks or on overflow.
    #[must_use]
    pub fn bytes_for(self, numel: u64, row_len: u64) -> Option<u64> {
        let (be, bb) = self.block();
        if !row_len.is_multiple_of(be) {
            return None;
        }
        (numel / be).checked_mul(bb)
    }

    #[must_use]
    pub fn is_quantized(self) -> bool {
        self.block().0 > 1
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantises `src` (whole blocks of `ty`) into `out`, which must hold exactly the
/// number of elements `src` encodes.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    debug_assert_eq!(src.len() / bb * be, out.len());
    for (blk, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            GgmlType::F16 => y[0] = h(blk, 0),
            GgmlType::BF16 => y[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            GgmlType::Q4_0 => {
                let d = h(blk, 0);
                let qs = &blk[2..18];
                for j in 0..16 {
                    y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
            GgmlType::Q4_1 => {
                let (d, m) = (h(blk, 0), h(blk, 2));
                let qs = &blk[4..20];
                for j in 0..16 {
                    y[j] = (qs[j] & 0x0F) as f32 * d + m;
                    y[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
            }
            GgmlType::Q8_0 => {
                let d = h(blk, 0);
                for j in 0..32 {
                    y[j] = (blk[2 + j] as i8) as f32 * d;
                }
            }
            GgmlType::Q4K => dequant_q4k(blk, y),
            GgmlType::Q6K => dequant_q6k(blk, y),
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K block (`get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// block_q4_K: f16 d, f16 dmin, 12 bytes of packed scales/mins, 128 bytes of nibbles.
fn dequant_q4k(blk: &[u8], y: &mut [f32]) {
    let d = h(blk, 0);
    let min = h(blk, 2);
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    for (n, j) in (0..256).step_by(64).enumerate() {
        let q = &qs[n * 32..n * 32 + 32];
        let (sc, m) = scale_min_k4(2 * n, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(2 * n + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            y[j + l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// block_q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 i8 scales, f16 d.
fn dequant_q6k(blk: &[u8], y: &mut [f32]) {
    let d = h(blk, 208);
    for half_ in 0..2 {
        let ql = &blk[half_ * 64..half_ * 64 + 64];
        let qh = &blk[128 + half_ * 32..128 + half_ * 32 + 32];
        let sc = &blk[192 + half_ * 8..192 + half_ * 8 + 8];
        let y = &mut y[half_ * 128..half_ * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| (sc[k] as i8) as f32;
            y[l] = d * s(is) * q1 as f32;
            y[l + 32] = d * s(is + 2) * q2 as f32;
            y[l + 64] = d * s(is + 4) * q3 as f32;
            y[l + 96] = d * s(is + 6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_and_q8_0_by_hand() {
        // d = 0.5 (f16 0x3800); nibbles 0..15 → (q-8)*d.
        let mut blk = vec![0x00, 0x38];
        blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_0, &blk, &mut y);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[15], 3.5);
        assert_eq!(y[16], 3.5);
        let mut blk = vec![0x00, 0x40]; // d = 2.0
        blk.extend((0..32).map(|j| (j as i8 - 16) as u8));
        dequantize(GgmlType::Q8_0, &blk, &mut y);
        assert_eq!(y[0], -32.0);
        assert_eq!(y[31], 30.0);
    }

    #[test]
    fn sizes_require_whole_blocks() {
        assert_eq!(GgmlType::Q4K.bytes_for(512, 256), Some(288));
        assert_eq!(GgmlType::Q4K.bytes_for(100, 100), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX, 1), None);
    }
}
