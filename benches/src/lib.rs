//! # quilt-bench: trace replay, workloads and the A/B harness
//!
//! - [`trace`]: the text trace format; [`snapshot`]: PyTorch snapshot pickles;
//!   [`workloads`]: built-in generators.
//! - [`replay`]: a trace through an allocator on a simulated device, with
//!   metrics ([`live`]: live bytes and the page-granular ideal); [`bisect`]: the
//!   minimum capacity at which it completes; [`serving`]: the serving events
//!   (growable buffers, sleep and wake) natively on Quilt, emulated elsewhere.
//! - [`allocators`]: the registry of allocators by name; [`report`]: rows, JSON
//!   and charts; [`table`]: the text table, its legend and summary; [`cli`]:
//!   the `quilt-bench` command line; [`units`]: byte sizes.
#![forbid(unsafe_code)]

pub mod allocators;
pub mod bisect;
pub mod cli;
pub mod live;
pub mod replay;
pub mod report;
pub mod scale;
pub mod serving;
pub mod snapshot;
pub mod spec;
pub mod sweep;
pub mod table;
pub mod trace;
pub mod units;
pub mod workloads;
