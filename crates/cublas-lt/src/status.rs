//! `cublasStatus_t`: the numbers, names and strings of cuBLAS's statuses
//! (`cublas_api.h`), and the face's result type.

use std::ffi::{c_char, CStr};

/// `cublasStatus_t`.
pub type Status = u32;

/// `CUBLAS_STATUS_SUCCESS`.
pub const SUCCESS: Status = 0;
/// `CUBLAS_STATUS_NOT_INITIALIZED`: no live handle, or no driver.
pub const NOT_INITIALIZED: Status = 1;
/// `CUBLAS_STATUS_ALLOC_FAILED`.
pub const ALLOC_FAILED: Status = 3;
/// `CUBLAS_STATUS_INVALID_VALUE`: an argument cuBLAS's reference forbids.
pub const INVALID_VALUE: Status = 7;
/// `CUBLAS_STATUS_ARCH_MISMATCH`.
pub const ARCH_MISMATCH: Status = 8;
/// `CUBLAS_STATUS_MAPPING_ERROR`.
pub const MAPPING_ERROR: Status = 11;
/// `CUBLAS_STATUS_EXECUTION_FAILED`: the driver refused the work.
pub const EXECUTION_FAILED: Status = 13;
/// `CUBLAS_STATUS_INTERNAL_ERROR`.
pub const INTERNAL_ERROR: Status = 14;
/// `CUBLAS_STATUS_NOT_SUPPORTED`: a call or a value the face does not model.
pub const NOT_SUPPORTED: Status = 15;
/// `CUBLAS_STATUS_LICENSE_ERROR`.
pub const LICENSE_ERROR: Status = 16;

/// What a call of the face answers: `Ok` or the status to return.
pub type Answer<T> = Result<T, Status>;

/// The status a result ends in.
pub fn status(r: Answer<()>) -> Status {
    match r {
        Ok(()) => SUCCESS,
        Err(s) => s,
    }
}

/// `Ok` where `cond` holds, else `INVALID_VALUE`.
pub fn require(cond: bool) -> Answer<()> {
    if cond {
        Ok(())
    } else {
        Err(INVALID_VALUE)
    }
}

/// The name of a status (`cublasGetStatusName`), `NULL`-free.
pub fn name(s: Status) -> &'static CStr {
    match s {
        SUCCESS => c"CUBLAS_STATUS_SUCCESS",
        NOT_INITIALIZED => c"CUBLAS_STATUS_NOT_INITIALIZED",
        ALLOC_FAILED => c"CUBLAS_STATUS_ALLOC_FAILED",
        INVALID_VALUE => c"CUBLAS_STATUS_INVALID_VALUE",
        ARCH_MISMATCH => c"CUBLAS_STATUS_ARCH_MISMATCH",
        MAPPING_ERROR => c"CUBLAS_STATUS_MAPPING_ERROR",
        EXECUTION_FAILED => c"CUBLAS_STATUS_EXECUTION_FAILED",
        INTERNAL_ERROR => c"CUBLAS_STATUS_INTERNAL_ERROR",
        NOT_SUPPORTED => c"CUBLAS_STATUS_NOT_SUPPORTED",
        LICENSE_ERROR => c"CUBLAS_STATUS_LICENSE_ERROR",
        _ => c"CUBLAS_STATUS_UNKNOWN",
    }
}

/// The description of a status (`cublasGetStatusString`).
pub fn text(s: Status) -> &'static CStr {
    match s {
        SUCCESS => c"the operation completed successfully",
        NOT_INITIALIZED => c"the library was not initialized",
        ALLOC_FAILED => c"the resource allocation failed",
        INVALID_VALUE => c"an invalid numeric value was used as an argument",
        ARCH_MISMATCH => c"an absent device architectural feature is required",
        MAPPING_ERROR => c"an access to GPU memory space failed",
        EXECUTION_FAILED => c"the GPU program failed to execute",
        INTERNAL_ERROR => c"an internal operation failed",
        NOT_SUPPORTED => c"the functionality requested is not supported",
        LICENSE_ERROR => c"an error was detected when checking the current licensing",
        _ => c"unknown error",
    }
}

/// A status's name as a C string for the exports.
pub fn name_ptr(s: Status) -> *const c_char {
    name(s).as_ptr()
}

/// A status's description as a C string for the exports.
pub fn text_ptr(s: Status) -> *const c_char {
    text(s).as_ptr()
}

/// Writes `v` through the client's out-pointer; `INVALID_VALUE` for null.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub unsafe fn out<T>(p: *mut T, v: T) -> Answer<()> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null, and valid by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// Answers `NOT_SUPPORTED` for a call the face does not model, naming it on
/// standard error (as the runtime face does): never a silent success.
pub fn refuse(call: &str) -> Status {
    eprintln!("quilt cuBLAS face: {call} is not implemented on the simulated GPU");
    NOT_SUPPORTED
}
