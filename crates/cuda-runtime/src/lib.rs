//! A CUDA runtime face over the strict driver double (`quilt-cuda-double`).
//!
//! Built as `libquilt_cuda_runtime.so`, soname `libcudart.so.13`, every
//! export versioned `libcudart.so.13` (`build.rs`), it answers the `cuda*`
//! calls that the CUDA 13 build of PyTorch makes, by calling the double's
//! driver functions in the `libcuda.so.1` the process loads (never a second
//! copy of the double), so that torch makes CUDA tensors on the double's
//! devices and torch, the face and Quilt's CUDA backend share one driver
//! state. `scripts/simulated-gpu.sh COMMAND` runs a program on it;
//! `docs/simulated-gpu.md` says what it implements, models and cannot.
//!
//! - devices, properties, attributes, current device and primary contexts,
//!   versions, driver entry points: `device.rs`, `api.rs`, `props.rs`;
//! - memory, copies, memsets: `memory.rs`;
//! - streams, events, capture, graphs: `streams.rs`;
//! - kernel registration and launches (queued, computing nothing):
//!   `kernels.rs`;
//! - errors, the last error, and the calls the face refuses: `errors.rs`,
//!   `api.rs`;
//! - the NVML calls torch's expandable segments make (the library also
//!   answers to `libnvidia-ml.so.1` in the simulated GPU's folder): `nvml.rs`.

mod api;
mod device;
mod driver;
mod errors;
mod kernels;
mod memory;
mod nvml;
mod props;
mod streams;
