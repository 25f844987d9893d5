//! Chained block hashes: block `i`'s hash covers its tokens and, through its parent's
//! hash, every token before it. Equal hashes mean equal prefixes, which is what prefix
//! caching, the KV-aware router and the KV transfer compare.

use std::sync::OnceLock;

use xxhash_rust::xxh3::Xxh3;

/// Identity of a full block of tokens together with everything before it.
pub type BlockHash = u64;

/// Root of every chain where no deployment key was set (tests, a process without a
/// cluster token).
const UNKEYED_ROOT: u64 = 0x5052_4548_4541_5400;
static KEY: OnceLock<u64> = OnceLock::new();

/// Keys every block hash of this process with a per-deployment secret (derived from
/// the cluster token, the same in every process of the deployment), so that nobody
/// without it can compute which hash a prompt's blocks get: prefix-cache entries, the
/// router's prefix index and K/V checks cannot be aimed at from outside. Set once, at
/// start, before any hash is taken; false when another key was set already.
pub fn set_key(key: u64) -> bool {
    KEY.set(key).is_ok() || KEY.get() == Some(&key)
}

/// Hash of the block holding `tokens` after a prefix whose last block hashed to `parent`.
#[must_use]
pub fn chain(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    chain_from(
        KEY.get().map_or(UNKEYED_ROOT, |k| k ^ UNKEYED_ROOT),
        parent,
        tokens,
    )
}

/// [`chain`] under the root `root` (the deployment key's).
fn chain_from(root: u64, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&parent.unwrap_or(root).to_le_bytes());
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

    #[test]
    fn another_deployment_key_gives_every_block_another_hash() {
        let t: Vec<u32> = (0..32).collect();
        let a = chain_from(1, None, &t[..16]);
        let b = chain_from(2, None, &t[..16]);
        assert_ne!(a, b);
        // ...and so every block chained after it.
        assert_ne!(
            chain_from(1, Some(a), &t[16..]),
            chain_from(2, Some(b), &t[16..])
        );
    }
}
