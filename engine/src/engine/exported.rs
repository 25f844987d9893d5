//! A sequence leaving one engine for another: a prefill engine exports its prompt's
//! K/V with the first token it sampled, and a decode engine imports it and goes on.
//! How it travels between processes is not the engine's business
//! ([`crate::disagg::wire::kv_message`] carries it, checked on arrival).

use crate::backend::KvLayout;
use crate::kv::BlockHash;
use crate::kv::payload::{PayloadShape, ShapeError};
use crate::sampling::SamplingParams;

/// A prefilled sequence and its K/V.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportedSequence {
    /// The id it was prefilled under (the transfer's, named by the decode side).
    pub request_id: String,
    /// The KV compatibility hash of the engine that computed it
    /// ([`crate::kv::payload::compat_hash`]): an engine imports only its own kind.
    pub compat: String,
    /// Tokens whose K/V are carried (positions `0..prompt.len()`).
    pub prompt: Vec<u32>,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<BlockHash>,
    pub first_token: u32,
    pub first_logprob: Option<f32>,
    /// The first token's top alternatives, when the request asked for logprobs.
    pub first_top_logprobs: Vec<(u32, f32)>,
    pub params: SamplingParams,
    /// The sampler's state after the first token.
    pub rng_state: u64,
    /// How `payload` is laid out.
    pub shape: PayloadShape,
    /// The prompt's blocks' K/V, as [`crate::backend::Backend::export_kv`] writes it.
    pub payload: Vec<u8>,
}

impl ExportedSequence {
    /// Checks the sequence's shape and payload size against an importer's `layout`
    /// and limit (what installing it into that cache needs; whether the bytes arrived
    /// intact, the wire has checked).
    pub fn check(&self, layout: &KvLayout, max_payload: u64) -> Result<(), ShapeError> {
        let n = self.shape.check(
            self.prompt.len(),
            self.block_hashes.len(),
            layout,
            max_payload,
        )?;
        if self.payload.len() as u64 != n {
            return Err(ShapeError::Shape(format!(
                "{} bytes of K/V, the shape says {n}",
                self.payload.len()
            )));
        }
        Ok(())
    }
}
