//! Device and pinned host memory, copies and memsets: each a call of the
//! double, so its rules hold (a copy's device range must be mapped with the
//! access it needs; work queued on a stream runs late; a copy into pageable
//! host memory waits for the stream).
//!
//! Copies between devices: `cudaMemcpy(Async)` of kind `Default` or
//! `DeviceToDevice` pass both pointers to the double, which reaches memory of
//! another device's `cudaMalloc` through that device (unified addressing:
//! no peer access needed); `cudaMemcpyPeer(Async)` name both devices, as
//! `cuMemcpyPeer(Async)` with their primary contexts, which reaches any
//! memory mapped for its own device (memory torch's expandable segments map
//! with `cuMemMap` included). Queued on the stream given, in its order.
//!
//! `cudaMallocAsync` and `cudaFreeAsync` have no memory pools to use (the
//! double's devices have none): they allocate like `cudaMalloc`, and free
//! like `cudaFree`, which first waits for all queued work (stream order
//! holds, more than kept).

#![allow(non_snake_case)] // the runtime's names
#![allow(missing_docs)] // each is the runtime function of the same name
#![allow(clippy::missing_safety_doc)] // the CUDA runtime reference's contract

use std::ffi::{c_int, c_uint, c_void};

use crate::device::{bind, primary_of};
use crate::driver::{self, CuDevicePtr, Opaque};
use crate::errors::{check, done, CudaError, Rt, INVALID_VALUE};

/// `cudaMemcpyKind`.
const HOST_TO_HOST: c_int = 0;
const HOST_TO_DEVICE: c_int = 1;
const DEVICE_TO_HOST: c_int = 2;
const DEVICE_TO_DEVICE: c_int = 3;
const DEFAULT: c_int = 4;

/// Writes `v` through the client's out-pointer.
///
/// # Safety
///
/// `p` is null or valid for a write of `T`.
pub unsafe fn out<T>(p: *mut T, v: T) -> Rt<()> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null; valid by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

fn drv() -> Rt<&'static driver::Driver> {
    driver::get().map_err(|e| e as CudaError)
}

