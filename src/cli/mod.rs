//! Command-line flags as clap parses them. Validation into typed options happens in
//! `commands`, so every subcommand's raw flags are readable in one place.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use preheat_flags::{duration_arg, seconds_arg};

mod engine;

pub use self::engine::*;
pub use preheat_bench::BenchCmd;
pub use preheat_flags::OutputArgs;
pub use preheat_local::UpArgs;

#[derive(Debug, Parser)]
#[command(
    name = "preheat",
    version,
    about = "Autoscaler and cold-start accelerator for disaggregated LLM serving",
    long_about = "preheat sizes the prefill and decode pools of a disaggregated LLM deployment \
independently and makes new replicas serve their first token in seconds.\n\n\
Logs go to stderr (filter with RUST_LOG, e.g. RUST_LOG=debug); results go to stdout, \
as JSON with --json where a tool would parse them."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// The whole stack on this machine: gateway, prefill and decode pools as worker
    /// processes, the scaler (KEDA gRPC open) and a local replica driver that scales
    /// the pools from zero and back.
    Up(UpArgs),
    /// Model snapshots: convert, inspect, verify, pack and unpack the loading-optimised format.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// The bundled engine: serve a model over the OpenAI API.
    #[command(subcommand)]
    Engine(EngineCmd),
    /// The KEDA external scaler: sizes prefill and decode pools from their metrics.
    #[command(subcommand)]
    Scaler(ScalerCmd),
    /// The warm-pool node agent: stage snapshots onto local disk, keep them hot, keep
    /// parked standbys.
    #[command(subcommand)]
    Warmpool(WarmpoolCmd),
    /// What the scaler decided for each pool and why, against the SLOs, and what each
    /// node has staged and hot: read from the scaler and the warm-pool agents.
    Status(StatusArgs),
    /// Replay a request trace against autoscaling policies in a discrete-event simulation.
    Simulate(SimulateArgs),
    /// Make request traces for the simulator.
    #[command(subcommand)]
    Trace(TraceCmd),
    /// Benchmarks that record the figures in BENCHMARKS.md.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Debug, Subcommand)]
