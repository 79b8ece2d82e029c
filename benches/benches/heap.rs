//! Heap allocations per allocator operation in steady state, per allocator,
//! on a slice of each real trace in `../shared/traces/converted/` (see
//! `steady/mod.rs` for the pass): dhat's heap statistics around one pass
//! after the warm-up. A pass allocates nothing of its own (ids are dense
//! slots; the simulated clock's advance allocates nothing), so what is
//! counted is the allocators' and the simulated driver's. Without the traces
//! the bench says so and measures nothing. Then the same for `quilt-bench
//! scale`'s churn at 1,000 live blocks on 1 and 64 streams: the
//! allocations of 8,000 more steps (two runs of 4,000 and 12,000 steps from
//! the same seed, so the live set's build cancels out).
//!
//! `cargo bench -p quilt-bench --bench heap`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code

mod steady;

use quilt_bench::allocators::ALLOCATOR_NAMES;
use steady::{slice, trace_files, Bench, SLICE_EVENTS};

#[global_allocator]
static GLOBAL: dhat::Alloc = dhat::Alloc;

fn main() {
    let _profiler = dhat::Profiler::builder().testing().build();
    churn();
    let files = trace_files();
    if files.is_empty() {
        eprintln!("heap bench SKIPPED: no ../shared/traces/converted/*.trace beside the checkout");
        return;
    }
    println!("heap allocations per allocator operation, steady state ({SLICE_EVENTS}-event pass):");
    print!("{:<38}", "trace");
    for name in ALLOCATOR_NAMES {
        print!("{name:>11}");
    }
    println!();
    for path in &files {
        let s = slice(path);
        print!("{:<38}", s.name);
        for name in ALLOCATOR_NAMES {
            let mut b = Bench::new(name, &s);
            let before = dhat::HeapStats::get().total_blocks;
            b.run(&s.pass);
            let allocs = dhat::HeapStats::get().total_blocks - before;
            print!("{:>11.3}", allocs as f64 / s.pass.len() as f64);
        }
        println!();
    }
}

/// Heap allocations per operation of the scale churn (see the module
/// documentation).
fn churn() {
    println!("heap allocations per allocator operation, scale churn at 1,000 live blocks:");
    for name in ["quilt", "classic"] {
        for streams in [1, 64] {
            let mut blocks = Vec::new();
            for steps in [4_000u64, 12_000] {
                let before = dhat::HeapStats::get().total_blocks;
                quilt_bench::scale::run_once(name, 1_000, streams, None, steps, 42).unwrap();
                blocks.push(dhat::HeapStats::get().total_blocks - before);
            }
            let per_op = (blocks[1] - blocks[0]) as f64 / (2.0 * 8_000.0);
            println!("{name:<10} {streams:>3} streams {per_op:>8.3}");
        }
    }
}
