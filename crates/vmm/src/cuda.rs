//! CUDA backend: the real driver, through `cudarc`'s raw bindings
//! (`cudarc::driver::sys`), with `libcuda` loaded at run time.
//!
//! - Construction checks `is_culib_present()`, then that `libcuda` exports
//!   every symbol this backend calls ([`DRIVER_SYMBOLS`]), before any driver
//!   call (cudarc panics on the first call of a missing symbol, and again in
//!   a destructor, which aborts the process), and returns
//!   [`VmmError::Unavailable`] naming what is missing where there is no
//!   driver, a symbol is missing, there is no device of that ordinal, or no
//!   virtual memory management on it.
//! - It retains the device's primary context (released at drop) and makes it
//!   current on the calling thread for each driver call, since allocators call
//!   from many threads, but keeps the thread's own context: when the primary
//!   context is current already nothing changes; when no context or another
//!   one is current, the primary context is pushed (`cuCtxPushCurrent`) for
//!   the call and popped after it (`cuCtxPopCurrent`), so the caller finds
//!   the context it had.
//! - The granularity is queried (`cuMemGetAllocationGranularity`, minimum), not
//!   assumed, with the properties of the `cuMemCreate` it rules: plain ones
//!   for [`Vmm::granularity`], and those of each [`CreateProps`] for
//!   [`Vmm::create_with`] ([`CudaVmm::granularity_for`]; a size that is not a
//!   multiple of it is refused before the driver sees it).
//! - Every call is checked against the same ledger as the host backend before
//!   the driver sees it, so bad input gets the same typed errors on every
//!   backend and never reaches the driver. Driver failures become
//!   [`VmmError::Driver`] with the `CUresult` code, name and text;
//!   `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemCreate` becomes
//!   [`VmmError::OutOfMemory`] with the free memory `cuMemGetInfo` reports.
//! - [`PhysHandle`] and [`EventId`] values are this backend's own ids (mapped to
//!   the driver's objects inside), so a handle the driver recycles can never be
//!   confused with a released one. [`StreamId`] values are raw `CUstream`
//!   pointers made by [`CudaVmm::create_stream`] or adopted by
//!   [`CudaVmm::adopt_stream`]; `StreamId(0)` is the legacy default stream
//!   (adopting `CU_STREAM_LEGACY`, `0x1`, gives it too), and the per-thread
//!   default stream (`CU_STREAM_PER_THREAD`, `0x2`, which names the calling
//!   thread's own stream) is one id per adopting thread, its calls issued
//!   on that thread (see [`CudaVmm::adopt_stream`] for what another thread
//!   gets instead). [`Vmm::forget_stream`] drops an adopted stream: its
//!   handle is never passed to the driver again.
//! - [`Vmm::stream_is_capturing`] asks `cuStreamIsCapturing`.
//! - Calls that CUDA forbids while a capture runs in global mode (on any
//!   thread) or in thread-local mode (on the calling one) — memory
//!   management, synchronisations, event queries, host copies — run in the
//!   relaxed capture mode (`cuThreadExchangeStreamCaptureMode` before and,
//!   unless the thread was relaxed already, after), as PyTorch's caching
//!   allocator puts its `cudaMalloc` under a capture: an allocation made
//!   during a capture (a graph's private pool filled then) leaves the
//!   capture valid. The exchange is made only around such a call, so an
//!   operation that makes none (an allocation served from mapped memory)
//!   makes no exchange. What relaxed mode still refuses (synchronising or
//!   querying the capturing stream itself) the allocator never asks.
//! - `map` follows CUDA's documented rule ([`MapRule::WholeHandle`], always:
//!   the offset "currently must be zero", and a mapping covers its handle
//!   whole); the ledger refuses anything else before the driver sees it.
//! - An unmap of several neighbouring mappings is made one `cuMemUnmap` per
//!   mapping (the driver unmaps whole mappings only) and counted as one call.
//! - Events are pooled: [`Vmm::event_destroy`] puts the driver's event on a
//!   free list (up to [`EVENT_POOL_MAX`] of them) and [`Vmm::event_record`]
//!   re-records one from it, so a steady state creates and destroys no driver
//!   event (re-recording is safe: a `cuStreamWaitEvent` already made waits for
//!   the record it saw). Past the cap `cuEventDestroy` runs; an event whose
//!   destroy fails stays live in the book (the error is returned, and drop
//!   tries again). Pooled events are destroyed at drop.
//!   [`Vmm::event_record_on`] re-records a live event in place (one
//!   `cuEventRecord`, no pool or book traffic).
//! - [`CudaVmm::copy_to_device`] synchronises the legacy default stream after
//!   `cuMemcpyHtoD`: from pageable memory the copy returns once the bytes are
//!   staged, before the DMA has landed (CUDA's "API synchronization
//!   behavior"). Copies run without the ledger's lock: the range is pinned
//!   in the ledger (an unmap of it is refused meanwhile), the lock dropped,
//!   the copy made, the range unpinned. No lock is held across a driver
//!   call beyond the call it guards.
//! - `cuMemAddressReserve` failing with `CUDA_ERROR_OUT_OF_MEMORY` is
//!   [`VmmError::AddressSpaceExhausted`], not device memory.
//! - An imported handle's size is checked against what the system or the
//!   driver says ([`Vmm::import_handle`] below): a POSIX descriptor that is
//!   a regular file (a memory file) by `fstat`, any other handle by mapping
//!   it whole once (a size larger than the memory is refused by
//!   `cuMemMap`).
//! - At drop, the context is synchronised (`cuCtxSynchronize`: no queued work
//!   may still touch the memory), then whatever is still alive (events,
//!   streams, mappings, handles, reservations) is given back to the driver,
//!   and the leak is logged.

mod cu;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_int;
use std::fmt;
use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::Instant;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::call_log::{lock, CallLog};
use crate::driver::Vmm;
use crate::error::{Result, Unavailability, VmmError};
use crate::events::EventBook;
use crate::leak::LeakReport;
use crate::ledger::Ledger;
use crate::share::{
    CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, HandleTypes, ShareableHandle,
};
use crate::types::{
    CallKind, DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId,
};
use cu::CuResult;

/// Most driver events kept for reuse after [`Vmm::event_destroy`]; beyond it
/// `cuEventDestroy` runs.
pub const EVENT_POOL_MAX: usize = 1024;

/// Every `libcuda` symbol this backend calls (through `cudarc::driver::sys`,
/// which loads each by this exact name on first use and panics when it is
/// missing). [`CudaVmm::new`] checks that all are exported before any call.
/// A unit test checks that every `sys::cu…` call of this file is listed, so
/// the list stays true: add a symbol here when adding a call.
pub const DRIVER_SYMBOLS: &[&str] = &[
    // errors (`describe`, through cudarc's `DriverError`)
    "cuGetErrorName",
    "cuGetErrorString",
    // setup and device queries
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDriverGetVersion",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    // the current context
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxSynchronize",
    // the thread's stream capture mode
    "cuThreadExchangeStreamCaptureMode",
    // virtual memory management
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetInfo_v2",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    // streams and events
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamIsCapturing",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    // copies
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
];

/// `CU_STREAM_LEGACY`: the legacy default stream, as a handle.
pub const CU_STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
pub const CU_STREAM_PER_THREAD: u64 = 0x2;

