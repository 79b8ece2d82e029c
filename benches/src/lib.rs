//! # quilt-bench: trace replay, workloads and the A/B harness
#![forbid(unsafe_code)]

pub mod snapshot;
pub mod trace;
