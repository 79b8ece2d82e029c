//! CUDA backend: the real driver, through `cudarc`'s raw bindings
//! (`cudarc::driver::sys`), with `libcuda` loaded at run time.
//!
//! - Construction checks `is_culib_present()` before any driver call (cudarc
//!   panics on the first call otherwise) and returns
//!   [`VmmError::Unavailable`] where there is no driver, no device of that
//!   ordinal, or no virtual memory management on it.
//! - It retains the device's primary context (released at drop) and makes it
//!   current on the calling thread before every driver call, since allocators
//!   call from many threads.
//! - The granularity is queried (`cuMemGetAllocationGranularity`, minimum), not assumed.
//! - Every call is checked against the same ledger as the host backend before
//!   the driver sees it, so bad input gets the same typed errors on every
//!   backend and never reaches the driver. Driver failures become
//!   [`VmmError::Driver`] with the `CUresult` code, name and text;
//!   `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemCreate` becomes
//!   [`VmmError::OutOfMemory`] with the free memory `cuMemGetInfo` reports.
//! - [`PhysHandle`] and [`EventId`] values are this backend's own ids (mapped to
//!   the driver's objects inside), so a handle the driver recycles can never be
//!   confused with a released one. [`StreamId`] values are raw `CUstream`
//!   pointers made by [`CudaVmm::create_stream`]; `StreamId(0)` is the legacy
//!   default stream.
//! - An unmap of several neighbouring mappings is made one `cuMemUnmap` per
//!   mapping (the driver unmaps whole mappings only) and counted as one call.
//! - At drop, whatever is still alive (events, streams, mappings, handles,
//!   reservations) is given back to the driver, and the leak is logged.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::call_log::CallLog;
use crate::driver::Vmm;
use crate::error::{Result, VmmError};
use crate::events::EventBook;
use crate::leak::LeakReport;
use crate::ledger::Ledger;
use crate::types::{CallKind, DevicePtr, DriverStats, EventId, MemInfo, PhysHandle, StreamId};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
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

/// `Ok` for `CUDA_SUCCESS`, else [`VmmError::Driver`] naming `call`.
fn check(call: CallKind, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, text) = describe(r);
    Err(VmmError::Driver {
        call,
        code: r as u32,
        name,
        text,
    })
}

/// `Ok` for `CUDA_SUCCESS`, else [`VmmError::Unavailable`] saying which step failed.
fn check_setup(step: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, text) = describe(r);
    Err(VmmError::Unavailable {
        reason: format!("{step} failed: {name} ({}): {text}", r as u32),
    })
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

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: `device` is the device this context was retained on, once;
        // this is the matching release.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(code = r as u32, "cuDevicePrimaryCtxRelease failed");
        }
    }
}

/// Streams and events alive on this backend.
#[derive(Debug, Default)]
struct SyncBook {
    /// Raw `CUstream` addresses made by `create_stream`.
    streams: BTreeSet<u64>,
    /// Live events, each with its raw `CUevent` address.
    events: EventBook<usize>,
}

impl SyncBook {
    fn stream(&self, call: CallKind, stream: StreamId) -> Result<sys::CUstream> {
        if stream == StreamId::DEFAULT || self.streams.contains(&stream.0) {
            Ok(stream.0 as usize as sys::CUstream)
        } else {
            Err(VmmError::InvalidArgument {
                call,
                argument: "stream",
                value: stream.0,
                rule: "is neither the default stream nor a live stream of this backend",
            })
        }
    }

    fn event(&self, call: CallKind, event: EventId) -> Result<sys::CUevent> {
        self.events.get(call, event).map(|raw| *raw as sys::CUevent)
    }
}

