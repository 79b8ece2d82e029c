//! Fault-injection sweep: every allocator the registry knows, on several
//! workloads, with one VMM driver call failed at a time.
//!
//! For a workload and an allocator, a clean run first counts the VMM calls the
//! run makes (allocator construction, the workload's events, freeing what is
//! left, `empty_cache`; drop excluded). Then, for each chosen call index `k`, a
//! fresh run arms `Fault::nth_overall(k)` (CUDA's error for that call: out of
//! memory for create, invalid value for the others) and checks:
//!
//! - the operation that hit the fault either recovered by itself (`Ok`) or
//!   returned a typed error (`AllocError::Driver` or `AllocError::OutOfMemory`),
//!   with the allocated bytes unchanged;
//! - the allocator's and the simulated driver's invariants hold at once;
//! - retrying the failed operation once succeeds, and the rest of the run
//!   completes (the device is sized well above the clean run's needs);
//! - after everything is freed, `empty_cache` and drop, the simulated device's
//!   leak report is empty.
//!
//! The default sweep tries an evenly spread sample of call indices (at least
//! 500 over all workloads and allocators); the full sweep, every index, runs with
//! `cargo test --release -p quilt-bench --test fault_sweep -- --ignored`.
//!
//! Also: partial failures inside one operation (the 5th map call of a stitched
//! or paged allocation fails; a pool growth fails) leave nothing behind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use common::traces_dir;
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_bench::allocators::{self, RegistryError, ALLOCATOR_NAMES};
use quilt_bench::trace::{load_trace, Event};
use quilt_bench::workloads;
use quilt_vmm::sim::{Fault, SimVmm};
use quilt_vmm::{CallKind, DevicePtr, StreamId, Vmm, VmmError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A workload of the sweep: events and a device size comfortably above what
/// every allocator needs for it.
struct Workload {
    name: String,
    events: Vec<Event>,
    capacity: u64,
    /// `empty_cache` after every this many events (0: only at the end), so
    /// that faults land in the reclaim paths while blocks are live.
    empty_cache_every: usize,
}

/// The operations of a run of `w`: its events (with `empty_cache` every
/// `w.empty_cache_every` events), then frees of what it left live, then
/// `empty_cache`.
fn ops_of(w: &Workload) -> Vec<Op> {
    let mut ops = Vec::with_capacity(w.events.len() * 2);
    let mut live = std::collections::BTreeSet::new();
    for (i, e) in w.events.iter().enumerate() {
        match *e {
            Event::Alloc { id, size, stream } => {
                live.insert(id);
                ops.push(Op::Alloc { id, size, stream });
            }
            Event::Free { id } => {
                live.remove(&id);
                ops.push(Op::Free { id });
            }
            other => panic!("{other:?}: these workloads allocate and free only"),
        }
        if w.empty_cache_every > 0 && (i + 1) % w.empty_cache_every == 0 {
            ops.push(Op::EmptyCache);
        }
    }
    ops.extend(live.into_iter().map(|id| Op::Free { id }));
    ops.push(Op::EmptyCache);
    ops
}

/// The first `max_events` events of `events` (every run frees what is left
/// live at its end).
fn prefix(events: Vec<Event>, max_events: usize) -> Vec<Event> {
    events.into_iter().take(max_events).collect()
}

/// Peak of the live requested bytes of `events`.
fn peak_live(events: &[Event]) -> u64 {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for e in events {
        match *e {
            Event::Alloc { id, size, .. } => {
                live.insert(id, size);
                now += size;
                peak = peak.max(now);
            }
            Event::Free { id } => now -= live.remove(&id).unwrap_or(0),
            other => panic!("{other:?}: these workloads allocate and free only"),
        }
    }
    peak
}

fn workload(name: &str, events: Vec<Event>) -> Workload {
    // Twice the live peak plus slack for segment rounding, per-stream caches
    // and the pool's growth margin; every clean run is checked to complete.
    let capacity = (peak_live(&events) * 2 + 2 * GIB).next_multiple_of(2 * MIB);
    Workload {
        name: name.to_string(),
        events,
        capacity,
        empty_cache_every: 0,
    }
}

/// A real trace from the shared folder (a prefix of it), or `None` with a note.
fn real_trace(stem: &str, max_events: usize) -> Option<Workload> {
    let path = traces_dir().join(format!("{stem}.trace"));
    if !path.exists() {
        eprintln!(
            "fault_sweep: {} is absent: skipping the real trace `{stem}`",
            path.display()
        );
        return None;
    }
    let trace = load_trace(&path).unwrap();
    Some(workload(
        &format!("{stem}[..{max_events}]"),
        prefix(trace.events, max_events),
    ))
}

fn generated(name: &str, seed: u64, max_events: usize) -> Workload {
    let w = workloads::find(name).unwrap();
    let trace = (w.generate)(seed);
    workload(
        &format!("{name}(seed {seed})[..{max_events}]"),
        prefix(trace.events, max_events),
    )
}

/// Build `name` on `vmm`; `None` (with a note) when it is not in this build yet.
fn build(name: &str, vmm: Arc<dyn Vmm>) -> Result<Option<Box<dyn DeviceAllocator>>, AllocError> {
    match allocators::build(name, vmm) {
        Ok(a) => Ok(Some(a)),
        Err(RegistryError::Construct { source, .. }) => Err(source),
        Err(other) => {
            eprintln!("fault_sweep: {other}: skipped");
            Ok(None)
        }
    }
}

/// The allocators of the registry that this build has.
fn available_allocators() -> Vec<&'static str> {
    let mut out = Vec::new();
    for name in ALLOCATOR_NAMES {
        let sim = Arc::new(SimVmm::with_capacity(GIB).unwrap());
        match build(name, sim) {
            Ok(Some(_)) => out.push(name),
            Ok(None) => eprintln!("fault_sweep: allocator `{name}` is not in this build: skipped"),
            Err(e) => panic!("building `{name}` on a clean device failed: {e}"),
        }
    }
    assert!(!out.is_empty(), "no allocator available");
    out
}

