//! `preheat bench …` flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use preheat_flags::{OutputArgs, duration_arg, seconds_arg};

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
    /// Sim-to-real: runs `preheat up` under a trace slice (as `serve` sends it), then
    /// the simulator with the same measured profile, start times, policy and requests;
    /// reports each pool's replica-seconds and the SLO attainment, measured against
    /// predicted, with their errors.
    Simreal(BenchSimrealArgs),
    /// Prefix-cache hit rate of KV-aware routing vs round robin on a trace with prefix
    /// block ids (Mooncake).
    Router(BenchRouterArgs),
    /// KV transfer throughput (pulled and checked as a decode worker does) vs raw
    /// loopback TCP in the same run.
    Kv(BenchKvArgs),
    /// Replica start to first token from an HF checkpoint over HTTP, a staged snapshot
    /// (cold page cache), a hot one and a parked standby, against a page-cache read.
    Coldstart(BenchColdstartArgs),
    /// Structured outputs: the per-token cost of a grammar's mask next to a decode step of
    /// the same model (SmolLM2, a 49k vocabulary, by default), in the engine and alone.
    Grammar(BenchGrammarArgs),
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
    /// Also start a second and a third model (copies of the snapshot, their own files)
    /// from each source while the first model serves requests back to back.
    #[arg(long)]
    pub fleet: bool,
    /// Write the phase breakdown per source as an SVG chart.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// `bench coldstart --sources`: how a replica starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SourceFlag {
    #[value(name = "convert")]
    Convert,
    #[value(name = "staged")]
    Staged,
    #[value(name = "hot")]
    Hot,
    #[value(name = "standby")]
    Standby,
}

impl SourceFlag {
    /// The spelling on the command line.
    #[must_use]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SourceFlag::Convert => "convert",
            SourceFlag::Staged => "staged",
            SourceFlag::Hot => "hot",
            SourceFlag::Standby => "standby",
        }
    }
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

/// What to send: a trace slice or a fixed rate (shared by `bench serve` and
/// `bench simreal`).
#[derive(Debug, Args)]
pub struct LoadArgs {
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
    /// Time after which a request counts as failed.
    #[arg(long, alias = "timeout-s", default_value = "300s", value_parser = duration_arg)]
    pub timeout: Duration,
}

#[derive(Debug, Args)]
pub struct BenchServeArgs {
    /// Base URL of the OpenAI-compatible server (`/v1/completions` is appended).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// `model` field of each request (default: the server's only model).
    #[arg(long)]
    pub model: Option<String>,
    #[command(flatten)]
    pub load: LoadArgs,
    /// TTFT target (`2`, `2s`, `1500ms`), as `up` and `bench simreal` take it.
    #[arg(long, default_value = "2s", value_parser = seconds_arg)]
    pub slo_ttft: f64,
    /// Inter-token latency target.
    #[arg(long, default_value = "50ms", value_parser = seconds_arg)]
    pub slo_itl: f64,
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

/// `bench simreal`: the local stack under a load, and the simulator's prediction of it.
#[derive(Debug, Args)]
pub struct BenchSimrealArgs {
    #[command(flatten)]
    pub load: LoadArgs,
    /// The cache of the `preheat up` this runs: the staged model and its measured
    /// profile are reused between runs. Not a running `up`'s own (the run writes a
    /// new cluster token there).
    #[arg(long, default_value = ".cache/simreal")]
    pub cache_dir: PathBuf,
    /// The model `preheat up` serves (default: its embedded tiny model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 2)]
    pub prefill_max: u32,
    #[arg(long, default_value_t = 2)]
    pub decode_max: u32,
    /// Idle time before a pool goes to zero.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub idle_grace: Duration,
    /// Parked standbys per pool.
    #[arg(long, default_value_t = 1)]
    pub standbys: u32,
    #[arg(long, default_value_t = 256)]
    pub kv_cache_mib: usize,
    /// TTFT target (`2`, `2s`, `1500ms`) the scaler sizes for and both sides count.
    #[arg(long, default_value = "2s", value_parser = seconds_arg)]
    pub slo_ttft: f64,
    /// Inter-token latency target.
    #[arg(long, default_value = "50ms", value_parser = seconds_arg)]
    pub slo_itl: f64,
    /// Write an SVG of each pool's replicas over time, measured and predicted.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Also write the measured run (requests and their outcomes, replicas over time,
    /// starts, the profile and both pools' policies) to this JSON file, for
    /// `--from-run`.
    #[arg(long, value_name = "FILE")]
    pub save_run: Option<PathBuf>,
    /// Predict a run saved with `--save-run` instead of measuring one: a change to the
    /// simulator judged on the same measurement. The run's own load, limits, SLOs and
    /// profile come from the file, so the flags that set them are refused here.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = [
            "save_run", "cache_dir", "model", "prefill_max", "decode_max", "idle_grace",
            "standbys", "kv_cache_mib", "slo_ttft", "slo_itl", "trace", "speedup",
            "max_requests", "token_scale", "max_input_tokens", "max_output_tokens", "rate",
            "requests", "input_tokens", "output_tokens", "timeout",
        ]
    )]
    pub from_run: Option<PathBuf>,
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
pub struct BenchGrammarArgs {
    /// A .gguf, an HF directory or a .preheat (`.ci/fetch-models` puts SmolLM2 here).
    #[arg(long, default_value = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: PathBuf,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 96)]
    pub tokens: usize,
    #[command(flatten)]
    pub out: OutputArgs,
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

impl BenchScalerArgs {
    /// `--interval`, or the old `--interval-ms`.
    #[must_use]
    pub(crate) fn poll_interval(&self) -> Duration {
        self.interval_ms
            .map_or(self.interval, Duration::from_millis)
    }
}

/// `preheat bench ARGS` as the CLI parses it (its `bench` subcommand is [`BenchCmd`] as
/// it is).
#[cfg(test)]
pub(crate) fn try_parse_bench(args: &[&str]) -> Result<BenchCmd, clap::Error> {
    #[derive(clap::Parser)]
    #[command(name = "preheat")]
    enum Preheat {
        #[command(subcommand)]
        Bench(BenchCmd),
    }
    let Preheat::Bench(cmd) =
        clap::Parser::try_parse_from(["preheat", "bench"].iter().chain(args))?;
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_run_refuses_the_flags_that_would_shape_a_new_run() {
        for flag in [["--rate", "3"], ["--slo-itl", "1s"], ["--prefill-max", "4"]] {
            let args: Vec<&str> = ["simreal", "--from-run", "x.json"]
                .into_iter()
                .chain(flag)
                .collect();
            assert!(
                try_parse_bench(&args).is_err(),
                "{flag:?} was taken beside --from-run"
            );
        }
        assert!(try_parse_bench(&["simreal", "--from-run", "x.json", "--json"]).is_ok());
    }
}
