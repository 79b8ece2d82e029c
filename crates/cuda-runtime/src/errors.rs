//! `cudaError_t`: the runtime's error numbers and texts, the per-thread last
//! error, and the calls the face does not implement.
//!
//! The driver's `CUresult` numbers of every error the double returns are
//! the runtime's `cudaError_t` numbers for the same error (invalid value 1,
//! out of memory 2, not ready 600, illegal address 700, not supported 801,
//! the stream-capture errors 900 to 908, ...), so a driver error passes
//! through unchanged.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::{Mutex, PoisonError};

use crate::driver::CuResult;

/// `cudaError_t`.
pub type CudaError = c_int;

pub const SUCCESS: CudaError = 0;
pub const INVALID_VALUE: CudaError = 1;
pub const INVALID_CONFIGURATION: CudaError = 9;
pub const INVALID_DEVICE_FUNCTION: CudaError = 98;
pub const INVALID_DEVICE: CudaError = 101;
pub const PEER_ACCESS_UNSUPPORTED: CudaError = 217;
pub const NOT_READY: CudaError = 600;
pub const NOT_SUPPORTED: CudaError = 801;

/// A runtime call's result: `Err` holds the `cudaError_t`.
pub type Rt<T> = Result<T, CudaError>;

/// A driver call's result as a runtime result.
pub fn check(r: CuResult) -> Rt<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(r as CudaError)
    }
}

thread_local! {
    /// The calling thread's last error (`cudaGetLastError`).
    static LAST: Cell<CudaError> = const { Cell::new(SUCCESS) };
    /// The name of the last call this thread made that the face does not
    /// implement, for `cudaGetErrorString(cudaErrorNotSupported)`.
    static UNIMPLEMENTED: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Ends a runtime call: records a failure as the thread's last error (a
/// "not ready" answer is a status, not an error, as in CUDA) and returns
/// its number.
pub fn done(r: Rt<()>) -> CudaError {
    match r {
        Ok(()) => SUCCESS,
        Err(e) => {
            if e != NOT_READY {
                LAST.with(|l| l.set(e));
            }
            e
        }
    }
}

/// `cudaGetLastError`: the last error, reset.
pub fn take_last() -> CudaError {
    LAST.with(|l| l.replace(SUCCESS))
}

/// `cudaPeekAtLastError`.
pub fn peek_last() -> CudaError {
    LAST.with(Cell::get)
}

/// A call the face does not implement: `cudaErrorNotSupported`, the name
/// kept for the error's text, and a line on stderr (once per name).
pub fn unimplemented(name: &'static str) -> CudaError {
    static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    if !seen.contains(&name) {
        seen.push(name);
        eprintln!(
            "quilt-cuda-runtime: {name} is not implemented by the CUDA runtime face over the Quilt CUDA double: cudaErrorNotSupported"
        );
    }
    UNIMPLEMENTED.with(|u| u.set(Some(name)));
    done(Err(NOT_SUPPORTED))
}

/// Each error's `cudaError_t` name and text (CUDA 13's).
const ERRORS: &[(CudaError, &str, &str)] = &[
    (0, "cudaSuccess", "no error"),
    (1, "cudaErrorInvalidValue", "invalid argument"),
    (2, "cudaErrorMemoryAllocation", "out of memory"),
    (3, "cudaErrorInitializationError", "initialization error"),
    (4, "cudaErrorCudartUnloading", "driver shutting down"),
    (9, "cudaErrorInvalidConfiguration", "invalid configuration argument"),
    (
        35,
        "cudaErrorInsufficientDriver",
        "CUDA driver version is insufficient for CUDA runtime version (the face needs quilt-cuda-double as libcuda.so.1)",
    ),
    (98, "cudaErrorInvalidDeviceFunction", "invalid device function"),
    (100, "cudaErrorNoDevice", "no CUDA-capable device is detected"),
    (101, "cudaErrorInvalidDevice", "invalid device ordinal"),
    (201, "cudaErrorDeviceUninitialized", "invalid device context"),
    (
        217,
        "cudaErrorPeerAccessUnsupported",
        "peer access is not supported between these two devices",
    ),
    (400, "cudaErrorInvalidResourceHandle", "invalid resource handle"),
    (
        401,
        "cudaErrorIllegalState",
        "the operation cannot be performed in the present state",
    ),
    (500, "cudaErrorSymbolNotFound", "named symbol not found"),
    (600, "cudaErrorNotReady", "device not ready"),
    (
        700,
        "cudaErrorIllegalAddress",
        "an illegal memory access was encountered",
    ),
    (704, "cudaErrorPeerAccessAlreadyEnabled", "peer access is already enabled"),
    (705, "cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"),
    (800, "cudaErrorNotPermitted", "operation not permitted"),
    (801, "cudaErrorNotSupported", "operation not supported"),
    (
        900,
        "cudaErrorStreamCaptureUnsupported",
        "operation not permitted when stream is capturing",
    ),
    (
        901,
        "cudaErrorStreamCaptureInvalidated",
        "operation failed due to a previous error during capture",
    ),
    (
        903,
        "cudaErrorStreamCaptureUnmatched",
        "capture was not initiated in this stream",
    ),
    (
        905,
        "cudaErrorStreamCaptureIsolation",
        "dependency created on uncaptured work in another stream",
    ),
    (
        906,
        "cudaErrorStreamCaptureImplicit",
        "operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        907,
        "cudaErrorCapturedEvent",
        "operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        908,
        "cudaErrorStreamCaptureWrongThread",
        "attempt to terminate a thread-local capture sequence from another thread",
    ),
    (999, "cudaErrorUnknown", "unknown error"),
];

/// A static C string for `text` (one per distinct text, for the process).
fn c_static(text: String) -> *const c_char {
    static STRINGS: Mutex<Option<HashMap<String, &'static CStr>>> = Mutex::new(None);
    let mut map = STRINGS.lock().unwrap_or_else(PoisonError::into_inner);
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(s) = map.get(&text) {
        return s.as_ptr();
    }
    let c = CString::new(text.replace('\0', " ")).unwrap_or_default();
    let leaked: &'static CStr = Box::leak(c.into_boxed_c_str());
    map.insert(text, leaked);
    leaked.as_ptr()
}

/// `cudaGetErrorName`.
pub fn name(e: CudaError) -> *const c_char {
    match ERRORS.iter().find(|(c, _, _)| *c == e) {
        Some((_, n, _)) => c_static((*n).to_string()),
        None => c_static("cudaErrorUnknown".to_string()),
    }
}

/// `cudaGetErrorString`; for `cudaErrorNotSupported` after a call the face
/// does not implement, the text names that call.
pub fn text(e: CudaError) -> *const c_char {
    let base = ERRORS
        .iter()
        .find(|(c, _, _)| *c == e)
        .map_or("unrecognized error code", |(_, _, t)| *t);
    if e == NOT_SUPPORTED {
        if let Some(call) = UNIMPLEMENTED.with(Cell::get) {
            return c_static(format!(
                "{base}: {call} is not implemented by the CUDA runtime face over the Quilt CUDA double"
            ));
        }
    }
    c_static(base.to_string())
}
