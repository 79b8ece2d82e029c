//! The C boundary: every exported function, each a thin wrapper that runs
//! the safe [`crate::library`] inside `guard` (no panic crosses it, every
//! error is kept for `quilt_last_error`).
//!
//! The exported names all start with `quilt_`, so they cannot collide with
//! another library's symbols (the reason `#[no_mangle]` counts as unsafe).
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::ffi::{c_char, c_double, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::library::library;

thread_local! {
    /// The calling thread's last error ("" if none yet).
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The tag the calling thread's `quilt_malloc`s carry (`quilt_set_tag`).
    static CURRENT_TAG: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// The version of the C ABI that this library, torch's allocator class
/// (`python/quilt_torch/torch_allocator.cpp`) and the Python package share:
/// the functions and structs of the header `python/quilt_torch/quilt_torch.h`,
/// which cbindgen generates from this crate (`tests/header.rs` fails while it
/// is stale). The class and the package check it when they load the library,
/// so that a library and a package of different builds refuse each other
/// rather than misread a struct. Raise it with any change to an exported
/// function or struct.
pub const QUILT_TORCH_ABI_VERSION: u32 = 2;

/// The C ABI version this library was built with
/// ([`QUILT_TORCH_ABI_VERSION`]).
#[no_mangle]
pub extern "C" fn quilt_abi_version() -> u32 {
    QUILT_TORCH_ABI_VERSION
}

/// The calling thread's current tag, as `quilt_current_tag` gives it.
pub fn current_tag() -> Option<String> {
    CURRENT_TAG.with(|t| t.borrow().clone())
}

/// Read a tag passed from C: not null, UTF-8, not empty.
///
/// # Safety
///
/// `tag` is null (an error) or a NUL-terminated string, read only before
/// this call returns.
unsafe fn read_tag(what: &str, tag: *const c_char) -> Result<String, String> {
    if tag.is_null() {
        return Err(format!("{what}: the tag is null"));
    }
    // SAFETY: a non-null `tag` is NUL-terminated (this function's contract);
    // it is only read, here.
    let text = unsafe { CStr::from_ptr(tag) };
    let text = text
        .to_str()
        .map_err(|_| format!("{what}: the tag is not UTF-8"))?;
    crate::library::check_tag(text).map_err(|e| format!("{what}: {e}"))?;
    Ok(text.to_string())
}

fn set_last_error(message: String) {
    tracing::debug!(%message, "quilt-torch call failed");
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// The calling thread's last error, as `quilt_last_error` gives it.
pub fn last_error() -> String {
    LAST_ERROR.with(|e| e.borrow().clone())
}

// -- fork() ------------------------------------------------------------------

/// torch's message for a child that touches CUDA after a `fork()` of a
/// process that used it (`torch.cuda._lazy_init`), and Quilt's reason.
pub const FORKED_CHILD: &str = "Cannot re-initialize CUDA in forked subprocess. To use CUDA with \
     multiprocessing, you must use the 'spawn' start method (this process was forked from one \
     whose Quilt allocator held CUDA state: its contexts, streams and memory are the parent's, \
     and its locks may have been held by another thread at the fork)";

/// Set in the child of a `fork()` made after [`watch_fork`].
static FORKED: AtomicBool = AtomicBool::new(false);
static WATCHING: Once = Once::new();

extern "C" fn forked_child() {
    // Async-signal-safe: one atomic store.
    FORKED.store(true, Ordering::SeqCst);
}

/// From now on (Quilt holds CUDA state), a child of `fork()` refuses every
/// C function with [`FORKED_CHILD`] instead of touching that state (whose
/// locks another thread of the parent may have held: a deadlock). Before
/// this, a fork is harmless and the child may use Quilt as any process.
pub fn watch_fork() {
    WATCHING.call_once(|| {
        // SAFETY: pthread_atfork with a child handler that only stores an
        // atomic (async-signal-safe, as a fork handler must be), no prepare
        // or parent handler; the function lives as long as the process.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if rc != 0 {
            tracing::warn!(rc, "pthread_atfork failed: a forked child is not guarded");
        }
    });
}

/// Whether this process is the child of a `fork()` of a process whose
/// Quilt held CUDA state.
pub fn in_forked_child() -> bool {
    FORKED.load(Ordering::SeqCst)
}

/// 1 in the child of a `fork()` of a process whose Quilt held CUDA state
/// (every other function then fails with torch's message, "Cannot
/// re-initialize CUDA in forked subprocess"), else 0.
#[no_mangle]
pub extern "C" fn quilt_in_forked_child() -> c_int {
    c_int::from(in_forked_child())
}

/// Run `f`, keeping its error (or a panic's message) for
/// `quilt_last_error`; `failed` is what the C caller gets then. In a forked
/// child ([`watch_fork`]) `f` is not run: the error is [`FORKED_CHILD`].
fn guard<T>(failed: T, f: impl FnOnce() -> Result<T, String>) -> T {
    if in_forked_child() {
        set_last_error(FORKED_CHILD.to_string());
        return failed;
    }
    guard_anywhere(failed, f)
}

/// [`guard`] without the forked child's refusal (for `quilt_last_error`).
fn guard_anywhere<T>(failed: T, f: impl FnOnce() -> Result<T, String>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(message)) => {
            set_last_error(message);
            failed
        }
        Err(payload) => {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown cause".into());
            set_last_error(format!("internal error in quilt-torch (a bug): {why}"));
            failed
        }
    }
}

