//! `quilt-bench scale`: host cost per operation as live blocks and streams
//! grow. A churn at a steady live set: `live` blocks of mixed sizes (512 B to
//! 64 MiB) spread round robin over `streams` streams; each step frees a
//! random live block and allocates a replacement of a fresh size on its
//! stream. The set is built first (not timed), then `steps` steps are timed
//! as a whole; the simulated GPU runs behind as in a replay.

use std::sync::Arc;
use std::time::Instant;

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;
use serde::Serialize;

use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

use crate::allocators;
use crate::replay::ReplayConfig;

/// One point of a scaling run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScalePoint {
    /// The allocator spec.
    pub allocator: String,
    /// Live blocks kept.
    pub live: u64,
    /// Streams they are spread over.
    pub streams: u64,
    /// Host nanoseconds per allocate or free (the mean over the timed steps).
    pub ns_per_op: f64,
}

/// A size of the churn: 512 B to 1 MiB three times in five, 1 to 16 MiB
/// once in five... in all: 60 % small, 30 % up to 16 MiB, 10 % up to 64 MiB,
/// log-uniform within each class.
fn size(rng: &mut Pcg64Mcg) -> u64 {
    let (lo, hi): (f64, f64) = match rng.random_range(0..10u32) {
        0..=5 => (512.0, (1u64 << 20) as f64),
        6..=8 => ((1u64 << 20) as f64, (16u64 << 20) as f64),
        _ => ((16u64 << 20) as f64, (64u64 << 20) as f64),
    };
    let x: f64 = rng.random_range(lo.ln()..hi.ln());
    x.exp() as u64
}

/// Mean bytes of [`size`], for sizing the device.
const MEAN_SIZE: u64 = 6 << 20;

/// Run one point: `allocator` with `live` blocks over `streams` streams,
/// `steps` timed steps (each a free and an allocate).
pub fn run_point(
    allocator: &str,
    live: u64,
    streams: u64,
    steps: u64,
    seed: u64,
) -> Result<ScalePoint, String> {
    let streams = streams.max(1);
    let capacity = (live.max(16) * MEAN_SIZE * 2).next_power_of_two();
    let config = ReplayConfig::default();
    let sim = Arc::new(SimVmm::new(config.sim_config(capacity)).map_err(|e| e.to_string())?);
    let vmm: Arc<dyn Vmm> = sim.clone();
    let alloc = allocators::build(allocator, vmm).map_err(|e| e.to_string())?;
    let mut rng = Pcg64Mcg::seed_from_u64(seed);
    let mut blocks: Vec<(u64, StreamId)> = Vec::with_capacity(live as usize);
    for i in 0..live {
        let s = StreamId(i % streams);
        let a = alloc
            .allocate(size(&mut rng), s)
            .map_err(|e| format!("{allocator}: building the live set: {e}"))?;
        sim.advance(1);
        blocks.push((a.ptr, s));
    }
    // Draw the steps first, so that the timed loop is the allocator's.
    let plan: Vec<(usize, u64)> = (0..steps)
        .map(|_| (rng.random_range(0..blocks.len().max(1)), size(&mut rng)))
        .collect();
    let start = Instant::now();
    churn(alloc.as_ref(), &sim, &mut blocks, &plan).map_err(|e| format!("{allocator}: {e}"))?;
    let ns = start.elapsed().as_nanos() as f64;
    for (ptr, _) in blocks {
        let _ = alloc.free(ptr);
    }
    Ok(ScalePoint {
        allocator: allocator.to_string(),
        live,
        streams,
        ns_per_op: ns / (2 * steps.max(1)) as f64,
    })
}

/// The timed steps: for each `(i, bytes)` of `plan`, free live block `i`
/// and allocate `bytes` on its stream in its place. Not inlined, so that a
/// profiler (`valgrind --tool=callgrind --toggle-collect='*scale::churn*'`)
/// can count the steps alone.
#[inline(never)]
fn churn(
    alloc: &dyn DeviceAllocator,
    sim: &SimVmm,
    blocks: &mut [(u64, StreamId)],
    plan: &[(usize, u64)],
) -> Result<(), String> {
    for &(i, bytes) in plan {
        let Some(&(ptr, s)) = blocks.get(i) else {
            break;
        };
        alloc.free(ptr).map_err(|e| format!("free: {e}"))?;
        sim.advance(1);
        let a = alloc
            .allocate(bytes, s)
            .map_err(|e| format!("allocate: {e}"))?;
        sim.advance(1);
        blocks[i] = (a.ptr, s);
    }
    Ok(())
}

/// The table of a scaling run: one line per point.
pub fn table(points: &[ScalePoint]) -> String {
    let mut out = format!(
        "{:<28} {:>9} {:>8} {:>10}\n",
        "allocator", "live", "streams", "ns/op"
    );
    for p in points {
        out += &format!(
            "{:<28} {:>9} {:>8} {:>10.0}\n",
            p.allocator, p.live, p.streams, p.ns_per_op
        );
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    #[test]
    fn sizes_span_the_range_and_a_point_runs() {
        let mut rng = Pcg64Mcg::seed_from_u64(1);
        let sizes: Vec<u64> = (0..10_000).map(|_| size(&mut rng)).collect();
        assert!(sizes.iter().all(|&s| (512..=64 << 20).contains(&s)));
        assert!(sizes.iter().any(|&s| s < 4096) && sizes.iter().any(|&s| s > 32 << 20));
        let p = run_point("quilt", 200, 4, 500, 7).unwrap();
        assert_eq!((p.live, p.streams), (200, 4));
        assert!(p.ns_per_op > 0.0);
        assert!(run_point("nope", 10, 1, 10, 7).is_err());
    }
}
