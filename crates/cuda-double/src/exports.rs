//! The exported driver functions, under cuda.h's names (and the `_v2`
//! names the header maps them to): each checks its pointers, takes the
//! driver's lock, calls the driver state and writes its results. An output
//! pointer that is null is `CUDA_ERROR_INVALID_VALUE` before anything
//! changes. Each function's contract is the CUDA driver reference's.

#![allow(non_snake_case)] // cuda.h's names
#![allow(missing_docs)] // each is the driver function of the same name
#![allow(clippy::missing_safety_doc)] // the safety contract is the CUDA driver reference's

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::os::fd::{BorrowedFd, IntoRawFd};

use crate::abi::*;
use crate::counters::count;
use crate::state::{self, with_driver, Call, Driver};
use crate::work::Op;

fn code(r: Call<()>) -> CuResult {
    match r {
        Ok(()) => CUDA_SUCCESS,
        Err(e) => e,
    }
}

/// `CUDA_ERROR_INVALID_VALUE` for a null pointer.
fn need<T>(p: *const T) -> Call<()> {
    if p.is_null() {
        Err(CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok(())
    }
}

/// Writes `v` through a pointer checked non-null with [`need`].
///
/// # Safety
///
/// `p` is valid for a write of `T` (the API's contract with the client).
unsafe fn put<T>(p: *mut T, v: T) {
    // SAFETY: the caller's contract; checked non-null before.
    unsafe { p.write(v) }
}

/// Runs `f` on the driver and writes its value through `out`: the shape of
/// every call that answers through one out-pointer. A null `out` is
/// `CUDA_ERROR_INVALID_VALUE` before `f` runs, so a refused call changes
/// nothing.
///
/// # Safety
///
/// `out` is null or valid for a write of `T`.
unsafe fn answer<T>(out: *mut T, f: impl FnOnce(&mut Driver) -> Call<T>) -> CuResult {
    code(with_driver(|d| {
        need(out)?;
        let v = f(d)?;
        // SAFETY: checked non-null; valid by the caller's contract.
        unsafe { put(out, v) };
        Ok(())
    }))
}

// --- Initialisation, version, errors -------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CuResult {
    count!("cuInit");
    code(state::init(flags))
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    count!("cuDriverGetVersion");
    code(need(version).map(|()| {
        // SAFETY: checked non-null; the client's out-pointer.
        unsafe { put(version, state::driver_version()) }
    }))
}

/// The static name or text of `error`.
fn error_text(error: CuResult, name: bool, out: *mut *const c_char) -> CuResult {
    let found = ERRORS.iter().find(|(c, _, _)| *c == error);
    let text: &'static [u8] = match found {
        Some((_, n, t)) => {
            let s = if name { *n } else { *t };
            // Leaked once per distinct string: static C strings for the client.
            leak_c(s)
        }
        None => {
            if !out.is_null() {
                // SAFETY: non-null out-pointer of the client.
                unsafe { put(out, std::ptr::null()) };
            }
            return CUDA_ERROR_INVALID_VALUE;
        }
    };
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer of the client; the string is static.
    unsafe { put(out, text.as_ptr().cast()) };
    CUDA_SUCCESS
}

