//! The driver calls behind the CUDA backend, one thin wrapper per `cu*`
//! function (in the style of `rustix`): each makes the FFI call, handles its
//! out-pointers, and returns the value or the failed `CUresult`.
//!
//! A wrapper is safe where the call can do no harm whatever its arguments
//! (only out-pointers, plain values, or borrowed inputs that live across the
//! call); it is an `unsafe fn` where the driver trusts the caller with an
//! object or an address (a handle that must be live, a range that must be
//! mapped, a stream nothing else destroys meanwhile), and says what the
//! caller guarantees. The CUDA backend guarantees it by checking each call
//! against its ledger and books first. Every `unsafe` block of this file
//! makes exactly the one call its wrapper is named after.
//!
//! Every wrapper other than the library checks assumes that `libcuda` is
//! loaded and exports the symbol ([`missing_symbols`] was empty), and all
//! but the setup ones that a context is current on the calling thread.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

pub(crate) use sys::{
    CUcontext as Context, CUdevice as Device, CUdeviceptr as DevicePtr, CUevent as Event,
    CUmemGenericAllocationHandle as Handle, CUresult, CUstream as Stream,
};

/// A driver call's value, or the `CUresult` it failed with.
pub(crate) type CuResult<T> = Result<T, CUresult>;

/// `Ok(value)` for `CUDA_SUCCESS`, else the failure.
fn ok<T>(r: CUresult, value: T) -> CuResult<T> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(value)
    } else {
        Err(r)
    }
}

// ---- the library ----

/// `libcuda` can be loaded (tries its candidate names; calls nothing).
pub(crate) fn library_present() -> bool {
    // SAFETY: only tries to load the library by its candidate names; it
    // calls no CUDA function and never panics.
    unsafe { sys::is_culib_present() }
}

/// The names of `symbols` the loaded `libcuda` does not export. Only call
/// once [`library_present`] is true.
pub(crate) fn missing_symbols(symbols: &[&'static str]) -> Vec<&'static str> {
    // SAFETY: the library is present (the caller checked), so `culib` loads
    // it and does not panic; loading a library runs its initialisers, which
    // `is_culib_present` did already.
    let lib = unsafe { sys::culib() };
    symbols
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: only looks the symbol up; it is never called or
            // dereferenced through this pointer type.
            unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()
        })
        .collect()
}

// ---- setup and device queries ----

/// `cuInit(0)`.
pub(crate) fn init() -> CuResult<()> {
    // SAFETY: takes no pointers.
    ok(unsafe { sys::cuInit(0) }, ())
}

/// `cuDeviceGetCount`.
pub(crate) fn device_get_count() -> CuResult<c_int> {
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid, writable `c_int`.
    ok(unsafe { sys::cuDeviceGetCount(&mut count) }, count)
}

/// `cuDeviceGet`.
pub(crate) fn device_get(ordinal: c_int) -> CuResult<Device> {
    let mut device: Device = 0;
    // SAFETY: a valid out-pointer; the driver checks the ordinal.
    ok(unsafe { sys::cuDeviceGet(&mut device, ordinal) }, device)
}

/// `cuDeviceGetAttribute`.
pub(crate) fn device_get_attribute(
    attribute: sys::CUdevice_attribute,
    device: Device,
) -> CuResult<c_int> {
    let mut value: c_int = 0;
    // SAFETY: a valid out-pointer; the driver checks the device and attribute.
    ok(
        unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, device) },
        value,
    )
}

/// `cuDeviceGetName`, as text (lossy).
pub(crate) fn device_get_name(device: Device) -> CuResult<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer is 256 writable bytes and we pass its length; the
    // driver writes at most that many.
    let r = unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device) };
    let bytes: Vec<u8> = buf.iter().map(|c| *c as u8).collect();
    let name = CStr::from_bytes_until_nul(&bytes)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
    ok(r, name)
}

/// `cuDeviceTotalMem`.
pub(crate) fn device_total_mem(device: Device) -> CuResult<usize> {
    let mut bytes: usize = 0;
    // SAFETY: a valid out-pointer; the driver checks the device.
    ok(
        unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, device) },
        bytes,
    )
}

