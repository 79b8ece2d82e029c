//! # quilt-bench: trace replay, workloads and the A/B harness
//!
//! - [`trace`]: the text trace format; [`snapshot_import`]: PyTorch snapshot pickles;
//!   [`workloads`]: built-in generators.
//! - [`replay`]: a trace through an allocator on a simulated device, with
//!   metrics ([`live`]: live bytes and the page-granular ideal); [`bisect`]: the
//!   minimum capacity at which it completes; [`races`]: memory reused while
//!   another stream's work may still use it, unordered; [`serving_events`]: the serving events
//!   (growable buffers, sleep and wake) natively on Quilt, emulated elsewhere.
//! - [`ab`]: the A/B measuring (every pair, on worker threads); [`scale`]:
//!   host cost per operation as live blocks and streams grow; [`sweep`]: one
//!   knob's values as specs; [`latency`]: the driver-call latency
//!   micro-benchmark (`--example driver_latency`).
//! - [`live_program`]: the live A/B, a real PyTorch program on the simulated
//!   GPU under torch's allocators and Quilt (`quilt-bench live`).
//! - [`allocators`]: the registry of allocators by name and what each can
//!   do; [`report`]: the outputs, a module each (rows, text, JSON, charts);
//!   [`cli`]: the `quilt-bench` command line; [`units`]: byte sizes.
#![forbid(unsafe_code)]

pub mod ab;
pub mod allocators;
pub mod bisect;
pub mod cli;
pub mod latency;
pub mod live;
pub mod live_program;
pub mod races;
pub mod replay;
pub mod report;
pub mod scale;
pub mod serving_events;
pub mod snapshot_import;
pub mod spec;
pub mod sweep;
pub mod trace;
pub mod units;
pub mod workloads;
