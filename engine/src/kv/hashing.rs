//! Chained block hashes: block `i`'s hash covers its tokens and, through its parent's
//! hash, every token before it. Equal hashes mean equal prefixes, which is what prefix
//! caching, the KV-aware router and the KV transfer compare.

use xxhash_rust::xxh3::Xxh3;

/// Identity of a full block of tokens together with everything before it.
pub type BlockHash = u64;

/// Hash of the block holding `tokens` after a prefix whose last block hashed to `parent`.
#[must_use]
pub fn chain(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&parent.unwrap_or(0x5052_4548_4541_5400).to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest()
}

/// Hashes of every *full* block of `tokens` (a trailing partial block has none).
#[must_use]
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let h = chain(parent, block);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_identify_prefixes() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 2, "the partial third block has no hash");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Same tokens in a block after a different prefix hash differently.
        assert_ne!(chain(Some(1), &[1, 2]), chain(Some(2), &[1, 2]));
    }
}