/// The [`StreamId`] of the `n`th thread to adopt the per-thread default
/// stream (`n >= 1`): `2 + 8n`, a value no `CUstream` pointer takes (they
/// are aligned), distinct from `0x1` and `0x2`.
fn per_thread_id(n: u64) -> u64 {
    CU_STREAM_PER_THREAD + 8 * n
}

/// Traces a driver call this backend does not count in [`DriverStats`]
/// (stream creation and destruction), as [`CallLog`] traces counted ones;
/// passes the result through.
fn trace_uncounted<T>(call: &'static str, started: Instant, result: Result<T>) -> Result<T> {
    tracing::trace!(
        backend = "cuda",
        call,
        ok = result.is_ok(),
        ns = started.elapsed().as_nanos() as u64,
        "driver call"
    );
    result
}

/// The driver's name and description of a `CUresult`.
fn describe(r: sys::CUresult) -> (String, String) {
    let e = DriverError(r);
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", r as u32));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    (name, text)
}

/// [`VmmError::Driver`] for the failed `CUresult` `r` of a call of kind `call`.
fn driver_error(call: CallKind, r: sys::CUresult) -> VmmError {
    let (name, text) = describe(r);
    VmmError::Driver {
        call,
        code: r as u32,
        name,
        text,
    }
}

/// The call's value, or [`VmmError::Driver`] naming `call`.
fn check<T>(call: CallKind, r: CuResult<T>) -> Result<T> {
    r.map_err(|r| driver_error(call, r))
}

/// [`VmmError::Unavailable`] saying which setup step failed with `r`.
fn setup_error(step: &'static str, r: sys::CUresult) -> VmmError {
    let (name, text) = describe(r);
    unavailable(Unavailability::Setup {
        step,
        code: r as u32,
        name,
        text,
    })
}

/// [`VmmError::Unavailable`] for `reason`.
fn unavailable(reason: Unavailability) -> VmmError {
    VmmError::Unavailable { reason }
}

/// The call's value, or [`VmmError::Unavailable`] saying which step failed.
fn check_setup<T>(step: &'static str, r: CuResult<T>) -> Result<T> {
    r.map_err(|r| setup_error(step, r))
}

fn to_usize(call: CallKind, argument: &'static str, value: u64) -> Result<usize> {
    usize::try_from(value).map_err(|_| VmmError::InvalidArgument {
        call,
        argument,
        value,
        rule: "does not fit the platform's size type",
    })
}

/// A retained primary context; released when dropped.
#[derive(Debug)]
struct PrimaryContext {
    device: sys::CUdevice,
    /// The `CUcontext` as an address (kept as an integer so the backend is `Send + Sync`).
    context: usize,
}

impl PrimaryContext {
    fn as_raw(&self) -> sys::CUcontext {
        self.context as sys::CUcontext
    }
}

