//! Chained block hashes: block `i`'s hash covers its tokens and, through its parent's
//! hash, every token before it. Equal hashes mean equal prefixes, which is what prefix
//! caching, the KV-aware router and the KV transfer compare.

use xxhash_rust::xxh3::Xxh3;

/// Identity of a full block of tokens together with everything before it.
pub type BlockHash = u64;

/// Root of every chain where no deployment key was set (tests, a process without a
/// cluster token).
const UNKEYED_ROOT: u64 = 0x5052_4548_4541_5400;

/// What every chain of block hashes starts from. Keyed with a per-deployment secret
/// (derived from the cluster token, the same in every process of the deployment), so
/// that nobody without it can compute which hash a prompt's blocks get: prefix-cache
/// entries, the router's prefix index and K/V checks cannot be aimed at from outside.
/// Every process of a deployment must use the same key: the gateway's router and the
/// workers compare hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixKey(u64);

impl Default for PrefixKey {
    fn default() -> Self {
        Self::UNKEYED
    }
}

impl PrefixKey {
    /// No deployment secret: anyone can compute the hashes.
    pub const UNKEYED: PrefixKey = PrefixKey(UNKEYED_ROOT);

    /// Keyed by `secret`.
    #[must_use]
    pub fn from_secret(secret: u64) -> Self {
        PrefixKey(secret ^ UNKEYED_ROOT)
    }

    /// The deployment's key, from its cluster token (unkeyed without one).
    #[must_use]
    pub fn of_deployment(token: Option<&preheat_edge::ClusterToken>) -> Self {
        token.map_or(Self::UNKEYED, |t| {
            Self::from_secret(t.derive_u64("prefix-cache"))
        })
    }

    /// Hash of the block holding `tokens` after a prefix whose last block hashed to
    /// `parent`.
    #[must_use]
    pub fn chain(self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = Xxh3::new();
        h.update(&parent.unwrap_or(self.0).to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    }

    /// Hashes of every *full* block of `tokens` (a trailing partial block has none).
    #[must_use]
    pub fn block_hashes(self, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        let mut parent = None;
        for block in tokens.chunks_exact(block_size.max(1)) {
            let h = self.chain(parent, block);
            out.push(h);
            parent = Some(h);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_identify_prefixes() {
        let k = PrefixKey::UNKEYED;
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (k.block_hashes(&a, 16), k.block_hashes(&b, 16));
        assert_eq!(ha.len(), 2, "the partial third block has no hash");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Same tokens in a block after a different prefix hash differently.
        assert_ne!(k.chain(Some(1), &[1, 2]), k.chain(Some(2), &[1, 2]));
    }

    #[test]
    fn another_deployment_key_gives_every_block_another_hash() {
        let t: Vec<u32> = (0..32).collect();
        let (k1, k2) = (PrefixKey::from_secret(1), PrefixKey::from_secret(2));
        let (a, b) = (k1.chain(None, &t[..16]), k2.chain(None, &t[..16]));
        assert_ne!(a, b);
        assert_ne!(a, PrefixKey::UNKEYED.chain(None, &t[..16]));
        // ...and so every block chained after it.
        assert_ne!(k1.chain(Some(a), &t[16..]), k2.chain(Some(b), &t[16..]));
        assert_eq!(k1.block_hashes(&t, 16), k1.block_hashes(&t, 16));
    }
}
