//! `y[t, out] = x[t, in] · W[out, in]ᵀ` on cuBLAS, for weights in their stored dtype:
//! f32 through SGEMM, bf16/f16 through GemmEx on tensor cores with f32 accumulation
//! and f32 output (activations are narrowed to the weight's dtype first).
// FFI with cuBLAS; every block says why it holds.
#![allow(unsafe_code)]

use std::ffi::c_void;

use cudarc::cublas::{CudaBlas, result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use preheat_snapshot::DType;

use crate::{EngineError, Result};

/// A weight matrix in device memory, row-major `[rows, cols]`, in its stored dtype.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub data: CudaSlice<u8>,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

fn blas_err(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Device(format!("cuBLAS: {e:?}"))
}

/// `y = x · wᵀ` for `t` rows. For half-precision weights `x_narrow` holds `x` already
/// narrowed to the weight's dtype (`t × w.cols` elements of 2 bytes).
pub fn linear(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<f32>,
    x_narrow: &CudaSlice<u16>,
    t: usize,
    w: &DeviceMatrix,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let (m, n, k) = (w.rows as i32, t as i32, w.cols as i32);
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (a, _ga) = w.data.device_ptr(stream);
    let (c, _gc) = y.device_ptr_mut(stream);
    // Row-major y[t, out] is column-major [out, t]: C = op(A)·B with A the weight seen
    // column-major as [in, out] (transposed), B = x column-major [in, t].
    match w.dtype {
        DType::F32 => {
            let (b, _gb) = x.device_ptr(stream);
            // SAFETY: pointers are live device allocations on this stream of at least
            // out×in, in×t and out×t elements (checked by the caller's shapes).
            unsafe {
                result::sgemm(
                    *blas.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    &alpha,
                    a as *const f32,
                    k,
                    b as *const f32,
                    k,
                    &beta,
                    c as *mut f32,
                    m,
                )
            }
            .map_err(blas_err)
        }
        DType::F16 | DType::BF16 => {
            let ty = if w.dtype == DType::BF16 {
                sys::cudaDataType::CUDA_R_16BF
            } else {
                sys::cudaDataType::CUDA_R_16F
            };
            let (b, _gb) = x_narrow.device_ptr(stream);
            // SAFETY: as above; A and B share the half-precision type, C is f32 and
            // the computation accumulates in f32 (a combination cuBLAS supports).
            unsafe {
                result::gemm_ex(
                    *blas.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast::<c_void>(),
                    a as *const c_void,
                    ty,
                    k,
                    b as *const c_void,
                    ty,
                    k,
                    (&beta as *const f32).cast::<c_void>(),
                    c as *mut c_void,
                    sys::cudaDataType::CUDA_R_32F,
                    m,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(blas_err)
        }
    }
}

/// Gives cuBLAS a workspace of its own, so it never allocates inside a captured graph.
pub fn set_workspace(blas: &CudaBlas, stream: &CudaStream, ws: &mut CudaSlice<u8>) -> Result<()> {
    let len = ws.len();
    let (p, _g) = ws.device_ptr_mut(stream);
    // SAFETY: `ws` outlives the handle's use of it (both owned by the backend, the
    // handle dropped first) and is `len` bytes long.
    let st = unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut c_void, len) };
    if st != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(blas_err(st));
    }
    Ok(())
}
