//! Quilt on the real traces (`../shared/traces/converted/*.trace`): a
//! training-like loop makes no driver call after its first iteration and no
//! stream synchronisation at all at 80 GiB, and (in the ignored `measure_*`
//! tests) the figures quoted in `docs/design.md`. Every test skips, saying
//! so, when the traces folder is absent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, DriverStats, StreamId, Vmm};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Ev {
    Alloc { id: usize, size: u64, stream: u64 },
    Free { id: usize },
}

fn traces_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/converted"
    ))
}

fn load(name: &str) -> Option<Vec<Ev>> {
    let path = traces_dir().join(format!("{name}.trace"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping: trace {} is absent", path.display());
        return None;
    };
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["a", id, size, stream] => out.push(Ev::Alloc {
                id: id.parse().unwrap(),
                size: size.parse().unwrap(),
                stream: stream.parse().unwrap(),
            }),
            ["f", id] => out.push(Ev::Free {
                id: id.parse().unwrap(),
            }),
            _ => panic!("bad trace line {line:?}"),
        }
    }
    Some(out)
}

fn trace_names() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(traces_dir()) else {
        eprintln!("skipping: {} is absent", traces_dir().display());
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().map(|s| s.to_string()))
        .filter_map(|n| n.strip_suffix(".trace").map(|s| s.to_string()))
        .collect();
    v.sort();
    v
}

/// Split a trace into a prefix (allocations live at the start and never freed
/// in the window) and a loop body that, repeated, is the same every iteration:
/// pre-existing allocations that the window frees are allocated at its start.
fn loop_body(events: &[Ev]) -> (Vec<Ev>, Vec<Ev>) {
    let mut freed = std::collections::HashSet::new();
    for e in events {
        if let Ev::Free { id } = e {
            freed.insert(*id);
        }
    }
    // Pre-existing: the leading run of allocations before the first free.
    let first_free = events
        .iter()
        .position(|e| matches!(e, Ev::Free { .. }))
        .unwrap_or(events.len());
    let mut prefix = Vec::new();
    let mut body = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match e {
            Ev::Alloc { id, .. } if i < first_free && !freed.contains(id) => prefix.push(*e),
            _ => body.push(*e),
        }
    }
    (prefix, body)
}

struct Replay {
    sim: Arc<SimVmm>,
    a: Box<dyn DeviceAllocator>,
    live: HashMap<usize, (u64, u64)>,
    live_bytes: u64,
    peak_live: u64,
    ooms: u64,
}

impl Replay {
    fn new(capacity: u64, config: QuiltConfig) -> Replay {
        let sim = SimVmm::new(SimConfig {
            capacity,
            ..SimConfig::default()
        })
        .unwrap();
        let sim = Arc::new(sim);
        let v: Arc<dyn Vmm> = sim.clone();
        Replay {
            sim,
            a: Box::new(QuiltAllocator::new(v, config).unwrap()),
            live: HashMap::new(),
            live_bytes: 0,
            peak_live: 0,
            ooms: 0,
        }
    }

    fn expandable(capacity: u64) -> Replay {
        use quilt_alloc::baselines::expandable::{ExpandableAllocator, ExpandableConfig};
        let sim = SimVmm::new(SimConfig {
            capacity,
            ..SimConfig::default()
        })
        .unwrap();
        let sim = Arc::new(sim);
        let v: Arc<dyn Vmm> = sim.clone();
        Replay {
            sim,
            a: Box::new(ExpandableAllocator::new(v, ExpandableConfig::default()).unwrap()),
            live: HashMap::new(),
            live_bytes: 0,
            peak_live: 0,
            ooms: 0,
        }
    }

