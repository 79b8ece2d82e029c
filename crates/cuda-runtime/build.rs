//! The face answers to `libcudart.so.13` and versions every export with that
//! node, as NVIDIA's `libcudart.so.13` does: the CUDA 13 wheels' libraries
//! (`libtorch_cuda.so`, `libc10_cuda.so`, ...) import `cudaMalloc@libcudart.so.13`
//! and so on, and an unversioned export would bind only with a warning.
//!
//! rustc already gives the linker an anonymous version script (the exported
//! names); GNU ld's `--default-symver` then puts every export under a
//! version node named after the soname. rust-lld (rustc's default linker on
//! x86_64 Linux) has no such option, so the face is linked with GNU ld
//! (`-fuse-ld=bfd`, from binutils, which the C compiler cargo links with
//! needs anyway). `tests/library.rs` checks the result with `objdump -T`.
//!
//! It also sets `cfg(quilt_no_torch)` where the torch virtual environment of
//! `scripts/torch-venv.sh` is not there (as `crates/torch/build.rs` does), so
//! that the real-torch tests (`tests/simulated_torch.rs`) are reported as
//! ignored, with the reason as a build warning.

use std::path::PathBuf;

/// Where `scripts/torch-venv.sh` installs torch (keep the two in step).
fn torch_venv() -> Option<PathBuf> {
    if let Some(v) = std::env::var_os("QUILT_TORCH_VENV") {
        return Some(PathBuf::from(v));
    }
    std::env::var_os("HOME").map(|h| {
        PathBuf::from(h)
            .join(".cache")
            .join("quilt")
            .join("torch-venv")
    })
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libcudart.so.13");
    println!("cargo::rustc-cdylib-link-arg=-fuse-ld=bfd");
    println!("cargo::rustc-cdylib-link-arg=-Wl,--default-symver");

    println!("cargo::rustc-check-cfg=cfg(quilt_no_torch)");
    println!("cargo::rerun-if-env-changed=QUILT_TORCH_VENV");
    println!("cargo::rerun-if-env-changed=HOME");
    let Some(venv) = torch_venv() else {
        println!("cargo::rustc-cfg=quilt_no_torch");
        println!("cargo::warning=simulated-GPU torch tests skipped: no HOME or QUILT_TORCH_VENV");
        return;
    };
    // The install script writes `<venv>.status`: "ok torch ..." once the
    // venv's python imports torch, else "skipped: <why>".
    let status_file = PathBuf::from(format!("{}.status", venv.display()));
    println!("cargo::rerun-if-changed={}", status_file.display());
    let status = std::fs::read_to_string(&status_file).unwrap_or_else(|_| {
        format!(
            "skipped: {} does not exist (run scripts/torch-venv.sh)",
            status_file.display()
        )
    });
    if !status.starts_with("ok") || !venv.join("bin").join("python").exists() {
        println!("cargo::rustc-cfg=quilt_no_torch");
        println!(
            "cargo::warning=simulated-GPU torch tests {}",
            status.lines().next().unwrap_or("no status")
        );
    } else {
        println!("cargo::rustc-env=QUILT_TORCH_VENV_FOUND={}", venv.display());
    }
}
