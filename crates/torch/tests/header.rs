//! The C header `python/quilt_torch/quilt_torch.h` is what cbindgen makes of
//! this crate now: the ABI the C++ allocator class and the Python package
//! are written against is the library's own. With `QUILT_UPDATE_HEADER=1`
//! the test writes the header instead (then review and commit it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::path::PathBuf;

#[test]
fn the_c_header_is_what_cbindgen_makes_of_the_crate() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen cannot read the crate");
    let mut made = Vec::new();
    bindings.write(&mut made);
    let header = crate_dir.join("../../python/quilt_torch/quilt_torch.h");
    if std::env::var_os("QUILT_UPDATE_HEADER").is_some() {
        std::fs::write(&header, &made).unwrap();
        return;
    }
    let kept = std::fs::read(&header).unwrap_or_default();
    assert!(
        kept == made,
        "{} is stale (or missing): an exported function or struct changed; \
         regenerate it with QUILT_UPDATE_HEADER=1 cargo test --release -p quilt-torch \
         --test header, raise QUILT_TORCH_ABI_VERSION (ffi.rs) if the ABI changed, \
         and commit it",
        header.display()
    );
    let text = String::from_utf8(made).unwrap();
    let version = format!(
        "#define QUILT_TORCH_ABI_VERSION {}",
        quilt_torch::ffi::QUILT_TORCH_ABI_VERSION
    );
    assert!(text.contains(&version), "the header lacks `{version}`");
    for name in [
        "quilt_malloc",
        "quilt_torch_malloc",
        "quilt_abi_version",
        "QuiltDeviceStats",
    ] {
        assert!(text.contains(name), "the header lacks {name}");
    }
}
