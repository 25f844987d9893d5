//! Typed errors of the snapshot crate. Every failure a caller can act on has its own
//! variant; input problems never panic.

use std::path::PathBuf;

/// Errors from opening, verifying, writing, converting and packing snapshots.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a preheat snapshot (bad magic {found:02x?})")]
    BadMagic { found: Vec<u8> },
    #[error("unsupported snapshot format version {found} (this build reads {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("truncated: {what} needs {needed} bytes, file has {actual}")]
    Truncated {
        what: String,
        needed: u64,
        actual: u64,
    },
    #[error("out of bounds: {what}")]
    OutOfBounds { what: String },
    #[error("unknown dtype {dtype:?} for {what}")]
    UnknownDtype { dtype: String, what: String },
    #[error("checksum mismatch in {what}: expected {expected}, computed {actual}")]
    ChecksumMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error("invalid manifest: {0}")]
    InvalidManifest(String),
    #[error("invalid model config: {}", .0.join("; "))]
    InvalidConfig(Vec<String>),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid source: {0}")]
    InvalidSource(String),
    #[error("invalid GGUF: {0}")]
    InvalidGguf(String),
    #[error("invalid packed file: {0}")]
    InvalidPacked(String),
    #[error("no tensor named {0:?}")]
    NoSuchTensor(String),
    #[error("tensor {name:?} is {actual}, not {requested}")]
    DtypeMismatch {
        name: String,
        actual: crate::DType,
        requested: crate::DType,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of the snapshot crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
