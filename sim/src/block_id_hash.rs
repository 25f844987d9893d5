//! The hasher for trace-assigned prefix block ids, in the prefix caches' maps and
//! where a trace's blocks are renumbered.

use std::hash::{BuildHasher, Hasher};

/// Block ids are trace-assigned integers (Mooncake's `hash_ids`, or `--rate-scale`'s
/// salted copies of them): a multiply and a shift spread them over the table without
/// SipHash's cost; no peer chooses them.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BlockIdHasher;

impl BuildHasher for BlockIdHasher {
    type Hasher = BlockIdHash;
    fn build_hasher(&self) -> BlockIdHash {
        BlockIdHash(0)
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BlockIdHash(u64);

impl Hasher for BlockIdHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 29;
    }
}