/// A NUL-terminated copy of `s` that lives for the process (one per string).
fn leak_c(s: &'static str) -> &'static [u8] {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    static STRINGS: Mutex<BTreeMap<&'static str, &'static [u8]>> = Mutex::new(BTreeMap::new());
    let mut m = STRINGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    m.entry(s).or_insert_with(|| {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        Box::leak(v.into_boxed_slice())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CuResult, out: *mut *const c_char) -> CuResult {
    count!("cuGetErrorName");
    error_text(error, true, out)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CuResult, out: *mut *const c_char) -> CuResult {
    count!("cuGetErrorString");
    error_text(error, false, out)
}

// --- Devices ---------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    count!("cuDeviceGetCount");
    let compute = |d: &mut Driver| Ok(d.rules.devices);
    // SAFETY: `count` is the client's out-pointer (the API's contract).
    unsafe { answer(count, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CuDevice, ordinal: c_int) -> CuResult {
    count!("cuDeviceGet");
    let compute = |d: &mut Driver| {
        let dev = d.device(ordinal)?;
        Ok(dev)
    };
    // SAFETY: `device` is the client's out-pointer (the API's contract).
    unsafe { answer(device, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(
    name: *mut c_char,
    len: c_int,
    device: CuDevice,
) -> CuResult {
    count!("cuDeviceGetName");
    code(with_driver(|d| {
        need(name)?;
        d.device(device)?;
        if len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("Quilt CUDA double {device}");
        let n = text.len().min(len as usize - 1);
        // SAFETY: the client gave `len` writable bytes at `name`; we write
        // `n + 1 <= len` of them.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            put(name.add(n), 0);
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CuDevice) -> CuResult {
    count!("cuDeviceTotalMem_v2");
    let compute = |d: &mut Driver| {
        d.device(device)?;
        Ok(d.rules.memory as usize)
    };
    // SAFETY: `bytes` is the client's out-pointer (the API's contract).
    unsafe { answer(bytes, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut usize, device: CuDevice) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuDeviceTotalMem_v2(bytes, device) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: CuDevice,
) -> CuResult {
    count!("cuDeviceGetAttribute");
    let compute = |d: &mut Driver| {
        d.device(device)?;
        if !(1..ATTR_MAX).contains(&attribute) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let v = match attribute {
            ATTR_MAX_THREADS_PER_BLOCK => 1024,
            ATTR_WARP_SIZE => 32,
            ATTR_MULTIPROCESSOR_COUNT => 132,
            ATTR_UNIFIED_ADDRESSING => 1,
            ATTR_COMPUTE_CAPABILITY_MAJOR => 9,
            ATTR_COMPUTE_CAPABILITY_MINOR => 0,
            ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => 1,
            ATTR_HANDLE_TYPE_POSIX_FD_SUPPORTED => c_int::from(d.rules.posix_fd),
            ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED => c_int::from(d.rules.rdma),
            ATTR_MEMORY_POOLS_SUPPORTED | ATTR_HANDLE_TYPE_FABRIC_SUPPORTED => 0,
            _ => 0,
        };
        Ok(v)
    };
    // SAFETY: `value` is the client's out-pointer (the API's contract).
    unsafe { answer(value, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut Uuid, device: CuDevice) -> CuResult {
    count!("cuDeviceGetUuid");
    let compute = |d: &mut Driver| {
        d.device(device)?;
        let mut bytes = *b"quilt-double-dev";
        bytes[15] = b'0' + device as u8;
        Ok(Uuid { bytes })
    };
    // SAFETY: `uuid` is the client's out-pointer (the API's contract).
    unsafe { answer(uuid, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut Uuid, device: CuDevice) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuDeviceGetUuid(uuid, device) }
}

// --- Contexts --------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Opaque, device: CuDevice) -> CuResult {
    count!("cuDevicePrimaryCtxRetain");
    let compute = |d: &mut Driver| {
        let c = d.primary_retain(device)?;
        Ok(c as usize as Opaque)
    };
    // SAFETY: `ctx` is the client's out-pointer (the API's contract).
    unsafe { answer(ctx, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(device: CuDevice) -> CuResult {
    count!("cuDevicePrimaryCtxRelease_v2");
    code(with_driver(|d| d.primary_release(device)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(device: CuDevice) -> CuResult {
    count!("cuDevicePrimaryCtxRelease");
    code(with_driver(|d| d.primary_release(device)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(device: CuDevice) -> CuResult {
    count!("cuDevicePrimaryCtxReset_v2");
    code(with_driver(|d| d.primary_reset(device)))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    device: CuDevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CuResult {
    count!("cuDevicePrimaryCtxGetState");
    code(with_driver(|d| {
        need(flags)?;
        need(active)?;
        d.device(device)?;
        let p = &d.primary[device as usize];
        // SAFETY: both checked non-null.
        unsafe {
            put(flags, p.flags);
            put(active, c_int::from(p.context.is_some()));
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(
    device: CuDevice,
    flags: c_uint,
) -> CuResult {
    count!("cuDevicePrimaryCtxSetFlags_v2");
    code(with_driver(|d| {
        d.device(device)?;
        d.primary[device as usize].flags = flags;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    ctx: *mut Opaque,
    _flags: c_uint,
    device: CuDevice,
) -> CuResult {
    count!("cuCtxCreate_v2");
    let compute = |d: &mut Driver| {
        let c = d.create_context(device)?;
        Ok(c as usize as Opaque)
    };
    // SAFETY: `ctx` is the client's out-pointer (the API's contract).
    unsafe { answer(ctx, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: Opaque) -> CuResult {
    count!("cuCtxDestroy_v2");
    code(with_driver(|d| {
        d.destroy_created_context(ctx as usize as u64)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Opaque) -> CuResult {
    count!("cuCtxGetCurrent");
    let compute = |_: &mut Driver| {
        let c = state::current().unwrap_or(0);
        Ok(c as usize as Opaque)
    };
    // SAFETY: `ctx` is the client's out-pointer (the API's contract).
    unsafe { answer(ctx, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Opaque) -> CuResult {
    count!("cuCtxSetCurrent");
    code(with_driver(|d| {
        let c = ctx as usize as u64;
        if c != 0 && !d.contexts.contains_key(&c) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        state::set_current((c != 0).then_some(c));
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Opaque) -> CuResult {
    count!("cuCtxPushCurrent_v2");
    code(with_driver(|d| {
        let c = ctx as usize as u64;
        if !d.contexts.contains_key(&c) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        state::push(c);
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Opaque) -> CuResult {
    count!("cuCtxPopCurrent_v2");
    code(with_driver(|_| {
        let c = state::pop().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !ctx.is_null() {
            // SAFETY: non-null out-pointer (optional in the API).
            unsafe { put(ctx, c as usize as Opaque) };
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CuDevice) -> CuResult {
    count!("cuCtxGetDevice");
    let compute = |d: &mut Driver| {
        let dev = d.context_device()?;
        Ok(dev)
    };
    // SAFETY: `device` is the client's out-pointer (the API's contract).
    unsafe { answer(device, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: Opaque, version: *mut c_uint) -> CuResult {
    count!("cuCtxGetApiVersion");
    let compute = |d: &mut Driver| {
        let c = ctx as usize as u64;
        if c == 0 {
            d.context()?;
        } else if !d.contexts.contains_key(&c) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        Ok(12080)
    };
    // SAFETY: `version` is the client's out-pointer (the API's contract).
    unsafe { answer(version, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CuResult {
    count!("cuCtxSynchronize");
    code(with_driver(|d| d.synchronize_context()))
}

// --- Virtual memory management --------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const MemAllocationProp,
    option: c_int,
) -> CuResult {
    count!("cuMemGetAllocationGranularity");
    let compute = |d: &mut Driver| {
        // SAFETY: a client's pointer to a CUmemAllocationProp, or null.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let g = d.allocation_granularity(prop, option)?;
        Ok(g as usize)
    };
    // SAFETY: `granularity` is the client's out-pointer (the API's contract).
    unsafe { answer(granularity, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CuDevicePtr,
    size: usize,
    alignment: usize,
    _addr: CuDevicePtr,
    flags: u64,
) -> CuResult {
    count!("cuMemAddressReserve");
    let compute = |d: &mut Driver| {
        let p = d.reserve(size as u64, alignment as u64, flags)?;
        Ok(p)
    };
    // SAFETY: `ptr` is the client's out-pointer (the API's contract).
    unsafe { answer(ptr, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CuDevicePtr, size: usize) -> CuResult {
    count!("cuMemAddressFree");
    code(with_driver(|d| d.address_free(ptr, size as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CuMemHandle,
    size: usize,
    prop: *const MemAllocationProp,
    flags: u64,
) -> CuResult {
    count!("cuMemCreate");
    let compute = |d: &mut Driver| {
        // SAFETY: a client's pointer to a CUmemAllocationProp, or null.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let h = d.create(size as u64, prop, flags)?;
        Ok(h)
    };
    // SAFETY: `handle` is the client's out-pointer (the API's contract).
    unsafe { answer(handle, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CuMemHandle) -> CuResult {
    count!("cuMemRelease");
    code(with_driver(|d| d.release(handle)))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: CuMemHandle,
    flags: u64,
) -> CuResult {
    count!("cuMemMap");
    code(with_driver(|d| {
        d.map(ptr, size as u64, offset as u64, handle, flags)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CuDevicePtr, size: usize) -> CuResult {
    count!("cuMemUnmap");
    code(with_driver(|d| d.unmap(ptr, size as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CuDevicePtr,
    size: usize,
    desc: *const MemAccessDesc,
    count: usize,
) -> CuResult {
    count!("cuMemSetAccess");
    code(with_driver(|d| {
        need(desc)?;
        if count == 0 || count > 64 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the client gives `count` descriptors at `desc` (non-null).
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        d.set_access(ptr, size as u64, descs)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAccess(
    flags: *mut u64,
    location: *const MemLocation,
    ptr: CuDevicePtr,
) -> CuResult {
    count!("cuMemGetAccess");
    let compute = |d: &mut Driver| {
        // SAFETY: a client's pointer to a CUmemLocation, or null.
        let location = unsafe { location.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if location.type_ != LOCATION_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let f = d.get_access(location.id, ptr)?;
        Ok(f as u64)
    };
    // SAFETY: `flags` is the client's out-pointer (the API's contract).
    unsafe { answer(flags, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: CuMemHandle,
    kind: c_int,
    flags: u64,
) -> CuResult {
    count!("cuMemExportToShareableHandle");
    code(with_driver(|d| {
        need(shareable)?;
        let file = d.export(handle, kind, flags)?;
        // SAFETY: for a POSIX descriptor the client passes an `int *`.
        unsafe { put(shareable.cast::<c_int>(), file.into_raw_fd()) };
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CuMemHandle,
    os_handle: *mut c_void,
    kind: c_int,
) -> CuResult {
    count!("cuMemImportFromShareableHandle");
    let compute = |d: &mut Driver| {
        if kind != HANDLE_TYPE_POSIX_FD {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let device = d.context_device()?;
        let fd = c_int::try_from(os_handle as usize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if fd < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the client passes an open descriptor it keeps owning; we
        // only borrow it for the duplicate below.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let file = borrowed
            .try_clone_to_owned()
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let h = d.import(file, device)?;
        Ok(h)
    };
    // SAFETY: `handle` is the client's out-pointer (the API's contract).
    unsafe { answer(handle, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CuMemHandle,
    addr: *mut c_void,
) -> CuResult {
    count!("cuMemRetainAllocationHandle");
    let compute = |d: &mut Driver| {
        let h = d.retain_handle(addr as usize as u64)?;
        Ok(h)
    };
    // SAFETY: `handle` is the client's out-pointer (the API's contract).
    unsafe { answer(handle, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut MemAllocationProp,
    handle: CuMemHandle,
) -> CuResult {
    count!("cuMemGetAllocationPropertiesFromHandle");
    let compute = |d: &mut Driver| {
        let p = d.handle_prop(handle)?;
        Ok(p)
    };
    // SAFETY: `prop` is the client's out-pointer (the API's contract).
    unsafe { answer(prop, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CuDevicePtr,
    size: *mut usize,
    ptr: CuDevicePtr,
) -> CuResult {
    count!("cuMemGetAddressRange_v2");
    code(with_driver(|d| {
        let (b, s) = d.address_range(ptr)?;
        // SAFETY: each optional out-pointer is written only where non-null.
        unsafe {
            if !base.is_null() {
                put(base, b);
            }
            if !size.is_null() {
                put(size, s as usize);
            }
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    count!("cuMemGetInfo_v2");
    code(with_driver(|d| {
        need(free)?;
        need(total)?;
        let (f, t) = d.mem_info()?;
        // SAFETY: both checked non-null.
        unsafe {
            put(free, f as usize);
            put(total, t as usize);
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CuDevicePtr, bytes: usize) -> CuResult {
    count!("cuMemAlloc_v2");
    let compute = |d: &mut Driver| {
        let p = d.mem_alloc(bytes as u64)?;
        Ok(p)
    };
    // SAFETY: `ptr` is the client's out-pointer (the API's contract).
    unsafe { answer(ptr, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(ptr: CuDevicePtr) -> CuResult {
    count!("cuMemFree_v2");
    code(with_driver(|d| d.mem_free(ptr)))
}

/// Stream-ordered allocation needs memory pools, which the double's devices
/// do not have (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` is 0).
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    _ptr: *mut CuDevicePtr,
    _bytes: usize,
    _stream: Opaque,
) -> CuResult {
    count!("cuMemAllocAsync");
    CUDA_ERROR_NOT_SUPPORTED
}

/// See [`cuMemAllocAsync`].
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(_ptr: CuDevicePtr, _stream: Opaque) -> CuResult {
    count!("cuMemFreeAsync");
    CUDA_ERROR_NOT_SUPPORTED
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    ptr: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CuResult {
    count!("cuMemHostAlloc");
    let compute = |d: &mut Driver| {
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut buf = vec![0u8; bytes];
        let p = buf.as_mut_ptr();
        d.host.insert(p as usize as u64, buf);
        Ok(p.cast())
    };
    // SAFETY: `ptr` is the client's out-pointer (the API's contract).
    unsafe { answer(ptr, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(ptr: *mut *mut c_void, bytes: usize) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemHostAlloc(ptr, bytes, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CuResult {
    count!("cuMemFreeHost");
    code(with_driver(|d| {
        // Work still queued on the buffer runs first (its memory goes away).
        d.run_all();
        d.host
            .remove(&(ptr as usize as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }))
}

// --- Copies and fills ------------------------------------------------------

/// Queues a copy of `len` bytes from host memory `src` to device `dst` on
/// `stream`: from pageable memory the bytes are staged now, from pinned
/// memory they are read when the copy runs.
fn queue_to_device(stream: u64, dst: u64, src: *const c_void, len: usize) -> Call<()> {
    with_driver(|d| {
        if len == 0 {
            return Ok(());
        }
        need(src)?;
        let s = d.stream(stream)?;
        let device = d.reach(s, dst, len as u64, ACCESS_READWRITE)?;
        let src = src as usize as u64;
        let op = if d.is_pinned(src, len as u64) {
            Op::Copy {
                dst,
                dst_device: Some(device),
                src,
                src_device: None,
                len: len as u64,
            }
        } else {
            // SAFETY: the client gives `len` readable bytes at `src`.
            let bytes = unsafe { crate::os::read(src, len as u64) };
            Op::Write { dst, device, bytes }
        };
        d.enqueue(s, op).map(|_| ())
    })
}

/// A copy of `len` bytes from device `src` to host `dst` on `stream`: into
/// pageable memory it runs before the call returns (after the stream's
/// earlier work), into pinned memory it is queued.
fn copy_to_host(stream: u64, dst: *mut c_void, src: u64, len: usize) -> Call<()> {
    with_driver(|d| {
        if len == 0 {
            return Ok(());
        }
        need(dst)?;
        let s = d.stream(stream)?;
        let device = d.reach(s, src, len as u64, ACCESS_READ)?;
        let dst = dst as usize as u64;
        let pinned = d.is_pinned(dst, len as u64);
        let op = Op::Copy {
            dst,
            dst_device: None,
            src,
            src_device: Some(device),
            len: len as u64,
        };
        let seq = d.enqueue(s, op)?;
        if !pinned {
            d.synchronize_up_to(s, seq)?;
        }
        Ok(())
    })
}

/// Queues a device-to-device copy on `stream`, between devices too
/// (`peer.rs` says which memory it reaches).
fn queue_device_copy(stream: u64, dst: u64, src: u64, len: usize) -> Call<()> {
    with_driver(|d| {
        if len == 0 {
            return Ok(());
        }
        let s = d.stream(stream)?;
        let dst_device = d.reach(s, dst, len as u64, ACCESS_READWRITE)?;
        let src_device = d.reach(s, src, len as u64, ACCESS_READ)?;
        let op = Op::Copy {
            dst,
            dst_device: Some(dst_device),
            src,
            src_device: Some(src_device),
            len: len as u64,
        };
        d.enqueue(s, op).map(|_| ())
    })
}

/// Queues a fill of `count` elements of `pattern` at `dst` on `stream`.
fn queue_fill(stream: u64, dst: u64, pattern: Vec<u8>, count: usize) -> Call<()> {
    with_driver(|d| {
        let len = (count as u64)
            .checked_mul(pattern.len() as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !dst.is_multiple_of(pattern.len() as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if len == 0 {
            return Ok(());
        }
        let s = d.stream(stream)?;
        d.check_device_range(dst, len, d.stream_device(s), ACCESS_READWRITE)?;
        d.enqueue(s, Op::Fill { dst, pattern, len }).map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CuDevicePtr,
    src: *const c_void,
    len: usize,
) -> CuResult {
    count!("cuMemcpyHtoD_v2");
    code(queue_to_device(0, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CuDevicePtr,
    src: *const c_void,
    len: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemcpyHtoDAsync_v2");
    code(queue_to_device(stream as usize as u64, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CuDevicePtr,
    len: usize,
) -> CuResult {
    count!("cuMemcpyDtoH_v2");
    code(copy_to_host(0, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemcpyDtoHAsync_v2");
    code(copy_to_host(stream as usize as u64, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
) -> CuResult {
    count!("cuMemcpyDtoD_v2");
    code(queue_device_copy(0, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemcpyDtoDAsync_v2");
    code(queue_device_copy(stream as usize as u64, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CuDevicePtr, value: u8, count: usize) -> CuResult {
    count!("cuMemsetD8_v2");
    code(queue_fill(0, dst, vec![value], count))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: CuDevicePtr,
    value: u8,
    count: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemsetD8Async");
    code(queue_fill(stream as usize as u64, dst, vec![value], count))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: CuDevicePtr, value: c_uint, count: usize) -> CuResult {
    count!("cuMemsetD32_v2");
    code(queue_fill(0, dst, value.to_ne_bytes().to_vec(), count))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: CuDevicePtr,
    value: c_uint,
    count: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemsetD32Async");
    code(queue_fill(
        stream as usize as u64,
        dst,
        value.to_ne_bytes().to_vec(),
        count,
    ))
}

/// `cuStreamWriteValue32`: a queued 4-byte write of `value` at `addr`
/// (flags: default or `CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`, 1).
#[no_mangle]
pub unsafe extern "C" fn cuStreamWriteValue32(
    stream: Opaque,
    addr: CuDevicePtr,
    value: c_uint,
    flags: c_uint,
) -> CuResult {
    count!("cuStreamWriteValue32");
    if flags & !1 != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    code(queue_fill(
        stream as usize as u64,
        addr,
        value.to_ne_bytes().to_vec(),
        1,
    ))
}

/// `cuStreamWriteValue32_v2` (what `cuStreamWriteValue32` means from CUDA 11.7 headers).
#[no_mangle]
pub unsafe extern "C" fn cuStreamWriteValue32_v2(
    stream: Opaque,
    addr: CuDevicePtr,
    value: c_uint,
    flags: c_uint,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamWriteValue32(stream, addr, value, flags) }
}

// --- Streams ---------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Opaque, flags: c_uint) -> CuResult {
    count!("cuStreamCreate");
    let compute = |d: &mut Driver| {
        let s = d.create_stream(flags)?;
        Ok(s as usize as Opaque)
    };
    // SAFETY: `stream` is the client's out-pointer (the API's contract).
    unsafe { answer(stream, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Opaque,
    flags: c_uint,
    _priority: c_int,
) -> CuResult {
    // SAFETY: the same contract (priorities are accepted and ignored).
    unsafe { cuStreamCreate(stream, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: Opaque) -> CuResult {
    count!("cuStreamDestroy_v2");
    code(with_driver(|d| d.destroy_stream(stream as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: Opaque) -> CuResult {
    count!("cuStreamSynchronize");
    code(with_driver(|d| {
        d.synchronize_stream(stream as usize as u64)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: Opaque) -> CuResult {
    count!("cuStreamQuery");
    code(with_driver(|d| d.query_stream(stream as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: Opaque,
    event: Opaque,
    flags: c_uint,
) -> CuResult {
    count!("cuStreamWaitEvent");
    code(with_driver(|d| {
        d.wait_event(stream as usize as u64, event as usize as u64, flags)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetFlags(stream: Opaque, flags: *mut c_uint) -> CuResult {
    count!("cuStreamGetFlags");
    let compute = |d: &mut Driver| {
        let (f, _) = d.stream_info(stream as usize as u64)?;
        Ok(f)
    };
    // SAFETY: `flags` is the client's out-pointer (the API's contract).
    unsafe { answer(flags, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(stream: Opaque, ctx: *mut Opaque) -> CuResult {
    count!("cuStreamGetCtx");
    let compute = |d: &mut Driver| {
        let (_, c) = d.stream_info(stream as usize as u64)?;
        Ok(c as usize as Opaque)
    };
    // SAFETY: `ctx` is the client's out-pointer (the API's contract).
    unsafe { answer(ctx, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: Opaque, mode: c_int) -> CuResult {
    count!("cuStreamBeginCapture_v2");
    code(with_driver(|d| {
        d.begin_capture(stream as usize as u64, mode)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Opaque, graph: *mut Opaque) -> CuResult {
    count!("cuStreamEndCapture");
    code(with_driver(|d| {
        need(graph)?;
        let result = d.end_capture(stream as usize as u64);
        let g = *result.as_ref().unwrap_or(&0);
        // SAFETY: checked non-null; null graph where the capture failed.
        unsafe { put(graph, g as usize as Opaque) };
        result.map(|_| ())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: Opaque, status: *mut c_int) -> CuResult {
    count!("cuStreamIsCapturing");
    let compute = |d: &mut Driver| {
        let (s, _) = d.capture_status(stream as usize as u64)?;
        Ok(s)
    };
    // SAFETY: `status` is the client's out-pointer (the API's contract).
    unsafe { answer(status, compute) }
}

/// The three capture-info calls: status and id (graph and dependencies
/// where asked: the double's graphs have no inspectable nodes).
fn capture_info(
    stream: Opaque,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Opaque,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CuResult {
    code(with_driver(|d| {
        need(status)?;
        let (s, i) = d.capture_status(stream as usize as u64)?;
        // SAFETY: `status` checked non-null; the others are optional and
        // written only where non-null.
        unsafe {
            put(status, s);
            if !id.is_null() {
                put(id, i);
            }
            if !graph.is_null() {
                put(graph, std::ptr::null_mut());
            }
            if !deps.is_null() {
                put(deps, std::ptr::null());
            }
            if !edges.is_null() {
                put(edges, std::ptr::null());
            }
            if !count.is_null() {
                put(count, 0);
            }
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    stream: Opaque,
    status: *mut c_int,
    id: *mut u64,
) -> CuResult {
    count!("cuStreamGetCaptureInfo");
    let null = std::ptr::null_mut();
    capture_info(
        stream,
        status,
        id,
        null,
        null.cast(),
        null.cast(),
        null.cast(),
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    stream: Opaque,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Opaque,
    deps: *mut *const c_void,
    count: *mut usize,
) -> CuResult {
    count!("cuStreamGetCaptureInfo_v2");
    capture_info(stream, status, id, graph, deps, std::ptr::null_mut(), count)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(
    stream: Opaque,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Opaque,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CuResult {
    count!("cuStreamGetCaptureInfo_v3");
    capture_info(stream, status, id, graph, deps, edges, count)
}

#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CuResult {
    count!("cuThreadExchangeStreamCaptureMode");
    code(with_driver(|_| {
        need(mode)?;
        // SAFETY: checked non-null; the client's in-out pointer.
        let asked = unsafe { *mode };
        if !matches!(
            asked,
            CAPTURE_MODE_GLOBAL | CAPTURE_MODE_THREAD_LOCAL | CAPTURE_MODE_RELAXED
        ) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = state::exchange_capture_mode(asked);
        // SAFETY: as above.
        unsafe { put(mode, old) };
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(graph: Opaque) -> CuResult {
    count!("cuGraphDestroy");
    code(with_driver(|d| {
        d.graphs
            .remove(&(graph as usize as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }))
}

/// `cuGraphInstantiateWithFlags` (what `cuGraphInstantiate` means from
/// CUDA 12 headers): an executable copy of the graph's recorded copies,
/// fills and kernels. `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH` (1)
/// and `CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY` (8) are accepted
/// (the double's graphs allocate nothing and have no priorities); others are
/// refused.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut Opaque,
    graph: Opaque,
    flags: u64,
) -> CuResult {
    count!("cuGraphInstantiateWithFlags");
    let compute = |d: &mut Driver| {
        // Auto-free on launch (1) and node priorities (8) change nothing
        // here; upload (2) and device launch (4) are not modelled.
        if flags & !(1 | 8) != 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let e = d.instantiate(graph as usize as u64)?;
        Ok(e as usize as Opaque)
    };
    // SAFETY: `exec` is the client's out-pointer (the API's contract).
    unsafe { answer(exec, compute) }
}

/// `cuGraphLaunch`: the graph's work queued on the stream, in the order it
/// was captured.
#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(exec: Opaque, stream: Opaque) -> CuResult {
    count!("cuGraphLaunch");
    code(with_driver(|d| {
        d.launch_graph(exec as usize as u64, stream as usize as u64)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(exec: Opaque, stream: Opaque) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuGraphLaunch(exec, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: Opaque) -> CuResult {
    count!("cuGraphExecDestroy");
    code(with_driver(|d| {
        d.execs
            .remove(&(exec as usize as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }))
}

/// `cuGraphGetNodes`: the number of recorded pieces of work. The double's
/// nodes have no handles to inspect, so asking for them (non-null `nodes`)
/// is `CUDA_ERROR_NOT_SUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(
    graph: Opaque,
    nodes: *mut Opaque,
    count: *mut usize,
) -> CuResult {
    count!("cuGraphGetNodes");
    let compute = |d: &mut Driver| {
        if !nodes.is_null() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        d.graph_nodes(graph as usize as u64)
    };
    // SAFETY: `count` is the client's out-pointer (the API's contract).
    unsafe { answer(count, compute) }
}

/// Not a driver call: how the CUDA runtime face (`quilt-cuda-runtime`)
/// queues a kernel launch. The double cannot run kernels, so the launch is
/// queued as work of unknown memory footprint that computes nothing: it
/// keeps the stream busy until it runs (by the double's ordinary rules),
/// and inside a capture it is recorded into the graph like other work.
#[no_mangle]
pub unsafe extern "C" fn quiltDoubleLaunchOpaqueWork(stream: Opaque) -> CuResult {
    count!("quiltDoubleLaunchOpaqueWork");
    code(with_driver(|d| {
        let s = d.stream(stream as usize as u64)?;
        d.enqueue(s, Op::Kernel).map(|_| ())
    }))
}

/// Not a driver call: the driver calls counted so far, as text, a line
/// `NAME COUNT` per entry point (see `counters.rs`). Like `snprintf`: writes
/// at most `length - 1` bytes of the text and a NUL into `buffer` (nothing
/// where it is null or `length` is 0) and returns the text's whole length,
/// so a caller whose buffer was short calls again with a larger one. Works
/// before `cuInit`; not counted itself.
#[no_mangle]
pub unsafe extern "C" fn quiltDoubleCounts(buffer: *mut c_char, length: usize) -> usize {
    let text = crate::counters::text();
    if !buffer.is_null() && length > 0 {
        let n = text.len().min(length - 1);
        // SAFETY: the caller gave `length` writable bytes at `buffer`; we
        // write `n + 1 <= length` of them.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buffer, n);
            put(buffer.add(n), 0);
        }
    }
    text.len()
}

// --- Events ----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut Opaque, flags: c_uint) -> CuResult {
    count!("cuEventCreate");
    let compute = |d: &mut Driver| {
        let e = d.create_event(flags)?;
        Ok(e as usize as Opaque)
    };
    // SAFETY: `event` is the client's out-pointer (the API's contract).
    unsafe { answer(event, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: Opaque, stream: Opaque) -> CuResult {
    count!("cuEventRecord");
    code(with_driver(|d| {
        d.record_event(event as usize as u64, stream as usize as u64)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    event: Opaque,
    stream: Opaque,
    flags: c_uint,
) -> CuResult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the same contract.
    unsafe { cuEventRecord(event, stream) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: Opaque) -> CuResult {
    count!("cuEventQuery");
    code(with_driver(|d| d.query_event(event as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(event: Opaque) -> CuResult {
    count!("cuEventSynchronize");
    code(with_driver(|d| d.synchronize_event(event as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: Opaque) -> CuResult {
    count!("cuEventDestroy_v2");
    code(with_driver(|d| d.destroy_event(event as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Opaque, end: Opaque) -> CuResult {
    count!("cuEventElapsedTime");
    let compute = |d: &mut Driver| {
        let t = d.elapsed(start as usize as u64, end as usize as u64)?;
        Ok(t)
    };
    // SAFETY: `ms` is the client's out-pointer (the API's contract).
    unsafe { answer(ms, compute) }
}

// --- Kernels: not modelled --------------------------------------------------

/// Kernels cannot run on the double: module loading and launches answer
/// `CUDA_ERROR_NOT_SUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(_module: *mut Opaque, _image: *const c_void) -> CuResult {
    count!("cuModuleLoadData");
    CUDA_ERROR_NOT_SUPPORTED
}

/// See [`cuModuleLoadData`].
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoad(_module: *mut Opaque, _path: *const c_char) -> CuResult {
    count!("cuModuleLoad");
    CUDA_ERROR_NOT_SUPPORTED
}

/// See [`cuModuleLoadData`].
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    _f: *mut Opaque,
    _module: Opaque,
    _name: *const c_char,
) -> CuResult {
    count!("cuModuleGetFunction");
    CUDA_ERROR_NOT_SUPPORTED
}

/// See [`cuModuleLoadData`].
#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(_module: Opaque) -> CuResult {
    count!("cuModuleUnload");
    CUDA_ERROR_NOT_SUPPORTED
}

/// See [`cuModuleLoadData`].
#[no_mangle]
#[allow(clippy::too_many_arguments)] // cuda.h's signature
pub unsafe extern "C" fn cuLaunchKernel(
    _f: Opaque,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _stream: Opaque,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    count!("cuLaunchKernel");
    CUDA_ERROR_NOT_SUPPORTED
}

/// Host functions on streams are not modelled.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    _stream: Opaque,
    _f: *const c_void,
    _data: *mut c_void,
) -> CuResult {
    count!("cuLaunchHostFunc");
    CUDA_ERROR_NOT_SUPPORTED
}

// --- Newer header mappings and less common calls ---------------------------

/// `cuCtxCreate_v3` (CUDA 11.4 to 12.4 headers): execution-affinity
/// parameters are accepted and ignored.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    ctx: *mut Opaque,
    _params: *mut c_void,
    _count: c_int,
    flags: c_uint,
    device: CuDevice,
) -> CuResult {
    // SAFETY: the same contract as cuCtxCreate_v2.
    unsafe { cuCtxCreate_v2(ctx, flags, device) }
}

/// `cuCtxCreate_v4` (what `cuCtxCreate` means from CUDA 12.5/13 headers):
/// the creation parameters are accepted and ignored.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    ctx: *mut Opaque,
    _params: *mut c_void,
    flags: c_uint,
    device: CuDevice,
) -> CuResult {
    // SAFETY: the same contract as cuCtxCreate_v2.
    unsafe { cuCtxCreate_v2(ctx, flags, device) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceComputeCapability(
    major: *mut c_int,
    minor: *mut c_int,
    device: CuDevice,
) -> CuResult {
    count!("cuDeviceComputeCapability");
    code(with_driver(|d| {
        need(major)?;
        need(minor)?;
        d.device(device)?;
        // SAFETY: both checked non-null.
        unsafe {
            put(major, 9);
            put(minor, 0);
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    can: *mut c_int,
    device: CuDevice,
    peer: CuDevice,
) -> CuResult {
    count!("cuDeviceCanAccessPeer");
    let compute = |d: &mut Driver| {
        d.device(device)?;
        d.device(peer)?;
        Ok(c_int::from(device != peer))
    };
    // SAFETY: `can` is the client's out-pointer (the API's contract).
    unsafe { answer(can, compute) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16_v2(dst: CuDevicePtr, value: u16, count: usize) -> CuResult {
    count!("cuMemsetD16_v2");
    code(queue_fill(0, dst, value.to_ne_bytes().to_vec(), count))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16Async(
    dst: CuDevicePtr,
    value: u16,
    count: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemsetD16Async");
    code(queue_fill(
        stream as usize as u64,
        dst,
        value.to_ne_bytes().to_vec(),
        count,
    ))
}

/// A copy with unified addressing: each side is device memory where the
/// double has a mapping at its first byte, else host memory.
fn unified_copy(stream: u64, dst: u64, src: u64, len: usize) -> Call<()> {
    let (dst_device, src_device) = with_driver(|d| Ok((d.is_device(dst), d.is_device(src))))?;
    match (dst_device, src_device) {
        (true, true) => queue_device_copy(stream, dst, src, len),
        (true, false) => queue_to_device(stream, dst, src as usize as *const c_void, len),
        (false, true) => copy_to_host(stream, dst as usize as *mut c_void, src, len),
        (false, false) => with_driver(|d| {
            let s = d.stream(stream)?;
            let seq = d.enqueue(s, Op::Marker)?;
            d.synchronize_up_to(s, seq)?;
            // SAFETY: both are host buffers the client gives for `len` bytes.
            unsafe { crate::os::copy(dst, src, len as u64) };
            Ok(())
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpy(dst: CuDevicePtr, src: CuDevicePtr, len: usize) -> CuResult {
    count!("cuMemcpy");
    code(unified_copy(0, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemcpyAsync");
    code(unified_copy(stream as usize as u64, dst, src, len))
}

/// `CUpointer_attribute` values answered: context, memory type, device
/// pointer, device ordinal, range start and size.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: CuDevicePtr,
) -> CuResult {
    count!("cuPointerGetAttribute");
    code(with_driver(|d| {
        need(data)?;
        let (start, size) = d.address_range(ptr).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let ctx = d.context()?;
        let device = d.memory.device_at(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: checked non-null; each attribute's documented type.
        unsafe {
            match attribute {
                1 => put(data.cast::<Opaque>(), ctx as usize as Opaque),
                2 => put(data.cast::<c_uint>(), 2), // CU_MEMORYTYPE_DEVICE
                3 => put(data.cast::<CuDevicePtr>(), ptr),
                9 => put(data.cast::<c_int>(), device),
                11 => put(data.cast::<CuDevicePtr>(), start),
                12 => put(data.cast::<usize>(), size as usize),
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        Ok(())
    }))
}

// --- Per-thread default-stream variants -------------------------------------
//
// A client compiled with `CUDA_API_PER_THREAD_DEFAULT_STREAM` (nvcc's
// `--default-stream per-thread`) calls these names, in which the null stream
// means the calling thread's per-thread stream (`_ptsz`), and the
// synchronous calls run on that stream (`_ptds`).

/// The stream a `_ptsz` call means: null is the per-thread stream.
fn per_thread(stream: Opaque) -> Opaque {
    if stream.is_null() {
        STREAM_PER_THREAD as usize as Opaque
    } else {
        stream
    }
}

/// The per-thread stream, as `_ptds` calls use it.
fn per_thread_stream() -> Opaque {
    STREAM_PER_THREAD as usize as Opaque
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2_ptsz(
    dst: CuDevicePtr,
    src: *const c_void,
    len: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemcpyHtoDAsync_v2(dst, src, len, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2_ptsz(
    dst: *mut c_void,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemcpyDtoHAsync_v2(dst, src, len, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemcpyDtoDAsync_v2(dst, src, len, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync_ptsz(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemcpyAsync(dst, src, len, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async_ptsz(
    dst: CuDevicePtr,
    value: u8,
    count: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemsetD8Async(dst, value, count, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16Async_ptsz(
    dst: CuDevicePtr,
    value: u16,
    count: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemsetD16Async(dst, value, count, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async_ptsz(
    dst: CuDevicePtr,
    value: c_uint,
    count: usize,
    stream: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuMemsetD32Async(dst, value, count, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize_ptsz(stream: Opaque) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamSynchronize(per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery_ptsz(stream: Opaque) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamQuery(per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent_ptsz(
    stream: Opaque,
    event: Opaque,
    flags: c_uint,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamWaitEvent(per_thread(stream), event, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord_ptsz(event: Opaque, stream: Opaque) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuEventRecord(event, per_thread(stream)) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Opaque, mode: c_int) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamBeginCapture_v2(per_thread(stream), mode) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: Opaque, graph: *mut Opaque) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamEndCapture(per_thread(stream), graph) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(stream: Opaque, status: *mut c_int) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuStreamIsCapturing(per_thread(stream), status) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(
    dst: CuDevicePtr,
    src: *const c_void,
    len: usize,
) -> CuResult {
    count!("cuMemcpyHtoD_v2_ptds");
    code(queue_to_device(STREAM_PER_THREAD, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(
    dst: *mut c_void,
    src: CuDevicePtr,
    len: usize,
) -> CuResult {
    count!("cuMemcpyDtoH_v2_ptds");
    code(copy_to_host(STREAM_PER_THREAD, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2_ptds(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    len: usize,
) -> CuResult {
    count!("cuMemcpyDtoD_v2_ptds");
    code(queue_device_copy(STREAM_PER_THREAD, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpy_ptds(dst: CuDevicePtr, src: CuDevicePtr, len: usize) -> CuResult {
    count!("cuMemcpy_ptds");
    code(unified_copy(STREAM_PER_THREAD, dst, src, len))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2_ptds(dst: CuDevicePtr, value: u8, count: usize) -> CuResult {
    // SAFETY: the same contract, on the per-thread stream.
    unsafe { cuMemsetD8Async(dst, value, count, per_thread_stream()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2_ptds(
    dst: CuDevicePtr,
    value: c_uint,
    count: usize,
) -> CuResult {
    // SAFETY: the same contract, on the per-thread stream.
    unsafe { cuMemsetD32Async(dst, value, count, per_thread_stream()) }
}

// --- Names that CUDA 12.8 and 13 headers map to -----------------------------

/// `cuEventElapsedTime_v2` (CUDA 12.8+).
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Opaque,
    end: Opaque,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuEventElapsedTime(ms, start, end) }
}

/// `cuCtxSynchronize_v2(ctx)` (CUDA 13): synchronises `ctx` (null: the
/// current context).
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize_v2(ctx: Opaque) -> CuResult {
    count!("cuCtxSynchronize_v2");
    if !ctx.is_null() && state::current() != Some(ctx as usize as u64) {
        state::push(ctx as usize as u64);
        let r = code(with_driver(|d| {
            d.live_context(ctx as usize as u64)?;
            d.synchronize_context()
        }));
        state::pop();
        return r;
    }
    code(with_driver(|d| d.synchronize_context()))
}

/// `cuCtxGetDevice_v2(device, ctx)` (CUDA 13): the device of `ctx` (null:
/// the current context).
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice_v2(device: *mut CuDevice, ctx: Opaque) -> CuResult {
    count!("cuCtxGetDevice_v2");
    let compute = |d: &mut Driver| {
        let c = if ctx.is_null() {
            d.context()?
        } else {
            d.live_context(ctx as usize as u64)?
        };
        let dev = d
            .contexts
            .get(&c)
            .map(|c| c.device)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok(dev)
    };
    // SAFETY: `device` is the client's out-pointer (the API's contract).
    unsafe { answer(device, compute) }
}

/// `cuStreamGetCtx_v2(stream, ctx, green)` (CUDA 12.5+): no green contexts.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx_v2(
    stream: Opaque,
    ctx: *mut Opaque,
    green: *mut Opaque,
) -> CuResult {
    if !green.is_null() {
        // SAFETY: non-null out-pointer of the client.
        unsafe { put(green, std::ptr::null_mut()) };
    }
    // SAFETY: the same contract.
    unsafe { cuStreamGetCtx(stream, ctx) }
}
