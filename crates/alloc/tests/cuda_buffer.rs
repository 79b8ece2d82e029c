//! `CudaBuffer` with cudarc: cudarc's copies through Quilt buffers across
//! two streams, the typed errors of a wrong backend, stream or length, and
//! the free at drop. Every test runs over the CUDA double
//! (`quilt-cuda-double`, in a child process); `QUILT_CUDA_TESTS=real` runs
//! them on a GPU, where a missing device fails them.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use cudarc::driver::{CudaContext, DeviceSlice};
use quilt_alloc::cuda_buffer::{CudaBuffer, CudaBufferError};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{Buffer, DeviceAllocator};
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

/// The CUDA backend on device 0 and a Quilt allocator on it.
fn quilt_on_gpu() -> (Arc<CudaVmm>, Arc<dyn DeviceAllocator>) {
    let cuda = Arc::new(CudaVmm::new(0).unwrap_or_else(|e| panic!("needs CUDA device 0: {e}")));
    let vmm: Arc<dyn Vmm> = cuda.clone();
    let alloc: Arc<dyn DeviceAllocator> =
        Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap());
    (cuda, alloc)
}

#[test]
fn cudarc_copies_through_quilt_buffers_on_two_streams() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let n = 5 << 20; // 20 MiB of u32: several pages
    let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let mut xs = CudaBuffer::<u32>::new(alloc.clone(), &cuda, s1.clone(), n).unwrap();
    let mut ys = CudaBuffer::<u32>::new(alloc.clone(), &cuda, s2.clone(), n).unwrap();
    assert_eq!(
        (xs.len(), xs.stream_id()),
        (n, StreamId(s1.cu_stream() as u64))
    );
    s1.memcpy_htod(&data, &mut xs).unwrap();
    // On s2: waits for the copy on s1 (xs's write event), then copies.
    s2.memcpy_dtod(&xs, &mut ys).unwrap();
    // Back on s1: waits for s2's copy (ys's write event).
    let back = s1.clone_dtoh(&ys).unwrap();
    assert!(back == data, "the data came back different");
    drop(xs);
    drop(ys);
    ctx.synchronize().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn wrong_backend_stream_or_length_is_a_typed_error() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    // An allocator on another backend.
    let sim: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
    let on_sim: Arc<dyn DeviceAllocator> =
        Arc::new(QuiltAllocator::new(sim, QuiltConfig::default()).unwrap());
    let r = CudaBuffer::<u8>::new(on_sim.clone(), &cuda, stream.clone(), 16);
    assert!(matches!(r, Err(CudaBufferError::OtherBackend)), "{r:?}");
    assert_eq!(on_sim.stats().allocation.current, 0);
    // A buffer of another stream.
    let buf = Buffer::new(alloc.clone(), 1 << 20, StreamId::DEFAULT).unwrap();
    let r = CudaBuffer::<u8>::from_buffer(buf, &cuda, stream.clone(), 16);
    assert!(
        matches!(r, Err(CudaBufferError::OtherStream { .. })),
        "{r:?}"
    );
    // More elements than the buffer holds, and a size that overflows.
    let id = cuda.adopt_cudarc_stream(&stream).unwrap();
    let buf = Buffer::new(alloc.clone(), 1 << 20, id).unwrap();
    let r = CudaBuffer::<u64>::from_buffer(buf, &cuda, stream.clone(), (1 << 17) + 1);
    assert!(matches!(r, Err(CudaBufferError::TooShort { .. })), "{r:?}");
    let r = CudaBuffer::<u64>::new(alloc.clone(), &cuda, stream.clone(), usize::MAX);
    assert!(matches!(r, Err(CudaBufferError::TooShort { .. })), "{r:?}");
    // Nothing was kept by the failures.
    assert_eq!(alloc.stats().allocation.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn into_buffer_gives_the_block_back_untyped() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let (cuda, alloc) = quilt_on_gpu();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut xs = CudaBuffer::<f32>::new(alloc.clone(), &cuda, stream.clone(), 1000).unwrap();
    stream.memcpy_htod(&[1.5f32; 1000], &mut xs).unwrap();
    let ptr = xs.buffer().unwrap().ptr();
    let buf = xs.into_buffer().unwrap();
    assert_eq!(
        (buf.ptr(), buf.stream()),
        (ptr, cuda.adopt_cudarc_stream(&stream).unwrap())
    );
    buf.free().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(alloc.stats().allocation.current, 0);
}
