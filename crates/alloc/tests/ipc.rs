//! Two real processes share an allocation on the host backend: this test
//! exports a communication buffer ([`CommAllocator::export`]) over a Unix
//! socket (the memfd travels as `SCM_RIGHTS`), the helper binary
//! `quilt-ipc-importer` maps it at an address of its own; bytes written by
//! one are read by the other both ways; the importer releases and says so;
//! only then does the exporter reuse the pages.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::MIB;
use quilt_alloc::comm::{CommAllocator, CommConfig};
use quilt_alloc::ipc::{recv_release, send_export, Released};
use quilt_alloc::quilt::{GrowthPolicy, QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::fd_pass::{recv_message, send_message};
use quilt_vmm::host::HostVmm;
use quilt_vmm::{CallKind, CreateProps, HandleKind, HandleTypes, StreamId, Vmm};

const PROBE_LEN: usize = 16;

/// The importer's probe offsets (as in `src/bin/quilt-ipc-importer.rs`).
fn probes(size: u64) -> [u64; 3] {
    [0, size / 2 - PROBE_LEN as u64 / 2, size - PROBE_LEN as u64]
}

fn pattern(k: usize) -> Vec<u8> {
    (0..PROBE_LEN).map(|i| (i * 31 + k * 7 + 3) as u8).collect()
}

fn socket_path(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!("quilt-{tag}-{}-{nanos}.sock", std::process::id()))
}

/// Starts the importer on a fresh socket and accepts its connection (20 s at
/// most, failing early if the child dies first).
fn start_importer(tag: &str, mode: Option<&str>) -> (Child, UnixStream, PathBuf) {
    let path = socket_path(tag);
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quilt-ipc-importer"));
    cmd.arg(&path);
    if let Some(m) = mode {
        cmd.arg(m);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let socket = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("importer exited before connecting: {status}");
                }
                assert!(Instant::now() < deadline, "importer never connected");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    socket.set_nonblocking(false).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    (child, socket, path)
}

fn host_vmm(capacity: u64) -> Arc<HostVmm> {
    common::host(2 * MIB, capacity)
}

fn host() -> Arc<HostVmm> {
    host_vmm(64 * MIB)
}

