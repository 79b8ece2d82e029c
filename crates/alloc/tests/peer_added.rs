//! A peer device given access at run time (`QuiltAllocator::add_peer_access`,
//! what PyTorch's `enablePeerAccess` asks of an allocator): every page
//! mapped before has the peer's access afterwards, every page mapped later
//! has it from its mapping, on simulated devices.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, DeviceSet, StreamId, Vmm};

const MIB: u64 = 1 << 20;

fn device(ordinal: u32) -> Arc<SimVmm> {
    Arc::new(
        SimVmm::new(SimConfig {
            capacity: 1 << 30,
            device_count: 4,
            ordinal,
            ..SimConfig::default()
        })
        .unwrap(),
    )
}

/// The devices with access to each page of `ptr..ptr + size`, in order.
fn access(sim: &SimVmm, page: u64, ptr: u64, size: u64) -> Vec<Option<Vec<u32>>> {
    let mut at = ptr - ptr % page;
    let mut out = Vec::new();
    while at < ptr + size {
        out.push(sim.devices_with_access(at).map(|mut d| {
            d.sort_unstable();
            d
        }));
        at += page;
    }
    out
}

#[test]
fn a_peer_added_at_run_time_reaches_every_mapping_before_and_after() {
    let sim = device(1);
    let quilt = QuiltAllocator::new(sim.clone(), QuiltConfig::default()).unwrap();
    let page = quilt.pool_stats().page_size;
    let s = StreamId::DEFAULT;
    let before: Vec<_> = [3 * MIB, 512, 7 * MIB + 5]
        .iter()
        .map(|&n| quilt.allocate(n, s).unwrap())
        .collect();
    quilt.free(before[1].ptr).unwrap(); // its page stays mapped (cached)
    for b in &before {
        assert!(access(&sim, page, b.ptr, b.size)
            .iter()
            .all(|a| a.as_deref() == Some(&[1][..])));
    }

    quilt.add_peer_access(3).unwrap();
    assert_eq!(quilt.config().peer_access, DeviceSet::of(&[3]).unwrap());
    for b in &before {
        assert!(
            access(&sim, page, b.ptr, b.size)
                .iter()
                .all(|a| a.as_deref() == Some(&[1, 3][..])),
            "block {:#x} mapped before: {:?}",
            b.ptr,
            access(&sim, page, b.ptr, b.size)
        );
    }
    let after = quilt.allocate(20 * MIB, s).unwrap();
    assert!(access(&sim, page, after.ptr, after.size)
        .iter()
        .all(|a| a.as_deref() == Some(&[1, 3][..])));

    // Again: nothing to do, no driver call.
    let calls = sim.driver_stats().count(CallKind::SetAccess);
    quilt.add_peer_access(3).unwrap();
    assert_eq!(sim.driver_stats().count(CallKind::SetAccess), calls);
    // A second peer joins the first.
    quilt.add_peer_access(0).unwrap();
    assert!(access(&sim, page, after.ptr, after.size)
        .iter()
        .all(|a| a.as_deref() == Some(&[0, 1, 3][..])));

    // Itself, or a device the driver does not have: refused.
    for bad in [1, 4, 64] {
        assert!(
            matches!(
                quilt.add_peer_access(bad),
                Err(AllocError::InvalidConfig { .. })
            ),
            "{bad}"
        );
    }
    quilt.free(after.ptr).unwrap();
    quilt.free(before[0].ptr).unwrap();
    quilt.free(before[2].ptr).unwrap();
    quilt.check_invariants().unwrap();
}
