//! Quilt next to a program's own cudarc (CUDA 12.6 bindings): the CUDA
//! backend is there, on the program's choice of version, and Quilt memory
//! goes to cudarc as a device slice (`CudaBuffer`) ordered on the program's
//! cudarc streams (`adopt_cudarc_stream`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut, DeviceSlice};
use quilt_alloc::cuda_buffer::CudaBuffer;
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::{StreamId, Vmm};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The program's own use of cudarc.
    // SAFETY: `is_culib_present` only tries to load libcuda by its names; it
    // calls no CUDA function.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    println!("libcuda present: {present}");
    let cuda = match quilt_vmm::cuda::CudaVmm::new(0) {
        Ok(cuda) => Arc::new(cuda),
        Err(e) => {
            println!("no CUDA here: {e}");
            return Ok(());
        }
    };
    let vmm: Arc<dyn Vmm> = cuda.clone();
    let alloc: Arc<dyn DeviceAllocator> =
        Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
    let block = alloc.allocate(1 << 20, StreamId::DEFAULT)?;
    alloc.free(block.ptr)?;
    println!("allocated and freed 1 MiB on the GPU");

    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let other = ctx.new_stream()?;
    let id = cuda.adopt_cudarc_stream(&stream)?;
    let mut xs = CudaBuffer::<u64>::new(alloc.clone(), &cuda, stream.clone(), 1000)?;
    assert_eq!((xs.len(), xs.stream_id()), (1000, id));
    stream.memcpy_htod(&(0..1000).collect::<Vec<u64>>(), &mut xs)?;
    {
        // Used on another cudarc stream: ordered after the copy.
        let (_ptr, _write) = xs.device_ptr_mut(&other);
    }
    {
        let (_ptr, _read) = xs.device_ptr(&other);
    }
    let back = stream.clone_dtoh(&xs)?;
    if back.iter().copied().ne(0..1000) {
        return Err("the copy through a Quilt CudaBuffer came back different".into());
    }
    drop(xs);
    println!("copied 1000 u64 through a Quilt buffer on cudarc streams");
    Ok(())
}
