//! Streams, events, stream capture and graphs: the double's, handle for
//! handle (a `cudaStream_t` is the double's `CUstream`, a `cudaEvent_t` its
//! `CUevent`, a `cudaGraph_t` its `CUgraph`), so a stream torch makes is the
//! stream Quilt's CUDA backend is given. Stream priorities are kept here
//! (the double queues all streams alike).

#![allow(non_snake_case)] // the runtime's names
#![allow(missing_docs)] // each is the runtime function of the same name
#![allow(clippy::missing_safety_doc)] // the CUDA runtime reference's contract

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, PoisonError};

use crate::device::bind;
use crate::driver::{self, Opaque};
use crate::errors::{check, done, CudaError, Rt, INVALID_VALUE};
use crate::memory::out;

/// The greatest (numerically least) priority; 0 is the least.
const GREATEST_PRIORITY: c_int = -5;

static PRIORITIES: Mutex<Option<HashMap<usize, c_int>>> = Mutex::new(None);

fn drv() -> Rt<&'static driver::Driver> {
    driver::get().map_err(|e| e as CudaError)
}

/// Binds a context, then runs one driver call.
fn call(f: impl FnOnce(&driver::Driver) -> u32) -> CudaError {
    done((|| {
        bind()?;
        check(f(drv()?))
    })())
}

// --- Streams -----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreateWithPriority(
    stream: *mut Opaque,
    flags: c_uint,
    priority: c_int,
) -> CudaError {
    done((|| {
        bind()?;
        if stream.is_null() {
            return Err(INVALID_VALUE);
        }
        let priority = priority.clamp(GREATEST_PRIORITY, 0);
        let mut s: Opaque = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(unsafe { (drv()?.cuStreamCreateWithPriority)(&mut s, flags, priority) })?;
        PRIORITIES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .insert(s as usize, priority);
        // SAFETY: checked non-null.
        unsafe { out(stream, s) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreateWithFlags(
    stream: *mut Opaque,
    flags: c_uint,
) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaStreamCreateWithPriority(stream, flags, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamCreate(stream: *mut Opaque) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaStreamCreateWithPriority(stream, 0, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamDestroy(stream: Opaque) -> CudaError {
    let r = call(|d| {
        // SAFETY: the double checks the handle.
        unsafe { (d.cuStreamDestroy_v2)(stream) }
    });
    if r == 0 {
        if let Some(m) = PRIORITIES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            m.remove(&(stream as usize));
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamGetPriority(stream: Opaque, priority: *mut c_int) -> CudaError {
    done((|| {
        bind()?;
        let mut flags = 0;
        // SAFETY: checks the handle (the default streams included).
        check(unsafe { (drv()?.cuStreamGetFlags)(stream, &mut flags) })?;
        let p = PRIORITIES
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|m| m.get(&(stream as usize)).copied())
            .unwrap_or(0);
        // SAFETY: the client's out-pointer.
        unsafe { out(priority, p) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CudaError {
    // SAFETY: optional out-pointers, written where non-null.
    unsafe {
        if !least.is_null() {
            least.write(0);
        }
        if !greatest.is_null() {
            greatest.write(GREATEST_PRIORITY);
        }
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamQuery(stream: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuStreamQuery)(stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamSynchronize(stream: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuStreamSynchronize)(stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamWaitEvent(
    stream: Opaque,
    event: Opaque,
    flags: c_uint,
) -> CudaError {
    // SAFETY: the double checks the handles.
    call(|d| unsafe { (d.cuStreamWaitEvent)(stream, event, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaDeviceSynchronize() -> CudaError {
    // SAFETY: no pointers.
    call(|d| unsafe { (d.cuCtxSynchronize)() })
}

// --- Capture and graphs ------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cudaStreamBeginCapture(stream: Opaque, mode: c_int) -> CudaError {
    // SAFETY: the double checks the handle and mode.
    call(|d| unsafe { (d.cuStreamBeginCapture_v2)(stream, mode) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamEndCapture(stream: Opaque, graph: *mut Opaque) -> CudaError {
    // SAFETY: the client's out-pointer (checked by the double).
    call(|d| unsafe { (d.cuStreamEndCapture)(stream, graph) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamIsCapturing(stream: Opaque, status: *mut c_int) -> CudaError {
    // SAFETY: the client's out-pointer (checked by the double).
    call(|d| unsafe { (d.cuStreamIsCapturing)(stream, status) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaStreamGetCaptureInfo(
    stream: Opaque,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Opaque,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CudaError {
    // SAFETY: the client's pointers (optional ones checked by the double).
    call(|d| unsafe {
        (d.cuStreamGetCaptureInfo_v3)(stream, status, id, graph, deps, edges, count)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CudaError {
    // SAFETY: the client's in-out pointer (checked by the double).
    call(|d| unsafe { (d.cuThreadExchangeStreamCaptureMode)(mode) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphInstantiateWithFlags(
    exec: *mut Opaque,
    graph: Opaque,
    flags: u64,
) -> CudaError {
    // SAFETY: the client's out-pointer (checked by the double).
    call(|d| unsafe { (d.cuGraphInstantiateWithFlags)(exec, graph, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphInstantiate(
    exec: *mut Opaque,
    graph: Opaque,
    flags: u64,
) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaGraphInstantiateWithFlags(exec, graph, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphLaunch(exec: Opaque, stream: Opaque) -> CudaError {
    // SAFETY: the double checks the handles.
    call(|d| unsafe { (d.cuGraphLaunch)(exec, stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphExecDestroy(exec: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuGraphExecDestroy)(exec) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphDestroy(graph: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuGraphDestroy)(graph) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaGraphGetNodes(
    graph: Opaque,
    nodes: *mut Opaque,
    count: *mut usize,
) -> CudaError {
    // SAFETY: the client's pointers (checked by the double).
    call(|d| unsafe { (d.cuGraphGetNodes)(graph, nodes, count) })
}

// --- Events ------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cudaEventCreateWithFlags(event: *mut Opaque, flags: c_uint) -> CudaError {
    // SAFETY: the client's out-pointer (checked by the double).
    call(|d| unsafe { (d.cuEventCreate)(event, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventCreate(event: *mut Opaque) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaEventCreateWithFlags(event, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventRecord(event: Opaque, stream: Opaque) -> CudaError {
    // SAFETY: the double checks the handles.
    call(|d| unsafe { (d.cuEventRecord)(event, stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventRecordWithFlags(
    event: Opaque,
    stream: Opaque,
    flags: c_uint,
) -> CudaError {
    // SAFETY: the double checks the handles and flags.
    call(|d| unsafe { (d.cuEventRecordWithFlags)(event, stream, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventQuery(event: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuEventQuery)(event) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventSynchronize(event: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuEventSynchronize)(event) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventDestroy(event: Opaque) -> CudaError {
    // SAFETY: the double checks the handle.
    call(|d| unsafe { (d.cuEventDestroy_v2)(event) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaEventElapsedTime(
    ms: *mut f32,
    start: Opaque,
    end: Opaque,
) -> CudaError {
    // SAFETY: the client's out-pointer (checked by the double).
    call(|d| unsafe { (d.cuEventElapsedTime)(ms, start, end) })
}
