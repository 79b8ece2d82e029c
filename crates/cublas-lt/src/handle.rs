//! Handles: `cublasLtCreate`, `cublasLtDestroy`, and the queueing of a
//! handle's work on a stream.
//!
//! A handle belongs to the context current when it was made (cuBLAS: "the
//! library context is tied to the current CUDA device"); work queued
//! through it on a stream of another context is refused with
//! `INVALID_VALUE`. The cuBLAS face (`libcublas.so.13`) makes its handles
//! here, so that a `cublasHandle_t` is also a `cublasLtHandle_t`, as
//! NVIDIA's libraries allow and torch relies on (it passes its cuBLAS
//! handle to `cublasLtMatmul`); it queues its work through
//! [`quiltCublasLtEnqueue`].

#![allow(non_snake_case)] // cuBLAS's names
#![allow(clippy::missing_safety_doc)] // cuBLAS's reference is the contract
#![allow(missing_docs)] // each is the cuBLASLt function of the same name

use std::ffi::c_void;

use crate::device::{self, Opaque};
use crate::registry::Registry;
use crate::status::{self, out, Answer, Status, INVALID_VALUE, NOT_INITIALIZED};

/// A live handle: its context and device.
#[derive(Debug, Clone, Copy)]
pub struct Handle {
    /// The `CUcontext` it belongs to.
    pub context: usize,
    /// That context's device.
    pub device: i32,
}

/// Live handles.
static HANDLES: Registry<Handle> = Registry::new();

/// The live handle at `handle`; `NOT_INITIALIZED` for any other pointer
/// (null, destroyed, never made), as cuBLAS answers.
pub fn lookup(handle: *const c_void) -> Answer<Handle> {
    HANDLES.get(handle, |h| *h).ok_or(NOT_INITIALIZED)
}

fn create() -> Answer<*mut c_void> {
    let (context, device) = device::current_context()?;
    Ok(HANDLES.insert(Handle { context, device }))
}

fn destroy(handle: *mut c_void) -> Answer<()> {
    HANDLES.remove(handle).map(|_| ()).ok_or(NOT_INITIALIZED)
}

/// Checks that `stream` belongs to `handle`'s context.
pub fn check_stream(handle: *const c_void, stream: Opaque) -> Answer<Handle> {
    let h = lookup(handle)?;
    if device::stream_context(stream)? != h.context {
        eprintln!(
            "quilt cuBLAS face: a handle of device {} used on a stream of another context",
            h.device
        );
        return Err(INVALID_VALUE);
    }
    Ok(h)
}

/// Queues one operation of `handle` on `stream`.
pub fn enqueue(handle: *const c_void, stream: Opaque) -> Answer<()> {
    check_stream(handle, stream)?;
    device::enqueue(stream)
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtCreate(handle: *mut *mut c_void) -> Status {
    if handle.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a non-null out-pointer (the API's contract).
    status::status(create().and_then(|h| unsafe { out(handle, h) }))
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtDestroy(handle: *mut c_void) -> Status {
    status::status(destroy(handle))
}

/// The face's own entry point for `libcublas.so.13`: checks `handle` and
/// `stream` as `cublasLtMatmul` does and
/// queues one operation's opaque work on `stream`.
#[no_mangle]
pub unsafe extern "C" fn quiltCublasLtEnqueue(handle: *const c_void, stream: Opaque) -> Status {
    status::status(enqueue(handle, stream))
}

/// The face's own entry point for `libcublas.so.13`: checks `handle` and
/// `stream` and waits for the stream's work (before a result is written to
/// host memory, as cuBLAS does in host pointer mode).
#[no_mangle]
pub unsafe extern "C" fn quiltCublasLtSynchronize(handle: *const c_void, stream: Opaque) -> Status {
    status::status(check_stream(handle, stream).and_then(|_| device::synchronize(stream)))
}
