//! The live A/B (`quilt-bench live PROGRAM.py [-- ARGS...]`): a real
//! PyTorch program run on the project's simulated GPU (`scripts/simulated-gpu.sh`,
//! `docs/simulated-gpu.md`) once per allocator, each in its own process,
//! with torch's own allocators as the baselines.
//!
//! Per allocator ([`allocator`]): a run on the largest device
//! (`--max-memory`), whose figures are torch's own `memory_stats()` and the
//! double's driver calls ([`probe`], [`calls`]); then the smallest device
//! on which the program completes, by bisection over the double's device
//! memory (`QUILT_CUDA_DOUBLE_MEMORY`) in whole steps, bounded below by the
//! peak allocated bytes ([`search`]). Only completion decides a probe, and
//! the double is deterministic, so the same program gives the same figures
//! (wall time aside). [`record`] replays torch's recorded snapshot of the
//! classic run with `ab`'s machinery beside the live figures; [`table`],
//! [`chart`] and [`json`] present them.
//!
//! A program that starts Python children (`torch.multiprocessing.spawn`)
//! runs them under the same allocator: the hook is imported by every
//! Python process of the run. Each process has its own simulated devices of
//! the size probed, so the peak figures are the largest over processes and
//! devices, and the counts are summed over processes.

pub mod allocator;
pub mod calls;
pub mod chart;
pub mod command;
pub mod json;
pub mod probe;
pub mod record;
pub mod search;
pub mod table;

use std::collections::BTreeMap;

use serde::Serialize;

use allocator::LiveAllocator;
use probe::{Probe, ProbeError, Runner};
use search::{smallest_device, Bounds};

use crate::units::size_text;

/// What a live run measures.
#[derive(Clone, Debug)]
pub struct Plan {
    /// How the program runs.
    pub runner: Runner,
    /// The allocators, in report order.
    pub allocators: Vec<LiveAllocator>,
    /// The largest device, bytes (a multiple of `step`): the first run.
    pub max_memory: u64,
    /// The bisection's resolution, bytes.
    pub step: u64,
    /// Whether to search for the smallest device.
    pub bisect: bool,
}

/// One allocator's results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The allocator spec.
    pub allocator: String,
    /// The run on the largest device.
    pub largest: Probe,
    /// The smallest device on which the program completes (`None`: it did
    /// not complete on the largest, or no bisection ran).
    pub smallest_device_bytes: Option<u64>,
    /// The run on that smallest device.
    pub at_smallest: Option<Probe>,
    /// The run one step below it, where one ran (its error says what failed).
    pub below_smallest: Option<Probe>,
    /// Every size the bisection probed, in order, and whether it completed.
    pub probes: Vec<(u64, bool)>,
}

/// Measure every allocator of `plan`, one process at a time; `progress`
/// gets a line per run.
pub fn measure(plan: &Plan, progress: &mut dyn FnMut(&str)) -> Result<Vec<Row>, ProbeError> {
    plan.runner.prepare()?;
    let mut n = 0usize;
    let mut rows = Vec::new();
    for a in &plan.allocators {
        let mut run = |memory: u64, progress: &mut dyn FnMut(&str)| -> Result<Probe, ProbeError> {
            n += 1;
            let probe = plan.runner.run(a, memory, None, n)?;
            plan.runner.forget(n);
            progress(&format!(
                "live: {} on {}: {} ({:.1} s)",
                a.spec,
                size_text(memory),
                if probe.completed {
                    "completed".to_string()
                } else {
                    probe.error.as_ref().map_or_else(
                        || "failed".to_string(),
                        |e| {
                            if e.oom {
                                "out of memory".into()
                            } else {
                                format!("failed: {}", e.kind)
                            }
                        },
                    )
                },
                probe.wall_s
            ));
            Ok(probe)
        };
        let largest = run(plan.max_memory, progress)?;
        let mut row = Row {
            allocator: a.spec.clone(),
            largest: largest.clone(),
            smallest_device_bytes: None,
            at_smallest: None,
            below_smallest: None,
            probes: Vec::new(),
        };
        if largest.completed && plan.bisect {
            let mut seen: BTreeMap<u64, Probe> = BTreeMap::new();
            seen.insert(plan.max_memory, largest.clone());
            let bounds = Bounds {
                max: plan.max_memory,
                step: plan.step,
                floor: largest.figures.peak_allocated_bytes,
                hint: largest.figures.peak_reserved_bytes,
            };
            let found = smallest_device(bounds, |memory| {
                let p = run(memory, progress)?;
                let ok = p.completed;
                seen.insert(memory, p);
                Ok::<bool, ProbeError>(ok)
            })?;
            row.smallest_device_bytes = Some(found.smallest);
            row.at_smallest = seen.get(&found.smallest).cloned();
            row.below_smallest = found
                .smallest
                .checked_sub(plan.step)
                .and_then(|below| seen.get(&below).cloned());
            row.probes = found.probes;
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Why a finished run counts as failed (exit status 1), if it does: an
/// allocator on which the program did not complete on the largest device;
/// when none completed, the program's error.
pub fn verdict(rows: &[Row], max_memory: u64) -> Result<(), String> {
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.largest.completed).collect();
    if failed.is_empty() {
        return Ok(());
    }
    let why = |r: &Row| {
        r.largest.error.as_ref().map_or_else(
            || "failed".to_string(),
            |e| format!("{}: {}", e.kind, e.message),
        )
    };
    if failed.len() == rows.len() {
        return Err(format!(
            "the program fails under every allocator on the largest device ({}): {}",
            size_text(max_memory),
            why(failed[0])
        ));
    }
    let names: Vec<String> = failed
        .iter()
        .map(|r| format!("{} ({})", r.allocator, why(r)))
        .collect();
    Err(format!(
        "the program did not complete on the largest device ({}) under {}",
        size_text(max_memory),
        names.join(", ")
    ))
}