/// The primary context made current on the calling thread for as long as the
/// guard lives, with the thread's previous context (or none) current again
/// after it. Not `Send`: a thread's context stack is its own.
#[must_use = "the context is current only while the guard lives"]
struct CurrentContext {
    /// True when this guard pushed the context and pops it when dropped;
    /// false when the context was current already.
    pushed: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl CurrentContext {
    /// Makes `context` current on this thread unless it is already; on
    /// failure, the driver's `CUresult`.
    fn enter(context: sys::CUcontext) -> CuResult<CurrentContext> {
        let pushed = cu::ctx_get_current()? != context;
        if pushed {
            // SAFETY: `context` is a retained, live primary context (the caller
            // owns the retain for longer than this guard lives). Pushing keeps
            // the thread's previous context under it, restored by the pop in `drop`.
            unsafe { cu::ctx_push_current(context) }?;
        }
        Ok(CurrentContext {
            pushed,
            _thread_bound: PhantomData,
        })
    }
}

/// The calling thread in CUDA's relaxed stream-capture mode while the guard
/// lives, its own mode restored after (nothing to restore when it was
/// relaxed already). Not `Send`: the mode is the thread's.
#[must_use = "the thread is relaxed only while the guard lives"]
struct RelaxedCapture {
    /// The mode to restore; `None` when it was relaxed already or the
    /// exchange failed (then the call goes on in the thread's own mode).
    prior: Option<sys::CUstreamCaptureMode>,
    _thread_bound: PhantomData<*const ()>,
}

impl RelaxedCapture {
    fn enter() -> RelaxedCapture {
        let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let prior = match cu::thread_exchange_stream_capture_mode(relaxed) {
            Ok(mode) if mode != relaxed => Some(mode),
            Ok(_) => None,
            Err(r) => {
                tracing::debug!(
                    code = r as u32,
                    "cuThreadExchangeStreamCaptureMode failed: the call runs in the thread's mode"
                );
                None
            }
        };
        RelaxedCapture {
            prior,
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mode) = self.prior {
            if let Err(r) = cu::thread_exchange_stream_capture_mode(mode) {
                tracing::warn!(
                    code = r as u32,
                    "cuThreadExchangeStreamCaptureMode failed: the thread's capture mode was not restored"
                );
            }
        }
    }
}

/// What a driver call runs under ([`CudaVmm::bind`]): the primary context
/// current and, for a call CUDA forbids under a global or thread-local
/// capture ([`forbidden_under_strict_capture`]), the relaxed capture mode.
/// Fields drop in order: the mode is restored, then the context popped.
#[must_use = "the call's context holds only while the guard lives"]
struct Bound {
    _relaxed: Option<RelaxedCapture>,
    _context: CurrentContext,
}

/// Whether CUDA forbids a call of `kind` while a capture in global mode
/// runs (on any thread) or one in thread-local mode runs on the calling
/// thread, unless the thread is in relaxed mode: memory management,
/// synchronisations, event queries, copies from or to the host. Recording
/// an event, a stream waiting for one, asking whether a stream captures and
/// `cuMemGetInfo` are legal under any capture.
fn forbidden_under_strict_capture(kind: CallKind) -> bool {
    !matches!(
        kind,
        CallKind::EventRecord
            | CallKind::EventDestroy
            | CallKind::StreamWaitEvent
            | CallKind::StreamIsCapturing
            | CallKind::MemInfo
    )
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        // SAFETY: this guard pushed the context on this thread (it is not
        // `Send`) and every guard is dropped in reverse order of creation,
        // so the top of the stack is the context it pushed.
        if let Err(r) = unsafe { cu::ctx_pop_current() } {
            tracing::warn!(
                code = r as u32,
                "cuCtxPopCurrent failed: the thread's previous context was not restored"
            );
        }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: `device` is the device this context was retained on, once;
        // this is the matching release.
        if let Err(r) = unsafe { cu::device_primary_ctx_release(self.device) } {
            tracing::warn!(code = r as u32, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

/// Streams and events alive on this backend.
///
/// Invariant: a raw event is either in `events` (live, named by an id) or in
/// `pooled` (destroyed by its user, kept for reuse), never both; `pooled`
/// holds at most [`EVENT_POOL_MAX`] events.
#[derive(Debug, Default)]
struct SyncBook {
    /// Raw `CUstream` addresses made by `create_stream`.
    streams: BTreeSet<u64>,
    /// Raw `CUstream` handles made elsewhere (PyTorch's streams, cudarc's)
    /// and adopted by `adopt_stream`: usable in every stream call until
    /// forgotten, never destroyed here.
    adopted: BTreeSet<u64>,
    /// Per-thread default streams adopted: each id with its owning thread.
    per_thread: BTreeMap<u64, ThreadId>,
    /// The per-thread id each adopting thread has (until forgotten).
    per_thread_of: std::collections::HashMap<ThreadId, u64>,
    /// Per-thread ids handed out so far (the next is this plus one).
    per_thread_issued: u64,
    /// A non-blocking stream of ours that never runs work, made on first
    /// need: events standing for work already known complete are recorded
    /// there (see [`CudaVmm::adopt_stream`]).
    quiet: Option<u64>,
    /// Live events, each with its raw `CUevent` address.
    events: EventBook<usize>,
    /// Raw `CUevent` addresses ready to be recorded again.
    pooled: Vec<usize>,
}

/// Where a call naming a stream goes.
#[derive(Clone, Copy, Debug)]
enum StreamTarget {
    /// This handle, valid on the calling thread.
    Raw(sys::CUstream),
    /// Another thread's per-thread default stream: no handle names it on
    /// this thread (see [`CudaVmm::adopt_stream`] for what is done instead).
    OtherThread,
}

impl SyncBook {
    fn target(&self, call: CallKind, stream: StreamId) -> Result<StreamTarget> {
        if stream == StreamId::DEFAULT
            || self.streams.contains(&stream.0)
            || self.adopted.contains(&stream.0)
        {
            return Ok(StreamTarget::Raw(stream.0 as usize as sys::CUstream));
        }
        match self.per_thread.get(&stream.0) {
            Some(owner) if *owner == std::thread::current().id() => Ok(StreamTarget::Raw(
                CU_STREAM_PER_THREAD as usize as sys::CUstream,
            )),
            Some(_) => Ok(StreamTarget::OtherThread),
            None => Err(VmmError::InvalidArgument {
                call,
                argument: "stream",
                value: stream.0,
                rule: "is neither the default stream nor a live stream of this backend (never adopted, or forgotten)",
            }),
        }
    }

    fn event(&self, call: CallKind, event: EventId) -> Result<sys::CUevent> {
        self.events.get(call, event).map(|raw| *raw as sys::CUevent)
    }
}

/// The CUDA backend for one device. `Send + Sync`: driver objects are kept as
/// integers behind mutexes, and every call makes the primary context current
/// for its length (keeping the calling thread's own context).
pub struct CudaVmm {
    ordinal: usize,
    name: String,
    driver_version: i32,
    /// Device memory in bytes (`cuDeviceTotalMem`): no handle can be larger.
    total_memory: u64,
    granularity: u64,
    /// Granularities queried for the properties of [`Vmm::create_with`]
    /// (the plain properties' is `granularity`).
    granularities: Mutex<Vec<(CreateProps, u64)>>,
    ledger: Mutex<Ledger<sys::CUmemGenericAllocationHandle>>,
    sync: Mutex<SyncBook>,
    log: CallLog,
    // Last: dropped after `Drop::drop` has given everything else back.
    context: PrimaryContext,
}

impl fmt::Debug for CudaVmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaVmm")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("driver_version", &self.driver_version)
            .field("total_memory", &self.total_memory)
            .field("granularity", &self.granularity)
            .field("live", &self.leak_report())
            .finish()
    }
}

/// Allocation properties for pinned device memory on device `ordinal`.
fn allocation_prop(ordinal: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
const MINIMUM: sys::CUmemAllocationGranularity_flags =
    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;

/// Allocation properties for `props` on device `ordinal`:
/// `requestedHandleTypes` as CUDA's bit set, `gpuDirectRDMACapable` as asked.
fn allocation_prop_with(ordinal: c_int, props: CreateProps) -> sys::CUmemAllocationProp {
    let mut prop = allocation_prop(ordinal);
    prop.requestedHandleTypes = handle_types_bits(props.handle_types);
    prop.allocFlags.gpuDirectRDMACapable = u8::from(props.gpu_direct_rdma);
    prop
}

/// `CUmemAllocationHandleType` of a set of handle types (a bit set).
fn handle_types_bits(types: HandleTypes) -> sys::CUmemAllocationHandleType {
    let mut bits = 0;
    if types.posix_fd {
        bits |= sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
    }
    if types.fabric {
        bits |= sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;
    }
    sys::CUmemAllocationHandleType(bits)
}

/// A boolean device attribute; false where the query fails (an older driver
/// that does not know the attribute).
fn device_flag(device: sys::CUdevice, attribute: sys::CUdevice_attribute) -> bool {
    cu::device_get_attribute(attribute, device).is_ok_and(|v| v != 0)
}

/// Device `ordinal` as [`CudaVmm::new`] checks it, without a context: the
/// driver is there with every symbol Quilt calls, `cuInit` succeeds, the
/// device exists and manages virtual memory. Returns its ordinal as the
/// driver takes it, its handle and the device count.
fn open_device(ordinal: usize) -> Result<(c_int, sys::CUdevice, c_int)> {
    if !cu::library_present() {
        return Err(unavailable(Unavailability::NoDriver));
    }
    let missing = cu::missing_symbols(DRIVER_SYMBOLS);
    if !missing.is_empty() {
        return Err(unavailable(Unavailability::MissingSymbols { missing }));
    }
    // From here on libcuda is present and exports every symbol we call.
    check_setup("cuInit", cu::init())?;
    let count = check_setup("cuDeviceGetCount", cu::device_get_count())?;
    let ordinal_c = c_int::try_from(ordinal)
        .ok()
        .filter(|o| *o < count)
        .ok_or_else(|| {
            unavailable(Unavailability::NoSuchDevice {
                ordinal,
                count: count.unsigned_abs(),
            })
        })?;
    let device = check_setup("cuDeviceGet", cu::device_get(ordinal_c))?;
    let vmm_supported = check_setup(
        "cuDeviceGetAttribute",
        cu::device_get_attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            device,
        ),
    )?;
    if vmm_supported == 0 {
        return Err(unavailable(Unavailability::NoVmm { ordinal }));
    }
    Ok((ordinal_c, device, count))
}

impl CudaVmm {
    /// Whether device `ordinal` could be opened ([`CudaVmm::new`]'s checks
    /// of the driver and the device), without opening it: no context is
    /// created or retained (a process that never uses the device pays
    /// nothing on it). Returns the number of devices.
    pub fn check_device(ordinal: usize) -> Result<usize> {
        let (_, _, count) = open_device(ordinal)?;
        Ok(count.unsigned_abs() as usize)
    }

    /// Opens device `ordinal`.
    ///
    /// Errors ([`VmmError::Unavailable`], with the reason): no `libcuda` on
    /// this machine; `cuInit` failed (e.g. `CUDA_ERROR_NO_DEVICE`); the ordinal
    /// is out of range; the device lacks virtual memory management; the
    /// primary context or the granularity could not be had.
    pub fn new(ordinal: usize) -> Result<CudaVmm> {
        let (ordinal_c, device, count) = open_device(ordinal)?;
        let name =
            cu::device_get_name(device).unwrap_or_else(|_| String::from("unknown CUDA device"));
        let total_memory = check_setup("cuDeviceTotalMem", cu::device_total_mem(device))?;
        let driver_version = cu::driver_get_version().unwrap_or(0);
        let raw_context = check_setup(
            "cuDevicePrimaryCtxRetain",
            cu::device_primary_ctx_retain(device),
        )?;
        // From here on, dropping `context` releases the primary context.
        let context = PrimaryContext {
            device,
            context: raw_context as usize,
        };
        // Current for the rest of `new` only; the thread's own context (if
        // any) is back when `_current` drops, before `context` would.
        let _current = CurrentContext::enter(context.as_raw())
            .map_err(|r| setup_error("cuCtxPushCurrent", r))?;
        let prop = allocation_prop(ordinal_c);
        let granularity = check_setup(
            "cuMemGetAllocationGranularity",
            cu::mem_get_allocation_granularity(&prop, MINIMUM),
        )?;
        if !granularity.is_power_of_two() {
            return Err(unavailable(Unavailability::Granularity {
                granularity: granularity as u64,
            }));
        }
        let granularity = granularity as u64;
        let recommended = match cu::mem_get_allocation_granularity(
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        ) {
            Ok(r) if r.is_power_of_two() && r as u64 >= granularity => r as u64,
            _ => granularity,
        };
        use sys::CUdevice_attribute as A;
        let caps = DeviceCaps {
            ordinal: ordinal_c.unsigned_abs(),
            device_count: count.unsigned_abs(),
            vmm: true,
            handle_types: HandleTypes {
                posix_fd: device_flag(
                    device,
                    A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                ),
                fabric: device_flag(device, A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED),
            },
            gpu_direct_rdma_with_vmm: device_flag(
                device,
                A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            ),
            granularity,
            recommended_granularity: recommended,
        };
        let mut ledger = Ledger::new(granularity, u64::MAX);
        ledger.set_caps(caps);
        tracing::debug!(ordinal, %name, driver_version, granularity, ?caps, "CUDA backend opened");
        Ok(CudaVmm {
            ordinal,
            name,
            driver_version,
            total_memory: total_memory as u64,
            granularity,
            granularities: Mutex::new(vec![(CreateProps::default(), granularity)]),
            ledger: Mutex::new(ledger),
            sync: Mutex::new(SyncBook::default()),
            log: CallLog::new("cuda"),
            context,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name (`cuDeviceGetName`), e.g. `NVIDIA H200`.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Device memory in bytes (`cuDeviceTotalMem`).
    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    /// The minimum granularity `cuMemGetAllocationGranularity` reports for a
    /// `cuMemCreate` with `props` (handle types, RDMA flag), queried once per
    /// distinct properties and kept. [`Vmm::create_with`] refuses a size
    /// that is not a multiple of it. The plain properties' is
    /// [`Vmm::granularity`].
    pub fn granularity_for(&self, props: CreateProps) -> Result<u64> {
        if let Some(&(_, g)) = lock(&self.granularities).iter().find(|(p, _)| *p == props) {
            return Ok(g);
        }
        let call = CallKind::Create;
        let prop = allocation_prop_with(self.ordinal_c(), props);
        let _context = self.bind(call)?;
        let granularity = check(call, cu::mem_get_allocation_granularity(&prop, MINIMUM))?;
        if !granularity.is_power_of_two() {
            return Err(VmmError::InvalidArgument {
                call,
                argument: "prop",
                value: granularity as u64,
                rule: "the driver's granularity for these properties is not a power of two",
            });
        }
        let granularity = granularity as u64;
        lock(&self.granularities).push((props, granularity));
        Ok(granularity)
    }

    /// Checks that the memory behind the freshly imported `raw` holds at
    /// least `size` bytes, where the caller's word is all the import has:
    /// maps it whole, once, on a private reservation (`cuMemMap` refuses a
    /// size beyond the memory), then unmaps and frees the range. The
    /// context must be current; no lock is held.
    fn map_check_import(
        &self,
        call: CallKind,
        raw: sys::CUmemGenericAllocationHandle,
        size: usize,
    ) -> Result<()> {
        let va = check(call, cu::mem_address_reserve(size, 0))?;
        // SAFETY: `va..va + size` is a fresh reservation of ours; `raw` is
        // a live imported handle; offset 0.
        let mapped = unsafe { cu::mem_map(va, size, 0, raw) };
        if mapped.is_ok() {
            // SAFETY: exactly the mapping just made; nothing used it.
            if let Err(r) = unsafe { cu::mem_unmap(va, size) } {
                tracing::warn!(
                    code = r as u32,
                    "cuMemUnmap of an import's size check failed"
                );
            }
        }
        // SAFETY: our reservation, without mappings now.
        if let Err(r) = unsafe { cu::mem_address_free(va, size) } {
            tracing::warn!(
                code = r as u32,
                "cuMemAddressFree of an import's size check failed"
            );
        }
        mapped.map_err(|_| VmmError::InvalidArgument {
            call,
            argument: "size",
            value: size as u64,
            rule: "exceeds the imported memory: cuMemMap refused to map it whole",
        })
    }

    /// The driver's CUDA version (`cuDriverGetVersion`), e.g. 12080 for 12.8.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Handles, reservations, mappings and events still alive.
    pub fn leak_report(&self) -> LeakReport {
        LeakReport {
            events: lock(&self.sync).events.len(),
            ..lock(&self.ledger).leak_report()
        }
    }

    /// Driver events destroyed by their users and kept for reuse (at most
    /// [`EVENT_POOL_MAX`]).
    pub fn pooled_events(&self) -> usize {
        lock(&self.sync).pooled.len()
    }

    fn ordinal_c(&self) -> c_int {
        // The ordinal was checked to fit a c_int in `new`.
        c_int::try_from(self.ordinal).unwrap_or(0)
    }

    /// Makes the primary context current on the calling thread until the
    /// returned guard drops (which restores the thread's previous context),
    /// and for a call of a kind CUDA forbids under a strict capture the
    /// thread's relaxed capture mode too ([`Bound`]).
    fn bind(&self, call: CallKind) -> Result<Bound> {
        let context =
            CurrentContext::enter(self.context.as_raw()).map_err(|r| driver_error(call, r))?;
        Ok(Bound {
            _relaxed: forbidden_under_strict_capture(call).then(RelaxedCapture::enter),
            _context: context,
        })
    }

    /// Runs `op` on the ledger, under its lock, as one timed and counted
    /// call (`op`: the ledger's check, the driver call, the commit).
    fn ledger_call<T>(
        &self,
        kind: CallKind,
        size: u64,
        op: impl FnOnce(&mut Ledger<sys::CUmemGenericAllocationHandle>) -> Result<T>,
    ) -> Result<T> {
        self.log.locked(kind, size, &self.ledger, op)
    }

    /// `cuMemGetInfo` without counting it (for out-of-memory figures).
    fn raw_mem_info(&self, call: CallKind) -> Result<MemInfo> {
        // The context is current (callers bind).
        let (free, total) = check(call, cu::mem_get_info())?;
        Ok(MemInfo {
            total: total as u64,
            free: free as u64,
        })
    }

    /// `cuStreamCreate` (non-blocking): a new stream, usable in every stream
    /// call of this backend until [`CudaVmm::destroy_stream`]. Not counted in
    /// [`DriverStats`]; driver failures name [`CallKind::StreamSynchronize`].
    pub fn create_stream(&self) -> Result<StreamId> {
        let started = Instant::now();
        let mut book = lock(&self.sync);
        let _context = self.bind(CallKind::StreamSynchronize)?;
        let result = check(
            CallKind::StreamSynchronize,
            cu::stream_create_non_blocking(),
        )
        .map(|stream| {
            let id = stream as usize as u64;
            book.streams.insert(id);
            StreamId(id)
        });
        trace_uncounted("cuStreamCreate", started, result)
    }

    /// Accept a `CUstream` this backend did not create in every stream call
    /// from now on (until [`Vmm::forget_stream`]), and return its
    /// [`StreamId`]. No driver call. The caller keeps the stream alive while
    /// work of this backend may use it, and calls [`Vmm::forget_stream`]
    /// (through the allocator: `QuiltAllocator::forget_stream`) before
    /// destroying it; [`CudaVmm::destroy_stream`] refuses it.
    ///
    /// - A caller's stream: the `StreamId` of the same value.
    /// - `0` and `CU_STREAM_LEGACY` (`0x1`): both the legacy default stream,
    ///   [`StreamId::DEFAULT`] (one stream, one id).
    /// - `CU_STREAM_PER_THREAD` (`0x2`): the calling thread's own default
    ///   stream, so each thread gets its own id (the same one each time it
    ///   adopts it, until forgotten), and two threads' per-thread streams
    ///   are two streams to the allocator (reusing one's memory on the
    ///   other needs an event). A call naming that id is issued with the
    ///   handle `0x2` on the owning thread. From any other thread (a free
    ///   or a reclaim on another thread, the map-ahead worker), where `0x2`
    ///   would name a different stream, the backend never acts on the wrong
    ///   stream; it falls back to something that covers the owner's stream:
    ///   - `stream_synchronize`: `cuCtxSynchronize` (all work of the device);
    ///   - `event_record`/`event_record_on`: `cuCtxSynchronize`, then the
    ///     event is recorded on a quiet stream of the backend (one that
    ///     never runs work), so it stands for work already complete;
    ///   - `stream_wait_event`: `cuCtxSynchronize` (the waiter's later work
    ///     cannot start before work already complete);
    ///   - `stream_is_capturing`: `cuStreamIsCapturing` of the legacy stream,
    ///     which reports when any blocking stream of the context (every
    ///     per-thread stream is one) is capturing: true then, conservatively.
    ///
    ///   Each fallback is correct and slower; an allocator that frees on the
    ///   thread that allocated never needs one.
    pub fn adopt_stream(&self, raw: u64) -> StreamId {
        let mut book = lock(&self.sync);
        match raw {
            0 | CU_STREAM_LEGACY => StreamId::DEFAULT,
            CU_STREAM_PER_THREAD => {
                let me = std::thread::current().id();
                if let Some(id) = book.per_thread_of.get(&me) {
                    return StreamId(*id);
                }
                book.per_thread_issued += 1;
                let id = per_thread_id(book.per_thread_issued);
                book.per_thread.insert(id, me);
                book.per_thread_of.insert(me, id);
                StreamId(id)
            }
            raw => {
                if !book.streams.contains(&raw) {
                    book.adopted.insert(raw);
                }
                StreamId(raw)
            }
        }
    }

    /// The owning thread of a per-thread default stream's id, or `None`
    /// for any other id.
    pub fn per_thread_owner(&self, stream: StreamId) -> Option<ThreadId> {
        lock(&self.sync).per_thread.get(&stream.0).copied()
    }

    /// `cuCtxSynchronize` in the current context (the caller binds it).
    fn synchronize_context(call: CallKind) -> Result<()> {
        check(call, cu::ctx_synchronize())
    }

    /// The quiet stream (made on first need, under the book's lock): a
    /// non-blocking stream of ours that never runs work. The context must
    /// be current.
    fn quiet_stream(book: &mut SyncBook, call: CallKind) -> Result<sys::CUstream> {
        if let Some(raw) = book.quiet {
            return Ok(raw as usize as sys::CUstream);
        }
        let stream = check(call, cu::stream_create_non_blocking())?;
        book.quiet = Some(stream as usize as u64);
        Ok(stream)
    }

    /// The stream an event record naming `stream` goes to, under the book's
    /// lock: the stream itself, or for another thread's per-thread stream
    /// (after the caller synchronised the context) the quiet stream.
    fn record_target(
        &self,
        book: &mut SyncBook,
        call: CallKind,
        stream: StreamId,
    ) -> Result<sys::CUstream> {
        match book.target(call, stream)? {
            StreamTarget::Raw(raw) => Ok(raw),
            StreamTarget::OtherThread => Self::quiet_stream(book, call),
        }
    }

    /// Before a record naming `stream`: when it is another thread's
    /// per-thread stream, synchronise the context (see
    /// [`CudaVmm::adopt_stream`]), without the book's lock. The context
    /// must be current.
    fn settle_other_thread(&self, call: CallKind, stream: StreamId) -> Result<()> {
        let target = lock(&self.sync).target(call, stream)?;
        match target {
            StreamTarget::Raw(_) => Ok(()),
            StreamTarget::OtherThread => Self::synchronize_context(call),
        }
    }

    /// `cuStreamDestroy`: destroys a stream made by [`CudaVmm::create_stream`]
    /// (`InvalidArgument` for any other, the default stream included).
    pub fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        let started = Instant::now();
        let call = CallKind::StreamSynchronize;
        let mut book = lock(&self.sync);
        if stream == StreamId::DEFAULT
            || !book.streams.contains(&stream.0)
            || book.quiet == Some(stream.0)
        {
            return Err(VmmError::InvalidArgument {
                call,
                argument: "stream",
                value: stream.0,
                rule: "is not a live stream made by create_stream",
            });
        }
        let _context = self.bind(call)?;
        // SAFETY: the stream was made by `cuStreamCreate` on this context and
        // not destroyed yet (it is in the book, which we hold locked).
        let result = check(call, unsafe {
            cu::stream_destroy(stream.0 as usize as sys::CUstream)
        });
        if result.is_ok() {
            book.streams.remove(&stream.0);
        }
        trace_uncounted("cuStreamDestroy", started, result)
    }

    /// Runs the copy `op` once the ledger has confirmed that every byte of
    /// `[ptr, ptr + len)` is mapped with access set. The range is pinned in
    /// the ledger for the copy's length (an unmap touching it is refused
    /// meanwhile), and the ledger's lock is not held across the copy, so
    /// other threads' VMM calls go on. Nothing runs for `len == 0`.
    fn copy_checked(
        &self,
        ptr: DevicePtr,
        len: usize,
        op: impl FnOnce() -> CuResult<()>,
    ) -> Result<()> {
        {
            let mut ledger = lock(&self.ledger);
            ledger.check_accessible(ptr, len as u64)?;
            if len == 0 {
                return Ok(());
            }
            ledger.pin(ptr, len as u64);
        }
        let result = self
            .bind(CallKind::StreamSynchronize)
            .and_then(|_context| check(CallKind::StreamSynchronize, op()));
        lock(&self.ledger).unpin(ptr, len as u64);
        result
    }

    /// `cuMemcpyHtoD`: copies `data` to `ptr`. The whole range must be mapped
    /// (else `NotMapped`) and access-set (else `InvalidArgument`), as on the
    /// host backend. Not counted in [`DriverStats`]; driver failures name
    /// [`CallKind::StreamSynchronize`].
    ///
    /// The bytes have landed when it returns: `data` is pageable memory, from
    /// which `cuMemcpyHtoD` returns once the bytes are staged for the DMA,
    /// "but the DMA to final destination may not have completed" (CUDA's API
    /// synchronization behavior), so the copy is followed by a
    /// `cuStreamSynchronize` of the legacy default stream it was issued on.
    pub fn copy_to_device(&self, ptr: DevicePtr, data: &[u8]) -> Result<()> {
        self.copy_checked(ptr, data.len(), || {
            // SAFETY: `copy_checked` confirmed the device range is mapped
            // and accessible, and pins it in the ledger so that no unmap can
            // take it meanwhile.
            unsafe { cu::memcpy_htod(ptr, data) }?;
            // SAFETY: the null stream is the legacy default stream of the
            // current context (made current by `copy_checked`), always valid;
            // waiting on it finishes the copy just queued there.
            unsafe { cu::stream_synchronize(std::ptr::null_mut()) }
        })
    }

    /// `cuMemcpyDtoH`: copies `out.len()` bytes from `ptr` into `out`; same
    /// rules as [`CudaVmm::copy_to_device`].
    pub fn copy_from_device(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.copy_checked(ptr, len, || {
            // SAFETY: the device range is mapped, accessible and pinned
            // (`copy_checked`), and the copy is synchronous.
            unsafe { cu::memcpy_dtoh(out, ptr) }
        })
    }
}

impl Vmm for CudaVmm {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let call = CallKind::Reserve;
        self.ledger_call(call, size, |ledger| {
            ledger.reserve(size, alignment, |alignment| {
                let size_u = to_usize(call, "size", size)?;
                let alignment_u = to_usize(call, "alignment", alignment)?;
                let _context = self.bind(call)?;
                cu::mem_address_reserve(size_u, alignment_u).map_err(|r| match r {
                    // No free range of virtual addresses: not device memory.
                    sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => VmmError::AddressSpaceExhausted {
                        call,
                        requested: size,
                        available: 0,
                    },
                    r => driver_error(call, r),
                })
            })
        })
    }

    fn address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::AddressFree;
        self.ledger_call(call, size, |ledger| {
            ledger.address_free(ptr, size, || {
                let _context = self.bind(call)?;
                // SAFETY: the ledger confirmed this is exactly a live reservation
                // of ours with no mapping left.
                check(call, unsafe { cu::mem_address_free(ptr, size as usize) })
            })
        })
    }

    fn create(&self, size: u64) -> Result<PhysHandle> {
        self.create_with(size, CreateProps::default())
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let call = CallKind::Release;
        self.log.time_sized(call, || {
            lock(&self.ledger).release_with(handle, |raw| {
                let _context = self.bind(call)?;
                // SAFETY: `raw` came from `cuMemCreate` and was not released yet
                // (the ledger marks it released right after). The driver keeps the
                // memory alive while mappings of it remain.
                check(call, unsafe { cu::mem_release(*raw) })
            })
        })
    }

    fn map(&self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        let call = CallKind::Map;
        self.ledger_call(call, size, |ledger| {
            ledger.map(ptr, size, handle, offset, |raw| {
                let _context = self.bind(call)?;
                // SAFETY: the ledger confirmed the range lies in one live
                // reservation with no mapping, aligned, and `offset + size` inside
                // the live handle `raw`.
                check(call, unsafe {
                    cu::mem_map(ptr, size as usize, offset as usize, *raw)
                })
            })
        })
    }

    /// One `cuMemUnmap` per mapping the range covers; mappings unmapped
    /// before a failure are gone either way.
    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::Unmap;
        self.ledger_call(call, size, |ledger| {
            ledger.unmap(ptr, size, |mappings| {
                let _context = match self.bind(call) {
                    Ok(context) => context,
                    Err(e) => return (0, Err(e)),
                };
                for (done, &(start, len)) in mappings.iter().enumerate() {
                    // SAFETY: `start..start + len` is exactly one whole live
                    // mapping (ledger); the driver unmaps it and drops its access.
                    if let Err(r) = unsafe { cu::mem_unmap(start, len as usize) } {
                        return (done, Err(driver_error(call, r)));
                    }
                }
                (mappings.len(), Ok(()))
            })
        })
    }

    fn set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.set_access_for(ptr, size, &[self.ordinal_c().unsigned_abs()])
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let started = Instant::now();
        let call = CallKind::MemInfo;
        let result = self.bind(call).and_then(|_context| self.raw_mem_info(call));
        self.log.record(call, 0, started, result)
    }

