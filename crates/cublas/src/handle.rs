//! cuBLAS handles and their settings: the stream, the workspace, the
//! pointer and math modes, the SM count target.
//!
//! A handle is made by the cuBLASLt face (`cublasLtCreate`), so it is also
//! a `cublasLtHandle_t` and belongs to the context current at its
//! creation; this face keeps each handle's settings. As cuBLAS does,
//! `cublasSetStream` resets the handle's workspace to the default (torch
//! sets its own workspace again after every `cublasSetStream`).

#![allow(non_snake_case)] // cuBLAS's names
#![allow(clippy::missing_safety_doc)] // cuBLAS's reference is the contract

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, PoisonError};

use crate::lt::{self, Status, NOT_INITIALIZED};
use crate::ops::{out, require, status, Answer, INVALID_VALUE};

/// `cublasHandle_t`.
pub type Handle = *mut c_void;

/// What cuBLAS keeps per handle.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// `cudaStream_t` (0: the legacy default stream).
    pub stream: usize,
    /// The user's workspace (`cublasSetWorkspace`), address and size.
    pub workspace: (usize, usize),
    /// `cublasPointerMode_t`: 0 host, 1 device.
    pub pointer_mode: c_int,
    /// `cublasMath_t`.
    pub math_mode: c_int,
    /// `cublasSetSmCountTarget` (0: the device's count).
    pub sm_count_target: c_int,
}

static SETTINGS: Mutex<Option<HashMap<usize, Settings>>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut HashMap<usize, Settings>) -> R) -> R {
    let mut guard = SETTINGS.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.get_or_insert_with(HashMap::new))
}

/// The settings of the live handle `h`; `NOT_INITIALIZED` for any other
/// pointer, as cuBLAS answers.
pub fn settings(h: Handle) -> Answer<Settings> {
    with(|m| m.get(&(h as usize)).copied()).ok_or(NOT_INITIALIZED)
}

fn update(h: Handle, f: impl FnOnce(&mut Settings)) -> Answer<()> {
    with(|m| m.get_mut(&(h as usize)).map(f)).ok_or(NOT_INITIALIZED)
}

fn create() -> Answer<Handle> {
    let lt = lt::get()?;
    let mut h: Handle = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let s = unsafe { (lt.create)(&mut h) };
    if s != 0 {
        return Err(s);
    }
    let fresh = Settings {
        stream: 0,
        workspace: (0, 0),
        pointer_mode: 0,
        math_mode: 0,
        sm_count_target: 0,
    };
    with(|m| m.insert(h as usize, fresh));
    Ok(h)
}

fn destroy(h: Handle) -> Answer<()> {
    with(|m| m.remove(&(h as usize))).ok_or(NOT_INITIALIZED)?;
    let lt = lt::get()?;
    // SAFETY: a handle the cuBLASLt face made.
    match unsafe { (lt.destroy)(h) } {
        0 => Ok(()),
        s => Err(s),
    }
}

/// Queues one operation of `h` on its stream.
pub fn enqueue(h: Handle) -> Answer<()> {
    let s = settings(h)?;
    let lt = lt::get()?;
    // SAFETY: the cuBLASLt face checks the handle and the stream.
    match unsafe { (lt.enqueue)(h, s.stream as *mut c_void) } {
        0 => Ok(()),
        e => Err(e),
    }
}

/// Waits for `h`'s stream (a result written to host memory).
pub fn synchronize(h: Handle) -> Answer<()> {
    let s = settings(h)?;
    let lt = lt::get()?;
    // SAFETY: the cuBLASLt face checks the handle and the stream.
    match unsafe { (lt.synchronize)(h, s.stream as *mut c_void) } {
        0 => Ok(()),
        e => Err(e),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut Handle) -> Status {
    if handle.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the client's out-pointer.
    status(create().and_then(|h| unsafe { out(handle, h) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasDestroy_v2(handle: Handle) -> Status {
    status(destroy(handle))
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetStream_v2(handle: Handle, stream: *mut c_void) -> Status {
    status(update(handle, |s| {
        s.stream = stream as usize;
        s.workspace = (0, 0);
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(handle: Handle, stream: *mut *mut c_void) -> Status {
    // SAFETY: the client's out-pointer.
    status(settings(handle).and_then(|s| unsafe { out(stream, s.stream as *mut c_void) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetWorkspace_v2(
    handle: Handle,
    workspace: *mut c_void,
    size: usize,
) -> Status {
    status((|| {
        settings(handle)?;
        // cuBLAS: the workspace is aligned to at least 256 bytes, and a
        // size needs an address.
        require((workspace as usize).is_multiple_of(256) && (size == 0 || !workspace.is_null()))?;
        update(handle, |s| s.workspace = (workspace as usize, size))
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetPointerMode_v2(handle: Handle, mode: c_int) -> Status {
    status(require(mode == 0 || mode == 1).and_then(|()| update(handle, |s| s.pointer_mode = mode)))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetPointerMode_v2(handle: Handle, mode: *mut c_int) -> Status {
    // SAFETY: the client's out-pointer.
    status(settings(handle).and_then(|s| unsafe { out(mode, s.pointer_mode) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetMathMode(handle: Handle, mode: c_int) -> Status {
    // CUBLAS_DEFAULT_MATH .. CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH (0-4, 8),
    // with CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (16).
    let base = mode & !16;
    let known = matches!(base, 0..=4 | 8) && mode & !(16 | 0xf) == 0;
    status(require(known).and_then(|()| update(handle, |s| s.math_mode = mode)))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetMathMode(handle: Handle, mode: *mut c_int) -> Status {
    // SAFETY: the client's out-pointer.
    status(settings(handle).and_then(|s| unsafe { out(mode, s.math_mode) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetSmCountTarget(handle: Handle, target: c_int) -> Status {
    status(require(target >= 0).and_then(|()| update(handle, |s| s.sm_count_target = target)))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetSmCountTarget(handle: Handle, target: *mut c_int) -> Status {
    // SAFETY: the client's out-pointer.
    status(settings(handle).and_then(|s| unsafe { out(target, s.sm_count_target) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(handle: Handle, version: *mut c_int) -> Status {
    // SAFETY: the client's out-pointer.
    status(settings(handle).and_then(|_| unsafe { out(version, 130_401) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStatusName(s: Status) -> *const c_char {
    match lt::get() {
        // SAFETY: the cuBLASLt face's function, any status.
        Ok(lt) => unsafe { (lt.status_name)(s) },
        Err(_) => c"CUBLAS_STATUS_NOT_INITIALIZED".as_ptr(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStatusString(s: Status) -> *const c_char {
    match lt::get() {
        // SAFETY: the cuBLASLt face's function, any status.
        Ok(lt) => unsafe { (lt.status_string)(s) },
        Err(_) => c"the library was not initialized".as_ptr(),
    }
}
