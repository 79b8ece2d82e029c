//! Plain value types shared by every backend.

use std::fmt;

/// A device virtual address (CUDA's `CUdeviceptr`). `0` is never a valid address.
pub type DevicePtr = u64;

/// An opaque handle to physical memory created by [`crate::Vmm::create`]
/// (CUDA's `CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysHandle(pub u64);

/// A stream: work on one stream runs in order. `StreamId(0)` is the default stream.
/// On the CUDA backend the value is the raw `CUstream` pointer of a stream it
/// made or adopted, except for two: the legacy default stream (`0x1`,
/// `CU_STREAM_LEGACY`, adopted) is `StreamId(0)`, and the per-thread default
/// stream (`0x2`, `CU_STREAM_PER_THREAD`, which names the calling thread's
/// own stream) is one id per adopting thread (see
/// `quilt_vmm::cuda::CudaVmm::adopt_stream`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The default (legacy) stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

/// An event recorded on a stream; it completes once the work queued before it on
/// that stream has finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u64);

/// Which `map` calls a backend accepts, beyond the rules every backend checks
/// (alignment, a live handle, `offset + size` inside it, one reservation, no
/// overlap).
///
/// CUDA's driver API reference for `cuMemMap` says of `offset`: "currently must
/// be zero", and every production VMM allocator maps one handle per unit, whole.
/// So the default, [`MapRule::WholeHandle`], refuses a non-zero `offset` and a
/// `size` other than the handle's own with [`crate::VmmError::InvalidArgument`]
/// naming the rule. [`MapRule::AnyOffset`] lifts that for what-if experiments
/// on the simulated and host backends only (the CUDA backend always uses
/// `WholeHandle`); [`crate::Vmm::map_rule`] tells which one a backend uses, so
/// that a report can say when a result depends on the relaxed rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MapRule {
    /// CUDA's documented rule (the default): a mapping covers its handle whole,
    /// at offset 0 (`offset == 0` and `size == ` the handle's size).
    #[default]
    WholeHandle,
    /// Experiment: map any granule-aligned part of a handle, at any
    /// granule-aligned offset inside it (not documented to work on CUDA).
    AnyOffset,
}

impl MapRule {
    /// A short name for reports: `whole-handle` or `any-offset`.
    pub fn name(self) -> &'static str {
        match self {
            MapRule::WholeHandle => "whole-handle",
            MapRule::AnyOffset => "any-offset",
        }
    }

    /// True for a rule more permissive than CUDA's documented one.
    pub fn is_relaxed(self) -> bool {
        self != MapRule::WholeHandle
    }
}

impl fmt::Display for MapRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Device memory figures, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    /// Total device memory in bytes.
    pub total: u64,
    /// Memory not yet backing any physical handle, in bytes.
    pub free: u64,
}

/// The kinds of driver call, for counters, costs and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CallKind {
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    AddressFree,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuEventRecord` (with a `cuEventCreate` when no pooled event is free).
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuStreamWaitEvent`.
    StreamWaitEvent,
    /// `cuStreamSynchronize` (and `cuCtxSynchronize`, made by
    /// [`crate::Vmm::device_synchronize`]: one drain of the queue either way).
    StreamSynchronize,
    /// `cuMemExportToShareableHandle`.
    ExportHandle,
    /// `cuMemImportFromShareableHandle`.
    ImportHandle,
    /// `cuMemcpyDtoH`: device memory copied to the host (its size is the byte count).
    MemcpyDtoH,
    /// `cuMemcpyHtoD`: host memory copied to the device (its size is the byte count).
    MemcpyHtoD,
    /// `cuStreamIsCapturing`: whether a stream is capturing a CUDA graph.
    StreamIsCapturing,
}

impl CallKind {
    /// How many kinds there are (the length of [`CallKind::ALL`]).
    pub const COUNT: usize = 18;

    /// Every kind, in declaration order (the index of a kind is its position here).
    pub const ALL: [CallKind; CallKind::COUNT] = [
        CallKind::Reserve,
        CallKind::AddressFree,
        CallKind::Create,
        CallKind::Release,
        CallKind::Map,
        CallKind::Unmap,
        CallKind::SetAccess,
        CallKind::MemInfo,
        CallKind::EventRecord,
        CallKind::EventQuery,
        CallKind::EventDestroy,
        CallKind::StreamWaitEvent,
        CallKind::StreamSynchronize,
        CallKind::ExportHandle,
        CallKind::ImportHandle,
        CallKind::MemcpyDtoH,
        CallKind::MemcpyHtoD,
        CallKind::StreamIsCapturing,
    ];

