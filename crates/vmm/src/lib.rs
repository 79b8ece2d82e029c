//! # quilt-vmm: Quilt's driver layer
//!
//! One trait, [`Vmm`], over CUDA's virtual memory management API
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`, plus the stream and event
//! calls an allocator needs), and three backends behind it:
//!
//! - [`cuda::CudaVmm`]: the real driver through `cudarc`, loaded at run time.
//!   Where `libcuda` is absent, construction returns [`VmmError::Unavailable`].
//! - [`host::HostVmm`]: the same semantics on real host memory (Linux): a memfd
//!   is physical memory, a `PROT_NONE` mapping is a reservation.
//! - [`sim::SimVmm`]: bookkeeping only, any capacity, a cost model, call
//!   counters, fault injection and a leak report.
//!
//! All three backends check every call with one shared piece of bookkeeping
//! (the crate's ledger) before the driver or the kernel sees it, so bad input
//! gets the same typed error on all three; [`LeakReport`], one type for all
//! three, says what a backend still holds.
//!
//! The ledger enforces CUDA's documented rules, strictly where the reference is
//! terse. In particular `map` must cover its handle whole, at offset 0
//! ([`MapRule::WholeHandle`], the default): the `cuMemMap` reference says the
//! offset "currently must be zero", and PyTorch's expandable segments, vLLM's
//! and NCCL's allocators all map one handle per unit. A non-zero offset or a
//! part of a handle is refused with [`VmmError::InvalidArgument`] naming the
//! rule. For what-if experiments the simulated backend
//! ([`sim::SimConfig::map_rule`]) and the host backend
//! ([`host::HostVmm::with_map_rule`]) accept [`MapRule::AnyOffset`]: any
//! granule-aligned part of a handle. [`Vmm::map_rule`] says which rule a backend
//! uses, so that a report can flag results that depend on the relaxed one; the
//! CUDA backend always answers `WholeHandle`.
//! The driver-call latency micro-benchmark lives in quilt-bench
//! (`cargo run --release -p quilt-bench --example driver_latency`).
//!
//! `unsafe` code lives in the CUDA and host backends alone.

mod call_log;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cudarc_interop;
pub mod driver;
pub mod error;
mod events;
pub mod fd_pass;
pub mod host;
mod leak;
mod ledger;
pub mod share;
pub mod sim;
pub mod types;

pub use driver::Vmm;
pub use error::{Result, Unavailability, VmmError};
pub use leak::LeakReport;
pub use share::{
    CreateProps, DeviceCaps, DeviceOrdinal, DeviceSet, HandleKind, HandleTypes, ShareableHandle,
};
pub use types::{
    CallKind, DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId,
};
