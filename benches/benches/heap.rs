//! Heap allocations per allocator operation in steady state, per allocator,
//! on a slice of each real trace in `../shared/traces/converted/` (see
//! `steady/mod.rs` for the pass): dhat's heap statistics around one pass
//! after the warm-up. A pass allocates nothing of its own (ids are dense
//! slots; the simulated clock's advance allocates nothing), so what is
//! counted is the allocators' and the simulated driver's. Without the traces
//! the bench says so and measures nothing.
//!
//! `cargo bench -p quilt-bench --bench heap`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code

mod steady;

use quilt_bench::allocators::ALLOCATOR_NAMES;
use steady::{slice, trace_files, Bench, SLICE_EVENTS};

#[global_allocator]
static GLOBAL: dhat::Alloc = dhat::Alloc;

fn main() {
    let files = trace_files();
    if files.is_empty() {
        eprintln!("heap bench SKIPPED: no ../shared/traces/converted/*.trace beside the checkout");
        return;
    }
    let _profiler = dhat::Profiler::builder().testing().build();
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