/// One operation of a run.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc { id: u64, size: u64, stream: u64 },
    Free { id: u64 },
    EmptyCache,
}

/// What one run (clean or with a fault) came to.
#[derive(Debug, Default)]
struct RunReport {
    /// VMM calls made before drop.
    vmm_calls: u64,
    /// The fault fired during construction, which failed with a typed error.
    fired_in_construction: bool,
    /// The operation the fault fired in, if any.
    fired_in: Option<String>,
    /// The operation recovered by itself (returned `Ok`).
    recovered_internally: bool,
    /// Kind of the call that was failed (from the driver's failure counters).
    failed_kind: Option<CallKind>,
    /// Allocations that ran out of memory after the fault (tolerated only
    /// under memory pressure, see [`Tolerance`]).
    ooms_after_fault: u64,
}

/// What a run tolerates after the fault has fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tolerance {
    /// Nothing: the device is large, so the rest of the run must complete.
    Strict,
    /// The device is tight (a little above the clean run's minimum): an
    /// allocation after the fault may run out of memory (the state after a
    /// failed operation need not match the clean run's), and is skipped.
    OomAfterFault,
}

fn check_all(alloc: &dyn DeviceAllocator, sim: &SimVmm, ctx: &str) {
    if let Err(v) = alloc.check_invariants() {
        panic!("{ctx}: allocator invariant broken: {v}");
    }
    if let Err(v) = sim.check_invariants() {
        panic!("{ctx}: simulated driver invariant broken: {v}");
    }
}

/// The errors an operation may return when a driver call it made failed: the
/// driver's error passed on (`VmmError::Driver`, CUDA's code, or the driver's
/// out-of-memory) or the allocator's out-of-memory. A rule the driver enforces
/// (`AlreadyMapped`, `NotMapped`, `StillMapped`, `InvalidArgument`) broken on
/// the way is a bug in the allocator, not a way to report the fault.
fn typed_fault_error(e: &AllocError) -> bool {
    match e {
        AllocError::OutOfMemory(_) => true,
        AllocError::Driver(v) => {
            matches!(v, VmmError::Driver { .. } | VmmError::OutOfMemory { .. })
        }
        _ => false,
    }
}

/// Run `w` on `allocator` with `fault` armed before construction (`None`:
/// clean). Every check of the module documentation is an assertion here.
fn run(w: &Workload, allocator: &str, fault: Option<Fault>, check_every: usize) -> RunReport {
    run_at(
        w,
        allocator,
        w.capacity,
        fault,
        check_every,
        Tolerance::Strict,
    )
}

