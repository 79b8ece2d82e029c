//! Where a replay stops being a fixed point: replays a built-in workload
//! (allocations, frees and `record_stream` only) through an allocator on
//! the simulated device, as `quilt-bench ab` does (80 GiB, the GPU 64
//! operations behind, the pre-existing prefix once, the rest `ITERATIONS`
//! times), and prints
//!
//! - the first allocation of the second iteration whose address differs
//!   from the first iteration's (the same event, the same request), and
//! - every allocation or free of the second and later iterations that made
//!   VMM calls, with the reserved bytes before and after.
//!
//! ```text
//! cargo run --release -p quilt-bench --example first_divergence -- many-streams-10 [ALLOCATOR] [ITERATIONS]
//! ```
//!
//! Iterations replay the same events, so an allocation that makes VMM
//! calls after the first iteration is one whose place (or the layout
//! around it) differs from the first iteration's: the first divergence is
//! where to look for the reason (issue 38's many-streams workloads).

use std::collections::{HashMap, HashSet};
use std::error::Error;
use std::sync::Arc;

use quilt_bench::replay::ReplayConfig;
use quilt_bench::trace::Event;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId, Vmm};

/// A live allocation: its address, and the streams that used it (its own
/// first, then those of `record_stream`).
struct Block {
    ptr: DevicePtr,
    used_on: Vec<u64>,
}

/// The replay: the device, the allocator, the live blocks, and the address
/// each allocation event got in each iteration.
struct Replay {
    sim: Arc<SimVmm>,
    alloc: Box<dyn quilt_alloc::DeviceAllocator>,
    live: HashMap<u64, Block>,
    placed: HashMap<(usize, usize), DevicePtr>,
    diverged: bool,
}

impl Replay {
    fn reserved_mib(&self) -> u64 {
        self.alloc.stats().reserved_bytes.current >> 20
    }

    fn free(&mut self, id: u64) -> Result<(), Box<dyn Error>> {
        let block = self
            .live
            .remove(&id)
            .ok_or_else(|| format!("free of id {id}, which is not live"))?;
        // The kernels that used it last: on the streams it was recorded on
        // if any, else on its own (as the replay harness has it).
        let last_users = if block.used_on.len() > 1 {
            &block.used_on[1..]
        } else {
            &block.used_on[..]
        };
        for &s in last_users {
            self.sim.queue_work(StreamId(s));
        }
        self.alloc.free(block.ptr)?;
        self.sim.advance(1);
        Ok(())
    }

    /// Replay event `i` of iteration `it`, reporting as the module says.
    fn step(&mut self, event: Event, i: usize, it: usize) -> Result<(), Box<dyn Error>> {
        let calls_before = self.sim.driver_stats().vmm_calls();
        let reserved_before = self.reserved_mib();
        let what = match event {
            Event::Alloc { id, size, stream } => {
                self.sim.queue_work(StreamId(stream));
                let a = self.alloc.allocate(size, StreamId(stream))?;
                self.sim.advance(1);
                self.live.insert(
                    id,
                    Block {
                        ptr: a.ptr,
                        used_on: vec![stream],
                    },
                );
                self.placed.insert((it, i), a.ptr);
                if it == 1 && !self.diverged {
                    if let Some(&first) = self.placed.get(&(0, i)) {
                        if first != a.ptr {
                            self.diverged = true;
                            println!(
                                "first divergence: event {i}, allocation of {size} B on stream {stream}: \
                                 {first:#x} in the first iteration, {:#x} in the second",
                                a.ptr
                            );
                        }
                    }
                }
                format!("allocation of {size} B on stream {stream} at {:#x}", a.ptr)
            }
            Event::Free { id } => {
                self.free(id)?;
                format!("free of id {id}")
            }
            Event::RecordStream { id, stream } => {
                let block = self
                    .live
                    .get_mut(&id)
                    .ok_or_else(|| format!("record_stream of id {id}, which is not live"))?;
                if !block.used_on.contains(&stream) {
                    block.used_on.push(stream);
                }
                self.alloc.record_stream(block.ptr, StreamId(stream))?;
                return Ok(());
            }
            other => return Err(format!("event {i}: {other:?} is not replayed here").into()),
        };
        let calls = self.sim.driver_stats().vmm_calls() - calls_before;
        if it >= 1 && calls > 0 {
            println!(
                "iteration {} event {i}: {what}: {calls} VMM calls, reserved {reserved_before} -> {} MiB",
                it + 1,
                self.reserved_mib()
            );
        }
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("many-streams-10", String::as_str);
    let spec = args.get(2).map_or("quilt", String::as_str);
    let iterations: usize = match args.get(3) {
        Some(n) => n.parse()?,
        None => 3,
    };
    let workload =
        quilt_bench::workloads::find(name).ok_or_else(|| format!("no built-in workload {name}"))?;
    let trace = (workload.generate)(42);
    let sim = Arc::new(SimVmm::new(ReplayConfig::default().sim_config(80 << 30))?);
    let vmm: Arc<dyn Vmm> = sim.clone();
    let mut r = Replay {
        sim,
        alloc: quilt_bench::allocators::build(spec, vmm)?,
        live: HashMap::new(),
        placed: HashMap::new(),
        diverged: false,
    };
    let pre = trace.preexisting.min(trace.events.len());
    let mut pre_ids = HashSet::new();
    for (i, &e) in trace.events[..pre].iter().enumerate() {
        if let Event::Alloc { id, .. } = e {
            pre_ids.insert(id);
        }
        r.step(e, i, 0)?;
    }
    for it in 0..iterations {
        if it > 0 {
            // What an iteration left live goes, in allocation order.
            let mut left: Vec<u64> = r
                .live
                .keys()
                .copied()
                .filter(|id| !pre_ids.contains(id))
                .collect();
            left.sort_unstable();
            for id in left {
                r.free(id)?;
            }
        }
        for (i, &e) in trace.events.iter().enumerate().skip(pre) {
            r.step(e, i, it)?;
        }
    }
    println!(
        "{name} on {spec}, {iterations} iterations: {} VMM calls in all, reserved {} MiB (peak {} MiB)",
        r.sim.driver_stats().vmm_calls(),
        r.reserved_mib(),
        r.alloc.stats().reserved_bytes.peak >> 20
    );
    Ok(())
}
