//! # quilt-torch: Quilt behind PyTorch's pluggable-allocator interface
//!
//! `cargo build --release -p quilt-torch` makes `libquilt_torch.so`, whose C
//! functions are what `torch.cuda.memory.CUDAPluggableAllocator` loads:
//!
//! ```c
//! void*  quilt_malloc(size_t size, int device, void* stream);
//! void   quilt_free(void* ptr, size_t size, int device, void* stream);
//! void   quilt_empty_cache(void);
//! void   quilt_record_stream(void* ptr, void* stream);
//! int    quilt_forget_stream(void* stream);     // before the stream is destroyed
//! int    quilt_reset_peak_stats(int device);
//! void   quilt_set_memory_fraction(double fraction, int device);
//! size_t quilt_stats_json(int device, char* buf, size_t len);
//! size_t quilt_last_error(char* buf, size_t len);
//! int    quilt_record_history(int enabled, size_t max_entries);
//! int    quilt_dump_snapshot(const char* path);
//! int    quilt_set_tag(const char* tag);      // this thread's mallocs carry it
//! int    quilt_clear_tag(void);
//! size_t quilt_current_tag(char* buf, size_t len);
//! int    quilt_sleep(const char* tag, int flags); // 1: discard, 2: release
//! int    quilt_wake(const char* tag);
//! int    quilt_is_asleep(const char* tag);   // 1, 0, or -1 on error
//! size_t quilt_check_configuration(char* buf, size_t len); // JSON, no context made
//! int    quilt_in_forked_child(void);        // 1 after fork() of a process using CUDA
//! ```
//!
//! and, for torch's allocator class (`python/quilt_torch/torch_allocator.cpp`,
//! which `quilt_torch.enable()` installs as torch's CUDA allocator), plain C
//! structs ([`device_stats`], [`listing`], [`ffi::QuiltAllocation`],
//! [`ffi::QuiltFreed`]):
//!
//! ```c
//! int    quilt_torch_malloc(size_t size, int device, void* stream, int use_pool,
//!                           uint64_t pool_first, uint64_t pool_second,
//!                           QuiltAllocation* out);      // 0, 1 out of memory, 2 error
//! int    quilt_torch_free(void* ptr, QuiltFreed* out); // 0, 3 kept by a private pool, 1 error
//! int    quilt_torch_block_size(void* ptr, uint64_t* size); // 0, 1 not a live block
//! int    quilt_device_stats(int device, QuiltDeviceStats* out);
//! int    quilt_reset_accumulated_stats(int device);
//! int    quilt_pool_create_or_incref(int device, uint64_t first, uint64_t second);
//! int    quilt_pool_release(int device, uint64_t first, uint64_t second);
//! int    quilt_pool_use_count(int device, uint64_t first, uint64_t second);
//! double quilt_get_memory_fraction(int device);
//! size_t quilt_segments(int device, QuiltSegment* segs, size_t seg_len,
//!                       QuiltBlock* blocks, size_t block_len, size_t* blocks_needed);
//! size_t quilt_history_since(uint64_t seq, QuiltTraceEntry* out, size_t len);
//! uint64_t quilt_history_last_seq(void);
//! int    quilt_clear_history(void);
//! int    quilt_try_set_memory_fraction(double fraction, int device); // 0, or 1 refused
//! int    quilt_enable_peer_access(int device, int peer);
//! int    quilt_pool_checkpoint(int device, uint64_t first, uint64_t second,
//!                              QuiltPoolBlock* out, size_t len, size_t* count);
//! int    quilt_pool_restore(int device, uint64_t first, uint64_t second,
//!                           const QuiltPoolBlock* state, size_t n, QuiltPoolBlock* freed,
//!                           size_t freed_len, size_t* freed_count); // 0, 2 freed too small, 1 error
//! int    quilt_pool_live_blocks(int device, uint64_t first, uint64_t second,
//!                               uint64_t* out, size_t len, size_t* count);
//! ```
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