#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(ptr: *mut *mut c_void, size: usize) -> CudaError {
    done((|| {
        bind()?;
        if size == 0 {
            // SAFETY: the client's out-pointer.
            return unsafe { out(ptr, std::ptr::null_mut()) };
        }
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let mut p: CuDevicePtr = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { (drv()?.cuMemAlloc_v2)(&mut p, size) })?;
        // SAFETY: checked non-null.
        unsafe { out(ptr, p as usize as *mut c_void) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> CudaError {
    done((|| {
        bind()?;
        if ptr.is_null() {
            return Ok(()); // cudaFree(0): initialises the context, frees nothing
        }
        // SAFETY: no pointers are dereferenced.
        check(unsafe { (drv()?.cuMemFree_v2)(ptr as usize as CuDevicePtr) })
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    ptr: *mut *mut c_void,
    size: usize,
    _stream: Opaque,
) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaMalloc(ptr, size) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync(ptr: *mut c_void, _stream: Opaque) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaFree(ptr) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaHostAlloc(
    ptr: *mut *mut c_void,
    size: usize,
    flags: c_uint,
) -> CudaError {
    done((|| {
        bind()?;
        if ptr.is_null() {
            return Err(INVALID_VALUE);
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(unsafe { (drv()?.cuMemHostAlloc)(&mut p, size, flags) })?;
        // SAFETY: checked non-null.
        unsafe { out(ptr, p) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaMallocHost(ptr: *mut *mut c_void, size: usize) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaHostAlloc(ptr, size, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaFreeHost(ptr: *mut c_void) -> CudaError {
    done((|| {
        bind()?;
        // SAFETY: the double only looks the pointer up.
        check(unsafe { (drv()?.cuMemFreeHost)(ptr) })
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> CudaError {
    done((|| {
        bind()?;
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        check(unsafe { (drv()?.cuMemGetInfo_v2)(&mut f, &mut t) })?;
        // SAFETY: the client's out-pointers.
        unsafe {
            out(free, f)?;
            out(total, t)
        }
    })())
}

/// `struct cudaPointerAttributes`.
#[repr(C)]
pub struct PointerAttributes {
    /// `cudaMemoryType`: 0 unregistered, 1 host, 2 device.
    pub kind: c_int,
    /// The device.
    pub device: c_int,
    /// The device address.
    pub device_pointer: *mut c_void,
    /// The host address.
    pub host_pointer: *mut c_void,
}

#[no_mangle]
pub unsafe extern "C" fn cudaPointerGetAttributes(
    attributes: *mut PointerAttributes,
    ptr: *const c_void,
) -> CudaError {
    done((|| {
        bind()?;
        let d = drv()?;
        let mut device: c_int = 0;
        // SAFETY: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9) writes an int: the
        // device whose memory is mapped at `ptr`, where any is.
        let r =
            unsafe { (d.cuPointerGetAttribute)((&mut device as *mut c_int).cast(), 9, ptr as u64) };
        let a = if r == 0 {
            PointerAttributes {
                kind: 2,
                device,
                device_pointer: ptr.cast_mut(),
                host_pointer: std::ptr::null_mut(),
            }
        } else {
            PointerAttributes {
                kind: 0,
                device: -2,
                device_pointer: std::ptr::null_mut(),
                host_pointer: ptr.cast_mut(),
            }
        };
        // SAFETY: the client's out-pointer.
        unsafe { out(attributes, a) }
    })())
}

/// Queues a copy of `len` bytes of `kind` on `stream`.
fn copy(dst: *mut c_void, src: *const c_void, len: usize, kind: c_int, stream: Opaque) -> Rt<()> {
    bind()?;
    if len == 0 {
        return Ok(());
    }
    let d = drv()?;
    let (dst_u, src_u) = (dst as usize as u64, src as usize as u64);
    // SAFETY (every arm): the client gives `len` bytes at each side (the
    // API's contract); the double checks device ranges against its maps.
    let r = unsafe {
        match kind {
            HOST_TO_DEVICE => (d.cuMemcpyHtoDAsync_v2)(dst_u, src, len, stream),
            DEVICE_TO_HOST => (d.cuMemcpyDtoHAsync_v2)(dst, src_u, len, stream),
            DEVICE_TO_DEVICE => (d.cuMemcpyDtoDAsync_v2)(dst_u, src_u, len, stream),
            HOST_TO_HOST | DEFAULT => (d.cuMemcpyAsync)(dst_u, src_u, len, stream),
            _ => return Err(INVALID_VALUE),
        }
    };
    check(r)
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
    kind: c_int,
    stream: Opaque,
) -> CudaError {
    done(copy(dst, src, len, kind, stream))
}

/// `cudaMemcpy`: on the legacy stream; waits for it unless both sides are
/// device memory (as the runtime reference says of its synchrony).
#[no_mangle]
pub unsafe extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    len: usize,
    kind: c_int,
) -> CudaError {
    done((|| {
        copy(dst, src, len, kind, std::ptr::null_mut())?;
        if kind != DEVICE_TO_DEVICE {
            // SAFETY: the legacy stream.
            check(unsafe { (drv()?.cuStreamSynchronize)(std::ptr::null_mut()) })?;
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyPeerAsync(
    dst: *mut c_void,
    dst_device: c_int,
    src: *const c_void,
    src_device: c_int,
    len: usize,
    stream: Opaque,
) -> CudaError {
    done((|| {
        bind()?;
        let (dst_ctx, src_ctx) = (primary_of(dst_device)?, primary_of(src_device)?);
        let (dst, src) = (dst as usize as u64, src as usize as u64);
        // SAFETY: the double checks both ranges against its maps.
        check(unsafe { (drv()?.cuMemcpyPeerAsync)(dst, dst_ctx, src, src_ctx, len, stream) })
    })())
}

/// `cudaMemcpyPeer`: serialised with the work of the current device and
/// both devices (the double returns once the bytes are there).
#[no_mangle]
pub unsafe extern "C" fn cudaMemcpyPeer(
    dst: *mut c_void,
    dst_device: c_int,
    src: *const c_void,
    src_device: c_int,
    len: usize,
) -> CudaError {
    done((|| {
        bind()?;
        let (dst_ctx, src_ctx) = (primary_of(dst_device)?, primary_of(src_device)?);
        let (dst, src) = (dst as usize as u64, src as usize as u64);
        // SAFETY: the double checks both ranges against its maps.
        check(unsafe { (drv()?.cuMemcpyPeer)(dst, dst_ctx, src, src_ctx, len) })
    })())
}

/// `cudaMemcpy2DAsync`: one copy per row.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // the runtime's signature
pub unsafe extern "C" fn cudaMemcpy2DAsync(
    dst: *mut c_void,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: Opaque,
) -> CudaError {
    done((|| {
        if width > dpitch || width > spitch {
            return Err(INVALID_VALUE);
        }
        for row in 0..height {
            let d = (dst as usize + row * dpitch) as *mut c_void;
            let s = (src as usize + row * spitch) as *const c_void;
            copy(d, s, width, kind, stream)?;
        }
        Ok(())
    })())
}

fn memset(ptr: *mut c_void, value: c_int, len: usize, stream: Opaque) -> Rt<()> {
    bind()?;
    // SAFETY: the double checks the range against its maps.
    check(unsafe { (drv()?.cuMemsetD8Async)(ptr as usize as u64, value as u8, len, stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemsetAsync(
    ptr: *mut c_void,
    value: c_int,
    len: usize,
    stream: Opaque,
) -> CudaError {
    done(memset(ptr, value, len, stream))
}

#[no_mangle]
pub unsafe extern "C" fn cudaMemset(ptr: *mut c_void, value: c_int, len: usize) -> CudaError {
    done(memset(ptr, value, len, std::ptr::null_mut()))
}
