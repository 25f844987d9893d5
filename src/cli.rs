//! Command-line flags as clap parses them. Validation into typed options happens in
//! `commands`, so every subcommand's raw flags are readable in one place.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration::duration_arg;

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
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// A .preheat snapshot, HF checkpoint directory or .gguf (staged once as a
    /// snapshot); default: an embedded synthetic tiny model that works offline.
    #[arg(long)]
    pub model: Option<PathBuf>,
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
    /// TTFT target in seconds the scaler sizes prefill for.
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft: f64,
    /// Inter-token latency target in seconds the scaler sizes decode for.
    #[arg(long, default_value_t = 0.05)]
    pub slo_itl: f64,
    /// Staged snapshots, the measured profile and worker logs.
    #[arg(long, default_value = ".cache/up")]
    pub cache_dir: PathBuf,
    /// Parked standby workers kept per pool (loaded, not registered); a scale-up
    /// promotes them first.
    #[arg(long, default_value_t = 1)]
    pub standbys: u32,
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

impl BenchScalerArgs {
    /// `--interval`, or the old `--interval-ms`.
    #[must_use]
    pub fn poll_interval(&self) -> Duration {
        self.interval_ms
            .map_or(self.interval, Duration::from_millis)
    }
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSONL.
    #[arg(long)]
    pub trace: PathBuf,
    /// Policies to compare, comma-separated, or all.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub policy: Vec<PolicyFlag>,
    /// Capacity profile JSON (`preheat engine profile`); default: the GPU-class profile.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Scaler YAML config whose first model's pool settings the simulation uses
    /// (default: the scaler's shipped defaults).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config value, as for `scaler run` (repeatable).
    #[arg(long = "set", value_name = "PATH=VALUE")]
    pub overrides: Vec<String>,
    /// TTFT target in seconds (prompts up to the reference length; longer ones scale).
    #[arg(long)]
    pub slo_ttft: Option<f64>,
    /// Mean inter-token latency target in seconds.
    #[arg(long)]
    pub slo_itl: Option<f64>,
    /// How warm new replicas start: cold, staged, hot or standby (start-up time from
    /// the profile).
    #[arg(long, value_enum, default_value_t = StartFlag::Hot)]
    pub start: StartFlag,
    /// With `--start standby`: parked standbys kept per pool (their GPU time counts);
    /// scale-ups beyond them start hot.
    #[arg(long, default_value_t = 1)]
    pub standbys: u32,
    /// Write the full report (every policy, timelines) as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an SVG plot of load and each policy's replicas over time here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
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

#[derive(Debug, Subcommand)]
pub enum EngineCmd {
    /// Serve a model (snapshot, HF directory or GGUF) with prefill and decode in one process.
    Serve(ServeArgs),
    /// The disaggregated front: the OpenAI API and the KV-aware router; workers register
    /// with it.
    Gateway(GatewayArgs),
    /// A prefill worker: computes prompts' K/V and first tokens for decode workers.
    Prefill(WorkerArgs),
    /// A decode worker: takes prefilled sequences and decodes them.
    Decode(WorkerArgs),
    /// Measure one replica's capacity (prefill tokens/s by prompt length, ITL by batch)
    /// on this machine and write the scaler's profile JSON.
    Profile {
        #[arg(long)]
        model: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
        /// Prompt lengths to time prefill at.
        #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
        lengths: Vec<usize>,
        /// Batch sizes to time decode at.
        #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
        batches: Vec<usize>,
        /// Decode steps timed per batch size.
        #[arg(long, default_value_t = 4)]
        steps: usize,
        /// KV-cache budget in MiB (sets the profile's KV capacity).
        #[arg(long, default_value_t = 512)]
        kv_cache_mib: usize,
    },
}

#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// The served model, read for its manifest and tokenizer only (no weights): a
    /// snapshot or packed snapshot as a path or http(s) URL (Range reads), or a
    /// Hugging Face directory or .gguf file (converted, as workers do). With it the
    /// gateway is ready at once and holds requests while both pools are at zero;
    /// without it, the first worker to register sets the model. Also
    /// `$PREHEAT_MODEL_SOURCE`, so a URL with credentials stays out of argv.
    #[arg(long, env = "PREHEAT_MODEL_SOURCE", hide_env_values = true)]
    pub model: Option<String>,
    /// Name clients use in the `model` field (default: the file name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tokens per KV block, as the workers are started with.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Port of worker registration (only where workers register; default --port + 1),
    /// on --host, behind the cluster token. The OpenAI port answers 404 to /internal/.
    #[arg(long)]
    pub internal_port: Option<u16>,
    #[command(flatten)]
    pub token: ClusterTokenArgs,
    #[command(flatten)]
    pub open: NoTokenArg,
    /// Clients' API keys, one per line (reloaded when the file changes): `/v1/*` then
    /// asks for `Authorization: Bearer <key>`.
    #[arg(long, env = "PREHEAT_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// How long a request waits for a decode worker when none is registered; then
    /// 503 with Retry-After.
    #[arg(long, alias = "hold-timeout-secs", default_value = "300s", value_parser = duration_arg)]
    pub hold_timeout: Duration,
    /// How long SIGTERM waits for in-flight (and held) requests before exiting.
    #[arg(long, alias = "drain-grace-secs", default_value = "30s", value_parser = duration_arg)]
    pub drain_grace: Duration,
    /// Kubernetes: find the workers as the Ready endpoints of these Services' pods
    /// (EndpointSlices in --discover-namespace) instead of taking registrations; every
    /// gateway replica sees the same workers. Needs --model.
    #[arg(long, requires_all = ["prefill_service", "decode_service", "model"])]
    pub discover_namespace: Option<String>,
    /// The prefill pool's Service (with --discover-namespace).
    #[arg(long, requires = "discover_namespace")]
    pub prefill_service: Option<String>,
    /// The decode pool's Service (with --discover-namespace).
    #[arg(long, requires = "discover_namespace")]
    pub decode_service: Option<String>,
    /// The warm-pool agents' Service (with --discover-namespace): each Ready agent's
    /// promoted standbys (`GET /standbys`, reached at the agent's own address) join
    /// their pools.
    #[arg(long, requires = "discover_namespace")]
    pub standby_agents_service: Option<String>,
    /// Kubernetes API base URL (default: the in-cluster service account, else the local
    /// kubeconfig).
    #[arg(long, requires = "discover_namespace")]
    pub kube_api_url: Option<String>,
    /// Prompts shorter than this are prefilled on the decode worker itself.
    #[arg(long, default_value_t = 32)]
    pub disagg_min_tokens: usize,
    /// Time without a heartbeat before a worker is dropped.
    #[arg(long, alias = "worker-timeout-secs", default_value = "3s", value_parser = duration_arg)]
    pub worker_timeout: Duration,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Gateway base URL to register with. Omit where the gateway discovers its workers
    /// (Kubernetes: the pools' EndpointSlices); the worker then only serves.
    #[arg(long)]
    pub gateway: Option<String>,
    /// URL the gateway and other workers use to reach this one (default:
    /// http://HOST:PORT).
    #[arg(long)]
    pub advertise: Option<String>,
    /// How long a decode worker waits for a prefill worker's K/V, its blocks reserved;
    /// then they are released and the gateway retries elsewhere or prefills on the
    /// decode worker.
    #[arg(long, alias = "transfer-timeout-secs", default_value = "60s", value_parser = duration_arg)]
    pub transfer_timeout: Duration,
    /// Prefill workers: port of the TCP KV transport (default: --port + 1).
    #[arg(long)]
    pub kv_port: Option<u16>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A .preheat snapshot, a Hugging Face checkpoint directory, or a .gguf file.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients use in the `model` field (default: the file or directory name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// KV-cache memory budget in MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_mib: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 256)]
    pub max_batched_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Queued requests beyond which new ones get 429.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// How long SIGTERM waits for in-flight requests before exiting.
    #[arg(long, alias = "drain-grace-secs", default_value = "30s", value_parser = duration_arg)]
    pub drain_grace: Duration,
    /// Load, page in and park without serving (workers: without registering) until
    /// `POST /internal/promote`.
    #[arg(long)]
    pub standby: bool,
    /// Where the model runs: auto (the GPU when built with `--features cuda` and a
    /// driver and device are present, else the CPU), cpu, or cuda (the GPU or fail).
    #[arg(long, value_enum, default_value_t = DeviceFlag::Auto)]
    pub device: DeviceFlag,
    /// Directory of compiled GPU kernels kept across restarts (the warm-pool agent's
    /// kernel cache on the node).
    #[arg(long, env = "PREHEAT_KERNEL_CACHE")]
    pub kernel_cache: Option<PathBuf>,
    #[command(flatten)]
    pub token: ClusterTokenArgs,
    #[command(flatten)]
    pub open: NoTokenArg,
    /// `engine serve`: clients' API keys, one per line (reloaded when the file
    /// changes); `/v1/*` then asks for `Authorization: Bearer <key>`.
    #[arg(long, env = "PREHEAT_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// `engine serve --standby`: port of the control routes (`/internal/state`,
    /// `/internal/promote`, behind the cluster token); without it promote with SIGUSR1.
    #[arg(long)]
    pub internal_port: Option<u16>,
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

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// Snapshot load, verify and packed-encoding throughput against same-run baselines.
    Snapshot(BenchSnapshotArgs),
    /// Engine decode/prefill/batching throughput against same-run baselines.
    Engine(BenchEngineArgs),
    /// KEDA GetMetrics latency at 1,000 ScaledObjects and scrape-and-decide at 1,000 pods.
    Scaler(BenchScalerArgs),
    /// Load generator: replay a trace or a fixed rate against an OpenAI endpoint and
    /// report TTFT, ITL, end-to-end latency, throughput and SLO attainment (exit 1 when
    /// any request failed).
    Serve(BenchServeArgs),
    /// Prefix-cache hit rate of KV-aware routing vs round robin on a trace with prefix
    /// block ids (Mooncake).
    Router(BenchRouterArgs),
    /// KV transfer throughput (pulled and checked as a decode worker does) vs raw
    /// loopback TCP in the same run.
    Kv(BenchKvArgs),
    /// Replica start to first token from an HF checkpoint over HTTP, a staged snapshot
    /// (cold page cache), a hot one and a parked standby, against a page-cache read.
    Coldstart(BenchColdstartArgs),
    /// A GPU replica's start phases (needs `--features cuda` and a GPU): weights upload
    /// vs the host-to-device copy limit, NVRTC compile vs kernel-cache restore, graphs.
    Gpu(BenchGpuArgs),
}

#[derive(Debug, Args)]
pub struct BenchGpuArgs {
    /// A synthetic preset (`llama-1b`, `tiny`), a .gguf, an HF directory or a .preheat.
    #[arg(long, default_value = "llama-1b")]
    pub model: String,
    /// Where a converted or synthetic snapshot is kept between runs.
    #[arg(long, default_value = ".cache/bench-coldstart")]
    pub work_dir: PathBuf,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchKvArgs {
    /// Prompt tokens whose K/V are moved.
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    #[arg(long, default_value_t = 16)]
    pub layers: usize,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchColdstartArgs {
    /// A synthetic preset (`llama-1b`, `tiny`), a .gguf, an HF directory or a .preheat.
    #[arg(long, default_value = "llama-1b")]
    pub model: String,
    /// Where the snapshot, the exported checkpoint and downloads go (kept between runs).
    #[arg(long, default_value = ".cache/bench-coldstart")]
    pub work_dir: PathBuf,
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// How the replicas start, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "convert,staged,hot,standby"
    )]
    pub sources: Vec<SourceFlag>,
    #[arg(long, default_value_t = 64)]
    pub kv_cache_mib: usize,
    /// Write the phase breakdown per source as an SVG chart.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchRouterArgs {
    #[arg(long)]
    pub trace: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Prefix-cache capacity per worker in 512-token blocks (default: the GPU-class
    /// profile's 450k KV tokens).
    #[arg(long, default_value_t = 878)]
    pub cache_blocks: usize,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// Base URL of the OpenAI-compatible server (`/v1/completions` is appended).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// `model` field of each request (default: the server's only model).
    #[arg(long)]
    pub model: Option<String>,
    /// Replay this trace (Azure CSV or Mooncake JSONL) instead of a fixed rate.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Trace time compression (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Send at most this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Multiply trace token counts (shrink long prompts for small CPU models).
    #[arg(long, default_value_t = 1.0)]
    pub token_scale: f64,
    #[arg(long, default_value_t = 4096)]
    pub max_input_tokens: u32,
    #[arg(long, default_value_t = 1024)]
    pub max_output_tokens: u32,
    /// Without --trace: requests per second …
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// … how many …
    #[arg(long, default_value_t = 10)]
    pub requests: usize,
    /// … and their prompt and output lengths.
    #[arg(long, default_value_t = 128)]
    pub input_tokens: u32,
    #[arg(long, default_value_t = 32)]
    pub output_tokens: u32,
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft: f64,
    #[arg(long, default_value_t = 0.05)]
    pub slo_itl: f64,
    /// Time after which a request counts as failed.
    #[arg(long, alias = "timeout-s", default_value = "300s", value_parser = duration_arg)]
    pub timeout: Duration,
    /// Include every request's outcome in the JSON.
    #[arg(long)]
    pub per_request: bool,
    /// Write an SVG of load, TTFT and (against a preheat gateway) each pool's
    /// replicas over time.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchScalerArgs {
    /// ScaledObjects polling GetMetrics concurrently.
    #[arg(long, default_value_t = 1000)]
    pub objects: usize,
    /// GetMetrics calls per ScaledObject.
    #[arg(long, default_value_t = 10)]
    pub polls: usize,
    /// Time between one ScaledObject's polls (KEDA's default is 30s).
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub interval: Duration,
    /// The same in milliseconds (the old spelling).
    #[arg(long, hide = true, conflicts_with = "interval")]
    pub interval_ms: Option<u64>,
    /// Pods scraped per tick (half prefill, half decode).
    #[arg(long, default_value_t = 1000)]
    pub pods: usize,
    #[arg(long, default_value_t = 5)]
    pub ticks: usize,
    /// Where the simulated KEDA callers run: in the scaler's process (sharing its
    /// runtime), in a process of their own (as KEDA does), or both, one after the other.
    #[arg(long, value_enum, default_value = "both")]
    pub callers: Callers,
    /// Internal: only poll the scaler at this address and print latencies (the callers'
    /// process of `--callers own-process`).
    #[arg(long, hide = true)]
    pub call_server: Option<String>,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Callers {
    SameProcess,
    OwnProcess,
    Both,
}

#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    /// Synthetic preset to measure.
    #[arg(long, default_value = "llama-1b")]
    pub preset: String,
    #[arg(long, default_value = ".bench")]
    pub dir: PathBuf,
    /// Decode steps timed at batch 1 (half as many at batch 32).
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prefill_len: usize,
    /// Tokens generated per stream in the batching measurement.
    #[arg(long, default_value_t = 8)]
    pub gen_tokens: usize,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args)]
pub struct BenchSnapshotArgs {
    /// Synthetic preset to measure.
    #[arg(long, default_value = "llama-1b")]
    pub preset: String,
    /// Scratch directory (needs about 4× the snapshot size free).
    #[arg(long, default_value = ".bench")]
    pub dir: PathBuf,
    /// Repetitions of each timed read (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(Debug, Args, Clone, Copy)]
pub struct OutputArgs {
    /// Print machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
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
value_enum!(
    /// `bench coldstart --sources`.
    SourceFlag { Convert => "convert", Staged => "staged", Hot => "hot", Standby => "standby" }
);
value_enum!(
    /// `simulate --policy` (the simulator's registry, `sim::autoscalers::POLICIES`).
    PolicyFlag {
        All => "all",
        Preheat => "preheat",
        StaticPeak => "static-peak",
        Clairvoyant => "clairvoyant",
        HpaUtilization => "hpa-utilization",
        KedaQueue => "keda-queue",
        Kpa => "kpa",
        SlaPlanner => "sla-planner",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_flag_is_a_simulator_policy_and_back() {
        let flags: Vec<&str> = PolicyFlag::value_variants()
            .iter()
            .map(|p| p.as_str())
            .filter(|p| *p != "all")
            .collect();
        let mut known = preheat_scaler::sim::autoscalers::POLICIES.to_vec();
        known.sort_unstable();
        let mut flags_sorted = flags.clone();
        flags_sorted.sort_unstable();
        assert_eq!(flags_sorted, known);
    }
}
