//! A cuBLASLt face over the strict driver double (`quilt-cuda-double`).
//!
//! Built as `libquilt_cublas_lt.so`, soname `libcublasLt.so.13`, every
//! export versioned `libcublasLt.so.13` (`build.rs`), it answers the
//! `cublasLt*` calls that the CUDA 13 build of PyTorch imports, so that
//! torch's matmuls run on the simulated GPU (`scripts/simulated-gpu.sh`,
//! `docs/simulated-gpu.md`):
//!
//! - handles, tied to the context current at their creation, shared with
//!   the cuBLAS face (`crates/cublas`): `handle.rs`;
//! - matmul descriptors, matrix layouts, preferences and their attributes,
//!   with cuBLASLt's size checks: `descriptors.rs`, `attributes.rs`;
//! - heuristics, algorithm descriptors and the matmul itself, checked as
//!   cuBLASLt checks it and queued on its stream as the double's opaque
//!   work (it computes nothing): `matmul.rs`;
//! - the driver and runtime functions it calls: `device.rs`; statuses:
//!   `status.rs`.
//!
//! Calls torch does not import (transforms, grouped layouts, emulation
//! descriptors, loggers) are not exported.

mod attributes;
mod descriptors;
mod device;
pub mod handle;
mod matmul;
mod registry;
pub mod status;

pub use matmul::VERSION;

#[no_mangle]
/// `cublasLtGetStatusName`.
pub extern "C" fn cublasLtGetStatusName(s: status::Status) -> *const std::ffi::c_char {
    status::name_ptr(s)
}

#[no_mangle]
/// `cublasLtGetStatusString`.
pub extern "C" fn cublasLtGetStatusString(s: status::Status) -> *const std::ffi::c_char {
    status::text_ptr(s)
}

#[no_mangle]
/// `cublasLtGetCudartVersion`: the runtime the face goes with (CUDA 13.2).
pub extern "C" fn cublasLtGetCudartVersion() -> usize {
    13_020
}
