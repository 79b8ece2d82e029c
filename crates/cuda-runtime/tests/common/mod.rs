//! Shared by the face's tests: where cargo built the libraries.

#![allow(dead_code)] // each test file uses a part
#![allow(clippy::unwrap_used, clippy::panic)] // test code

use std::path::PathBuf;

/// The folder of the running test binary (`target/<profile>/deps`).
pub fn deps() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

/// A library cargo built for this test: beside the test binary or one up.
pub fn built(name: &str) -> PathBuf {
    let here = deps();
    [here.join(name), here.join("..").join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} is not built beside {}", here.display()))
}

/// The face: `libquilt_cuda_runtime.so`.
pub fn face() -> PathBuf {
    built("libquilt_cuda_runtime.so")
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}