    /// Run events. Stops at the first OOM (returns false).
    fn run(&mut self, events: &[Ev], check: bool) -> bool {
        for e in events {
            match *e {
                Ev::Alloc { id, size, stream } => match self.a.allocate(size, StreamId(stream)) {
                    Ok(al) => {
                        self.live.insert(id, (al.ptr, size));
                        self.live_bytes += size;
                        self.peak_live = self.peak_live.max(self.live_bytes);
                    }
                    Err(e) => {
                        assert!(e.oom_report().is_some(), "{e}");
                        self.ooms += 1;
                        return false;
                    }
                },
                Ev::Free { id } => {
                    if let Some((p, size)) = self.live.remove(&id) {
                        self.a.free(p).unwrap();
                        self.live_bytes -= size;
                    }
                }
            }
            if check {
                self.a.check_invariants().unwrap();
            }
        }
        true
    }

    fn free_all_but(&mut self, keep: &std::collections::HashSet<usize>) {
        let ids: Vec<usize> = self
            .live
            .keys()
            .copied()
            .filter(|i| !keep.contains(i))
            .collect();
        let mut ids = ids;
        ids.sort_unstable();
        for id in ids {
            if let Some((p, size)) = self.live.remove(&id) {
                self.a.free(p).unwrap();
                self.live_bytes -= size;
            }
        }
    }
}

