//! Fragmentation on the simulated device: the same requests on the same
//! capacity (1 GiB) to PyTorch's classic caching allocator and to Quilt.
//!
//! 255 blocks of 4 MiB fill the device (classic packs five in each 20 MiB
//! segment); every other one is freed, leaving about half the memory free
//! but in 4 MiB holes, no segment empty. Then one 256 MiB request: classic
//! needs 256 MiB contiguous in one segment and the device has no room for a
//! new one, so it runs out of memory; Quilt maps free pages behind a new
//! virtual range and serves it.
//!
//! ```sh
//! cargo run --release -p quilt-alloc --example fragmentation
//! ```
//!
//! Prints both outcomes; exits 0 only if classic failed with out-of-memory
//! and Quilt succeeded.

use std::error::Error;
use std::sync::Arc;

use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, Allocation, DeviceAllocator};
use quilt_vmm::{sim::SimVmm, StreamId, Vmm};

const MIB: u64 = 1 << 20;
/// The simulated device's memory.
pub const CAPACITY: u64 = 1 << 30;
/// Size of each small block.
const SMALL: u64 = 4 * MIB;
/// Small blocks allocated (1020 MiB: 51 of classic's 20 MiB segments).
const COUNT: usize = 255;
/// The large request made after every other small block is freed.
pub const LARGE: u64 = 256 * MIB;

/// Run the pattern on `alloc`: the large request's outcome, with every
/// block freed afterwards and the invariants checked.
pub fn run(alloc: &dyn DeviceAllocator) -> Result<Result<Allocation, AllocError>, Box<dyn Error>> {
    let s = StreamId::DEFAULT;
    let mut small = Vec::with_capacity(COUNT);
    for _ in 0..COUNT {
        small.push(alloc.allocate(SMALL, s)?);
    }
    for b in small.iter().step_by(2) {
        alloc.free(b.ptr)?;
    }
    let large = alloc.allocate(LARGE, s);
    alloc.check_invariants()?;
    if let Ok(l) = &large {
        alloc.free(l.ptr)?;
    }
    for b in small.iter().skip(1).step_by(2) {
        alloc.free(b.ptr)?;
    }
    alloc.check_invariants()?;
    Ok(large)
}

/// Classic's and Quilt's outcomes, each on its own 1 GiB simulated device.
pub fn outcomes() -> Result<[Result<Allocation, AllocError>; 2], Box<dyn Error>> {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(CAPACITY)?);
    let classic = run(&CachingAllocator::new(vmm, CachingConfig::classic())?)?;
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(CAPACITY)?);
    let quilt = run(&QuiltAllocator::new(vmm, QuiltConfig::default())?)?;
    Ok([classic, quilt])
}

/// Runs both allocators and prints their outcomes; an error unless the claim held.
pub fn main() -> Result<(), Box<dyn Error>> {
    println!(
        "{COUNT} blocks of {} MiB on a {} MiB device, every other one freed, then {} MiB:",
        SMALL / MIB,
        CAPACITY / MIB,
        LARGE / MIB
    );
    let [classic, quilt] = outcomes()?;
    for (name, outcome) in [("classic", &classic), ("quilt", &quilt)] {
        match outcome {
            Ok(a) => println!("  {name}: served, {} MiB at {:#x}", a.size / MIB, a.ptr),
            Err(e) => println!("  {name}: failed: {e}"),
        }
    }
    let held = matches!(classic, Err(AllocError::OutOfMemory(_))) && quilt.is_ok();
    if !held {
        return Err(
            "the claim did not hold: expected classic out of memory and Quilt served".into(),
        );
    }
    println!("the claim held: classic ran out of memory where Quilt served the request");
    Ok(())
}
