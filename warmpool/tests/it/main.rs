//! preheat-warmpool's integration tests, one binary (one link) with a module per area;
//! `cargo test -p preheat-warmpool --test it AREA::` runs one area.

mod agent;
mod stage;
mod standby;
