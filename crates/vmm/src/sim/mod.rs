//! The simulated backend: the driver's bookkeeping without a device.
//!
//! [`SimVmm`] enforces every rule of the [`Vmm`] trait (alignment to the
//! granularity, mappings inside one reservation, no double mapping, offset plus
//! size inside the handle, a mapping covers its handle whole at offset 0 unless
//! [`SimConfig::map_rule`] relaxes it, whole-mapping unmaps, release while
//! mapped), with the same bookkeeping code as the CUDA and host backends, at any
//! capacity (a 200 GiB device costs nothing), counts every call by kind, models
//! the driver's time per call ([`CostModel`]), injects faults ([`Fault`]) and
//! reports what is still alive ([`LeakReport`]).
//!
//! It is fast: every call is a few `BTreeMap` look-ups under one mutex, O(log n)
//! (plus O(k log n) for an unmap or set-access covering k mappings).
//!
//! Addresses come from a bump pointer starting at `0x7f00_0000_0000` and are
//! never reused; a one-granule gap follows each reservation, so two reservations
//! are never adjacent. Handle ids count up from 1; event ids are never reused
//! (each names a slot and its generation, see the events module).
//!
//! Events: the device runs behind the host. The simulated device keeps an
//! operation clock, moved forward by whoever drives it ([`SimVmm::advance`]; the
//! replay harness moves it by one per allocator operation). An event recorded on
//! a stream at clock `t` completes once the clock reaches
//! `t + `[`SimConfig::gpu_lag_ops`] and every event the stream waited on
//! ([`Vmm::stream_wait_event`]) before it has completed, transitively. With a
//! lag of 0 an event completes as soon as it is recorded; with [`LAG_NEVER`]
//! (the default) only catch-ups complete work. A catch-up completes all of a
//! stream's work at once, and what its waits named, transitively:
//! [`Vmm::stream_synchronize`] (charged as a pipeline drain, see
//! [`CostModel::sync_ns`]), or the test's [`SimVmm::complete_stream`] and
//! [`SimVmm::complete_all`]. Queries are amortised O(1): a stream's events
//! complete in order, each leaves its queue once.

mod cost;
mod faults;
mod state;

use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

pub use crate::leak::LeakReport;
pub use cost::{
    CostModel, SimConfig, DEFAULT_CAPACITY, DEFAULT_GRANULARITY, DEFAULT_VA_LIMIT, LAG_NEVER,
};
pub use faults::{cuda_error_for, Fault, FaultTrigger};

use crate::driver::Vmm;
use crate::error::{Result, VmmError};
use crate::share::{CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, ShareableHandle};
use crate::types::{
    CallKind, DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId,
};
use faults::FaultSet;
use state::State;

/// Bytes of the simulated device's memory: `len` bytes from `offset` of
/// the memory `memory` (a handle's id, see [`SimVmm::memory_id`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPiece {
    /// The memory (shared by a handle and its imports).
    pub memory: u64,
    /// Where in it the piece starts.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// Target of the backend's tracing events.
const TARGET: &str = "quilt_vmm::sim";

/// Everything behind the lock.
#[derive(Debug)]
struct Inner {
    state: State,
    stats: DriverStats,
    faults: FaultSet,
}

/// A simulated device (see the module documentation).
///
/// `Send + Sync`; all methods take `&self` (one mutex inside). No method panics.
pub struct SimVmm {
    config: SimConfig,
    inner: Mutex<Inner>,
}

