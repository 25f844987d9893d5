//! The snapshot crate's own test fixtures (workspace-wide ones are in `preheat-testkit`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn test_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}