/// `cuDriverGetVersion`.
pub(crate) fn driver_get_version() -> CuResult<c_int> {
    let mut version: c_int = 0;
    // SAFETY: a valid out-pointer.
    ok(unsafe { sys::cuDriverGetVersion(&mut version) }, version)
}

/// `cuDevicePrimaryCtxRetain`: one retain, to be matched by one
/// [`device_primary_ctx_release`].
pub(crate) fn device_primary_ctx_retain(device: Device) -> CuResult<Context> {
    let mut context: Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver checks the device.
    ok(
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) },
        context,
    )
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// Matches one earlier [`device_primary_ctx_retain`] of `device`, and nothing
/// of the context is used afterwards under that retain.
pub(crate) unsafe fn device_primary_ctx_release(device: Device) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) }, ())
}

// ---- the current context ----

/// `cuCtxGetCurrent`.
pub(crate) fn ctx_get_current() -> CuResult<Context> {
    let mut current: Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the call only reads this thread's stack.
    ok(unsafe { sys::cuCtxGetCurrent(&mut current) }, current)
}

/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's stream
/// capture mode to `mode` and returns the mode it had.
pub(crate) fn thread_exchange_stream_capture_mode(
    mode: sys::CUstreamCaptureMode,
) -> CuResult<sys::CUstreamCaptureMode> {
    let mut exchanged = mode;
    // SAFETY: a valid in-out pointer; the call only reads and writes this
    // thread's capture mode.
    ok(
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut exchanged) },
        exchanged,
    )
}

/// `cuCtxPushCurrent`.
///
/// # Safety
/// `context` is live (retained) for as long as it stays pushed.
pub(crate) unsafe fn ctx_push_current(context: Context) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuCtxPushCurrent_v2(context) }, ())
}

/// `cuCtxPopCurrent`: the context popped.
///
/// # Safety
/// The top of this thread's context stack is a context the caller pushed.
pub(crate) unsafe fn ctx_pop_current() -> CuResult<Context> {
    let mut popped: Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, and the caller's guarantee.
    ok(unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }, popped)
}

/// `cuCtxSynchronize`: waits for all work of the current context.
pub(crate) fn ctx_synchronize() -> CuResult<()> {
    // SAFETY: takes no arguments.
    ok(unsafe { sys::cuCtxSynchronize() }, ())
}

// ---- virtual memory management ----

/// `cuMemGetAllocationGranularity` of `prop` with `flag`.
pub(crate) fn mem_get_allocation_granularity(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> CuResult<usize> {
    let mut granularity: usize = 0;
    // SAFETY: a valid out-pointer and a fully initialised `prop` that lives
    // across the call.
    ok(
        unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, prop, flag) },
        granularity,
    )
}

/// `cuMemAddressReserve` of `size` bytes aligned to `alignment`, at an
/// address the driver picks (no fixed address, flags 0).
pub(crate) fn mem_address_reserve(size: usize, alignment: usize) -> CuResult<DevicePtr> {
    let mut ptr: DevicePtr = 0;
    // SAFETY: a valid out-pointer; no fixed address is asked for (0), so the
    // driver picks a fresh range that nothing uses; flags must be 0.
    ok(
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0) },
        ptr,
    )
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `ptr..ptr + size` is exactly a reservation of the caller's, with no
/// mapping left in it.
pub(crate) unsafe fn mem_address_free(ptr: DevicePtr, size: usize) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuMemAddressFree(ptr, size) }, ())
}

