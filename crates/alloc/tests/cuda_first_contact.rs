//! What breaks where a user first touches the CUDA path, checked over the
//! strict CUDA double (`quilt-cuda-double`, each test in a child process):
//! the per-thread default stream is one stream per thread, nothing is
//! unmapped under queued work (Quilt's drop, the caching baseline's release),
//! and stream capture is respected. Device memory is host memory on the
//! double, so the tests read it directly.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use cudarc::driver::sys;
use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_cuda_double::harness::driver::bind_primary;
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{StreamId, Vmm};

const MIB: u64 = 1 << 20;

/// No queued work runs by itself during a test: only what waits for it
/// makes it run, so an ordering mistake cannot be hidden by timing.
const NEVER_BY_ITSELF: [(&str, &str); 1] = [("QUILT_CUDA_DOUBLE_LAG", "1000000")];

fn over_the_double() -> bool {
    quilt_cuda_double::harness::rerun_over_double_with(&NEVER_BY_ITSELF)
}

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn raw(stream: u64) -> sys::CUstream {
    stream as usize as sys::CUstream
}

/// Queues a fill of `len` bytes of `value` at `ptr` on `stream`.
fn fill_async(ptr: u64, value: u8, len: u64, stream: u64) {
    // SAFETY: `ptr..ptr + len` is a live allocation of the test's.
    ok(
        unsafe { sys::cuMemsetD8Async(ptr, value, len as usize, raw(stream)) },
        "cuMemsetD8Async",
    );
}

fn synchronize_context() -> sys::CUresult {
    // SAFETY: a context is current (bind_primary).
    unsafe { sys::cuCtxSynchronize() }
}

/// Bytes at device address `ptr` (host memory on the double).
fn device_bytes(ptr: u64, len: u64) -> Vec<u8> {
    // SAFETY: on the double a device address is a host address, mapped
    // with access by the allocator for a live allocation of the test's.
    unsafe { std::slice::from_raw_parts(ptr as usize as *const u8, len as usize) }.to_vec()
}

fn quilt(cuda: &Arc<CudaVmm>) -> QuiltAllocator {
    let vmm: Arc<dyn Vmm> = cuda.clone();
    QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap()
}

/// Thread A queues a fill on its per-thread stream and frees the block
/// there; thread B allocates on its own per-thread stream and writes. The
/// two are different streams: B's write must come after A's fill, whether
/// or not B got A's block.
#[test]
fn per_thread_default_streams_are_one_stream_per_thread() {
    if !over_the_double() {
        return;
    }
    let cuda = Arc::new(CudaVmm::new(0).unwrap());
    let alloc = quilt(&cuda);
    let size = 4 * MIB;
    const PER_THREAD: u64 = 0x2;
    let a_ptr = std::thread::scope(|s| {
        s.spawn(|| {
            bind_primary();
            let stream = cuda.adopt_stream(PER_THREAD);
            let a = alloc.allocate(size, stream).unwrap();
            fill_async(a.ptr, 0xAA, size, PER_THREAD);
            alloc.free(a.ptr).unwrap();
            a.ptr
        })
        .join()
        .unwrap()
    });
    let (b_ptr, b_stream) = std::thread::scope(|s| {
        s.spawn(|| {
            bind_primary();
            let stream = cuda.adopt_stream(PER_THREAD);
            let b = alloc.allocate(size, stream).unwrap();
            fill_async(b.ptr, 0x55, size, PER_THREAD);
            // SAFETY: a context is current; 0x2 is this thread's stream.
            ok(
                unsafe { sys::cuStreamSynchronize(raw(PER_THREAD)) },
                "B's stream",
            );
            (b.ptr, stream)
        })
        .join()
        .unwrap()
    });
    bind_primary();
    ok(
        synchronize_context(),
        "everything queued ran without a fault",
    );
    let bytes = device_bytes(b_ptr, size);
    assert!(
        bytes.iter().all(|b| *b == 0x55),
        "thread B's block (reused from A's: {}) was overwritten by A's fill still queued on A's per-thread stream",
        b_ptr == a_ptr
    );
    std::thread::scope(|s| {
        s.spawn(|| {
            bind_primary();
            let _ = b_stream;
            alloc.free(b_ptr).unwrap();
        });
    });
    alloc.check_invariants().unwrap();
}

