//! Model sources a snapshot is converted from: Hugging Face checkpoint directories and
//! GGUF files. Both produce HF tensor names and layouts, so the engine knows one naming.

pub mod gguf;
pub mod hf;

use std::path::Path;

use crate::manifest::SourceInfo;
use crate::progress::Progress;
use crate::writer::{SnapshotBuilder, TensorSpec, WriteSummary};
use crate::{DType, Result};

/// Target dtype of a conversion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TargetDtype {
    /// Keep each tensor's dtype; quantised GGUF tensors become f32, the only dtype that
    /// holds their dequantised values exactly.
    #[default]
    Keep,
    To(DType),
}

impl std::str::FromStr for TargetDtype {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "keep" {
            Ok(TargetDtype::Keep)
        } else {
            DType::parse(s, "--dtype").map(TargetDtype::To)
        }
    }
}

/// A checkpoint that can be turned into a snapshot, one tensor at a time.
pub trait ModelSource {
    /// Config, tokenizer and tensor list (with target dtypes already resolved).
    fn builder(&self, target: TargetDtype) -> Result<SnapshotBuilder>;
    /// Appends tensor `spec` (found by name) converted to `spec.dtype` to `out`.
    fn read_tensor(&self, spec: &TensorSpec, out: &mut Vec<u8>) -> Result<()>;
}

/// Opens `src` as a HF directory or a `.gguf` file, whichever it is.
pub fn open(src: &Path) -> Result<Box<dyn ModelSource>> {
    if src.is_dir() {
        Ok(Box::new(hf::HfCheckpoint::open(src)?))
    } else {
        Ok(Box::new(gguf::GgufModel::open(src)?))
    }
}

/// Converts `src` (HF directory or GGUF file) to a snapshot at `dest`.
pub fn convert(
    src: &Path,
    dest: &Path,
    target: TargetDtype,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    let source = open(src)?;
    let builder = source.builder(target)?;
    builder.write(dest, |_, spec, out| source.read_tensor(spec, out), progress)
}

pub(crate) fn source_info(kind: &str, path: &Path) -> SourceInfo {
    SourceInfo {
        kind: kind.to_owned(),
        name: path.display().to_string(),
    }
}

/// Sort key that lays tensors out in the order a loader consumes them: embeddings,
/// then layer by layer (numerically, so layer 10 follows layer 9), then the head.
pub(crate) fn engine_order(name: &str) -> (u8, u64, String) {
    if name == "model.embed_tokens.weight" {
        (0, 0, String::new())
    } else if let Some(rest) = name.strip_prefix("model.layers.") {
        let (l, tail) = rest.split_once('.').unwrap_or((rest, ""));
        (1, l.parse().unwrap_or(u64::MAX), tail.to_owned())
    } else if name == "model.norm.weight" {
        (2, 0, String::new())
    } else {
        (3, 0, name.to_owned())
    }
}
