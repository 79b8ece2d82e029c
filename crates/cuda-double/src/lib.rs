//! A strict CUDA driver double.
//!
//! Built as `libquilt_cuda_double.so` (`cargo build --release -p
//! quilt-cuda-double`), it exports the driver functions that Quilt's CUDA
//! backend and cudarc's safe layer call, under cuda.h's names, and answers
//! them on host memory: device addresses are host addresses, a reservation
//! is a `PROT_NONE` mapping, a physical handle a memory file, `cuMemMap`
//! maps the file at the address and `cuMemSetAccess` grants access, so a
//! test can read and write device memory directly.
//!
//! It is strict where the driver reference is (see `memory.rs` and
//! `work.rs` for each rule), and makes queued work run late, so that an
//! allocator that unmaps or reuses memory under queued work is caught: the
//! work faults when it runs and the context is poisoned with
//! `CUDA_ERROR_ILLEGAL_ADDRESS`. What it cannot check: kernels (module and
//! launch calls answer `CUDA_ERROR_NOT_SUPPORTED`; the CUDA runtime face,
//! `quilt-cuda-runtime`, queues its launches as work of unknown footprint
//! that computes nothing, `quiltDoubleLaunchOpaqueWork`), timing, and the
//! driver's undocumented behaviour; its rules can be relaxed to mirror a
//! real GPU's answers (`rules.rs`).
//!
//! Stream capture records the captured copies, fills and launches into the
//! graph; `cuGraphInstantiate` and `cuGraphLaunch` replay them on a stream,
//! where they compute (and fault) as any queued work does.
//!
//! Every driver call is counted by entry point (`counters.rs`); the
//! exported `quiltDoubleCounts` gives the counts to the process that loaded
//! the double (`quilt-bench live` reads them through `ctypes`).
//!
//! It never shadows a real driver: a program reaches it only through a
//! private directory holding `libcuda.so` and `libcuda.so.1` links, first
//! on its library path; [`harness`] makes one and runs tests over it.

pub mod abi;
pub mod counters;
mod exports;
pub mod harness;
mod memory;
mod os;
mod peer;
pub mod rules;
mod state;
mod work;
