//! The importing side of the two-process IPC test (`crates/alloc/tests/ipc.rs`),
//! on the host backend: connects to the Unix socket named by its first
//! argument, receives an exported allocation, maps it, reports the bytes it
//! reads at the probe offsets, writes its own, and on the exporter's word
//! releases the import and sends the release message.
//!
//! Usage: `quilt-ipc-importer SOCKET [vanish]`; with `vanish` it exits right
//! after mapping, without a release message (the exporter sees the socket
//! close). Exit status 0 on success; a message and status 1 on any failure.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use quilt_alloc::ipc::{recv_export, send_release, ImportedAllocation};
use quilt_vmm::fd_pass::{recv_message, send_message};
use quilt_vmm::host::{HostConfig, HostVmm};

/// Bytes read or written at each probe.
const PROBE_LEN: u64 = 16;

/// Offsets probed in an allocation of `size` bytes: its start, across its
/// middle, and its end.
fn probes(size: u64) -> [u64; 3] {
    [0, size / 2 - PROBE_LEN / 2, size - PROBE_LEN]
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: quilt-ipc-importer SOCKET [vanish]")?;
    let vanish = args.next().as_deref() == Some("vanish");
    let socket = UnixStream::connect(&path).map_err(|e| format!("connect {path}: {e}"))?;
    let host = Arc::new(
        HostVmm::new(HostConfig {
            granularity: 2 << 20,
            capacity: 64 << 20,
        })
        .map_err(|e| e.to_string())?,
    );
    let export = recv_export(&socket).map_err(|e| e.to_string())?;
    let imported =
        ImportedAllocation::import(host.clone(), &export, &[]).map_err(|e| e.to_string())?;
    drop(export);
    if vanish {
        // The process ends with the mapping in place: the kernel drops it.
        std::process::exit(0);
    }
    let mut report = b"READ".to_vec();
    for at in probes(imported.size()) {
        let mut buf = [0u8; PROBE_LEN as usize];
        host.read_bytes(imported.ptr() + at, &mut buf)
            .map_err(|e| e.to_string())?;
        report.extend_from_slice(&buf);
    }
    send_message(&socket, &report, &[]).map_err(|e| e.to_string())?;
    for (k, at) in probes(imported.size()).into_iter().enumerate() {
        host.fill(imported.ptr() + at, PROBE_LEN, 0xB0 + k as u8)
            .map_err(|e| e.to_string())?;
    }
    send_message(&socket, b"WROTE", &[]).map_err(|e| e.to_string())?;
    let (word, _) = recv_message(&socket, 0).map_err(|e| e.to_string())?;
    if word != b"RELEASE" {
        return Err(format!("expected RELEASE, got {word:?}"));
    }
    let id = imported.release().map_err(|e| e.to_string())?;
    let left = host.leak_report();
    if !left.is_empty() {
        return Err(format!("importer still holds {left}"));
    }
    send_release(&socket, id).map_err(|e| e.to_string())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("quilt-ipc-importer: {e}");
        std::process::exit(1);
    }
}
