//! The A/B measuring: every (trace, allocator) pair replayed on worker
//! threads, each with its minimum-capacity bisection, into the rows of
//! [`crate::report::rows`]. The `ab` and `sweep` commands ([`crate::cli`])
//! present what it measures.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use quilt_alloc::DeviceAllocator;

use crate::bisect::min_capacity_bytes;
use crate::live::trace_stats;
use crate::replay::{replay_fresh_then, ReplayConfig, ReplayError};
use crate::report::charts::file_safe;
use crate::report::rows::{Failure, Measurement, Outcome};
use crate::trace::Trace;

/// What an A/B measures: every trace through every allocator spec.
#[derive(Clone, Copy, Debug)]
pub struct Plan<'a> {
    /// The traces, in report order.
    pub traces: &'a [Trace],
    /// The allocator specs, in report order (each checked).
    pub specs: &'a [String],
    /// Device capacity of the main replay.
    pub capacity: u64,
    /// How to replay.
    pub config: &'a ReplayConfig,
    /// Skip the minimum-capacity bisection.
    pub no_bisect: bool,
    /// Worker threads (`None`: the machine's parallelism).
    pub jobs: Option<usize>,
    /// Write each pair's snapshot pickle into this folder.
    pub export_snapshot: Option<&'a Path>,
}

/// Measure every pair of `plan` on worker threads; the outcomes come back
/// in (trace, allocator) order, a pair that failed as a [`Failure`] (the
/// others go on). `Err` when a worker thread panicked.
pub fn measure_all(plan: &Plan<'_>) -> Result<Vec<Outcome>, String> {
    let traces = plan.traces;
    let jobs: Vec<(usize, &str)> = (0..traces.len())
        .flat_map(|t| plan.specs.iter().map(move |a| (t, a.as_str())))
        .collect();
    let workers = plan
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));

    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::with_draw_target(Some(jobs.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}") {
        bar.set_style(style);
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Outcome>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    let stats: Vec<u64> = traces
        .iter()
        .map(|t| trace_stats(t).peak_live_bytes)
        .collect();
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(t, allocator)) = jobs.get(i) else {
                    break;
                };
                let trace = &traces[t];
                bar.set_message(format!("{} / {allocator}", trace.name));
                let outcome = measure(
                    trace,
                    allocator,
                    plan.capacity,
                    stats[t],
                    plan.config,
                    plan.no_bisect,
                    plan.export_snapshot,
                );
                bar.inc(1);
                if let Ok(mut slots) = results.lock() {
                    slots[i] = Some(outcome);
                }
            });
        }
    });
    bar.finish_and_clear();
    let panicked = || "a worker thread panicked".to_string();
    let slots = results.into_inner().map_err(|_| panicked())?;
    slots
        .into_iter()
        .map(|slot| slot.ok_or_else(panicked))
        .collect()
}

/// Write `alloc`'s snapshot pickle into `dir` as `WORKLOAD__ALLOCATOR.pickle`
/// (characters of a spec other than letters, digits, `-`, `_` and `.` become `_`).
fn export_snapshot(
    dir: &Path,
    workload: &str,
    allocator: &str,
    alloc: &dyn DeviceAllocator,
) -> Result<(), String> {
    let safe = |s: &str| file_safe(s, "-_.");
    let bytes = quilt_torch::pytorch_snapshot::pickle_of(alloc)?;
    std::fs::create_dir_all(dir)
        .and_then(|()| {
            std::fs::write(
                dir.join(format!("{}__{}.pickle", safe(workload), safe(allocator))),
                bytes,
            )
        })
        .map_err(|e| format!("writing a snapshot into {}: {e}", dir.display()))
}

/// One (trace, allocator) pair: the main replay and the bisection; a
/// [`Failure`] when either could not run to a result.
fn measure(
    trace: &Trace,
    allocator: &str,
    capacity: u64,
    peak_live: u64,
    config: &ReplayConfig,
    no_bisect: bool,
    export: Option<&Path>,
) -> Outcome {
    let failure = |error: String| Failure {
        workload: trace.name.clone(),
        allocator: allocator.to_string(),
        capacity_bytes: capacity,
        completed: false,
        error,
    };
    let at =
        |capacity: u64, e: ReplayError| failure(format!("at a capacity of {capacity} bytes: {e}"));
    let (result, exported) = replay_fresh_then(trace, allocator, capacity, config, |alloc| {
        export.map(|dir| export_snapshot(dir, &trace.name, allocator, alloc))
    })
    .map_err(|e| match e {
        // Building the allocator failed: no capacity to name.
        ReplayError::Registry(r) => failure(r.to_string()),
        e => at(capacity, e),
    })?;
    exported
        .transpose()
        .map_err(|e| failure(format!("exporting its snapshot: {e}")))?;
    let min = if no_bisect {
        None
    } else {
        min_capacity_bytes(trace, allocator, peak_live, config)
            .map_err(|e| at(e.capacity, *e.source))?
    };
    Ok(Measurement::new(
        &trace.name,
        allocator,
        capacity,
        config.iterations,
        result,
        min,
    ))
}
