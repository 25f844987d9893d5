//! Writing a snapshot: lay out the file, stream tensors in, then publish atomically.
//!
//! The file is built under a temporary name in the destination directory, fsynced and
//! renamed into place, and the directory is fsynced: a reader sees either no file or a
//! complete one, and a crash leaves at most a `.partial` temp file that never opens as
//! a snapshot (its header is written last).

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::checksum::{Checksum, Hasher};
use crate::config::{GenerationDefaults, ModelConfig};
use crate::format::{FORMAT_VERSION, HEADER_LEN, Header, align_up};
use crate::manifest::{Blob, Manifest, SourceInfo, TensorEntry, TokenizerSection};
use crate::progress::Progress;
use crate::{DType, Error, Result};

/// What a tensor will be: the writer needs every shape before the first byte is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn nbytes(&self) -> Result<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size() as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidSource(format!("tensor {} shape overflows", self.name)))
    }
}

/// Tokenizer to embed.
#[derive(Clone, Debug, Default)]
pub struct TokenizerData {
    /// `tokenizer.json` bytes, loadable by the `tokenizers` crate.
    pub json: Vec<u8>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub add_bos_token: bool,
}

/// Everything but the tensor bytes.
#[derive(Clone, Debug)]
#[must_use]
pub struct SnapshotBuilder {
    pub model: ModelConfig,
    pub generation: GenerationDefaults,
    pub chat_template: Option<String>,
    /// See [`crate::Manifest::tool_use_template`].
    pub tool_use_template: Option<String>,
    pub tokenizer: Option<TokenizerData>,
    pub source: SourceInfo,
    pub tensors: Vec<TensorSpec>,
}

/// What [`SnapshotBuilder::write`] produced.
#[derive(Clone, Debug)]
pub struct WriteSummary {
    pub path: PathBuf,
    pub file_len: u64,
    pub tensors: usize,
    pub tensor_bytes: u64,
}

impl SnapshotBuilder {
    pub fn new(model: ModelConfig, source: SourceInfo) -> Self {
        SnapshotBuilder {
            model,
            generation: GenerationDefaults::default(),
            chat_template: None,
            tool_use_template: None,
            tokenizer: None,
            source,
            tensors: Vec::new(),
        }
    }

    /// Writes the snapshot to `dest`. `fill(i, spec, buf)` must append exactly the
    /// bytes of tensor `i` (little-endian, `spec.dtype`) to the empty `buf`; tensors are
    /// requested in order, one at a time, so memory use is one tensor.
    pub fn write<F>(self, dest: &Path, mut fill: F, progress: &dyn Progress) -> Result<WriteSummary>
    where
        F: FnMut(usize, &TensorSpec, &mut Vec<u8>) -> Result<()>,
    {
        self.model.validate()?;
        let mut seen = std::collections::HashSet::new();
        for t in &self.tensors {
            if !seen.insert(&t.name) {
                return Err(Error::InvalidSource(format!("tensor {:?} twice", t.name)));
            }
        }
        let (mut manifest, header) = self.layout()?;
        if dest.file_name().is_none() {
            return Err(Error::InvalidSource(format!(
                "{} is not a file path",
                dest.display()
            )));
        }
        let (tmp, _) = crate::publish::temp_beside(dest)?;
        let io = |e| Error::io(tmp.path(), e);
        let file: &File = tmp.as_file();
        file.set_len(header.file_len).map_err(io)?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.seek(SeekFrom::Start(header.data_offset)).map_err(io)?;
        let mut pos = header.data_offset;
        let total: u64 = manifest.tensors.iter().map(|t| t.nbytes).sum();
        progress.start("writing", total);

        if let (Some(sec), Some(tok)) = (&mut manifest.tokenizer, &self.tokenizer) {
            seek_to(&mut w, &mut pos, sec.blob.offset).map_err(io)?;
            w.write_all(&tok.json).map_err(io)?;
            pos += tok.json.len() as u64;
            sec.blob.checksum = Checksum::of(&tok.json);
        }
        let mut buf = Vec::new();
        for (i, spec) in self.tensors.iter().enumerate() {
            buf.clear();
            fill(i, spec, &mut buf)?;
            let entry = &mut manifest.tensors[i];
            if buf.len() as u64 != entry.nbytes {
                return Err(Error::InvalidSource(format!(
                    "tensor {} produced {} bytes, expected {}",
                    spec.name,
                    buf.len(),
                    entry.nbytes
                )));
            }
            let mut h = Hasher::new();
            h.update(&buf);
            entry.checksum = h.finish();
            seek_to(&mut w, &mut pos, entry.offset).map_err(io)?;
            w.write_all(&buf).map_err(io)?;
            pos += entry.nbytes;
            progress.advance(entry.nbytes);
        }
        // Manifest and header last: until they are written the file has no magic.
        let json = serde_json::to_vec(&manifest)
            .map_err(|e| Error::InvalidManifest(format!("serialising: {e}")))?;
        if json.len() as u64 != header.manifest_len {
            return Err(Error::InvalidManifest(format!(
                "manifest changed size while writing ({} → {})",
                header.manifest_len,
                json.len()
            )));
        }
        let header = Header {
            manifest_checksum: Checksum::of(&json),
            ..header
        };
        w.seek(SeekFrom::Start(HEADER_LEN as u64)).map_err(io)?;
        w.write_all(&json).map_err(io)?;
        w.seek(SeekFrom::Start(0)).map_err(io)?;
        w.write_all(&header.encode()).map_err(io)?;
        w.flush().map_err(io)?;
        drop(w);
        crate::publish::publish_temp(tmp, dest)?;
        progress.finish();
        Ok(WriteSummary {
            path: dest.to_path_buf(),
            file_len: header.file_len,
            tensors: manifest.tensors.len(),
            tensor_bytes: total,
        })
    }

