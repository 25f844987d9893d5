//! preheat-scaler's integration tests, one binary (one link) with a module per area;
//! `cargo test -p preheat-scaler --test it AREA::` runs one area.

mod controller;
mod grpc;
mod grpcurl;
mod kube;
mod prometheus;
mod prometheus_server;
mod scrape;
mod tls;
