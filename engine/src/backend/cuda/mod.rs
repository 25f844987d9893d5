//! The GPU backend (feature `cuda`).

pub mod nvrtc;
