//! Opening a model from whatever the operator points at: a `.preheat` snapshot is
//! mapped as is; a Hugging Face directory or a GGUF file is converted first into an
//! unlinked temporary snapshot (so it is mapped the same way and vanishes on exit).

use std::path::Path;
use std::sync::Arc;

use preheat_snapshot::{NoProgress, Snapshot, TargetDtype};

use crate::Result;

/// How the model was obtained, for start-up metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Snapshot,
    Converted,
}

impl ModelSource {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ModelSource::Snapshot => "staged",
            ModelSource::Converted => "convert",
        }
    }
}

/// Opens `path` as a snapshot, converting HF directories and GGUF files on the way.
pub fn open_model(path: &Path) -> Result<(Arc<Snapshot>, ModelSource)> {
    // A file that opens as a snapshot is served as is (opened once); anything else
    // (HF directory, GGUF) is converted.
    if path.is_file()
        && let Ok(snap) = Snapshot::open(path)
    {
        return Ok((Arc::new(snap), ModelSource::Snapshot));
    }
    // A private directory per conversion: concurrent loads never share a path.
    let dir = tempfile::Builder::new()
        .prefix("preheat-model-")
        .tempdir()
        .map_err(|e| crate::EngineError::Model(format!("temporary directory: {e}")))?;
    let tmp = dir.path().join("model.preheat");
    tracing::info!(src = %path.display(), "converting model to a temporary snapshot");
    preheat_snapshot::convert(path, &tmp, TargetDtype::Keep, &NoProgress)?;
    // The mapping keeps the data alive once the directory is removed on drop.
    let snap = Snapshot::open(&tmp)?;
    Ok((Arc::new(snap), ModelSource::Converted))
}
