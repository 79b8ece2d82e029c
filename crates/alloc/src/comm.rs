//! Communication buffers: memory handed to NCCL, to a NIC for RDMA, or to
//! another process, one physical handle per allocation.
//!
//! Quilt stitches an allocation from pages of several handles. That is what
//! makes it frugal, and what some consumers of device memory cannot take:
//! NCCL's user-buffer registration (`ncclCommRegister`) and NVLS in some
//! versions expect one handle behind a buffer, `ibv_reg_mr` (GPUDirect RDMA)
//! pins one allocation made with `gpuDirectRDMACapable`, and legacy CUDA IPC
//! (`cudaIpcGetMemHandle`) exports one allocation. Exporting a stitched range
//! costs one shareable handle (one file descriptor) per page, and its
//! importer one `cuMemImportFromShareableHandle` plus one `cuMemMap` per page.
//!
//! [`CommAllocator`] makes each allocation the way NCCL's `ncclMemAlloc`
//! does: one `cuMemCreate` of the size rounded up to the device's RECOMMENDED
//! granularity ([`quilt_vmm::DeviceCaps::recommended_granularity`]),
//! requesting the handle types and the GPUDirect RDMA flag the device
//! supports ([`CreateProps::preferred_for`], unless the configuration says
//! otherwise), one `cuMemAddressReserve` aligned to that granularity, one
//! `cuMemMap`, and one `cuMemSetAccess` naming this device and every peer of
//! [`CommConfig::peers`]. Use it for buffers that cross a device or process
//! boundary; use Quilt for everything else (activations, weights, caches).
//!
//! It caches: a freed buffer is kept, mapped, for the next request of the
//! same rounded size on the same stream (communication buffers are few,
//! large and reallocated every step at the same sizes, and each new one costs
//! a create, reserve, map and a set-access for every peer, about 250 us on
//! an A100; a cached buffer costs no driver call). Nothing inside a buffer is
//! wasted beyond the rounding; a whole cached buffer idles until reused or
//! [`DeviceAllocator::empty_cache`] gives it back. A request that runs out of
//! device memory frees the cache and tries once more.
//!
//! Streams: a buffer freed after [`DeviceAllocator::record_stream`] named other
//! streams waits, pending, on one event per such stream before it is reused
//! or given back (counted in the driver statistics).
//!
//! Export ([`CommAllocator::export`], see [`crate::ipc`]): while another
//! process holds an import, the buffer is pinned ([`ExportPins`]): freed here,
//! it stays pending, not reused, until [`CommAllocator::end_export`] (the
//! importer's release message) ends its last export.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use quilt_vmm::{
    CreateProps, DeviceOrdinal, DevicePtr, EventId, HandleKind, PhysHandle, StreamId, Vmm, VmmError,
};

use crate::api::{check_size, round_up, Allocation, DeviceAllocator};
use crate::error::AllocError;
#[cfg(feature = "invariants")]
use crate::error::InvariantViolation;
use crate::export_pins::{ExportPins, OnEnd};
use crate::ipc::{ExportedAllocation, SharedDescriptor, SharedPiece};
use crate::snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};
use crate::stats::AllocatorStats;

/// `CUDA_ERROR_NOT_PERMITTED` and `CUDA_ERROR_NOT_SUPPORTED`: what
/// `cuMemCreate` answers a FABRIC request without an IMEX channel.
const FABRIC_REFUSED: [u32; 2] = [800, 801];

/// Settings of a [`CommAllocator`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommConfig {
    /// What each `cuMemCreate` requests; `None` (the default): what the device
    /// supports ([`CreateProps::preferred_for`]: POSIX file descriptors, FABRIC
    /// where supported, GPUDirect RDMA where supported with VMM).
    pub props: Option<CreateProps>,
    /// Other devices that get access to every buffer (one `cuMemSetAccess`
    /// naming this device and all of them); empty by default.
    pub peers: Vec<DeviceOrdinal>,
}

/// One buffer: one handle, one reservation, one mapping.
#[derive(Clone, Debug)]
struct Buffer {
    ptr: DevicePtr,
    size: u64,
    requested: u64,
    handle: PhysHandle,
    stream: StreamId,
    /// Other streams that used it ([`DeviceAllocator::record_stream`]).
    uses: Vec<StreamId>,
}