/// Copy `text` into the caller's buffer `buf` of `len` bytes, `snprintf`
/// style: at most `len - 1` bytes and a NUL; nothing when `len` is 0.
/// Returns the length of `text`.
///
/// # Safety
///
/// `buf` is null or points to `len` writable bytes.
unsafe fn write_c_string(text: &str, buf: *mut c_char, len: usize) -> usize {
    let bytes = text.as_bytes();
    if !buf.is_null() && len > 0 {
        let n = bytes.len().min(len - 1);
        // SAFETY: `buf` points to `len` writable bytes (this function's
        // contract, passed on from the C functions'); we write `n + 1 <= len`
        // of them, from a slice that cannot overlap a buffer it never saw.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    bytes.len()
}

/// A block of `size` bytes on `device`, ordered on `stream`, carrying the
/// calling thread's tag if one is set (`quilt_set_tag`); NULL on failure
/// (see `quilt_last_error`).
#[no_mangle]
pub extern "C" fn quilt_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        CURRENT_TAG.with(|tag| {
            library()
                .malloc_tagged(
                    size as u64,
                    device,
                    stream as usize as u64,
                    tag.borrow().as_deref(),
                )
                .map(|p| p as usize as *mut c_void)
        })
    })
}

/// From now on the calling thread's `quilt_malloc`s carry `tag` (until
/// `quilt_clear_tag` or another `quilt_set_tag`): their blocks sleep and
/// wake with it. Other threads are not affected. 0 on success; a null,
/// non-UTF-8 or empty tag is an error (the current tag is then unchanged).
///
/// # Safety
///
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quilt_set_tag(tag: *const c_char) -> c_int {
    guard(1, || {
        // SAFETY: `tag` as this function's contract says.
        let tag = unsafe { read_tag("quilt_set_tag", tag) }?;
        CURRENT_TAG.with(|t| *t.borrow_mut() = Some(tag));
        Ok(0)
    })
}

/// The calling thread's `quilt_malloc`s carry no tag any more. 0.
#[no_mangle]
pub extern "C" fn quilt_clear_tag() -> c_int {
    guard(1, || {
        CURRENT_TAG.with(|t| *t.borrow_mut() = None);
        Ok(0)
    })
}

/// The calling thread's current tag into `buf` (`snprintf` style; "" when
/// none is set).
///
/// # Safety
///
/// `buf` is null (then `len` must be 0) or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn quilt_current_tag(buf: *mut c_char, len: usize) -> usize {
    guard(0, || {
        let tag = current_tag().unwrap_or_default();
        // SAFETY: `buf` and `len` as this function's contract says.
        Ok(unsafe { write_c_string(&tag, buf, len) })
    })
}

/// Put `tag` to sleep on every device where its blocks live: their work
/// completes, their contents are copied to host memory (or dropped with
/// `QUILT_SLEEP_DISCARD` = 1), their pages are unmapped and kept in Quilt's
/// pool (or released to the device with `QUILT_SLEEP_RELEASE` = 2, for other
/// programs); their addresses stay reserved. 0 on success; an unknown tag,
/// one already asleep, unknown flags, or a failure is an error.
///
/// # Safety
///
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quilt_sleep(tag: *const c_char, flags: c_int) -> c_int {
    guard(1, || {
        // SAFETY: `tag` as this function's contract says.
        let tag = unsafe { read_tag("quilt_sleep", tag) }?;
        let (mode, pages) = crate::library::sleep_options(flags)?;
        library().sleep(&tag, mode, pages).map(|()| 0)
    })
}

