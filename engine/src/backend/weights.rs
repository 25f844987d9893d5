//! Weights as zero-copy views into a mapped snapshot: what the CPU backend computes on
//! and the GPU backend uploads from.

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use multiversion::multiversion;
use preheat_snapshot::tensors::Named;
use preheat_snapshot::{DType, ModelConfig, Snapshot};

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

    /// The tensor `t` of the model's table ([`preheat_snapshot::tensors`]).
    pub fn load_named(snap: &Arc<Snapshot>, t: &Named) -> Result<Self> {
        let shape: Vec<usize> = t.1.iter().map(|&d| d as usize).collect();
        Self::load(snap, &t.0, &shape)
    }

    /// A q/k/v bias `t`: used when the checkpoint has it, required when the config
    /// declares biases.
    pub fn load_bias(snap: &Arc<Snapshot>, c: &ModelConfig, t: &Named) -> Result<Option<Self>> {
        if snap.tensor(&t.0).is_some() {
            Ok(Some(Self::load_named(snap, t)?))
        } else if c.attention_bias {
            Err(EngineError::Model(format!(
                "config declares q/k/v bias but {} is missing",
                t.0
            )))
        } else {
            Ok(None)
        }
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
            Elems::F16(w) => f16_to_f32(&w[a..b], out),
            Elems::BF16(w) => bf16_to_f32(&w[a..b], out),
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

/// Widens bf16 to f32 (exact: bf16 is f32's top half).
#[multiversion(targets("x86_64+avx2+fma", "x86_64+avx", "aarch64+neon"))]
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

/// Widens f16 to f32.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    // `half` picks F16C at run time when the CPU has it.
    src.convert_to_f32_slice(dst);
}
