//! A steady-state pass over a slice of a real trace, shared by the `traces`
//! and `heap` benches: the first [`SLICE_EVENTS`] events after a trace's
//! pre-existing allocations, closed by freeing what the slice left live (and
//! allocating again a pre-existing block it freed), so that passes repeat.
//! Each allocator gets a fresh simulated 80 GiB device running
//! [`DEFAULT_GPU_LAG_OPS`] operations behind (as in `quilt-bench ab`), the
//! trace's pre-existing allocations and [`WARM_PASSES`] untimed passes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quilt_alloc::DeviceAllocator;
use quilt_bench::allocators::build;
use quilt_bench::cli::preexisting_from_stats;
use quilt_bench::replay::{ReplayConfig, DEFAULT_GPU_LAG_OPS};
use quilt_bench::trace::{load_trace, Event};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId, Vmm};

/// Events of a trace (after its pre-existing allocations) in one pass.
pub const SLICE_EVENTS: usize = 4000;
/// Untimed passes before measuring: the allocator's caches and pool settle.
const WARM_PASSES: usize = 2;

/// One operation of a pass, with ids made dense so a pass needs no hashing.
#[derive(Clone, Copy)]
pub enum Op {
    Alloc { slot: usize, size: u64, stream: u64 },
    Free { slot: usize },
}

/// A trace cut to a repeatable pass.
pub struct Slice {
    pub name: String,
    pre: Vec<Op>,
    pub pass: Vec<Op>,
    slots: usize,
}

pub fn slice(path: &Path) -> Slice {
    let mut trace = load_trace(path).unwrap();
    trace.preexisting = preexisting_from_stats(path).unwrap().unwrap_or(0);
    let mut slot_of: HashMap<u64, usize> = HashMap::new();
    let mut live: Vec<bool> = Vec::new();
    let mut dense = |id: u64, live: &mut Vec<bool>| {
        let next = slot_of.len();
        let s = *slot_of.entry(id).or_insert(next);
        if s == live.len() {
            live.push(false);
        }
        s
    };
    let mut to_op = |e: &Event, live: &mut Vec<bool>| match *e {
        Event::Alloc { id, size, stream } => {
            let slot = dense(id, live);
            live[slot] = true;
            Op::Alloc { slot, size, stream }
        }
        Event::Free { id } => {
            let slot = dense(id, live);
            live[slot] = false;
            Op::Free { slot }
        }
        other => panic!("{other:?}: a real trace holds allocations and frees only"),
    };
    let pre_len = trace.preexisting.min(trace.events.len());
    let pre: Vec<Op> = trace.events[..pre_len]
        .iter()
        .map(|e| to_op(e, &mut live))
        .collect();
    let pre_live = live.clone();
    let end = (pre_len + SLICE_EVENTS).min(trace.events.len());
    let mut pass: Vec<Op> = trace.events[pre_len..end]
        .iter()
        .map(|e| to_op(e, &mut live))
        .collect();
    // Close the pass: free what it allocated and left live. A pre-existing
    // allocation it freed is allocated again, so every pass starts alike.
    for (slot, &l) in live.iter().enumerate() {
        let was = pre_live.get(slot).copied().unwrap_or(false);
        if l && !was {
            pass.push(Op::Free { slot });
        }
    }
    for (slot, &was) in pre_live.iter().enumerate() {
        if was && !live[slot] {
            if let Some(Op::Alloc { size, stream, .. }) = pre
                .iter()
                .find(|op| matches!(op, Op::Alloc { slot: s, .. } if *s == slot))
            {
                pass.push(Op::Alloc {
                    slot,
                    size: *size,
                    stream: *stream,
                });
            }
        }
    }
    Slice {
        name: trace.name,
        pre,
        pass,
        slots: live.len(),
    }
}

/// An allocator on a fresh simulated device with a slice's state set up.
pub struct Bench {
    sim: Arc<SimVmm>,
    alloc: Box<dyn DeviceAllocator>,
    ptrs: Vec<DevicePtr>,
}

impl Bench {
    pub fn new(name: &str, s: &Slice) -> Bench {
        let config = ReplayConfig {
            gpu_lag_ops: DEFAULT_GPU_LAG_OPS,
            ..ReplayConfig::default()
        };
        let sim = Arc::new(SimVmm::new(config.sim_config(80 << 30)).unwrap());
        let vmm: Arc<dyn Vmm> = sim.clone();
        let alloc = build(name, vmm).unwrap();
        let mut b = Bench {
            sim,
            alloc,
            ptrs: vec![0; s.slots],
        };
        b.run(&s.pre);
        for _ in 0..WARM_PASSES {
            b.run(&s.pass);
        }
        b
    }

    /// Run `ops`.
    pub fn run(&mut self, ops: &[Op]) {
        for op in ops {
            let r = match *op {
                Op::Alloc { slot, size, stream } => self
                    .alloc
                    .allocate(size, StreamId(stream))
                    .map(|a| self.ptrs[slot] = a.ptr),
                Op::Free { slot } => self.alloc.free(self.ptrs[slot]),
            };
            self.sim.advance(1);
            r.unwrap();
        }
    }
}

pub fn trace_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/converted");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "trace"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}
