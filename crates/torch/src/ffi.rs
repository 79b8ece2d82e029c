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

use crate::library::library;

thread_local! {
    /// The calling thread's last error ("" if none yet).
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The tag the calling thread's `quilt_malloc`s carry (`quilt_set_tag`).
    static CURRENT_TAG: RefCell<Option<String>> = const { RefCell::new(None) };
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

/// Run `f`, keeping its error (or a panic's message) for
/// `quilt_last_error`; `failed` is what the C caller gets then.
fn guard<T>(failed: T, f: impl FnOnce() -> Result<T, String>) -> T {
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

/// The share of `device` Quilt may hold, in (0, 1].
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
    guard(0, || Ok(unsafe { write_c_string(&last_error(), buf, len) }))
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
