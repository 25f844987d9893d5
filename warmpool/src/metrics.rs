//! The agent's Prometheus metrics. Every name it exports is in [`names`].

use prometheus::{
    Encoder, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// All exported metric names.
pub mod names {
    /// Models published in the snapshot directory.
    pub const STAGED_MODELS: &str = "preheat:warmpool_staged_models";
    /// Models of the hot set (held in page cache).
    pub const HOT_MODELS: &str = "preheat:warmpool_hot_models";
    /// Bytes of published snapshots.
    pub const STAGED_BYTES: &str = "preheat:warmpool_staged_bytes";
    /// Disk budget in bytes.
    pub const DISK_BUDGET_BYTES: &str = "preheat:warmpool_disk_budget_bytes";
    /// Bytes of the hot set resident in page cache (mincore), per model.
    pub const RESIDENT_BYTES: &str = "preheat:warmpool_resident_bytes";
    /// Staging progress in [0, 1] per model; 1 once published.
    pub const STAGING_PROGRESS: &str = "preheat:warmpool_staging_progress_ratio";
    /// Bytes written by staging (after decompression).
    pub const STAGING_BYTES: &str = "preheat:warmpool_staging_bytes_total";
    /// Throughput of the last (or current) staging per model, bytes/s.
    pub const STAGING_THROUGHPUT: &str = "preheat:warmpool_staging_throughput_bytes_per_second";
    /// Snapshots removed to respect the disk budget.
    pub const EVICTIONS: &str = "preheat:warmpool_evictions_total";
    /// Stagings that failed, per model.
    pub const STAGING_FAILURES: &str = "preheat:warmpool_staging_failures_total";
    /// Parked standby replicas per pool.
    pub const PARKED_STANDBYS: &str = "preheat:warmpool_parked_standbys";
    /// Entries of the kernel cache directory.
    pub const KERNEL_CACHE_ENTRIES: &str = "preheat:warmpool_kernel_cache_entries";

    /// Every name above.
    pub const ALL: &[&str] = &[
        STAGED_MODELS,
        HOT_MODELS,
        STAGED_BYTES,
        DISK_BUDGET_BYTES,
        RESIDENT_BYTES,
        STAGING_PROGRESS,
        STAGING_BYTES,
        STAGING_THROUGHPUT,
        EVICTIONS,
        STAGING_FAILURES,
        PARKED_STANDBYS,
        KERNEL_CACHE_ENTRIES,
    ];
}

/// The agent's metrics.
#[derive(Debug)]
pub struct AgentMetrics {
    pub registry: Registry,
    pub staged_models: IntGauge,
    pub hot_models: IntGauge,
    pub staged_bytes: IntGauge,
    pub disk_budget: IntGauge,
    pub resident_bytes: IntGaugeVec,
    pub staging_progress: GaugeVec,
    pub staging_bytes: IntCounter,
    pub staging_throughput: GaugeVec,
    pub evictions: IntCounter,
    pub staging_failures: IntCounterVec,
    pub parked: IntGaugeVec,
    pub kernel_entries: IntGauge,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    #[must_use]
    pub fn new() -> Self {
        use names::*;
        let registry = Registry::new();
        let g = |n: &str, h: &str| {
            let m = IntGauge::new(n, h).expect("valid metric");
            registry
                .register(Box::new(m.clone()))
                .expect("unique metric");
            m
        };
        let staged_models = g(STAGED_MODELS, "Models published in the snapshot directory");
        let hot_models = g(HOT_MODELS, "Models held in page cache");
        let staged_bytes = g(STAGED_BYTES, "Bytes of published snapshots");
        let disk_budget = g(DISK_BUDGET_BYTES, "Disk budget of the snapshot directory");
        let kernel_entries = g(KERNEL_CACHE_ENTRIES, "Entries of the kernel cache");
        let resident_bytes = IntGaugeVec::new(
            Opts::new(RESIDENT_BYTES, "Hot-set bytes resident in page cache"),
            &["model"],
        )
        .expect("valid metric");
        let staging_progress = GaugeVec::new(
            Opts::new(STAGING_PROGRESS, "Staging progress (1 once published)"),
            &["model"],
        )
        .expect("valid metric");
        let staging_throughput = GaugeVec::new(
            Opts::new(
                STAGING_THROUGHPUT,
                "Throughput of the last staging, bytes per second",
            ),
            &["model"],
        )
        .expect("valid metric");
        let staging_bytes =
            IntCounter::new(STAGING_BYTES, "Bytes written by staging").expect("valid metric");
        let evictions = IntCounter::new(EVICTIONS, "Snapshots evicted for the disk budget")
            .expect("valid metric");
        let staging_failures = IntCounterVec::new(
            Opts::new(STAGING_FAILURES, "Stagings that failed"),
            &["model"],
        )
        .expect("valid metric");
        let parked = IntGaugeVec::new(
            Opts::new(PARKED_STANDBYS, "Parked standby replicas"),
            &["pool"],
        )
        .expect("valid metric");
        for m in [
            Box::new(resident_bytes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(staging_progress.clone()),
            Box::new(staging_throughput.clone()),
            Box::new(staging_bytes.clone()),
            Box::new(evictions.clone()),
            Box::new(staging_failures.clone()),
            Box::new(parked.clone()),
        ] {
            registry.register(m).expect("unique metric");
        }
        AgentMetrics {
            registry,
            staged_models,
            hot_models,
            staged_bytes,
            disk_budget,
            resident_bytes,
            staging_progress,
            staging_bytes,
            staging_throughput,
            evictions,
            staging_failures,
            parked,
            kernel_entries,
        }
    }

    /// The text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}
