//! The driver trait: the VMM calls every layer above talks to.

use crate::error::{Result, VmmError};
use crate::share::{CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, ShareableHandle};
use crate::types::{DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId};

/// CUDA's virtual memory management API for one device, as one trait.
///
/// Every backend enforces the driver's rules and reports breaches as typed
/// errors; no method panics on any input. Methods take `&self`: a backend is
/// shared by every thread and stream of its device.
///
/// Rules (as in the CUDA driver documentation):
/// - `reserve` sizes and alignments are multiples of [`Vmm::granularity`]
///   (alignment 0 means the granularity); `address_free` names a whole
///   reservation exactly and is rejected while it still holds mappings.
/// - `create` sizes are non-zero multiples of the granularity.
/// - `map(ptr, size, handle, offset)`: `ptr`, `size` and `offset` are multiples of
///   the granularity, `size > 0`, `offset + size` lies inside the handle, the range
///   lies inside one live reservation and overlaps no existing mapping. Under
///   the default [`MapRule::WholeHandle`] (CUDA's reference for `cuMemMap`: the
///   offset "currently must be zero") the mapping also covers its handle whole:
///   `offset == 0` and `size` equals the handle's size; a backend built with
///   [`MapRule::AnyOffset`] (an experiment) accepts any part. See [`Vmm::map_rule`].
/// - `unmap(ptr, size)` must cover whole mappings exactly (one or several
///   neighbouring ones); a hole in the range is an error.
/// - `release(handle)` may be called while the handle is still mapped: the
///   physical memory lives until its last mapping is unmapped.
/// - `set_access` makes a fully mapped range readable and writable by the device.
///
/// ```
/// use quilt_vmm::{sim::SimVmm, CallKind, Vmm};
///
/// let vmm = SimVmm::with_capacity(1 << 30)?;
/// let g = vmm.granularity();
/// let va = vmm.reserve(4 * g, 0)?;
/// let h = vmm.create(g)?;
/// vmm.map(va, g, h, 0)?; // one whole handle, at offset 0
/// vmm.set_access(va, g)?;
/// vmm.unmap(va, g)?;
/// vmm.release(h)?;
/// vmm.address_free(va, 4 * g)?;
/// assert_eq!(vmm.driver_stats().count(CallKind::Map), 1);
/// // A map at a non-zero offset breaks CUDA's documented rule.
/// let h2 = vmm.create(2 * g)?;
/// let va2 = vmm.reserve(2 * g, 0)?;
/// assert!(vmm.map(va2, g, h2, g).is_err());
/// # Ok::<(), quilt_vmm::VmmError>(())
/// ```
///
/// Streams and events:
///
/// ```
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm = SimVmm::with_capacity(1 << 30)?;
/// let e = vmm.event_record(StreamId(1))?;
/// vmm.stream_wait_event(StreamId(2), e)?; // stream 2 waits for stream 1's work so far
/// vmm.stream_synchronize(StreamId(1))?;   // the host waits for stream 1
/// assert!(vmm.event_query(e)?);
/// vmm.event_destroy(e)?;
/// # Ok::<(), quilt_vmm::VmmError>(())
/// ```
pub trait Vmm: Send + Sync + std::fmt::Debug {
    /// A short name of the backend ("cuda", "host", "simulated").
    fn backend_name(&self) -> &'static str;

    /// The allocation granularity in bytes (a power of two), fixed for the
    /// backend's lifetime (`cuMemGetAllocationGranularity`, minimum).
    fn granularity(&self) -> u64;

    /// `cuMemAddressReserve`: reserve `size` bytes of virtual address space aligned to `alignment`.
    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr>;

    /// `cuMemAddressFree`: free a whole reservation made by [`Vmm::reserve`].
    fn address_free(&self, ptr: DevicePtr, size: u64) -> Result<()>;

    /// `cuMemCreate`: create `size` bytes of physical memory on the device.
    fn create(&self, size: u64) -> Result<PhysHandle>;

    /// `cuMemRelease`: release a handle; its memory is freed at its last unmap.
    fn release(&self, handle: PhysHandle) -> Result<()>;