impl SimVmm {
    /// A simulated device with `config`.
    ///
    /// Fails with [`VmmError::InvalidArgument`] when the granularity is not a
    /// non-zero power of two.
    pub fn new(config: SimConfig) -> Result<SimVmm> {
        if !config.granularity.is_power_of_two() {
            return Err(VmmError::InvalidArgument {
                call: CallKind::MemInfo,
                argument: "granularity",
                value: config.granularity,
                rule: "the simulated device's granularity must be a non-zero power of two",
            });
        }
        let recommended = match config.recommended_granularity {
            0 => config.granularity,
            r => r,
        };
        if !recommended.is_power_of_two() || recommended < config.granularity {
            return Err(VmmError::InvalidArgument {
                call: CallKind::MemInfo,
                argument: "recommended_granularity",
                value: recommended,
                rule: "must be 0 or a power of two at least the granularity",
            });
        }
        if config.ordinal >= config.device_count {
            return Err(VmmError::InvalidArgument {
                call: CallKind::MemInfo,
                argument: "ordinal",
                value: u64::from(config.ordinal),
                rule: "must be below the simulated device count",
            });
        }
        let mut state = State::new(
            config.granularity,
            config.capacity,
            config.va_limit,
            config.gpu_lag_ops,
        );
        state.set_map_rule(config.map_rule);
        state.set_caps(DeviceCaps {
            ordinal: config.ordinal,
            device_count: config.device_count,
            vmm: true,
            handle_types: config.handle_types,
            gpu_direct_rdma_with_vmm: config.gpu_direct_rdma,
            granularity: config.granularity,
            recommended_granularity: recommended,
        });
        Ok(SimVmm {
            config,
            inner: Mutex::new(Inner {
                state,
                stats: DriverStats::default(),
                faults: FaultSet::default(),
            }),
        })
    }