pub enum WarmpoolCmd {
    /// Run the agent (a DaemonSet in Kubernetes) from a YAML config.
    Run {
        #[arg(long)]
        config: PathBuf,
        /// Where peers reach this node's standbys (overrides the config's
        /// `advertise_host`; in Kubernetes the pod IP, `$(POD_IP)`).
        #[arg(long)]
        advertise_host: Option<String>,
        /// Address of the agent's API (overrides the config's `listen`; in Kubernetes
        /// `$(POD_IP):PORT`, never every interface).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        #[command(flatten)]
        token: ClusterTokenArgs,
        #[command(flatten)]
        open: NoTokenArg,
    },
    /// Give the node's cache directories (created when missing) to the user the agent
    /// and workers run as: the chart's one root step, with only CAP_CHOWN.
    Own {
        /// Directories, chowned recursively (links themselves, never their targets).
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long, default_value_t = 65532)]
        uid: u32,
        #[arg(long, default_value_t = 65532)]
        gid: u32,
    },
    /// Stage one snapshot into a directory: parallel, resumable, verified, published
    /// atomically. Exit 0 only when a verified snapshot is in place.
    Stage {
        /// A path or http(s) URL of a snapshot or packed snapshot (or
        /// `$PREHEAT_MODEL_SOURCE`, so a URL with credentials stays out of argv).
        #[arg(long, env = "PREHEAT_MODEL_SOURCE", hide_env_values = true)]
        source: String,
        #[arg(long)]
        dir: PathBuf,
        /// Model name (file name `<name>.preheat`); default: the source's file name.
        #[arg(long)]
        name: Option<String>,
        /// Ranges fetched at once.
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Range size for plain snapshots, MiB.
        #[arg(long, default_value_t = 8)]
        piece_mib: u64,
        /// The node's disk budget for snapshots (e.g. `200GiB`), as its warm-pool agent
        /// keeps it: staging makes room by evicting the least recently wanted snapshot
        /// no replica maps, and records this model as wanted. Without it, the model is
        /// staged whatever else the directory holds.
        #[arg(long)]
        disk_budget: Option<String>,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The scaler's HTTP endpoint (`preheat up --scaler-http`, the chart's `scaler.httpPort`).
    #[arg(long, default_value = "http://127.0.0.1:9091", conflicts_with = "kube")]
    pub scaler: String,
    /// A warm-pool agent's API (repeat for each node).
    #[arg(long, conflicts_with = "kube")]
    pub agent: Vec<String>,
    #[command(flatten)]
    pub token: ClusterTokenArgs,
    /// Find the scaler and the agents as the release's pods in a Kubernetes namespace
    /// (KUBECONFIG or in-cluster), and read the cluster token from the release's Secret
    /// unless --cluster-token-file is given.
    #[arg(long)]
    pub kube: bool,
    /// With --kube: the namespace (default: the kubeconfig's).
    #[arg(long, requires = "kube")]
    pub namespace: Option<String>,
    /// With --kube: the Helm release.
    #[arg(long, default_value = "preheat")]
    pub release: String,
    /// With --kube: the Secret holding the cluster token (default: the chart's,
    /// `<release>-preheat-cluster-token`).
    #[arg(long, requires = "kube")]
    pub token_secret: Option<String>,
    /// Refresh until interrupted (in place on a terminal).
    #[arg(long)]
    pub watch: bool,
    /// How often --watch refreshes.
    #[arg(long, default_value = "2s", value_parser = duration_arg)]
    pub interval: Duration,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSONL.
    #[arg(long)]
    pub trace: PathBuf,
    /// Policies to compare, comma-separated, or all. With `--fleet`: always-on,
    /// zero-cold, serverlessllm, preheat, clairvoyant.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub policy: Vec<PolicyFlag>,
    /// A fleet file (`FLEET.yaml`: models, nodes and their budgets, hardware): the
    /// trace is then a fleet's (Mooncake JSONL with a `model` per line), every model
    /// scaled on its own and every start timed by the tier its model finds on its node.
    #[arg(
        long,
        value_name = "FLEET.yaml",
        conflicts_with_all = ["frontier", "startup_s", "need_curve", "start", "standbys", "rate_scale"]
    )]
    pub fleet: Option<PathBuf>,
    /// Capacity profile JSON (`preheat engine profile`); default: the scaler config's
    /// `profile`, else the GPU-class profile.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Scaler YAML config whose first model's pool settings, tick, window and profile
    /// (unless `--profile`) the simulation uses (default: the scaler's shipped
    /// defaults); its other keys configure a deployment and are not read.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config value, as for `scaler run` (repeatable): the keys the
    /// simulation reads (the first model's pool policies, interval_s, window_s,
    /// profile), others refused; without `--config`, `models.0` is one model at the
    /// shipped defaults (`--set models.0.prefill.headroom=0.8`).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub overrides: Vec<String>,
    /// Prompts shorter than this many tokens are prefilled on the decode replica that
    /// serves them, as the gateway does with the same flag; 0 sends every prompt
    /// through the prefill pool.
    #[arg(long, default_value_t = preheat_engine::disagg::gateway::DEFAULT_DISAGG_MIN_TOKENS)]
    pub disagg_min_tokens: usize,
    /// TTFT target (`2`, `2s`, `1500ms`) for prompts up to the reference length; longer
    /// ones scale.
    #[arg(long, value_parser = seconds_arg)]
    pub slo_ttft: Option<f64>,
    /// Mean inter-token latency target (`50ms`, `0.05`).
    #[arg(long, value_parser = seconds_arg)]
    pub slo_itl: Option<f64>,
    /// How warm new replicas start: cold, staged, hot or standby (start-up time from
    /// the profile).
    #[arg(long, value_enum, default_value_t = StartFlag::Hot)]
    pub start: StartFlag,
    /// With `--start standby`: parked standbys kept per pool (their GPU time counts);
    /// scale-ups beyond them start hot.
    #[arg(long, default_value_t = 1)]
    pub standbys: u32,
    /// Replay each request K times (copies jittered within a second, prefixes renamed per
    /// copy), so the trace's shape loads a K-times larger fleet.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub rate_scale: u32,
    /// How preheat's decisions reach the pools: keda (HPA's sync period, tolerances and
    /// rate limits and KEDA's activation and cooldown, as the chart renders them) or
    /// direct (the replica count set at the scaler's tick, as in `preheat up`).
    #[arg(long, value_enum, default_value_t = ActuationFlag::Keda)]
    pub actuation: ActuationFlag,
    /// The wall clock at the trace's first second, Unix seconds (UTC), for the
    /// policy's scheduled floors (`schedule:` in the config); 0 is a Thursday midnight.
    #[arg(long, default_value_t = 0, value_name = "UNIX_SECONDS")]
    pub start_unix: i64,
    /// Sweep each policy's knob (preheat's headroom, HPA's target utilisation, KEDA's
    /// queue target, KPA's concurrency target, the SLA planner's headroom) and report
    /// every (SLO %, GPU-s) point, with the references.
    #[arg(long, conflicts_with = "startup_s")]
    pub frontier: bool,
    /// Rerun every policy with replicas starting in each of these times (`1,2,5,20s,2m`)
    /// and report attainment and GPU-seconds against start time.
    #[arg(long, value_delimiter = ',', value_parser = seconds_arg, value_name = "SECONDS")]
    pub startup_s: Vec<f64>,
    /// Instead of the policies: the fewest fixed replicas that hold a steady hour at
    /// 99% (`static-peak`'s search), at this many rates from the trace's quietest busy
    /// minute to its busiest (requests drawn from the trace), and what holding every
    /// minute at its rate's size would cost against `static-peak` on the trace.
    #[arg(
        long,
        value_name = "POINTS",
        value_parser = clap::value_parser!(u32).range(2..=64),
        conflicts_with_all = ["frontier", "startup_s", "policy", "actuation", "start", "standbys", "start_unix"]
    )]
    pub need_curve: Option<u32>,
    /// Write the full report (every policy, timelines; with `--frontier`, `--startup-s`
    /// or `--need-curve`, their points) as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot here: load and each policy's replicas over time (with
    /// `--frontier`, `--startup-s` or `--need-curve`, their points).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum TraceCmd {
    /// A day (or several) whose arrival rate swings between a night trough and an
    /// afternoon peak (non-homogeneous Poisson, seeded), with request sizes and prefix
    /// blocks drawn from a real trace; written as Mooncake JSONL.
    Day(TraceDayArgs),
    /// A serverless fleet's traffic from a single-model trace: many models, Zipf
    /// popularity, each alternating active stretches (the base trace from a random
    /// offset, thinned to its rate) and idle ones; Mooncake JSONL with a `model` field.
    Fleet(TraceFleetArgs),
}

