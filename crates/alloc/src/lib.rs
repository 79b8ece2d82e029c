//! # quilt-alloc: the Quilt GPU memory allocator and its baselines
//!
//! Quilt allocates GPU memory with CUDA's virtual memory management API: it
//! maps scattered physical pages behind one contiguous virtual range, so a
//! request fails only when fewer pages are free or reclaimable than it needs,
//! never because free memory is fragmented. Quilt and the allocators it is
//! measured against (PyTorch's caching allocator, GMLake, `offset-allocator`)
//! all implement one trait, [`DeviceAllocator`], over any driver backend of
//! [`quilt_vmm`]: CUDA, host memory, or a simulated device for tests and tools.
//!
//! ## A first program
//!
//! Take `quilt-alloc` and `quilt-vmm` as dependencies (`cargo add quilt-alloc
//! quilt-vmm`, or by path from a checkout of the repository). This program,
//! on the simulated device (no GPU), makes an allocator, allocates on two
//! streams, frees, reads the statistics and runs out of memory:
//!
//! ```
//! use std::sync::Arc;
//!
//! use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
//! use quilt_alloc::{AllocError, Buffer, DeviceAllocator, OomVerdict};
//! use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // A simulated device of 1 GiB: the driver's bookkeeping without a GPU.
//!     // On a GPU: `Arc::new(quilt_vmm::cuda::CudaVmm::new(0)?)`.
//!     let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
//!     let alloc = Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
//!
//!     // Two streams. A block is ordered on the stream it is allocated for.
//!     let (compute, copy) = (StreamId(1), StreamId(2));
//!     let weights = alloc.allocate(300 << 20, compute)?;
//!     alloc.record_stream(weights.ptr, copy)?; // the copy stream reads it too
//!     let staging = Buffer::new(alloc.clone(), 100 << 20, copy)?; // freed when dropped
//!
//!     let stats = alloc.stats();
//!     println!(
//!         "{} blocks, {} MiB allocated, {} MiB reserved",
//!         stats.allocation.current,
//!         stats.allocated_bytes.current >> 20,
//!         stats.reserved_bytes.current >> 20,
//!     );
//!
//!     // Out of memory is an error with its diagnosis; nothing is lost.
//!     match alloc.allocate(1 << 30, compute) {
//!         Err(AllocError::OutOfMemory(report)) => {
//!             assert_eq!(report.verdict, OomVerdict::Capacity);
//!             println!("{report}");
//!         }
//!         other => return Err(format!("expected out of memory, got {other:?}").into()),
//!     }
//!
//!     // Recorded on the copy stream, `weights` is held until that stream's
//!     // work is done (as PyTorch holds it): its memory is not reused before.
//!     alloc.free(weights.ptr)?;
//!     drop(staging);
//!     assert_eq!(alloc.stats().allocated_bytes.current, 0);
//!     // Freed memory stays mapped and cached: the same request again makes
//!     // no VMM call.
//!     let calls = alloc.vmm().driver_stats().vmm_calls();
//!     let again = alloc.allocate(100 << 20, copy)?;
//!     assert_eq!(alloc.vmm().driver_stats().vmm_calls(), calls);
//!     alloc.free(again.ptr)?;
//!     println!("{}", alloc.memory_summary());
//!     Ok(())
//! }
//! ```
//!
//! It prints `2 blocks, 400 MiB allocated, 400 MiB reserved`, the
//! out-of-memory report (`quilt: out of memory allocating 1073741824 bytes
//! (...); capacity 1024.00 MiB, reserved 400.00 MiB, ... verdict: capacity:
//! the device really has too little memory`) and a table in the spirit of
//! `torch.cuda.memory_summary()`. A verdict of [`OomVerdict::Fragmentation`]
//! (enough memory free, not in a usable piece) is what the baselines answer
//! where Quilt serves the request: see [`OomVerdict`].
//!
//! ## On a GPU, with cudarc
//!
//! With the `cuda` feature (on by default), [`CudaVmm`][cuda-vmm] is
//! the real driver and [`CudaBuffer`][cuda-buffer] is a Quilt block that
//! cudarc takes as device memory: its copies, and `device_ptr(&stream)` as a
//! kernel argument of its launch builder. This program also needs `cudarc =
//! { version = "0.19", features = ["driver"] }` and a GPU (it is compiled,
//! not run, by the doctests; over the repository's CUDA driver double it runs):
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # mod cuda_example {
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use quilt_alloc::cuda_buffer::CudaBuffer;
//! use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
//! use quilt_alloc::DeviceAllocator;
//! use quilt_vmm::{cuda::CudaVmm, Vmm};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Device 0 through CUDA's driver API; libcuda is loaded at run time
//!     // (without it, `VmmError::Unavailable`).
//!     let cuda = Arc::new(CudaVmm::new(0)?);
//!     let vmm: Arc<dyn Vmm> = cuda.clone();
//!     let alloc: Arc<dyn DeviceAllocator> =
//!         Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
//!
//!     let ctx = CudaContext::new(0)?;
//!     let (s1, s2) = (ctx.new_stream()?, ctx.new_stream()?);
//!     // Quilt memory that cudarc takes as a device slice, ordered on s1.
//!     let n = 1 << 20;
//!     let mut xs = CudaBuffer::<f32>::new(alloc.clone(), &cuda, s1.clone(), n)?;
//!     s1.memcpy_htod(&vec![1.5f32; n], &mut xs)?;
//!     // Read on s2: s2 first waits for the copy queued on s1 (events, as for
//!     // cudarc's own slices). A kernel takes `xs.device_ptr(&s2)` likewise.
//!     let back: Vec<f32> = s2.clone_dtoh(&xs)?;
//!     assert!(back.iter().all(|&x| x == 1.5));
//!     // Dropped: s1 waits for every use, then Quilt frees the block on s1.
//!     drop(xs);
//!     s1.synchronize()?;
//!     assert_eq!(alloc.stats().allocated_bytes.current, 0);
//!     println!("{}", alloc.memory_summary());
//!     Ok(())
//! }
//! # }
//! # fn main() {}
//! ```
//!
//! The repository's `cudarc_kernel` example launches a PTX kernel on two
//! Quilt buffers (`cargo run --release -p quilt-alloc --example
//! cudarc_kernel`).
//!
//! ## Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `cuda` | yes | the CUDA backend of [`quilt_vmm`] and [`cuda_buffer`][cuda-buffer-mod] (Quilt memory as cudarc device slices), without choosing a CUDA version: with `default-features = false, features = ["cuda"]`, your own cudarc version feature decides |
//! | `cuda-12080` | yes | `cuda` on cudarc's CUDA 12.8 bindings |
//! | `serde` | no | `Serialize` and `Deserialize` on [`OomReport`] and [`OomVerdict`] |
//! | `invariants` | no | `DeviceAllocator::check_invariants` and the checkers behind it: for tests, fuzzing and debugging, not for a library build |
//!
//! Without `cuda` nothing of cudarc is compiled; the host and simulated
//! backends need no feature. cudarc loads `libcuda` at run time, so a build
//! with `cuda` needs no CUDA toolkit and runs where there is no GPU (the CUDA
//! backend then answers [`quilt_vmm::VmmError::Unavailable`]).
//!
//! ## The crate
//!
//! - [`quilt`]: [`QuiltAllocator`](quilt::QuiltAllocator) and its policy,
//!   [`QuiltConfig`](quilt::QuiltConfig) (presets `default` and `gmlake`),
//!   with growable buffers, tags that sleep and wake, and the offload tier.
//! - [`baselines`]: PyTorch's caching allocator (`classic`, `expandable`)
//!   and `offset`, behind the same trait.
//! - [`Buffer`]: an owning block, freed when dropped.
//! - [`AllocError`], [`OomReport`], [`OomVerdict`]: what fails and why.
//! - [`stats`], [`summary`], [`snapshot`]: the figures, in PyTorch's
//!   vocabulary.
//! - [`settings`]: the configuration as text (`QUILT_ALLOC_CONF`).
//! - [`registry`] (one allocator per device), [`comm`] (one handle per
//!   buffer, for NCCL, RDMA and other processes), [`ipc`] and
//!   [`export_pins`] (sharing with other processes).
//!
//! ## Where to go next
//!
//! - `docs/design.md` in the repository: the allocator as built (the page
//!   pool, arenas, placement, streams and their hazards, the out-of-memory
//!   verdict, the invariants). `docs/serving.md` and `docs/multi-gpu.md`
//!   cover growable buffers, sleep and wake, peers and sharing.
//! - `quilt-bench`, the repository's A/B tool (not published):
//!   `cargo run --release -p quilt-bench -- ab` replays workloads and real
//!   PyTorch traces through Quilt and the baselines, a row per allocator
//!   (minimum capacity, efficiency, driver calls, stream waits);
//!   `--allocator quilt:reclaim=always` tries a setting. `docs/benchmarks.md`
//!   has the figures and how to read them.
//! - The examples: `cargo run --release -p quilt-alloc --example
//!   fragmentation` (classic runs out of memory where Quilt serves the same
//!   requests), `readme`, `serving`.
//!
//! <!-- Links to what only the `cuda` feature compiles: -->
#![cfg_attr(
    feature = "cuda",
    doc = "[cuda-vmm]: quilt_vmm::cuda::CudaVmm",
    doc = "[cuda-buffer]: cuda_buffer::CudaBuffer",
    doc = "[cuda-buffer-mod]: cuda_buffer"
)]
#![cfg_attr(
    not(feature = "cuda"),
    doc = "[cuda-vmm]: #feature-flags",
    doc = "[cuda-buffer]: #feature-flags",
    doc = "[cuda-buffer-mod]: #feature-flags"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

pub mod api;
pub mod baselines;
pub mod buffer;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda_buffer;
pub mod error;
pub mod export_pins;
pub mod ipc;
pub mod quilt;
pub mod registry;
pub mod settings;
pub mod snapshot;
pub mod stats;
pub mod summary;
pub mod units;

pub use api::{Allocation, DeviceAllocator, MAX_ALLOCATION, MIN_BLOCK_SIZE, SMALL_SIZE};
pub use buffer::Buffer;
pub use error::{AllocError, InvariantViolation, OomReport, OomVerdict};
pub use snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};
pub use stats::{AllocatorStats, Stat};
pub use summary::MemorySummary;

/// The example of the crate's README (its page on the registry), run with
/// the doctests so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
