//! The manifest: a JSON document right after the header that describes everything in
//! the file. Parsing it is the only parse an open does; tensor bytes are never touched.

use serde::{Deserialize, Serialize};

use crate::DType;
use crate::checksum::Checksum;
use crate::config::{GenerationDefaults, ModelConfig};

/// A byte range of the file with its digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blob {
    /// Absolute offset in the file, a multiple of [`crate::format::ALIGN`].
    pub offset: u64,
    pub nbytes: u64,
    pub checksum: Checksum,
}

/// One tensor: row-major (C order), little-endian, starting at an aligned offset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    /// Kept as a string so an unknown dtype is reported as such, naming the tensor,
    /// rather than as a generic JSON error.
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute offset in the file.
    pub offset: u64,
    pub nbytes: u64,
    pub checksum: Checksum,
}

impl TensorEntry {
    /// The element type (validated when the snapshot is opened).
    #[must_use]
    pub fn dtype(&self) -> DType {
        DType::parse(&self.dtype, &self.name).unwrap_or(DType::F32)
    }

    /// Number of elements.
    #[must_use]
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Tokenizer data: a `tokenizers`-loadable `tokenizer.json` stored as a blob.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSection {
    pub blob: Blob,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<String>,
    #[serde(default)]
    pub add_bos_token: bool,
}

/// A compiled-kernel image keyed by what it was built for (backend, GPU architecture,
/// driver). Filled by GPU backends; empty in CPU-only snapshots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelCacheEntry {
    pub key: String,
    pub blob: Blob,
}

/// Where the snapshot came from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// `hf`, `gguf` or `synthetic`.
    pub kind: String,
    /// Path, file name or preset.
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub model: ModelConfig,
    #[serde(default)]
    pub generation: GenerationDefaults,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// The template for chats that offer tools, where the model has one of its own
    /// (Hugging Face's named `tool_use` template: Hermes 2 Pro, Command R).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_use_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSection>,
    #[serde(default)]
    pub kernel_cache: Vec<KernelCacheEntry>,
    /// Warm-up plan (requests to replay after load); reserved, empty for now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_plan: Option<Blob>,
    #[serde(default)]
    pub source: SourceInfo,
    pub tensors: Vec<TensorEntry>,
}

impl Manifest {
    /// Every blob in the file with a name for error messages, tensors included.
    pub(crate) fn regions(&self) -> Vec<(String, u64, u64)> {
        let mut r = Vec::with_capacity(self.tensors.len() + 2);
        if let Some(t) = &self.tokenizer {
            r.push(("tokenizer".to_owned(), t.blob.offset, t.blob.nbytes));
        }
        for k in &self.kernel_cache {
            r.push((
                format!("kernel cache {}", k.key),
                k.blob.offset,
                k.blob.nbytes,
            ));
        }
        if let Some(w) = &self.warmup_plan {
            r.push(("warm-up plan".to_owned(), w.offset, w.nbytes));
        }
        for t in &self.tensors {
            r.push((format!("tensor {}", t.name), t.offset, t.nbytes));
        }
        r
    }
}
