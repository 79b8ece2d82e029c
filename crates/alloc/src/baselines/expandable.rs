//! `expandable`: PyTorch's caching allocator with `expandable_segments:True`
//! (`../shared/reference/pytorch-caching-allocator.md` §6).
//!
//! Each (stream, pool) gets one virtual range of 9/8 of the device total
//! (rounded up to whole pages), grown by mapping pages of 2 MiB (small pool) or
//! 20 MiB (large pool), one physical handle per page, at the lowest gap that
//! fits; one `set_access` covers each mapped run. Free blocks merge across page
//! boundaries; pages are unmapped only by `empty_cache` or before an
//! out-of-memory (release cached pages, retry). Any block splits when at least
//! 512 bytes remain. As in PyTorch, the `segment` statistic counts `cudaMalloc`
//! segments only and stays 0 here, and `inactive_split` excludes expandable blocks.

use std::sync::Arc;

use quilt_vmm::Vmm;

use super::caching::config::RoundupPower2Divisions;
use super::caching::CachingEngine;
use super::classic::ClassicConfig;
use crate::error::AllocError;

/// Settings of [`ExpandableAllocator`]; `Default` is PyTorch's default
/// configuration with `expandable_segments:True`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpandableConfig {
    /// `max_split_size_mb` in bytes (at least 20 MiB); `None` = unlimited.
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions` (off by default).
    pub roundup_power2_divisions: RoundupPower2Divisions,
    /// `garbage_collection_threshold` in (0, 1); active only with a memory fraction
    /// (and, as in PyTorch, it never frees expandable memory).
    pub garbage_collection_threshold: Option<f64>,
    /// `set_per_process_memory_fraction` in (0, 1], applied to the device total.
    pub memory_fraction: Option<f64>,
    /// Virtual bytes reserved per expandable segment; `None` = 9/8 of the device
    /// total (PyTorch's rule). Rounded up to whole pages.
    pub va_reserve_bytes: Option<u64>,
}

/// PyTorch's caching allocator with expandable segments, over a [`Vmm`].
#[derive(Debug)]
pub struct ExpandableAllocator {
    engine: CachingEngine,
}

impl ExpandableAllocator {
    /// An expandable-segments allocator on `vmm`. Fails with
    /// [`AllocError::InvalidSize`] for a setting out of range, or
    /// [`AllocError::Driver`] if `mem_info` fails.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::expandable::{ExpandableAllocator, ExpandableConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = ExpandableAllocator::new(vmm, ExpandableConfig::default())?;
    /// let a = alloc.allocate(30 << 20, StreamId::DEFAULT)?;
    /// alloc.free(a.ptr)?;
    /// alloc.check_invariants()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(vmm: Arc<dyn Vmm>, config: ExpandableConfig) -> Result<Self, AllocError> {
        let classic = ClassicConfig {
            max_split_size: config.max_split_size,
            roundup_power2_divisions: config.roundup_power2_divisions,
            garbage_collection_threshold: config.garbage_collection_threshold,
            memory_fraction: config.memory_fraction,
        };
        let mut settings = classic.settings(&*vmm, true)?;
        if let Some(va) = config.va_reserve_bytes {
            if va == 0 {
                return Err(AllocError::InvalidSize {
                    size: va,
                    reason: "the expandable reservation must be non-zero",
                });
            }
            settings.expandable_va_bytes = va;
        }
        Ok(ExpandableAllocator {
            engine: CachingEngine::new("expandable", vmm, settings),
        })
    }
}

super::caching::delegate_to_engine!(ExpandableAllocator);
