//! What the scaler tells people: its `/metrics` (for Prometheus and the chart's
//! dashboard) and `GET /status` (for `preheat status`), both read from the
//! [`DecisionStore`] the control loop writes.

use serde::{Deserialize, Serialize};

use crate::decisions::DecisionStore;
use crate::policy::{LoadView, Pool};

/// `GET /status`: every model's pools as the last tick saw them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatusReport {
    pub models: Vec<ModelReport>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelReport {
    pub model: String,
    pub pools: Vec<PoolReport>,
}

/// One pool: the decision KEDA reads, and what it was made from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolReport {
    pub pool: String,
    /// `None` until the scaler knows the pool's replicas (KEDA then keeps its size).
    pub desired: Option<u32>,
    pub active: Option<bool>,
    pub current: u32,
    pub ready: u32,
    /// Why the last decision was what it was.
    pub reason: String,
    pub endpoints_ok: usize,
    pub endpoints_failed: usize,
    /// Every endpoint failed: the pool is held at its size, not sized.
    pub blind: bool,
    pub failing: Vec<String>,
    pub slo: crate::decisions::SloView,
    pub load: Option<LoadView>,
    /// Replicas the policy wanted before the fleet's GPU budget; `desired` is what
    /// was granted.
    pub wanted: Option<u32>,
}