/// `cuMemCreate` of `size` bytes with `prop` (flags 0).
pub(crate) fn mem_create(size: usize, prop: &sys::CUmemAllocationProp) -> CuResult<Handle> {
    let mut handle: Handle = 0;
    // SAFETY: a valid out-pointer and a fully initialised `prop` that lives
    // across the call; flags must be 0.
    ok(
        unsafe { sys::cuMemCreate(&mut handle, size, prop, 0) },
        handle,
    )
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` is a live handle of the caller's, released once: never used
/// again (the driver keeps its memory while mappings of it remain).
pub(crate) unsafe fn mem_release(handle: Handle) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuMemRelease(handle) }, ())
}

/// `cuMemMap` of `size` bytes of `handle` from `offset` at `ptr` (flags 0).
///
/// # Safety
/// `ptr..ptr + size` lies in one reservation of the caller's with no
/// mapping in it; `handle` is live and `offset + size` lies inside it.
pub(crate) unsafe fn mem_map(
    ptr: DevicePtr,
    size: usize,
    offset: usize,
    handle: Handle,
) -> CuResult<()> {
    // SAFETY: the caller's guarantee; flags must be 0.
    ok(unsafe { sys::cuMemMap(ptr, size, offset, handle, 0) }, ())
}

/// `cuMemUnmap`.
///
/// # Safety
/// `ptr..ptr + size` is exactly one whole mapping of the caller's, which no
/// queued work and no reference uses any more.
pub(crate) unsafe fn mem_unmap(ptr: DevicePtr, size: usize) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuMemUnmap(ptr, size) }, ())
}

/// `cuMemSetAccess` with `descs` (one per device).
///
/// # Safety
/// `ptr..ptr + size` is wholly mapped by mappings of the caller's.
pub(crate) unsafe fn mem_set_access(
    ptr: DevicePtr,
    size: usize,
    descs: &[sys::CUmemAccessDesc],
) -> CuResult<()> {
    // SAFETY: the caller's guarantee; `descs` holds `descs.len()` fully
    // initialised descriptors and lives across the call.
    ok(
        unsafe { sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()) },
        (),
    )
}

/// `cuMemGetInfo`: (free, total) bytes.
pub(crate) fn mem_get_info() -> CuResult<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: two valid out-pointers.
    ok(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        (free, total),
    )
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the
/// caller (a negative descriptor is `CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `handle` is live and was created requesting POSIX file descriptors.
pub(crate) unsafe fn mem_export_to_shareable_handle_fd(handle: Handle) -> CuResult<OwnedFd> {
    let mut fd: c_int = -1;
    // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes one `int` through
    // the pointer, which is valid and writable; the caller's guarantee.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    ok(r, ())?;
    if fd < 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the driver returned a new descriptor that nothing else owns;
    // the `OwnedFd` closes it once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemExportToShareableHandle` as a fabric handle (64 bytes).
///
/// # Safety
/// `handle` is live and was created requesting fabric handles.
pub(crate) unsafe fn mem_export_to_shareable_handle_fabric(handle: Handle) -> CuResult<[u8; 64]> {
    let mut fabric = sys::CUmemFabricHandle_st { data: [0; 64] };
    // SAFETY: for FABRIC the driver writes one `CUmemFabricHandle` (64 bytes)
    // through the pointer, which is valid and writable; the caller's guarantee.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fabric as *mut sys::CUmemFabricHandle_st).cast::<c_void>(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            0,
        )
    };
    ok(r, fabric.data)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor, borrowed for
/// the call (the driver does not take it).
pub(crate) fn mem_import_from_shareable_handle_fd(fd: BorrowedFd<'_>) -> CuResult<Handle> {
    let mut handle: Handle = 0;
    // A POSIX descriptor is passed by value, as the pointer's integer.
    let os_handle = fd.as_raw_fd() as isize as *mut c_void;
    // SAFETY: a valid out-pointer; `os_handle` is a live descriptor borrowed
    // for the call.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            os_handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    ok(r, handle)
}

/// `cuMemImportFromShareableHandle` of a fabric handle.
pub(crate) fn mem_import_from_shareable_handle_fabric(bytes: &[u8; 64]) -> CuResult<Handle> {
    let mut handle: Handle = 0;
    let mut fabric = sys::CUmemFabricHandle_st { data: *bytes };
    // SAFETY: a valid out-pointer; a pointer to the 64 readable bytes of a
    // fabric handle living across the call.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            (&mut fabric as *mut sys::CUmemFabricHandle_st).cast::<c_void>(),
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        )
    };
    ok(r, handle)
}

