//! Prometheus metrics. Every metric name the engine exports is in [`names`], with
//! vLLM's names verbatim so existing dashboards and autoscalers read them unchanged.

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

/// All exported metric names.
pub mod names {
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
    pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
    pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
    pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
    pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
    pub const TTFT: &str = "vllm:time_to_first_token_seconds";
    pub const ITL: &str = "vllm:inter_token_latency_seconds";
    pub const E2E: &str = "vllm:e2e_request_latency_seconds";
    pub const QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
    /// Prompt tokens queued and not yet prefilled.
    pub const PREFILL_QUEUE_TOKENS: &str = "preheat:prefill_queue_tokens";
    /// Fraction of KV-cache blocks reserved for K/V still being prefilled elsewhere or
    /// in transfer: a decode worker takes room before it pulls, so a prefill backlog
    /// holds decode blocks. Counted in [`KV_CACHE_USAGE`] too, as vLLM counts blocks
    /// allocated for remote K/V; an autoscaler subtracts it to see decode's own load.
    pub const KV_CACHE_RESERVED: &str = "preheat:kv_cache_reserved_perc";
    /// Requests refused because the queue was full, or (a decode worker) the KV cache
    /// had no room, or the batch no running slot, to reserve for a prompt's K/V. A
    /// gateway holds such a request and asks again: this counts the asks.
    pub const REJECTED: &str = "preheat:requests_rejected_total";
    pub const STARTUP_PHASE: &str = "preheat:startup_phase_seconds";
    /// Unix time the replica's current start began (process start, or promotion of a
    /// standby): with [`STARTUP_PHASE`], which starts were the last ones.
    pub const START_TIME: &str = "preheat:replica_start_time_seconds";
    /// Gateway: requests waiting for a worker, by `model_name` and the `pool` they wait
    /// for (held at zero or for room; a long prompt with no prefill worker also counts
    /// for `prefill`).
    pub const GATEWAY_PENDING: &str = "preheat:gateway_pending_requests";
    /// Workers in a gateway's rotation, by `role` (prefill, decode).
    pub const GATEWAY_WORKERS: &str = "preheat:gateway_workers";
    /// Gateway: requests run again from the start after their decode worker was lost
    /// (killed, crashed, cut off) before they finished.
    pub const GATEWAY_REPLAYS: &str = "preheat:gateway_replays_total";
    /// OpenAI API requests accepted, by API key (a short hash of it).
    pub const API_KEY_REQUESTS: &str = preheat_edge::api_keys::REQUESTS_METRIC;

    /// Every name above.
    pub const ALL: &[&str] = &[
        NUM_REQUESTS_RUNNING,
        NUM_REQUESTS_WAITING,
        KV_CACHE_USAGE,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        PREFIX_CACHE_QUERIES,
        PREFIX_CACHE_HITS,
        REQUEST_SUCCESS,
        NUM_PREEMPTIONS,
        TTFT,
        ITL,
        E2E,
        QUEUE_TIME,
        PREFILL_QUEUE_TOKENS,
        KV_CACHE_RESERVED,
        REJECTED,
        STARTUP_PHASE,
        START_TIME,
        GATEWAY_PENDING,
        GATEWAY_WORKERS,
        GATEWAY_REPLAYS,
        API_KEY_REQUESTS,
    ];
}

/// Which part of a disaggregated deployment a process plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Colocated,
    Prefill,
    Decode,
    Gateway,
}

impl Role {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Colocated => "colocated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Gateway => "gateway",
        }
    }
}

/// Seconds since the Unix epoch (0 on a clock set before it).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Also the simulator's (`preheat_sim::ITL_BUCKETS`), held to these by a test.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The engine's metrics, bound to its `model_name` and `role` labels.
#[derive(Debug)]
pub struct EngineMetrics {
    pub registry: Registry,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_usage: Gauge,
    pub kv_reserved: Gauge,
    pub prefill_queue_tokens: IntGauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub prefix_queries: IntCounter,
    pub prefix_hits: IntCounter,
    pub preemptions: IntCounter,
    pub rejected: IntCounter,
    success: IntCounterVec,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    /// `preheat:startup_phase_seconds{phase, source}`: seconds from the start's origin
    /// (process start, or promotion of a standby) to the end of each phase.
    pub startup: GaugeVec,
    /// `preheat:replica_start_time_seconds`: when that origin was, in Unix time.
    start_time: Gauge,
    startup_origin: std::sync::Mutex<(std::time::Instant, String)>,
    first_token_seen: std::sync::atomic::AtomicBool,
    labels: [String; 2],
}

