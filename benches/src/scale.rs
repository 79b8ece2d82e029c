//! `quilt-bench scale` and `quilt-bench sizes`: host cost per operation as
//! live blocks and streams grow, or as blocks grow. A churn at a steady live
//! set: `live` blocks of mixed sizes (512 B to 64 MiB; with `size`, all of
//! that one size) spread round robin over `streams` streams; each step frees
//! a random live block and allocates a replacement of a fresh size (the
//! same size, with `size`) on its stream. The set is built first (not timed), then `steps` steps are timed
//! as a whole; the simulated GPU runs behind as in a replay.
//!
//! The host time is the allocator's: the simulated driver times its own
//! work in each call ([`SimConfig::time_calls`]), and that time, and the
//! clock readings' own cost, are taken out (`sim_ns_per_op` reports it, and
//! `wall_ns_per_op` the whole). On a GPU the driver's time is charged by
//! the cost model instead: each point reports what it charges for the calls
//! the timed steps made (`driver_ns_per_op`: page creation and mapping, and
//! the stream and event calls that many streams need), and those calls
//! counted. The calls are the same in every run of a point (the simulated
//! device is deterministic); the host times are not.
//!
//! A point is run `repeat` times and reported as the median: the runs go
//! round robin over the points (each round visits every point once), so that
//! a change in the machine's load falls on every point alike and the ratios
//! between points, which are what the figures are for, stay fair.

use std::sync::Arc;
use std::time::Instant;

use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, DriverStats, StreamId, Vmm};
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::allocators;
use crate::replay::ReplayConfig;
use crate::report::rows::{per_op, ScalePoint, StreamCalls};

/// What one run of a point measured, per operation of its timed steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Run {
    /// The allocator's host nanoseconds (wall less the simulated driver's).
    pub ns_per_op: f64,
    /// The simulated driver's own host nanoseconds.
    pub sim_ns_per_op: f64,
    /// Wall nanoseconds.
    pub wall_ns_per_op: f64,
    /// The driver calls of the timed steps (in all, not per operation).
    pub driver: DriverStats,
}

/// One point of a scaling run, to be measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PointSpec {
    /// The allocator spec.
    pub allocator: String,
    /// Live blocks kept.
    pub live: u64,
    /// Streams they are spread over.
    pub streams: u64,
    /// Every block's size in bytes (`None`: the mixed sizes of `size`).
    pub size: Option<u64>,
}

/// Run every point of `specs` `repeat` times (at least once), round robin,
/// `steps` timed steps each; returns the points measured (in the order of
/// `specs`, each with its median) and, for each point that failed, why (a
/// point that fails once is dropped from later rounds).
pub fn run_points(
    specs: &[PointSpec],
    steps: u64,
    seed: u64,
    repeat: u32,
) -> (Vec<ScalePoint>, Vec<String>) {
    let mut runs: Vec<Result<Vec<Run>, String>> = vec![Ok(Vec::new()); specs.len()];
    for _ in 0..repeat.max(1) {
        for (spec, runs) in specs.iter().zip(runs.iter_mut()) {
            let Ok(done) = runs else {
                continue;
            };
            match run_once(
                &spec.allocator,
                spec.live,
                spec.streams,
                spec.size,
                steps,
                seed,
            ) {
                Ok(run) => done.push(run),
                Err(e) => {
                    *runs = Err(format!(
                        "{}, {} live, {} streams: {e}",
                        spec.allocator, spec.live, spec.streams
                    ))
                }
            }
        }
    }
    let mut points = Vec::new();
    let mut failed = Vec::new();
    for (spec, runs) in specs.iter().zip(runs) {
        match runs {
            Ok(runs) => points.push(point(spec, steps, &runs)),
            Err(e) => failed.push(e),
        }
    }
    (points, failed)
}

/// The point of `spec` from its runs of `steps` steps each (at least one).
fn point(spec: &PointSpec, steps: u64, runs: &[Run]) -> ScalePoint {
    let ops = 2 * steps.max(1);
    let runs_ns_per_op: Vec<f64> = runs.iter().map(|r| r.ns_per_op).collect();
    let median_of = |f: fn(&Run) -> f64| median(&runs.iter().map(f).collect::<Vec<f64>>());
    // Every run makes the same calls; the first one's stand for all.
    let driver = runs.first().map(|r| r.driver).unwrap_or_default();
    let stream_calls = StreamCalls::from_stats(&driver);
    ScalePoint {
        allocator: spec.allocator.clone(),
        live: spec.live,
        streams: spec.streams,
        size_bytes: spec.size,
        ns_per_op: median(&runs_ns_per_op),
        runs_ns_per_op,
        event_records_per_op: per_op(driver.count(CallKind::EventRecord), ops),
        event_queries_per_op: per_op(driver.count(CallKind::EventQuery), ops),
        sim_ns_per_op: median_of(|r| r.sim_ns_per_op),
        wall_ns_per_op: median_of(|r| r.wall_ns_per_op),
        driver_ns_per_op: per_op(driver.modelled_ns, ops),
        vmm_calls_per_op: per_op(driver.vmm_calls(), ops),
        stream_calls_per_op: per_op(stream_calls.total(), ops),
        stream_calls,
    }
}