/// A freed buffer not yet reusable: events of other streams, or importers.
#[derive(Debug)]
struct Pending {
    buffer: Buffer,
    events: Vec<EventId>,
}

#[derive(Debug, Default)]
struct State {
    live: BTreeMap<DevicePtr, Buffer>,
    pending: BTreeMap<DevicePtr, Pending>,
    /// Cached buffers by (stream, size).
    cached: BTreeMap<(StreamId, u64), Vec<Buffer>>,
    /// Exports other processes hold, by buffer address.
    exports: ExportPins,
    stats: AllocatorStats,
}

/// The communication-buffer allocator (see the module documentation).
pub struct CommAllocator {
    vmm: Arc<dyn Vmm>,
    props: CreateProps,
    access: Vec<DeviceOrdinal>,
    unit: u64,
    /// Set once a create requesting FABRIC was refused.
    fabric_refused: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
}

impl std::fmt::Debug for CommAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommAllocator")
            .field("props", &self.props)
            .field("access", &self.access)
            .field("unit", &self.unit)
            .finish_non_exhaustive()
    }
}

impl CommAllocator {
    /// A communication-buffer allocator on `vmm`.
    ///
    /// Errors: `InvalidConfig` when a peer is not a device of the process or
    /// repeats this device, or when the properties ask for what the device
    /// does not report.
    pub fn new(vmm: Arc<dyn Vmm>, config: CommConfig) -> Result<CommAllocator, AllocError> {
        let caps = vmm.caps();
        let props = config
            .props
            .unwrap_or_else(|| CreateProps::preferred_for(&caps));
        if !props.handle_types.is_subset_of(caps.handle_types)
            || (props.gpu_direct_rdma && !caps.gpu_direct_rdma_with_vmm)
        {
            return Err(AllocError::InvalidConfig {
                reason: format!(
                    "comm: handle types {} / RDMA {} requested, the device reports {} / {}",
                    props.handle_types,
                    props.gpu_direct_rdma,
                    caps.handle_types,
                    caps.gpu_direct_rdma_with_vmm
                ),
            });
        }
        let mut access = vec![caps.ordinal];
        for p in &config.peers {
            if *p >= caps.device_count || access.contains(p) {
                return Err(AllocError::InvalidConfig {
                    reason: format!(
                        "comm: peer {p} is this device, a repeat, or not one of the {} devices",
                        caps.device_count
                    ),
                });
            }
            access.push(*p);
        }
        Ok(CommAllocator {
            vmm,
            props,
            access,
            unit: caps.recommended_granularity.max(caps.granularity),
            fabric_refused: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(State::default()),
        })
    }

    /// The size unit and alignment of every buffer (the recommended granularity).
    pub fn unit(&self) -> u64 {
        self.unit
    }