/// Wake `tag`: its blocks are backed again at the same addresses, their
/// contents copied back if they were offloaded. 0 on success; an unknown
/// tag, one that is awake, or a failure (out of memory: the tag stays
/// asleep, its host copy intact) is an error.
///
/// # Safety
///
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quilt_wake(tag: *const c_char) -> c_int {
    guard(1, || {
        // SAFETY: `tag` as this function's contract says.
        let tag = unsafe { read_tag("quilt_wake", tag) }?;
        library().wake(&tag).map(|()| 0)
    })
}

/// 1 while `tag` sleeps (on some device), 0 while it is awake, -1 on error
/// (an unknown tag, a null, non-UTF-8 or empty one).
///
/// # Safety
///
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quilt_is_asleep(tag: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: `tag` as this function's contract says.
        let tag = unsafe { read_tag("quilt_is_asleep", tag) }?;
        library().is_asleep(&tag).map(c_int::from)
    })
}

/// Give back the block at `ptr` (of `size` bytes, on `device`).
#[no_mangle]
pub extern "C" fn quilt_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    guard((), || {
        library().free(
            ptr as usize as u64,
            size as u64,
            device,
            stream as usize as u64,
        )
    })
}

/// Return every device's cached pages to the driver.
#[no_mangle]
pub extern "C" fn quilt_empty_cache() {
    guard((), || library().empty_cache())
}

/// The block at `ptr` is used on `stream` as well: its memory is reused on
/// another stream only after that stream's work.
#[no_mangle]
pub extern "C" fn quilt_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard((), || {
        library().record_stream(ptr as usize as u64, stream as usize as u64)
    })
}

/// Quilt forgets `stream` before its owner destroys it (a `torch.cuda.Stream`
/// or a `CUstream` going away): work pending on it is waited for once, and
/// its handle is never passed to the driver again. 0 on success; 1 on
/// error (the default stream, a stream capturing now; see
/// `quilt_last_error`).
#[no_mangle]
pub extern "C" fn quilt_forget_stream(stream: *mut c_void) -> c_int {
    guard(1, || {
        library().forget_stream(stream as usize as u64).map(|()| 0)
    })
}

/// Sets every peak of `device`'s statistics to its current value (what
/// `torch.cuda.reset_peak_memory_stats` does). 0 on success, 1 on error
/// (see `quilt_last_error`).
#[no_mangle]
pub extern "C" fn quilt_reset_peak_stats(device: c_int) -> c_int {
    guard(1, || library().reset_peak_stats(device).map(|()| 0))
}

/// The share of `device` Quilt may hold, in [0, 1] (0: none).
#[no_mangle]
pub extern "C" fn quilt_set_memory_fraction(fraction: c_double, device: c_int) {
    guard((), || library().set_memory_fraction(fraction, device))
}

/// The statistics of `device` as JSON into `buf` (`snprintf` style). When
/// they cannot be had (a bad configuration, no such device), the JSON is
/// `{"device": N, "error": "..."}` and the error is kept for
/// `quilt_last_error` as well.
///
/// # Safety
///
/// `buf` is null (then `len` must be 0) or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn quilt_stats_json(device: c_int, buf: *mut c_char, len: usize) -> usize {
    guard(0, || {
        let json = library().stats_json(device).unwrap_or_else(|e| {
            let json = serde_json::json!({ "device": device, "error": e }).to_string();
            set_last_error(e);
            json
        });
        // SAFETY: `buf` and `len` as this function's contract says.
        Ok(unsafe { write_c_string(&json, buf, len) })
    })
}

/// The calling thread's last error into `buf` (`snprintf` style).
///
/// # Safety
///
/// `buf` is null (then `len` must be 0) or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn quilt_last_error(buf: *mut c_char, len: usize) -> usize {
    // SAFETY: `buf` and `len` as this function's contract says.
    guard_anywhere(0, || Ok(unsafe { write_c_string(&last_error(), buf, len) }))
}

