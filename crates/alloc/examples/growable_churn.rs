//! A churn of growing KV caches on the simulated 80 GiB device (the GPU 64
//! operations behind the host): 64 requests at a time, each a growable
//! buffer of at most 1 GiB grown 640 KiB per step to a random length of 32
//! to 800 MiB, then released and replaced; 20 000 steps. One line per
//! policy (map-ahead off / inline up to 1 or 8 pages / the default worker,
//! up to 8 pages; pages ahead only from free pool pages; released
//! ranges recycled or not): the share of grows that found their pages
//! mapped, VMM calls, maps, syncs, waits, modelled driver time, efficiency
//! (peak allocated / peak reserved) and host ns per `grow_to`.
//!
//! `cargo run --release -p quilt-alloc --example growable_churn`

use std::sync::Arc;
use std::time::Instant;

use quilt_alloc::quilt::{
    AheadMode, GrowableBuffer, MapAhead, QuiltAllocator, QuiltConfig, Recycle,
};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

fn run(ahead: MapAhead, recycle: Recycle, label: &str) -> Result<(), Box<dyn std::error::Error>> {
    let sim = Arc::new(SimVmm::new(SimConfig {
        gpu_lag_ops: 64,
        ..SimConfig::default()
    })?);
    let alloc = Arc::new(QuiltAllocator::new(sim.clone(), QuiltConfig::default())?);
    alloc.set_map_ahead(ahead)?;
    alloc.set_recycle(recycle)?;
    let mut x: u64 = 12345;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    // (buffer, length, target length)
    let mut live: Vec<(GrowableBuffer, u64, u64)> = Vec::new();
    let (mut grows, mut ns, mut peak_allocated) = (0u64, 0u128, 0u64);
    for _ in 0..20_000 {
        sim.advance(1);
        if live.len() < 64 {
            let target = (64 + next() % 1536) * MIB / 2;
            let kv = GrowableBuffer::new(alloc.clone(), 1024 * MIB, StreamId::DEFAULT)?;
            live.push((kv, 0, target));
        }
        let i = (next() % live.len() as u64) as usize;
        let (kv, len, target) = &mut live[i];
        if *len >= *target {
            live.swap_remove(i);
            continue;
        }
        let to = (*len + 640 * 1024).min(*target);
        let started = Instant::now();
        kv.grow_to(to)?;
        ns += started.elapsed().as_nanos();
        grows += 1;
        *len = to;
        peak_allocated = peak_allocated.max(alloc.stats().allocated_bytes.current);
    }
    let st = alloc.serving_stats();
    let d = sim.driver_stats();
    let peak_reserved = alloc.stats().reserved_bytes.peak;
    println!(
        "{label}: {grows} grows, {:.3} already mapped, {} VMM calls ({:.3} per grow), {} maps, \
         {} syncs, {} waits, driver {:.1} ms, efficiency {:.4} ({:.2} / {:.2} GiB), {} host ns per grow",
        st.grows_already_mapped as f64 / st.grows.max(1) as f64,
        d.vmm_calls(),
        d.vmm_calls() as f64 / grows.max(1) as f64,
        d.count(CallKind::Map),
        d.count(CallKind::StreamSynchronize),
        d.count(CallKind::StreamWaitEvent),
        d.modelled_ns as f64 / 1e6,
        peak_allocated as f64 / peak_reserved.max(1) as f64,
        peak_allocated as f64 / GIB,
        peak_reserved as f64 / GIB,
        ns / u128::from(grows.max(1)),
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Map-ahead as by default (pages only from free pool pages), inline
    // with two bounds, and the default worker.
    let inline = |pages| MapAhead {
        pages,
        mode: AheadMode::Inline,
        ..MapAhead::default()
    };
    for (recycle, name) in [
        (Recycle::OFF, "recycle off"),
        (Recycle { max_buffers: 64 }, "recycle 64 "),
    ] {
        run(MapAhead::OFF, recycle, &format!("{name}, map-ahead off  "))?;
        run(inline(1), recycle, &format!("{name}, inline up to 1 "))?;
        run(inline(8), recycle, &format!("{name}, inline up to 8 "))?;
        run(
            MapAhead::default(),
            recycle,
            &format!("{name}, background 8  "),
        )?;
    }
    Ok(())
}