    /// What every `cuMemCreate` requests (FABRIC dropped once the driver
    /// refused it).
    pub fn props(&self) -> CreateProps {
        let mut props = self.props;
        if self
            .fabric_refused
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            props.handle_types.fabric = false;
        }
        props
    }

    /// The devices every buffer is accessible from (this one first).
    pub fn access_devices(&self) -> &[DeviceOrdinal] {
        &self.access
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, AllocError> {
        self.state.lock().map_err(|_| AllocError::Poisoned)
    }

    /// Creates, reserves, maps and sets access for one buffer of `size`
    /// bytes (a multiple of the unit); undoes what it did on failure.
    fn make(&self, size: u64) -> Result<(DevicePtr, PhysHandle), VmmError> {
        let vmm = &self.vmm;
        let handle = match vmm.create_with(size, self.props()) {
            // FABRIC reported but refused (no IMEX channel): fall back to the
            // other types from now on, as NCCL does.
            Err(VmmError::Driver { code, .. })
                if self.props().handle_types.fabric && FABRIC_REFUSED.contains(&code) =>
            {
                self.fabric_refused
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                vmm.create_with(size, self.props())?
            }
            other => other?,
        };
        let ptr = match vmm.reserve(size, self.unit) {
            Ok(ptr) => ptr,
            Err(e) => {
                let _ = vmm.release(handle);
                return Err(e);
            }
        };
        let mapped = vmm.map(ptr, size, handle, 0).and_then(|()| {
            vmm.set_access_for(ptr, size, &self.access)
                .inspect_err(|_| {
                    let _ = vmm.unmap(ptr, size);
                })
        });
        if let Err(e) = mapped {
            let _ = vmm.release(handle);
            let _ = vmm.address_free(ptr, size);
            return Err(e);
        }
        Ok((ptr, handle))
    }

    /// Unmaps, releases and frees one buffer.
    fn destroy(&self, b: &Buffer) -> Result<(), VmmError> {
        self.vmm.unmap(b.ptr, b.size)?;
        self.vmm.release(b.handle)?;
        self.vmm.address_free(b.ptr, b.size)
    }

    /// Moves pending buffers whose events completed and whose exports ended
    /// into the cache. With `wait`, synchronises the streams they wait on first.
    fn settle(&self, st: &mut State, wait: bool) -> Result<(), AllocError> {
        let ready: Vec<DevicePtr> = st
            .pending
            .keys()
            .copied()
            .filter(|p| !st.exports.is_pinned(*p))
            .collect();
        for ptr in ready {
            let Some(p) = st.pending.get(&ptr) else {
                continue;
            };
            if wait {
                for s in &p.buffer.uses {
                    self.vmm.stream_synchronize(*s)?;
                }
            }
            let mut done = true;
            for e in &p.events {
                done &= self.vmm.event_query(*e)?;
            }
            if !done {
                continue;
            }
            if let Some(p) = st.pending.remove(&ptr) {
                for e in p.events {
                    self.vmm.event_destroy(e)?;
                }
                let mut b = p.buffer;
                b.uses.clear();
                b.requested = 0;
                st.cached.entry((b.stream, b.size)).or_default().push(b);
            }
        }
        Ok(())
    }

    /// Gives every cached buffer back to the driver.
    fn release_cached(&self, st: &mut State) -> Result<(), AllocError> {
        while let Some(mut entry) = st.cached.first_entry() {
            let Some(b) = entry.get_mut().pop() else {
                entry.remove();
                continue;
            };
            if let Err(e) = self.destroy(&b) {
                entry.get_mut().push(b);
                return Err(e.into());
            }
            if entry.get().is_empty() {
                entry.remove();
            }
            st.stats.reserved_bytes.decrease(b.size);
            st.stats.segment.decrease(1);
        }
        Ok(())
    }

    /// Exports the live buffer at `ptr` for another process: one shareable
    /// handle of `kind` and the descriptor that says where it goes. The buffer
    /// is held for the importer until [`CommAllocator::end_export`], even
    /// after a [`DeviceAllocator::free`] here. Several exports of one buffer
    /// each need their own `end_export`.
    pub fn export(
        &self,
        ptr: DevicePtr,
        kind: HandleKind,
    ) -> Result<ExportedAllocation, AllocError> {
        let mut st = self.lock()?;
        let b = st
            .live
            .get(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?
            .clone();
        let handle = self.vmm.export_handle(b.handle, kind)?;
        st.exports.pin(ptr);
        Ok(ExportedAllocation {
            descriptor: SharedDescriptor {
                id: ptr,
                size: b.size,
                pieces: vec![SharedPiece {
                    offset: 0,
                    size: b.size,
                }],
                start: 0,
                len: b.size,
            },
            handles: vec![handle],
        })
    }

    /// One importer of the buffer exported at `ptr` has released it. When
    /// none is left and the buffer was freed here, it becomes reusable.
    /// Errors: [`AllocError::Sharing`] when no export of `ptr` is outstanding.
    pub fn end_export(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        match st.exports.end(ptr)? {
            OnEnd::Pinned | OnEnd::Unpinned => Ok(()),
            // Freed here meanwhile: pending, reusable once unpinned.
            OnEnd::FreeNow => {
                st.exports.unpin_freed(ptr);
                self.settle(&mut st, false)
            }
        }
    }

    /// Exports outstanding (imports other processes still hold), in total.
    pub fn exports_outstanding(&self) -> u64 {
        self.lock().map(|st| st.exports.outstanding()).unwrap_or(0)
    }

    /// Freed buffers held back for importers or for other streams' events.
    pub fn pending_buffers(&self) -> usize {
        self.lock().map(|st| st.pending.len()).unwrap_or(0)
    }

    /// The physical handle behind the buffer at `ptr` (live only).
    pub fn handle_of(&self, ptr: DevicePtr) -> Option<PhysHandle> {
        self.lock().ok()?.live.get(&ptr).map(|b| b.handle)
    }
}

impl DeviceAllocator for CommAllocator {
    fn name(&self) -> &str {
        "comm"
    }

    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        check_size(size)?;
        let rounded = round_up(size, self.unit).ok_or(AllocError::InvalidSize {
            size,
            reason: "size overflows when rounded to the recommended granularity",
        })?;
        let mut st = self.lock()?;
        self.settle(&mut st, false)?;
        let reused = st.cached.get_mut(&(stream, rounded)).and_then(Vec::pop);
        if st.cached.get(&(stream, rounded)).is_some_and(Vec::is_empty) {
            st.cached.remove(&(stream, rounded));
        }
        let mut b = match reused {
            Some(b) => b,
            None => {
                let made = match self.make(rounded) {
                    Err(e) if e.is_out_of_memory() && !st.cached.is_empty() => {
                        st.stats.num_alloc_retries += 1;
                        self.release_cached(&mut st)?;
                        self.make(rounded)
                    }
                    other => other,
                };
                let (ptr, handle) = made.inspect_err(|e| {
                    if e.is_out_of_memory() {
                        st.stats.num_ooms += 1;
                    }
                })?;
                st.stats.reserved_bytes.increase(rounded);
                st.stats.segment.increase(1);
                Buffer {
                    ptr,
                    size: rounded,
                    requested: 0,
                    handle,
                    stream,
                    uses: Vec::new(),
                }
            }
        };
        b.requested = size;
        let out = Allocation {
            ptr: b.ptr,
            size: b.size,
        };
        st.stats.allocated_bytes.increase(b.size);
        st.stats.active_bytes.increase(b.size);
        st.stats.requested_bytes.increase(size);
        st.stats.allocation.increase(1);
        st.stats.active.increase(1);
        st.live.insert(b.ptr, b);
        Ok(out)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        let Some(b) = st.live.remove(&ptr) else {
            return Err(
                if st.pending.contains_key(&ptr)
                    || st.cached.values().flatten().any(|c| c.ptr == ptr)
                {
                    AllocError::DoubleFree { ptr }
                } else {
                    AllocError::UnknownPointer { ptr }
                },
            );
        };
        // A pinned buffer's free is deferred: it stays pending until the end
        // of its last export (`settle` skips it).
        if let Err(e) = st.exports.on_free(ptr) {
            st.live.insert(ptr, b);
            return Err(e);
        }
        st.stats.allocated_bytes.decrease(b.size);
        st.stats.active_bytes.decrease(b.size);
        st.stats.requested_bytes.decrease(b.requested);
        st.stats.allocation.decrease(1);
        st.stats.active.decrease(1);
        let mut events = Vec::with_capacity(b.uses.len());
        for s in &b.uses {
            match self.vmm.event_record(*s) {
                Ok(e) => events.push(e),
                Err(e) => {
                    // Keep it pending on the events made so far, and the sync
                    // at empty_cache covers the rest.
                    st.pending.insert(ptr, Pending { buffer: b, events });
                    return Err(e.into());
                }
            }
        }
        st.pending.insert(ptr, Pending { buffer: b, events });
        self.settle(&mut st, false)
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        let b = st
            .live
            .get_mut(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        if stream != b.stream && !b.uses.contains(&stream) {
            b.uses.push(stream);
        }
        Ok(())
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        let mut st = self.lock()?;
        self.settle(&mut st, true)?;
        self.release_cached(&mut st)
    }

    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.lock()?.stats.reset_peaks();
        Ok(())
    }

    fn stats(&self) -> AllocatorStats {
        let mut s = match self.state.lock() {
            Ok(st) => st.stats.clone(),
            Err(p) => p.into_inner().stats.clone(),
        };
        s.driver = self.vmm.driver_stats();
        s
    }

    fn snapshot(&self) -> MemorySnapshot {
        let st = match self.state.lock() {
            Ok(st) => st,
            Err(p) => p.into_inner(),
        };
        let seg = |b: &Buffer, state: BlockState| SegmentInfo {
            address: b.ptr,
            total_size: b.size,
            mapped_size: b.size,
            stream: b.stream,
            kind: "comm",
            blocks: vec![BlockInfo {
                address: b.ptr,
                size: b.size,
                requested: if state == BlockState::Active {
                    b.requested
                } else {
                    0
                },
                state,
            }],
        };
        let mut segments: Vec<SegmentInfo> = st
            .live
            .values()
            .map(|b| seg(b, BlockState::Active))
            .chain(
                st.pending
                    .values()
                    .map(|p| seg(&p.buffer, BlockState::PendingFree)),
            )
            .chain(
                st.cached
                    .values()
                    .flatten()
                    .map(|b| seg(b, BlockState::Inactive)),
            )
            .collect();
        segments.sort_by_key(|s| s.address);
        MemorySnapshot {
            allocator: "comm".to_owned(),
            segments,
        }
    }

    #[cfg(feature = "invariants")]
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let st = self
            .state
            .lock()
            .map_err(|_| InvariantViolation("comm: state poisoned".into()))?;
        let fail = |m: String| Err(InvariantViolation(format!("comm: {m}")));
        let mut reserved = 0u64;
        let mut count = 0u64;
        let mut seen = std::collections::BTreeSet::new();
        let all = st
            .live
            .values()
            .chain(st.pending.values().map(|p| &p.buffer))
            .chain(st.cached.values().flatten());
        for b in all {
            if b.size == 0 || b.size % self.unit != 0 || b.ptr % self.unit != 0 {
                return fail(format!(
                    "buffer {:#x}+{:#x} not a multiple of the unit",
                    b.ptr, b.size
                ));
            }
            if !seen.insert(b.ptr) {
                return fail(format!("buffer {:#x} held twice", b.ptr));
            }
            reserved += b.size;
            count += 1;
        }
        for ((stream, size), v) in &st.cached {
            if v.is_empty() || v.iter().any(|b| b.stream != *stream || b.size != *size) {
                return fail(format!(
                    "cache bucket ({stream:?}, {size}) is empty or holds a stranger"
                ));
            }
        }
        for (ptr, exports, freed) in st.exports.iter() {
            let held = if freed {
                st.pending.contains_key(&ptr)
            } else {
                st.live.contains_key(&ptr)
            };
            if exports == 0 || !held {
                return fail(format!(
                    "export of {ptr:#x} outstanding (freed: {freed}) but its buffer is not {}",
                    if freed { "pending" } else { "live" }
                ));
            }
        }
        let active: u64 = st.live.values().map(|b| b.size).sum();
        let stats = &st.stats;
        if stats.reserved_bytes.current != reserved
            || stats.segment.current != count
            || stats.active_bytes.current != active
            || stats.allocation.current != st.live.len() as u64
        {
            return fail(format!(
                "stats (reserved {}, segments {}, active {}, allocations {}) disagree with buffers ({reserved}, {count}, {active}, {})",
                stats.reserved_bytes.current,
                stats.segment.current,
                stats.active_bytes.current,
                stats.allocation.current,
                st.live.len()
            ));
        }
        Ok(())
    }

    fn vmm(&self) -> &Arc<dyn Vmm> {
        &self.vmm
    }
}

