//! The device side of the face: the double's driver functions in the
//! `libcuda.so.1` the process loads, and the runtime's `cudaFree(NULL)` in
//! its `libcudart.so.13` (the runtime face on the simulated GPU), looked up
//! once with `libloading`: never a copy of either linked in, so the face,
//! torch and Quilt share one driver state.
//!
//! A GEMM is queued on its stream as the double's opaque work
//! (`quiltDoubleLaunchOpaqueWork`): it keeps the stream busy until the
//! double runs it, a capture records it, and it computes nothing.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

use libloading::Library;

use crate::status::{Answer, EXECUTION_FAILED, INVALID_VALUE, NOT_INITIALIZED};

/// `CUcontext`, `CUstream`.
pub type Opaque = *mut c_void;
type CuResult = c_uint;

/// The functions the face calls.
struct Device {
    cu_ctx_get_current: unsafe extern "C" fn(*mut Opaque) -> CuResult,
    cu_ctx_get_device: unsafe extern "C" fn(*mut c_int) -> CuResult,
    cu_stream_get_ctx: unsafe extern "C" fn(Opaque, *mut Opaque) -> CuResult,
    cu_stream_synchronize: unsafe extern "C" fn(Opaque) -> CuResult,
    launch_opaque_work: unsafe extern "C" fn(Opaque) -> CuResult,
    cuda_free: unsafe extern "C" fn(*mut c_void) -> c_int,
    // The libraries stay loaded for the process.
    _driver: Library,
    _runtime: Library,
}

/// Loads `name` from `lib` as a function of type `T`.
///
/// # Safety
/// `T` is the function type the library's header declares for `name`.
unsafe fn symbol<T: Copy>(lib: &Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller's contract on `T`.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(name)))
}

impl Device {
    fn load() -> Result<Device, String> {
        // SAFETY: loading the double (or a driver) runs no code of its own
        // that the face depends on; the runtime face likewise.
        let driver = unsafe { Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        // SAFETY: as above.
        let runtime = unsafe { Library::new("libcudart.so.13") }.map_err(|e| e.to_string())?;
        // SAFETY: each type is the one cuda.h / cuda_runtime_api.h declares
        // (quiltDoubleLaunchOpaqueWork: the double's `CUresult (CUstream)`).
        unsafe {
            Ok(Device {
                cu_ctx_get_current: symbol(&driver, b"cuCtxGetCurrent\0")?,
                cu_ctx_get_device: symbol(&driver, b"cuCtxGetDevice\0")?,
                cu_stream_get_ctx: symbol(&driver, b"cuStreamGetCtx\0")?,
                cu_stream_synchronize: symbol(&driver, b"cuStreamSynchronize\0")?,
                launch_opaque_work: symbol(&driver, b"quiltDoubleLaunchOpaqueWork\0")?,
                cuda_free: symbol(&runtime, b"cudaFree\0")?,
                _driver: driver,
                _runtime: runtime,
            })
        }
    }
}

/// The loaded functions; `NOT_INITIALIZED` (and one line on standard
/// error) where `libcuda.so.1` is not the double or cannot be loaded.
fn get() -> Answer<&'static Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEVICE.get_or_init(|| {
        Device::load().inspect_err(|e| {
            eprintln!("quilt cuBLAS face: cannot load the simulated GPU's driver: {e}");
        })
    }) {
        Ok(d) => Ok(d),
        Err(_) => Err(NOT_INITIALIZED),
    }
}

/// The context a handle created now belongs to: the runtime's current
/// context, made current as `cudaFree(NULL)` does where none was, and its
/// device. `NOT_INITIALIZED` where there is none (as cuBLAS answers when
/// the CUDA runtime cannot initialise).
pub fn current_context() -> Answer<(usize, c_int)> {
    let d = get()?;
    // SAFETY: `cudaFree(NULL)` frees nothing; it initialises the runtime's
    // context for the calling thread.
    if unsafe { (d.cuda_free)(std::ptr::null_mut()) } != 0 {
        return Err(NOT_INITIALIZED);
    }
    let mut ctx: Opaque = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    if unsafe { (d.cu_ctx_get_current)(&mut ctx) } != 0 || ctx.is_null() {
        return Err(NOT_INITIALIZED);
    }
    let mut device = 0;
    // SAFETY: a valid out-pointer.
    if unsafe { (d.cu_ctx_get_device)(&mut device) } != 0 {
        return Err(NOT_INITIALIZED);
    }
    Ok((ctx as usize, device))
}

/// The context of `stream` (the current one for the legacy and per-thread
/// default streams); `INVALID_VALUE` for a handle the driver does not know.
pub fn stream_context(stream: Opaque) -> Answer<usize> {
    let d = get()?;
    let mut ctx: Opaque = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the double checks the handle.
    if unsafe { (d.cu_stream_get_ctx)(stream, &mut ctx) } != 0 {
        return Err(INVALID_VALUE);
    }
    Ok(ctx as usize)
}

/// Queues one kernel's worth of opaque work on `stream`.
pub fn enqueue(stream: Opaque) -> Answer<()> {
    let d = get()?;
    // SAFETY: the double checks the stream handle.
    match unsafe { (d.launch_opaque_work)(stream) } {
        0 => Ok(()),
        _ => Err(EXECUTION_FAILED),
    }
}

/// Waits for `stream`'s work, as cuBLAS does before it writes a result to
/// host memory.
pub fn synchronize(stream: Opaque) -> Answer<()> {
    let d = get()?;
    // SAFETY: the double checks the stream handle.
    match unsafe { (d.cu_stream_synchronize)(stream) } {
        0 => Ok(()),
        _ => Err(EXECUTION_FAILED),
    }
}