#[derive(Debug, Args)]
pub struct TraceFleetArgs {
    /// The single-model trace whose arrivals, sizes and prefix blocks each model
    /// follows: Azure CSV or Mooncake JSONL.
    #[arg(long)]
    pub from: PathBuf,
    /// Where the fleet trace goes (Mooncake JSONL with `model`).
    #[arg(long, short)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 12)]
    pub models: usize,
    #[arg(long, default_value_t = 3.0)]
    pub hours: f64,
    /// Popularity's Zipf exponent: model i gets a share of the requests ∝ 1/(i+1)^s.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Mean length of a model's active stretch, seconds (idle ones are longer the
    /// less popular the model).
    #[arg(long, default_value_t = 1200.0)]
    pub active_mean_s: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct TraceDayArgs {
    /// The trace whose requests' sizes (and prefix blocks) are drawn: Azure CSV or
    /// Mooncake JSONL.
    #[arg(long)]
    pub from: PathBuf,
    /// Where the day goes (Mooncake JSONL).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Arrival rate at the peak, requests/s.
    #[arg(long, default_value_t = 20.0)]
    pub peak_rps: f64,
    /// Peak rate over trough rate.
    #[arg(long, default_value_t = 30.0)]
    pub swing: f64,
    /// Length in hours (the trace starts at midnight).
    #[arg(long, default_value_t = 24.0)]
    pub hours: f64,
    /// Hour of the peak; the trough is twelve hours away.
    #[arg(long, default_value_t = 14.0, conflicts_with = "office")]
    pub peak_hour: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Office hours (`8-18`, UTC) instead of a cosine: the peak rate while open, the
    /// trough otherwise, climbing and falling over `--ramp-s`.
    #[arg(long, value_name = "OPEN-CLOSE", value_parser = office_hours)]
    pub office: Option<(f64, f64)>,
    /// With --office: seconds from trough to peak at opening (and back at closing).
    #[arg(long, default_value_t = 120.0, requires = "office")]
    pub ramp_s: f64,
}

/// `8-18` or `8.5-17`: opening and closing hours.
fn office_hours(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected OPEN-CLOSE hours, e.g. 8-18"))?;
    let hour = |v: &str| {
        v.trim()
            .parse::<f64>()
            .map_err(|e| format!("{s:?}: {v:?} is not an hour ({e})"))
    };
    Ok((hour(a)?, hour(b)?))
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Convert a Hugging Face checkpoint directory or a GGUF file into a snapshot.
    Convert {
        /// HF directory (config.json + safetensors) or a .gguf file.
        src: PathBuf,
        /// Output snapshot file (written atomically).
        #[arg(short, long)]
        output: PathBuf,
        /// Stored dtype: keep the source's (quantised GGUF tensors become f32), or convert.
        #[arg(long, value_enum, default_value_t = DTypeFlag::Keep)]
        dtype: DTypeFlag,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Show a snapshot's model config and tensor table (no tensor data is read).
    Inspect {
        file: PathBuf,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Recompute every checksum; exits non-zero naming each corrupt tensor.
    Verify {
        file: PathBuf,
        /// Threads hashing in parallel (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Compress a snapshot into the chunked packed encoding for storage and transfer.
    Pack {
        file: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
        /// zstd level.
        #[arg(long, default_value_t = 3)]
        level: i32,
        /// Chunk size in MiB (each chunk decompresses independently).
        #[arg(long, default_value_t = 4)]
        chunk_mib: u64,
        /// Compress 16-bit tensors as they are, without the byte-plane split.
        #[arg(long)]
        no_byte_planes: bool,
        #[arg(long)]
        threads: Option<usize>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Decompress a packed snapshot; resumes an interrupted unpack from its partial file.
    Unpack {
        packed: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long)]
        threads: Option<usize>,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Write a synthetic snapshot of a real model shape with deterministic random weights.
    Synth {
        /// tiny (the llama-tiny fixture's shapes) or llama-1b (Llama-3.2-1B, ~1.24 B params).
        #[arg(long)]
        preset: String,
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, value_enum, default_value_t = DTypeFlag::Bf16)]
        dtype: DTypeFlag,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        out: OutputArgs,
    },
}

/// The deployment's cluster token, which every request between preheat's own
/// processes carries.
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterTokenArgs {
    /// File holding the cluster token (a mounted Secret; `preheat up` writes one per
    /// run). A process with an internal listener refuses to start without it.
    #[arg(long, env = "PREHEAT_CLUSTER_TOKEN_FILE")]
    pub cluster_token_file: Option<PathBuf>,
}

/// For processes that serve internal endpoints: leave them open instead of refusing to
/// start without a cluster token.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct NoTokenArg {
    /// Run without a cluster token: internal endpoints then accept anyone. Only for a
    /// machine no one else can reach.
    #[arg(long, env = "PREHEAT_INSECURE_NO_TOKEN")]
    pub insecure_no_token: bool,
}

impl ClusterTokenArgs {
    /// The token, read and checked.
    pub fn load(&self) -> anyhow::Result<Option<std::sync::Arc<preheat_edge::ClusterToken>>> {
        match &self.cluster_token_file {
            Some(p) => Ok(Some(std::sync::Arc::new(
                preheat_edge::ClusterToken::from_file(p)?,
            ))),
            None => Ok(None),
        }
    }