/// The report of every pool of `models`.
#[must_use]
pub fn report(store: &DecisionStore, models: &[String]) -> StatusReport {
    StatusReport {
        models: models
            .iter()
            .map(|m| ModelReport {
                model: m.clone(),
                pools: [Pool::Prefill, Pool::Decode]
                    .into_iter()
                    .map(|p| {
                        let d = store.get(m, p);
                        let s = store.status(m, p);
                        PoolReport {
                            pool: p.as_str().to_owned(),
                            desired: d.map(|d| d.desired),
                            active: d.map(|d| d.active),
                            current: s.current,
                            ready: s.ready,
                            reason: s.reason.to_owned(),
                            endpoints_ok: s.endpoints_ok,
                            endpoints_failed: s.endpoints_failed,
                            blind: s.blind,
                            failing: s.failing,
                            slo: s.slo,
                            load: s.load,
                            wanted: s.wanted,
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// A pool's series of one family: the value of the family's extra label (empty when it
/// has none) and the sample.
type Series = Vec<(String, f64)>;

/// The scaler's own metrics (names in [`crate::signals::names::own`]): what it decided
/// for each pool, why, and what it saw, in the text format the `prometheus` crate
/// writes for the engine and the agent too.
#[must_use]
pub fn metrics(store: &DecisionStore, models: &[String]) -> String {
    use crate::signals::names::own;
    let report = report(store, models);
    let registry = prometheus::Registry::new();
    let family = |name: &str,
                  help: &str,
                  extra: Option<&str>,
                  value: &dyn Fn(&PoolReport) -> Series|
     -> prometheus::Result<()> {
        let labels: Vec<&str> = ["model", "pool"].into_iter().chain(extra).collect();
        let g = prometheus::GaugeVec::new(prometheus::Opts::new(name, help), &labels)?;
        for m in &report.models {
            for p in &m.pools {
                for (key, v) in value(p) {
                    let mut values = vec![m.model.as_str(), p.pool.as_str()];
                    if extra.is_some() {
                        values.push(&key);
                    }
                    g.get_metric_with_label_values(&values)?.set(v);
                }
            }
        }
        registry.register(Box::new(g))
    };
    let one = |v: f64| vec![(String::new(), v)];
    let some = |v: Option<f64>| v.map_or_else(Vec::new, one);
    let keyed = |vs: &[(&str, Option<f64>)]| -> Series {
        vs.iter()
            .filter_map(|(k, v)| v.map(|v| ((*k).to_owned(), v)))
            .collect()
    };
    // Each pool against the target it is sized for (prefill: TTFT, decode: ITL), once
    // it has been ticked (before, the targets are not read yet).
    let own_slo = |p: &PoolReport, ttft: Option<f64>, itl: Option<f64>| -> Series {
        if p.reason.is_empty() {
            return Vec::new();
        }
        match Pool::parse(&p.pool) {
            Some(Pool::Prefill) => keyed(&[("ttft", ttft)]),
            Some(Pool::Decode) => keyed(&[("itl", itl)]),
            None => Vec::new(),
        }
    };
    let families = [
        family(
            own::DESIRED,
            "Replicas the policy wants per pool",
            None,
            &|p| some(p.desired.map(f64::from)),
        ),
        family(
            own::ACTIVE,
            "Whether the pool is active (KEDA activation)",
            None,
            &|p| some(p.active.map(|a| f64::from(u8::from(a)))),
        ),
        family(
            own::CURRENT,
            "Replicas the pool had at the last tick",
            None,
            &|p| one(f64::from(p.current)),
        ),
        family(
            own::READY,
            "Replicas serving at the last tick (ready pods, else endpoints that answered)",
            None,
            &|p| one(f64::from(p.ready)),
        ),
        family(
            own::ENDPOINTS,
            "Endpoints scraped in the last tick, by state",
            Some("state"),
            &|p| {
                vec![
                    ("ok".to_owned(), p.endpoints_ok as f64),
                    ("failed".to_owned(), p.endpoints_failed as f64),
                ]
            },
        ),
        family(
            own::BLIND,
            "1 while every endpoint of the pool fails (held, not sized)",
            None,
            &|p| one(f64::from(u8::from(p.blind))),
        ),
        family(
            own::DECISION,
            "1 for the reason of the pool's last decision",
            Some("reason"),
            &|p| {
                if p.reason.is_empty() {
                    return Vec::new();
                }
                vec![(p.reason.clone(), 1.0)]
            },
        ),
        family(
            own::SLO_TARGET,
            "Latency target the pool is sized for (prefill: ttft, decode: itl)",
            Some("slo"),
            &|p| own_slo(p, Some(p.slo.ttft_target_s), Some(p.slo.itl_target_s)),
        ),
        family(
            own::SLO_ATTAINMENT,
            "Share of the window's requests (ttft, prefill) or tokens (itl, decode) within the pool's target",
            Some("slo"),
            &|p| own_slo(p, p.slo.ttft_attainment, p.slo.itl_attainment),
        ),
        family(
            own::LOAD,
            "The pool's load now and forecast one lead time ahead, by kind (uncached prompt tokens/s for prefill, generated tokens/s for decode)",
            Some("kind"),
            &|p| {
                let l = p.load;
                keyed(&[
                    ("observed", l.map(|l| l.observed)),
                    ("forecast", l.map(|l| l.forecast)),
                ])
            },
        ),
        family(
            own::LEAD,
            "Lead time the forecast looks ahead (a replica's start-up)",
            None,
            &|p| some(p.load.map(|l| l.lead_s)),
        ),
        family(
            own::NEEDED,
            "Replicas the load needs, before limits, rounding and damping",
            None,
            &|p| some(p.load.map(|l| l.needed)),
        ),
    ];
    // Per scaler, not per pool.
    let saved = store.state_saved().map(|unix| -> prometheus::Result<()> {
        let g = prometheus::Gauge::with_opts(prometheus::Opts::new(
            own::STATE_SAVED,
            "Unix time of the state file's last successful save (0: none yet)",
        ))?;
        g.set(unix);
        registry.register(Box::new(g))
    });
    // Per model: the GPUs its pools wanted and were granted under the fleet's budget,
    // and the GPU-seconds its replicas have held.
    let fleet = (|| -> prometheus::Result<()> {
        let gpus = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                own::FLEET_GPUS,
                "GPUs a model's pools wanted and were granted under the fleet's GPU budget",
            ),
            &["model", "state"],
        )?;
        let wait = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                own::FLEET_WAIT,
                "Seconds a model has been granted fewer GPUs than it wants by the fleet's budget (0: not waiting)",
            ),
            &["model"],
        )?;
        let held = prometheus::CounterVec::new(
            prometheus::Opts::new(
                own::FLEET_GPU_SECONDS,
                "GPU-seconds a model's replicas have held since the scaler started",
            ),
            &["model"],
        )?;
        for m in &report.models {
            let sum = |f: &dyn Fn(&PoolReport) -> Option<u32>| -> Option<f64> {
                let v: Vec<u32> = m.pools.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| v.iter().map(|&n| f64::from(n)).sum())
            };
            // (One GPU per replica: the bundled engine has no tensor parallelism.)
            if let (Some(wanted), Some(granted)) = (sum(&|p| p.wanted), sum(&|p| p.desired)) {
                gpus.get_metric_with_label_values(&[&m.model, "wanted"])?
                    .set(wanted);
                gpus.get_metric_with_label_values(&[&m.model, "granted"])?
                    .set(granted);
            }
            held.get_metric_with_label_values(&[&m.model])?
                .inc_by(store.gpu_seconds(&m.model));
            wait.get_metric_with_label_values(&[&m.model])?
                .set(store.budget_wait_s(&m.model));
        }
        registry.register(Box::new(gpus))?;
        registry.register(Box::new(wait))?;
        registry.register(Box::new(held))
    })();
    for e in families
        .into_iter()
        .chain(saved)
        .chain([fleet])
        .filter_map(Result::err)
    {
        // Only a malformed name or label could fail, and those are constants here.
        tracing::error!(error = %e, "a scaler metric family could not be built");
    }
    prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "encoding the scaler's metrics");
            String::new()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decisions::{PoolDecision, PoolStatus, SloView};

    #[test]
    fn every_family_is_exposed_and_parses_back() {
        let store = DecisionStore::new(vec!["m".into()]);
        store.set(
            "m",
            Pool::Prefill,
            PoolDecision {
                desired: 3,
                active: true,
            },
        );
        store.set_status(
            "m",
            Pool::Prefill,
            PoolStatus {
                current: 2,
                ready: 1,
                endpoints_ok: 1,
                endpoints_failed: 1,
                reason: "scale up",
                failing: vec!["http://10.0.0.9:8000/metrics".into()],
                slo: SloView {
                    ttft_target_s: 2.0,
                    itl_target_s: 0.05,
                    ttft_attainment: Some(0.97),
                    ..SloView::default()
                },
                load: Some(LoadView {
                    observed: 900.0,
                    forecast: 1200.0,
                    lead_s: 20.0,
                    needed: 2.4,
                }),
                wanted: Some(5),
                ..PoolStatus::default()
            },
        );
        store.set_state_saved(1.8e9);
        let text = metrics(&store, &["m".into()]);
        let samples: Vec<_> = crate::signals::text_format::samples(&text)
            .collect::<Result<_, _>>()
            .expect("valid exposition");
        assert!(
            samples
                .iter()
                .any(|s| s.name == crate::signals::names::own::STATE_SAVED && s.value == 1.8e9),
            "{text}"
        );
        let value = |name: &str, labels: &[(&str, &str)]| {
            samples
                .iter()
                .find(|s| {
                    s.name == name
                        && s.label("pool") == Some("prefill")
                        && labels.iter().all(|(k, v)| s.label(k) == Some(*v))
                })
                .map(|s| s.value)
        };
        use crate::signals::names::own;
        assert_eq!(value(own::DESIRED, &[]), Some(3.0));
        assert_eq!(value(own::READY, &[]), Some(1.0));
        assert_eq!(value(own::SLO_TARGET, &[("slo", "ttft")]), Some(2.0));
        assert_eq!(value(own::SLO_ATTAINMENT, &[("slo", "ttft")]), Some(0.97));
        assert_eq!(value(own::SLO_ATTAINMENT, &[("slo", "itl")]), None);
        assert_eq!(value(own::LOAD, &[("kind", "forecast")]), Some(1200.0));
        assert_eq!(value(own::LEAD, &[]), Some(20.0));
        assert_eq!(value(own::DECISION, &[("reason", "scale up")]), Some(1.0));
        for name in own::ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        let fleet = |state: &str| {
            samples
                .iter()
                .find(|s| s.name == own::FLEET_GPUS && s.label("state") == Some(state))
                .map(|s| s.value)
        };
        assert_eq!((fleet("wanted"), fleet("granted")), (Some(5.0), Some(3.0)));
        let r = report(&store, &["m".into()]);
        assert_eq!(
            r.models[0].pools[0].failing,
            ["http://10.0.0.9:8000/metrics"]
        );
        assert_eq!(
            r.models[0].pools[1].desired, None,
            "decode has no decision yet"
        );
    }

    #[test]
    fn before_the_first_tick_only_what_is_known_is_exposed() {
        let store = DecisionStore::new(vec!["m".into()]);
        let text = metrics(&store, &["m".into()]);
        let samples: Vec<_> = crate::signals::text_format::samples(&text)
            .collect::<Result<_, _>>()
            .expect("valid exposition");
        use crate::signals::names::own;
        // No decision yet: no desired replicas (KEDA keeps the pool's size), no reason.
        assert!(
            samples
                .iter()
                .all(|s| s.name != own::DESIRED && s.name != own::DECISION)
        );
        assert!(
            samples
                .iter()
                .any(|s| s.name == own::CURRENT && s.label("pool") == Some("decode"))
        );
    }
}