    /// `cuMemMap`: map `size` bytes of `handle` starting at `offset` at `ptr`
    /// (under [`MapRule::WholeHandle`]: the whole handle, `offset` 0).
    fn map(&self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()>;

    /// `cuMemUnmap`: unmap the mappings that exactly cover `ptr..ptr+size`.
    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()>;

    /// `cuMemSetAccess`: make `ptr..ptr+size` (all mapped) read-write for this device.
    fn set_access(&self, ptr: DevicePtr, size: u64) -> Result<()>;

    /// `cuMemGetInfo`: total and free device memory.
    fn mem_info(&self) -> Result<MemInfo>;

    /// Record an event on `stream` (`cuEventRecord`, on a driver event the
    /// backend creates with `cuEventCreate` or reuses from its pool).
    fn event_record(&self, stream: StreamId) -> Result<EventId>;

    /// `cuEventRecord` on a live event the caller owns: `event` now captures
    /// `stream`'s work up to now (its earlier capture is forgotten; queries
    /// report the new one, while a `cuStreamWaitEvent` already made keeps
    /// waiting for the capture it saw). Counted as
    /// [`crate::CallKind::EventRecord`]. An id that is not live gets the same
    /// `InvalidArgument` error as the other event calls, and changes nothing.
    /// Lets a caller reuse its completed events instead of destroying them
    /// and recording new ones.
    fn event_record_on(&self, event: EventId, stream: StreamId) -> Result<()>;

    /// `cuEventQuery`: true once the work before the event has completed.
    fn event_query(&self, event: EventId) -> Result<bool>;

    /// `cuEventDestroy`: the id is dead afterwards (the CUDA backend may keep
    /// the driver's event for a later record). An event whose destroy fails
    /// stays live.
    fn event_destroy(&self, event: EventId) -> Result<()>;

    /// `cuStreamWaitEvent`: later work on `stream` waits for `event`.
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()>;

    /// `cuStreamSynchronize`: wait for all work on `stream`.
    fn stream_synchronize(&self, stream: StreamId) -> Result<()>;

    /// `cuCtxSynchronize`: wait for all work on every stream of the device
    /// (what `cudaFree` does before it frees). Counted and costed as one
    /// [`crate::CallKind::StreamSynchronize`] (one drain of the device's
    /// queue). Illegal while a stream of the device is capturing (the
    /// simulated backend refuses it then, as CUDA may).
    ///
    /// By default the legacy default stream's synchronisation
    /// (`stream_synchronize(StreamId::DEFAULT)`), which on CUDA waits for
    /// every blocking stream but not for non-blocking ones; the CUDA,
    /// host and simulated backends override it with the device-wide one, so
    /// the default only serves wrappers that do not forward it.
    fn device_synchronize(&self) -> Result<()> {
        self.stream_synchronize(StreamId::DEFAULT)
    }

    /// `cuStreamIsCapturing`: true while `stream` is being captured into a
    /// CUDA graph (also once the capture was invalidated and not ended yet).
    /// Under capture an allocator may make only the calls legal under
    /// relaxed capture mode: no event recorded on the capturing stream for
    /// later queries, no query of an event recorded during the capture, no
    /// synchronisation of the capturing stream (nor of the device), no wait
    /// by the capturing stream on an event recorded outside the capture.
    /// Counted in [`Vmm::driver_stats`] as
    /// [`crate::CallKind::StreamIsCapturing`] where the backend calls the
    /// driver. By default `Ok(false)`, no call: a backend that cannot
    /// capture never captures; the simulated backend models capture
    /// ([`crate::sim::SimVmm::begin_capture`]).
    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }

    /// The caller is done with `stream` (its owner is about to destroy it, or
    /// did): the backend forgets it, and a later call naming it is refused
    /// ([`VmmError::InvalidArgument`]) unless it is adopted again (a new
    /// stream may get the same handle). No driver call: the caller first
    /// makes sure nothing it owns still needs the stream (its work known
    /// complete, its events destroyed). The default stream cannot be
    /// forgotten. By default `Ok(())`: a backend that accepts any stream id
    /// (the simulated and host ones) keeps nothing that could go stale; the
    /// CUDA backend drops the adopted handle.
    fn forget_stream(&self, stream: StreamId) -> Result<()> {
        if stream == StreamId::DEFAULT {
            return Err(VmmError::InvalidArgument {
                call: crate::CallKind::StreamSynchronize,
                argument: "stream",
                value: 0,
                rule: "the default stream cannot be forgotten",
            });
        }
        Ok(())
    }

    /// Calls made through this backend so far, by kind, and their time.
    fn driver_stats(&self) -> DriverStats;

    /// The map rule this backend enforces. The default, and always on CUDA, is
    /// [`MapRule::WholeHandle`]; a result obtained on a backend that answers
    /// [`MapRule::AnyOffset`] depends on a rule CUDA does not document, and a
    /// report should say so.
    fn map_rule(&self) -> MapRule {
        MapRule::WholeHandle
    }

    /// True when the backend's memory holds real bytes (CUDA, host), so that
    /// [`Vmm::copy_to_host`] fills its buffer and a caller offloading device
    /// memory must keep what it copied; false for the simulated device, whose
    /// copies move nothing (they are only checked, counted and costed).
    fn holds_bytes(&self) -> bool {
        true
    }

    // ---- sharing between devices and processes (see [`crate::share`]) ----

    /// What the device reports about sharing: its ordinal, the device count,
    /// the handle types and GPUDirect RDMA it supports, the minimum and
    /// recommended granularities. By default a lone device that shares nothing.
    fn caps(&self) -> DeviceCaps {
        DeviceCaps::single(self.granularity())
    }