impl Drop for CommAllocator {
    fn drop(&mut self) {
        let mut st = match self.state.lock() {
            Ok(st) => st,
            Err(p) => p.into_inner(),
        };
        let st = &mut *st;
        let mut buffers: Vec<Buffer> = std::mem::take(&mut st.live).into_values().collect();
        for (_, p) in std::mem::take(&mut st.pending) {
            for s in &p.buffer.uses {
                let _ = self.vmm.stream_synchronize(*s);
            }
            for e in p.events {
                let _ = self.vmm.event_destroy(e);
            }
            buffers.push(p.buffer);
        }
        buffers.extend(std::mem::take(&mut st.cached).into_values().flatten());
        for b in &buffers {
            if let Err(e) = self.destroy(b) {
                tracing::warn!(ptr = b.ptr, %e, "comm: buffer not given back at drop");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_vmm::sim::{SimConfig, SimVmm};
    use quilt_vmm::CallKind;

    const MIB: u64 = 1 << 20;

    fn sim(capacity: u64, devices: u32) -> Arc<SimVmm> {
        Arc::new(
            SimVmm::new(SimConfig {
                capacity,
                recommended_granularity: 8 * MIB,
                device_count: devices,
                ..SimConfig::default()
            })
            .unwrap(),
        )
    }

    #[test]
    fn one_handle_per_buffer_at_the_recommended_granularity_and_cached() {
        let vmm = sim(1 << 30, 1);
        let comm = CommAllocator::new(vmm.clone(), CommConfig::default()).unwrap();
        assert_eq!(comm.unit(), 8 * MIB);
        assert!(comm.props().handle_types.posix_fd && comm.props().gpu_direct_rdma);
        let a = comm.allocate(9 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!((a.size, a.ptr % (8 * MIB)), (16 * MIB, 0));
        let d = vmm.driver_stats();
        for k in [
            CallKind::Create,
            CallKind::Reserve,
            CallKind::Map,
            CallKind::SetAccess,
        ] {
            assert_eq!(d.count(k), 1, "{k}");
        }
        let h = comm.handle_of(a.ptr).unwrap();
        assert!(
            vmm.export_handle(h, HandleKind::PosixFd).is_ok(),
            "POSIX requested"
        );
        comm.free(a.ptr).unwrap();
        assert!(matches!(
            comm.free(a.ptr),
            Err(AllocError::DoubleFree { .. })
        ));
        assert!(matches!(
            comm.free(1),
            Err(AllocError::UnknownPointer { .. })
        ));
        let before = vmm.driver_stats();
        let b = comm.allocate(16 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(b.ptr, a.ptr, "same size, same stream: the cached buffer");
        assert_eq!(vmm.driver_stats().since(&before).vmm_calls(), 0);
        // Another stream does not take it.
        comm.free(b.ptr).unwrap();
        let c = comm.allocate(16 * MIB, StreamId(7)).unwrap();
        assert_ne!(c.ptr, a.ptr);
        comm.free(c.ptr).unwrap();
        comm.check_invariants().unwrap();
        comm.empty_cache().unwrap();
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn peers_get_access_to_every_buffer_in_one_call() {
        let vmm = sim(1 << 30, 4);
        assert!(CommAllocator::new(
            vmm.clone(),
            CommConfig {
                peers: vec![4],
                ..CommConfig::default()
            }
        )
        .is_err());
        assert!(CommAllocator::new(
            vmm.clone(),
            CommConfig {
                peers: vec![0],
                ..CommConfig::default()
            }
        )
        .is_err());
        let comm = CommAllocator::new(
            vmm.clone(),
            CommConfig {
                peers: vec![3, 1],
                ..CommConfig::default()
            },
        )
        .unwrap();
        let before = vmm.driver_stats();
        let a = comm.allocate(MIB, StreamId::DEFAULT).unwrap();
        let d = vmm.driver_stats().since(&before);
        assert_eq!(d.count(CallKind::SetAccess), 1);
        assert_eq!(vmm.devices_with_access(a.ptr), Some(vec![0, 1, 3]));
        comm.free(a.ptr).unwrap();
    }

    #[test]
    fn a_buffer_used_on_another_stream_waits_for_it() {
        let vmm = sim(1 << 30, 1);
        let comm = CommAllocator::new(vmm.clone(), CommConfig::default()).unwrap();
        let a = comm.allocate(MIB, StreamId(1)).unwrap();
        comm.record_stream(a.ptr, StreamId(2)).unwrap();
        comm.free(a.ptr).unwrap();
        assert_eq!(comm.pending_buffers(), 1);
        let b = comm.allocate(MIB, StreamId(1)).unwrap();
        assert_ne!(b.ptr, a.ptr, "stream 2 may still use it");
        vmm.complete_stream(StreamId(2));
        comm.free(b.ptr).unwrap();
        assert_eq!(comm.pending_buffers(), 0);
        assert_eq!(vmm.driver_stats().count(CallKind::EventRecord), 1);
        comm.check_invariants().unwrap();
        comm.empty_cache().unwrap();
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn out_of_memory_frees_the_cache_once_and_retries() {
        let vmm = sim(32 * MIB, 1);
        let comm = CommAllocator::new(vmm.clone(), CommConfig::default()).unwrap();
        let a = comm.allocate(24 * MIB, StreamId::DEFAULT).unwrap();
        comm.free(a.ptr).unwrap();
        let b = comm.allocate(16 * MIB, StreamId::DEFAULT).unwrap();
        assert_eq!(comm.stats().num_alloc_retries, 1);
        let err = comm.allocate(24 * MIB, StreamId::DEFAULT).unwrap_err();
        assert!(
            matches!(&err, AllocError::Driver(e) if e.is_out_of_memory()),
            "{err}"
        );
        assert_eq!(comm.stats().num_ooms, 1);
        comm.check_invariants().unwrap();
        comm.free(b.ptr).unwrap();
        drop(comm);
        assert!(vmm.leak_report().is_empty());
    }
}
