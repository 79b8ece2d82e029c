//! `classic`: PyTorch's split-block CUDA caching allocator, rule for rule
//! (`../shared/reference/pytorch-caching-allocator.md` §1–§5, §7).
//!
//! Requests are rounded to 512 bytes (or by `roundup_power2_divisions`), served
//! best-fit from per-stream free sets ordered by `(stream, size, address)`, split
//! and merged inside segments of 2 MiB (small pool, ≤ 1 MiB), 20 MiB (large
//! requests below 10 MiB) or the request rounded up to 2 MiB. When no cached
//! block fits and the driver is full, the allocator frees cached segments
//! (oversize ones first when `max_split_size` is set, then every whole free
//! segment) and retries before reporting out-of-memory.
//!
//! A segment is a `cudaMalloc`, modelled on the [`Vmm`] as `reserve + create +
//! map + set_access` of the segment size; freeing it is `unmap + release +
//! address_free`.
//!
//! One deliberate deviation: when `max_split_size` is set, the oversize release
//! step (`release_available_cached_blocks`) frees only free blocks that are whole
//! segments; PyTorch would `cudaFree` the block it finds even if it were part of
//! a split segment (which its own rules make impossible in practice, since only
//! blocks below `max_split_size` are split).
//!
//! Fidelity (`benches/tests/fidelity.rs`): replayed on the simulated driver, the
//! peak reserved bytes equal PyTorch's on four real traces; on the one trace with
//! its raw snapshot, every `cudaMalloc` has PyTorch's size in PyTorch's order and,
//! given PyTorch's segment addresses, every allocation lands at PyTorch's address.

use std::sync::Arc;

use quilt_vmm::Vmm;

use super::caching::config::{
    validate_common, CachingSettings, RoundupPower2Divisions, LARGE_BUFFER,
};
use super::caching::CachingEngine;
use crate::error::AllocError;

/// Settings of [`ClassicAllocator`] (`PYTORCH_CUDA_ALLOC_CONF`); `Default` is
/// PyTorch's default configuration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClassicConfig {
    /// `max_split_size_mb` in bytes (at least 20 MiB); `None` = unlimited.
    /// Blocks this big are never split and never handed to smaller requests.
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions` (off by default).
    pub roundup_power2_divisions: RoundupPower2Divisions,
    /// `garbage_collection_threshold` in (0, 1); active only with a memory fraction.
    pub garbage_collection_threshold: Option<f64>,
    /// `set_per_process_memory_fraction` in (0, 1], applied to the device total.
    pub memory_fraction: Option<f64>,
}

impl ClassicConfig {
    /// Validate and resolve against the device (`mem_info` total).
    pub(crate) fn settings(
        &self,
        vmm: &dyn Vmm,
        expandable: bool,
    ) -> Result<CachingSettings, AllocError> {
        let (max_split_size, gc_threshold, fraction) = validate_common(
            self.max_split_size,
            &self.roundup_power2_divisions,
            self.garbage_collection_threshold,
            self.memory_fraction,
        )?;
        let total = vmm.mem_info()?.total;
        let gran = vmm.granularity().max(1);
        let page = |p: u64| p.div_ceil(gran) * gran;
        Ok(CachingSettings {
            max_split_size,
            max_non_split_rounding_size: LARGE_BUFFER,
            divisions: self.roundup_power2_divisions,
            gc_threshold,
            allowed_memory_maximum: fraction.map(|f| (f * total as f64) as u64),
            expandable,
            large_page: page(LARGE_BUFFER),
            small_page: page(super::caching::config::SMALL_BUFFER),
            expandable_va_bytes: total + total / 8,
            device_total: total,
        })
    }
}

/// PyTorch's classic caching allocator over a [`Vmm`].
#[derive(Debug)]
pub struct ClassicAllocator {
    engine: CachingEngine,
}

impl ClassicAllocator {
    /// A classic allocator on `vmm`. Fails with [`AllocError::InvalidSize`] for a
    /// setting out of range, or [`AllocError::Driver`] if `mem_info` fails.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::classic::{ClassicAllocator, ClassicConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let config = ClassicConfig { max_split_size: Some(256 << 20), ..ClassicConfig::default() };
    /// let alloc = ClassicAllocator::new(vmm, config)?;
    /// let a = alloc.allocate(5 << 20, StreamId::DEFAULT)?;
    /// assert_eq!(alloc.stats().reserved_bytes.current, 20 << 20, "a 20 MiB segment, as PyTorch");
    /// alloc.free(a.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(vmm: Arc<dyn Vmm>, config: ClassicConfig) -> Result<Self, AllocError> {
        let settings = config.settings(&*vmm, false)?;
        Ok(ClassicAllocator {
            engine: CachingEngine::new("classic", vmm, settings),
        })
    }
}

super::caching::delegate_to_engine!(ClassicAllocator);