/// Start (non-zero `enabled`, keeping the last `max_entries` actions per
/// device) or stop recording the history that snapshots show. 0 on success.
#[no_mangle]
pub extern "C" fn quilt_record_history(enabled: c_int, max_entries: usize) -> c_int {
    guard(1, || {
        library().record_history(enabled != 0, max_entries);
        Ok(0)
    })
}

/// Write a snapshot in PyTorch's layout to `path`. 0 on success.
///
/// # Safety
///
/// `path` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quilt_dump_snapshot(path: *const c_char) -> c_int {
    guard(1, || {
        if path.is_null() {
            return Err("quilt_dump_snapshot: the path is null".into());
        }
        // SAFETY: a non-null `path` is NUL-terminated (this function's
        // contract); it is only read, before this call returns.
        let path = unsafe { CStr::from_ptr(path) };
        let path = path
            .to_str()
            .map_err(|_| "quilt_dump_snapshot: the path is not UTF-8".to_string())?;
        library().dump_snapshot(path).map(|()| 0)
    })
}

// -- torch's allocator class (python/quilt_torch/torch_allocator.cpp) ------

/// What `quilt_torch_malloc` made.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QuiltAllocation {
    /// The block (NULL on failure).
    pub ptr: *mut c_void,
    /// The sequence number of its `alloc` history entry (0: none recorded).
    pub seq: u64,
}

/// Write `value` to `out` if it is not null.
///
/// # Safety
///
/// `out` is null or points to a writable `T`.
unsafe fn write_out<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: a non-null `out` points to a writable `T` (this
        // function's contract, passed on from the C functions').
        unsafe { out.write(value) };
    }
}

/// Copy `items` into the caller's array `out` of `len` elements (as many
/// as fit); returns how many there are.
///
/// # Safety
///
/// `out` is null (then nothing is written) or points to `len` writable `T`s.
unsafe fn write_array<T: Copy>(items: &[T], out: *mut T, len: usize) -> usize {
    if !out.is_null() {
        let n = items.len().min(len);
        // SAFETY: `out` points to `len >= n` writable `T`s (this function's
        // contract); `items` is our own slice, which cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, n) };
    }
    items.len()
}

/// The pool of a `quilt_torch_malloc`: none when `use_pool` is 0.
fn pool_of(use_pool: c_int, first: u64, second: u64) -> Option<crate::private_pools::PoolId> {
    (use_pool != 0).then_some((first, second))
}

/// A block of `size` bytes on `device`, ordered on `stream`, into torch's
/// private pool `(pool_first, pool_second)` when `use_pool` is non-zero,
/// carrying the calling thread's tag if one is set. Returns 0 and fills
/// `*out`; 1 for an out of memory (the device cannot back it, or it is
/// larger than Quilt could ever map), 2 for another failure (both: see
/// `quilt_last_error`).
///
/// # Safety
///
/// `out` is null or points to a writable `QuiltAllocation`.
#[no_mangle]
pub unsafe extern "C" fn quilt_torch_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    use_pool: c_int,
    pool_first: u64,
    pool_second: u64,
    out: *mut QuiltAllocation,
) -> c_int {
    guard(2, || {
        let made = CURRENT_TAG.with(|tag| {
            library().torch_malloc(
                size as u64,
                device,
                stream as usize as u64,
                tag.borrow().as_deref(),
                pool_of(use_pool, pool_first, pool_second),
            )
        });
        match made {
            Ok((ptr, seq)) => {
                let a = QuiltAllocation {
                    ptr: ptr as usize as *mut c_void,
                    seq,
                };
                // SAFETY: `out` as this function's contract says.
                unsafe { write_out(out, a) };
                Ok(0)
            }
            Err(f) => {
                set_last_error(f.message);
                Ok(if f.out_of_memory { 1 } else { 2 })
            }
        }
    })
}

/// What `quilt_torch_free` gave back: the block as torch had it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltFreed {
    /// The bytes torch asked for.
    pub size: u64,
    /// The stream it was allocated on.
    pub stream: u64,
    /// The sequence number of its `free_requested` history entry (0: none
    /// recorded).
    pub seq: u64,
    /// The device that had allocated it.
    pub device: i32,
    /// 1 when a private pool kept it, else 0.
    pub kept_by_pool: i32,
}

