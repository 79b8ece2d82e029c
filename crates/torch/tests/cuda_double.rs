//! The PyTorch library with `backend:cuda` over the strict CUDA double
//! (`quilt-cuda-double`, in a child process), as PyTorch calls it: from 8
//! threads at once, on the legacy stream (`NULL` and `0x1`), each thread's
//! per-thread default stream (`0x2`) and streams of their own, with work
//! queued on each block's stream before its stream-ordered free (the double
//! runs it late), blocks used on a second stream (`quilt_record_stream`),
//! and device memory read and written directly (a device address is a host
//! address on the double). Every block's bytes are checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::ffi::c_void;

use cudarc::driver::sys;
use quilt_cuda_double::harness::driver::bind_primary;
use quilt_torch::ffi::{
    quilt_forget_stream, quilt_free, quilt_malloc, quilt_record_stream, quilt_stats_json,
};

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn last_error() -> String {
    quilt_torch::last_error()
}

/// One thread's run: `rounds` blocks over its four streams (with `legacy`,
/// `NULL` and `0x1` among them; without, its per-thread and own streams
/// only, so that no legacy-stream work orders the threads' streams).
fn client(thread: u8, rounds: usize, legacy: bool) {
    bind_primary();
    let mut own: sys::CUstream = std::ptr::null_mut();
    // SAFETY: a context is current; valid out-pointer.
    ok(
        unsafe { sys::cuStreamCreate(&mut own, 1) },
        "cuStreamCreate",
    );
    let streams: [sys::CUstream; 4] = if legacy {
        [
            std::ptr::null_mut(),
            0x1 as sys::CUstream,
            0x2 as sys::CUstream,
            own,
        ]
    } else {
        [0x2 as sys::CUstream, own, 0x2 as sys::CUstream, own]
    };
    for i in 0..rounds {
        let stream = streams[i % 4];
        let size = [4096usize, 1 << 20, 3 << 20, 9 << 20][(i / 4) % 4] + 512 * (i % 7);
        let p = quilt_malloc(size, 0, stream.cast());
        assert!(!p.is_null(), "thread {thread} round {i}: {}", last_error());
        let ptr = p as usize as u64;
        let tag = thread.wrapping_mul(31).wrapping_add(i as u8) | 1;
        // Stream-ordered use: a fill queued on the block's stream.
        // SAFETY: `ptr..ptr + size` is the block just allocated.
        ok(
            unsafe { sys::cuMemsetD8Async(ptr, tag, size, stream) },
            "fill",
        );
        if i % 3 == 0 {
            // The host reads and writes the block directly after its stream.
            // Then everything queued anywhere runs: work of a previous owner
            // of the block that the fill was not ordered after would now
            // overwrite it.
            // SAFETY: a stream of the current context; a context is current.
            ok(unsafe { sys::cuStreamSynchronize(stream) }, "sync");
            // SAFETY: as above.
            ok(unsafe { sys::cuCtxSynchronize() }, "context sync");
            // SAFETY: on the double the block is host memory, mapped with
            // access for this live allocation.
            let bytes = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), size) };
            assert!(
                bytes.iter().all(|b| *b == tag),
                "thread {thread} round {i}: the block does not hold its fill"
            );
            bytes[0] = !tag;
            bytes[size - 1] = !tag;
        }
        if i % 5 == 1 {
            // Used on a second stream as well (PyTorch's record_stream).
            let other = streams[(i + 1) % 4];
            // SAFETY: as above.
            ok(
                unsafe { sys::cuMemsetD8Async(ptr + 64, tag, 64, other) },
                "fill on a second stream",
            );
            quilt_record_stream(p, other.cast::<c_void>());
        }
        quilt_free(p, size, 0, stream.cast());
    }
    // The stream goes: Quilt forgets it first, then it is destroyed, and
    // the other threads go on (a later use of the dead handle by Quilt would
    // be CUDA_ERROR_INVALID_HANDLE on the double).
    assert_eq!(quilt_forget_stream(own.cast()), 0, "{}", last_error());
    // SAFETY: the stream made above, forgotten by Quilt.
    ok(
        unsafe { sys::cuStreamDestroy_v2(own) },
        "destroy own stream",
    );
    assert_ne!(
        quilt_forget_stream(std::ptr::null_mut()),
        0,
        "the legacy stream cannot be forgotten"
    );
}

/// The double's rules for these tests.
const RULES: [(&str, &str); 3] = [
    ("QUILT_ALLOC_CONF", "backend:cuda"),
    ("QUILT_CUDA_DOUBLE_MEMORY", "4GiB"),
    // Queued work runs only when waited for: no timing hides a race.
    ("QUILT_CUDA_DOUBLE_LAG", "1000000"),
];

#[test]
fn eight_threads_on_every_kind_of_stream_keep_their_bytes() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&RULES) {
        return;
    }
    eight_threads(true);
}

#[test]
fn eight_threads_on_per_thread_and_own_streams_keep_their_bytes() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&RULES) {
        return;
    }
    eight_threads(false);
}

fn eight_threads(legacy: bool) {
    std::thread::scope(|s| {
        for t in 0..8u8 {
            s.spawn(move || client(t, 120, legacy));
        }
    });
    bind_primary();
    // SAFETY: a context is current.
    ok(unsafe { sys::cuCtxSynchronize() }, "no queued work faulted");
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `buf` is writable for its length.
    let n = unsafe { quilt_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
    let stats: serde_json::Value = serde_json::from_slice(&buf[..n]).unwrap();
    assert_eq!(
        stats["allocated_bytes"]["current"], 0,
        "every block was freed: {stats}"
    );
}
