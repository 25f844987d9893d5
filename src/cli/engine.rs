//! `preheat engine …` flags: the engine's processes (serve, gateway, workers).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use preheat_flags::duration_arg;

use super::{ClusterTokenArgs, DeviceFlag, NoTokenArg};

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
        /// Batch sizes to time decode at (by default up to the engine's most running
        /// sequences, 64: between sizes the cost is interpolated, and it bends).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1,2,4,8,12,16,24,32,48,64"
        )]
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
    /// A served model, `[NAME=]SOURCE`, read for its manifest and tokenizer only (no
    /// weights): a snapshot or packed snapshot as a path or http(s) URL (Range
    /// reads), or a Hugging Face directory or .gguf file (converted, as workers do).
    /// Repeat it for several models: the request's `model` field picks one, and each
    /// has its own workers (a worker joins the model it names). With it the gateway is
    /// ready at once and holds a model's requests while its pools are at zero; without
    /// it, the first worker to register sets the model. One model whose manifest
    /// cannot be read answers 503 naming the cause while the others serve (alone, it
    /// stops the gateway). Also `$PREHEAT_MODEL_SOURCE` (one model), so a URL with
    /// credentials stays out of argv.
    #[arg(long, env = "PREHEAT_MODEL_SOURCE", hide_env_values = true)]
    pub model: Vec<String>,
    /// A served model whose source is in an environment variable, `NAME=VAR`, beside
    /// or instead of `--model NAME=SOURCE` (repeat it): each of several sources with
    /// credentials stays out of argv (the chart sets each from its Secret).
    #[arg(long)]
    pub model_env: Vec<String>,
    /// Name clients use in the `model` field, with one `--model` (default: the file
    /// name; with several, give `NAME=SOURCE`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// A chat template (Jinja, as in Hugging Face's `chat_template`) rendered instead of
    /// the model's own, with one model (the gateway renders every chat; workers' templates are not used), e.g. one that renders `tools`
    /// (`testdata/chat_templates/smollm2_hermes_tools.jinja` for ChatML models).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
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
    /// gateway replica sees the same workers. Needs --model (or --model-env).
    #[arg(long, requires_all = ["prefill_service", "decode_service"])]
    pub discover_namespace: Option<String>,
    /// The prefill pool's Service (with --discover-namespace); with several models,
    /// one `NAME=SERVICE` per model.
    #[arg(long, requires = "discover_namespace")]
    pub prefill_service: Vec<String>,
    /// The decode pool's Service (with --discover-namespace); with several models,
    /// one `NAME=SERVICE` per model.
    #[arg(long, requires = "discover_namespace")]
    pub decode_service: Vec<String>,
    /// The warm-pool agents' Service (with --discover-namespace): each Ready agent's
    /// promoted standbys (`GET /standbys`, reached at the agent's own address) join
    /// their pools: a model's from the agents' pools `NAME-prefill` and `NAME-decode`,
    /// and the one model's also from `prefill` and `decode`.
    #[arg(long, requires = "discover_namespace")]
    pub standby_agents_service: Option<String>,
    /// Kubernetes API base URL (default: the in-cluster service account, else the local
    /// kubeconfig).
    #[arg(long, requires = "discover_namespace")]
    pub kube_api_url: Option<String>,
    /// Prompts shorter than this are prefilled on the decode worker itself.
    #[arg(long, default_value_t = preheat_engine::disagg::gateway::DEFAULT_DISAGG_MIN_TOKENS)]
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
    /// A chat template (Jinja, as in Hugging Face's `chat_template`) rendered instead of
    /// the model's own, e.g. one that renders `tools`
    /// (`testdata/chat_templates/smollm2_hermes_tools.jinja` for ChatML models).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// KV-cache memory budget in MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_mib: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = preheat_engine::scheduler::DEFAULT_MAX_BATCHED_TOKENS)]
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
