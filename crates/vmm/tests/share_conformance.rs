//! Conformance of the sharing calls ([`Vmm::create_with`],
//! [`Vmm::export_handle`], [`Vmm::import_handle`], [`Vmm::set_access_for`],
//! [`Vmm::caps`]) on the simulated and host backends: CUDA's rules (a handle
//! exports only as a type requested at create; a device requests only what
//! it reports; set-access names existing devices, once each) with the same
//! typed errors on both, and what sharing means (an import names the same
//! memory: on the host, the same bytes).
//!
//! The CUDA backend's versions of these calls are compile-checked here and
//! run by `scripts/gpu-check.sh` (`cuda_share` test, ignored without a GPU).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::{CostModel, SimConfig, SimVmm};
use quilt_vmm::{CallKind, CreateProps, HandleKind, HandleTypes, ShareableHandle, Vmm, VmmError};

const MIB: u64 = 1 << 20;
const G: u64 = 2 * MIB;

fn sim() -> Arc<SimVmm> {
    Arc::new(
        SimVmm::new(SimConfig {
            capacity: 64 * MIB,
            granularity: G,
            ..SimConfig::default()
        })
        .unwrap(),
    )
}

fn host() -> Arc<HostVmm> {
    Arc::new(
        HostVmm::new(HostConfig {
            granularity: G,
            capacity: 64 * MIB,
        })
        .unwrap(),
    )
}

fn backends() -> Vec<Arc<dyn Vmm>> {
    vec![sim(), host()]
}

const POSIX: CreateProps = CreateProps {
    handle_types: HandleTypes::POSIX_FD,
    gpu_direct_rdma: false,
};

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(result: Result<T, VmmError>, call: CallKind, argument: &str) {
    match result {
        Err(VmmError::InvalidArgument {
            call: c,
            argument: a,
            ..
        }) if c == call && a == argument => {}
        other => panic!("expected InvalidArgument {{ {call}, {argument:?} }}, got {other:?}"),
    }
}

#[test]
fn ipc_export_needs_the_type_requested_at_create() {
    for vmm in backends() {
        let name = vmm.backend_name();
        let plain = vmm.create(G).unwrap();
        assert_invalid(
            vmm.export_handle(plain, HandleKind::PosixFd),
            CallKind::ExportHandle,
            "handleType",
        );
        let shareable = vmm.create_with(G, POSIX).unwrap();
        let exported = vmm.export_handle(shareable, HandleKind::PosixFd).unwrap();
        assert_eq!(exported.kind(), HandleKind::PosixFd, "{name}");
        // FABRIC was not requested (and neither device supports it).
        assert_invalid(
            vmm.export_handle(shareable, HandleKind::Fabric),
            CallKind::ExportHandle,
            "handleType",
        );
        // A released handle exports nothing.
        vmm.release(shareable).unwrap();
        assert_invalid(
            vmm.export_handle(shareable, HandleKind::PosixFd),
            CallKind::ExportHandle,
            "handle",
        );
        vmm.release(plain).unwrap();
        let stats = vmm.driver_stats();
        assert_eq!(stats.count(CallKind::ExportHandle), 4, "{name}");
        assert_eq!(stats.failed[CallKind::ExportHandle.index()], 3, "{name}");
        drop(exported);
        assert_eq!(
            vmm.mem_info().unwrap().free,
            64 * MIB,
            "{name}: nothing held"
        );
    }
}

#[test]
fn ipc_create_refuses_what_the_device_does_not_report() {
    for vmm in backends() {
        let caps = vmm.caps();
        assert!(caps.handle_types.posix_fd && !caps.handle_types.fabric);
        assert_eq!((caps.ordinal, caps.device_count), (0, 1));
        let fabric = CreateProps {
            handle_types: HandleTypes {
                posix_fd: true,
                fabric: true,
            },
            gpu_direct_rdma: false,
        };
        assert_invalid(
            vmm.create_with(G, fabric),
            CallKind::Create,
            "requestedHandleTypes",
        );
        // The production policy asks only for what the device has.
        let preferred = CreateProps::preferred_for(&caps);
        assert_eq!(preferred.handle_types, HandleTypes::POSIX_FD);
        assert_eq!(preferred.gpu_direct_rdma, caps.gpu_direct_rdma_with_vmm);
        let h = vmm.create_with(G, preferred).unwrap();
        vmm.release(h).unwrap();
        // Size rules hold as for a plain create.
        assert_invalid(vmm.create_with(G + 1, POSIX), CallKind::Create, "size");
    }
    // The host reports no GPUDirect RDMA: the flag is refused there.
    let host = host();
    assert!(!host.caps().gpu_direct_rdma_with_vmm);
    assert_invalid(
        host.create_with(
            G,
            CreateProps {
                gpu_direct_rdma: true,
                ..POSIX
            },
        ),
        CallKind::Create,
        "allocFlags.gpuDirectRDMACapable",
    );
}

