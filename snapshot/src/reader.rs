//! Opening a snapshot: map the file, check the header and manifest, and hand out
//! zero-copy tensor views. Tensor bytes are only read by `verify` or by the caller.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::{Advice, Mmap};

use crate::checksum::Checksum;
use crate::format::{ALIGN, HEADER_LEN, Header};
use crate::manifest::{Blob, Manifest, TensorEntry};
use crate::{DType, Error, Result};

/// A read-only, memory-mapped snapshot. Cheap to open, whatever its size.
#[derive(Debug)]
pub struct Snapshot {
    path: PathBuf,
    map: Mmap,
    header: Header,
    manifest: Manifest,
}

/// Page-cache hints for the whole mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessHint {
    /// Start reading everything in now (staging a hot replica).
    WillNeed,
    /// Front-to-back read: aggressive readahead (load, verify).
    Sequential,
    /// Scattered access: no readahead.
    Random,
}

impl Snapshot {
    /// Maps `path` and validates the header, the manifest checksum and every bound the
    /// manifest declares. Does not read tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        if len < HEADER_LEN as u64 {
            // Too short to map usefully; read what is there for a precise error.
            let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            return Err(Header::decode(&bytes, len)
                .err()
                .unwrap_or_else(|| short_header(len)));
        }
        // SAFETY: the mapping is read-only and snapshots are immutable once published
        // (writers build a temp file and rename it into place, never modify in place),
        // so the bytes cannot change under the slices handed out below.
        #[allow(unsafe_code)]
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header, manifest) = parse(&map)?;
        Ok(Snapshot {
            path,
            map,
            header,
            manifest,
        })
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    #[must_use]
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Total file size in bytes.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.header.file_len
    }

    /// Sum of all tensor sizes in bytes.
    #[must_use]
    pub fn tensor_bytes(&self) -> u64 {
        self.manifest.tensors.iter().map(|t| t.nbytes).sum()
    }

    /// All tensors in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = TensorView<'_>> {
        self.manifest.tensors.iter().map(|e| TensorView {
            entry: e,
            bytes: slice(&self.map, e.offset, e.nbytes),
        })
    }

    /// The tensor named `name`, if any.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors().find(|t| t.entry.name == name)
    }

    /// Like [`Snapshot::tensor`] but a typed error when absent.
    pub fn require(&self, name: &str) -> Result<TensorView<'_>> {
        self.tensor(name)
            .ok_or_else(|| Error::NoSuchTensor(name.to_owned()))
    }

    /// The raw bytes of a blob declared in the manifest (bounds checked at open).
    #[must_use]
    pub fn blob(&self, blob: &Blob) -> &[u8] {
        slice(&self.map, blob.offset, blob.nbytes)
    }

    /// The tokenizer JSON, checked against its digest.
    pub fn tokenizer_json(&self) -> Result<Option<&[u8]>> {
        let Some(t) = &self.manifest.tokenizer else {
            return Ok(None);
        };
        let bytes = self.blob(&t.blob);
        check("tokenizer", t.blob.checksum, bytes)?;
        Ok(Some(bytes))
    }

    /// The whole file as mapped (header included).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Passes a page-cache hint for the whole file to the kernel.
    pub fn advise(&self, hint: AccessHint) -> Result<()> {
        let advice = match hint {
            AccessHint::WillNeed => Advice::WillNeed,
            AccessHint::Sequential => Advice::Sequential,
            AccessHint::Random => Advice::Random,
        };
        self.map
            .advise(advice)
            .map_err(|e| Error::io(&self.path, e))
    }

    /// How much of the file is in page cache now.
    pub fn residency(&self) -> Result<crate::residency::Residency> {
        crate::residency::of_map(&self.map).map_err(|e| Error::io(&self.path, e))
    }

    /// Maps every page of the file into this process (reading it from disk where it is
    /// not in page cache), so the first forward pass takes no page faults.
    pub fn populate(&self) -> Result<()> {
        crate::residency::populate(&self.map).map_err(|e| Error::io(&self.path, e))
    }

    /// Recomputes every digest (tensors and blobs) on `threads` threads and returns
    /// the names of those that do not match, in file order. `Ok` with an empty list
    /// means the file is intact.
    pub fn verify(&self, threads: usize) -> Result<VerifyReport> {
        let mut items: Vec<(String, Blob)> = Vec::new();
        if let Some(t) = &self.manifest.tokenizer {
            items.push(("tokenizer".into(), t.blob));
        }
        for k in &self.manifest.kernel_cache {
            items.push((format!("kernel cache {}", k.key), k.blob));
        }
        if let Some(w) = &self.manifest.warmup_plan {
            items.push(("warm-up plan".into(), *w));
        }
        for t in &self.manifest.tensors {
            items.push((
                t.name.clone(),
                Blob {
                    offset: t.offset,
                    nbytes: t.nbytes,
                    checksum: t.checksum,
                },
            ));
        }
        let bytes: u64 = items.iter().map(|(_, b)| b.nbytes).sum();
        // Work-stealing over items, largest first, so one huge embedding does not
        // leave the other threads idle at the end.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(items[i].1.nbytes));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let bad = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..threads.max(1) {
                s.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&i) = order.get(k) else { break };
                        let (name, b) = &items[i];
                        let actual = Checksum::of(self.blob(b));
                        if actual != b.checksum {
                            bad.lock().expect("no panics while held").push((
                                i,
                                Mismatch {
                                    name: name.clone(),
                                    offset: b.offset,
                                    nbytes: b.nbytes,
                                    expected: b.checksum,
                                    actual,
                                },
                            ));
                        }
                    }
                });
            }
        });
        let mut bad = bad.into_inner().expect("no panics while held");
        bad.sort_by_key(|(i, _)| *i);
        Ok(VerifyReport {
            items: items.len(),
            bytes,
            mismatches: bad.into_iter().map(|(_, m)| m).collect(),
        })
    }
}