    fn event_record(&self, stream: StreamId) -> Result<EventId> {
        let call = CallKind::EventRecord;
        self.log.time(call, 0, || {
            let _context = self.bind(call)?;
            self.settle_other_thread(call, stream)?;
            let mut book = lock(&self.sync);
            let raw_stream = self.record_target(&mut book, call, stream)?;
            // A pooled event if there is one, else a new one.
            let event = match book.pooled.pop() {
                Some(raw) => raw as sys::CUevent,
                None => check(call, cu::event_create_disable_timing())?,
            };
            // SAFETY: `event` is a live event of this context, owned by no
            // id (fresh, or taken from the pool under the book's lock);
            // `raw_stream` is the default stream, a live stream of ours or
            // adopted, or the calling thread's own per-thread stream
            // (checked in the book we hold). Recording a pooled event again
            // overwrites its state; waits made on its earlier record keep
            // waiting for that one.
            let recorded = check(call, unsafe { cu::event_record(event, raw_stream) });
            if let Err(e) = recorded {
                // Still a valid event: back to the pool (destroyed at drop).
                book.pooled.push(event as usize);
                return Err(e);
            }
            Ok(book.events.record(event as usize))
        })
    }

    fn event_record_on(&self, event: EventId, stream: StreamId) -> Result<()> {
        let call = CallKind::EventRecord;
        self.log.time(call, 0, || {
            let _context = self.bind(call)?;
            lock(&self.sync).event(call, event)?;
            self.settle_other_thread(call, stream)?;
            let mut book = lock(&self.sync);
            let raw_stream = self.record_target(&mut book, call, stream)?;
            let raw_event = book.event(call, event)?;
            // SAFETY: `raw_event` is a live event of this context, named by
            // `event` (in the book, which we hold locked, so no destroy can
            // race); `raw_stream` is the default stream, a live stream of
            // ours or adopted, the calling thread's own per-thread stream, or
            // the quiet stream (checked in the same book). Recording it again overwrites
            // its state; waits made on its earlier record keep waiting for
            // that one. A failed record leaves the event live and named by
            // `event`.
            check(call, unsafe { cu::event_record(raw_event, raw_stream) })
        })
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        let call = CallKind::EventQuery;
        self.log.time(call, 0, || {
            let book = lock(&self.sync);
            let raw = book.event(call, event)?;
            let _context = self.bind(call)?;
            // SAFETY: `raw` is a live event (in the book, which we hold locked
            // so no destroy can race).
            check(call, unsafe { cu::event_query(raw) })
        })
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        let call = CallKind::EventDestroy;
        self.log.time(call, 0, || {
            let mut book = lock(&self.sync);
            let raw = *book.events.get(call, event)?;
            if book.pooled.len() < EVENT_POOL_MAX {
                // Kept for the next record: no driver call.
                book.events.remove(call, event)?;
                book.pooled.push(raw);
                return Ok(());
            }
            let _context = self.bind(call)?;
            // SAFETY: `raw` is a live event of ours (in the book, which we
            // hold locked), destroyed once: it leaves the book only if the
            // destroy succeeds, and is otherwise still live and named by `event`.
            check(call, unsafe { cu::event_destroy(raw as sys::CUevent) })?;
            book.events.remove(call, event).map(drop)
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        let call = CallKind::StreamWaitEvent;
        self.log.time(call, 0, || {
            let book = lock(&self.sync);
            let target = book.target(call, stream)?;
            let raw_event = book.event(call, event)?;
            let raw_stream = match target {
                StreamTarget::Raw(raw) => raw,
                StreamTarget::OtherThread => {
                    // Another thread's per-thread stream: wait on the host
                    // for everything so far, the event's work included.
                    drop(book);
                    let _context = self.bind(call)?;
                    return Self::synchronize_context(call);
                }
            };
            let _context = self.bind(call)?;
            // SAFETY: both are live objects of this context (checked in the
            // book, held locked); flags must be 0.
            check(call, unsafe {
                cu::stream_wait_event(raw_stream, raw_event)
            })
        })
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        let call = CallKind::StreamSynchronize;
        self.log.time(call, 0, || {
            let target = lock(&self.sync).target(call, stream)?;
            let _context = self.bind(call)?;
            match target {
                // SAFETY: the default stream, a live stream of ours or
                // adopted, or this thread's per-thread stream. The book's
                // lock is not held while waiting, so a concurrent
                // destroy_stream of the same stream is the caller's race, as
                // with the driver.
                StreamTarget::Raw(raw) => check(call, unsafe { cu::stream_synchronize(raw) }),
                // Another thread's per-thread stream: all of the device's work.
                StreamTarget::OtherThread => Self::synchronize_context(call),
            }
        })
    }

    /// `cuCtxSynchronize`, counted as one `cuStreamSynchronize`.
    fn device_synchronize(&self) -> Result<()> {
        let call = CallKind::StreamSynchronize;
        self.log.time(call, 0, || {
            let _context = self.bind(call)?;
            Self::synchronize_context(call)
        })
    }

    /// `cuStreamIsCapturing`, counted. An invalidated capture counts as
    /// capturing; `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (the legacy stream
    /// asked while a blocking stream captures) is true, as is the
    /// conservative answer for another thread's per-thread stream (see
    /// [`CudaVmm::adopt_stream`]).
    fn stream_is_capturing(&self, stream: StreamId) -> Result<bool> {
        let call = CallKind::StreamIsCapturing;
        let target = lock(&self.sync).target(call, stream)?;
        let raw = match target {
            StreamTarget::Raw(raw) => raw,
            StreamTarget::OtherThread => CU_STREAM_LEGACY as usize as sys::CUstream,
        };
        self.log.time(call, 0, || {
            let _context = self.bind(call)?;
            // SAFETY: a stream of this context (checked in the book) or the
            // legacy stream's handle.
            match unsafe { cu::stream_is_capturing(raw) } {
                Ok(status) => {
                    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
                }
                Err(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) => Ok(true),
                Err(r) => Err(driver_error(call, r)),
            }
        })
    }

    /// Drops an adopted stream or a per-thread stream's id: later calls
    /// naming it are refused until it is adopted again. A stream made by
    /// [`CudaVmm::create_stream`] is refused (destroy it with
    /// [`CudaVmm::destroy_stream`]), as is the default stream. No driver call.
    fn forget_stream(&self, stream: StreamId) -> Result<()> {
        let mut book = lock(&self.sync);
        if book.adopted.remove(&stream.0) {
            return Ok(());
        }
        if let Some(owner) = book.per_thread.remove(&stream.0) {
            book.per_thread_of.remove(&owner);
            return Ok(());
        }
        Err(VmmError::InvalidArgument {
            call: CallKind::StreamSynchronize,
            argument: "stream",
            value: stream.0,
            rule: "is not an adopted stream (the default stream and streams made by create_stream cannot be forgotten)",
        })
    }

    /// [`CudaVmm::copy_from_device`] (`cuMemcpyDtoH` to pageable memory,
    /// which returns once the copy has completed), counted as one
    /// `cuMemcpyDtoH`. Host memory is pageable, not pinned: the caller's
    /// buffer is used as it is.
    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let len = dst.len() as u64;
        self.log.time(CallKind::MemcpyDtoH, len, || {
            self.copy_from_device(src, dst)
        })
    }

    /// [`CudaVmm::copy_to_device`] (`cuMemcpyHtoD` from pageable memory, then
    /// a synchronisation of the legacy default stream so that the bytes have
    /// landed), counted as one `cuMemcpyHtoD`.
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let len = src.len() as u64;
        self.log
            .time(CallKind::MemcpyHtoD, len, || self.copy_to_device(dst, src))
    }

