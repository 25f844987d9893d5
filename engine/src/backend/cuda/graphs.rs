//! Decode steps captured as CUDA graphs, one per batch-size bucket, and replayed.

use cudarc::driver::{CudaGraph, sys};

use super::{CudaBackend, dev};
use crate::backend::ForwardBatch;
use crate::{EngineError, Result};

/// A captured decode step.
pub(super) struct Graph(pub(super) CudaGraph);

// SAFETY: a graph executable is not tied to the thread that captured it: cudarc binds
// the context before launching, and the backend (which owns it) is moved between
// threads, never shared, so no two threads launch it at once.
unsafe impl Send for Graph {}

impl CudaBackend {
    /// Captures the decode step of `bucket` sequences (one token each) into a graph.
    pub(super) fn capture(&mut self, bucket: usize) -> Result<()> {
        if bucket > self.s.cap_tokens {
            return Ok(());
        }
        // All rows are padding for the capture: it writes only the scratch block.
        let empty = ForwardBatch {
            tokens: &[],
            positions: &[],
            seq_of: &[],
            seqs: &[],
            logits_rows: &[],
        };
        self.stage_inputs(&empty, bucket, self.graph_bt_stride)?;
        self.stream.synchronize().map_err(dev)?;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(dev)?;
        let launched = self.launch_forward(bucket, bucket, self.graph_bt_stride);
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(dev)?;
        launched?;
        let graph = graph.ok_or_else(|| EngineError::Device("empty graph capture".into()))?;
        graph.upload().map_err(dev)?;
        self.graphs.insert(bucket, Graph(graph));
        Ok(())
    }
}
