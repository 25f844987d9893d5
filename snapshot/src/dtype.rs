//! Element types a snapshot stores, and exact conversions between them.

use std::fmt;

use half::{bf16, f16};

use crate::{Error, Result};

/// Element type of a stored tensor. Quantised source formats are dequantised into one
/// of these at conversion time, so every snapshot tensor is directly usable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Bytes per element.
    #[must_use]
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The name used in manifests and on the command line.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Parses a manifest / CLI name; `what` names the thing being parsed in the error.
    pub fn parse(s: &str, what: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => Err(Error::UnknownDtype {
                dtype: s.to_owned(),
                what: what.to_owned(),
            }),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DType::parse(s, "dtype")
    }
}

/// Appends `src` (elements of `from`, little-endian, any alignment) to `out` as `to`.
///
/// Widening (f16/bf16 → f32) is exact; narrowing rounds to nearest even, as PyTorch's
/// `.to()` does, so a converted checkpoint matches what the reference library computes.
pub fn convert_into(src: &[u8], from: DType, to: DType, out: &mut Vec<u8>) -> Result<()> {
    if !src.len().is_multiple_of(from.size()) {
        return Err(Error::InvalidSource(format!(
            "{} bytes is not a whole number of {from} elements",
            src.len()
        )));
    }
    if from == to {
        out.extend_from_slice(src);
        return Ok(());
    }
    let n = src.len() / from.size();
    let start = out.len();
    out.resize(start + n * to.size(), 0);
    let dst = &mut out[start..];
    // Work in bounded chunks so the f32 intermediate stays in cache.
    const CHUNK: usize = 4096;
    let mut tmp = vec![0f32; CHUNK.min(n)];
    for c in 0..n.div_ceil(CHUNK) {
        let lo = c * CHUNK;
        let hi = (lo + CHUNK).min(n);
        let t = &mut tmp[..hi - lo];
        read_f32(&src[lo * from.size()..hi * from.size()], from, t);
        write_f32(t, to, &mut dst[lo * to.size()..hi * to.size()]);
    }
    Ok(())
}

/// Decodes little-endian elements of `from` into `out` (same element count).
pub fn read_f32(src: &[u8], from: DType, out: &mut [f32]) {
    match from {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// Encodes `src` as little-endian elements of `to` into `out` (same element count).
pub fn write_f32(src: &[f32], to: DType, out: &mut [u8]) {
    match to {
        DType::F32 => {
            for (v, o) in src.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (v, o) in src.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (v, o) in src.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_and_narrowing_rounds_to_nearest_even() {
        let vals = [0.0f32, 1.0, -2.5, 1.0e-3, 65504.0, f32::INFINITY];
        let mut f32_bytes = Vec::new();
        for v in vals {
            f32_bytes.extend_from_slice(&v.to_le_bytes());
        }
        for dt in [DType::F16, DType::BF16] {
            let mut narrow = Vec::new();
            convert_into(&f32_bytes, DType::F32, dt, &mut narrow).unwrap();
            assert_eq!(narrow.len(), vals.len() * 2);
            let mut back = Vec::new();
            convert_into(&narrow, dt, DType::F32, &mut back).unwrap();
            let mut wide = vec![0f32; vals.len()];
            read_f32(&back, DType::F32, &mut wide);
            for (a, b) in vals.iter().zip(&wide) {
                let expect = if dt == DType::F16 {
                    f16::from_f32(*a).to_f32()
                } else {
                    bf16::from_f32(*a).to_f32()
                };
                assert_eq!(expect.to_bits(), b.to_bits(), "{dt} {a}");
            }
        }
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
        let halfway = 1.0f32 + 2f32.powi(-8);
        let mut out = Vec::new();
        convert_into(&halfway.to_le_bytes(), DType::F32, DType::BF16, &mut out).unwrap();
        assert_eq!(bf16::from_le_bytes([out[0], out[1]]).to_f32(), 1.0);
    }

    #[test]
    fn ragged_input_is_an_error() {
        let mut out = Vec::new();
        assert!(convert_into(&[0, 0, 0], DType::F16, DType::F32, &mut out).is_err());
    }

    #[test]
    fn parse_rejects_unknown_names() {
        assert_eq!(DType::parse("BF16", "x").unwrap(), DType::BF16);
        assert!(matches!(
            DType::parse("q4_0", "x"),
            Err(Error::UnknownDtype { .. })
        ));
    }
}
