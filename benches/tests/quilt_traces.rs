//! Quilt's default policy on the real traces (`../shared/traces/converted`),
//! through the harness's own replay (the simulated GPU 64 operations behind):
//! at 80 GiB a looped trace makes no VMM call after its first iteration and
//! no stream synchronisation at all, also with its tensors spread over four
//! streams, where cross-stream waits stay rare; and the invariants hold after
//! every event of a whole trace. Without the traces folder (at build time)
//! every test is ignored, with the reason; `cargo test -- --ignored` runs
//! them, and then fails saying the folder is absent. (Figures for other policies: `quilt-bench ab
//! --allocator quilt:KEY=VALUE`, `docs/benchmarks.md`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::traces_dir;
use quilt_bench::allocators;
use quilt_bench::cli::preexisting_from_stats;
use quilt_bench::replay::{replay, replay_fresh, ReplayConfig};
use quilt_bench::trace::{load_trace, Event, Trace};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, Vmm};

const GIB: u64 = 1 << 30;

/// Every trace, with its pre-existing prefix from `stats.json`.
fn traces() -> Vec<Trace> {
    let rd = std::fs::read_dir(traces_dir())
        .unwrap_or_else(|e| panic!("{}: {e} (the real traces)", traces_dir().display()));
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "trace"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let mut t = load_trace(p).unwrap();
            if let Some(n) = preexisting_from_stats(p).unwrap() {
                t.preexisting = n;
            }
            t
        })
        .collect()
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn every_trace_looped_makes_no_driver_call_after_its_first_iteration() {
    let config = ReplayConfig {
        iterations: 3,
        ..ReplayConfig::default()
    };
    for t in traces() {
        let r = replay_fresh(&t, "quilt", 80 * GIB, &config).unwrap();
        assert!(r.completed, "{}: out of memory at 80 GiB", t.name);
        assert_eq!(
            r.driver_after_first_iteration.vmm_calls(),
            0,
            "{}: VMM calls after the first iteration",
            t.name
        );
        assert_eq!(
            r.driver.count(CallKind::StreamSynchronize),
            0,
            "{}: a synchronisation without memory pressure",
            t.name
        );
    }
}

/// Each trace's tensors spread round robin over four streams (artificial: a
/// tensor freed on one stream is reused by the next within the GPU's lag, so
/// cross-stream reuse is constant): no synchronisation, and waits well under
/// one per allocation, each one counted by the allocator and the driver alike.
#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn every_trace_on_four_streams_syncs_never_and_waits_rarely() {
    for mut t in traces() {
        let mut allocations = 0u64;
        for e in &mut t.events {
            if let Event::Alloc { id, stream, .. } = e {
                *stream = *id % 4;
                allocations += 1;
            }
        }
        let config = ReplayConfig::default();
        let sim = Arc::new(SimVmm::new(config.sim_config(80 * GIB)).unwrap());
        let vmm: Arc<dyn Vmm> = sim.clone();
        let alloc = allocators::build("quilt", vmm).unwrap();
        let r = replay(&t, alloc.as_ref(), &sim, &config).unwrap();
        assert!(r.completed, "{}", t.name);
        alloc.check_invariants().unwrap();
        assert_eq!(r.driver.count(CallKind::StreamSynchronize), 0, "{}", t.name);
        let waits = alloc.stats().num_stream_waits;
        assert_eq!(
            r.driver.count(CallKind::StreamWaitEvent),
            waits,
            "{}",
            t.name
        );
        let per = waits as f64 / allocations.max(1) as f64;
        eprintln!(
            "{} on four streams: {waits} waits, {per:.4} per allocation",
            t.name
        );
        assert!(per <= 0.5, "{}: {per:.4} waits per allocation", t.name);
    }
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn invariants_hold_after_every_event_of_a_whole_trace() {
    let Some(t) = traces()
        .into_iter()
        .find(|t| t.name == "cnn_counterfactual_eor")
    else {
        return;
    };
    let config = ReplayConfig {
        iterations: 2,
        check_every: Some(1),
        ..ReplayConfig::default()
    };
    let r = replay_fresh(&t, "quilt", 80 * GIB, &config).unwrap();
    assert!(r.completed);
}