    /// A simulated device of `capacity` bytes with the default granularity (2 MiB),
    /// costs and address-space limit.
    ///
    /// ```
    /// use quilt_vmm::{sim::SimVmm, Vmm};
    ///
    /// let sim = SimVmm::with_capacity(80 << 30)?;
    /// assert_eq!(sim.mem_info()?.total, 80 << 30);
    /// let h = sim.create(sim.granularity())?;
    /// assert!(!sim.leak_report().is_empty(), "a live handle is reported");
    /// sim.release(h)?;
    /// assert!(sim.leak_report().is_empty());
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn with_capacity(capacity: u64) -> Result<SimVmm> {
        SimVmm::new(SimConfig {
            capacity,
            ..SimConfig::default()
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No code under this lock panics; should it ever be poisoned, the state is
        // still consistent (every operation validates before it mutates).
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Arm a fault (see [`Fault`]); several may be armed at once.
    ///
    /// ```
    /// use quilt_vmm::sim::{Fault, SimVmm};
    /// use quilt_vmm::{CallKind, Vmm};
    ///
    /// let sim = SimVmm::with_capacity(1 << 30)?;
    /// sim.inject(Fault::nth(CallKind::Create, 1)); // the next create fails
    /// assert!(sim.create(sim.granularity()).is_err());
    /// let h = sim.create(sim.granularity())?; // then creates work again
    /// sim.release(h)?;
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn inject(&self, fault: Fault) {
        tracing::debug!(target: TARGET, ?fault, "fault armed");
        self.lock().faults.arm(fault);
    }

    /// Disarm every fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Faults still armed (an `Nth` fault disarms when it fires).
    pub fn armed_faults(&self) -> usize {
        self.lock().faults.len()
    }

    /// What is alive now: handles, reservations, mappings, events.
    pub fn leak_report(&self) -> LeakReport {
        self.lock().state.leak_report()
    }

    /// Move the operation clock `ops` forward (saturating): work queued
    /// [`SimConfig::gpu_lag_ops`] operations ago or earlier completes, once what
    /// it waited on has. Not a driver call: not counted, costs nothing.
    pub fn advance(&self, ops: u64) {
        self.lock().state.advance(ops);
    }

    /// Declare work queued on `stream` now (the kernels a program launches
    /// there): it completes [`SimConfig::gpu_lag_ops`] operations from now,
    /// once what the stream waited on has. A stream whose work is declared
    /// completes an event as soon as the work before it has, at once when
    /// the stream is idle, as a GPU does; on a stream never declared, every
    /// event counts as work due a lag after its record (a stream always
    /// busy). Not a driver call: not counted, costs nothing. Ignored on a
    /// capturing stream.
    pub fn queue_work(&self, stream: StreamId) {
        self.lock().state.queue_work(stream);
    }

    /// Set how far the device runs behind for work queued from now on (work
    /// already queued keeps its completion time): for experiments, and for
    /// tests of a stream held back by a long kernel. [`SimVmm::config`] keeps
    /// the value the device started with.
    pub fn set_gpu_lag_ops(&self, ops: u64) {
        self.lock().state.set_gpu_lag_ops(ops);
    }

    /// The operation clock: the sum of every [`SimVmm::advance`] so far.
    pub fn clock(&self) -> u64 {
        self.lock().state.clock()
    }

    /// Complete every event recorded so far on `stream` (as if the device caught up).
    pub fn complete_stream(&self, stream: StreamId) {
        self.lock().state.complete_stream(stream);
    }

    /// Start capturing `stream` into a graph (as `cuStreamBeginCapture`
    /// would, in any mode): from now until [`SimVmm::end_capture`],
    /// [`Vmm::stream_is_capturing`] says so, and the device refuses what
    /// CUDA forbids under relaxed capture, invalidating the capture: a
    /// synchronisation of the stream or of the device
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), a query of an event last
    /// recorded in the capture (`CUDA_ERROR_CAPTURED_EVENT`), and a wait
    /// that crosses the capture's edge (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`:
    /// the capturing stream waiting for an event recorded outside, or a
    /// stream outside waiting for an event recorded inside). A record on the
    /// capturing stream is legal: a graph node, not work of the stream, so
    /// its event never completes by the stream's progress. Not a driver
    /// call: not counted, costs nothing. An error if the stream is
    /// capturing already.
    ///
    /// ```
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let sim = SimVmm::with_capacity(1 << 30)?;
    /// let s = StreamId(5);
    /// sim.begin_capture(s)?;
    /// assert!(sim.stream_is_capturing(s)?);
    /// let e = sim.event_record(s)?; // legal: a node of the graph
    /// assert!(sim.event_query(e).is_err()); // illegal even in relaxed mode
    /// assert!(sim.end_capture(s).is_err(), "the query invalidated the capture");
    /// assert!(!sim.stream_is_capturing(s)?);
    /// assert_eq!(sim.capture_violations(), 1);
    /// # sim.event_destroy(e)?;
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn begin_capture(&self, stream: StreamId) -> Result<()> {
        self.lock().state.begin_capture(stream)
    }

    /// End the capture of `stream` (as `cuStreamEndCapture`): an error if
    /// it was not capturing, or `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` when
    /// a refused call invalidated it; the capture is over either way.
    pub fn end_capture(&self, stream: StreamId) -> Result<()> {
        self.lock().state.end_capture(stream)
    }

    /// Calls the device refused because of a capture, over its life (each
    /// also invalidated the capture it broke).
    pub fn capture_violations(&self) -> u64 {
        self.lock().state.capture_violations()
    }

    /// Complete every event recorded so far on every stream.
    ///
    /// ```
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let sim = SimVmm::with_capacity(1 << 30)?; // the GPU never catches up by itself
    /// let e = sim.event_record(StreamId(3))?;
    /// assert!(!sim.event_query(e)?);
    /// sim.complete_all();
    /// assert!(sim.event_query(e)?);
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn complete_all(&self) {
        self.lock().state.complete_all();
    }

    /// Bytes of physical memory held by live handles (not released, or released
    /// but still mapped).
    pub fn physical_in_use(&self) -> u64 {
        self.lock().state.physical_in_use()
    }

    /// Bytes currently mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.lock().state.mapped_bytes()
    }

    /// Bytes of virtual address space currently reserved.
    pub fn reserved_bytes(&self) -> u64 {
        self.lock().state.reserved_bytes()
    }

    /// Live handles, reservations and mappings, in that order.
    pub fn live_counts(&self) -> (usize, usize, usize) {
        self.lock().state.counts()
    }

    /// Whether the mapping containing `addr` has had [`Vmm::set_access`] called on
    /// it (any part of it) since it was mapped; `None` when `addr` is not mapped.
    pub fn access_set(&self, addr: DevicePtr) -> Option<bool> {
        self.lock().state.access_set(addr)
    }

    /// The physical handle and the offset inside it that back `addr`, or `None`
    /// when `addr` is not mapped.
    pub fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        self.lock().state.translate(addr)
    }

    /// The simulated memory behind `addr .. addr + len` (whatever handles
    /// and mappings make it up), as pieces in address order; unmapped parts
    /// are left out. Two pieces name the same memory only where the same
    /// bytes of the device lie behind them, whatever their addresses.
    pub fn memory_pieces(&self, addr: DevicePtr, len: u64) -> Vec<MemoryPiece> {
        self.lock()
            .state
            .memory_pieces(addr, len)
            .into_iter()
            .map(|(memory, offset, len)| MemoryPiece {
                memory,
                offset,
                len,
            })
            .collect()
    }

