//! The runtime's device, version, error and entry-point calls, and the
//! calls the face refuses (each answers `cudaErrorNotSupported` naming
//! itself: never a silent success).

#![allow(non_snake_case)] // the runtime's names
#![allow(missing_docs)] // each is the runtime function of the same name
#![allow(clippy::missing_safety_doc)] // the CUDA runtime reference's contract

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use crate::device::{self, RUNTIME_VERSION};
use crate::driver;
use crate::errors::{self, check, done, CudaError, INVALID_VALUE};
use crate::memory::out;
use crate::props::DeviceProp;

#[no_mangle]
pub unsafe extern "C" fn cudaGetDeviceCount(count: *mut c_int) -> CudaError {
    done((|| {
        let n = device::count()?;
        // SAFETY: the client's out-pointer.
        unsafe { out(count, n) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaSetDevice(device: c_int) -> CudaError {
    done(device::set(device))
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDevice(device: *mut c_int) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(device::current().and_then(|d| unsafe { out(device, d) }))
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetDeviceProperties(
    prop: *mut DeviceProp,
    device: c_int,
) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(device::properties(device).and_then(|p| unsafe { out(prop, p) }))
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceGetAttribute(
    value: *mut c_int,
    attr: c_int,
    device: c_int,
) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(device::attribute(attr, device).and_then(|v| unsafe { out(value, v) }))
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceGetPCIBusId(
    id: *mut c_char,
    len: c_int,
    device: c_int,
) -> CudaError {
    // SAFETY: the client gives `len` bytes at `id`.
    done(device::pci_bus_id(device).and_then(|t| unsafe { device::write_text(id, len, &t) }))
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceCanAccessPeer(
    can: *mut c_int,
    device: c_int,
    peer: c_int,
) -> CudaError {
    done((|| {
        let (dev, peer) = (device::valid(device)?, device::valid(peer)?);
        let d = driver::get().map_err(|e| e as CudaError)?;
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { (d.cuDeviceCanAccessPeer)(&mut v, dev, peer) })?;
        // SAFETY: the client's out-pointer.
        unsafe { out(can, v) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> CudaError {
    done(device::enable_peer(peer, flags))
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceDisablePeerAccess(peer: c_int) -> CudaError {
    done(device::disable_peer(peer))
}

#[no_mangle]
pub unsafe extern "C" fn cudaDriverGetVersion(version: *mut c_int) -> CudaError {
    done((|| {
        let d = driver::get().map_err(|e| e as CudaError)?;
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { (d.cuDriverGetVersion)(&mut v) })?;
        // SAFETY: the client's out-pointer.
        unsafe { out(version, v) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaRuntimeGetVersion(version: *mut c_int) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(unsafe { out(version, RUNTIME_VERSION) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetLastError() -> CudaError {
    errors::take_last()
}

#[no_mangle]
pub unsafe extern "C" fn cudaPeekAtLastError() -> CudaError {
    errors::peek_last()
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetErrorName(error: CudaError) -> *const c_char {
    errors::name(error)
}

#[no_mangle]
pub unsafe extern "C" fn cudaGetErrorString(error: CudaError) -> *const c_char {
    errors::text(error)
}

/// `cudaDriverEntryPointQueryResult`.
const ENTRY_POINT_FOUND: c_int = 0;
const ENTRY_POINT_NOT_FOUND: c_int = 1;

/// `cudaGetDriverEntryPointByVersion`: the double's function for `symbol`
/// as a client of CUDA `version` means it (how torch reaches `cuMemCreate`
/// and the other VMM calls of expandable segments). A name the double does
/// not export is "symbol not found", with a null pointer.
#[no_mangle]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    func: *mut *mut c_void,
    version: c_uint,
    _flags: u64,
    status: *mut c_int,
) -> CudaError {
    done((|| {
        if symbol.is_null() || func.is_null() {
            return Err(INVALID_VALUE);
        }
        driver::get().map_err(|e| e as CudaError)?;
        // SAFETY: the client's NUL-terminated name.
        let name = unsafe { CStr::from_ptr(symbol) };
        let found = device::entry_point(name, version);
        if found.is_none() && std::env::var_os("QUILT_CUDA_RUNTIME_TRACE").is_some() {
            eprintln!("quilt-cuda-runtime: driver entry point {name:?} (CUDA {version}): not in the double");
        }
        // SAFETY: checked non-null; `status` is optional.
        unsafe {
            func.write(found.unwrap_or(std::ptr::null_mut()));
            if !status.is_null() {
                status.write(if found.is_some() {
                    ENTRY_POINT_FOUND
                } else {
                    ENTRY_POINT_NOT_FOUND
                });
            }
        }
        Ok(())
    })())
}

/// Calls the face refuses: `cudaErrorNotSupported`, the call named on
/// stderr and in `cudaGetErrorString`'s text. Arguments are not read (a C
/// caller passes them and cleans them up itself).
macro_rules! refused {
    ($($name:ident),* $(,)?) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name() -> CudaError {
                errors::unimplemented(stringify!($name))
            }
        )*
    };
}

refused!(
    // Memory pools: the double's devices have none.
    cudaDeviceGetDefaultMemPool,
    cudaMemPoolGetAttribute,
    cudaMemPoolSetAccess,
    cudaMemPoolSetAttribute,
    cudaMemPoolTrimTo,
    cudaDeviceGetGraphMemAttribute,
    cudaDeviceSetGraphMemAttribute,
    // Graph editing, user objects, conditional nodes.
    cudaGraphAddNode,
    cudaGraphConditionalHandleCreate,
    cudaGraphNodeGetDependencies,
    cudaGraphRetainUserObject,
    cudaUserObjectCreate,
    cudaUserObjectRelease,
    cudaStreamBeginCaptureToGraph,
    cudaStreamUpdateCaptureDependencies,
    // Host memory registration, managed memory, IPC.
    cudaHostRegister,
    cudaHostUnregister,
    cudaMallocManaged,
    cudaIpcCloseMemHandle,
    cudaIpcGetEventHandle,
    cudaIpcGetMemHandle,
    cudaIpcOpenEventHandle,
    cudaIpcOpenMemHandle,
    // Host functions on streams (the double runs no host code on a stream).
    cudaLaunchHostFunc,
    cudaStreamAddCallback,
    // Device variables and run-time loaded libraries: no device code runs.
    cudaGetSymbolAddress,
    cudaMemcpyToSymbol,
    cudaLibraryGetGlobal,
    cudaLibraryGetKernel,
    cudaLibraryGetKernelCount,
    cudaLibraryGetManaged,
    cudaLibraryGetUnifiedFunction,
    cudaLibraryLoadData,
    cudaLibraryLoadFromFile,
    cudaLibraryUnload,
    // Profiling: nothing to profile.
    cudaProfilerStart,
    cudaProfilerStop,
);
