//! Weights as zero-copy views into a mapped snapshot.

use std::sync::Arc;

use half::{bf16, f16};
use preheat_snapshot::{DType, Snapshot};

use crate::{EngineError, Result};

/// A 2-D (or 1-D) weight stored in the snapshot, in its stored dtype.
#[derive(Clone, Debug)]
pub struct Weight {
    snap: Arc<Snapshot>,
    start: usize,
    len: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// Typed view of a weight's elements.
#[derive(Clone, Copy, Debug)]
pub enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Weight {
    /// The tensor `name`, checked to have `shape`.
    pub fn load(snap: &Arc<Snapshot>, name: &str, shape: &[usize]) -> Result<Self> {
        let t = snap
            .require(name)
            .map_err(|e| EngineError::Model(e.to_string()))?;
        let actual: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
        if actual != shape {
            return Err(EngineError::Model(format!(
                "tensor {name} has shape {actual:?}, expected {shape:?}"
            )));
        }
        let start = t.bytes.as_ptr() as usize - snap.bytes().as_ptr() as usize;
        Ok(Weight {
            snap: Arc::clone(snap),
            start,
            len: t.bytes.len(),
            dtype: t.dtype(),
            rows: if shape.len() == 2 { shape[0] } else { 1 },
            cols: *shape.last().unwrap_or(&0),
        })
    }

    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.snap.bytes()[self.start..self.start + self.len]
    }

    /// The elements without copying (offsets are page-aligned, so the casts hold).
    #[must_use]
    pub fn elems(&self) -> Elems<'_> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => Elems::F32(bytemuck::cast_slice(b)),
            DType::F16 => Elems::F16(bytemuck::cast_slice(b)),
            DType::BF16 => Elems::BF16(bytemuck::cast_slice(b)),
        }
    }

    /// Widens rows `r0..r1` into `out` (`(r1 - r0) × cols` elements).
    pub fn rows_to_f32(&self, r0: usize, r1: usize, out: &mut [f32]) {
        let (a, b) = (r0 * self.cols, r1 * self.cols);
        match self.elems() {
            Elems::F32(w) => out.copy_from_slice(&w[a..b]),
            Elems::F16(w) => super::matmul::f16_to_f32(&w[a..b], out),
            Elems::BF16(w) => super::matmul::bf16_to_f32(&w[a..b], out),
        }
    }

    /// A 1-D weight (norm scale, bias) widened to f32.
    #[must_use]
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.rows * self.cols];
        self.rows_to_f32(0, self.rows, &mut v);
        v
    }
}
