//! The shared library answers to the real driver's soname, `libcuda.so.1`,
//! so that a program linked with `-lcuda` against it asks for that name.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
