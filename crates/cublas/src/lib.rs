//! A cuBLAS face over the strict driver double (`quilt-cuda-double`).
//!
//! Built as `libquilt_cublas.so`, soname `libcublas.so.13`, every export
//! versioned `libcublas.so.13` (`build.rs`), it answers the `cublas*` calls
//! that the CUDA 13 build of PyTorch imports, so that `torch.nn.Linear`,
//! `matmul`, `bmm` and `addmm` run on the simulated GPU
//! (`scripts/simulated-gpu.sh`, `docs/simulated-gpu.md`):
//!
//! - handles (made by the cuBLASLt face, `crates/cublas-lt`, so each is
//!   also a cuBLASLt handle), streams, workspaces, pointer and math modes:
//!   `handle.rs`;
//! - GEMM, GEMV, dot, TRSM and the batched solvers, checked as cuBLAS's
//!   reference says and queued on the handle's stream as the double's
//!   opaque work (they compute nothing): `ops.rs`;
//! - the BLAS calls only `libtorch_cuda_linalg.so` imports (it also needs
//!   NVIDIA's cuSOLVER, which cannot run here): answered
//!   `CUBLAS_STATUS_NOT_SUPPORTED` by name, `refused.rs`;
//! - the cuBLASLt face it calls: `lt.rs`.

mod handle;
mod lt;
mod ops;
mod refused;
