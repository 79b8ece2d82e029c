//! The example of docs/library.md, on the simulated device (80 GiB, no GPU needed):
//! Quilt behind the `DeviceAllocator` trait, a block by address, an owning
//! `Buffer`, and the memory summary.
//!
//! ```sh
//! cargo run --release -p quilt-alloc --example readme
//! ```

use std::error::Error;
use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{Buffer, DeviceAllocator};
use quilt_vmm::{sim::SimVmm, StreamId, Vmm};

/// Runs the example; an error if anything is left allocated.
pub fn main() -> Result<(), Box<dyn Error>> {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(80 << 30)?);
    let alloc = Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
    let block = alloc.allocate(300 << 20, StreamId::DEFAULT)?;
    alloc.free(block.ptr)?;

    // An owning buffer: freed when dropped (or by `free()`, with its error).
    let buf = Buffer::new(alloc.clone(), 300 << 20, StreamId::DEFAULT)?;
    buf.record_stream(StreamId(7))?; // also used on stream 7
    println!("buffer: {} bytes at {:#x}", buf.size(), buf.ptr());
    println!("{}", alloc.memory_summary());
    drop(buf);
    alloc.check_invariants()?;
    let stats = alloc.stats();
    if stats.allocated_bytes.current != 0 {
        return Err(format!("{} bytes still allocated", stats.allocated_bytes.current).into());
    }
    println!(
        "ok: everything freed, {} bytes cached for reuse",
        stats.reserved_bytes.current
    );
    Ok(())
}