    /// How far the host has queued `stream`'s work: a position that
    /// [`SimVmm::work_complete`] and [`SimVmm::ordered_after`] take (every
    /// [`SimVmm::queue_work`] and event record moves it by one).
    pub fn stream_position(&self, stream: StreamId) -> u64 {
        self.lock().state.stream_position(stream)
    }

    /// Whether `stream`'s work up to `position` has completed on the device.
    pub fn work_complete(&self, stream: StreamId, position: u64) -> bool {
        self.lock().state.work_complete(stream, position)
    }

    /// Whether work queued on `waiter` from now on is ordered after
    /// `stream`'s work up to `position` (see [`SimVmm::stream_position`]):
    /// the same stream (stream order), that work completed, or a chain of
    /// [`Vmm::stream_wait_event`] calls from `waiter` to an event of
    /// `stream` recorded at or past `position`. Not a driver call.
    pub fn ordered_after(&self, waiter: StreamId, stream: StreamId, position: u64) -> bool {
        self.lock().state.ordered_after(waiter, stream, position)
    }

    /// Checks every invariant of the simulated device's bookkeeping and says which
    /// one broke (O(n) in what is alive: meant for tests, after every operation).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().state.check_invariants()
    }

    /// Reset the call counters and modelled time to zero (state is kept).
    pub fn reset_stats(&self) {
        self.lock().stats = DriverStats::default();
    }

    /// The devices from which the whole mapping containing `addr` is
    /// accessible (this device first when it is one), as every
    /// [`Vmm::set_access`] and [`Vmm::set_access_for`] since the mapping was
    /// made left it; `None` when `addr` is not mapped.
    pub fn devices_with_access(&self, addr: DevicePtr) -> Option<Vec<DeviceOrdinal>> {
        self.lock().state.devices_with_access(addr)
    }

    /// The id of the simulated memory behind a live handle: an imported
    /// handle has its exporter's (they name the same memory). `None` for a
    /// handle that is not live.
    pub fn memory_id(&self, handle: PhysHandle) -> Option<u64> {
        self.lock().state.memory_id(handle)
    }

    /// Run one driver call: count it, fire a fault or run `op`, cost it, trace it.
    fn call<T>(
        &self,
        kind: CallKind,
        size: u64,
        op: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        self.call_costing(kind, size, 0, op)
    }

    /// [`SimVmm::call`], charging `extra_ns` on top of the call's figure.
    fn call_costing<T>(
        &self,
        kind: CallKind,
        size: u64,
        extra_ns: u64,
        op: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        let started = self.config.time_calls.then(Instant::now);
        let mut guard = self.lock();
        let inner = &mut *guard;
        let result = match inner.faults.check(kind) {
            Some(error) => Err(error),
            None => op(&mut inner.state),
        };
        account(
            &self.config.cost,
            self.config.granularity,
            &mut inner.stats,
            kind,
            size,
            extra_ns,
            result.as_ref().err(),
        );
        if let Some(started) = started {
            let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            inner.stats.measured_ns = inner.stats.measured_ns.saturating_add(ns);
        }
        result
    }
}

/// Count, cost and trace one driver call of `kind` (`error`: how it failed).
/// Not generic and not inlined: every call shares this code, so that the
/// code a run of driver calls passes through stays small.
#[inline(never)]
fn account(
    cost: &CostModel,
    granularity: u64,
    stats: &mut DriverStats,
    kind: CallKind,
    size: u64,
    extra_ns: u64,
    error: Option<&VmmError>,
) {
    let i = kind.index();
    stats.calls[i] += 1;
    let (modelled, flat) = match (kind, error) {
        (kind, None) if kind.is_copy() => {
            stats.copied_bytes = stats.copied_bytes.saturating_add(size);
            let ns = cost
                .per_call_ns(kind)
                .saturating_add(cost.copy_bytes_ns(size));
            (ns, ns)
        }
        (CallKind::Create, None) => {
            stats.created_bytes = stats.created_bytes.saturating_add(size);
            (
                cost.create_proportional_ns(size, granularity),
                cost.create_flat_ns,
            )
        }
        _ => {
            let ns = cost.per_call_ns(kind);
            (ns, ns)
        }
    };
    stats.modelled_ns = stats.modelled_ns.saturating_add(modelled + extra_ns);
    stats.modelled_flat_create_ns = stats
        .modelled_flat_create_ns
        .saturating_add(flat + extra_ns);
    match error {
        None => tracing::trace!(target: TARGET, call = %kind, size, ok = true),
        Some(error) => {
            stats.failed[i] += 1;
            tracing::trace!(target: TARGET, call = %kind, size, ok = false, %error);
        }
    }
}