/// The CUDA backend for one device. `Send + Sync`: driver objects are kept as
/// integers behind mutexes, and every call binds the primary context first.
pub struct CudaVmm {
    ordinal: usize,
    name: String,
    driver_version: i32,
    /// Device memory in bytes (`cuDeviceTotalMem`): no handle can be larger.
    total_memory: u64,
    granularity: u64,
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

impl CudaVmm {
    /// Opens device `ordinal`.
    ///
    /// Errors ([`VmmError::Unavailable`], with the reason): no `libcuda` on
    /// this machine; `cuInit` failed (e.g. `CUDA_ERROR_NO_DEVICE`); the ordinal
    /// is out of range; the device lacks virtual memory management; the
    /// primary context or the granularity could not be had.
    pub fn new(ordinal: usize) -> Result<CudaVmm> {
        // SAFETY: `is_culib_present` only tries to load the library by its
        // candidate names; it calls no CUDA function and never panics.
        if !unsafe { sys::is_culib_present() } {
            return Err(VmmError::Unavailable {
                reason: "libcuda could not be loaded: no CUDA driver on this machine".to_owned(),
            });
        }
        // SAFETY: libcuda is present (checked above), so the symbol loads;
        // `cuInit` takes no pointers.
        check_setup("cuInit", unsafe { sys::cuInit(0) })?;
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid, writable `c_int`.
        check_setup("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        let ordinal_c = c_int::try_from(ordinal)
            .ok()
            .filter(|o| *o < count)
            .ok_or_else(|| VmmError::Unavailable {
                reason: format!("device ordinal {ordinal} out of range: {count} CUDA device(s)"),
            })?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: `device` is a valid, writable `CUdevice`; the ordinal is in range.
        check_setup("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal_c)
        })?;
        let mut vmm_supported: c_int = 0;
        // SAFETY: valid out-pointer and a device returned by `cuDeviceGet`.
        check_setup("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut vmm_supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                device,
            )
        })?;
        if vmm_supported == 0 {
            return Err(VmmError::Unavailable {
                reason: format!("device {ordinal} does not support virtual memory management"),
            });
        }
        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer is 256 writable bytes and we pass its length; the
        // driver writes at most that many.
        let name = match unsafe {
            sys::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as c_int, device)
        } {
            sys::CUresult::CUDA_SUCCESS => {
                let bytes: Vec<u8> = name_buf.iter().map(|c| *c as u8).collect();
                CStr::from_bytes_until_nul(&bytes)
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
            }
            _ => String::from("unknown CUDA device"),
        };
        let mut total_memory: usize = 0;
        // SAFETY: valid out-pointer and a device returned by `cuDeviceGet`.
        check_setup("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total_memory, device)
        })?;
        let mut driver_version: c_int = 0;
        // SAFETY: valid out-pointer.
        let _ = unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        let mut raw_context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and a device returned by `cuDeviceGet`.
        check_setup("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut raw_context, device)
        })?;
        // From here on, dropping `context` releases the primary context.
        let context = PrimaryContext {
            device,
            context: raw_context as usize,
        };
        // SAFETY: the context was just retained and is live.
        check_setup("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(context.as_raw())
        })?;
        let prop = allocation_prop(ordinal_c);
        let mut granularity: usize = 0;
        // SAFETY: valid out-pointer and a fully initialised `prop` that lives
        // across the call.
        check_setup("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if !granularity.is_power_of_two() {
            return Err(VmmError::Unavailable {
                reason: format!("granularity {granularity} is not a power of two"),
            });
        }
        let granularity = granularity as u64;
        tracing::debug!(ordinal, %name, driver_version, granularity, "CUDA backend opened");
        Ok(CudaVmm {
            ordinal,
            name,
            driver_version,
            total_memory: total_memory as u64,
            granularity,
            ledger: Mutex::new(Ledger::new(granularity, u64::MAX)),
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

    fn ordinal_c(&self) -> c_int {
        // The ordinal was checked to fit a c_int in `new`.
        c_int::try_from(self.ordinal).unwrap_or(0)
    }

    /// Makes the primary context current on the calling thread.
    fn bind(&self, call: CallKind) -> Result<()> {
        // SAFETY: the context is retained for this backend's whole life.
        check(call, unsafe { sys::cuCtxSetCurrent(self.context.as_raw()) })
    }

    /// `cuMemGetInfo` without counting it (for out-of-memory figures).
    fn raw_mem_info(&self, call: CallKind) -> Result<MemInfo> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two valid out-pointers; the context is current (callers bind).
        check(call, unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
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
        self.bind(CallKind::StreamSynchronize)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current.
        let r = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
            )
        };
        let result = check(CallKind::StreamSynchronize, r).map(|()| {
            let id = stream as usize as u64;
            book.streams.insert(id);
            StreamId(id)
        });
        tracing::trace!(
            backend = "cuda",
            call = "cuStreamCreate",
            ok = result.is_ok(),
            ns = started.elapsed().as_nanos() as u64,
            "driver call"
        );
        result
    }

    /// `cuStreamDestroy`: destroys a stream made by [`CudaVmm::create_stream`]
    /// (`InvalidArgument` for any other, the default stream included).
    pub fn destroy_stream(&self, stream: StreamId) -> Result<()> {
        let started = Instant::now();
        let call = CallKind::StreamSynchronize;
        let mut book = lock(&self.sync);
        if stream == StreamId::DEFAULT || !book.streams.contains(&stream.0) {
            return Err(VmmError::InvalidArgument {
                call,
                argument: "stream",
                value: stream.0,
                rule: "is not a live stream made by create_stream",
            });
        }
        self.bind(call)?;
        // SAFETY: the stream was made by `cuStreamCreate` on this context and
        // not destroyed yet (it is in the book, which we hold locked).
        let result = check(call, unsafe {
            sys::cuStreamDestroy_v2(stream.0 as usize as sys::CUstream)
        });
        if result.is_ok() {
            book.streams.remove(&stream.0);
        }
        tracing::trace!(
            backend = "cuda",
            call = "cuStreamDestroy",
            ok = result.is_ok(),
            ns = started.elapsed().as_nanos() as u64,
            "driver call"
        );
        result
    }

    /// Runs the copy `op` once the ledger has confirmed that every byte of
    /// `[ptr, ptr + len)` is mapped with access set, holding the ledger's
    /// lock so that no unmap can race it. Nothing runs for `len == 0`.
    fn copy_checked(
        &self,
        ptr: DevicePtr,
        len: usize,
        op: impl FnOnce() -> sys::CUresult,
    ) -> Result<()> {
        let ledger = lock(&self.ledger);
        ledger.check_accessible(ptr, len as u64)?;
        if len == 0 {
            return Ok(());
        }
        self.bind(CallKind::StreamSynchronize)?;
        check(CallKind::StreamSynchronize, op())
    }

    /// `cuMemcpyHtoD`: copies `data` to `ptr`. The whole range must be mapped
    /// (else `NotMapped`) and access-set (else `InvalidArgument`), as on the
    /// host backend. Synchronous with respect to the host. Not counted in
    /// [`DriverStats`]; driver failures name [`CallKind::StreamSynchronize`].
    pub fn copy_to_device(&self, ptr: DevicePtr, data: &[u8]) -> Result<()> {
        self.copy_checked(ptr, data.len(), || {
            // SAFETY: `data` is valid for `data.len()` reads; `copy_checked`
            // confirmed the device range is mapped and accessible, and holds
            // the ledger's lock that keeps it so.
            unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast::<c_void>(), data.len()) }
        })
    }

    /// `cuMemcpyDtoH`: copies `out.len()` bytes from `ptr` into `out`; same
    /// rules as [`CudaVmm::copy_to_device`].
    pub fn copy_from_device(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<()> {
        let len = out.len();
        self.copy_checked(ptr, len, || {
            // SAFETY: `out` is valid for `len` writes; the device range is
            // mapped and accessible (`copy_checked`), and the copy is synchronous.
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast::<c_void>(), ptr, len) }
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
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            let alignment = ledger.check_reserve(size, alignment)?;
            let size_u = to_usize(call, "size", size)?;
            let alignment_u = to_usize(call, "alignment", alignment)?;
            self.bind(call)?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: valid out-pointer; no fixed address is asked for (0), so
            // the driver picks a fresh range; flags must be 0.
            let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size_u, alignment_u, 0, 0) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(VmmError::OutOfMemory {
                    call,
                    requested: size,
                    available: 0,
                });
            }
            check(call, r)?;
            ledger.add_reservation(ptr, size);
            Ok(ptr)
        })
    }

    fn address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::AddressFree;
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            ledger.check_address_free(ptr, size)?;
            self.bind(call)?;
            // SAFETY: the ledger confirmed this is exactly a live reservation
            // of ours with no mapping left.
            check(call, unsafe { sys::cuMemAddressFree(ptr, size as usize) })?;
            ledger.remove_reservation(ptr);
            Ok(())
        })
    }

    fn create(&self, size: u64) -> Result<PhysHandle> {
        let call = CallKind::Create;
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            ledger.check_create(size)?;
            let size_u = to_usize(call, "size", size)?;
            self.bind(call)?;
            if size > self.total_memory {
                // Larger than the device: out of memory whatever is free, and
                // not worth a driver call (whose error for it is not documented).
                let available = self.raw_mem_info(call).map_or(0, |m| m.free);
                return Err(VmmError::OutOfMemory {
                    call,
                    requested: size,
                    available,
                });
            }
            let prop = allocation_prop(self.ordinal_c());
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out-pointer and a fully initialised `prop` that
            // lives across the call; flags must be 0.
            let r = unsafe { sys::cuMemCreate(&mut handle, size_u, &prop, 0) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let available = self.raw_mem_info(call).map_or(0, |m| m.free);
                return Err(VmmError::OutOfMemory {
                    call,
                    requested: size,
                    available,
                });
            }
            check(call, r)?;
            Ok(ledger.add_handle(size, handle))
        })
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        let started = Instant::now();
        let call = CallKind::Release;
        let result = (|| {
            let mut ledger = lock(&self.ledger);
            let entry = ledger.live_handle(call, handle)?;
            let (raw, size) = (entry.payload, entry.size);
            self.bind(call)?;
            // SAFETY: `raw` came from `cuMemCreate` and was not released yet
            // (the ledger marks it released right after). The driver keeps the
            // memory alive while mappings of it remain.
            check(call, unsafe { sys::cuMemRelease(raw) })?;
            let _ = ledger.release(handle);
            Ok(size)
        })();
        let size = result.as_ref().map_or(0, |s| *s);
        self.log.record(call, size, started, result.map(|_| ()))
    }

    fn map(&self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        let call = CallKind::Map;
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            let raw = ledger.check_map(ptr, size, handle, offset)?.payload;
            self.bind(call)?;
            // SAFETY: the ledger confirmed the range lies in one live
            // reservation with no mapping, aligned, and `offset + size` inside
            // the live handle `raw`; flags must be 0.
            check(call, unsafe {
                sys::cuMemMap(ptr, size as usize, offset as usize, raw, 0)
            })?;
            ledger.add_mapping(ptr, size, handle, offset);
            Ok(())
        })
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::Unmap;
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            let starts = ledger.check_unmap(ptr, size)?;
            self.bind(call)?;
            let mut done = Vec::with_capacity(starts.len());
            let mut outcome = Ok(());
            for start in &starts {
                let end = starts
                    .iter()
                    .find(|s| *s > start)
                    .copied()
                    .unwrap_or(ptr + size);
                // SAFETY: `start..end` is exactly one whole live mapping
                // (ledger); the driver unmaps it and drops its access.
                outcome = check(call, unsafe {
                    sys::cuMemUnmap(*start, (end - start) as usize)
                });
                if outcome.is_err() {
                    break;
                }
                done.push(*start);
            }
            // Mappings unmapped before a failure are gone either way.
            let _ = ledger.remove_mappings(&done);
            outcome
        })
    }

    fn set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::SetAccess;
        self.log.time(call, size, || {
            let mut ledger = lock(&self.ledger);
            ledger.check_set_access(ptr, size)?;
            self.bind(call)?;
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: self.ordinal_c(),
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is wholly mapped (ledger); `desc` is one fully
            // initialised descriptor living across the call, and count is 1.
            check(call, unsafe {
                sys::cuMemSetAccess(ptr, size as usize, &desc, 1)
            })?;
            ledger.mark_accessible(ptr, size);
            Ok(())
        })
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let started = Instant::now();
        let call = CallKind::MemInfo;
        let result = self.bind(call).and_then(|()| self.raw_mem_info(call));
        self.log.record(call, 0, started, result)
    }

    fn event_record(&self, stream: StreamId) -> Result<EventId> {
        let call = CallKind::EventRecord;
        self.log.time(call, 0, || {
            let mut book = lock(&self.sync);
            let raw_stream = book.stream(call, stream)?;
            self.bind(call)?;
            let mut event: sys::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer; the context is current.
            check(call, unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
                )
            })?;
            // SAFETY: `event` was just created; `raw_stream` is the default
            // stream or a live stream of ours (checked in the book we hold).
            let recorded = check(call, unsafe { sys::cuEventRecord(event, raw_stream) });
            if let Err(e) = recorded {
                // SAFETY: the event was created above and is not used again.
                let _ = unsafe { sys::cuEventDestroy_v2(event) };
                return Err(e);
            }
            Ok(book.events.record(event as usize))
        })
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        let call = CallKind::EventQuery;
        self.log.time(call, 0, || {
            let book = lock(&self.sync);
            let raw = book.event(call, event)?;
            self.bind(call)?;
            // SAFETY: `raw` is a live event (in the book, which we hold locked
            // so no destroy can race).
            match unsafe { sys::cuEventQuery(raw) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                r => check(call, r).map(|()| false),
            }
        })
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        let call = CallKind::EventDestroy;
        self.log.time(call, 0, || {
            let mut book = lock(&self.sync);
            let raw = book.event(call, event)?;
            self.bind(call)?;
            book.events.remove(call, event)?;
            // SAFETY: `raw` was live and is now out of the book, so it is
            // destroyed exactly once.
            check(call, unsafe { sys::cuEventDestroy_v2(raw) })
        })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> Result<()> {
        let call = CallKind::StreamWaitEvent;
        self.log.time(call, 0, || {
            let book = lock(&self.sync);
            let raw_stream = book.stream(call, stream)?;
            let raw_event = book.event(call, event)?;
            self.bind(call)?;
            // SAFETY: both are live objects of this context (checked in the
            // book, held locked); flags must be 0.
            check(call, unsafe {
                sys::cuStreamWaitEvent(raw_stream, raw_event, 0)
            })
        })
    }

    fn stream_synchronize(&self, stream: StreamId) -> Result<()> {
        let call = CallKind::StreamSynchronize;
        self.log.time(call, 0, || {
            let raw_stream = lock(&self.sync).stream(call, stream)?;
            self.bind(call)?;
            // SAFETY: the default stream or a live stream of ours. The book's
            // lock is not held while waiting, so a concurrent destroy_stream
            // of the same stream is the caller's race, as with the driver.
            check(call, unsafe { sys::cuStreamSynchronize(raw_stream) })
        })
    }

    fn driver_stats(&self) -> DriverStats {
        self.log.stats()
    }
}

