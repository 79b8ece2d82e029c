//! The allocator's error type and its out-of-memory diagnosis.

use std::fmt;

use quilt_vmm::{DevicePtr, VmmError};

/// Everything an allocator operation can fail with. After any of these the
/// allocator is consistent and usable, and nothing has leaked.
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::{AllocError, DeviceAllocator};
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 << 20)?);
/// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
/// let s = StreamId::DEFAULT;
/// let block = alloc.allocate(1 << 20, s)?;
/// for result in [
///     alloc.allocate(0, s).map(|_| ()),         // InvalidSize
///     alloc.allocate(100 << 20, s).map(|_| ()), // OutOfMemory, with its report
///     alloc.free(block.ptr + 512),              // UnknownPointer: not a block's start
/// ] {
///     match result {
///         Err(AllocError::InvalidSize { size, reason }) => println!("size {size}: {reason}"),
///         Err(AllocError::OutOfMemory(report)) => println!("{:?}: {report}", report.verdict),
///         Err(e @ AllocError::UnknownPointer { .. }) => println!("{e}"),
///         other => return Err(format!("unexpected {other:?}").into()),
///     }
/// }
/// // None of them changed anything: the block is still live, and freed once.
/// assert_eq!(alloc.stats().allocation.current, 1);
/// alloc.free(block.ptr)?;
/// assert!(matches!(alloc.free(block.ptr), Err(AllocError::DoubleFree { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Zero, or larger than any allocation can be.
    #[error("invalid size {size}: {reason}")]
    InvalidSize {
        /// The size asked for.
        size: u64,
        /// The rule it broke.
        reason: &'static str,
    },
    /// The device cannot back the request; the report says why.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// The pointer is not the start of a live allocation.
    #[error("unknown pointer {ptr:#x}: not the start of a live allocation")]
    UnknownPointer {
        /// The pointer passed.
        ptr: DevicePtr,
    },
    /// The pointer was the start of an allocation that is already free.
    #[error("double free of {ptr:#x}")]
    DoubleFree {
        /// The pointer passed.
        ptr: DevicePtr,
    },
    /// A driver call failed; what the allocator held before the call is intact.
    #[error("driver call failed: {0}")]
    Driver(#[from] VmmError),
    /// A reservation of virtual address space failed for lack of address
    /// space (the driver's [`VmmError::AddressSpaceExhausted`]): not device
    /// memory, so no out-of-memory report, and freeing memory does not help.
    /// Reserving less does: a smaller `ArenaLayout::va_factor`, or fewer
    /// arenas (growable buffers, tags, per-stream arenas each reserve one).
    #[error("virtual address space exhausted reserving {requested} bytes with {reservations} reservation(s) held: {source}")]
    AddressSpaceExhausted {
        /// Bytes of address space asked for.
        requested: u64,
        /// Reservations the allocator held when it failed.
        reservations: usize,
        /// The driver's error.
        source: VmmError,
    },
    /// A stream operation the stream's state forbids now (a stream that is
    /// capturing a CUDA graph, one a live growable buffer grows on, the
    /// default stream forgotten), or that the allocator does not support.
    #[error("stream {stream:#x}: {reason}")]
    StreamBusy {
        /// The stream (its [`quilt_vmm::StreamId`] value).
        stream: u64,
        /// Why, in words.
        reason: &'static str,
    },
    /// An internal lock was poisoned by a panic on another thread.
    #[error("allocator state poisoned by a panic on another thread")]
    Poisoned,
    /// A configuration that would break one of the allocator's promises, or
    /// that sets a knob the rest of it ignores.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// The rule it breaks.
        reason: String,
    },
    /// The page pool refused: a limit below what it holds, a page it did not
    /// hand out (a bug), ... The operation changed nothing.
    #[error("page pool: {0}")]
    Pool(Box<quilt_pool::PoolError>),
    /// A bug: a layer below refused what the allocator's own books allowed.
    /// The operation changed nothing; the allocator stays usable.
    #[error("internal error (a bug in the allocator): {0}")]
    Internal(String),
    /// The id names no live growable buffer: never created, or released.
    #[error("unknown growable buffer {id}: never created, or already released")]
    UnknownGrowable {
        /// The id passed.
        id: u64,
    },
    /// A resize a growable buffer refuses: past its maximum, `grow_to` below
    /// its length or `shrink_to` above it. Nothing changed.
    #[error("growable buffer {id} of {len} bytes (at most {max}) cannot resize to {requested}: {reason}")]
    InvalidResize {
        /// The buffer.
        id: u64,
        /// Its length in bytes.
        len: u64,
        /// Its maximum length in bytes.
        max: u64,
        /// The length asked for.
        requested: u64,
        /// The rule it broke.
        reason: &'static str,
    },
    /// A sleep or wake that the tag's state refuses (an unknown tag, a
    /// sleep of a sleeping tag, a wake of an awake one), or an operation on a
    /// member of a sleeping tag (free, resize, record-stream, release, a new
    /// tagged allocation). Nothing changed.
    #[error("tag {tag:?}: {reason}")]
    TagState {
        /// The tag.
        tag: String,
        /// What was refused, in words.
        reason: &'static str,
    },
    /// Sharing an allocation with another process ([`crate::ipc`]) was
    /// refused: a malformed or unexpected message, a descriptor whose pieces
    /// do not tile it, handles that do not match its pieces, an allocation
    /// that cannot be exported, no export to end, or the socket failing.
    /// Nothing changed on this side.
    #[error("shared allocation: {reason}")]
    Sharing {
        /// What was refused, in words.
        reason: String,
    },
}

