//! Quilt on the CUDA backend over the CUDA driver double (each test in a
//! child process; `QUILT_CUDA_TESTS=real` runs them on a GPU), where queued
//! work runs late and faults on memory unmapped under it, poisoning the
//! context: the allocator's drop waits for queued work before it unmaps,
//! and two threads' per-thread default streams are two streams, so memory
//! freed on one is not reused on the other before its work is done.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use cudarc::driver::CudaContext;
use quilt_alloc::cuda_buffer::{forget_cudarc_stream, CudaBuffer};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{StreamId, Vmm};

fn quilt_on_gpu() -> (Arc<CudaVmm>, Arc<dyn DeviceAllocator>) {
    let cuda = Arc::new(CudaVmm::new(0).unwrap_or_else(|e| panic!("needs CUDA device 0: {e}")));
    let vmm: Arc<dyn Vmm> = cuda.clone();
    let alloc: Arc<dyn DeviceAllocator> =
        Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap());
    (cuda, alloc)
}

#[test]
fn the_allocators_drop_waits_for_queued_work_before_it_unmaps() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let n = 3 << 20; // 12 MiB of u32
    let data: Vec<u32> = (0..n as u32).collect();
    let mut buf = CudaBuffer::<u32>::new(alloc.clone(), &cuda, stream.clone(), n).unwrap();
    // Queued, not run yet (the double runs work late).
    stream.memcpy_htod(&data, &mut buf).unwrap();
    drop(buf); // freed on its stream: no wait on the host
    drop(alloc); // unmaps every page: only after the copy is done
                 // A copy that had run on unmapped memory would have poisoned the context.
    ctx.synchronize().unwrap();
    cuda.stream_synchronize(StreamId::DEFAULT).unwrap();
    assert!(cuda.leak_report().is_clean(), "{}", cuda.leak_report());
}

#[test]
fn memory_freed_on_one_threads_stream_is_not_reused_under_its_work_on_another() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let n = 1 << 20; // 4 MiB of u32
    let first: Vec<u32> = vec![0xAAAA_AAAA; n];
    let second: Vec<u32> = vec![0x5555_5555; n];
    std::thread::scope(|s| {
        // Thread A writes through its per-thread stream and frees at once.
        s.spawn(|| {
            let stream = ctx.per_thread_stream();
            let mut buf = CudaBuffer::<u32>::new(alloc.clone(), &cuda, stream.clone(), n).unwrap();
            stream.memcpy_htod(&first, &mut buf).unwrap(); // still queued
            drop(buf);
        })
        .join()
        .unwrap();
    });
    // Thread B (this one) allocates the same size on its own per-thread
    // stream and writes; its own stream's work runs first (its
    // synchronisation runs nothing of thread A's stream), then every queued
    // copy runs, and B reads back.
    let stream = ctx.per_thread_stream();
    let mut buf = CudaBuffer::<u32>::new(alloc.clone(), &cuda, stream.clone(), n).unwrap();
    stream.memcpy_htod(&second, &mut buf).unwrap();
    stream.synchronize().unwrap();
    ctx.synchronize().unwrap();
    let back = stream.clone_dtoh(&buf).unwrap();
    assert!(
        back == second,
        "another thread's queued copy landed after this thread's write"
    );
    drop(buf);
    // The cudarc interop forgets the per-thread stream of this thread.
    forget_cudarc_stream(alloc.as_ref(), &cuda, &stream).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn under_relaxed_capture_freed_blocks_wait_for_its_end_and_it_stays_valid() {
    use cudarc::driver::sys::{CUstreamCaptureMode, CUstreamCaptureStatus};
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let (id1, id2) = (
        cuda.adopt_cudarc_stream(&s1).unwrap(),
        cuda.adopt_cudarc_stream(&s2).unwrap(),
    );
    // Two streams in use, and memory freed on each before the capture.
    let a = alloc.allocate(8 << 20, id2).unwrap();
    let b = alloc.allocate(4 << 20, id1).unwrap();
    alloc.free(a.ptr).unwrap();
    alloc.free(b.ptr).unwrap();
    s1.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    assert!(cuda.stream_is_capturing(id1).unwrap());
    assert!(!cuda.stream_is_capturing(id2).unwrap());
    let mut live = Vec::new();
    // Freed during the capture: the graph may use them; never reused in it.
    let mut freed_in_capture: Vec<quilt_alloc::Allocation> = Vec::new();
    let overlaps = |x: &quilt_alloc::Allocation, y: &quilt_alloc::Allocation| {
        x.ptr < y.ptr + y.size && y.ptr < x.ptr + x.size
    };
    for i in 0..12u64 {
        let blk = alloc.allocate((1 + i % 4) << 20, id1).unwrap();
        assert!(
            freed_in_capture.iter().all(|f| !overlaps(f, &blk)),
            "{blk:?} reuses memory freed during the capture"
        );
        live.push(blk);
        if i % 3 == 2 {
            let gone = live.remove(0);
            alloc.free(gone.ptr).unwrap();
            freed_in_capture.push(gone);
        }
    }
    // Over the range freed on the other stream: ordered without a wait by
    // the capturing stream.
    live.push(alloc.allocate(8 << 20, id1).unwrap());
    for blk in live.drain(..) {
        alloc.free(blk.ptr).unwrap();
    }
    alloc.check_invariants().unwrap();
    assert_eq!(
        s1.capture_status().unwrap(),
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE,
        "the allocator invalidated the capture"
    );
    // Ended without instantiating the graph (the double has no graph
    // instantiation; cudarc's `end_capture` instantiates).
    // SAFETY: `s1` is a live stream of this context, capturing; the graph
    // returned is ours and destroyed once, right after.
    let graph = unsafe { cudarc::driver::result::stream::end_capture(s1.cu_stream()) }.unwrap();
    if !graph.is_null() {
        // SAFETY: the graph the capture just produced, destroyed once.
        unsafe { cudarc::driver::result::graph::destroy(graph) }.unwrap();
    }
    // After the capture, the frees deferred during it are carried out.
    let c = alloc.allocate(2 << 20, id1).unwrap();
    alloc.free(c.ptr).unwrap();
    ctx.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    alloc.check_invariants().unwrap();
}