impl Drop for CudaVmm {
    fn drop(&mut self) {
        let report = self.leak_report();
        if !report.is_clean() {
            tracing::warn!(%report, "CUDA backend dropped with memory still held; giving it back");
        }
        if self.bind(CallKind::Release).is_err() {
            return;
        }
        let mut book = std::mem::take(&mut *lock(&self.sync));
        for raw in book.events.drain() {
            // SAFETY: each event is live and destroyed once, here.
            let _ = unsafe { sys::cuEventDestroy_v2(raw as sys::CUevent) };
        }
        for raw in book.streams {
            // SAFETY: each stream is live and destroyed once, here.
            let _ = unsafe { sys::cuStreamDestroy_v2(raw as usize as sys::CUstream) };
        }
        let drained = lock(&self.ledger).drain();
        for (ptr, size) in drained.mappings {
            // SAFETY: a whole live mapping of ours.
            let _ = unsafe { sys::cuMemUnmap(ptr, size as usize) };
        }
        for (released, raw) in drained.handles {
            if !released {
                // SAFETY: a live handle of ours, released once, here.
                let _ = unsafe { sys::cuMemRelease(raw) };
            }
        }
        for (ptr, size) in drained.reservations {
            // SAFETY: a whole reservation of ours, now without mappings.
            let _ = unsafe { sys::cuMemAddressFree(ptr, size as usize) };
        }
        // `self.context` drops next and releases the primary context.
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
        // SAFETY: only tries to load the library.
        let present = unsafe { sys::is_culib_present() };
        match CudaVmm::new(0) {
            Err(VmmError::Unavailable { reason }) => assert!(!reason.is_empty()),
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
    fn bad_ordinal_is_a_typed_error() {
        assert!(matches!(
            CudaVmm::new(usize::MAX),
            Err(VmmError::Unavailable { .. })
        ));
    }
}
