//! # quilt-torch: Quilt behind PyTorch's pluggable-allocator interface
//!
//! `cargo build --release -p quilt-torch` makes `libquilt_torch.so`: the C
//! functions `torch.cuda.memory.CUDAPluggableAllocator` loads (`quilt_malloc`,
//! `quilt_free`), Quilt's own (statistics, last error, history, snapshots,
//! tags, sleep and wake, the memory fraction, configuration), and those of
//! torch's allocator class (`python/quilt_torch/torch_allocator.cpp`, which
//! `quilt_torch.enable()` installs as torch's CUDA allocator) with plain C
//! structs ([`device_stats`], [`listing`], [`ffi::QuiltAllocation`],
//! [`ffi::QuiltFreed`], [`private_pools::CheckpointBlock`]).
//!
//! Their declarations are one generated header,
//! `python/quilt_torch/quilt_torch.h`: cbindgen makes it from this crate
//! (`cbindgen.toml`; `tests/header.rs` fails while it is stale), the C++
//! class includes it, and the Python package reads its ctypes prototypes
//! from it. [`ffi::QUILT_TORCH_ABI_VERSION`] (`quilt_abi_version()`) is
//! checked by both when they load the library.
//!
//! After a `fork()` of a process whose Quilt holds CUDA state, every
//! function but `quilt_last_error` and `quilt_in_forked_child` fails in the
//! child with torch's "Cannot re-initialize CUDA in forked subprocess".
//!
//! torch's private pools (CUDA graphs, `torch.cuda.MemPool`) are kept in
//! front of Quilt ([`private_pools`]).
//!
//! Sleep and wake (`docs/serving.md`, "From PyTorch"): the allocations a
//! thread makes between `quilt_set_tag` and `quilt_clear_tag` carry the tag
//! (as torch_memory_saver's `region` and vLLM's `use_memory_pool(tag)`);
//! `quilt_sleep` unmaps them keeping their addresses, `quilt_wake` maps them
//! again with their contents.
//!
//! One Quilt allocator per device, created on first use, configured by
//! `QUILT_ALLOC_CONF` ([`conf`]). Streams the library did not create are
//! accepted as they are (on CUDA they are adopted, the legacy `0x1` and
//! per-thread `0x2` default streams included). Every function may be called
//! from any thread; no panic crosses the boundary; a failure (out of memory
//! with its report and verdict, a null, unknown or double-freed pointer, a bad
//! configuration) is kept for the calling thread's `quilt_last_error`, never
//! a crash. The text functions follow `snprintf`: they return the length
//! needed (without the terminating NUL) and never write past `len`.
//!
//! `unsafe` lives in [`ffi`] only (the C boundary): the exported symbols,
//! reading the caller's C string and writing into the caller's buffers.
#![deny(unsafe_code)]

pub mod conf;
pub mod device_stats;
pub mod ffi;
pub mod history;
pub mod library;
pub mod listing;
pub mod private_pools;
pub mod pytorch_snapshot;

pub use ffi::{current_tag, last_error};