    fn driver_stats(&self) -> DriverStats {
        self.log.stats()
    }

    fn map_rule(&self) -> MapRule {
        // Always CUDA's documented rule: the ledger was built with it.
        MapRule::WholeHandle
    }

    fn caps(&self) -> DeviceCaps {
        lock(&self.ledger).caps()
    }

    /// The size is first checked against the granularity of `props`
    /// ([`CudaVmm::granularity_for`], queried without the ledger's lock).
    fn create_with(&self, size: u64, props: CreateProps) -> Result<PhysHandle> {
        let call = CallKind::Create;
        self.log.time(call, size, || {
            lock(&self.ledger).check_create_with(size, props)?;
            let granularity = self.granularity_for(props)?;
            if !size.is_multiple_of(granularity) {
                return Err(VmmError::InvalidArgument {
                    call,
                    argument: "size",
                    value: size,
                    rule: "is not a multiple of the granularity cuMemGetAllocationGranularity reports for these properties (CudaVmm::granularity_for)",
                });
            }
            lock(&self.ledger).create(size, props, |_| {
                let size_u = to_usize(call, "size", size)?;
                let _context = self.bind(call)?;
                let out_of_memory = || VmmError::OutOfMemory {
                    call,
                    requested: size,
                    available: self.raw_mem_info(call).map_or(0, |m| m.free),
                };
                if size > self.total_memory {
                    // Larger than the device: out of memory whatever is free, and
                    // not worth a driver call (whose error for it is not documented).
                    return Err(out_of_memory());
                }
                let prop = allocation_prop_with(self.ordinal_c(), props);
                match cu::mem_create(size_u, &prop) {
                    Err(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) => Err(out_of_memory()),
                    r => check(call, r),
                }
            })
        })
    }