/// Outcome of [`Snapshot::verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    pub items: usize,
    pub bytes: u64,
    pub mismatches: Vec<Mismatch>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub name: String,
    /// Where the corrupt item lies in the file.
    pub offset: u64,
    pub nbytes: u64,
    pub expected: Checksum,
    pub actual: Checksum,
}

impl VerifyReport {
    /// `Err` naming the first corrupt item, for callers that only need pass/fail.
    pub fn into_result(self) -> Result<Self> {
        match self.mismatches.first() {
            None => Ok(self),
            Some(m) => Err(Error::ChecksumMismatch {
                what: m.name.clone(),
                expected: m.expected.to_string(),
                actual: m.actual.to_string(),
            }),
        }
    }
}

/// A zero-copy view of one tensor inside the mapping.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub entry: &'a TensorEntry,
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    #[must_use]
    pub fn name(&self) -> &'a str {
        &self.entry.name
    }

    /// The tensor's raw little-endian bytes.
    #[must_use]
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    #[must_use]
    pub fn dtype(&self) -> DType {
        self.entry.dtype()
    }
    #[must_use]
    pub fn shape(&self) -> &'a [u64] {
        &self.entry.shape
    }

    fn typed<T: bytemuck::AnyBitPattern>(&self, want: DType) -> Result<&'a [T]> {
        if self.dtype() != want {
            return Err(Error::DtypeMismatch {
                name: self.entry.name.clone(),
                actual: self.dtype(),
                requested: want,
            });
        }
        // Offsets are page-aligned in a page-aligned mapping, so this cannot fail for a
        // validated snapshot; keep the error path rather than assume it.
        bytemuck::try_cast_slice(self.bytes).map_err(|e| Error::OutOfBounds {
            what: format!("tensor {} cannot be viewed as {want}: {e}", self.entry.name),
        })
    }

    /// The tensor as `f32` elements, without copying.
    pub fn as_f32(&self) -> Result<&'a [f32]> {
        self.typed(DType::F32)
    }
    /// The tensor as IEEE half elements, without copying.
    pub fn as_f16(&self) -> Result<&'a [f16]> {
        self.typed(DType::F16)
    }
    /// The tensor as bfloat16 elements, without copying.
    pub fn as_bf16(&self) -> Result<&'a [bf16]> {
        self.typed(DType::BF16)
    }

    /// A widened copy, whatever the stored dtype.
    #[must_use]
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.bytes.len() / self.dtype().size()];
        crate::dtype::read_f32(self.bytes, self.dtype(), &mut out);
        out
    }
}