/// The median of `xs` (the mean of the middle two for an even count; 0 when empty).
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
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

/// The least device for blocks of one size (`quilt-bench sizes`).
const FIXED_FLOOR: u64 = 8 << 30;

/// Run one point once: `allocator` with `live` blocks over `streams`
/// streams (each of `fixed` bytes, or of the mixed sizes of `size`),
/// `steps` timed steps (each a free and an allocate); returns the host
/// nanoseconds per operation and the driver calls of the timed steps.
pub fn run_once(
    allocator: &str,
    live: u64,
    streams: u64,
    fixed: Option<u64>,
    steps: u64,
    seed: u64,
) -> Result<Run, String> {
    let streams = streams.max(1);
    // Twice the live set, and room for every stream's segments where the
    // blocks are of one size (classic carves 20 MiB segments per stream).
    let floor = if fixed.is_some() { FIXED_FLOOR } else { 0 };
    let capacity = live
        .max(16)
        .saturating_mul(fixed.unwrap_or(MEAN_SIZE))
        .saturating_mul(2)
        .max(floor)
        .checked_next_power_of_two()
        .ok_or_else(|| {
            format!("{allocator}: {live} blocks of {fixed:?} bytes overflow a device")
        })?;
    let draw = |rng: &mut Pcg64Mcg| fixed.unwrap_or_else(|| size(rng));
    let config = SimConfig {
        time_calls: true,
        ..ReplayConfig::default().sim_config(capacity)
    };
    let sim = Arc::new(SimVmm::new(config).map_err(|e| e.to_string())?);
    let vmm: Arc<dyn Vmm> = sim.clone();
    let alloc = allocators::build(allocator, vmm).map_err(|e| e.to_string())?;
    let mut rng = Pcg64Mcg::seed_from_u64(seed);
    let mut blocks: Vec<(u64, StreamId)> = Vec::with_capacity(live as usize);
    for i in 0..live {
        let s = StreamId(i % streams);
        let a = alloc
            .allocate(draw(&mut rng), s)
            .map_err(|e| format!("{allocator}: building the live set: {e}"))?;
        sim.advance(1);
        blocks.push((a.ptr, s));
    }
    // Draw the steps first, so that the timed loop is the allocator's.
    let plan: Vec<(usize, u64)> = (0..steps)
        .map(|_| (rng.random_range(0..blocks.len().max(1)), draw(&mut rng)))
        .collect();
    let clock_ns = clock_reading_ns();
    let before = sim.driver_stats();
    let start = Instant::now();
    churn(alloc.as_ref(), &sim, &mut blocks, &plan).map_err(|e| format!("{allocator}: {e}"))?;
    let wall = start.elapsed().as_nanos() as f64;
    let driver = sim.driver_stats().since(&before);
    for (ptr, _) in blocks {
        let _ = alloc.free(ptr);
    }
    // Each call's timing reads the clock twice: one reading falls inside
    // the time measured, one outside it (see the module documentation).
    let calls: u64 = driver.calls.iter().sum();
    let clocks = calls as f64 * clock_ns;
    let inside = driver.measured_ns as f64;
    let ops = (2 * steps.max(1)) as f64;
    Ok(Run {
        ns_per_op: (wall - inside - clocks).max(0.0) / ops,
        sim_ns_per_op: (inside - clocks).max(0.0) / ops,
        wall_ns_per_op: wall / ops,
        driver,
    })
}

/// The host nanoseconds of one clock reading (`Instant::now`), measured:
/// the fastest of several batches, since a batch the scheduler interrupts
/// reads long, and an estimate too high, subtracted once per driver call,
/// would take the allocator's own time out of the figure with it (on a
/// loaded machine it made whole runs read 0 ns).
fn clock_reading_ns() -> f64 {
    const BATCHES: u32 = 50;
    const READINGS: u32 = 200;
    (0..BATCHES)
        .map(|_| {
            let start = Instant::now();
            let mut last = start;
            for _ in 0..READINGS {
                last = std::hint::black_box(Instant::now());
            }
            (last - start).as_nanos() as f64 / f64::from(READINGS)
        })
        .fold(f64::INFINITY, f64::min)
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
        let spec = |allocator: &str, live| PointSpec {
            allocator: allocator.to_string(),
            live,
            streams: 4,
            size: None,
        };
        let (points, failed) = run_points(&[spec("quilt", 200), spec("nope", 10)], 500, 7, 3);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(
            failed[0].starts_with("nope, 10 live, 4 streams"),
            "{failed:?}"
        );
        let [p] = &points[..] else {
            panic!("{points:?}");
        };
        assert_eq!((p.live, p.streams, p.runs_ns_per_op.len()), (200, 4, 3));
        assert_eq!(p.ns_per_op, median(&p.runs_ns_per_op));
        assert!(p.runs_ns_per_op.iter().all(|&ns| ns > 0.0));
    }

    #[test]
    fn the_median_is_the_middle_run() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 100.0]), 3.5);
    }
}