    fn export_handle(&self, handle: PhysHandle, kind: HandleKind) -> Result<ShareableHandle> {
        let call = CallKind::ExportHandle;
        self.ledger_call(call, 0, |ledger| {
            ledger.export(handle, kind, |entry| {
                let _context = self.bind(call)?;
                let raw = entry.payload;
                let shared = match kind {
                    // SAFETY: `raw` is live and was created requesting
                    // POSIX file descriptors (the ledger's export check).
                    HandleKind::PosixFd => unsafe { cu::mem_export_to_shareable_handle_fd(raw) }
                        .map(ShareableHandle::PosixFd),
                    // SAFETY: `raw` is live and was created requesting
                    // fabric handles (the ledger's export check).
                    HandleKind::Fabric => unsafe { cu::mem_export_to_shareable_handle_fabric(raw) }
                        .map(ShareableHandle::Fabric),
                };
                check(call, shared)
            })
        })
    }

    /// The size is checked where the system or the driver can tell it,
    /// not taken on the caller's word: a POSIX descriptor that is a regular
    /// file of non-zero size (a memory file) must be exactly `size` bytes by
    /// `fstat`; any other handle is mapped whole once after the import
    /// (`CudaVmm::map_check_import`: a size beyond the memory is refused
    /// by `cuMemMap`). A refused import releases what it imported. No lock
    /// is held across the driver calls.
    fn import_handle(&self, shared: &ShareableHandle, size: u64) -> Result<PhysHandle> {
        let call = CallKind::ImportHandle;
        self.log.time(call, size, || {
            let kind = match shared {
                ShareableHandle::PosixFd(_) => HandleKind::PosixFd,
                ShareableHandle::Fabric(_) => HandleKind::Fabric,
                ShareableHandle::Sim(_) => {
                    return Err(crate::ledger::invalid(
                        call,
                        "osHandle",
                        0,
                        "a simulated device's handle cannot be imported by CUDA",
                    ))
                }
            };
            lock(&self.ledger).check_import(size, kind)?;
            let size_u = to_usize(call, "size", size)?;
            let mut map_check = true;
            if let ShareableHandle::PosixFd(fd) = shared {
                if let Ok(stat) = rustix::fs::fstat(fd) {
                    // A memory file says its size; anything else (the
                    // driver's own descriptors, a file of size 0) does not.
                    if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                        == rustix::fs::FileType::RegularFile
                        && stat.st_size > 0
                    {
                        if u64::try_from(stat.st_size).ok() != Some(size) {
                            return Err(VmmError::InvalidArgument {
                                call,
                                argument: "size",
                                value: size,
                                rule: "differs from the size of the memory file the descriptor names (fstat)",
                            });
                        }
                        map_check = false;
                    }
                }
            }
            let _context = self.bind(call)?;
            let raw = check(
                call,
                match shared {
                    ShareableHandle::PosixFd(fd) => {
                        cu::mem_import_from_shareable_handle_fd(fd.as_fd())
                    }
                    ShareableHandle::Fabric(bytes) => {
                        cu::mem_import_from_shareable_handle_fabric(bytes)
                    }
                    ShareableHandle::Sim(_) => Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
                },
            )?;
            if map_check {
                if let Err(e) = self.map_check_import(call, raw, size_u) {
                    // SAFETY: the handle just imported, released once here;
                    // nothing else knows it.
                    let _ = unsafe { cu::mem_release(raw) };
                    return Err(e);
                }
            }
            Ok(lock(&self.ledger).add_imported(size, kind, raw))
        })
    }

