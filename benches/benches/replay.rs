//! Host CPU time per allocate/free pair, per allocator, on a slice of the
//! `train-varlen` workload (its weights, then its first 3000 step events),
//! each sample on a fresh simulated device and a fresh allocator.
//!
//! `cargo bench -p quilt-bench --bench replay`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use quilt_bench::allocators::{build, ALLOCATOR_NAMES};
use quilt_bench::replay::{replay, ReplayConfig};
use quilt_bench::trace::{Event, Trace};
use quilt_bench::workloads::{find, DEFAULT_SEED};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::Vmm;

fn slice() -> Trace {
    let mut t = (find("train-varlen").unwrap().generate)(DEFAULT_SEED);
    t.events.truncate(t.preexisting + 3000);
    t
}

fn bench(c: &mut Criterion) {
    let trace = slice();
    let pairs = trace.events[trace.preexisting..]
        .iter()
        .filter(|e| matches!(e, Event::Alloc { .. }))
        .count() as u64;
    let mut group = c.benchmark_group("replay-train-varlen-slice");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(pairs));
    for name in ALLOCATOR_NAMES {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // The race finder is the harness's, not the allocator's, time.
                    let config = ReplayConfig {
                        find_races: false,
                        ..ReplayConfig::default()
                    };
                    let sim = Arc::new(SimVmm::new(config.sim_config(80 << 30)).unwrap());
                    let vmm: Arc<dyn Vmm> = sim.clone();
                    let alloc = build(name, vmm).unwrap();
                    let start = Instant::now();
                    let r = replay(&trace, alloc.as_ref(), &sim, &config).unwrap();
                    total += start.elapsed();
                    assert!(r.completed);
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