/// [`run`] on a device of `capacity` bytes, with `tolerance`.
fn run_at(
    w: &Workload,
    allocator: &str,
    capacity: u64,
    fault: Option<Fault>,
    check_every: usize,
    tolerance: Tolerance,
) -> RunReport {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let ctx = format!("{} on {} with fault {:?}", allocator, w.name, fault);
    if let Some(f) = &fault {
        sim.inject(f.clone());
    }
    let mut report = RunReport::default();
    let alloc = match build(allocator, sim.clone()) {
        Ok(Some(a)) => a,
        Ok(None) => unreachable!("only available allocators are swept"),
        Err(e) => {
            assert!(
                fault.is_some() && sim.armed_faults() == 0,
                "{ctx}: construction failed without a fault: {e}"
            );
            assert!(
                typed_fault_error(&e),
                "{ctx}: construction failed with {e:?}"
            );
            let leaks = sim.leak_report();
            assert!(
                leaks.is_empty(),
                "{ctx}: failed construction leaked: {leaks}"
            );
            report.fired_in_construction = true;
            report.failed_kind = failed_kind(&sim);
            return report;
        }
    };
    let mut live: BTreeMap<u64, DevicePtr> = BTreeMap::new();
    let ops = ops_of(w);

    for (i, op) in ops.iter().enumerate() {
        let armed_before = sim.armed_faults() > 0;
        let allocated_before = alloc.stats().allocated_bytes.current;
        let result = apply(alloc.as_ref(), &sim, &mut live, *op);
        let fired_now = armed_before && sim.armed_faults() == 0;
        if fired_now {
            report.fired_in = Some(format!("op {i} {op:?}"));
            report.failed_kind = failed_kind(&sim);
            check_all(
                alloc.as_ref(),
                &sim,
                &format!("{ctx}, right after op {i} {op:?}"),
            );
            match result {
                Ok(()) => report.recovered_internally = true,
                Err(e) => {
                    assert!(
                        typed_fault_error(&e),
                        "{ctx}: op {i} {op:?} hit the fault and returned {e:?}"
                    );
                    assert_eq!(
                        alloc.stats().allocated_bytes.current,
                        allocated_before,
                        "{ctx}: op {i} {op:?} failed but changed the allocated bytes"
                    );
                    match apply(alloc.as_ref(), &sim, &mut live, *op) {
                        Ok(()) => {}
                        Err(e) if tolerance == Tolerance::OomAfterFault && is_oom(&e) => {
                            report.ooms_after_fault += 1;
                        }
                        Err(e) => {
                            panic!("{ctx}: retry of op {i} {op:?} after the fault failed: {e}")
                        }
                    }
                    check_all(
                        alloc.as_ref(),
                        &sim,
                        &format!("{ctx}, after the retry of op {i}"),
                    );
                }
            }
        } else if let Err(e) = result {
            let after = fault.is_some() && sim.armed_faults() == 0;
            if after && tolerance == Tolerance::OomAfterFault && is_oom(&e) {
                report.ooms_after_fault += 1;
                continue;
            }
            panic!(
                "{ctx}: op {i} {op:?} failed ({}): {e}",
                if sim.armed_faults() == 0 && fault.is_some() {
                    "after the fault"
                } else {
                    "before the fault"
                }
            );
        }
        if check_every > 0 && i % check_every == 0 {
            check_all(alloc.as_ref(), &sim, &format!("{ctx}, after op {i}"));
        }
    }
    check_all(alloc.as_ref(), &sim, &format!("{ctx}, at the end"));
    let stats = alloc.stats();
    assert_eq!(
        stats.allocated_bytes.current, 0,
        "{ctx}: bytes still allocated at the end"
    );
    assert_eq!(
        stats.allocation.current, 0,
        "{ctx}: allocations still counted at the end"
    );
    report.vmm_calls = sim.driver_stats().vmm_calls();
    if fault.is_some() {
        assert_eq!(
            sim.armed_faults(),
            0,
            "{ctx}: the fault never fired ({} VMM calls made)",
            report.vmm_calls
        );
    }
    drop(alloc);
    let leaks = sim.leak_report();
    assert!(leaks.is_empty(), "{ctx}: after drop: {leaks}");
    report
}

fn failed_kind(sim: &SimVmm) -> Option<CallKind> {
    let stats = sim.driver_stats();
    CallKind::ALL
        .into_iter()
        .find(|k| stats.failed[k.index()] > 0)
}

fn is_oom(e: &AllocError) -> bool {
    match e {
        AllocError::OutOfMemory(_) => true,
        AllocError::Driver(v) => v.is_out_of_memory(),
        _ => false,
    }
}

/// Apply `op`; a free of an id that is not live (its allocation was skipped
/// after an out-of-memory) is skipped too.
fn apply(
    alloc: &dyn DeviceAllocator,
    sim: &SimVmm,
    live: &mut BTreeMap<u64, DevicePtr>,
    op: Op,
) -> Result<(), AllocError> {
    if let Op::Free { id } = op {
        if !live.contains_key(&id) {
            return Ok(());
        }
    }
    match op {
        Op::Alloc { id, size, stream } => {
            let a = alloc.allocate(size, StreamId(stream))?;
            live.insert(id, a.ptr);
        }
        Op::Free { id } => {
            let ptr = live[&id];
            alloc.free(ptr)?;
            live.remove(&id);
            sim.complete_all();
        }
        Op::EmptyCache => alloc.empty_cache()?,
    }
    Ok(())
}

/// Up to `n` call indices spread evenly over `1..=calls`, always including both ends.
fn spread(calls: u64, n: u64) -> Vec<u64> {
    if calls == 0 {
        return Vec::new();
    }
    if n >= calls {
        return (1..=calls).collect();
    }
    let mut out: Vec<u64> = (0..n)
        .map(|i| 1 + i * (calls - 1) / (n - 1).max(1))
        .collect();
    out.dedup();
    out
}

