//! Peer access on several simulated devices: a [`DeviceRegistry`] of four
//! devices with [`PeerAccess::AllDevices`] makes every mapping of every
//! device's Quilt allocator (and communication allocator) accessible from all
//! four, checked page by page through the simulated device's access record;
//! the calls are the same as without peers, and the modelled cost grows by
//! exactly the cost model's figure per extra device of each set-access.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, Mutex};

use quilt_alloc::comm::CommConfig;
use quilt_alloc::quilt::QuiltConfig;
use quilt_alloc::registry::{DeviceRegistry, PeerAccess, VmmFactory};
use quilt_alloc::{Allocation, DeviceAllocator};
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, DeviceOrdinal, DeviceSet, DriverStats, StreamId, Vmm};

const MIB: u64 = 1 << 20;
const DEVICES: u32 = 4;

type Opened = Arc<Mutex<Vec<(DeviceOrdinal, Arc<SimVmm>)>>>;

/// A registry over `DEVICES` simulated devices, and the devices it opened.
fn registry(peers: PeerAccess) -> (DeviceRegistry, Opened) {
    let opened: Opened = Arc::default();
    let record = opened.clone();
    let factory: VmmFactory = Box::new(move |ordinal| {
        let sim = Arc::new(SimVmm::new(SimConfig {
            capacity: 2 << 30,
            device_count: DEVICES,
            ordinal,
            ..SimConfig::default()
        })?);
        record.lock().unwrap().push((ordinal, sim.clone()));
        Ok(sim as Arc<dyn Vmm>)
    });
    let reg = DeviceRegistry::new(
        DEVICES,
        factory,
        QuiltConfig::default(),
        CommConfig::default(),
        peers,
    )
    .unwrap();
    (reg, opened)
}

fn sim_of(opened: &Opened, device: DeviceOrdinal) -> Arc<SimVmm> {
    opened
        .lock()
        .unwrap()
        .iter()
        .find(|(d, _)| *d == device)
        .map(|(_, s)| s.clone())
        .unwrap()
}

/// The same mixed workload on one device's Quilt allocator: sizes from
/// 1 MiB to 40 MiB on three streams, some freed and reallocated (stitched
/// from cached pages). Returns the live allocations.
fn workload(alloc: &dyn DeviceAllocator) -> Vec<Allocation> {
    let mut live = Vec::new();
    for i in 0..24u64 {
        let size = (1 + (i * 7) % 40) * MIB + (i % 3) * 4096;
        live.push(alloc.allocate(size, StreamId(i % 3)).unwrap());
        if i % 4 == 3 {
            let gone = live.remove((i as usize / 2) % live.len());
            alloc.free(gone.ptr).unwrap();
        }
        alloc.check_invariants().unwrap();
    }
    live
}

/// Every page under `a` is accessible from exactly `devices`.
#[track_caller]
fn assert_access(sim: &SimVmm, a: &Allocation, devices: &[DeviceOrdinal]) {
    let page = sim.granularity();
    let mut at = a.ptr - a.ptr % page;
    while at < a.ptr + a.size {
        assert_eq!(
            sim.devices_with_access(at).as_deref(),
            Some(devices),
            "page {at:#x} of allocation {:#x}+{:#x}",
            a.ptr,
            a.size
        );
        at += page;
    }
}

