//! # quilt-alloc: the Quilt allocator and its baselines
//!
//! [`DeviceAllocator`] is the one trait every allocator here implements.
#![forbid(unsafe_code)]

pub mod api;
pub mod baselines;
pub mod buffer;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda_buffer;
pub mod error;
pub mod export_pins;
pub mod ipc;
pub mod quilt;
pub mod registry;
pub mod settings;
pub mod snapshot;
pub mod stats;
pub mod summary;
pub mod units;

pub use api::{Allocation, DeviceAllocator, MAX_ALLOCATION, MIN_BLOCK_SIZE, SMALL_SIZE};
pub use buffer::Buffer;
pub use error::{AllocError, InvariantViolation, OomReport, OomVerdict};
pub use snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};
pub use stats::{AllocatorStats, Stat};
pub use summary::MemorySummary;
