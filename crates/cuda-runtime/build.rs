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

include!("../torch/build/torch_venv.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libcudart.so.13");
    println!("cargo::rustc-cdylib-link-arg=-fuse-ld=bfd");
    println!("cargo::rustc-cdylib-link-arg=-Wl,--default-symver");

    println!("cargo::rerun-if-changed=../torch/build/torch_venv.rs");
    torch_venv_cfg("simulated-GPU torch tests");
}