fn slice(map: &[u8], offset: u64, nbytes: u64) -> &[u8] {
    // Bounds were validated at open; usize conversion cannot truncate on 64-bit.
    &map[offset as usize..(offset + nbytes) as usize]
}

fn check(what: &str, expected: Checksum, bytes: &[u8]) -> Result<()> {
    let actual = Checksum::of(bytes);
    if actual == expected {
        Ok(())
    } else {
        Err(Error::ChecksumMismatch {
            what: what.to_owned(),
            expected: expected.to_string(),
            actual: actual.to_string(),
        })
    }
}

fn short_header(len: u64) -> Error {
    Error::Truncated {
        what: "header".into(),
        needed: HEADER_LEN as u64,
        actual: len,
    }
}

/// Validates a complete snapshot image held in memory: header, manifest digest and
/// JSON, dtypes, shapes, alignment, bounds, overlaps and duplicate names. This is the
/// function the fuzz target drives.
pub fn parse(bytes: &[u8]) -> Result<(Header, Manifest)> {
    parse_prefix(bytes, bytes.len() as u64)
}

/// Like [`parse`], from the first bytes of a file of `file_len` bytes: enough for a
/// fetcher to plan a download from the header and manifest alone. `prefix` must hold
/// at least the header and the manifest (`64 + manifest_len` bytes).
pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<(Header, Manifest)> {
    let bytes = prefix;
    let header = Header::decode(bytes, file_len)?;
    let m_start = header.manifest_offset as usize;
    let m_end = (header.manifest_offset + header.manifest_len) as usize;
    let m_bytes = bytes.get(m_start..m_end).ok_or(Error::Truncated {
        what: "manifest".into(),
        needed: m_end as u64,
        actual: bytes.len() as u64,
    })?;
    check("manifest", header.manifest_checksum, m_bytes)?;
    let manifest: Manifest = serde_json::from_slice(m_bytes)
        .map_err(|e| Error::InvalidManifest(format!("manifest JSON: {e}")))?;
    validate_manifest(&manifest, &header)?;
    Ok((header, manifest))
}

fn validate_manifest(m: &Manifest, h: &Header) -> Result<()> {
    if m.format_version != h.version {
        return Err(Error::InvalidManifest(format!(
            "manifest format_version {} differs from header version {}",
            m.format_version, h.version
        )));
    }
    let mut names = HashSet::with_capacity(m.tensors.len());
    for t in &m.tensors {
        let dtype = DType::parse(&t.dtype, &format!("tensor {}", t.name))?;
        if !names.insert(t.name.as_str()) {
            return Err(Error::InvalidManifest(format!(
                "tensor {:?} appears twice",
                t.name
            )));
        }
        let expect = t
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size() as u64));
        if expect != Some(t.nbytes) {
            return Err(Error::InvalidManifest(format!(
                "tensor {}: shape {:?} of {dtype} does not make {} bytes",
                t.name, t.shape, t.nbytes
            )));
        }
    }
    let mut regions = m.regions();
    for (what, off, n) in &regions {
        if off % ALIGN != 0 {
            return Err(Error::OutOfBounds {
                what: format!("{what} at offset {off} is not {ALIGN}-aligned"),
            });
        }
        let end = off.checked_add(*n);
        if *off < h.data_offset || end.is_none_or(|e| e > h.file_len) {
            return Err(Error::OutOfBounds {
                what: format!(
                    "{what} spans {off}+{n}, outside the data region {}..{}",
                    h.data_offset, h.file_len
                ),
            });
        }
    }
    regions.sort_by_key(|r| r.1);
    for w in regions.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a.1 + a.2 > b.1 {
            return Err(Error::OutOfBounds {
                what: format!("{} overlaps {}", a.0, b.0),
            });
        }
    }
    m.model.validate()?;
    Ok(())
}
