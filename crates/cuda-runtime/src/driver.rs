//! The double's driver functions, looked up in the `libcuda.so.1` the
//! process loads (`dlopen`, `dlsym`): never a copy of the double linked in,
//! so the face, Quilt's CUDA backend (cudarc, which loads the same library)
//! and torch's own driver calls all share one driver state: the same
//! contexts, streams, events and addresses.

#![allow(non_snake_case)] // cuda.h's names

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// `CUresult`.
pub type CuResult = c_uint;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr`.
pub type CuDevicePtr = u64;
/// `CUcontext`, `CUstream`, `CUevent`, `CUgraph`, `CUgraphExec`.
pub type Opaque = *mut c_void;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *const c_char;
}

const RTLD_NOW: c_int = 2;

/// What a call answers where `libcuda.so.1` cannot be loaded or lacks a
/// function the face needs: no `CUresult` has this number, and as a
/// `cudaError_t` it is `cudaErrorInsufficientDriver`.
pub const NO_DRIVER: CuResult = 35;
const RTLD_GLOBAL: c_int = 0x100;

macro_rules! driver_api {
    ($($name:ident: fn($($arg:ty),* $(,)?);)*) => {
        /// The driver functions the face calls.
        pub struct Driver {
            /// The `dlopen` handle of `libcuda.so.1`.
            pub library: usize,
            $(
                #[allow(missing_docs)]
                pub $name: unsafe extern "C" fn($($arg),*) -> CuResult,
            )*
        }

        impl Driver {
            fn load(library: *mut c_void) -> Result<Driver, String> {
                Ok(Driver {
                    library: library as usize,
                    $(
                        $name: {
                            let p = symbol(library, concat!(stringify!($name), "\0"))?;
                            // SAFETY: the double exports `$name` with the
                            // signature cuda.h declares, written out above.
                            unsafe {
                                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CuResult>(p)
                            }
                        },
                    )*
                })
            }
        }
    };
}

driver_api! {
    cuInit: fn(c_uint);
    cuDriverGetVersion: fn(*mut c_int);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGet: fn(*mut CuDevice, c_int);
    cuDeviceGetName: fn(*mut c_char, c_int, CuDevice);
    cuDeviceTotalMem_v2: fn(*mut usize, CuDevice);
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CuDevice);
    cuDeviceGetUuid: fn(*mut [u8; 16], CuDevice);
    cuDeviceCanAccessPeer: fn(*mut c_int, CuDevice, CuDevice);
    cuDevicePrimaryCtxRetain: fn(*mut Opaque, CuDevice);
    cuCtxGetCurrent: fn(*mut Opaque);
    cuCtxSetCurrent: fn(Opaque);
    cuCtxGetDevice: fn(*mut CuDevice);
    cuCtxSynchronize: fn();
    cuCtxEnablePeerAccess: fn(Opaque, c_uint);
    cuCtxDisablePeerAccess: fn(Opaque);
    cuMemAlloc_v2: fn(*mut CuDevicePtr, usize);
    cuMemFree_v2: fn(CuDevicePtr);
    cuMemGetInfo_v2: fn(*mut usize, *mut usize);
    cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint);
    cuMemFreeHost: fn(*mut c_void);
    cuPointerGetAttribute: fn(*mut c_void, c_int, CuDevicePtr);
    cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, Opaque);
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, Opaque);
    cuMemcpyDtoDAsync_v2: fn(CuDevicePtr, CuDevicePtr, usize, Opaque);
    cuMemcpyAsync: fn(CuDevicePtr, CuDevicePtr, usize, Opaque);
    cuMemcpyPeerAsync: fn(CuDevicePtr, Opaque, CuDevicePtr, Opaque, usize, Opaque);
    cuMemcpyPeer: fn(CuDevicePtr, Opaque, CuDevicePtr, Opaque, usize);
    cuMemsetD8Async: fn(CuDevicePtr, u8, usize, Opaque);
    cuStreamCreateWithPriority: fn(*mut Opaque, c_uint, c_int);
    cuStreamDestroy_v2: fn(Opaque);
    cuStreamSynchronize: fn(Opaque);
    cuStreamQuery: fn(Opaque);
    cuStreamWaitEvent: fn(Opaque, Opaque, c_uint);
    cuStreamGetFlags: fn(Opaque, *mut c_uint);
    cuStreamBeginCapture_v2: fn(Opaque, c_int);
    cuStreamEndCapture: fn(Opaque, *mut Opaque);
    cuStreamIsCapturing: fn(Opaque, *mut c_int);
    cuStreamGetCaptureInfo_v3: fn(
        Opaque,
        *mut c_int,
        *mut u64,
        *mut Opaque,
        *mut *const c_void,
        *mut *const c_void,
        *mut usize,
    );
    cuThreadExchangeStreamCaptureMode: fn(*mut c_int);
    cuGraphInstantiateWithFlags: fn(*mut Opaque, Opaque, u64);
    cuGraphLaunch: fn(Opaque, Opaque);
    cuGraphExecDestroy: fn(Opaque);
    cuGraphDestroy: fn(Opaque);
    cuGraphGetNodes: fn(Opaque, *mut Opaque, *mut usize);
    cuEventCreate: fn(*mut Opaque, c_uint);
    cuEventRecord: fn(Opaque, Opaque);
    cuEventRecordWithFlags: fn(Opaque, Opaque, c_uint);
    cuEventQuery: fn(Opaque);
    cuEventSynchronize: fn(Opaque);
    cuEventDestroy_v2: fn(Opaque);
    cuEventElapsedTime: fn(*mut f32, Opaque, Opaque);
    quiltDoubleLaunchOpaqueWork: fn(Opaque);
}

/// `name` (NUL-terminated) in `library`, or why it is not there.
fn symbol(library: *mut c_void, name: &str) -> Result<*mut c_void, String> {
    // SAFETY: a `dlopen` handle and a NUL-terminated name.
    let p = unsafe { dlsym(library, name.as_ptr().cast()) };
    if p.is_null() {
        return Err(format!(
            "libcuda.so.1 has no {} (the face needs quilt-cuda-double as libcuda.so.1)",
            name.trim_end_matches('\0')
        ));
    }
    Ok(p)
}

/// Any symbol of the loaded `libcuda.so.1` (for driver entry points).
pub fn lookup(name: &CStr) -> Option<*mut c_void> {
    let d = get().ok()?;
    // SAFETY: a `dlopen` handle and a NUL-terminated name.
    let p = unsafe { dlsym(d.library as *mut c_void, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The driver, loaded and initialised (`cuInit`) on the first call; the
/// error says why it cannot be (printed once on stderr).
pub fn get() -> Result<&'static Driver, CuResult> {
    static DRIVER: OnceLock<Result<Driver, (String, CuResult)>> = OnceLock::new();
    let loaded = DRIVER.get_or_init(|| {
        // SAFETY: a NUL-terminated name; loading the double runs no code of
        // its own at load time.
        let lib = unsafe { dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
        if lib.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message after a
            // failed dlopen.
            let why = unsafe { CStr::from_ptr(dlerror()) }.to_string_lossy();
            let text = format!("dlopen libcuda.so.1: {why}");
            eprintln!("quilt-cuda-runtime: {text}");
            return Err((text, NO_DRIVER));
        }
        let driver = Driver::load(lib).map_err(|e| {
            eprintln!("quilt-cuda-runtime: {e}");
            (e, NO_DRIVER)
        })?;
        // SAFETY: no pointers.
        let r = unsafe { (driver.cuInit)(0) };
        if r != 0 {
            return Err((format!("cuInit failed with {r}"), r));
        }
        Ok(driver)
    });
    match loaded {
        Ok(d) => Ok(d),
        Err((_, code)) => Err(*code),
    }
}
