//! Sharing on the CUDA backend: what the device reports, peer access on a
//! machine with two or more devices, and export / import of a handle between
//! two processes on one device (POSIX file descriptor over a Unix socket).
//!
//! `cargo test` runs every test over the CUDA double (`quilt-cuda-double`,
//! two devices for the peer test, POSIX handles for the export test), each
//! in a child process; `QUILT_CUDA_TESTS=real` runs them on a real GPU
//! (`scripts/gpu-check.sh`, step `cuda_share`). A test that cannot run on the
//! machine it finds (one device only; no POSIX handle support) fails with
//! the reason: it never passes without running. On a machine with one
//! device, `scripts/gpu-check.sh` leaves the peer test out
//! (`--skip cuda_share_peer_access_for_every_device`) and records why.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::Duration;

use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::fd_pass::{recv_message, send_message};
use quilt_vmm::{CallKind, CreateProps, HandleKind, HandleTypes, ShareableHandle, Vmm};

/// Set in the child process of the two-process test: the socket to connect to.
const CHILD_SOCKET: &str = "QUILT_CUDA_SHARE_SOCKET";

fn gpu(ordinal: usize) -> CudaVmm {
    match CudaVmm::new(ordinal) {
        Ok(v) => v,
        Err(e) => panic!("this test needs CUDA device {ordinal}: {e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn cuda_share_the_device_reports_its_sharing_capabilities() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu(0);
    let caps = v.caps();
    println!(
        "cuda_share: caps {{\"device\": \"{}\", \"ordinal\": {}, \"device_count\": {}, \"posix_fd\": {}, \"fabric\": {}, \"gpu_direct_rdma_with_vmm\": {}, \"granularity\": {}, \"recommended_granularity\": {}}}",
        v.device_name(),
        caps.ordinal,
        caps.device_count,
        caps.handle_types.posix_fd,
        caps.handle_types.fabric,
        caps.gpu_direct_rdma_with_vmm,
        caps.granularity,
        caps.recommended_granularity
    );
    assert_eq!(caps.ordinal, 0);
    assert!(caps.device_count >= 1);
    assert_eq!(caps.granularity, v.granularity());
    assert!(caps.recommended_granularity.is_power_of_two());
    assert!(caps.recommended_granularity >= caps.granularity);
    // POSIX handles where reported; FABRIC also needs an IMEX channel, so a
    // refusal there is reported, not failed (NCCL falls back the same way).
    let posix = CreateProps {
        handle_types: HandleTypes::POSIX_FD,
        gpu_direct_rdma: caps.gpu_direct_rdma_with_vmm,
    };
    let h = if caps.handle_types.posix_fd {
        let h = v.create_with(caps.recommended_granularity, posix).unwrap();
        assert!(v.export_handle(h, HandleKind::PosixFd).is_ok());
        assert!(
            v.export_handle(h, HandleKind::Fabric).is_err(),
            "not requested"
        );
        h
    } else {
        v.create(caps.recommended_granularity).unwrap()
    };
    if caps.handle_types.fabric {
        let fabric = CreateProps::preferred_for(&caps);
        match v.create_with(caps.recommended_granularity, fabric) {
            Ok(f) => {
                let exported = v.export_handle(f, HandleKind::Fabric);
                println!(
                    "cuda_share: fabric handle created, export: {:?}",
                    exported.is_ok()
                );
                v.release(f).unwrap();
            }
            Err(e) => println!("cuda_share: fabric reported but refused: {e}"),
        }
    }
    v.release(h).unwrap();
    // A plain handle (no handle type requested) exports nothing: the ledger
    // refuses before the driver sees it.
    let plain = v.create(caps.granularity).unwrap();
    assert!(v.export_handle(plain, HandleKind::PosixFd).is_err());
    v.release(plain).unwrap();
    assert!(v.leak_report().is_empty());
}

#[test]
fn cuda_share_peer_access_for_every_device() {
    // Two devices on the double, so that peer access is exercised here.
    if !quilt_cuda_double::harness::rerun_over_double_with(&[("QUILT_CUDA_DOUBLE_DEVICES", "2")]) {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu(0);
    let caps = v.caps();
    assert!(
        caps.device_count >= 2,
        "cuda_share: peer access needs two or more devices, found {} (on a one-device machine leave this test out: --skip cuda_share_peer_access_for_every_device)",
        caps.device_count
    );
    let g = caps.granularity;
    let devices = caps.all_devices();
    let h = v.create(2 * g).unwrap();
    let va = v.reserve(2 * g, 0).unwrap();
    v.map(va, 2 * g, h, 0).unwrap();
    let before = v.driver_stats();
    v.set_access_for(va, 2 * g, &devices).unwrap();
    assert_eq!(
        v.driver_stats().since(&before).count(CallKind::SetAccess),
        1
    );
    let data = pattern(4096, 5);
    v.copy_to_device(va + g - 2048, &data).unwrap();
    let mut out = vec![0u8; data.len()];
    v.copy_from_device(va + g - 2048, &mut out).unwrap();
    assert_eq!(out, data);
    // An ordinal past the device count is refused before the driver.
    assert!(v.set_access_for(va, 2 * g, &[caps.device_count]).is_err());
    println!("cuda_share: peer access set for devices {devices:?} in one cuMemSetAccess");
    v.unmap(va, 2 * g).unwrap();
    v.release(h).unwrap();
    v.address_free(va, 2 * g).unwrap();
}

/// The child's side: import the handle it is sent, read the parent's bytes,
/// write its own, release on the parent's word.
fn child(path: &str) {
    let v = gpu(0);
    let socket = UnixStream::connect(path).unwrap();
    let (size_bytes, mut fds) = recv_message(&socket, 1).unwrap();
    let size = u64::from_le_bytes(size_bytes.as_slice().try_into().unwrap());
    let shared = ShareableHandle::PosixFd(fds.pop().unwrap());
    let h = v.import_handle(&shared, size).unwrap();
    drop(shared);
    let va = v.reserve(size, 0).unwrap();
    v.map(va, size, h, 0).unwrap();
    v.set_access(va, size).unwrap();
    let mut seen = vec![0u8; 4096];
    v.copy_from_device(va, &mut seen).unwrap();
    v.copy_to_device(va + size - 4096, &pattern(4096, 77))
        .unwrap();
    send_message(&socket, &seen, &[]).unwrap();
    let (word, _) = recv_message(&socket, 0).unwrap();
    assert_eq!(word, b"RELEASE");
    v.unmap(va, size).unwrap();
    v.release(h).unwrap();
    v.address_free(va, size).unwrap();
    assert!(v.leak_report().is_empty());
    send_message(&socket, b"RELEASED", &[]).unwrap();
}

#[test]
fn cuda_share_export_and_import_between_two_processes() {
    // POSIX handles on the double (its default, set here all the same).
    if !quilt_cuda_double::harness::rerun_over_double_with(&[("QUILT_CUDA_DOUBLE_POSIX_FD", "1")]) {
        return; // ran over the CUDA double in a child process
    }
    if let Ok(path) = std::env::var(CHILD_SOCKET) {
        child(&path);
        return;
    }
    let v = gpu(0);
    let caps = v.caps();
    assert!(
        caps.handle_types.posix_fd,
        "cuda_share: the device reports no POSIX file descriptor handles, which this test exports"
    );
    let size = 2 * caps.granularity;
    let props = CreateProps {
        handle_types: HandleTypes::POSIX_FD,
        gpu_direct_rdma: false,
    };
    let h = v.create_with(size, props).unwrap();
    let va = v.reserve(size, 0).unwrap();
    v.map(va, size, h, 0).unwrap();
    v.set_access(va, size).unwrap();
    let mine = pattern(4096, 3);
    v.copy_to_device(va, &mine).unwrap();

    let path = std::env::temp_dir().join(format!("quilt-cuda-share-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child_process = Command::new(std::env::current_exe().unwrap())
        .args([
            "cuda_share_export_and_import_between_two_processes",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD_SOCKET, &path)
        .spawn()
        .unwrap();
    let (socket, _) = listener.accept().unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let ShareableHandle::PosixFd(fd) = v.export_handle(h, HandleKind::PosixFd).unwrap() else {
        panic!("a POSIX export is a file descriptor");
    };
    send_message(&socket, &size.to_le_bytes(), &[fd.as_fd()]).unwrap();
    drop(fd);
    let (seen, _) = recv_message(&socket, 0).unwrap();
    assert_eq!(seen, mine, "the child read our bytes");
    let mut theirs = vec![0u8; 4096];
    v.copy_from_device(va + size - 4096, &mut theirs).unwrap();
    assert_eq!(theirs, pattern(4096, 77), "we read the child's bytes");
    send_message(&socket, b"RELEASE", &[]).unwrap();
    let (word, _) = recv_message(&socket, 0).unwrap();
    assert_eq!(word, b"RELEASED");
    assert!(child_process.wait().unwrap().success());
    let _ = std::fs::remove_file(&path);
    assert_eq!(v.driver_stats().count(CallKind::ExportHandle), 1);
    v.unmap(va, size).unwrap();
    v.release(h).unwrap();
    v.address_free(va, size).unwrap();
    assert!(v.leak_report().is_empty());
    println!("cuda_share: export and import between two processes: bytes both ways");
}
