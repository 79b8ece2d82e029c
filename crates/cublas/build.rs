//! The face answers to `libcublas.so.13` and versions every export with
//! that node, as NVIDIA's `libcublas.so.13` does (torch's
//! `libtorch_cuda.so` imports `cublasGemmEx@libcublas.so.13`): GNU ld's
//! `--default-symver`, as `crates/cuda-runtime/build.rs` explains.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libcublas.so.13");
    println!("cargo::rustc-cdylib-link-arg=-fuse-ld=bfd");
    println!("cargo::rustc-cdylib-link-arg=-Wl,--default-symver");
}