impl EngineMetrics {
    #[must_use]
    pub fn new(model_name: &str, role: Role) -> Self {
        let registry = Registry::new();
        let labels = [model_name.to_owned(), role.as_str().to_owned()];
        let const_labels = || {
            [
                ("model_name".to_owned(), labels[0].clone()),
                ("role".to_owned(), labels[1].clone()),
            ]
            .into_iter()
            .collect()
        };
        let opts = |name: &str, help: &str| Opts::new(name, help).const_labels(const_labels());
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .const_labels(const_labels())
                    .buckets(buckets.to_vec()),
            )
            .expect("valid histogram");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        macro_rules! reg {
            ($ty:ty, $name:expr, $help:expr) => {{
                let m = <$ty>::with_opts(opts($name, $help)).expect("valid metric");
                registry
                    .register(Box::new(m.clone()))
                    .expect("unique metric");
                m
            }};
        }
        use names::*;
        let success = IntCounterVec::new(
            opts(REQUEST_SUCCESS, "Finished requests by reason"),
            &["finished_reason"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(success.clone()))
            .expect("unique metric");
        let startup = GaugeVec::new(
            opts(
                STARTUP_PHASE,
                "Seconds from the start (process start or standby promotion) to the end of each phase",
            ),
            &["phase", "source"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(startup.clone()))
            .expect("unique metric");
        let start_time = reg!(
            Gauge,
            START_TIME,
            "Unix time the current start began (process start or standby promotion)"
        );
        start_time.set(unix_now());
        EngineMetrics {
            startup,
            start_time,
            startup_origin: std::sync::Mutex::new((std::time::Instant::now(), "staged".to_owned())),
            first_token_seen: false.into(),
            running: reg!(
                IntGauge,
                NUM_REQUESTS_RUNNING,
                "Requests in the running batch"
            ),
            waiting: reg!(
                IntGauge,
                NUM_REQUESTS_WAITING,
                "Requests waiting to be scheduled"
            ),
            kv_usage: reg!(
                Gauge,
                KV_CACHE_USAGE,
                "Fraction of KV-cache blocks in use (0-1)"
            ),
            kv_reserved: reg!(
                Gauge,
                KV_CACHE_RESERVED,
                "Fraction of KV-cache blocks reserved for K/V not yet received (0-1), included in the usage"
            ),
            prefill_queue_tokens: reg!(
                IntGauge,
                PREFILL_QUEUE_TOKENS,
                "Prompt tokens queued and not yet prefilled"
            ),
            prompt_tokens: reg!(
                IntCounter,
                PROMPT_TOKENS,
                "Prompt tokens of prefilled requests, prefix-cache hits included"
            ),
            generation_tokens: reg!(IntCounter, GENERATION_TOKENS, "Generated tokens"),
            prefix_queries: reg!(
                IntCounter,
                PREFIX_CACHE_QUERIES,
                "Prompt tokens looked up in the prefix cache"
            ),
            prefix_hits: reg!(
                IntCounter,
                PREFIX_CACHE_HITS,
                "Prompt tokens found in the prefix cache"
            ),
            preemptions: reg!(
                IntCounter,
                NUM_PREEMPTIONS,
                "Sequences preempted for lack of KV blocks"
            ),
            rejected: reg!(
                IntCounter,
                REJECTED,
                "Requests refused with 429: the queue was full, or (decode) no KV room or running slot to reserve for a prompt; a gateway asks again, so one request may count more than once"
            ),
            success,
            ttft: hist(TTFT, "Time to first token", TTFT_BUCKETS),
            itl: hist(ITL, "Time between consecutive output tokens", ITL_BUCKETS),
            e2e: hist(
                E2E,
                "Request latency from arrival to last token",
                LATENCY_BUCKETS,
            ),
            queue_time: hist(
                QUEUE_TIME,
                "Time from arrival to first scheduling",
                LATENCY_BUCKETS,
            ),
            registry,
            labels,
        }
    }

    /// Starts a new start-up record: phases are measured from `origin`, labelled
    /// `source` (`convert`, `staged`, `hot`, `standby`); the next first token counts.
    pub fn set_startup_origin(&self, origin: std::time::Instant, source: &str) {
        self.start_time
            .set(unix_now() - origin.elapsed().as_secs_f64());
        *self.startup_origin.lock().expect("no panics while held") = (origin, source.to_owned());
        self.first_token_seen
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records that `phase` ended now; returns its seconds from the origin.
    pub fn mark_startup(&self, phase: &str) -> f64 {
        let (origin, source) = self
            .startup_origin
            .lock()
            .expect("no panics while held")
            .clone();
        let secs = origin.elapsed().as_secs_f64();
        self.startup.with_label_values(&[phase, &source]).set(secs);
        secs
    }

    /// Observes a time to first token; the first one after a start also ends the
    /// `first_token` start-up phase.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
        if !self
            .first_token_seen
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            self.mark_startup("first_token");
        }
    }

    pub fn finished(&self, reason: &str) {
        self.success.with_label_values(&[reason]).inc();
    }

    #[must_use]
    pub fn model_name(&self) -> &str {
        &self.labels[0]
    }

    /// The text exposition of every metric.
    #[must_use]
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
