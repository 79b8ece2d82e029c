//! The C types and numbers of CUDA's `cuda.h` (CUDA 12) that the double's
//! exports take and return. Enumerations arrive as plain integers (a value
//! a client passes need not be one the double knows), structures are
//! `#[repr(C)]` copies of the header's.

#![allow(missing_docs)] // the names are cuda.h's; the header documents them

use std::ffi::{c_int, c_uint, c_void};

/// `CUresult`.
pub type CuResult = c_uint;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CuResult = 201;
pub const CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: CuResult = 217;
pub const CUDA_ERROR_INVALID_HANDLE: CuResult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CuResult = 401;
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CuResult = 700;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CuResult = 704;
pub const CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: CuResult = 705;
pub const CUDA_ERROR_NOT_PERMITTED: CuResult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CuResult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CuResult = 903;
pub const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: CuResult = 905;
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CuResult = 906;
pub const CUDA_ERROR_CAPTURED_EVENT: CuResult = 907;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CuResult = 908;
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// Every code the double can return, with cuda.h's name and the driver's text.
pub const ERRORS: &[(CuResult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS", "no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
        "initialization error",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
        "no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE",
        "invalid device ordinal",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT",
        "invalid device context",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        "peer access is not supported across the given devices",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        "invalid resource handle",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        "CUDA_ERROR_ILLEGAL_STATE",
        "the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND",
        "named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        "CUDA_ERROR_NOT_READY",
        "device not ready",
    ),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        "peer access is already enabled",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        "peer access has not been enabled",
    ),
    (
        CUDA_ERROR_NOT_PERMITTED,
        "CUDA_ERROR_NOT_PERMITTED",
        "operation not permitted",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "operation not permitted when stream is capturing",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        "operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        "capture was not initiated in this stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        "dependency created on uncaptured work in another stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        "operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        "CUDA_ERROR_CAPTURED_EVENT",
        "operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        "attempt to terminate a thread-local capture sequence from another thread",
    ),
    (CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

pub type CuDevice = c_int;
pub type CuDevicePtr = u64;
pub type CuMemHandle = u64;
/// `CUcontext`, `CUstream`, `CUevent`, `CUgraph`: opaque pointers whose
/// values the double makes up and never dereferences.
pub type Opaque = *mut c_void;

/// `CU_STREAM_LEGACY`.
pub const STREAM_LEGACY: u64 = 0x1;
/// `CU_STREAM_PER_THREAD`.
pub const STREAM_PER_THREAD: u64 = 0x2;
/// `CU_STREAM_NON_BLOCKING`.
pub const STREAM_NON_BLOCKING: c_uint = 0x1;

/// `CUevent_flags`: default, blocking sync, disable timing, interprocess.
pub const EVENT_FLAGS_ALL: c_uint = 0x1 | 0x2 | 0x4;

/// `CUstreamCaptureMode`.
pub const CAPTURE_MODE_GLOBAL: c_int = 0;
pub const CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub const CAPTURE_MODE_RELAXED: c_int = 2;
/// `CUstreamCaptureStatus`.
pub const CAPTURE_STATUS_NONE: c_int = 0;
pub const CAPTURE_STATUS_ACTIVE: c_int = 1;
pub const CAPTURE_STATUS_INVALIDATED: c_int = 2;

/// `CUmemAllocationType`: `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CUmemAllocationHandleType` bits.
pub const HANDLE_TYPE_POSIX_FD: c_int = 0x1;
pub const HANDLE_TYPE_WIN32: c_int = 0x2;
pub const HANDLE_TYPE_WIN32_KMT: c_int = 0x4;
pub const HANDLE_TYPE_FABRIC: c_int = 0x8;
/// `CUmemLocationType`: `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_DEVICE: c_int = 1;
/// `CUmemAccess_flags`.
pub const ACCESS_NONE: c_int = 0;
pub const ACCESS_READ: c_int = 1;
pub const ACCESS_READWRITE: c_int = 3;
/// `CUmemAllocationGranularity_flags`.
pub const GRANULARITY_MINIMUM: c_int = 0;
pub const GRANULARITY_RECOMMENDED: c_int = 1;

/// `CUdevice_attribute` values the double answers with something other than 0.
pub const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
pub const ATTR_WARP_SIZE: c_int = 10;
pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
pub const ATTR_UNIFIED_ADDRESSING: c_int = 41;
pub const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
pub const ATTR_HANDLE_TYPE_POSIX_FD_SUPPORTED: c_int = 103;
pub const ATTR_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 110;
pub const ATTR_MEMORY_POOLS_SUPPORTED: c_int = 115;
pub const ATTR_HANDLE_TYPE_FABRIC_SUPPORTED: c_int = 128;
/// One past the largest `CUdevice_attribute` of CUDA 12.8.
pub const ATTR_MAX: c_int = 140;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemLocation {
    pub type_: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: AllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemAccessDesc {
    pub location: MemLocation,
    pub flags: c_int,
}

/// `CUuuid`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Uuid {
    pub bytes: [u8; 16],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_have_the_headers_layout() {
        assert_eq!(std::mem::size_of::<MemLocation>(), 8);
        assert_eq!(std::mem::size_of::<MemAllocationProp>(), 32);
        assert_eq!(
            std::mem::offset_of!(MemAllocationProp, win32_handle_meta_data),
            16
        );
        assert_eq!(std::mem::offset_of!(MemAllocationProp, alloc_flags), 24);
        assert_eq!(std::mem::size_of::<MemAccessDesc>(), 12);
    }
}
