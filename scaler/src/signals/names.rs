//! Every metric name the scaler reads, grouped by the signal it feeds, and (in [`own`])
//! every name it exposes. Engines differ in naming (preheat and vLLM ≥ 0.10, older vLLM,
//! SGLang); the first name present in a scrape wins.

pub const WAITING: &[&str] = &["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
pub const RUNNING: &[&str] = &["vllm:num_requests_running", "sglang:num_running_reqs"];
pub const KV_USAGE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];
pub const PROMPT_TOKENS: &[&str] = &["vllm:prompt_tokens_total", "sglang:prompt_tokens_total"];
pub const GENERATION_TOKENS: &[&str] = &[
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
];
pub const PREFIX_QUERIES: &[&str] = &["vllm:prefix_cache_queries_total"];
pub const PREFIX_HITS: &[&str] = &["vllm:prefix_cache_hits_total"];
pub const TTFT: &[&str] = &[
    "vllm:time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
];
pub const ITL: &[&str] = &[
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
];
/// preheat engines only: the share of KV blocks a decode worker reserved for K/V
/// still being prefilled elsewhere (part of [`KV_USAGE`], not decode's own load).
pub const KV_RESERVED: &[&str] = &["preheat:kv_cache_reserved_perc"];
/// preheat engines only: prompt tokens queued and not yet prefilled.
pub const PREFILL_QUEUE_TOKENS: &[&str] = &["preheat:prefill_queue_tokens"];
/// preheat gateway only: requests held while a pool is at zero.
pub const GATEWAY_PENDING: &[&str] = &["preheat:gateway_pending_requests"];
/// preheat workers: seconds from the start of a replica (process start, or promotion
/// of a standby) to the end of each start-up phase, by `phase` and `source`.
pub const STARTUP_PHASE: &str = "preheat:startup_phase_seconds";

/// The scaler's own `/metrics`, per `model` and `pool`: what it decided and why, and
/// what it could see — `BLIND` is the one to alert on.
pub mod own {
    pub const DESIRED: &str = "preheat:scaler_desired_replicas";
    pub const ACTIVE: &str = "preheat:scaler_active";
    pub const CURRENT: &str = "preheat:scaler_current_replicas";
    /// Endpoints of the pool by `state` (`ok` | `failed`) in the last tick.
    pub const ENDPOINTS: &str = "preheat:scaler_endpoints";
    /// 1 while every endpoint of the pool fails: the pool is held, not sized.
    pub const BLIND: &str = "preheat:scaler_blind";
    /// 1 for the `reason` of the last decision.
    pub const DECISION: &str = "preheat:scaler_decision";
    /// Replicas serving (ready pods, else endpoints that answered).
    pub const READY: &str = "preheat:scaler_ready_replicas";
    /// The latency targets the pool is sized for, by `slo` (`ttft` | `itl`).
    pub const SLO_TARGET: &str = "preheat:scaler_slo_target_seconds";
    /// Share of the window's requests (`ttft`) or tokens (`itl`) within the target.
    pub const SLO_ATTAINMENT: &str = "preheat:scaler_slo_attainment_ratio";
    /// The pool's load by `kind` (`observed` | `forecast` one lead time ahead).
    pub const LOAD: &str = "preheat:scaler_load";
    /// The lead time the forecast looks ahead: a replica's start-up.
    pub const LEAD: &str = "preheat:scaler_lead_seconds";
    /// Replicas the load needs before limits, rounding and damping.
    pub const NEEDED: &str = "preheat:scaler_needed_replicas";
    /// Unix time of the state file's last successful save, per scaler (no labels;
    /// 0 until the first; absent without a state file): the chart's
    /// `PreheatScalerStateNotSaved` alerts when `time() -` it passes two minutes.
    pub const STATE_SAVED: &str = "preheat:scaler_state_saved_timestamp_seconds";
    /// GPUs a model's pools wanted and were granted under the fleet's budget, by
    /// `model` and `state` (`wanted`, `granted`).
    pub const FLEET_GPUS: &str = "preheat:scaler_fleet_gpus";
    /// Seconds a model has been granted fewer GPUs than it wants by the fleet's
    /// budget, by `model` (0: not waiting): the chart's
    /// `PreheatModelWaitingOnGpuBudget` alerts when it passes the model's start-up.
    pub const FLEET_WAIT: &str = "preheat:scaler_fleet_wait_seconds";
    /// GPU-seconds a model's replicas have held since the scaler started, by `model`.
    pub const FLEET_GPU_SECONDS: &str = "preheat:scaler_fleet_gpu_seconds_total";

    /// Every name above.
    pub const ALL: &[&str] = &[
        DESIRED,
        ACTIVE,
        CURRENT,
        ENDPOINTS,
        BLIND,
        DECISION,
        READY,
        SLO_TARGET,
        SLO_ATTAINMENT,
        LOAD,
        LEAD,
        NEEDED,
        STATE_SAVED,
        FLEET_GPUS,
        FLEET_WAIT,
        FLEET_GPU_SECONDS,
    ];
}