    /// Assigns offsets. The manifest's size depends on the offsets' digit counts and
    /// the offsets depend on where the manifest ends, so iterate to a fixed point.
    fn layout(&self) -> Result<(Manifest, Header)> {
        let mut manifest = Manifest {
            format_version: FORMAT_VERSION,
            model: self.model.clone(),
            generation: self.generation.clone(),
            chat_template: self.chat_template.clone(),
            tool_use_template: self.tool_use_template.clone(),
            tokenizer: self.tokenizer.as_ref().map(|t| TokenizerSection {
                blob: Blob {
                    offset: 0,
                    nbytes: t.json.len() as u64,
                    checksum: Checksum(0),
                },
                bos_token: t.bos_token.clone(),
                eos_token: t.eos_token.clone(),
                add_bos_token: t.add_bos_token,
            }),
            kernel_cache: Vec::new(),
            warmup_plan: None,
            source: self.source.clone(),
            tensors: Vec::with_capacity(self.tensors.len()),
        };
        for t in &self.tensors {
            manifest.tensors.push(TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype.as_str().to_owned(),
                shape: t.shape.clone(),
                offset: 0,
                nbytes: t.nbytes()?,
                checksum: Checksum(0),
            });
        }
        let overflow = || Error::InvalidSource("snapshot size overflows u64".into());
        let mut data_offset = 0u64;
        for _ in 0..16 {
            let json_len = serde_json::to_vec(&manifest)
                .map_err(|e| Error::InvalidManifest(format!("serialising: {e}")))?
                .len() as u64;
            let need = align_up(HEADER_LEN as u64 + json_len).ok_or_else(overflow)?;
            if need <= data_offset {
                let header = Header {
                    version: FORMAT_VERSION,
                    flags: 0,
                    manifest_offset: HEADER_LEN as u64,
                    manifest_len: json_len,
                    manifest_checksum: Checksum(0),
                    data_offset,
                    file_len: end_of(&manifest, data_offset),
                };
                return Ok((manifest, header));
            }
            data_offset = need;
            let mut pos = data_offset;
            if let Some(t) = &mut manifest.tokenizer {
                t.blob.offset = pos;
                pos = align_up(pos + t.blob.nbytes).ok_or_else(overflow)?;
            }
            for t in &mut manifest.tensors {
                t.offset = pos;
                pos = align_up(pos.checked_add(t.nbytes).ok_or_else(overflow)?)
                    .ok_or_else(overflow)?;
            }
        }
        Err(Error::InvalidManifest("layout did not converge".into()))
    }
}

fn end_of(m: &Manifest, data_offset: u64) -> u64 {
    m.regions()
        .iter()
        .map(|(_, o, n)| o + n)
        .max()
        .unwrap_or(data_offset)
        .max(data_offset)
}

fn seek_to<W: Write + Seek>(w: &mut W, pos: &mut u64, target: u64) -> std::io::Result<()> {
    if *pos != target {
        w.seek(SeekFrom::Start(target))?;
        *pos = target;
    }
    Ok(())
}