/// The driver calls of a looped replay of trace `name` at 80 GiB: the
/// prefix, then the loop body three times (freeing all but the prefix after
/// each). Returns (calls over the whole replay, calls after the first
/// iteration), or `None` when the trace is absent.
fn looped_replay(name: &str, config: QuiltConfig) -> Option<(DriverStats, DriverStats)> {
    let events = load(name)?;
    let (prefix, body) = loop_body(&events);
    let keep: std::collections::HashSet<usize> = prefix
        .iter()
        .filter_map(|e| match e {
            Ev::Alloc { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let mut r = Replay::new(80 * GIB, config);
    let start = r.a.vmm().driver_stats();
    assert!(r.run(&prefix, false), "{name}: OOM at 80 GiB");
    assert!(r.run(&body, false), "{name}: OOM at 80 GiB");
    r.free_all_but(&keep);
    r.a.check_invariants().unwrap();
    let after_first = r.a.vmm().driver_stats();
    for _ in 0..2 {
        assert!(r.run(&body, false), "{name}: OOM at 80 GiB");
        r.free_all_but(&keep);
    }
    r.a.check_invariants().unwrap();
    let end = r.a.vmm().driver_stats();
    Some((end.since(&start), end.since(&after_first)))
}

fn training_loop_makes_no_driver_call_after_first_iteration(name: &str) {
    let Some((_, d)) = looped_replay(name, config_from_env()) else {
        return;
    };
    assert_eq!(
        d.vmm_calls(),
        0,
        "{name}: driver calls after the first iteration: {d:?}"
    );
}

#[test]
fn training_loop_opt_zo_no_driver_calls_after_first_iteration() {
    training_loop_makes_no_driver_call_after_first_iteration("opt_zo_fedlearn_finetune");
}

#[test]
fn training_loop_cs336_fwd_amp_no_driver_calls_after_first_iteration() {
    training_loop_makes_no_driver_call_after_first_iteration("cs336_lm_ctx512_fwd_amp");
}

#[test]
fn training_loop_every_trace_no_driver_calls_after_first_iteration() {
    for name in trace_names() {
        training_loop_makes_no_driver_call_after_first_iteration(&name);
    }
}

#[test]
fn every_trace_looped_makes_no_stream_sync_at_80_gib() {
    for name in trace_names() {
        let Some((whole, _)) = looped_replay(&name, config_from_env()) else {
            continue;
        };
        assert_eq!(
            whole.count(CallKind::StreamSynchronize),
            0,
            "{name}: stream synchronisations without memory pressure: {whole:?}"
        );
    }
}

/// Every trace with its allocations spread over four streams (each block
/// freed on the stream it was allocated on), the device catching up every 64
/// operations: at 80 GiB, no stream synchronisation at all. Returns (trace,
/// allocations, waits) for each trace.
fn four_stream_replays() -> Vec<(String, u64, u64)> {
    let mut out = Vec::new();
    for name in trace_names() {
        let Some(events) = load(&name) else { continue };
        let mut r = Replay::new(80 * GIB, QuiltConfig::default());
        let mut allocs = 0u64;
        for (i, e) in events.iter().enumerate() {
            let e = match *e {
                Ev::Alloc { id, size, .. } => {
                    allocs += 1;
                    Ev::Alloc {
                        id,
                        size,
                        stream: id as u64 % 4,
                    }
                }
                f => f,
            };
            assert!(r.run(&[e], false), "{name}: OOM at 80 GiB");
            if i % 64 == 63 {
                r.sim.complete_all();
            }
        }
        r.a.check_invariants().unwrap();
        let d = r.a.vmm().driver_stats();
        assert_eq!(
            d.count(CallKind::StreamSynchronize),
            0,
            "{name} on four streams: stream synchronisations without memory pressure"
        );
        let waits = r.a.stats().num_stream_waits;
        assert_eq!(d.count(CallKind::StreamWaitEvent), waits);
        eprintln!(
            "{name} on four streams: {allocs} allocations, {waits} waits ({:.4} per allocation), {} event queries",
            waits as f64 / allocs.max(1) as f64,
            d.count(CallKind::EventQuery)
        );
        out.push((name, allocs, waits));
    }
    out
}

#[test]
fn every_trace_on_four_streams_makes_no_stream_sync_at_80_gib() {
    four_stream_replays();
}

/// Each trace's tensors spread round robin over four streams (artificial: a
/// tensor freed on one stream is reused by the next within the GPU's lag), so
/// cross-stream reuse is constant: waits stay well under one per allocation.
#[test]
fn every_trace_on_four_streams_waits_less_than_every_other_allocation() {
    for (name, allocs, waits) in four_stream_replays() {
        let w = waits as f64 / allocs.max(1) as f64;
        assert!(
            w <= 0.5,
            "{name} on four streams: {w:.4} waits per allocation"
        );
    }
}

#[test]
fn replay_small_trace_with_invariants_after_every_step() {
    let Some(events) = load("cnn_counterfactual_eor") else {
        return;
    };
    let mut r = Replay::new(80 * GIB, QuiltConfig::default());
    assert!(r.run(&events, true));
}

/// The ideal capacity of a trace: the peak of whole pages for the sum of live
/// large requests plus whole pages for the sum of live small requests rounded to 512.
fn ideal_bytes(events: &[Ev]) -> u64 {
    let page = 2 * MIB;
    let mut sizes = HashMap::new();
    let (mut large, mut small, mut peak) = (0u64, 0u64, 0u64);
    for e in events {
        match *e {
            Ev::Alloc { id, size, .. } => {
                sizes.insert(id, size);
                if size > MIB {
                    large += size;
                } else {
                    small += size.div_ceil(512) * 512;
                }
            }
            Ev::Free { id } => {
                let size = sizes[&id];
                if size > MIB {
                    large -= size;
                } else {
                    small -= size.div_ceil(512) * 512;
                }
            }
        }
        peak = peak.max(large.div_ceil(page) * page + small.div_ceil(page) * page);
    }
    peak
}

fn completes(events: &[Ev], capacity: u64, config: QuiltConfig) -> bool {
    let mut r = Replay::new(capacity, config);
    r.run(events, false)
}

/// The configuration to measure: the default, changed by `QUILT_AHEAD` (growth
/// margin divisor), `QUILT_MAX_MARGIN` (largest growth margin, MiB),
/// `QUILT_PAGE_MIB` (page size, MiB), `QUILT_CANDIDATES` (placement
/// candidates), `QUILT_RECLAIM` (`full`, `always`, `aboveN` per mille, or an
/// idle count), `QUILT_SEPARATE=1` (separate small arenas), `QUILT_GMLAKE=1`
/// (the GMLake preset), `QUILT_BISECT=0` (skip the minimum-capacity search).
fn config_from_env() -> QuiltConfig {
    use quilt_alloc::quilt::{PageSize, ReclaimPolicy};
    let mut c = if std::env::var("QUILT_GMLAKE").is_ok() {
        QuiltConfig::gmlake()
    } else {
        QuiltConfig::default()
    };
    if let Ok(v) = std::env::var("QUILT_AHEAD") {
        c.pool.growth.ahead_divisor = v.parse().unwrap();
    }
    if let Ok(v) = std::env::var("QUILT_MAX_MARGIN") {
        c.pool.growth.max_margin_bytes = v.parse::<u64>().unwrap() * MIB;
    }
    if let Ok(v) = std::env::var("QUILT_PAGE_MIB") {
        c.pool.page_size = PageSize::Bytes(v.parse::<u64>().unwrap() * MIB);
    }
    if let Ok(v) = std::env::var("QUILT_CANDIDATES") {
        c.placement_candidates = v.parse().unwrap();
    }
    if let Ok(v) = std::env::var("QUILT_SEPARATE") {
        c.separate_small_arena = v == "1";
    }
    if let Ok(v) = std::env::var("QUILT_RECLAIM") {
        c.reclaim = match v.as_str() {
            "full" => ReclaimPolicy::WhenFull,
            "always" => ReclaimPolicy::Always,
            v if v.starts_with("above") => ReclaimPolicy::CachedAbove(v[5..].parse().unwrap()),
            n => ReclaimPolicy::IdleFor(n.parse().unwrap()),
        };
    }
    c
}

/// Figures for docs/design.md: `cargo test --release -p quilt-alloc --test
/// quilt_traces -- --ignored --nocapture measure_traces`
#[test]
#[ignore]
fn measure_traces() {
    let config = config_from_env();
    let bisect = std::env::var("QUILT_BISECT")
        .map(|v| v != "0")
        .unwrap_or(true);
    println!("config: {config:?}");
    println!(
        "{:<36} {:>10} {:>10} {:>7} {:>7} {:>7} {:>6} {:>6} {:>6} {:>9} {:>10} {:>10} {:>7} {:>7} {:>7}",
        "trace", "live MiB", "resv MiB", "eff", "calls", "create", "map", "access", "unmap", "model ms", "ideal MiB", "min MiB", "ratio", "x-calls", "x-time"
    );
    let mut xline = String::new();
    for name in trace_names() {
        let Some(events) = load(&name) else { continue };
        let mut r = Replay::new(80 * GIB, config);
        let done = r.run(&events, false);
        let st = r.a.stats();
        let d = st.driver;
        let ideal = ideal_bytes(&events);
        // Bisection on capacity, in pages.
        let page = 2 * MIB;
        let (mut lo, mut hi) = (ideal / page / 2, (ideal / page) * 2 + 64);
        while bisect && hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if completes(&events, mid * page, config) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let min = hi * page;
        let mut x = Replay::expandable(80 * GIB);
        x.run(&events, false);
        let xs = x.a.stats();
        let xd = xs.driver;
        xline += &format!(
            "expandable {name}: peak reserved {:.1} MiB, efficiency {:.4}, calls {}, modelled {:.1} ms\n",
            xs.reserved_bytes.peak as f64 / MIB as f64,
            x.peak_live as f64 / xs.reserved_bytes.peak as f64,
            xd.vmm_calls(),
            xd.modelled_ns as f64 / 1e6
        );
        println!(
            "{:<36} {:>10.1} {:>10.1} {:>7.4} {:>7} {:>7} {:>6} {:>6} {:>6} {:>9.1} {:>10.1} {:>10.1} {:>7.4} {:>7.3} {:>7.3}{}",
            name,
            r.peak_live as f64 / MIB as f64,
            st.reserved_bytes.peak as f64 / MIB as f64,
            r.peak_live as f64 / st.reserved_bytes.peak as f64,
            d.vmm_calls(),
            d.count(CallKind::Create),
            d.count(CallKind::Map),
            d.count(CallKind::SetAccess),
            d.count(CallKind::Unmap),
            d.modelled_ns as f64 / 1e6,
            ideal as f64 / MIB as f64,
            min as f64 / MIB as f64,
            min as f64 / ideal as f64,
            d.vmm_calls() as f64 / xd.vmm_calls() as f64,
            d.modelled_ns as f64 / xd.modelled_ns as f64,
            if done { "" } else { " (did not complete at 80 GiB)" }
        );
    }
    print!("{xline}");
}
