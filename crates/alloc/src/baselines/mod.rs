//! The baselines Quilt is measured against, behind the same
//! [`DeviceAllocator`](crate::DeviceAllocator) trait so that an A/B is one switch:
//!
//! - [`classic`]: PyTorch's CUDA caching allocator (split blocks, small and large
//!   pools, 2 MiB / 20 MiB / rounded segments), rule for rule;
//! - [`expandable`]: the same with `expandable_segments:True`;
//! - [`offset`]: the `offset-allocator` crate over one fixed arena, no caching.
//!
//! The classic and expandable baselines share one engine (PyTorch itself is one
//! allocator with a switch), in the private `caching` module.

mod caching;
pub mod classic;
pub mod expandable;
pub mod offset;

#[cfg(test)]
mod proptests;

pub use caching::config::{
    RoundupPower2Divisions, LARGE_BUFFER, MIN_LARGE_ALLOC, ROUNDUP_INTERVALS, ROUND_LARGE,
    SMALL_BUFFER,
};