    /// Position of this kind in [`CallKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The CUDA driver function this kind stands for.
    pub fn driver_name(self) -> &'static str {
        match self {
            CallKind::Reserve => "cuMemAddressReserve",
            CallKind::AddressFree => "cuMemAddressFree",
            CallKind::Create => "cuMemCreate",
            CallKind::Release => "cuMemRelease",
            CallKind::Map => "cuMemMap",
            CallKind::Unmap => "cuMemUnmap",
            CallKind::SetAccess => "cuMemSetAccess",
            CallKind::MemInfo => "cuMemGetInfo",
            CallKind::EventRecord => "cuEventRecord",
            CallKind::EventQuery => "cuEventQuery",
            CallKind::EventDestroy => "cuEventDestroy",
            CallKind::StreamWaitEvent => "cuStreamWaitEvent",
            CallKind::StreamSynchronize => "cuStreamSynchronize",
            CallKind::ExportHandle => "cuMemExportToShareableHandle",
            CallKind::ImportHandle => "cuMemImportFromShareableHandle",
            CallKind::MemcpyDtoH => "cuMemcpyDtoH",
            CallKind::MemcpyHtoD => "cuMemcpyHtoD",
            CallKind::StreamIsCapturing => "cuStreamIsCapturing",
        }
    }

    /// True for the copies between host and device ([`CallKind::MemcpyDtoH`],
    /// [`CallKind::MemcpyHtoD`]).
    pub fn is_copy(self) -> bool {
        matches!(self, CallKind::MemcpyDtoH | CallKind::MemcpyHtoD)
    }

    /// True for the seven VMM calls the allocator reports on (reserve, create,
    /// map, set-access, unmap, release, address-free).
    pub fn is_vmm(self) -> bool {
        matches!(
            self,
            CallKind::Reserve
                | CallKind::AddressFree
                | CallKind::Create
                | CallKind::Release
                | CallKind::Map
                | CallKind::Unmap
                | CallKind::SetAccess
        )
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.driver_name())
    }
}

/// Driver calls made through one backend: counts by kind, and time.
///
/// Invariant: `calls[k.index()]` counts every call of kind `k` that reached the
/// backend, whether it succeeded or failed; `failed` counts the failures among them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Calls by [`CallKind::index`].
    pub calls: [u64; CallKind::COUNT],
    /// Calls that returned an error, by kind.
    pub failed: [u64; CallKind::COUNT],
    /// Modelled driver time in nanoseconds (simulated backend; 0 elsewhere),
    /// with `cuMemCreate` costed in proportion to the handle's size.
    pub modelled_ns: u64,
    /// The same, with every `cuMemCreate` costed as one flat per-call figure
    /// whatever its size (the cost model's alternative; reports give both).
    pub modelled_flat_create_ns: u64,
    /// Bytes of physical memory created so far (sum of successful `cuMemCreate` sizes).
    pub created_bytes: u64,
    /// Measured wall time inside driver calls in nanoseconds (real backends;
    /// on the simulated one, the simulation's own host time when
    /// [`crate::sim::SimConfig::time_calls`] is set, else 0).
    pub measured_ns: u64,
    /// Bytes copied between host and device by successful
    /// [`CallKind::MemcpyDtoH`] and [`CallKind::MemcpyHtoD`] calls.
    pub copied_bytes: u64,
}

impl DriverStats {
    /// Calls of one kind.
    ///
    /// ```
    /// use quilt_vmm::{sim::SimVmm, CallKind, Vmm};
    ///
    /// let sim = SimVmm::with_capacity(1 << 30)?;
    /// let before = sim.driver_stats();
    /// let h = sim.create(sim.granularity())?;
    /// let since = sim.driver_stats().since(&before);
    /// assert_eq!(since.count(CallKind::Create), 1);
    /// assert_eq!(since.vmm_calls(), 1);
    /// # sim.release(h)?;
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn count(&self, kind: CallKind) -> u64 {
        self.calls[kind.index()]
    }

    /// All VMM calls (see [`CallKind::is_vmm`]) together.
    pub fn vmm_calls(&self) -> u64 {
        CallKind::ALL
            .iter()
            .filter(|k| k.is_vmm())
            .map(|k| self.count(*k))
            .sum()
    }

    /// The difference `self - earlier`, kind by kind (saturating).
    pub fn since(&self, earlier: &DriverStats) -> DriverStats {
        let mut out = DriverStats::default();
        for i in 0..self.calls.len() {
            out.calls[i] = self.calls[i].saturating_sub(earlier.calls[i]);
            out.failed[i] = self.failed[i].saturating_sub(earlier.failed[i]);
        }
        out.modelled_ns = self.modelled_ns.saturating_sub(earlier.modelled_ns);
        out.modelled_flat_create_ns = self
            .modelled_flat_create_ns
            .saturating_sub(earlier.modelled_flat_create_ns);
        out.created_bytes = self.created_bytes.saturating_sub(earlier.created_bytes);
        out.measured_ns = self.measured_ns.saturating_sub(earlier.measured_ns);
        out.copied_bytes = self.copied_bytes.saturating_sub(earlier.copied_bytes);
        out
    }
}