/// Give back the block at `ptr`, whichever device allocated it (Quilt
/// knows; torch's deleter passes only the pointer): a block of a private
/// pool in use stays the pool's. 0 when it went back to Quilt, 3 when a
/// private pool kept it (both: the block as torch had it in `*out`); 1 on
/// error (a null, unknown or double-freed pointer: see `quilt_last_error`).
///
/// # Safety
///
/// `out` is null or points to a writable `QuiltFreed`.
#[no_mangle]
pub unsafe extern "C" fn quilt_torch_free(ptr: *mut c_void, out: *mut QuiltFreed) -> c_int {
    guard(1, || {
        let f = library().torch_free(ptr as usize as u64)?;
        let freed = QuiltFreed {
            size: f.size,
            stream: f.stream,
            seq: f.seq,
            device: f.device,
            kept_by_pool: c_int::from(f.kept_by_pool),
        };
        // SAFETY: `out` as this function's contract says.
        unsafe { write_out(out, freed) };
        Ok(if f.kept_by_pool { 3 } else { 0 })
    })
}

/// The bytes torch asked for the live block at `ptr` into `*size` (torch's
/// `getBaseAllocation`). 0 when `ptr` is a live block, 1 when it is not
/// (nothing written).
///
/// # Safety
///
/// `size` is null or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn quilt_torch_block_size(ptr: *mut c_void, size: *mut u64) -> c_int {
    guard(1, || {
        Ok(match library().block_size(ptr as usize as u64) {
            Some(n) => {
                // SAFETY: `size` as this function's contract says.
                unsafe { write_out(size, n) };
                0
            }
            None => 1,
        })
    })
}

/// torch's statistics of `device` into `*out`. 0 on success, 1 on error.
///
/// # Safety
///
/// `out` is null or points to a writable `QuiltDeviceStats`.
#[no_mangle]
pub unsafe extern "C" fn quilt_device_stats(
    device: c_int,
    out: *mut crate::device_stats::QuiltDeviceStats,
) -> c_int {
    guard(1, || {
        let s = library().device_stats(device)?;
        // SAFETY: `out` as this function's contract says.
        unsafe { write_out(out, s) };
        Ok(0)
    })
}

/// The totals of `device`'s statistics count from now (torch's
/// `resetAccumulatedStats`). 0 on success, 1 on error.
#[no_mangle]
pub extern "C" fn quilt_reset_accumulated_stats(device: c_int) -> c_int {
    guard(1, || library().reset_accumulated_stats(device).map(|()| 0))
}

/// torch's `createOrIncrefPool`. 0 on success, 1 on error.
#[no_mangle]
pub extern "C" fn quilt_pool_create_or_incref(device: c_int, first: u64, second: u64) -> c_int {
    guard(1, || {
        library()
            .pool_create_or_incref(device, (first, second))
            .map(|()| 0)
    })
}

/// torch's `releasePool`. 0 on success, 1 on error.
#[no_mangle]
pub extern "C" fn quilt_pool_release(device: c_int, first: u64, second: u64) -> c_int {
    guard(1, || {
        library().pool_release(device, (first, second)).map(|()| 0)
    })
}

/// torch's `setNoSplit`: the pool hands its segments out whole. 0 on
/// success, 1 on error (a pool that does not exist).
#[no_mangle]
pub extern "C" fn quilt_pool_set_no_split(device: c_int, first: u64, second: u64) -> c_int {
    guard(1, || {
        library()
            .pool_set_no_split(device, (first, second))
            .map(|()| 0)
    })
}

/// torch's `getPoolUseCount`; -1 on error.
#[no_mangle]
pub extern "C" fn quilt_pool_use_count(device: c_int, first: u64, second: u64) -> c_int {
    guard(-1, || {
        library()
            .pool_use_count(device, (first, second))
            .map(|n| c_int::try_from(n).unwrap_or(c_int::MAX))
    })
}

/// The memory fraction of `device`; -1 on error.
#[no_mangle]
pub extern "C" fn quilt_get_memory_fraction(device: c_int) -> c_double {
    guard(-1.0, || library().memory_fraction(device))
}