/// The faults to try on a run of `calls` VMM calls: up to `points` indices of
/// any kind spread over the run, plus up to `points / 8` indices of each kind
/// the clean run makes (so that a rare kind, such as create, is never missed);
/// `None`: every index.
fn fault_points(
    w: &Workload,
    allocator: &str,
    capacity: u64,
    calls: u64,
    points: Option<u64>,
) -> Vec<Fault> {
    let mut faults: Vec<Fault> = match points {
        Some(n) => spread(calls, n)
            .into_iter()
            .map(Fault::nth_overall)
            .collect(),
        None => (1..=calls).map(Fault::nth_overall).collect(),
    };
    if let Some(n) = points {
        for (kind, count) in clean_calls_by_kind(w, allocator, capacity) {
            faults.extend(
                spread(count, (n / 8).max(2))
                    .into_iter()
                    .map(|i| Fault::nth(kind, i)),
            );
        }
    }
    faults
}

/// VMM calls of `kind` made by a clean run (counted again: the clean run's
/// driver statistics are gone with its device).
fn clean_calls_by_kind(w: &Workload, allocator: &str, capacity: u64) -> BTreeMap<CallKind, u64> {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let alloc = build(allocator, sim.clone()).unwrap().unwrap();
    let mut live = BTreeMap::new();
    for op in ops_of(w) {
        apply(alloc.as_ref(), &sim, &mut live, op).unwrap();
    }
    let stats = sim.driver_stats();
    CallKind::ALL
        .into_iter()
        .filter(|k| k.is_vmm() && stats.count(*k) > 0)
        .map(|k| (k, stats.count(k)))
        .collect()
}

/// Totals of a sweep of one workload.
#[derive(Default)]
struct Tally {
    tried: u64,
    survived: u64,
    recovered_internally: u64,
    in_construction: u64,
    by_kind: BTreeMap<String, u64>,
}

/// Sweep `w` over every available allocator with up to `points` fault indices
/// of any kind each, plus up to `points / 8` indices of each kind of call the
/// clean run makes (so that a rare kind, such as create, is never missed);
/// `None`: every index. Prints the figures; returns the points tried.
fn sweep(w: &Workload, points: Option<u64>) -> u64 {
    let mut total = 0;
    let mut failed = 0u64;
    let mut failures: Vec<String> = Vec::new();
    for name in available_allocators() {
        let clean = run(w, name, None, 1);
        let calls = clean.vmm_calls;
        // `None` is every index, up to `QUILT_FULL_SWEEP_MAX` (default 3000)
        // spread over the run when the run makes more calls than that.
        let points = points.or_else(|| {
            let max = std::env::var("QUILT_FULL_SWEEP_MAX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(3000u64);
            (calls > max).then_some(max)
        });
        let faults = fault_points(w, name, w.capacity, calls, points);
        let mut tally = Tally::default();
        for fault in faults {
            tally.tried += 1;
            // `run` panics on any broken promise: a run that returns survived.
            let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(w, name, Some(fault.clone()), 0)
            }));
            let r = match attempt {
                Ok(r) => r,
                Err(p) => {
                    let msg = panic_message(&p);
                    if failures.len() < 10 {
                        failures.push(format!("{name} on {} with {fault:?}: {msg}", w.name));
                    }
                    failed += 1;
                    continue;
                }
            };
            tally.survived += 1;
            tally.recovered_internally += u64::from(r.recovered_internally);
            tally.in_construction += u64::from(r.fired_in_construction);
            if let Some(kind) = r.failed_kind {
                *tally
                    .by_kind
                    .entry(kind.driver_name().to_string())
                    .or_default() += 1;
            }
        }
        eprintln!(
            "fault_sweep: {:<11} {:<44} events {:>5} clean VMM calls {:>5}: tried {:>5}, survived {:>5} \
             (recovered inside the op {}, in construction {}); failed calls by kind {:?}",
            name,
            w.name,
            w.events.len(),
            calls,
            tally.tried,
            tally.survived,
            tally.recovered_internally,
            tally.in_construction,
            tally.by_kind
        );
        total += tally.tried;
    }
    assert!(
        failures.is_empty(),
        "{failed} fault point(s) broke a promise on {}; the first ones:\n{}",
        w.name,
        failures.join("\n")
    );
    total
}

/// The message of a caught panic.
fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "(a panic without a message)".to_string()
    }
}

// ------------------------------------------------------------------ the sweeps

/// Points per (workload, allocator) in the default sweep.
const DEFAULT_POINTS: u64 = 48;