/// Quilt's drop (with a block freed and one still live, each with a fill
/// still queued) must not unmap before that work is done.
#[test]
fn quilt_drop_waits_for_queued_work_before_unmapping() {
    if !over_the_double() {
        return;
    }
    bind_primary();
    let cuda = Arc::new(CudaVmm::new(0).unwrap());
    let stream = cuda.create_stream().unwrap();
    let alloc = quilt(&cuda);
    let freed = alloc.allocate(8 * MIB, stream).unwrap();
    let live = alloc.allocate(8 * MIB, stream).unwrap();
    fill_async(freed.ptr, 1, 8 * MIB, stream.0);
    fill_async(live.ptr, 2, 8 * MIB, stream.0);
    alloc.free(freed.ptr).unwrap();
    drop(alloc);
    assert_eq!(
        synchronize_context(),
        sys::CUresult::CUDA_SUCCESS,
        "queued work faulted: Quilt unmapped under it at drop"
    );
    cuda.destroy_stream(stream).unwrap();
}

/// The caching baseline's release (`empty_cache`) models `cudaFree`, which
/// synchronises the device: queued work on a freed block completes first.
#[test]
fn caching_release_waits_for_queued_work() {
    if !over_the_double() {
        return;
    }
    bind_primary();
    let cuda = Arc::new(CudaVmm::new(0).unwrap());
    let stream = cuda.create_stream().unwrap();
    let vmm: Arc<dyn Vmm> = cuda.clone();
    let alloc = CachingAllocator::new(vmm, CachingConfig::classic()).unwrap();
    let a = alloc.allocate(8 * MIB, stream).unwrap();
    fill_async(a.ptr, 3, 8 * MIB, stream.0);
    alloc.free(a.ptr).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(
        synchronize_context(),
        sys::CUresult::CUDA_SUCCESS,
        "queued work faulted: the caching baseline released a segment under it"
    );
    drop(alloc);
    cuda.destroy_stream(stream).unwrap();
}

/// Under capture (PyTorch's pattern: the capture in global mode, the
/// allocator called in relaxed mode), Quilt records no event on and queries
/// none for the capturing stream, frees without a driver call (a block
/// freed in the capture may serve the capturing stream again, in stream
/// order, as PyTorch's private pools do), and leaves the capture valid.
#[test]
fn capture_is_respected() {
    if !over_the_double() {
        return;
    }
    bind_primary();
    let cuda = Arc::new(CudaVmm::new(0).unwrap());
    let stream = cuda.create_stream().unwrap();
    let alloc = quilt(&cuda);
    // Warm up: a block freed and reused before the capture.
    let w = alloc.allocate(4 * MIB, stream).unwrap();
    alloc.free(w.ptr).unwrap();
    // SAFETY: a live stream of the current context.
    ok(
        unsafe {
            sys::cuStreamBeginCapture_v2(
                raw(stream.0),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        },
        "begin capture",
    );
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in-out pointer.
    ok(
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
        "relaxed",
    );
    let a = alloc.allocate(4 * MIB, stream).unwrap();
    fill_async(a.ptr, 9, 4 * MIB, stream.0); // captured, never run
    let before = cuda.driver_stats();
    alloc.free(a.ptr).unwrap();
    assert_eq!(
        cuda.driver_stats().calls,
        before.calls,
        "the free under capture made a driver call"
    );
    let b = alloc.allocate(4 * MIB, stream).unwrap();
    alloc.free(b.ptr).unwrap();
    // SAFETY: valid in-out pointer.
    ok(
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
        "back to global",
    );
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the capturing stream and a valid out-pointer.
    ok(
        unsafe { sys::cuStreamEndCapture(raw(stream.0), &mut graph) },
        "end capture: the capture is still valid",
    );
    // SAFETY: the graph just made.
    ok(unsafe { sys::cuGraphDestroy(graph) }, "graph destroy");
    // After the capture, allocation works and reuses memory again.
    let c = alloc.allocate(4 * MIB, stream).unwrap();
    alloc.free(c.ptr).unwrap();
    let stats = cuda.driver_stats();
    assert_eq!(
        stats.failed.iter().sum::<u64>(),
        0,
        "a driver call failed under capture: {stats:?}"
    );
    ok(synchronize_context(), "nothing faulted");
    alloc.check_invariants().unwrap();
    drop(alloc);
    cuda.destroy_stream(stream).unwrap();
}

/// `StreamId(0)` and an adopted `CU_STREAM_LEGACY` (0x1) are one stream.
#[test]
fn the_legacy_stream_has_one_id() {
    if !over_the_double() {
        return;
    }
    let cuda = CudaVmm::new(0).unwrap();
    assert_eq!(cuda.adopt_stream(0x1), StreamId::DEFAULT);
    assert_eq!(cuda.adopt_stream(0), StreamId::DEFAULT);
}