/// The segments of `device` (every device when it is -1) into `segs` (of
/// `seg_len`) and their blocks into `blocks` (of `block_len`), as many as
/// fit; returns the number of segments and writes the number of blocks to
/// `*blocks_needed`. Call again with larger arrays when they did not fit.
///
/// # Safety
///
/// `segs` is null or points to `seg_len` writable `QuiltSegment`s; `blocks`
/// likewise with `block_len`; `blocks_needed` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn quilt_segments(
    device: c_int,
    segs: *mut crate::listing::QuiltSegment,
    seg_len: usize,
    blocks: *mut crate::listing::QuiltBlock,
    block_len: usize,
    blocks_needed: *mut usize,
) -> usize {
    guard(0, || {
        let (s, b) = library().segments((device >= 0).then_some(device))?;
        // SAFETY: the three pointers as this function's contract says.
        unsafe {
            write_out(blocks_needed, b.len());
            write_array(&b, blocks, block_len);
            Ok(write_array(&s, segs, seg_len))
        }
    })
}

/// The history entries with a sequence number above `seq`, oldest first,
/// into `out` (of `len`), as many as fit; returns how many there are.
///
/// # Safety
///
/// `out` is null or points to `len` writable `QuiltTraceEntry`s.
#[no_mangle]
pub unsafe extern "C" fn quilt_history_since(
    seq: u64,
    out: *mut crate::listing::QuiltTraceEntry,
    len: usize,
) -> usize {
    guard(0, || {
        let entries = library().history_since(seq);
        // SAFETY: `out` and `len` as this function's contract says.
        Ok(unsafe { write_array(&entries, out, len) })
    })
}

/// The sequence number of the last history entry recorded so far (0:
/// none); every entry recorded later has a higher one (what torch's user
/// metadata set now applies to).
#[no_mangle]
pub extern "C" fn quilt_history_last_seq() -> u64 {
    guard(0, || Ok(library().history_last_seq()))
}

/// Forget the history recorded so far. 0.
#[no_mangle]
pub extern "C" fn quilt_clear_history() -> c_int {
    guard(1, || {
        library().clear_history();
        Ok(0)
    })
}

/// torch's `roundup_power2_divisions` setting: `len` divisions, one per
/// power of two of request sizes from 1 MiB (torch's
/// `AcceleratorAllocatorConfig::roundup_power2_divisions()`, 16 of them),
/// each 0 or a power of two (all 0: off), applied to every later request by
/// torch's rounding rule. 0 on success; 1 when refused (another length, a
/// bad division; see `quilt_last_error`), nothing changed.
///
/// # Safety
///
/// `divisions` points to `len` readable `uint64_t`s (or is null with `len`
/// 0).
#[no_mangle]
pub unsafe extern "C" fn quilt_set_roundup_power2_divisions(
    divisions: *const u64,
    len: usize,
) -> c_int {
    guard(1, || {
        let table = if divisions.is_null() || len == 0 {
            &[][..]
        } else {
            // SAFETY: `divisions` points to `len` readable values (this
            // function's contract).
            unsafe { std::slice::from_raw_parts(divisions, len) }
        };
        library().set_roundup_power2_divisions(table)?;
        Ok(0)
    })
}

/// As `quilt_set_memory_fraction`, saying whether it took: 0 on success, 1
/// when refused (a fraction outside [0, 1], one below what live blocks
/// hold; see `quilt_last_error`).
#[no_mangle]
pub extern "C" fn quilt_try_set_memory_fraction(fraction: c_double, device: c_int) -> c_int {
    guard(1, || {
        library().set_memory_fraction(fraction, device).map(|()| 0)
    })
}

/// Check `QUILT_ALLOC_CONF` and that its backend can start, creating no
/// device's allocator (on CUDA no context is made): the JSON text
/// `{"backend": "cuda"}`, or `{"error": "..."}` (also kept for
/// `quilt_last_error`), into `buf` (`snprintf` style).
///
/// # Safety
///
/// `buf` is null (then `len` must be 0) or points to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn quilt_check_configuration(buf: *mut c_char, len: usize) -> usize {
    guard(0, || {
        let json = match library().check_configuration() {
            Ok(backend) => serde_json::json!({ "backend": backend }).to_string(),
            Err(e) => {
                let json = serde_json::json!({ "error": e }).to_string();
                set_last_error(e);
                json
            }
        };
        // SAFETY: `buf` and `len` as this function's contract says.
        Ok(unsafe { write_c_string(&json, buf, len) })
    })
}

