//! The allocator trait that Quilt and every baseline implement, so that an A/B
//! comparison is one switch.

use std::sync::Arc;

use quilt_vmm::{DevicePtr, StreamId, Vmm};

#[cfg(feature = "invariants")]
use crate::error::InvariantViolation;
use crate::error::{AllocError, OomReport};
use crate::snapshot::MemorySnapshot;
use crate::stats::AllocatorStats;

/// What a successful allocation hands back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the first byte. Never 0.
    pub ptr: DevicePtr,
    /// Bytes usable at `ptr`: at least the size asked for (the rounded size).
    pub size: u64,
}

/// A device memory allocator for one device.
///
/// Contract, shared by every implementation:
/// - `allocate(0, _)` and sizes past [`MAX_ALLOCATION`] are
///   [`AllocError::InvalidSize`]; a request the device cannot back is
///   [`AllocError::OutOfMemory`] with a diagnosis; the allocator stays usable.
/// - `free` of a pointer that is not the start of a live allocation is
///   [`AllocError::UnknownPointer`] (or [`AllocError::DoubleFree`] where the
///   allocator can tell) and changes nothing.
/// - A block freed on its stream may be reused at once on that stream; on another
///   stream only after the events of every stream it was recorded on
///   (`record_stream`) have completed.
/// - `check_invariants` (with the `invariants` feature) is cheap enough to
///   call after every operation in tests.
///
/// Every allocator of this crate behind one trait:
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::{AllocError, DeviceAllocator};
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
/// let quilt: Box<dyn DeviceAllocator> = Box::new(QuiltAllocator::new(vmm.clone(), QuiltConfig::default())?);
/// for alloc in [quilt] {
///     let a = alloc.allocate(3 << 20, StreamId(1))?;
///     alloc.record_stream(a.ptr, StreamId(2))?; // used on stream 2 too
///     alloc.free(a.ptr)?;
///     assert!(matches!(alloc.free(a.ptr), Err(AllocError::DoubleFree { .. })));
///     assert!(matches!(alloc.allocate(0, StreamId(1)), Err(AllocError::InvalidSize { .. })));
///     alloc.empty_cache()?;
///     assert_eq!(alloc.stats().reserved_bytes.current, 0);
///     alloc.check_invariants()?;
/// }
/// # let _ = CachingAllocator::new(vmm, CachingConfig::classic())?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait DeviceAllocator: Send + Sync {
    /// Short name of the allocator (`quilt`, `classic`, `expandable`, `gmlake`, `offset`).
    fn name(&self) -> &str;

    /// Allocate `size` bytes for use on `stream`.
    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError>;

    /// Free the allocation starting at `ptr`.
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError>;

    /// Note that the live allocation at `ptr` is also used on `stream`
    /// (PyTorch's `record_stream`): its memory is not reused until the work queued
    /// on `stream` before its free has completed.
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError>;

    /// Forget `stream`: its owner is about to destroy it. Afterwards the
    /// allocator never hands the stream's handle to the driver again (its
    /// work is made complete once, its pending events resolved, memory
    /// cached with its hazards becomes plain free memory). Quilt
    /// ([`crate::quilt::QuiltAllocator::forget_stream`]) and the caching
    /// baselines (`classic`, `expandable`) implement it; the default (the
    /// `offset` baseline) refuses with [`AllocError::StreamBusy`] and
    /// changes nothing.
    fn forget_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        Err(AllocError::StreamBusy {
            stream: stream.0,
            reason: "this allocator cannot forget a stream",
        })
    }

    /// Release every cached block that can be released back to the driver
    /// (PyTorch's `empty_cache`).
    fn empty_cache(&self) -> Result<(), AllocError>;

    /// Statistics, in PyTorch's vocabulary.
    fn stats(&self) -> AllocatorStats;

    /// Sets every peak of [`DeviceAllocator::stats`] to its current value
    /// (`torch.cuda.reset_peak_memory_stats`).
    fn reset_peak_stats(&self) -> Result<(), AllocError>;

    /// Segments and blocks as they stand now.
    fn snapshot(&self) -> MemorySnapshot;

    /// The memory as the GPU sees it: segments that are backed end to end,
    /// each tiled by its blocks (no `Unmapped` block). By default the
    /// [`snapshot`](DeviceAllocator::snapshot) with every segment cut at its
    /// unmapped blocks ([`crate::snapshot::without_unmapped`]).
    fn gpu_segments(&self) -> MemorySnapshot {
        crate::snapshot::without_unmapped(self.snapshot())
    }

    /// Check every internal invariant; the first violation found is returned.
    /// Only with the `invariants` feature (tests, fuzzing, debugging).
    #[cfg(feature = "invariants")]
    fn check_invariants(&self) -> Result<(), InvariantViolation>;

    /// The driver backend underneath (for driver statistics and leak reports).
    fn vmm(&self) -> &Arc<dyn Vmm>;

    /// The report of the last request that ran out of memory, kept until
    /// the next one replaces it (`None` before any). Every allocator of this
    /// crate keeps it; the default, for allocators that never run out of
    /// memory or do not keep one, is `None`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
    /// use quilt_alloc::{DeviceAllocator, OomVerdict};
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 << 20)?);
    /// let alloc = CachingAllocator::new(vmm, CachingConfig::classic())?;
    /// assert!(alloc.last_oom().is_none());
    /// let err = alloc.allocate(100 << 20, StreamId::DEFAULT).unwrap_err();
    /// let last = alloc.last_oom().expect("kept");
    /// assert_eq!(Some(&last), err.oom_report());
    /// assert_eq!((last.requested, last.verdict), (100 << 20, OomVerdict::Capacity));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn last_oom(&self) -> Option<OomReport> {
        None
    }

    /// A text summary of the memory in the spirit of
    /// `torch.cuda.memory_summary()`: current and peak allocated, reserved,
    /// cached, active blocks, segments, driver calls, and the last
    /// out-of-memory report ([`crate::summary::MemorySummary`]).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
    /// let a = alloc.allocate(300 << 20, StreamId::DEFAULT)?;
    /// let text = alloc.memory_summary();
    /// assert!(text.contains("quilt memory summary"));
    /// assert!(text.contains("Allocated memory"));
    /// println!("{text}");
    /// # alloc.free(a.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn memory_summary(&self) -> String {
        crate::summary::MemorySummary::of(self).to_string()
    }
}

/// The largest single request any allocator accepts: 1 TiB. Larger sizes are
/// rejected as invalid before any rounding can overflow.
pub const MAX_ALLOCATION: u64 = 1 << 40;

/// PyTorch's smallest block and rounding unit: 512 bytes.
pub const MIN_BLOCK_SIZE: u64 = 512;

/// The boundary between small and large requests: 1 MiB.
pub const SMALL_SIZE: u64 = 1 << 20;

/// Round `size` up to a multiple of `unit` (a power of two); `None` on overflow.
pub fn round_up(size: u64, unit: u64) -> Option<u64> {
    debug_assert!(unit.is_power_of_two());
    size.checked_add(unit - 1).map(|s| s & !(unit - 1))
}

/// Validate a requested size against the shared contract.
pub fn check_size(size: u64) -> Result<(), AllocError> {
    if size == 0 {
        return Err(AllocError::InvalidSize {
            size,
            reason: "size must be non-zero",
        });
    }
    if size > MAX_ALLOCATION {
        return Err(AllocError::InvalidSize {
            size,
            reason: "size exceeds the 1 TiB limit of a single allocation",
        });
    }
    Ok(())
}