fn sweep_workloads(full: bool) -> Vec<Workload> {
    let mut out = Vec::new();
    let real_len = if full { 4000 } else { 1500 };
    out.extend(real_trace("cnn_counterfactual_eor", real_len));
    out.extend(real_trace("opt_zo_fedlearn_finetune", real_len));
    let gen_len = if full { 3000 } else { 1200 };
    out.push(generated("train-varlen", 7, gen_len));
    out.push(generated("llm-serving", 7, gen_len));
    out
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn fault_sweep_real_cnn() {
    let w = real_trace("cnn_counterfactual_eor", 1500).expect("the real trace");
    let tried = sweep(&w, Some(DEFAULT_POINTS));
    assert!(tried > 0);
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn fault_sweep_real_opt_zo() {
    let w = real_trace("opt_zo_fedlearn_finetune", 1500).expect("the real trace");
    let tried = sweep(&w, Some(DEFAULT_POINTS));
    assert!(tried > 0);
}

/// The sampled sweep with `empty_cache` every 100 events, so that faults land
/// in releasing cached memory while blocks are live (Quilt: unmapping cached
/// mappings and remapping the pages that live blocks still touch).
#[test]
fn fault_sweep_with_empty_cache_midway() {
    let mut ws = Vec::new();
    ws.extend(real_trace("cnn_counterfactual_eor", 1500));
    ws.extend(real_trace("opt_zo_fedlearn_finetune", 1500));
    ws.push(generated("llm-serving", 5, 600));
    for mut w in ws {
        w.empty_cache_every = 100;
        w.name = format!("{} + empty_cache/100", w.name);
        assert!(sweep(&w, Some(32)) > 0);
    }
}

#[test]
fn fault_sweep_train_varlen() {
    let w = generated("train-varlen", 7, 1200);
    let tried = sweep(&w, Some(DEFAULT_POINTS));
    assert!(tried > 0);
}

#[test]
fn fault_sweep_llm_serving() {
    let w = generated("llm-serving", 7, 1200);
    let tried = sweep(&w, Some(DEFAULT_POINTS));
    assert!(tried > 0);
}

/// Every call index of every workload and allocator (capped at
/// `QUILT_FULL_SWEEP_MAX` indices, default 3000, spread over the run, for runs
/// that make more calls; GMLake's one-page-per-call runs make tens of
/// thousands). `QUILT_FULL_SWEEP_ONLY=<substring>` keeps the workloads whose
/// name contains it. Tens of minutes in release.
#[test]
#[ignore = "every call index, tens of minutes: run with --ignored (docs/reliability.md)"]
fn fault_sweep_full() {
    let only = std::env::var("QUILT_FULL_SWEEP_ONLY").unwrap_or_default();
    let mut total = 0;
    for w in sweep_workloads(true)
        .into_iter()
        .filter(|w| w.name.contains(&only))
    {
        total += sweep(&w, None);
    }
    eprintln!("fault_sweep_full: {total} fault points tried and survived");
}

// ------------------------------------------------- failures inside one operation

/// A device big enough for every case below, with nothing alive.
fn device() -> Arc<SimVmm> {
    Arc::new(SimVmm::with_capacity(16 * GIB).unwrap())
}

/// Free `live`, empty the cache, drop `alloc`, and check the device is clean.
fn tear_down(alloc: Box<dyn DeviceAllocator>, sim: &SimVmm, live: &[DevicePtr], ctx: &str) {
    sim.clear_faults();
    for &p in live {
        alloc.free(p).unwrap();
    }
    sim.complete_all();
    alloc.empty_cache().unwrap();
    check_all(alloc.as_ref(), sim, ctx);
    drop(alloc);
    let leaks = sim.leak_report();
    assert!(leaks.is_empty(), "{ctx}: after drop: {leaks}");
}

/// The 5th `cuMemMap` of one allocation fails: the maps before it are undone,
/// the pages go back to the pool (or the handles to the driver), nothing is
/// counted as allocated, and the same request succeeds on retry.
#[test]
fn fifth_map_of_one_allocation_fails_and_the_four_before_are_undone() {
    // 600 MiB: above GMLake's 512 MiB stitch threshold; 300 pages of 2 MiB.
    const SIZE: u64 = 600 * MIB;
    let mut fired = Vec::new();
    let mut cases: Vec<(String, Arc<SimVmm>, Box<dyn DeviceAllocator>)> = Vec::new();
    for name in available_allocators() {
        let sim = device();
        let a = build(name, sim.clone()).unwrap().unwrap();
        cases.push((name.to_string(), sim, a));
    }
    for (name, sim, alloc) in cases {
        let ctx = format!("{name}: 5th map fails");
        // Something live first, so that "as before" is not "empty".
        let keep = alloc.allocate(3 * MIB, StreamId(0)).unwrap();
        let mapped = sim.mapped_bytes();
        let allocated = alloc.stats().allocated_bytes.current;
        let before = sim.driver_stats();
        sim.inject(Fault::nth(CallKind::Map, 5));
        let result = alloc.allocate(SIZE, StreamId(0));
        let during = sim.driver_stats().since(&before);
        check_all(alloc.as_ref(), &sim, &ctx);
        let mut live = vec![keep.ptr];
        match result {
            Ok(a) => {
                // Fewer than 5 map calls (one per segment or per run of
                // neighbouring pages), or the allocator retried by itself.
                assert!(
                    sim.armed_faults() == 1 || during.failed[CallKind::Map.index()] == 1,
                    "{ctx}: fault state unclear"
                );
                live.push(a.ptr);
            }
            Err(e) => {
                assert!(typed_fault_error(&e), "{ctx}: {e:?}");
                assert_eq!(
                    sim.armed_faults(),
                    0,
                    "{ctx}: failed without the fault: {e}"
                );
                fired.push(name.clone());
                let maps_ok = during.count(CallKind::Map) - 1;
                assert!(
                    maps_ok >= 4,
                    "{ctx}: only {maps_ok} maps before the failure"
                );
                assert_eq!(
                    sim.mapped_bytes(),
                    mapped,
                    "{ctx}: the {maps_ok} maps before the failure were not all undone"
                );
                assert!(
                    during.count(CallKind::Unmap) >= maps_ok,
                    "{ctx}: {} unmaps for {maps_ok} maps",
                    during.count(CallKind::Unmap)
                );
                assert_eq!(alloc.stats().allocated_bytes.current, allocated, "{ctx}");
                let physical = sim.physical_in_use();
                let retry_start = sim.driver_stats();
                let a = alloc.allocate(SIZE, StreamId(0)).unwrap_or_else(|e| {
                    panic!("{ctx}: retry failed: {e}");
                });
                let retry = sim.driver_stats().since(&retry_start);
                // The pages of the failed attempt are reused (no new create), or
                // were given back to the driver.
                assert!(
                    retry.count(CallKind::Create) == 0 || physical <= sim.physical_in_use(),
                    "{ctx}: retry made {} creates",
                    retry.count(CallKind::Create)
                );
                eprintln!(
                    "fault_sweep: {ctx}: {maps_ok} maps undone by {} unmaps; retry made {} creates",
                    during.count(CallKind::Unmap),
                    retry.count(CallKind::Create)
                );
                live.push(a.ptr);
                check_all(alloc.as_ref(), &sim, &ctx);
            }
        }
        tear_down(alloc, &sim, &live, &ctx);
    }
    eprintln!("fault_sweep: the 5th map failed inside one allocation for: {fired:?}");
    for must in ["gmlake", "quilt"] {
        assert!(
            fired.iter().any(|n| n == must),
            "{must}: the 5th map never failed"
        );
    }
}

/// A pool growth whose `cuMemCreate` fails leaves the pool and the driver as
/// they were; the retry succeeds.
#[test]
fn failed_growth_leaves_the_pool_as_it_was() {
    for name in available_allocators() {
        let sim = device();
        let alloc = build(name, sim.clone()).unwrap().unwrap();
        let ctx = format!("{name}: create fails during growth");
        let keep = alloc.allocate(64 * MIB, StreamId(0)).unwrap();
        let physical = sim.physical_in_use();
        let counts = sim.live_counts();
        let mapped = sim.mapped_bytes();
        let reserved = alloc.stats().reserved_bytes.current;
        let allocated = alloc.stats().allocated_bytes.current;
        sim.inject(Fault::nth(CallKind::Create, 1));
        let result = alloc.allocate(4 * GIB, StreamId(0));
        check_all(alloc.as_ref(), &sim, &ctx);
        let mut live = vec![keep.ptr];
        match result {
            Ok(a) => {
                // It retried the growth (or needed none).
                live.push(a.ptr);
            }
            Err(e) => {
                assert!(typed_fault_error(&e), "{ctx}: {e:?}");
                assert_eq!(
                    sim.armed_faults(),
                    0,
                    "{ctx}: failed without the fault: {e}"
                );
                assert_eq!(sim.physical_in_use(), physical, "{ctx}: physical memory");
                assert_eq!(
                    sim.live_counts(),
                    counts,
                    "{ctx}: handles, reservations, mappings"
                );
                assert_eq!(sim.mapped_bytes(), mapped, "{ctx}: mapped bytes");
                let stats = alloc.stats();
                assert_eq!(
                    stats.reserved_bytes.current, reserved,
                    "{ctx}: reserved bytes"
                );
                assert_eq!(
                    stats.allocated_bytes.current, allocated,
                    "{ctx}: allocated bytes"
                );
                live.push(alloc.allocate(4 * GIB, StreamId(0)).unwrap().ptr);
            }
        }
        tear_down(alloc, &sim, &live, &ctx);
    }
}

/// Quilt's page pool itself: a failed growth leaves its page counts unchanged,
/// and a failed stitch gives every page back.
#[test]
fn quilt_pool_counts_survive_failed_growth_and_failed_stitch() {
    use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    for (label, cfg) in [
        ("quilt", QuiltConfig::default()),
        ("gmlake", QuiltConfig::gmlake()),
    ] {
        let sim = device();
        let alloc = QuiltAllocator::new(sim.clone(), cfg).unwrap();
        let keep = alloc.allocate(5 * MIB, StreamId(0)).unwrap();
        let (total, free) = (
            alloc.pool_stats().total_pages,
            alloc.pool_stats().free_pages,
        );
        // Every create fails (one failure alone, Quilt retries after reclaiming).
        sim.inject(Fault::always(CallKind::Create));
        let r = alloc.allocate(2 * GIB, StreamId(0));
        sim.clear_faults();
        assert!(r.is_err(), "{label}: growth should have failed");
        assert_eq!(
            alloc.pool_stats().total_pages,
            total,
            "{label}: pool pages after failed growth"
        );
        assert_eq!(
            alloc.pool_stats().free_pages,
            free,
            "{label}: free pages after failed growth"
        );
        alloc.check_invariants().unwrap();
        alloc.check_invariants().unwrap();

        // Now let growth succeed and the 5th map fail: pages come back to the pool.
        sim.inject(Fault::nth(CallKind::Map, 5));
        // Every page is its own map call: the 5th map fails.
        let r = alloc.allocate(600 * MIB, StreamId(0));
        assert!(r.is_err(), "{label}: the 5th map should have failed");
        assert_eq!(
            alloc.pool_stats().free_pages,
            alloc.pool_stats().total_pages - (total - free),
            "{label}: pages of the failed stitch not all back in the pool"
        );
        alloc.check_invariants().unwrap();
        alloc.check_invariants().unwrap();
        sim.clear_faults();
        let mut live = vec![keep.ptr];
        if let Ok(a) = r {
            live.push(a.ptr);
        }
        tear_down(Box::new(alloc), &sim, &live, label);
    }
}

// ------------------------------------------------------ under memory pressure

/// The sweep on a tight device: 10 % above the smallest capacity at which the
/// clean run completes (found by bisection), so that reclaiming, releasing
/// cached segments and retrying run, and faults land in those paths too. After
/// the fault an allocation may run out of memory (the state after a failed
/// operation need not match the clean run's) except for Quilt, whose promise
/// is that out-of-memory means capacity: a transient driver failure must not
/// leave it needing more memory than the clean run.
fn pressure_sweep(w: &Workload, points: u64) -> u64 {
    use quilt_bench::bisect::min_capacity_bytes;
    use quilt_bench::replay::ReplayConfig;
    use quilt_bench::trace::Trace;
    let trace = Trace {
        name: w.name.clone(),
        events: w.events.clone(),
        preexisting: 0,
    };
    let peak = peak_live(&w.events);
    let mut total = 0;
    for name in available_allocators() {
        let min = min_capacity_bytes(&trace, name, peak, &ReplayConfig::default())
            .unwrap()
            .unwrap_or_else(|| panic!("{name} does not complete {} at 2x its peak", w.name));
        let capacity = min;
        let clean = run_at(w, name, capacity, None, 1, Tolerance::Strict);
        let faults = fault_points(w, name, capacity, clean.vmm_calls, Some(points));
        let (mut tried, mut ooms, mut runs_with_oom) = (0u64, 0u64, 0u64);
        for fault in faults {
            let r = run_at(w, name, capacity, Some(fault), 0, Tolerance::OomAfterFault);
            tried += 1;
            ooms += r.ooms_after_fault;
            runs_with_oom += u64::from(r.ooms_after_fault > 0);
        }
        eprintln!(
            "fault_sweep (pressure): {name:<11} {:<36} capacity {} MiB (min {} MiB), clean VMM calls {:>5}: \
             tried {tried}, survived {tried}; runs with an OOM after the fault {runs_with_oom} ({ooms} OOMs)",
            w.name,
            capacity / MIB,
            min / MIB,
            clean.vmm_calls
        );
        if name == "quilt" {
            assert_eq!(
                runs_with_oom, 0,
                "quilt ran out of memory after a transient driver failure on {}",
                w.name
            );
        }
        total += tried;
    }
    total
}

#[test]
fn fault_sweep_under_pressure_llm_serving() {
    let w = generated("llm-serving", 11, 1500);
    assert!(pressure_sweep(&w, 32) > 0);
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn fault_sweep_under_pressure_real_opt_zo() {
    let w = real_trace("opt_zo_fedlearn_finetune", 3000).expect("the real trace");
    assert!(pressure_sweep(&w, 32) > 0);
}

// ------------------------------------------------ regressions found by fuzzing

/// Found by `fuzz/alloc_ops` (see docs/reliability.md): a set-access fault
/// around small allocations on two streams. Each operation either succeeds or
/// fails with the injected error; invariants hold after each; a failed one
/// succeeds on retry.
#[test]
fn set_access_faults_around_small_blocks_on_two_streams() {
    for nth in 1..=4 {
        for name in available_allocators() {
            let sim = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
            let alloc = build(name, sim.clone()).unwrap().unwrap();
            let ctx = format!("{name}: set-access call {nth} fails");
            sim.inject(Fault::nth(CallKind::SetAccess, nth));
            let mut live = Vec::new();
            let mut step = |size: u64, stream: u64, keep: bool, what: &str| {
                let a = match alloc.allocate(size, StreamId(stream)) {
                    Ok(a) => a,
                    Err(e) => {
                        assert!(typed_fault_error(&e), "{ctx}: {what}: {e:?}");
                        check_all(
                            alloc.as_ref(),
                            &sim,
                            &format!("{ctx}: after the failed {what}"),
                        );
                        alloc
                            .allocate(size, StreamId(stream))
                            .unwrap_or_else(|e| panic!("{ctx}: retry of {what}: {e:?}"))
                    }
                };
                check_all(alloc.as_ref(), &sim, &format!("{ctx}: after {what}"));
                if keep {
                    live.push(a.ptr);
                } else {
                    alloc.free(a.ptr).unwrap();
                    check_all(
                        alloc.as_ref(),
                        &sim,
                        &format!("{ctx}: after freeing {what}"),
                    );
                }
            };
            step(2 * MIB + 1, 0, false, "2 MiB + 1 on stream 0");
            step(944, 0, true, "944 B on stream 0");
            step(944, 1, true, "944 B on stream 1");
            step(153_600, 3, true, "150 KiB on stream 3");
            tear_down(alloc, &sim, &live, &ctx);
        }
    }
}

// ------------------------------------------------------------ faults at drop

/// Build a state with live, cached and pending blocks on two streams.
fn state_for_drop(name: &str, sim: &Arc<SimVmm>) -> Box<dyn DeviceAllocator> {
    let alloc = build(name, sim.clone()).unwrap().unwrap();
    let mut keep = Vec::new();
    for (i, size) in [700, 3 * MIB, 30 * MIB, 100, 9 * MIB, 600 * MIB]
        .into_iter()
        .enumerate()
    {
        keep.push(alloc.allocate(size, StreamId(i as u64 % 2)).unwrap());
    }
    alloc.free(keep[1].ptr).unwrap();
    alloc.free(keep[2].ptr).unwrap();
    alloc.record_stream(keep[4].ptr, StreamId(5)).unwrap();
    alloc.free(keep[4].ptr).unwrap();
    alloc
}

/// A driver call that fails while an allocator is dropped: `Drop` cannot
/// report it. Measured, not asserted beyond "no panic": how many of the calls
/// made at drop, when failed, leave something behind on the device.
#[test]
fn faults_during_drop_are_measured() {
    for name in available_allocators() {
        let sim = device();
        let alloc = state_for_drop(name, &sim);
        let before = sim.driver_stats().vmm_calls();
        drop(alloc);
        let drop_calls = sim.driver_stats().vmm_calls() - before;
        assert!(sim.leak_report().is_empty(), "{name}: clean drop leaked");
        let mut leaking = 0;
        for k in 1..=drop_calls {
            let sim = device();
            let alloc = state_for_drop(name, &sim);
            sim.inject(Fault::nth_overall(k));
            drop(alloc);
            sim.check_invariants().unwrap();
            if !sim.leak_report().is_empty() {
                leaking += 1;
            }
        }
        eprintln!(
            "fault_sweep (drop): {name:<11} {drop_calls} VMM calls at drop; failing one of them \
             leaves something on the device in {leaking} of {drop_calls} cases"
        );
    }
}

/// Found by `fuzz/alloc_ops` (bug B4 of docs/reliability.md): on a 256 MiB
/// device, a block of 10 599 936 bytes on stream 0, one of 233 472 bytes on
/// stream 3, the first freed, then `empty_cache` with the first set-access call
/// failing. `empty_cache` may fail with the injected error, but the invariants
/// must hold and nothing may stay mapped behind the allocator's back.
#[test]
fn empty_cache_with_a_failing_set_access() {
    for name in available_allocators() {
        let sim = Arc::new(SimVmm::with_capacity(256 * MIB).unwrap());
        let alloc = build(name, sim.clone()).unwrap().unwrap();
        let ctx = format!("{name}: empty_cache, 1st set-access fails");
        let a = alloc.allocate(10_599_936, StreamId(0)).unwrap();
        let b = alloc.allocate(233_472, StreamId(3)).unwrap();
        alloc.free(a.ptr).unwrap();
        check_all(alloc.as_ref(), &sim, &ctx);
        sim.inject(Fault::nth(CallKind::SetAccess, 1));
        if let Err(e) = alloc.empty_cache() {
            assert!(typed_fault_error(&e), "{ctx}: {e:?}");
        }
        check_all(alloc.as_ref(), &sim, &format!("{ctx}, after empty_cache"));
        sim.clear_faults();
        alloc.empty_cache().unwrap();
        check_all(
            alloc.as_ref(),
            &sim,
            &format!("{ctx}, after a second empty_cache"),
        );
        tear_down(alloc, &sim, &[b.ptr], &ctx);
    }
}