/// torch's `enablePeerAccess(peer, device)`: device `peer` gets read-write
/// access to every page of `device`'s memory, mapped now or later. 0 on
/// success, 1 on error (a device index that is not one, `peer` being
/// `device`, a driver failure).
#[no_mangle]
pub extern "C" fn quilt_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guard(1, || library().enable_peer_access(device, peer).map(|()| 0))
}

// -- CUDA graph trees: a private pool checkpointed and restored ------------

/// torch's `getCheckpointState`: the blocks of pool `(first, second)` on
/// `device` (address order, each with whether it is handed out) into
/// `out` (of `len`), as many as fit, and how many there are into
/// `*count`; call again with a larger array when they did not fit. 0 on
/// success, 1 on error (a pool that does not exist or is released).
///
/// # Safety
///
/// `out` is null or points to `len` writable `QuiltPoolBlock`s; `count`
/// is null or writable.
#[no_mangle]
pub unsafe extern "C" fn quilt_pool_checkpoint(
    device: c_int,
    first: u64,
    second: u64,
    out: *mut crate::private_pools::CheckpointBlock,
    len: usize,
    count: *mut usize,
) -> c_int {
    guard(1, || {
        let state = library().pool_checkpoint(device, (first, second))?;
        // SAFETY: `out`, `len` and `count` as this function's contract says.
        unsafe {
            let n = write_array(&state, out, len);
            write_out(count, n);
        }
        Ok(0)
    })
}

/// torch's `setCheckpointPoolState`: pool `(first, second)` on `device` put
/// back in the state `state` (`n` blocks, as `quilt_pool_checkpoint` gave
/// them): the blocks handed out now are free, then the state's handed-out
/// blocks are handed out again at their addresses. The freed blocks (as
/// torch last had them) go into `freed` (of `freed_len`) and their number
/// into `*freed_count`.
/// 0 on success; 2 when `freed` is too small (nothing changed;
/// `*freed_count` says how many there would be); 1 on error (nothing
/// changed: a pool that does not exist or is released, a state that does
/// not match the pool).
///
/// # Safety
///
/// `state` is null (then `n` must be 0) or points to `n` readable
/// `QuiltPoolBlock`s; `freed` is null or points to `freed_len` writable
/// `QuiltPoolBlock`s; `freed_count` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn quilt_pool_restore(
    device: c_int,
    first: u64,
    second: u64,
    state: *const crate::private_pools::CheckpointBlock,
    n: usize,
    freed: *mut crate::private_pools::CheckpointBlock,
    freed_len: usize,
    freed_count: *mut usize,
) -> c_int {
    guard(1, || {
        let state = if state.is_null() || n == 0 {
            &[][..]
        } else {
            // SAFETY: a non-null `state` points to `n` readable blocks (this
            // function's contract), read only before this call returns.
            unsafe { std::slice::from_raw_parts(state, n) }
        };
        let restored = match library().pool_restore(device, (first, second), state, freed_len)? {
            Ok(r) => r,
            Err(needed) => {
                // SAFETY: `freed_count` as this function's contract says.
                unsafe { write_out(freed_count, needed) };
                return Ok(2);
            }
        };
        // SAFETY: `freed`, `freed_len` and `freed_count` as this function's
        // contract says.
        unsafe {
            let k = write_array(&restored.freed, freed, freed_len);
            write_out(freed_count, k);
        }
        Ok(0)
    })
}

/// torch's `checkPoolLiveAllocations`: the blocks of pool `(first, second)`
/// on `device` handed out now into `out` (of `len`), as many as fit, and
/// how many there are into `*count`. 0 on success, 1 on error (a pool that
/// does not exist).
///
/// # Safety
///
/// `out` is null or points to `len` writable `uint64_t`s; `count` is null
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn quilt_pool_live_blocks(
    device: c_int,
    first: u64,
    second: u64,
    out: *mut u64,
    len: usize,
    count: *mut usize,
) -> c_int {
    guard(1, || {
        let live = library().pool_live_blocks(device, (first, second))?;
        // SAFETY: `out`, `len` and `count` as this function's contract says.
        unsafe {
            let k = write_array(&live, out, len);
            write_out(count, k);
        }
        Ok(0)
    })
}
