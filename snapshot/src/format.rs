//! The fixed 64-byte header at the start of every snapshot file.
//!
//! ```text
//! offset size field
//!      0    8 magic  b"PREHEAT\0"
//!      8    4 format version (u32 LE)
//!     12    4 flags (u32 LE, 0)
//!     16    8 manifest offset (u64 LE, always 64)
//!     24    8 manifest length in bytes
//!     32    8 manifest checksum (XXH3-64)
//!     40    8 data offset: first byte of the data region, a multiple of ALIGN
//!     48    8 total file length
//!     56    8 header checksum (XXH3-64 of bytes 0..56)
//! ```
//!
//! After the header: the manifest (JSON), zero padding to `data offset`, then blobs
//! (tokenizer, kernel cache, …) and tensors, each starting at a multiple of [`ALIGN`].

use crate::checksum::Checksum;
use crate::{Error, Result};

pub const MAGIC: [u8; 8] = *b"PREHEAT\0";
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 64;
/// Every blob and tensor starts at a multiple of this: a page, so an mmap hands out
/// correctly aligned slices and DMA engines can read straight from the mapping.
pub const ALIGN: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub flags: u32,
    pub manifest_offset: u64,
    pub manifest_len: u64,
    pub manifest_checksum: Checksum,
    pub data_offset: u64,
    pub file_len: u64,
}

impl Header {
    #[must_use]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.manifest_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.manifest_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.manifest_checksum.0.to_le_bytes());
        b[40..48].copy_from_slice(&self.data_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.file_len.to_le_bytes());
        let sum = Checksum::of(&b[0..56]);
        b[56..64].copy_from_slice(&sum.0.to_le_bytes());
        b
    }

    /// Decodes and checks the header of a file of `actual_len` bytes whose first bytes
    /// are `b`. Checks only the header itself and the bounds it declares.
    pub fn decode(b: &[u8], actual_len: u64) -> Result<Self> {
        if b.len() < MAGIC.len() || b[..MAGIC.len()] != MAGIC {
            return Err(Error::BadMagic {
                found: b[..b.len().min(MAGIC.len())].to_vec(),
            });
        }
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated {
                what: "header".into(),
                needed: HEADER_LEN as u64,
                actual: actual_len,
            });
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(Error::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let expected = Checksum(u64_at(56));
        let actual = Checksum::of(&b[0..56]);
        if expected != actual {
            return Err(Error::ChecksumMismatch {
                what: "header".into(),
                expected: expected.to_string(),
                actual: actual.to_string(),
            });
        }
        let h = Header {
            version,
            flags: u32_at(12),
            manifest_offset: u64_at(16),
            manifest_len: u64_at(24),
            manifest_checksum: Checksum(u64_at(32)),
            data_offset: u64_at(40),
            file_len: u64_at(48),
        };
        if h.file_len > actual_len {
            return Err(Error::Truncated {
                what: "file".into(),
                needed: h.file_len,
                actual: actual_len,
            });
        }
        if h.file_len < actual_len {
            return Err(Error::OutOfBounds {
                what: format!(
                    "file is {actual_len} bytes but its header says {}",
                    h.file_len
                ),
            });
        }
        if h.manifest_offset != HEADER_LEN as u64 {
            return Err(Error::OutOfBounds {
                what: format!("manifest offset {} (must be 64)", h.manifest_offset),
            });
        }
        let manifest_end = h.manifest_offset.checked_add(h.manifest_len);
        match manifest_end {
            Some(end) if end <= h.data_offset && h.data_offset <= h.file_len => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: format!(
                        "manifest {}+{} / data offset {} in a {}-byte file",
                        h.manifest_offset, h.manifest_len, h.data_offset, h.file_len
                    ),
                });
            }
        }
        if !h.data_offset.is_multiple_of(ALIGN) {
            return Err(Error::OutOfBounds {
                what: format!("data offset {} is not {ALIGN}-aligned", h.data_offset),
            });
        }
        Ok(h)
    }
}

/// Rounds `x` up to the next multiple of [`ALIGN`]; `None` on overflow.
#[must_use]
pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            version: FORMAT_VERSION,
            flags: 0,
            manifest_offset: 64,
            manifest_len: 100,
            manifest_checksum: Checksum(7),
            data_offset: 4096,
            file_len: 8192,
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(Header::decode(&h.encode(), 8192).unwrap(), h);
    }

    #[test]
    fn every_single_bit_flip_is_rejected() {
        let b = sample().encode();
        for byte in 0..HEADER_LEN {
            for bit in 0..8 {
                let mut c = b;
                c[byte] ^= 1 << bit;
                assert!(Header::decode(&c, 8192).is_err(), "flip {byte}:{bit}");
            }
        }
    }

    #[test]
    fn length_disagreements_are_typed() {
        let b = sample().encode();
        assert!(matches!(
            Header::decode(&b, 5000),
            Err(Error::Truncated { .. })
        ));
        assert!(matches!(
            Header::decode(&b, 9000),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            Header::decode(&b[..10], 10),
            Err(Error::Truncated { .. })
        ));
        assert!(matches!(
            Header::decode(b"GGUF\x03\0\0\0", 8),
            Err(Error::BadMagic { .. })
        ));
    }
}
