//! Serving with Quilt, on real bytes (the host backend): model weights under
//! a tag, one growable KV cache per request grown as tokens arrive, the
//! weights put to sleep while another model uses the device, then woken at
//! the same addresses with every byte intact.
//!
//! `cargo run --release -p quilt-alloc --example serving`

use std::sync::Arc;

use quilt_alloc::quilt::{
    AheadMode, GrowableBuffer, MapAhead, MemoryLimit, QuiltAllocator, QuiltConfig, SleepMode,
};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::{StreamId, Vmm};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Runs the example (also run by the `growable_serving_example_runs` test).
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A 16 MiB "device" of 64 KiB pages, with real bytes.
    let host = Arc::new(HostVmm::new(HostConfig {
        granularity: 64 * KIB,
        capacity: 16 * MIB,
    })?);
    let vmm: Arc<dyn Vmm> = host.clone();
    let config = QuiltConfig::default().with_limit(MemoryLimit::Bytes(16 * MIB));
    let alloc = Arc::new(QuiltAllocator::new(vmm, config)?);
    // Two pages mapped ahead of every KV cache, on this thread (the default
    // maps one page ahead on a background worker).
    alloc.set_map_ahead(MapAhead {
        pages: 2,
        below_per_mille: 900,
        mode: AheadMode::Inline,
    })?;
    let stream = StreamId::DEFAULT;

    // The model's weights, tagged so that they can sleep.
    let weights = alloc.allocate_tagged(6 * MIB, stream, "model-a")?;
    host.fill(weights.ptr, weights.size, 0xA5)?;

    // Four requests, each with a KV cache of at most 2 MiB, grown 16 KiB per
    // token: the address never moves, nothing is copied.
    let mut caches = Vec::new();
    for _ in 0..4 {
        caches.push(GrowableBuffer::new(alloc.clone(), 2 * MIB, stream)?);
    }
    for token in 1..=64u64 {
        for (i, kv) in caches.iter().enumerate() {
            let len = token * 16 * KIB;
            kv.grow_to(len)?;
            host.fill(kv.ptr() + len - 16 * KIB, 16 * KIB, i as u8)?;
        }
    }
    let s = alloc.serving_stats();
    println!(
        "{} grows, {} found their pages already mapped ({} pages mapped ahead, {} on a grow)",
        s.grows, s.grows_already_mapped, s.pages_mapped_ahead, s.pages_mapped_on_grow
    );
    for (i, kv) in caches.iter().enumerate() {
        assert!(host.check_filled(kv.ptr(), kv.len()?, i as u8)?);
    }
    drop(caches); // the requests finish: their pages go back to the pool

    // Switch models: model A sleeps (its bytes go to host memory, its pages
    // to the pool), model B uses the same pages, then A wakes.
    alloc.sleep("model-a", SleepMode::Offload)?;
    let model_b = alloc.allocate(12 * MIB, stream)?;
    host.fill(model_b.ptr, model_b.size, 0x0B)?;
    alloc.free(model_b.ptr)?;
    alloc.wake("model-a")?;
    assert!(host.check_filled(weights.ptr, weights.size, 0xA5)?);
    println!(
        "model-a slept and woke at {:#x}: {} MiB offloaded and restored, every byte intact",
        weights.ptr,
        alloc.serving_stats().bytes_restored / MIB
    );
    alloc.free(weights.ptr)?;
    alloc.check_invariants()?;
    Ok(())
}
