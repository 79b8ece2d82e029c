//! Host CPU time per allocator operation in steady state, per allocator, on
//! a slice of each real trace in `../shared/traces/converted/` (see
//! `steady/mod.rs` for the pass); criterion times whole passes, throughput in
//! operations per pass. Without the traces the bench says so and measures
//! nothing. Heap allocations per operation: the `heap` bench.
//!
//! `cargo bench -p quilt-bench --bench traces` (`-- --quick` for a short run)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code

mod steady;

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use quilt_bench::allocators::ALLOCATOR_NAMES;
use steady::{slice, trace_files, Bench, Slice};

fn main() {
    let files = trace_files();
    if files.is_empty() {
        eprintln!(
            "traces bench SKIPPED: no ../shared/traces/converted/*.trace beside the checkout"
        );
        return;
    }
    let slices: Vec<Slice> = files.iter().map(|f| slice(f)).collect();
    let mut c = Criterion::default().configure_from_args();
    for s in &slices {
        let mut group = c.benchmark_group(format!("steady-{}", s.name));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(s.pass.len() as u64));
        for name in ALLOCATOR_NAMES {
            let mut b = Bench::new(name, s);
            group.bench_function(name, |bencher| {
                bencher.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        b.run(&s.pass);
                    }
                    start.elapsed()
                })
            });
        }
        group.finish();
    }
    c.final_summary();
}