#[test]
fn ipc_host_import_maps_the_same_bytes_and_outlives_the_exporter() {
    let exporter = host();
    let importer = host(); // another "process": its own arena and ledger
    let h = exporter.create_with(2 * G, POSIX).unwrap();
    let va = exporter.reserve(2 * G, 0).unwrap();
    exporter.map(va, 2 * G, h, 0).unwrap();
    exporter.set_access(va, 2 * G).unwrap();
    exporter.write_bytes(va + G - 3, b"stitched?").unwrap();

    let shared = exporter.export_handle(h, HandleKind::PosixFd).unwrap();
    let imported = importer.import_handle(&shared, 2 * G).unwrap();
    drop(shared); // the import holds its own reference
    let vb = importer.reserve(2 * G, 0).unwrap();
    importer.map(vb, 2 * G, imported, 0).unwrap();
    importer.set_access(vb, 2 * G).unwrap();
    let mut out = [0u8; 9];
    importer.read_bytes(vb + G - 3, &mut out).unwrap();
    assert_eq!(&out, b"stitched?");
    // The exporter lets go entirely; the importer's pages live on.
    exporter.unmap(va, 2 * G).unwrap();
    exporter.release(h).unwrap();
    exporter.address_free(va, 2 * G).unwrap();
    assert!(exporter.leak_report().is_empty());
    importer.write_bytes(vb, b"still here").unwrap();
    let mut out = [0u8; 10];
    importer.read_bytes(vb, &mut out).unwrap();
    assert_eq!(&out, b"still here");
    importer.unmap(vb, 2 * G).unwrap();
    importer.release(imported).unwrap();
    importer.address_free(vb, 2 * G).unwrap();
    assert!(importer.leak_report().is_empty());
    assert_eq!(importer.driver_stats().count(CallKind::ImportHandle), 1);
}

#[test]
fn ipc_host_import_refuses_a_bad_descriptor_or_size() {
    let vmm = host();
    let h = vmm.create_with(G, POSIX).unwrap();
    let shared = vmm.export_handle(h, HandleKind::PosixFd).unwrap();
    assert_invalid(
        vmm.import_handle(&shared, 2 * G),
        CallKind::ImportHandle,
        "size",
    );
    assert_invalid(
        vmm.import_handle(&shared, G + 1),
        CallKind::ImportHandle,
        "size",
    );
    // A descriptor that is not a memfd: a socket.
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let not_memory = ShareableHandle::PosixFd(std::os::fd::OwnedFd::from(a));
    assert_invalid(
        vmm.import_handle(&not_memory, G),
        CallKind::ImportHandle,
        "osHandle",
    );
    // A regular file is not device memory either.
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    let not_memory = ShareableHandle::PosixFd(std::os::fd::OwnedFd::from(file));
    assert_invalid(
        vmm.import_handle(&not_memory, G),
        CallKind::ImportHandle,
        "osHandle",
    );
    // A simulated handle means nothing to the host.
    let s = sim();
    let sh = s.create_with(G, POSIX).unwrap();
    let sim_shared = s.export_handle(sh, HandleKind::PosixFd).unwrap();
    assert_invalid(
        vmm.import_handle(&sim_shared, G),
        CallKind::ImportHandle,
        "shHandleType",
    );
    s.release(sh).unwrap();
    // Nothing was added by the failures; the good import works.
    let (handles, _, _) = (vmm.leak_report().handles.len(), 0, 0);
    assert_eq!(handles, 1);
    let imported = vmm.import_handle(&shared, G).unwrap();
    vmm.release(imported).unwrap();
    vmm.release(h).unwrap();
    assert!(vmm.leak_report().is_empty());
    assert_eq!(vmm.driver_stats().failed[CallKind::ImportHandle.index()], 5);
}

