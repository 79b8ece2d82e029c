//! The CUDA backend's first-contact defects, over the strict CUDA double
//! (each test in a child process with the double's rules set to mirror the
//! case): granularity queried with the properties used, an imported
//! handle's size checked, address-space exhaustion told apart from out of
//! memory, and a driver without the symbols the backend calls refused at
//! construction with a typed error, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::process::Command;

use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{CreateProps, HandleKind, HandleTypes, Vmm, VmmError};

const MIB: u64 = 1 << 20;

const SHAREABLE: CreateProps = CreateProps {
    handle_types: HandleTypes::POSIX_FD,
    gpu_direct_rdma: false,
};

/// Shareable allocations have a coarser granularity (4 MiB) than plain
/// ones (2 MiB): a 2 MiB shareable create is refused before the driver
/// sees it, a 4 MiB one works.
#[test]
fn shareable_creates_use_their_own_granularity() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[(
        "QUILT_CUDA_DOUBLE_SHAREABLE_GRANULARITY",
        "4MiB",
    )]) {
        return;
    }
    let v = CudaVmm::new(0).unwrap();
    assert_eq!(v.granularity(), 2 * MIB);
    match v.create_with(2 * MIB, SHAREABLE) {
        Err(VmmError::InvalidArgument { .. }) => {}
        other => panic!("a 2 MiB shareable create: expected InvalidArgument, got {other:?}"),
    }
    let h = v.create_with(4 * MIB, SHAREABLE).unwrap();
    v.release(h).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

/// An import whose claimed size is larger than the handle's real size is
/// refused; the real size is accepted.
#[test]
fn imports_are_checked_against_the_handles_real_size() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return;
    }
    let v = CudaVmm::new(0).unwrap();
    let h = v.create_with(2 * MIB, SHAREABLE).unwrap();
    let shared = v.export_handle(h, HandleKind::PosixFd).unwrap();
    let lie = v.import_handle(&shared, 4 * MIB);
    assert!(lie.is_err(), "a 2 MiB handle imported as 4 MiB: {lie:?}");
    let imported = v.import_handle(&shared, 2 * MIB).unwrap();
    v.release(imported).unwrap();
    v.release(h).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

/// With 64 MiB of address space, reserving 128 MiB fails, and not as out
/// of memory (the device has gigabytes free).
#[test]
fn address_space_exhaustion_is_not_out_of_memory() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[(
        "QUILT_CUDA_DOUBLE_ADDRESS_SPACE",
        "64MiB",
    )]) {
        return;
    }
    let v = CudaVmm::new(0).unwrap();
    let va = v.reserve(32 * MIB, 0).unwrap();
    match v.reserve(128 * MIB, 0) {
        Err(VmmError::OutOfMemory { .. }) => {
            panic!("address space exhaustion reported as device out of memory")
        }
        Err(_) => {}
        Ok(p) => panic!("reserved {p:#x} past the address space"),
    }
    v.address_free(va, 32 * MIB).unwrap();
}

/// Set in the child of the missing-symbols test.
const NO_SYMBOLS: &str = "QUILT_TEST_LIBCUDA_WITHOUT_SYMBOLS";

/// A "libcuda" that loads but has none of the driver's symbols (the C math
/// library under libcuda's names): construction is a typed error naming
/// what is missing, not a panic in cudarc.
#[test]
fn a_driver_without_the_symbols_is_unavailable_not_a_panic() {
    if std::env::var_os(NO_SYMBOLS).is_some() {
        match CudaVmm::new(0) {
            Err(VmmError::Unavailable { reason }) => {
                assert!(reason.contains("cuInit"), "{reason}");
                println!("unavailable: {reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        return;
    }
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
        "/usr/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("the C math library is on every Linux machine");
    let dir = std::env::temp_dir().join(format!(
        "quilt-libcuda-without-symbols-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        let _ = std::fs::remove_file(dir.join(name));
        std::os::unix::fs::symlink(libm, dir.join(name)).unwrap();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_driver_without_the_symbols_is_unavailable_not_a_panic",
            "--exact",
            "--nocapture",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env(NO_SYMBOLS, "1")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("test result: ok. 1 passed"), "{text}");
}
