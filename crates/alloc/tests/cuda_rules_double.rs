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
