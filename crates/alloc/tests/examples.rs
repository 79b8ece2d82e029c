//! The examples that need no GPU, run as tests so that what they claim stays
//! true: `readme` runs to the end, and in `fragmentation` classic runs out of
//! memory (a fragmentation verdict) where Quilt serves the same request on
//! the same simulated capacity. (`cudarc_kernel` needs a GPU:
//! `scripts/gpu-check.sh` runs it.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

#[allow(dead_code)] // its `main` is the example's, not called here
#[path = "../examples/fragmentation.rs"]
mod fragmentation;

#[allow(dead_code)]
#[path = "../examples/readme.rs"]
mod readme;

use quilt_alloc::{AllocError, OomVerdict};

#[test]
fn readme_example_runs() {
    readme::main().unwrap();
}

#[test]
fn fragmentation_example_classic_fails_where_quilt_serves() {
    let [classic, quilt] = fragmentation::outcomes().unwrap();
    let Err(AllocError::OutOfMemory(report)) = classic else {
        panic!("classic did not run out of memory: {classic:?}");
    };
    assert_eq!(report.verdict, OomVerdict::Fragmentation, "{report}");
    assert_eq!(report.requested, fragmentation::LARGE);
    let served = quilt.unwrap();
    assert!(served.size >= fragmentation::LARGE);
    fragmentation::main().unwrap();
}
