//! preheat-engine's integration tests, one binary (one link) with a module per area;
//! `cargo test -p preheat-engine --test it AREA::` runs one area.

mod api;
mod choices;
mod cuda_gpu;
mod cuda_nvrtc;
mod disagg_worker;
mod gateway_counts;
mod gateway_models;
mod gateway_room;
mod gateway_routing;
mod reference;
mod regressions;
mod server;
mod structured;
mod text;
mod tools;
mod transfer;
