//! The baselines Quilt is measured against, behind the same
//! [`DeviceAllocator`](crate::DeviceAllocator) trait so that an A/B is one switch:
//!
//! - `classic`: PyTorch's CUDA caching allocator (split blocks, small and large
//!   pools, 2 MiB / 20 MiB / rounded segments), rule for rule:
//!   [`CachingAllocator`] with [`CachingConfig::classic`];
//! - `expandable`: the same with `expandable_segments:True`:
//!   [`CachingAllocator`] with [`CachingConfig::expandable`];
//! - [`offset`]: the `offset-allocator` crate over one fixed arena, no caching.
//!
//! The classic and expandable baselines are one allocator with a switch, as
//! PyTorch's is ([`caching`]).

pub mod caching;
pub mod offset;

#[cfg(test)]
mod proptests;

pub use caching::config::{
    CachingConfig, RoundupPower2Divisions, LARGE_BUFFER, MIN_LARGE_ALLOC, ROUNDUP_INTERVALS,
    ROUND_LARGE, SMALL_BUFFER,
};
pub use caching::CachingAllocator;
