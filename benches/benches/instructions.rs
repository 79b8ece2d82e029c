//! Instructions per allocator operation in steady state, for callgrind: the
//! same steady-state pass as the `traces` and `heap` benches (see
//! `steady/mod.rs`), for one allocator on the real traces whose names
//! contain a filter, with the measured passes in one function that callgrind
//! can collect alone. Prints the operations measured per trace; the
//! instructions come from callgrind:
//!
//! ```sh
//! cargo bench -p quilt-bench --bench instructions --no-run   # prints the binary
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measured_passes*' \
//!     target/release/deps/instructions-HASH quilt bert_large
//! ```
//!
//! Instructions per operation: the `Ir` total over the operations printed.
//! Without the traces the bench says so and measures nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // benchmark code

mod steady;

use steady::{slice, trace_files, Bench, Op};

/// Passes measured per trace.
const PASSES: usize = 3;

/// The measured passes (not inlined: callgrind collects this function).
#[inline(never)]
fn measured_passes(b: &mut Bench, pass: &[Op]) {
    for _ in 0..PASSES {
        b.run(pass);
    }
}

fn main() {
    // `cargo bench` passes `--bench`; the first other arguments are the
    // allocator and the trace filter.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let allocator = args.first().map_or("quilt", String::as_str);
    let filter = args.get(1).map_or("", String::as_str);
    let files = trace_files();
    if files.is_empty() {
        eprintln!(
            "instructions bench SKIPPED: no ../shared/traces/converted/*.trace beside the checkout"
        );
        return;
    }
    let mut total = 0;
    for path in files
        .iter()
        .filter(|p| p.to_string_lossy().contains(filter))
    {
        let s = slice(path);
        let mut b = Bench::new(allocator, &s);
        measured_passes(&mut b, &s.pass);
        let ops = PASSES * s.pass.len();
        println!("{allocator} {} ops {ops}", s.name);
        total += ops;
    }
    println!("{allocator} total ops {total}");
}
