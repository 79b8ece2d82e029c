//! Quilt next to a program's own cudarc (CUDA 12.6 bindings): the CUDA
//! backend is there, on the program's choice of version.

use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::{StreamId, Vmm};

fn main() {
    // The program's own use of cudarc.
    // SAFETY: `is_culib_present` only tries to load libcuda by its names; it
    // calls no CUDA function.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    println!("libcuda present: {present}");
    match quilt_vmm::cuda::CudaVmm::new(0) {
        Ok(cuda) => {
            let vmm: Arc<dyn Vmm> = Arc::new(cuda);
            let alloc = QuiltAllocator::new(vmm, QuiltConfig::default()).expect("allocator");
            let block = alloc
                .allocate(1 << 20, StreamId::DEFAULT)
                .expect("allocate");
            alloc.free(block.ptr).expect("free");
            println!("allocated and freed 1 MiB on the GPU");
        }
        Err(e) => println!("no CUDA here: {e}"),
    }
}
