//! preheat-snapshot's integration tests, one binary (one link) with a module per area;
//! `cargo test -p preheat-snapshot --test it AREA::` runs one area.

mod common;
mod gguf;
mod hf;
mod malformed;
mod packed;
