//! Weights from the mapped snapshot to device memory through pinned staging buffers, in
//! chunks alternating between two streams: while one chunk crosses PCIe, the CPU reads
//! the next one from the page cache (or disk) into the other buffer.
// FFI with the CUDA driver (pinned memory); every block says why it holds.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};

use crate::{EngineError, Result};

/// Bytes per staging buffer (and per copy).
pub const CHUNK: usize = 32 << 20;

fn dev(e: impl std::fmt::Debug) -> EngineError {
    EngineError::Device(format!("CUDA: {e:?}"))
}

/// Two pinned buffers, two streams, and the last copy issued from each.
#[derive(Debug)]
pub struct Uploader {
    streams: [Arc<CudaStream>; 2],
    staging: [PinnedHostSlice<u8>; 2],
    in_flight: [Option<CudaEvent>; 2],
    next: usize,
    pub bytes: u64,
    /// Seconds spent filling staging buffers (reading the snapshot).
    pub read_s: f64,
}

impl Uploader {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let s0 = ctx.new_stream().map_err(dev)?;
        let s1 = ctx.new_stream().map_err(dev)?;
        // SAFETY: the buffers are written before any copy reads them.
        let (b0, b1) = unsafe {
            (
                ctx.alloc_pinned::<u8>(CHUNK).map_err(dev)?,
                ctx.alloc_pinned::<u8>(CHUNK).map_err(dev)?,
            )
        };
        Ok(Uploader {
            streams: [s0, s1],
            staging: [b0, b1],
            in_flight: [None, None],
            next: 0,
            bytes: 0,
            read_s: 0.0,
        })
    }

    /// Queues the copy of `src` into `dst` (at least as long); returns once every chunk
    /// is queued, with the last two possibly still in flight ([`Uploader::finish`]).
    pub fn upload(&mut self, src: &[u8], dst: &mut CudaSlice<u8>) -> Result<()> {
        if dst.len() < src.len() {
            return Err(EngineError::Internal(format!(
                "upload of {} bytes into {}",
                src.len(),
                dst.len()
            )));
        }
        let mut off = 0;
        for chunk in src.chunks(CHUNK) {
            let i = self.next;
            self.next ^= 1;
            // The buffer is reused only after its previous copy completed.
            if let Some(ev) = self.in_flight[i].take() {
                ev.synchronize().map_err(dev)?;
            }
            let t = Instant::now();
            let buf = self.staging[i].as_mut_slice().map_err(dev)?;
            buf[..chunk.len()].copy_from_slice(chunk);
            self.read_s += t.elapsed().as_secs_f64();
            let stream = &self.streams[i];
            let mut view = dst.slice_mut(off..off + chunk.len());
            let pinned = &self.staging[i].as_slice().map_err(dev)?[..chunk.len()];
            stream.memcpy_htod(pinned, &mut view).map_err(dev)?;
            self.in_flight[i] = Some(stream.record_event(None).map_err(dev)?);
            off += chunk.len();
            self.bytes += chunk.len() as u64;
        }
        Ok(())
    }

    /// Waits for every queued copy.
    pub fn finish(&mut self) -> Result<()> {
        for s in &self.streams {
            s.synchronize().map_err(dev)?;
        }
        self.in_flight = [None, None];
        Ok(())
    }
}

/// Host-to-device bandwidth of device `device`: `bytes` copied from one pinned buffer,
/// best of three, in bytes/s (the physical limit an upload is compared against).
pub fn h2d_bandwidth(device: usize, bytes: usize) -> Result<f64> {
    let ctx = CudaContext::new(device).map_err(dev)?;
    let stream = ctx.default_stream();
    // SAFETY: the contents are irrelevant to a bandwidth measurement.
    let host = unsafe { ctx.alloc_pinned::<u8>(bytes).map_err(dev)? };
    // SAFETY: written by the copy before anything reads it.
    let mut devbuf = unsafe { stream.alloc::<u8>(bytes).map_err(dev)? };
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        stream.synchronize().map_err(dev)?;
        let t = Instant::now();
        stream.memcpy_htod(&host, &mut devbuf).map_err(dev)?;
        stream.synchronize().map_err(dev)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best)
}