    /// The token, for a process that serves internal endpoints (`what`): refused
    /// without one, unless `--insecure-no-token` says so.
    pub fn require(
        &self,
        open: NoTokenArg,
        what: &str,
    ) -> anyhow::Result<Option<std::sync::Arc<preheat_edge::ClusterToken>>> {
        let t = self.load()?;
        if t.is_some() && open.insecure_no_token {
            anyhow::bail!(
                "--insecure-no-token ($PREHEAT_INSECURE_NO_TOKEN) and a cluster token file were both given: {what} takes one or the other"
            );
        }
        if t.is_none() && !open.insecure_no_token {
            anyhow::bail!(
                "{what} serves internal endpoints, which ask for the deployment's cluster token: give --cluster-token-file FILE or $PREHEAT_CLUSTER_TOKEN_FILE (make one with `openssl rand -hex 32 > FILE`; `preheat up` and the chart make their own), or --insecure-no-token on a machine no one else can reach"
            );
        }
        Ok(t)
    }
}

#[derive(Debug, Subcommand)]
pub enum ScalerCmd {
    /// Serve KEDA's ExternalScaler gRPC API and run the scrape-and-decide loop.
    Run {
        /// YAML config (pools, models, SLOs, endpoints, limits).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Override any config value: `--set models.0.decode.max_replicas=8` (repeatable).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        overrides: Vec<String>,
        /// Capacity profile JSON (default: the documented GPU-class profile).
        #[arg(long)]
        profile: Option<PathBuf>,
        #[command(flatten)]
        token: ClusterTokenArgs,
    },
}

/// Flags that take one of a few values: parsed by clap (which lists them in `--help`
/// and names the wrong one), then handed to the parts as their own types or names.
macro_rules! value_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
        pub enum $name {
            $(#[value(name = $s)] $variant),+
        }