#[test]
fn ipc_sim_import_names_the_same_memory_on_another_device() {
    let a = sim();
    let b = Arc::new(
        SimVmm::new(SimConfig {
            capacity: 64 * MIB,
            granularity: G,
            device_count: 2,
            ordinal: 1,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let h = a.create_with(G, POSIX).unwrap();
    let shared = a.export_handle(h, HandleKind::PosixFd).unwrap();
    assert_invalid(
        b.import_handle(&shared, 2 * G),
        CallKind::ImportHandle,
        "size",
    );
    let imported = b.import_handle(&shared, G).unwrap();
    assert_eq!(a.memory_id(h), b.memory_id(imported));
    assert!(a.memory_id(h).is_some());
    // An imported handle can be exported again as the type it came as.
    assert!(b.export_handle(imported, HandleKind::PosixFd).is_ok());
    b.release(imported).unwrap();
    a.release(h).unwrap();
    assert!(a.leak_report().is_empty() && b.leak_report().is_empty());
    let cost = CostModel::default();
    let d = b.driver_stats();
    assert_eq!(d.count(CallKind::ImportHandle), 2);
    assert_eq!(
        d.modelled_ns,
        2 * cost.import_ns + cost.export_ns + cost.release_ns
    );
}

#[test]
fn peer_set_access_names_existing_devices_once_each() {
    for vmm in backends() {
        let h = vmm.create(G).unwrap();
        let va = vmm.reserve(G, 0).unwrap();
        assert!(matches!(
            vmm.set_access_for(va, G, &[0]),
            Err(VmmError::NotMapped { .. })
        ));
        vmm.map(va, G, h, 0).unwrap();
        assert_invalid(vmm.set_access_for(va, G, &[]), CallKind::SetAccess, "count");
        assert_invalid(
            vmm.set_access_for(va, G, &[0, 1]),
            CallKind::SetAccess,
            "location.id",
        );
        assert_invalid(
            vmm.set_access_for(va, G, &[0, 0]),
            CallKind::SetAccess,
            "location.id",
        );
        vmm.set_access_for(va, G, &[0]).unwrap();
        vmm.unmap(va, G).unwrap();
        vmm.release(h).unwrap();
        vmm.address_free(va, G).unwrap();
    }
}

#[test]
fn peer_access_is_recorded_per_device_and_costed_per_device() {
    let vmm = SimVmm::new(SimConfig {
        capacity: 64 * MIB,
        granularity: G,
        device_count: 4,
        ordinal: 2,
        ..SimConfig::default()
    })
    .unwrap();
    let cost = vmm.config().cost.clone();
    let va = vmm.reserve(4 * G, 0).unwrap();
    let (h1, h2) = (vmm.create(2 * G).unwrap(), vmm.create(2 * G).unwrap());
    vmm.map(va, 2 * G, h1, 0).unwrap();
    vmm.map(va + 2 * G, 2 * G, h2, 0).unwrap();
    assert_eq!(vmm.devices_with_access(va), Some(vec![]));
    let before = vmm.driver_stats();
    // One call over both mappings, four devices (this one, 2, among them).
    vmm.set_access_for(va, 4 * G, &[3, 2, 0, 1]).unwrap();
    let d = vmm.driver_stats().since(&before);
    assert_eq!(d.count(CallKind::SetAccess), 1);
    assert_eq!(
        d.modelled_ns,
        cost.set_access_ns + 3 * cost.set_access_per_peer_ns
    );
    assert_eq!(cost.set_access_ns_for(4), d.modelled_ns);
    for addr in [va, va + 3 * G] {
        assert_eq!(vmm.devices_with_access(addr), Some(vec![2, 0, 1, 3]));
    }
    // Part of a mapping is not access to the mapping; a plain set-access is
    // this device only.
    vmm.unmap(va + 2 * G, 2 * G).unwrap();
    vmm.map(va + 2 * G, 2 * G, h2, 0).unwrap();
    vmm.set_access_for(va + 2 * G, G, &[1]).unwrap();
    vmm.set_access(va + 2 * G, 2 * G).unwrap();
    assert_eq!(vmm.devices_with_access(va + 2 * G), Some(vec![2]));
    assert_invalid(
        vmm.set_access_for(va, G, &[4]),
        CallKind::SetAccess,
        "location.id",
    );
    assert_eq!(vmm.devices_with_access(va + 4 * G), None);
    vmm.unmap(va, 4 * G).unwrap();
    for h in [h1, h2] {
        vmm.release(h).unwrap();
    }
    vmm.address_free(va, 4 * G).unwrap();
    vmm.check_invariants().unwrap();
    assert!(vmm.leak_report().is_empty());
    // An ordinal outside the device count is refused at construction.
    assert!(SimVmm::new(SimConfig {
        device_count: 2,
        ordinal: 2,
        ..SimConfig::default()
    })
    .is_err());
}