#[test]
fn peer_every_mapping_of_every_device_is_accessible_from_every_peer() {
    let (reg, opened) = registry(PeerAccess::AllDevices);
    assert!(reg.opened().is_empty(), "nothing is opened before use");
    // Concurrent first use: one allocator per device, whoever asks.
    let allocs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2 * DEVICES)
            .map(|i| {
                let reg = &reg;
                s.spawn(move || reg.quilt(i % DEVICES).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for i in 0..DEVICES as usize {
        assert!(Arc::ptr_eq(&allocs[i], &allocs[i + DEVICES as usize]));
    }
    assert_eq!(
        opened.lock().unwrap().len(),
        DEVICES as usize,
        "one backend each"
    );
    assert!(reg.quilt(DEVICES).is_err());

    for d in 0..DEVICES {
        let sim = sim_of(&opened, d);
        let quilt = reg.quilt(d).unwrap();
        let live = workload(quilt.as_ref());
        let expected = DeviceSet::all(DEVICES).access_list(d);
        assert_eq!(expected[0], d, "this device first, then its peers");
        for a in &live {
            assert_access(&sim, a, &expected);
        }
        // A communication buffer too.
        let comm = reg.comm(d).unwrap();
        let buf = comm.allocate(5 * MIB, StreamId(0)).unwrap();
        assert_access(&sim, &buf, &expected);
        comm.free(buf.ptr).unwrap();
        for a in live {
            quilt.free(a.ptr).unwrap();
        }
        quilt.check_invariants().unwrap();
        sim.check_invariants().unwrap();
    }
}

#[test]
fn peer_access_costs_what_the_cost_model_says_and_nothing_else() {
    let stats_of = |peers: PeerAccess| -> DriverStats {
        let (reg, opened) = registry(peers);
        let quilt = reg.quilt(1).unwrap();
        let live = workload(quilt.as_ref());
        let sim = sim_of(&opened, 1);
        let expected = match peers {
            PeerAccess::None => vec![1],
            _ => vec![1, 0, 2, 3],
        };
        for a in &live {
            assert_access(&sim, a, &expected);
        }
        assert_eq!(reg.opened(), vec![1], "only the device asked for");
        sim.driver_stats()
    };
    let alone = stats_of(PeerAccess::None);
    let shared = stats_of(PeerAccess::AllDevices);
    assert_eq!(alone.calls, shared.calls, "the same calls, peers or not");
    let set_access = shared.count(CallKind::SetAccess);
    assert!(set_access > 0);
    let cost = SimConfig::default().cost;
    assert_eq!(
        shared.modelled_ns - alone.modelled_ns,
        set_access * (cost.set_access_ns_for(DEVICES as u64) - cost.set_access_ns),
        "each set-access pays for its three extra devices"
    );
    assert_eq!(
        cost.set_access_ns_for(4),
        cost.set_access_ns + 3 * cost.set_access_per_peer_ns
    );
}

#[test]
fn peer_sets_and_registry_errors() {
    // A chosen peer set: device 0 and 2 reach device 2's memory, 3 does not.
    let (reg, opened) = registry(PeerAccess::Devices(DeviceSet::of(&[0, 2]).unwrap()));
    assert_eq!(reg.peers_of(2).to_vec(), vec![0]);
    assert_eq!(reg.peers_of(1).to_vec(), vec![0, 2]);
    let quilt = reg.quilt(2).unwrap();
    let a = quilt.allocate(3 * MIB, StreamId(0)).unwrap();
    assert_access(&sim_of(&opened, 2), &a, &[2, 0]);
    quilt.free(a.ptr).unwrap();
    // Registries that cannot work are refused up front.
    let none: VmmFactory = Box::new(|_| unreachable!("never opened"));
    assert!(DeviceRegistry::new(
        0,
        none,
        QuiltConfig::default(),
        CommConfig::default(),
        PeerAccess::None
    )
    .is_err());
    let none: VmmFactory = Box::new(|_| unreachable!("never opened"));
    assert!(DeviceRegistry::new(
        2,
        none,
        QuiltConfig::default(),
        CommConfig::default(),
        PeerAccess::Devices(DeviceSet::of(&[5]).unwrap())
    )
    .is_err());
    // A factory whose device disagrees with the ordinal asked for.
    let wrong: VmmFactory =
        Box::new(|_| Ok(Arc::new(SimVmm::with_capacity(1 << 30)?) as Arc<dyn Vmm>));
    let reg = DeviceRegistry::new(
        2,
        wrong,
        QuiltConfig::default(),
        CommConfig::default(),
        PeerAccess::AllDevices,
    )
    .unwrap();
    assert!(reg.quilt(1).is_err(), "ordinal 0 opened for device 1");
    assert!(
        reg.quilt(0).is_err(),
        "a one-device backend cannot grant peers"
    );
}

/// One step of a generated workload: allocate `size` MiB (plus `extra`
/// bytes) on a stream, or free the `index`th live allocation.
#[derive(Clone, Debug)]
enum Op {
    Alloc { mib: u64, extra: u64, stream: u64 },
    Free { index: usize },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (1u64..48, 0u64..4096, 0u64..3).prop_map(|(mib, extra, stream)| Op::Alloc { mib, extra, stream }),
        2 => any::<usize>().prop_map(|index| Op::Free { index }),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]

    /// Any device count, any peer set, any workload: every page of every live
    /// allocation is accessible from exactly this device and its peers, after
    /// every operation, and the calls match a run without peers.
    #[test]
    fn peer_access_holds_for_any_workload_and_peer_set(
        devices in 1u32..7,
        mask in 0u64..64,
        device in 0u32..7,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let device = device % devices;
        let peers = DeviceSet::of(&(0..devices).filter(|d| mask & (1 << d) != 0).collect::<Vec<_>>()).unwrap();
        let run = |peer_access: PeerAccess| {
            let opened: Opened = Arc::default();
            let record = opened.clone();
            let factory: VmmFactory = Box::new(move |ordinal| {
                let sim = Arc::new(SimVmm::new(SimConfig {
                    capacity: 1 << 30,
                    device_count: devices,
                    ordinal,
                    ..SimConfig::default()
                })?);
                record.lock().unwrap().push((ordinal, sim.clone()));
                Ok(sim as Arc<dyn Vmm>)
            });
            let reg = DeviceRegistry::new(devices, factory, QuiltConfig::default(), CommConfig::default(), peer_access).unwrap();
            let quilt = reg.quilt(device).unwrap();
            let sim = sim_of(&opened, device);
            let expected = reg.peers_of(device).access_list(device);
            let mut live: Vec<Allocation> = Vec::new();
            for op in &ops {
                match *op {
                    Op::Alloc { mib, extra, stream } => {
                        // Out of memory is a fine answer at 1 GiB; anything else is not.
                        match quilt.allocate(mib * MIB + extra, StreamId(stream)) {
                            Ok(a) => live.push(a),
                            Err(e) => assert!(matches!(e, quilt_alloc::AllocError::OutOfMemory(_)), "{e}"),
                        }
                    }
                    Op::Free { index } if !live.is_empty() => {
                        let a = live.swap_remove(index % live.len());
                        quilt.free(a.ptr).unwrap();
                    }
                    Op::Free { .. } => {}
                }
                quilt.check_invariants().unwrap();
                for a in &live {
                    assert_access(&sim, a, &expected);
                }
            }
            sim.check_invariants().unwrap();
            sim.driver_stats()
        };
        let with_peers = run(PeerAccess::Devices(peers));
        let alone = run(PeerAccess::None);
        proptest::prop_assert_eq!(with_peers.calls, alone.calls);
        let extra = peers.without(device).len() as u64;
        let cost = SimConfig::default().cost;
        proptest::prop_assert_eq!(
            with_peers.modelled_ns - alone.modelled_ns,
            with_peers.count(CallKind::SetAccess) * extra * cost.set_access_per_peer_ns
        );
    }
}