        impl $name {
            /// The spelling on the command line.
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $s),+
                }
            }
        }
    };
}

value_enum!(
    /// `--device`.
    DeviceFlag { Auto => "auto", Cpu => "cpu", Cuda => "cuda" }
);
value_enum!(
    /// `snapshot convert|synth --dtype`.
    DTypeFlag { Keep => "keep", F32 => "f32", F16 => "f16", Bf16 => "bf16" }
);
value_enum!(
    /// `simulate --start`: how warm new replicas start.
    StartFlag { Cold => "cold", Staged => "staged", Hot => "hot", Standby => "standby" }
);
impl From<StartFlag> for preheat_sim::StartClass {
    fn from(f: StartFlag) -> Self {
        match f {
            StartFlag::Cold => Self::Cold,
            StartFlag::Staged => Self::Staged,
            StartFlag::Hot => Self::Hot,
            StartFlag::Standby => Self::Standby,
        }
    }
}
value_enum!(
    /// `simulate --actuation`.
    ActuationFlag { Keda => "keda", Direct => "direct" }
);
impl From<ActuationFlag> for preheat_sim::Actuation {
    fn from(f: ActuationFlag) -> Self {
        match f {
            ActuationFlag::Keda => Self::Keda,
            ActuationFlag::Direct => Self::Direct,
        }
    }
}
value_enum!(
    /// `simulate --policy` (the simulator's registries: `sim::autoscalers::POLICIES`,
    /// and with `--fleet`, `sim::fleet::FLEET_POLICIES`).
    PolicyFlag {
        All => "all",
        Preheat => "preheat",
        StaticPeak => "static-peak",
        Clairvoyant => "clairvoyant",
        HpaUtilization => "hpa-utilization",
        KedaQueue => "keda-queue",
        Kpa => "kpa",
        SlaPlanner => "sla-planner",
        AlwaysOn => "always-on",
        ZeroCold => "zero-cold",
        Serverlessllm => "serverlessllm",
    }
);

#[cfg(test)]
mod tests;