// ---- streams and events ----

/// `cuStreamCreate` of a non-blocking stream.
pub(crate) fn stream_create_non_blocking() -> CuResult<Stream> {
    let mut stream: Stream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let r = unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
        )
    };
    ok(r, stream)
}

/// `cuStreamDestroy`.
///
/// # Safety
/// `stream` was made by [`stream_create_non_blocking`] in the current
/// context, is destroyed once, and is not used afterwards.
pub(crate) unsafe fn stream_destroy(stream: Stream) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuStreamDestroy_v2(stream) }, ())
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// `stream` is live in the current context (or a special handle: null,
/// `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) for the call's length.
pub(crate) unsafe fn stream_synchronize(stream: Stream) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuStreamSynchronize(stream) }, ())
}

/// `cuStreamWaitEvent` (flags 0).
///
/// # Safety
/// As [`stream_synchronize`] for `stream`; `event` is a live event of the
/// current context.
pub(crate) unsafe fn stream_wait_event(stream: Stream, event: Event) -> CuResult<()> {
    // SAFETY: the caller's guarantee; flags must be 0.
    ok(unsafe { sys::cuStreamWaitEvent(stream, event, 0) }, ())
}

/// `cuStreamIsCapturing`: the capture status, or the failure
/// (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` among them).
///
/// # Safety
/// As [`stream_synchronize`].
pub(crate) unsafe fn stream_is_capturing(stream: Stream) -> CuResult<sys::CUstreamCaptureStatus> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a valid out-pointer, and the caller's guarantee.
    ok(
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        status,
    )
}

/// `cuEventCreate` of an event without timing.
pub(crate) fn event_create_disable_timing() -> CuResult<Event> {
    let mut event: Event = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let r = unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint,
        )
    };
    ok(r, event)
}

/// `cuEventRecord`.
///
/// # Safety
/// `event` is a live event of the current context that no other thread
/// records or destroys meanwhile; `stream` as in [`stream_synchronize`].
pub(crate) unsafe fn event_record(event: Event, stream: Stream) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuEventRecord(event, stream) }, ())
}

/// `cuEventQuery`: `Ok(true)` once complete, `Ok(false)` while
/// `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// `event` is a live event of the current context, not destroyed meanwhile.
pub(crate) unsafe fn event_query(event: Event) -> CuResult<bool> {
    // SAFETY: the caller's guarantee.
    match unsafe { sys::cuEventQuery(event) } {
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => ok(r, true),
    }
}

/// `cuEventDestroy`.
///
/// # Safety
/// `event` is a live event of the caller's, destroyed once and not used
/// afterwards (unless this fails).
pub(crate) unsafe fn event_destroy(event: Event) -> CuResult<()> {
    // SAFETY: the caller's guarantee.
    ok(unsafe { sys::cuEventDestroy_v2(event) }, ())
}

// ---- copies ----

/// `cuMemcpyHtoD` of `data` to `dst`.
///
/// # Safety
/// `dst..dst + data.len()` is mapped with access set for this device, and
/// stays mapped for the call's length.
pub(crate) unsafe fn memcpy_htod(dst: DevicePtr, data: &[u8]) -> CuResult<()> {
    // SAFETY: `data` is valid for `data.len()` reads; the caller's guarantee.
    ok(
        unsafe { sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast::<c_void>(), data.len()) },
        (),
    )
}

/// `cuMemcpyDtoH` of `out.len()` bytes from `src` into `out` (synchronous).
///
/// # Safety
/// As [`memcpy_htod`], for `src..src + out.len()`.
pub(crate) unsafe fn memcpy_dtoh(out: &mut [u8], src: DevicePtr) -> CuResult<()> {
    // SAFETY: `out` is valid for `out.len()` writes; the caller's guarantee.
    ok(
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast::<c_void>(), src, out.len()) },
        (),
    )
}
