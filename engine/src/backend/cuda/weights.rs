//! The model's weights on the GPU: matrices in their stored dtype (uploaded through
//! pinned staging on two streams), norms, biases and the RoPE table in f32.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use preheat_snapshot::tensors::{self, LayerTensors, Named};
use preheat_snapshot::{ModelConfig, Snapshot};

use super::gemm::DeviceMatrix;
use super::upload::Uploader;
use super::{GpuStartup, dev};
use crate::Result;
use crate::backend::rope::inv_freq;
use crate::backend::weights::Weight;

#[derive(Debug)]
pub(super) struct Layer {
    pub(super) input_norm: CudaSlice<f32>,
    pub(super) post_norm: CudaSlice<f32>,
    pub(super) q: DeviceMatrix,
    pub(super) k: DeviceMatrix,
    pub(super) v: DeviceMatrix,
    pub(super) o: DeviceMatrix,
    pub(super) q_bias: Option<CudaSlice<f32>>,
    pub(super) k_bias: Option<CudaSlice<f32>>,
    pub(super) v_bias: Option<CudaSlice<f32>>,
    pub(super) gate: DeviceMatrix,
    pub(super) up: DeviceMatrix,
    pub(super) down: DeviceMatrix,
}

/// Everything of the model that lives on the device.
#[derive(Debug)]
pub(super) struct DeviceWeights {
    pub(super) embed: DeviceMatrix,
    pub(super) lm_head: Option<DeviceMatrix>,
    pub(super) final_norm: CudaSlice<f32>,
    pub(super) layers: Vec<Layer>,
    pub(super) inv_freq: CudaSlice<f32>,
}

impl DeviceWeights {
    /// Uploads the model of `snap`: every matrix is allocated first (on the compute
    /// stream), then uploaded; `startup` gets the bytes and times.
    pub(super) fn upload(
        snap: &Arc<Snapshot>,
        c: &ModelConfig,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        startup: &mut GpuStartup,
    ) -> Result<Self> {
        let t0 = Instant::now();
        let mut up = Uploader::new(ctx)?;
        let mut mat = |t: &Named| -> Result<DeviceMatrix> {
            let w = Weight::load_named(snap, t)?;
            // SAFETY: fully written by the upload below before any kernel reads it.
            let mut data = unsafe { stream.alloc::<u8>(w.bytes().len()).map_err(dev)? };
            stream.synchronize().map_err(dev)?;
            up.upload(w.bytes(), &mut data)?;
            Ok(DeviceMatrix {
                data,
                dtype: w.dtype,
                rows: w.rows,
                cols: w.cols,
            })
        };
        let mut layers_m = Vec::with_capacity(c.num_hidden_layers as usize);
        for l in 0..c.num_hidden_layers {
            let t = LayerTensors::of(c, l);
            layers_m.push([
                mat(&t.q)?,
                mat(&t.k)?,
                mat(&t.v)?,
                mat(&t.o)?,
                mat(&t.gate)?,
                mat(&t.up)?,
                mat(&t.down)?,
            ]);
        }
        let embed = mat(&tensors::embed(c))?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(mat(&tensors::lm_head(c))?)
        };
        up.finish()?;
        // Small f32 vectors (norms, biases, RoPE table) go up directly.
        let vecf = |v: &[f32]| stream.clone_htod(v).map_err(dev);
        let w32 = |t: &Named| -> Result<Vec<f32>> { Ok(Weight::load_named(snap, t)?.to_f32_vec()) };
        let bias = |t: &Named| -> Result<Option<CudaSlice<f32>>> {
            match Weight::load_bias(snap, c, t)? {
                Some(b) => Ok(Some(vecf(&b.to_f32_vec())?)),
                None => Ok(None),
            }
        };
        let mut layers = Vec::with_capacity(layers_m.len());
        for (l, [q, k, v, o, gate, upm, down]) in layers_m.into_iter().enumerate() {
            let t = LayerTensors::of(c, l as u64);
            layers.push(Layer {
                input_norm: vecf(&w32(&t.input_norm)?)?,
                post_norm: vecf(&w32(&t.post_norm)?)?,
                q,
                k,
                v,
                o,
                q_bias: bias(&t.q_bias)?,
                k_bias: bias(&t.k_bias)?,
                v_bias: bias(&t.v_bias)?,
                gate,
                up: upm,
                down,
            });
        }
        let final_norm = vecf(&w32(&tensors::final_norm(c))?)?;
        let inv_freq = vecf(&inv_freq(c))?;
        stream.synchronize().map_err(dev)?;
        startup.upload_bytes = up.bytes;
        startup.upload_s = t0.elapsed().as_secs_f64();
        startup.upload_read_s = up.read_s;
        Ok(DeviceWeights {
            embed,
            lm_head,
            final_norm,
            layers,
            inv_freq,
        })
    }
}
