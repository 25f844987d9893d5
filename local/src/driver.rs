//! The local replica driver: what KEDA and Kubernetes do in a cluster. Each pool asks
//! the scaler over its gRPC API and starts or stops worker processes to match,
//! promoting parked standbys first.

use super::*;

pub(super) struct Replica {
    pub(super) child: Child,
    pub(super) port: u16,
    pub(super) started: Instant,
    /// Its stderr, for its own account of why it died.
    pub(super) log: Option<PathBuf>,
    /// It lived past [`QUICK_DEATH`] (counted once, so one long-lived replica does not
    /// excuse every new one that dies at start).
    pub(super) survived: bool,
}

/// A replica that dies sooner than this after its start "died at start": the next
/// start waits (exponential back-off), and a few in a row stop `up` with the reason.
pub(super) const QUICK_DEATH: Duration = Duration::from_secs(30);

pub(super) struct PoolState {
    /// The model it serves, and the staged snapshot its workers start from.
    pub(super) model: String,
    pub(super) snap: PathBuf,
    /// `up` serves other models beside it (its lines then name it).
    pub(super) several: bool,
    pub(super) pool: Pool,
    pub(super) role: &'static str,
    pub(super) min: u32,
    pub(super) max: u32,
    pub(super) replicas: Vec<Replica>,
    pub(super) stopping: Vec<Child>,
    pub(super) endpoints: SharedEndpoints,
    pub(super) standby: StandbyPool,
    pub(super) backoff: RestartBackoff,
    /// This run's cluster token, named in each worker's environment.
    pub(super) token_file: PathBuf,
    /// Parked standbys ready at the last report.
    pub(super) parked: usize,
}

impl PoolState {
    /// `MODEL/` before the pool's role in what `up` prints, where it serves several
    /// models.
    pub(super) fn label(&self) -> String {
        if self.several {
            format!("{}/", self.model)
        } else {
            String::new()
        }
    }

    pub(super) fn publish(&self) {
        let list: Vec<String> = self
            .replicas
            .iter()
            .map(|r| format!("http://127.0.0.1:{}/metrics", r.port))
            .collect();
        *self
            .endpoints
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = list;
    }

    pub(super) fn start(&mut self, gw: &str, logs: &Path, kv_mib: usize) -> anyhow::Result<()> {
        let port = free_port()?;
        let mut args: Vec<std::ffi::OsString> = ["engine", self.role, "--model"]
            .iter()
            .map(Into::into)
            .collect();
        args.push(self.snap.clone().into());
        let (port_s, kv_mib_s) = (port.to_string(), kv_mib.to_string());
        args.extend(
            [
                "--host",
                "127.0.0.1",
                "--port",
                &port_s,
                "--gateway",
                gw,
                "--kv-cache-mib",
                &kv_mib_s,
                "--served-model-name",
                &self.model,
            ]
            .iter()
            .map(Into::into),
        );
        if self.pool == Pool::Prefill {
            args.extend(["--kv-port".into(), free_port()?.to_string().into()]);
        }
        let log_path = logs.join(format!("{}-{}-{port}.log", self.model, self.role));
        let cmd = worker_command(
            std::env::current_exe()?,
            args,
            Some(&self.token_file),
            Some(&log_path),
        )?;
        let child = Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker")?;
        self.replicas.push(Replica {
            child,
            port,
            started: Instant::now(),
            log: Some(log_path),
            survived: false,
        });
        self.publish();
        Ok(())
    }

    /// Adds a replica: a parked standby when one is ready (promotion takes
    /// milliseconds), else a cold start.
    pub(super) async fn add(
        &mut self,
        gw: &str,
        logs: &Path,
        kv_mib: usize,
    ) -> anyhow::Result<&'static str> {
        match self.standby.promote_take().await {
            Ok(Some((p, port, child))) => {
                tracing::info!(pool = self.role, url = %p.url, ms = p.promote_ms, "standby promoted");
                self.replicas.push(Replica {
                    child,
                    port,
                    started: Instant::now(),
                    log: None,
                    survived: false,
                });
                self.publish();
                return Ok("standby");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(pool = self.role, error = %e, "standby promotion failed; starting cold")
            }
        }
        self.start(gw, logs, kv_mib)?;
        Ok("cold")
    }

    /// SIGTERM: the worker deregisters, finishes what it holds, then exits.
    pub(super) fn stop_newest(&mut self) {
        if let Some(r) = self.replicas.pop() {
            preheat_warmpool::standby::terminate(&r.child);
            self.stopping.push(r.child);
            self.publish();
        }
    }

    pub(super) fn reap(&mut self) {
        self.stopping
            .retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        // A worker that died on its own leaves the pool (the scaler sees it missing);
        // one that died at start delays the next start.
        let before = self.replicas.len();
        let now = Instant::now();
        let backoff = &mut self.backoff;
        self.replicas.retain_mut(|r| match r.child.try_wait() {
            Ok(Some(status)) => {
                let up = r.started.elapsed();
                tracing::warn!(port = r.port, %status, up_s = up.as_secs(), "worker exited");
                if up < QUICK_DEATH {
                    let words = r.log.as_deref().map(|l| log_tail(l, 3)).unwrap_or_default();
                    backoff.died_at_start(
                        now,
                        format!(
                            "exited with {status} after {:.1} s: {words}",
                            up.as_secs_f64()
                        ),
                    );
                }
                false
            }
            _ => {
                if !r.survived && r.started.elapsed() >= QUICK_DEATH {
                    r.survived = true;
                    backoff.started_ok();
                }
                true
            }
        });
        if self.replicas.len() != before {
            self.publish();
        }
    }
}

pub(super) fn sref(model: &str, pool: Pool) -> ScaledObjectRef {
    ScaledObjectRef {
        name: format!("{model}-{}", pool.as_str()),
        namespace: "local".into(),
        scaler_metadata: HashMap::from([
            ("pool".to_owned(), pool.as_str().to_owned()),
            ("model".to_owned(), model.to_owned()),
        ]),
    }
}

/// What KEDA + the HPA would set: 0 when inactive, else the metric (target 1).
pub(super) async fn target(
    c: &mut ExternalScalerClient<tonic::transport::Channel>,
    model: &str,
    pool: Pool,
) -> Option<u32> {
    let active = c
        .is_active(sref(model, pool))
        .await
        .ok()?
        .into_inner()
        .result;
    if !active {
        return Some(0);
    }
    let m = c
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(sref(model, pool)),
            metric_name: String::new(),
        })
        .await
        .ok()?
        .into_inner();
    let v = m.metric_values.first()?;
    Some(
        v.metric_value_float
            .max(v.metric_value as f64)
            .ceil()
            .max(0.0) as u32,
    )
}
