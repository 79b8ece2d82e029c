//! What peer access costs on the simulated backend: the same workload on
//! device 0 of a registry of 1, 2, 4 and 8 simulated devices, every mapping
//! made accessible from every device ([`PeerAccess::AllDevices`]). Prints one
//! Markdown row per device count: set-access calls, every VMM call, and the
//! modelled driver time, in total and in set-access (the cost model's
//! `set_access_ns + (devices - 1) * set_access_per_peer_ns` per call: an
//! estimate, not a measurement).
//!
//! `cargo run --release -p quilt-alloc --example peer_cost`

use std::sync::{Arc, Mutex};

use quilt_alloc::comm::CommConfig;
use quilt_alloc::quilt::QuiltConfig;
use quilt_alloc::registry::{DeviceRegistry, PeerAccess, VmmFactory};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("| devices | set-access calls | VMM calls | modelled ms | of which set-access ms |");
    println!("|---:|---:|---:|---:|---:|");
    for devices in [1u32, 2, 4, 8] {
        let device0: Arc<Mutex<Option<Arc<SimVmm>>>> = Arc::default();
        let keep = device0.clone();
        let factory: VmmFactory = Box::new(move |ordinal| {
            let sim = Arc::new(SimVmm::new(SimConfig {
                capacity: 8 << 30,
                device_count: devices,
                ordinal,
                ..SimConfig::default()
            })?);
            if ordinal == 0 {
                if let Ok(mut slot) = keep.lock() {
                    *slot = Some(sim.clone());
                }
            }
            Ok(sim as Arc<dyn Vmm>)
        });
        let reg = DeviceRegistry::new(
            devices,
            factory,
            QuiltConfig::default(),
            CommConfig::default(),
            PeerAccess::AllDevices,
        )?;
        let quilt = reg.quilt(0)?;
        // A churn of 2000 allocations of 1 to 64 MiB on two streams, 64 live.
        let mut live = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let size = (1 + x % 64) * MIB;
            live.push(quilt.allocate(size, StreamId(i % 2))?.ptr);
            if live.len() > 64 {
                let at = (x as usize / 7) % live.len();
                quilt.free(live.swap_remove(at))?;
            }
        }
        for p in live {
            quilt.free(p)?;
        }
        quilt.check_invariants()?;
        let sim = device0
            .lock()
            .map_err(|_| "poisoned")?
            .clone()
            .ok_or("device 0 was not opened")?;
        let stats = sim.driver_stats();
        let cost = &sim.config().cost;
        let set_access = stats.count(CallKind::SetAccess);
        let set_access_ns = set_access * cost.set_access_ns_for(u64::from(devices));
        println!(
            "| {devices} | {set_access} | {} | {:.1} | {:.1} |",
            stats.vmm_calls(),
            stats.modelled_ns as f64 / 1e6,
            set_access_ns as f64 / 1e6
        );
    }
    Ok(())
}
