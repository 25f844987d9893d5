//! `preheat up`'s flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use preheat_flags::{duration_arg, seconds_arg};

#[derive(Debug, Args)]
pub struct UpArgs {
    /// A model to serve, `[NAME=]PATH`: a .preheat snapshot, HF checkpoint directory
    /// or .gguf (staged once as a snapshot). Repeat it for several models, each
    /// answering under its name with its own pools, to zero on its own. NAME defaults
    /// to the file's stem made a DNS label (`SmolLM2-135M-Instruct.Q4_1.gguf` →
    /// `smollm2-135m-instruct-q4-1`). Default: an embedded synthetic tiny model,
    /// `default`, that works offline.
    #[arg(long, value_name = "[NAME=]PATH")]
    pub model: Vec<String>,
    /// A chat template rendered instead of the model's own (the gateway renders every
    /// chat), e.g. `testdata/chat_templates/smollm2_hermes_tools.jinja` for tools.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Where workers register with the gateway (internal, behind this run's cluster
    /// token; default: a free loopback port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub gateway_internal: String,
    /// The scaler's KEDA external-scaler gRPC address.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub scaler_listen: String,
    /// The scaler's HTTP endpoint: `/metrics`, and `/status` for `preheat status`.
    #[arg(long, default_value = "127.0.0.1:9091")]
    pub scaler_http: String,
    /// The warm-pool agent's API (`/models`, `/standbys`, `/metrics`).
    #[arg(long, default_value = "127.0.0.1:9092")]
    pub agent_listen: String,
    /// Idle time before a pool goes to zero (e.g. 90s, 5m).
    #[arg(long, default_value = "60s", value_parser = duration_arg)]
    pub idle_grace: Duration,
    #[arg(long, default_value_t = 0)]
    pub prefill_min: u32,
    #[arg(long, default_value_t = 2)]
    pub prefill_max: u32,
    #[arg(long, default_value_t = 0)]
    pub decode_min: u32,
    #[arg(long, default_value_t = 2)]
    pub decode_max: u32,
    /// KV-cache budget per worker, MiB.
    #[arg(long, default_value_t = 256)]
    pub kv_cache_mib: usize,
    /// TTFT target the scaler sizes prefill for (`2`, `2s`, `1500ms`).
    #[arg(long, default_value = "2s", value_parser = seconds_arg)]
    pub slo_ttft: f64,
    /// Inter-token latency target the scaler sizes decode for (`50ms`, `0.05`).
    #[arg(long, default_value = "50ms", value_parser = seconds_arg)]
    pub slo_itl: f64,
    /// Staged snapshots, the measured profile and worker logs.
    #[arg(long, default_value = ".cache/up")]
    pub cache_dir: PathBuf,
    /// The scaler's state file: each pool's learnt season, resumed at the next start
    /// [default: <cache-dir>/scaler-state.json].
    #[arg(long)]
    pub state_file: Option<PathBuf>,
    /// Parked standby workers kept per pool (loaded, not registered); a scale-up
    /// promotes them first.
    #[arg(long, default_value_t = 1)]
    pub standbys: u32,
    /// Set a pool's policy key in the scaler config `up` runs, as `scaler run --set`
    /// does (repeatable): `models.0.prefill.schedule=[{cron: "0 8 * * 1-5",
    /// duration_s: 36000, min_replicas: 1}]`, `models.0.decode.headroom=1.2`. Only
    /// the pools' policy keys: addresses, sources and the model come from `up` itself.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub overrides: Vec<String>,
}