#[test]
fn ipc_two_processes_share_bytes_and_the_exporter_waits_for_release() {
    let host = host();
    let comm = CommAllocator::new(host.clone(), CommConfig::default()).unwrap();
    assert!(comm.props().handle_types.posix_fd);
    let a = comm.allocate(3 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(a.size, 4 * MIB, "rounded to the recommended granularity");
    for (k, at) in probes(a.size).into_iter().enumerate() {
        host.write_bytes(a.ptr + at, &pattern(k)).unwrap();
    }

    let (mut child, socket, path) = start_importer("ipc", None);
    let export = comm.export(a.ptr, HandleKind::PosixFd).unwrap();
    assert_eq!(export.descriptor.pieces.len(), 1, "one handle per buffer");
    send_export(&socket, &export).unwrap();
    drop(export); // our copies of the descriptors; the child has its own

    // The child read what we wrote.
    let (report, _) = recv_message(&socket, 0).unwrap();
    let (tag, bytes) = report.split_at(4);
    assert_eq!(tag, b"READ");
    let expected: Vec<u8> = (0..3).flat_map(pattern).collect();
    assert_eq!(bytes, expected.as_slice(), "the importer sees our bytes");

    // Freed here while imported: held, not reused.
    comm.free(a.ptr).unwrap();
    assert_eq!((comm.pending_buffers(), comm.exports_outstanding()), (1, 1));
    let other = comm.allocate(4 * MIB, StreamId::DEFAULT).unwrap();
    assert_ne!(other.ptr, a.ptr, "pages an importer holds are not reused");
    comm.free(other.ptr).unwrap();
    comm.check_invariants().unwrap();

    // We read what the child wrote (the mapping still stands: it is held).
    let (word, _) = recv_message(&socket, 0).unwrap();
    assert_eq!(word, b"WROTE");
    for (k, at) in probes(a.size).into_iter().enumerate() {
        assert!(
            host.check_filled(a.ptr + at, PROBE_LEN as u64, 0xB0 + k as u8)
                .unwrap(),
            "probe {k}: the importer's bytes"
        );
    }

    send_message(&socket, b"RELEASE", &[]).unwrap();
    assert_eq!(recv_release(&socket).unwrap(), Released::Id(a.ptr));
    comm.end_export(a.ptr).unwrap();
    assert_eq!((comm.pending_buffers(), comm.exports_outstanding()), (0, 0));
    assert!(comm.end_export(a.ptr).is_err(), "no export left to end");
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_file(path);

    // Released: the buffer is cached and reused at no driver call.
    let before = host.driver_stats();
    let again = comm.allocate(4 * MIB, StreamId::DEFAULT).unwrap();
    assert!(again.ptr == a.ptr || again.ptr == other.ptr);
    assert_eq!(host.driver_stats().since(&before).vmm_calls(), 0);
    comm.free(again.ptr).unwrap();
    comm.check_invariants().unwrap();
    let stats = host.driver_stats();
    assert_eq!(stats.count(CallKind::ExportHandle), 1);
    assert_eq!(stats.count(CallKind::Create), 2);
    comm.empty_cache().unwrap();
    assert_eq!(comm.stats().reserved_bytes.current, 0);
    assert!(host.leak_report().is_empty(), "{}", host.leak_report());
}

#[test]
fn ipc_an_importer_that_vanishes_ends_its_export() {
    let host = host();
    let comm = CommAllocator::new(host.clone(), CommConfig::default()).unwrap();
    let a = comm.allocate(2 * MIB, StreamId::DEFAULT).unwrap();
    let (mut child, socket, path) = start_importer("ipc-vanish", Some("vanish"));
    send_export(&socket, &comm.export(a.ptr, HandleKind::PosixFd).unwrap()).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(recv_release(&socket).unwrap(), Released::Gone);
    comm.free(a.ptr).unwrap();
    assert_eq!(comm.pending_buffers(), 1, "held until the export ends");
    comm.end_export(a.ptr).unwrap();
    assert_eq!(comm.pending_buffers(), 0);
    comm.check_invariants().unwrap();
    comm.empty_cache().unwrap();
    assert!(host.leak_report().is_empty());
    let _ = std::fs::remove_file(path);
}

#[test]
fn ipc_a_stitched_range_travels_as_one_handle_per_piece() {
    use quilt_alloc::ipc::{
        recv_export, ExportedAllocation, ImportedAllocation, SharedDescriptor, SharedPiece,
    };
    let exporter = host();
    let importer = host();
    let g = 2 * MIB;
    let props = CreateProps {
        handle_types: HandleTypes::POSIX_FD,
        gpu_direct_rdma: false,
    };
    // Two handles (one and two granules) stitched at one address.
    let (h1, h2) = (
        exporter.create_with(g, props).unwrap(),
        exporter.create_with(2 * g, props).unwrap(),
    );
    let va = exporter.reserve(3 * g, 0).unwrap();
    exporter.map(va, g, h1, 0).unwrap();
    exporter.map(va + g, 2 * g, h2, 0).unwrap();
    exporter.set_access(va, 3 * g).unwrap();
    exporter.write_bytes(va + g - 4, b"across!!").unwrap();
    let export = ExportedAllocation {
        descriptor: SharedDescriptor {
            id: va,
            size: 3 * g,
            pieces: vec![
                SharedPiece { offset: 0, size: g },
                SharedPiece {
                    offset: g,
                    size: 2 * g,
                },
            ],
            start: 0,
            len: 3 * g,
        },
        handles: vec![
            exporter.export_handle(h1, HandleKind::PosixFd).unwrap(),
            exporter.export_handle(h2, HandleKind::PosixFd).unwrap(),
        ],
    };
    // Through a socket pair in this process: the descriptors are duplicated.
    let (a, b) = UnixStream::pair().unwrap();
    send_export(&a, &export).unwrap();
    drop(export);
    let received = recv_export(&b).unwrap();
    assert_eq!(received.handles.len(), 2);
    let before = importer.driver_stats();
    let imported = ImportedAllocation::import(importer.clone(), &received, &[]).unwrap();
    let d = importer.driver_stats().since(&before);
    for (kind, n) in [
        (CallKind::Reserve, 1),
        (CallKind::ImportHandle, 2),
        (CallKind::Map, 2),
        (CallKind::SetAccess, 1),
    ] {
        assert_eq!(d.count(kind), n, "{kind}");
    }
    let mut out = [0u8; 8];
    importer
        .read_bytes(imported.ptr() + g - 4, &mut out)
        .unwrap();
    assert_eq!(&out, b"across!!", "both pieces, in order");
    // A descriptor whose handles do not match it is refused, nothing kept.
    let wrong = ExportedAllocation {
        descriptor: SharedDescriptor {
            id: va,
            size: 3 * g,
            pieces: vec![
                SharedPiece {
                    offset: 0,
                    size: 2 * g,
                },
                SharedPiece {
                    offset: 2 * g,
                    size: g,
                },
            ],
            start: 0,
            len: 3 * g,
        },
        handles: received.handles,
    };
    assert!(ImportedAllocation::import(importer.clone(), &wrong, &[]).is_err());
    assert_eq!(imported.release().unwrap(), va);
    assert!(
        importer.leak_report().is_empty(),
        "{}",
        importer.leak_report()
    );
    exporter.unmap(va, 3 * g).unwrap();
    for h in [h1, h2] {
        exporter.release(h).unwrap();
    }
    exporter.address_free(va, 3 * g).unwrap();
    assert!(exporter.leak_report().is_empty());
}

/// A Quilt allocator on a 16 MiB host device (8 pages of 2 MiB, one handle
/// each, created exactly as needed) whose pages can be exported.
fn exportable_quilt(host: &Arc<HostVmm>) -> QuiltAllocator {
    let mut config = QuiltConfig::default();
    config.pool.create_props = CreateProps {
        handle_types: HandleTypes::POSIX_FD,
        gpu_direct_rdma: false,
    };
    config.pool.growth = GrowthPolicy::exact();
    QuiltAllocator::new(host.clone(), config).unwrap()
}

fn small_host() -> Arc<HostVmm> {
    host_vmm(16 * MIB)
}

#[test]
fn ipc_a_stitched_quilt_allocation_is_shared_with_another_process() {
    let host = small_host();
    let quilt = exportable_quilt(&host);
    let s = StreamId::DEFAULT;
    // Fragment the device: six 2 MiB blocks and a 1 MiB one (7 of the 8
    // pages), then every other block freed: three cached pages in holes.
    let blocks: Vec<_> = (0..6)
        .map(|_| quilt.allocate(2 * MIB, s).unwrap())
        .collect();
    let tail = quilt.allocate(MIB, s).unwrap();
    for b in blocks.iter().skip(1).step_by(2) {
        quilt.free(b.ptr).unwrap();
    }
    // 6 MiB fit in no hole: they go after `tail`, sharing its page, on one
    // created page and pages unmapped from the holes: stitched.
    let before = host.driver_stats();
    let x = quilt.allocate(6 * MIB, s).unwrap();
    let made = host.driver_stats().since(&before);
    assert_eq!(
        made.count(CallKind::Create),
        1,
        "the last page the device has"
    );
    assert!(
        made.count(CallKind::Unmap) >= 2,
        "pages taken from the holes: {made:?}"
    );
    let segment = quilt
        .mapped_segments()
        .segments
        .into_iter()
        .find(|g| g.blocks.iter().any(|b| b.address == x.ptr))
        .unwrap();
    assert!(
        segment.blocks.iter().any(|b| b.address == tail.ptr),
        "x shares tail's page"
    );
    for (k, at) in probes(x.size).into_iter().enumerate() {
        host.write_bytes(x.ptr + at, &pattern(k)).unwrap();
    }

    let (mut child, socket, path) = start_importer("ipc-quilt", None);
    let export = quilt.export(x.ptr, HandleKind::PosixFd).unwrap();
    let d = &export.descriptor;
    assert_eq!((d.id, d.len), (x.ptr, x.size));
    assert_eq!(d.pieces.len(), 4, "one handle per page: tail's, then three");
    assert_eq!(d.start, MIB, "x starts inside the page it shares with tail");
    assert_eq!(d.size, 4 * 2 * MIB);
    assert_eq!(quilt.exports_outstanding(), 1);
    send_export(&socket, &export).unwrap();
    drop(export);
    assert_eq!(host.driver_stats().count(CallKind::ExportHandle), 4);

    let (report, _) = recv_message(&socket, 0).unwrap();
    let (word, bytes) = report.split_at(4);
    assert_eq!(word, b"READ");
    let expected: Vec<u8> = (0..3).flat_map(pattern).collect();
    assert_eq!(bytes, expected.as_slice(), "the importer sees our bytes");
    let (word, _) = recv_message(&socket, 0).unwrap();
    assert_eq!(word, b"WROTE");
    for (k, at) in probes(x.size).into_iter().enumerate() {
        assert!(
            host.check_filled(x.ptr + at, PROBE_LEN as u64, 0xB0 + k as u8)
                .unwrap(),
            "probe {k}: the importer's bytes"
        );
    }

    // Freed here while imported: the free waits, the pages stay held.
    quilt.free(tail.ptr).unwrap();
    quilt.free(x.ptr).unwrap();
    assert!(matches!(
        quilt.free(x.ptr),
        Err(AllocError::DoubleFree { .. })
    ));
    assert!(
        quilt.record_stream(x.ptr, StreamId(3)).is_err(),
        "freed here"
    );
    assert!(
        quilt.export(x.ptr, HandleKind::PosixFd).is_err(),
        "freed here"
    );
    quilt.check_invariants().unwrap();
    let held = quilt.allocate(6 * MIB, s).unwrap_err();
    assert!(
        matches!(&held, AllocError::OutOfMemory(_)),
        "an importer's pages are neither reclaimed nor reused: {held}"
    );
    // The importer still reads and writes them.
    assert!(host.check_filled(x.ptr, PROBE_LEN as u64, 0xB0).unwrap());

    send_message(&socket, b"RELEASE", &[]).unwrap();
    assert_eq!(recv_release(&socket).unwrap(), Released::Id(x.ptr));
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_file(path);
    quilt.end_export(x.ptr).unwrap();
    assert_eq!(quilt.exports_outstanding(), 0);
    assert!(matches!(
        quilt.end_export(x.ptr),
        Err(AllocError::Sharing { .. })
    ));
    // Released: the deferred free happened, the pages serve others.
    assert_eq!(
        quilt.stats().allocated_bytes.current,
        3 * 2 * MIB,
        "the three blocks left"
    );
    let y = quilt.allocate(6 * MIB, s).unwrap();
    quilt.check_invariants().unwrap();
    quilt.free(y.ptr).unwrap();
    for b in blocks.iter().step_by(2) {
        quilt.free(b.ptr).unwrap();
    }
    quilt.check_invariants().unwrap();
    drop(quilt);
    assert!(host.leak_report().is_empty(), "{}", host.leak_report());
}

#[test]
fn ipc_quilt_exports_are_refused_with_typed_errors_and_change_nothing() {
    let host = small_host();
    let quilt = exportable_quilt(&host);
    let s = StreamId::DEFAULT;
    let a = quilt.allocate(3 * MIB, s).unwrap();
    let w = quilt.allocate_tagged(2 * MIB, s, "weights").unwrap();
    assert!(matches!(
        quilt.export(a.ptr + 512, HandleKind::PosixFd),
        Err(AllocError::UnknownPointer { .. })
    ));
    let tagged = quilt.export(w.ptr, HandleKind::PosixFd).unwrap_err();
    assert!(
        matches!(&tagged, AllocError::Sharing { reason } if reason.contains("weights")),
        "{tagged}"
    );
    assert!(
        matches!(
            quilt.export(a.ptr, HandleKind::Fabric),
            Err(AllocError::Driver(_))
        ),
        "pages created without FABRIC"
    );
    assert!(matches!(
        quilt.end_export(a.ptr),
        Err(AllocError::Sharing { .. })
    ));
    assert_eq!(quilt.exports_outstanding(), 0);
    quilt.check_invariants().unwrap();
    // Pages of a pool that does not request POSIX descriptors cannot go.
    let plain = QuiltAllocator::new(host.clone(), QuiltConfig::default()).unwrap();
    let p = plain.allocate(MIB, s).unwrap();
    assert!(matches!(
        plain.export(p.ptr, HandleKind::PosixFd),
        Err(AllocError::Driver(_))
    ));
    assert_eq!(plain.exports_outstanding(), 0);
    plain.free(p.ptr).unwrap();
    // Two exports of one block, through a socket pair in this process: both
    // must end before its deferred free happens.
    let e1 = quilt.export(a.ptr, HandleKind::PosixFd).unwrap();
    let e2 = quilt.export(a.ptr, HandleKind::PosixFd).unwrap();
    let (tx, rx) = UnixStream::pair().unwrap();
    send_export(&tx, &e1).unwrap();
    let received = quilt_alloc::ipc::recv_export(&rx).unwrap();
    assert_eq!(received.descriptor, e1.descriptor);
    let importer = host_vmm(64 * MIB);
    let imported =
        quilt_alloc::ipc::ImportedAllocation::import(importer.clone(), &received, &[]).unwrap();
    host.write_bytes(a.ptr + 3 * MIB - 8, b"lastbyte").unwrap();
    let mut out = [0u8; 8];
    importer
        .read_bytes(imported.ptr() + 3 * MIB - 8, &mut out)
        .unwrap();
    assert_eq!(&out, b"lastbyte");
    assert_eq!(imported.size(), 3 * MIB);
    imported.release().unwrap();
    drop((e1, e2, received));
    quilt.free(a.ptr).unwrap();
    quilt.end_export(a.ptr).unwrap();
    assert_eq!(
        quilt.stats().allocated_bytes.current,
        5 * MIB,
        "one export left: still live"
    );
    quilt.end_export(a.ptr).unwrap();
    assert_eq!(quilt.stats().allocated_bytes.current, 2 * MIB);
    quilt.check_invariants().unwrap();
    quilt.free(w.ptr).unwrap();
    assert!(importer.leak_report().is_empty());
}