    fn set_access_for(&self, ptr: DevicePtr, size: u64, devices: &[DeviceOrdinal]) -> Result<()> {
        let call = CallKind::SetAccess;
        self.ledger_call(call, size, |ledger| {
            ledger.set_access(ptr, size, devices, || {
                let _context = self.bind(call)?;
                let descs: Vec<sys::CUmemAccessDesc> = devices
                    .iter()
                    .map(|d| sys::CUmemAccessDesc {
                        location: sys::CUmemLocation {
                            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: c_int::try_from(*d).unwrap_or(c_int::MAX),
                        },
                        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    })
                    .collect();
                // SAFETY: the range is wholly mapped (ledger); each descriptor
                // names a device of this process (ledger).
                check(call, unsafe {
                    cu::mem_set_access(ptr, size as usize, &descs)
                })
            })
        })
    }
}

impl Drop for CudaVmm {
    fn drop(&mut self) {
        let report = self.leak_report();
        if !report.is_clean() {
            tracing::warn!(%report, "CUDA backend dropped with memory still held; giving it back");
        }
        // Current until the end of `drop`, before `self.context` is released.
        let Ok(_context) = self.bind(CallKind::Release) else {
            tracing::warn!(
                "CUDA backend dropped without its context; driver objects left as they are"
            );
            return;
        };
        // No queued work may still read or write memory that is unmapped below.
        if let Err(synced) = cu::ctx_synchronize() {
            let (name, _) = describe(synced);
            tracing::warn!(code = synced as u32, %name, "cuCtxSynchronize failed at drop; unmapping anyway");
        }
        let mut book = std::mem::take(&mut *lock(&self.sync));
        for raw in book.events.drain().into_iter().chain(book.pooled) {
            // SAFETY: each event is live and owned here once: the live ones
            // from the book and the pooled ones are disjoint (the book's invariant).
            let _ = unsafe { cu::event_destroy(raw as sys::CUevent) };
        }
        for raw in book.streams.into_iter().chain(book.quiet) {
            // SAFETY: each stream is live and destroyed once, here (the
            // quiet stream is never in `streams`).
            let _ = unsafe { cu::stream_destroy(raw as usize as sys::CUstream) };
        }
        let drained = lock(&self.ledger).drain();
        for (ptr, size) in drained.mappings {
            // SAFETY: a whole live mapping of ours; the context was
            // synchronised above, so no queued work still uses it.
            let _ = unsafe { cu::mem_unmap(ptr, size as usize) };
        }
        for (released, raw) in drained.handles {
            if !released {
                // SAFETY: a live handle of ours, released once, here.
                let _ = unsafe { cu::mem_release(raw) };
            }
        }
        for (ptr, size) in drained.reservations {
            // SAFETY: a whole reservation of ours, now without mappings.
            let _ = unsafe { cu::mem_address_free(ptr, size as usize) };
        }
        // `_context` pops here (restoring the thread's own context), then
        // `self.context` drops and releases the primary context.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_send_sync_debug() {
        fn check<T: Send + Sync + std::fmt::Debug>() {}
        check::<CudaVmm>();
    }