impl AllocError {
    /// The out-of-memory report, if this is an out-of-memory error.
    pub fn oom_report(&self) -> Option<&OomReport> {
        match self {
            AllocError::OutOfMemory(r) => Some(r),
            _ => None,
        }
    }
}

/// Why a request ran out of memory.
///
/// The same requests on two allocators of the same 100 MiB: PyTorch's classic
/// caching allocator runs out of memory with about half the memory free, in
/// holes (`Fragmentation`); Quilt maps scattered free pages behind one range
/// and serves the request. Quilt runs out only where the pages are missing
/// (`Capacity`).
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::{AllocError, Allocation, DeviceAllocator, OomVerdict};
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// // 25 blocks of 4 MiB fill the device; every other one is freed (52 MiB
/// // free, in 4 MiB holes); then 40 MiB.
/// fn fragment(alloc: &dyn DeviceAllocator) -> Result<Result<Allocation, AllocError>, AllocError> {
///     let blocks = (0..25)
///         .map(|_| alloc.allocate(4 << 20, StreamId::DEFAULT))
///         .collect::<Result<Vec<_>, _>>()?;
///     for b in blocks.iter().step_by(2) {
///         alloc.free(b.ptr)?;
///     }
///     Ok(alloc.allocate(40 << 20, StreamId::DEFAULT))
/// }
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(100 << 20)?);
/// let classic = CachingAllocator::new(vmm, CachingConfig::classic())?;
/// let err = fragment(&classic)?.unwrap_err();
/// assert_eq!(err.oom_report().map(|r| r.verdict), Some(OomVerdict::Fragmentation));
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(100 << 20)?);
/// let quilt = QuiltAllocator::new(vmm, QuiltConfig::default())?;
/// assert!(fragment(&quilt)?.is_ok());
/// let err = quilt.allocate(100 << 20, StreamId::DEFAULT).unwrap_err();
/// assert_eq!(err.oom_report().map(|r| r.verdict), Some(OomVerdict::Capacity));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum OomVerdict {
    /// Free plus reclaimable memory is smaller than the request: a real shortage.
    Capacity,
    /// Enough memory is free in total, but not in a shape the allocator can use.
    Fragmentation,
}

/// The figures behind an out-of-memory error.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::{DeviceAllocator, OomVerdict};
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 << 20)?);
/// let alloc = QuiltAllocator::new(vmm, QuiltConfig::default())?;
/// let err = alloc.allocate(100 << 20, StreamId::DEFAULT).unwrap_err();
/// let report = err.oom_report().expect("an out-of-memory report");
/// assert_eq!(report.verdict, OomVerdict::Capacity);
/// assert!(err.to_string().contains("verdict: capacity"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct OomReport {
    /// The allocator that failed.
    pub allocator: String,
    /// Bytes asked for.
    pub requested: u64,
    /// The request after the allocator's rounding: for Quilt, rounded to
    /// 512 B and then up to whole pages; for the caching baselines, the block
    /// size; for `offset`, its allocation units.
    pub needed: u64,
    /// Bytes of physical memory the allocator had to add to serve the
    /// request: for Quilt, the pages of its range not backed already (at most
    /// `needed`, less where the range shares a backed page); for `classic`,
    /// the segment it would create (20 MiB for a 4 MiB block, as PyTorch);
    /// for `expandable`, `needed` rounded to the granularity; for `offset`,
    /// `needed`. The verdict weighs this against `reclaimable + device_free`.
    pub needed_unbacked: u64,
    /// Device capacity (or the allocator's memory limit) in bytes.
    pub capacity: u64,
    /// Bytes reserved from the driver (physical memory held).
    pub reserved: u64,
    /// Bytes handed out to live allocations.
    pub allocated: u64,
    /// Bytes the allocator could still create on the device (within its
    /// limit), whatever the request: a request larger than an empty
    /// device still sees the whole device here.
    pub device_free: u64,
    /// Bytes held but not backing any live allocation that could serve this
    /// request after reclaiming caches (free pages plus reclaimable cached pages).
    pub reclaimable: u64,
    /// The largest contiguous free extent the allocator could hand out whole.
    pub largest_free_extent: u64,
    /// Capacity or fragmentation.
    pub verdict: OomVerdict,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let verdict = match self.verdict {
            OomVerdict::Capacity => "capacity: the device really has too little memory",
            OomVerdict::Fragmentation => {
                "fragmentation: enough memory is free in total, but not in one usable piece"
            }
        };
        write!(
            f,
            "{}: out of memory allocating {} bytes ({:.2} MiB, {:.2} MiB rounded, {:.2} MiB of \
             new memory); capacity {:.2} MiB, reserved {:.2} MiB, allocated {:.2} MiB, \
             device free {:.2} MiB, free or reclaimable {:.2} MiB, largest free extent {:.2} MiB; \
             verdict: {}",
            self.allocator,
            self.requested,
            mib(self.requested),
            mib(self.needed),
            mib(self.needed_unbacked),
            mib(self.capacity),
            mib(self.reserved),
            mib(self.allocated),
            mib(self.device_free),
            mib(self.reclaimable),
            mib(self.largest_free_extent),
            verdict
        )
    }
}

/// An invariant the checker found broken: a bug in the allocator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant violated: {0}")]
pub struct InvariantViolation(pub String);