    /// `cuMemCreate` with `props.handle_types` as `requestedHandleTypes` and
    /// `props.gpu_direct_rdma` as `allocFlags.gpuDirectRDMACapable`. A type or
    /// flag the device does not report ([`Vmm::caps`]) is refused with
    /// `InvalidArgument`. By default only the empty properties are accepted
    /// (a plain [`Vmm::create`]).
    fn create_with(&self, size: u64, props: CreateProps) -> Result<PhysHandle> {
        if props == CreateProps::default() {
            self.create(size)
        } else {
            Err(unsupported(
                self.backend_name(),
                crate::CallKind::Create,
                "no shareable handle types or RDMA flag",
            ))
        }
    }

    /// `cuMemExportToShareableHandle`: an OS handle of `kind` to the live
    /// `handle`, which must have been created requesting `kind`.
    fn export_handle(&self, handle: PhysHandle, kind: HandleKind) -> Result<ShareableHandle> {
        let _ = (handle, kind);
        Err(unsupported(
            self.backend_name(),
            crate::CallKind::ExportHandle,
            "no handle export",
        ))
    }

    /// `cuMemImportFromShareableHandle`: a new handle on this device to the
    /// `size` bytes of memory `shared` names (the size travels with the
    /// handle, as in PyTorch's and vLLM's IPC). The caller keeps `shared` and
    /// may drop it afterwards: the new handle holds its own reference.
    fn import_handle(&self, shared: &ShareableHandle, size: u64) -> Result<PhysHandle> {
        let _ = (shared, size);
        Err(unsupported(
            self.backend_name(),
            crate::CallKind::ImportHandle,
            "no handle import",
        ))
    }

    /// `cuMemcpyDtoH`: copy `dst.len()` bytes of device memory at `src` to
    /// the host, synchronously (when it returns the bytes are in `dst`). The
    /// whole range must be mapped (`NotMapped`) and access-set
    /// (`InvalidArgument`), and may span neighbouring mappings. The copy is
    /// not ordered after work queued on any stream: the caller makes that
    /// work complete first. Counted as one [`crate::CallKind::MemcpyDtoH`]
    /// of `dst.len()` bytes (in [`crate::DriverStats::copied_bytes`]). By
    /// default [`VmmError::Unsupported`]; the host backend copies real
    /// bytes, the simulated one checks, counts and costs the copy (no bytes).
    ///
    /// ```
    /// use quilt_vmm::{sim::SimVmm, CallKind, Vmm};
    ///
    /// let vmm = SimVmm::with_capacity(1 << 30)?;
    /// let g = vmm.granularity();
    /// let va = vmm.reserve(2 * g, 0)?;
    /// let h = vmm.create(g)?;
    /// vmm.map(va, g, h, 0)?;
    /// vmm.set_access(va, g)?;
    /// let mut host = vec![0u8; 4096];
    /// vmm.copy_to_host(va, &mut host)?;
    /// vmm.copy_from_host(va, &host)?;
    /// let stats = vmm.driver_stats();
    /// assert_eq!(stats.count(CallKind::MemcpyDtoH), 1);
    /// assert_eq!(stats.copied_bytes, 8192);
    /// assert!(vmm.copy_to_host(va + g, &mut host).is_err()); // not mapped
    /// # vmm.unmap(va, g)?;
    /// # vmm.release(h)?;
    /// # vmm.address_free(va, 2 * g)?;
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let _ = (src, dst);
        Err(unsupported(
            self.backend_name(),
            crate::CallKind::MemcpyDtoH,
            "no copy to the host",
        ))
    }

    /// `cuMemcpyHtoD`: copy `src` to device memory at `dst`, synchronously
    /// (the bytes have landed when it returns); same rules as
    /// [`Vmm::copy_to_host`], counted as one [`crate::CallKind::MemcpyHtoD`].
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let _ = (dst, src);
        Err(unsupported(
            self.backend_name(),
            crate::CallKind::MemcpyHtoD,
            "no copy from the host",
        ))
    }

    /// `cuMemSetAccess` with one `CUmemAccessDesc` per device of `devices`
    /// (read-write): one call makes the wholly mapped range reachable from
    /// each. `devices` is non-empty, without repeats, every ordinal below
    /// [`DeviceCaps::device_count`]. By default only this device alone is
    /// accepted (a plain [`Vmm::set_access`]).
    fn set_access_for(&self, ptr: DevicePtr, size: u64, devices: &[DeviceOrdinal]) -> Result<()> {
        if devices == [self.caps().ordinal] {
            self.set_access(ptr, size)
        } else {
            Err(unsupported(
                self.backend_name(),
                crate::CallKind::SetAccess,
                "no access for peer devices",
            ))
        }
    }
}

/// The [`VmmError::Unsupported`] error of the backend named `backend` for `call`.
fn unsupported(backend: &'static str, call: crate::CallKind, reason: &'static str) -> VmmError {
    VmmError::Unsupported {
        call,
        backend,
        reason,
    }
}
