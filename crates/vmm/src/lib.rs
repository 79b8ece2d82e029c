//! # quilt-vmm: Quilt's driver layer
//!
//! One trait, [`Vmm`], over CUDA's virtual memory management API
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`, plus the stream and event
//! calls an allocator needs), with three backends behind it: the real driver,
//! host memory, and a simulated device for tests and tools. It is the layer
//! under the Quilt allocator (`quilt-alloc`, which a program that wants GPU
//! memory takes) and its page pool (`quilt-pool`): this crate picks the
//! backend, and is for building allocators and tools on the driver's calls.
//!
//! ## A first program
//!
//! On the simulated device (no GPU; `quilt-vmm` as the one dependency): one
//! virtual range backed by four physical handles, two streams ordered by an
//! event, an out-of-memory error, and the driver's statistics.
//!
//! ```
//! use quilt_vmm::{sim::SimVmm, CallKind, StreamId, Vmm, VmmError};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // A simulated device of 64 MiB: CUDA's rules and bookkeeping, no GPU.
//!     // On a GPU: `quilt_vmm::cuda::CudaVmm::new(0)?`, behind the same trait.
//!     let vmm = SimVmm::with_capacity(64 << 20)?;
//!     let page = vmm.granularity(); // 2 MiB, as on current GPUs
//!
//!     // One contiguous virtual range backed by four separate physical handles.
//!     let va = vmm.reserve(4 * page, 0)?;
//!     let mut handles = Vec::new();
//!     for i in 0..4 {
//!         let handle = vmm.create(page)?;
//!         vmm.map(va + i * page, page, handle, 0)?;
//!         handles.push(handle);
//!     }
//!     vmm.set_access(va, 4 * page)?;
//!
//!     // Two streams: stream 2's later work waits for what stream 1 queued.
//!     let (s1, s2) = (StreamId(1), StreamId(2));
//!     let event = vmm.event_record(s1)?;
//!     vmm.stream_wait_event(s2, event)?;
//!     vmm.stream_synchronize(s2)?;
//!     assert!(vmm.event_query(event)?);
//!     vmm.event_destroy(event)?;
//!
//!     // More than the device has left: a typed error with the figures.
//!     match vmm.create(64 << 20) {
//!         Err(VmmError::OutOfMemory { requested, available, .. }) => {
//!             println!("out of memory: {requested} bytes asked, {available} available")
//!         }
//!         other => return Err(format!("expected out of memory, got {other:?}").into()),
//!     }
//!
//!     vmm.unmap(va, 4 * page)?;
//!     for handle in handles {
//!         vmm.release(handle)?;
//!     }
//!     vmm.address_free(va, 4 * page)?;
//!     let stats = vmm.driver_stats();
//!     println!(
//!         "{} cuMemCreate, {} cuMemMap, {} VMM calls",
//!         stats.count(CallKind::Create),
//!         stats.count(CallKind::Map),
//!         stats.vmm_calls()
//!     );
//!     assert!(vmm.leak_report().is_empty(), "everything given back");
//!     Ok(())
//! }
//! ```
//!
//! It prints `out of memory: 67108864 bytes asked, 58720256 available` and
//! `5 cuMemCreate, 4 cuMemMap, 17 VMM calls` (a refused call is counted too,
//! and in [`DriverStats::failed`]).
//!
//! ## On a GPU
//!
//! With the `cuda` feature (on by default), [`CudaVmm`][cuda-vmm] is device
//! `ordinal` through the driver API, and takes cudarc's streams. This
//! program also needs `cudarc = { version = "0.19", features = ["driver"] }`
//! and a GPU (the doctests compile it, and do not run it):
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # mod cuda_example {
//! use cudarc::driver::CudaContext;
//! use quilt_vmm::{cuda::CudaVmm, Vmm};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Device 0; libcuda is loaded at run time (without it, or without a
//!     // device, `VmmError::Unavailable` says why).
//!     let cuda = CudaVmm::new(0)?;
//!     println!("{}: {} MiB", cuda.device_name(), cuda.total_memory() >> 20);
//!     let page = cuda.granularity();
//!
//!     // One range, two handles: a copy crosses the boundary between them.
//!     let va = cuda.reserve(2 * page, 0)?;
//!     let (a, b) = (cuda.create(page)?, cuda.create(page)?);
//!     cuda.map(va, page, a, 0)?;
//!     cuda.map(va + page, page, b, 0)?;
//!     cuda.set_access(va, 2 * page)?;
//!     let data: Vec<u8> = (0..2 * page).map(|i| i as u8).collect();
//!     cuda.copy_to_device(va, &data)?;
//!     let mut back = vec![0u8; data.len()];
//!     cuda.copy_from_device(va, &mut back)?;
//!     assert_eq!(back, data);
//!
//!     // Streams are cudarc's (or `cuda.create_stream()?`): adopted as ids.
//!     let ctx = CudaContext::new(0)?;
//!     let (s1, s2) = (ctx.new_stream()?, ctx.new_stream()?);
//!     let (id1, id2) = (cuda.adopt_cudarc_stream(&s1)?, cuda.adopt_cudarc_stream(&s2)?);
//!     let event = cuda.event_record(id1)?;
//!     cuda.stream_wait_event(id2, event)?; // s2's later work waits for s1's
//!     cuda.stream_synchronize(id2)?;
//!     cuda.event_destroy(event)?;
//!
//!     cuda.unmap(va, 2 * page)?;
//!     cuda.release(a)?;
//!     cuda.release(b)?;
//!     cuda.address_free(va, 2 * page)?;
//!     for stream in [&s1, &s2] {
//!         let id = cuda.adopt_cudarc_stream(stream)?;
//!         cuda.forget_stream(id)?; // before cudarc destroys it
//!     }
//!     assert!(cuda.leak_report().is_empty());
//!     Ok(())
//! }
//! # }
//! # fn main() {}
//! ```
//!
//! ## The backends
//!
//! - [`CudaVmm`][cuda-vmm] (`cuda` feature): the real driver through
//!   `cudarc`, loaded at run time. Where `libcuda` is absent, construction
//!   returns [`VmmError::Unavailable`].
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
//!
//! `unsafe` code lives in the CUDA and host backends alone.
//!
//! ## Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `cuda` | yes | the CUDA backend, [`cuda`][cuda-mod], without choosing a CUDA version: with `default-features = false, features = ["cuda"]`, your own cudarc version feature decides |
//! | `cuda-12080` | yes | `cuda` on cudarc's CUDA 12.8 bindings |
//!
//! Without `cuda` nothing of cudarc is compiled. cudarc loads `libcuda` at
//! run time, so a build with `cuda` needs no CUDA toolkit and runs where there
//! is no GPU (the CUDA backend then answers [`VmmError::Unavailable`]).
//!
//! ## Where to go next
//!
//! - `quilt-alloc`: the allocator on top (its front page starts the same way).
//! - `docs/design.md` in the repository: the allocator as built, and (§13) the
//!   strict CUDA driver double the repository's tests run the CUDA backend on
//!   without a GPU.
//! - `cargo run --release -p quilt-bench --example driver_latency` in the
//!   repository: the driver's real latencies per call, on a GPU.
//!
//! <!-- Links to what only the `cuda` feature compiles: -->
#![cfg_attr(
    feature = "cuda",
    doc = "[cuda-vmm]: cuda::CudaVmm",
    doc = "[cuda-mod]: cuda"
)]
#![cfg_attr(
    not(feature = "cuda"),
    doc = "[cuda-vmm]: #feature-flags",
    doc = "[cuda-mod]: #feature-flags"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

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