/// The simulated device's system call: none (the ledger's check and
/// commit are the whole call).
fn nothing() -> Result<()> {
    Ok(())
}

impl fmt::Debug for SimVmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        let (handles, reservations, mappings) = inner.state.counts();
        f.debug_struct("SimVmm")
            .field("capacity", &self.config.capacity)
            .field("granularity", &self.config.granularity)
            .field("map_rule", &self.config.map_rule)
            .field("physical_in_use", &inner.state.physical_in_use())
            .field("mapped_bytes", &inner.state.mapped_bytes())
            .field("handles", &handles)
            .field("reservations", &reservations)
            .field("mappings", &mappings)
            .field("armed_faults", &inner.faults.len())
            .finish()
    }
}

impl Drop for SimVmm {
    fn drop(&mut self) {
        let report = self.leak_report();
        if !report.is_empty() {
            tracing::warn!(target: TARGET, "simulated device dropped with {report}");
        }
    }
}

impl Vmm for SimVmm {
    fn backend_name(&self) -> &'static str {
        "simulated"
    }

    fn granularity(&self) -> u64 {
        self.config.granularity
    }

    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.call(CallKind::Reserve, size, |s| s.reserve(size, alignment))
    }

    fn address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.call(CallKind::AddressFree, size, |s| {
            s.ledger.address_free(ptr, size, nothing)
        })
    }

    fn create(&self, size: u64) -> Result<PhysHandle> {
        self.create_with(size, CreateProps::default())
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.call(CallKind::Release, 0, |s| {
            s.ledger.release_with(handle, |_| Ok(())).map(drop)
        })
    }

    fn map(&self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        self.call(CallKind::Map, size, |s| {
            s.ledger.map(ptr, size, handle, offset, |_| Ok(()))
        })
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.call(CallKind::Unmap, size, |s| {
            s.ledger
                .unmap(ptr, size, |mappings| (mappings.len(), Ok(())))
        })
    }

    fn set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.set_access_for(ptr, size, &[self.config.ordinal])
    }

    /// The simulated device holds no bytes: the range is checked (mapped,
    /// access set), `dst` is left as it is, and the copy is counted and
    /// costed (per call plus bytes over the copy bandwidth).
    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let len = dst.len() as u64;
        self.call(CallKind::MemcpyDtoH, len, |s| s.check_copy(src, len))
    }

    /// No bytes: a copy moves nothing.
    fn holds_bytes(&self) -> bool {
        false
    }

    /// As [`SimVmm::copy_to_host`]: checked, counted and costed, no bytes moved.
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let len = src.len() as u64;
        self.call(CallKind::MemcpyHtoD, len, |s| s.check_copy(dst, len))
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.call(CallKind::MemInfo, 0, |s| Ok(s.mem_info()))
    }

    fn event_record(&self, stream: StreamId) -> Result<EventId> {
        self.call(CallKind::EventRecord, 0, |s| Ok(s.event_record(stream)))
    }

    fn event_record_on(&self, event: EventId, stream: StreamId) -> Result<()> {
        self.call(CallKind::EventRecord, 0, |s| {
            s.event_record_on(event, stream)
        })
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        self.call(CallKind::EventQuery, 0, |s| s.event_query(event))
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        self.call(CallKind::EventDestroy, 0, |s| s.event_destroy(event))
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        self.call(CallKind::StreamWaitEvent, 0, |s| {
            s.stream_wait_event(stream, event)
        })
    }

    /// Refused on a capturing stream (see [`SimVmm::begin_capture`]).
    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        self.call(CallKind::StreamSynchronize, 0, |s| {
            s.stream_synchronize(stream)
        })
    }

    /// Every stream's work completes at once; counted and charged as one
    /// `cuStreamSynchronize` (one drain). Refused while a stream captures.
    fn device_synchronize(&self) -> Result<()> {
        self.call(CallKind::StreamSynchronize, 0, |s| s.device_synchronize())
    }

    /// As [`SimVmm::begin_capture`] and [`SimVmm::end_capture`] left it;
    /// counted and charged as a driver call (what a GPU pays for it).
    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        self.call(CallKind::StreamIsCapturing, 0, |s| {
            Ok(s.is_capturing(stream))
        })
    }

    fn driver_stats(&self) -> DriverStats {
        self.lock().stats
    }

    fn map_rule(&self) -> MapRule {
        self.config.map_rule
    }

    fn caps(&self) -> DeviceCaps {
        self.lock().state.caps()
    }

    fn create_with(&self, size: u64, props: CreateProps) -> Result<PhysHandle> {
        self.call(CallKind::Create, size, |s| s.create_with(size, props))
    }

    fn export_handle(&self, handle: PhysHandle, kind: HandleKind) -> Result<ShareableHandle> {
        self.call(CallKind::ExportHandle, 0, |s| s.export_handle(handle, kind))
    }

    fn import_handle(&self, shared: &ShareableHandle, size: u64) -> Result<PhysHandle> {
        self.call(CallKind::ImportHandle, size, |s| {
            s.import_handle(shared, size)
        })
    }

    /// Charged [`CostModel::set_access_ns_for`] the number of devices named.
    fn set_access_for(&self, ptr: DevicePtr, size: u64, devices: &[DeviceOrdinal]) -> Result<()> {
        let n = devices.len() as u64;
        let extra = self
            .config
            .cost
            .set_access_ns_for(n)
            .saturating_sub(self.config.cost.set_access_ns);
        self.call_costing(CallKind::SetAccess, size, extra, |s| {
            s.ledger.set_access(ptr, size, devices, nothing)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_completes_work_and_a_sync_is_charged_as_a_drain() {
        let sim = SimVmm::new(SimConfig {
            gpu_lag_ops: 2,
            ..SimConfig::default()
        })
        .unwrap();
        assert_eq!(sim.config().cost.sync_ns, 100_000);
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = sim.event_record(s1).unwrap();
        sim.advance(1);
        assert!(!sim.event_query(a).unwrap());
        sim.advance(1);
        assert_eq!(sim.clock(), 2);
        assert!(sim.event_query(a).unwrap());
        let b = sim.event_record(s2).unwrap();
        let before = sim.driver_stats();
        sim.stream_synchronize(s2).unwrap();
        assert!(sim.event_query(b).unwrap(), "synchronised at once");
        let d = sim.driver_stats().since(&before);
        assert_eq!(d.count(CallKind::StreamSynchronize), 1);
        assert_eq!(
            d.modelled_ns,
            100_000 + sim.config().cost.event_ns,
            "the sync and one query"
        );
        for e in [a, b] {
            sim.event_destroy(e).unwrap();
        }
        sim.check_invariants().unwrap();
        assert!(sim.leak_report().is_empty());
    }

    #[test]
    fn ordering_follows_completion_stream_order_and_chains_of_waits() {
        let sim = SimVmm::new(SimConfig {
            gpu_lag_ops: 4,
            ..SimConfig::default()
        })
        .unwrap();
        let (a, b, c) = (StreamId(1), StreamId(2), StreamId(3));
        sim.queue_work(a);
        let pos = sim.stream_position(a);
        assert_eq!(pos, 1);
        assert!(!sim.work_complete(a, pos));
        assert!(sim.ordered_after(a, a, pos), "stream order");
        assert!(!sim.ordered_after(b, a, pos), "nothing orders b after a");
        // c waits for a's event; b waits for one of c's recorded after that:
        // b is ordered after a's work through c.
        let ea = sim.event_record(a).unwrap();
        sim.stream_wait_event(c, ea).unwrap();
        assert!(sim.ordered_after(c, a, pos));
        assert!(!sim.ordered_after(b, a, pos));
        let ec = sim.event_record(c).unwrap();
        sim.stream_wait_event(b, ec).unwrap();
        assert!(sim.ordered_after(b, a, pos), "through c's wait");
        // Work a queues later is not covered by those waits.
        sim.queue_work(a);
        let later = sim.stream_position(a);
        assert!(!sim.ordered_after(b, a, later));
        // A wait for a stream that never waited for a orders nothing after a.
        let (d, early) = (StreamId(4), StreamId(5));
        let ec_early = sim.event_record(early).unwrap();
        sim.stream_wait_event(d, ec_early).unwrap();
        assert!(!sim.ordered_after(d, a, pos));
        // The device catches up: everything is complete, hence ordered.
        sim.advance(10);
        assert!(sim.work_complete(a, later));
        assert!(sim.ordered_after(d, a, later));
        for e in [ea, ec, ec_early] {
            sim.event_destroy(e).unwrap();
        }
    }

    #[test]
    fn memory_pieces_name_the_bytes_behind_addresses() {
        let sim = SimVmm::with_capacity(1 << 30).unwrap();
        let g = sim.config().granularity;
        let va = sim.reserve(5 * g, 0).unwrap();
        let (big, one, other) = (
            sim.create(2 * g).unwrap(),
            sim.create(g).unwrap(),
            sim.create(g).unwrap(),
        );
        // `one`, then `big` whole, then nothing, then `other`.
        sim.map(va, g, one, 0).unwrap();
        sim.map(va + g, 2 * g, big, 0).unwrap();
        sim.map(va + 4 * g, g, other, 0).unwrap();
        let m = |h| sim.memory_id(h).unwrap();
        let piece = |memory, offset, len| MemoryPiece {
            memory,
            offset,
            len,
        };
        assert_eq!(
            sim.memory_pieces(va + 10, 5 * g - 20),
            [
                piece(m(one), 10, g - 10),
                piece(m(big), 0, 2 * g),
                piece(m(other), 0, g - 10),
            ]
        );
        assert_eq!(sim.memory_pieces(va + g + 7, g), [piece(m(big), 7, g)]);
        assert!(sim.memory_pieces(va + 3 * g, g).is_empty());
        // The same memory mapped elsewhere is the same piece.
        sim.unmap(va, g).unwrap();
        sim.map(va + 3 * g, g, one, 0).unwrap();
        assert_eq!(sim.memory_pieces(va + 3 * g, 16), [piece(m(one), 0, 16)]);
        for (addr, len) in [(va + g, 2 * g), (va + 3 * g, g), (va + 4 * g, g)] {
            sim.unmap(addr, len).unwrap();
        }
        for h in [big, one, other] {
            sim.release(h).unwrap();
        }
        sim.address_free(va, 5 * g).unwrap();
        assert!(sim.leak_report().is_empty());
    }

    #[test]
    fn the_simulation_times_its_own_calls_only_when_asked() {
        for time_calls in [false, true] {
            let sim = SimVmm::new(SimConfig {
                time_calls,
                ..SimConfig::default()
            })
            .unwrap();
            let e = sim.event_record(StreamId(1)).unwrap();
            let before = sim.driver_stats();
            for _ in 0..1000 {
                sim.event_query(e).unwrap();
            }
            let d = sim.driver_stats().since(&before);
            assert_eq!(d.count(CallKind::EventQuery), 1000);
            // The modelled time never depends on it.
            assert_eq!(d.modelled_ns, 1000 * sim.config().cost.event_ns);
            assert_eq!(d.measured_ns > 0, time_calls, "{d:?}");
            sim.event_destroy(e).unwrap();
            assert!(sim.leak_report().is_empty());
        }
    }

    #[test]
    fn under_capture_the_device_refuses_what_relaxed_mode_forbids() {
        let sim = SimVmm::with_capacity(1 << 30).unwrap();
        let (s, other) = (StreamId(1), StreamId(2));
        let before_capture = sim.event_record(s).unwrap();
        let outside = sim.event_record(other).unwrap();
        assert!(!sim.stream_is_capturing(s).unwrap());
        sim.begin_capture(s).unwrap();
        assert!(sim.begin_capture(s).is_err(), "capturing already");
        assert!(sim.stream_is_capturing(s).unwrap());
        assert!(!sim.stream_is_capturing(other).unwrap());
        // Legal under relaxed capture: a record (a graph node), a query of an
        // event recorded before the capture, work on other streams.
        let inside = sim.event_record(s).unwrap();
        assert!(!sim.event_query(before_capture).unwrap());
        sim.stream_synchronize(other).unwrap();
        assert!(sim.event_query(outside).unwrap());
        assert_eq!(sim.capture_violations(), 0);
        sim.end_capture(s).unwrap();

        // Each forbidden call is refused with its code and invalidates the capture.
        type Forbidden<'a> = Box<dyn Fn(&SimVmm) -> Result<()> + 'a>;
        let cases: Vec<(Forbidden, u32)> = vec![
            (Box::new(|v: &SimVmm| v.stream_synchronize(s)), 900),
            (Box::new(|v: &SimVmm| v.device_synchronize()), 900),
            (
                Box::new(|v: &SimVmm| {
                    let e = v.event_record(s)?;
                    let r = v.event_query(e).map(drop);
                    v.event_destroy(e)?;
                    r
                }),
                907,
            ),
            (Box::new(|v: &SimVmm| v.stream_wait_event(s, outside)), 905),
            (
                Box::new(|v: &SimVmm| {
                    let e = v.event_record(s)?;
                    let r = v.stream_wait_event(other, e);
                    v.event_destroy(e)?;
                    r
                }),
                905,
            ),
        ];
        for (n, (call, code)) in cases.iter().enumerate() {
            sim.begin_capture(s).unwrap();
            match call(&sim) {
                Err(VmmError::Driver { code: got, .. }) => assert_eq!(got, *code, "case {n}"),
                other => panic!("case {n}: expected a capture error, got {other:?}"),
            }
            assert!(
                matches!(sim.end_capture(s), Err(VmmError::Driver { code: 901, .. })),
                "case {n}: the capture is invalidated"
            );
        }
        assert_eq!(sim.capture_violations(), cases.len() as u64);
        // After the capture: an event recorded inside it stays refused until
        // recorded again outside; synchronisation works again.
        assert!(sim.event_query(inside).is_err());
        sim.event_record_on(inside, s).unwrap();
        sim.stream_synchronize(s).unwrap();
        assert!(sim.event_query(inside).unwrap());
        assert!(sim.end_capture(s).is_err(), "not capturing");
        for e in [before_capture, outside, inside] {
            sim.event_destroy(e).unwrap();
        }
        sim.check_invariants().unwrap();
        assert!(sim.leak_report().is_empty());
    }

    #[test]
    fn a_device_synchronisation_completes_every_stream_and_costs_one_drain() {
        let sim = SimVmm::with_capacity(1 << 30).unwrap();
        let events: Vec<EventId> = (1..=3)
            .map(|s| sim.event_record(StreamId(s)).unwrap())
            .collect();
        let before = sim.driver_stats();
        sim.device_synchronize().unwrap();
        let d = sim.driver_stats().since(&before);
        assert_eq!(d.count(CallKind::StreamSynchronize), 1);
        assert_eq!(d.modelled_ns, sim.config().cost.sync_ns);
        for e in events {
            assert!(sim.event_query(e).unwrap());
            sim.event_destroy(e).unwrap();
        }
    }

    #[test]
    fn a_record_again_is_counted_and_costed_as_a_record() {
        let sim = SimVmm::new(SimConfig {
            gpu_lag_ops: 1,
            ..SimConfig::default()
        })
        .unwrap();
        let a = sim.event_record(StreamId(1)).unwrap();
        sim.advance(1);
        assert!(sim.event_query(a).unwrap());
        let before = sim.driver_stats();
        sim.event_record_on(a, StreamId(2)).unwrap();
        assert!(!sim.event_query(a).unwrap(), "pending again");
        sim.advance(1);
        assert!(sim.event_query(a).unwrap());
        sim.event_destroy(a).unwrap();
        assert!(sim.event_record_on(a, StreamId(2)).is_err(), "destroyed");
        let d = sim.driver_stats().since(&before);
        assert_eq!(d.count(CallKind::EventRecord), 2);
        assert_eq!(d.failed[CallKind::EventRecord.index()], 1);
        assert_eq!(d.count(CallKind::EventQuery), 2);
        sim.check_invariants().unwrap();
        assert!(sim.leak_report().is_empty());
    }
}