    #[test]
    fn new_without_a_driver_is_unavailable_not_a_panic() {
        let present = cu::library_present();
        match CudaVmm::new(0) {
            Err(VmmError::Unavailable { reason }) => assert!(!reason.to_string().is_empty()),
            Ok(vmm) => {
                assert!(present);
                assert!(vmm.granularity().is_power_of_two());
            }
            Err(other) => panic!("expected Unavailable or a device, got {other}"),
        }
        if !present {
            assert!(CudaVmm::new(0).is_err());
        }
    }

    #[test]
    fn every_driver_call_of_this_backend_is_in_the_symbol_list() {
        // Every `sys::cu…(` call in this file and in the cudarc interop, by
        // the name cudarc loads (its function's name).
        let sources = [
            include_str!("cuda.rs"),
            include_str!("cuda/cu.rs"),
            include_str!("cudarc_interop.rs"),
        ];
        let mut called = BTreeSet::new();
        for source in sources {
            for (i, _) in source.match_indices("sys::cu") {
                let rest = &source[i + "sys::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // Calls only (not types such as `sys::CUresult`, which start
                // with an upper-case `CU`, nor `sys::culib`).
                if rest[name.len()..].starts_with('(') && name != "culib" {
                    called.insert(name);
                }
            }
        }
        assert!(called.len() > 30, "found only {called:?}");
        let listed: BTreeSet<&str> = DRIVER_SYMBOLS.iter().copied().collect();
        for name in &called {
            assert!(
                listed.contains(name.as_str()),
                "{name} is called but missing from DRIVER_SYMBOLS"
            );
        }
        assert_eq!(
            listed.len(),
            DRIVER_SYMBOLS.len(),
            "a symbol is listed twice"
        );
    }

    #[test]
    fn per_thread_ids_are_no_stream_pointer_nor_a_special_handle() {
        let ids: Vec<u64> = (1..=1000).map(per_thread_id).collect();
        for id in &ids {
            assert_ne!(id % 8, 0, "{id:#x} could be an aligned CUstream pointer");
            assert!(![0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD].contains(id));
        }
        let distinct: BTreeSet<u64> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len());
    }

    #[test]
    fn bad_ordinal_is_a_typed_error() {
        assert!(matches!(
            CudaVmm::new(usize::MAX),
            Err(VmmError::Unavailable { .. })
        ));
    }
}
