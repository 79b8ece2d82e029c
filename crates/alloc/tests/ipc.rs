//! Two real processes share an allocation on the host backend: this test
//! exports a communication buffer ([`CommAllocator::export`]) over a Unix
//! socket (the memfd travels as `SCM_RIGHTS`), the helper binary
//! `quilt-ipc-importer` maps it at an address of its own; bytes written by
//! one are read by the other both ways; the importer releases and says so;
//! only then does the exporter reuse the pages.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quilt_alloc::comm::{CommAllocator, CommConfig};
use quilt_alloc::share::{recv_release, send_export, Released};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::fd_pass::{recv_message, send_message};
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::{CallKind, HandleKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;
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

fn host() -> Arc<HostVmm> {
    Arc::new(
        HostVmm::new(HostConfig {
            granularity: 2 * MIB,
            capacity: 64 * MIB,
        })
        .unwrap(),
    )
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
    use quilt_alloc::share::{
        recv_export, ExportedAllocation, ImportedAllocation, SharedDescriptor, SharedPiece,
    };
    use quilt_vmm::{CreateProps, HandleTypes};
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
