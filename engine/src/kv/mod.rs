//! The paged KV cache: fixed-size blocks of token slots, block tables per sequence, and
//! prefix caching by chained block hashes.
//!
//! ## Layout (what a backend stores and what the KV transfer ships)
//!
//! For each layer there is one K and one V array of `num_blocks` blocks. A block holds
//! `block_size` token slots; a slot holds `num_kv_heads × head_dim` elements, so one
//! block of one layer's K is a contiguous `[block_size][num_kv_heads][head_dim]` row-major
//! array (f32 on the CPU backend). Token `p` of a sequence lives in block
//! `block_table[p / block_size]`, slot `p % block_size`. Shipping a sequence is therefore
//! `num_layers × 2 × blocks` contiguous copies, and a receiver with the same
//! compatibility hash can place them into whatever block ids it allocated.

pub mod block_pool;
pub mod hashing;
pub mod payload;

pub use block_pool::{BlockId, BlockPool};
pub use hashing::{BlockHash, PrefixKey};
