//! `preheat bench simreal`: is the simulator right about the stack it models?
//!
//! It runs `preheat up` (as a child process, with the flags an operator would give)
//! under a trace slice sent as `bench serve` sends it, and records each pool's replicas
//! (the scaler's `/status`, twice a second) and every worker's start time (its
//! `preheat:startup_phase_seconds{phase="registered"}`). Then it runs the simulator on
//! what actually happened: the requests as sent (their times and token counts as the
//! server counted them), `up`'s measured profile, the start times just measured, and
//! the pools' policies worked out from the same `up` flags, actuated directly as `up`'s
//! driver does. (The simulator decides on whole seconds, `up` every half second; and it
//! counts a draining replica until it empties, where `up`'s scaler stops counting it
//! when told to stop, a difference of the drain's length.) It reports each pool's replica-seconds and the
//! SLO attainment, measured and predicted, and their errors against the tolerances
//! the simulator is held to.

mod measure;
mod predict;
mod report;
mod saved_run;
mod stack;

use std::process::ExitCode;

use crate::args::BenchSimrealArgs;
use crate::serve;

use self::measure::measure_run;
use self::predict::predict;
use self::report::{plot, print_text};
use self::saved_run::SavedRun;

pub(crate) fn run(a: &BenchSimrealArgs) -> anyhow::Result<ExitCode> {
    let run = match &a.from_run {
        Some(path) => SavedRun::read(path)?,
        None => {
            let run = measure_run(a)?;
            // The measurement took minutes: its report comes whether or not it could
            // also be kept.
            if let Some(path) = &a.save_run
                && let Err(e) = run.write(path)
            {
                tracing::error!("the run is not saved: {e:#}");
            }
            run
        }
    };
    let report = predict(run)?;
    let svg = a.plot.as_deref().map(|p| (p, plot(&report)));
    serve::emit(&report, svg, a.out.json, print_text, report.failed)
}
