//! Content checksums: XXH3-64, which runs near memory bandwidth, so verifying a
//! snapshot costs about as much as reading it.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A 64-bit XXH3 digest, written in manifests as exactly 16 lowercase hex digits.
///
/// The fixed width matters: the writer serialises the manifest once with zero
/// placeholders to lay out the file, and again with the real digests, and the two must
/// have the same length.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Checksum(pub u64);

impl Checksum {
    /// Digest of `bytes`.
    #[must_use]
    pub fn of(bytes: &[u8]) -> Self {
        Checksum(xxhash_rust::xxh3::xxh3_64(bytes))
    }
}

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Checksum({self})")
    }
}

impl Serialize for Checksum {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() != 16 {
            return Err(serde::de::Error::custom(format!(
                "checksum {s:?} is not 16 hex digits"
            )));
        }
        u64::from_str_radix(&s, 16)
            .map(Checksum)
            .map_err(|_| serde::de::Error::custom(format!("checksum {s:?} is not hex")))
    }
}

/// Streaming digest for data that arrives in pieces.
#[derive(Default)]
pub struct Hasher(xxhash_rust::xxh3::Xxh3);

impl fmt::Debug for Hasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Hasher")
    }
}

impl Hasher {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    #[must_use]
    pub fn finish(&self) -> Checksum {
        Checksum(self.0.digest())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_and_hex_is_fixed_width() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut h = Hasher::new();
        for part in data.chunks(777) {
            h.update(part);
        }
        assert_eq!(h.finish(), Checksum::of(&data));
        let json = serde_json::to_string(&Checksum(1)).unwrap();
        assert_eq!(json, "\"0000000000000001\"");
        let back: Checksum = serde_json::from_str(&json).unwrap();
        assert_eq!(back, Checksum(1));
        assert!(serde_json::from_str::<Checksum>("\"xyz\"").is_err());
    }
}
