//! The Python side: `python/tests/test_ctypes.py` (standard library only)
//! loads the library this build made and runs its scenarios on the host and
//! simulated backends, each in a process of its own. Where no `python3` ran
//! when the crate was built (`build.rs` sets `cfg(quilt_no_python3)`), the
//! test is ignored, so `cargo test` reports it as ignored; where it was
//! found then but cannot be run now, the test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::path::PathBuf;
use std::process::Command;

#[test]
#[cfg_attr(
    quilt_no_python3,
    ignore = "needs python3 on the PATH (none ran when quilt-torch was built)"
)]
fn the_ctypes_test_passes_against_this_build() {
    // The cdylib cargo built for this test run sits beside the test binary.
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libquilt_torch.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = match Command::new("python3")
        .args(["-m", "unittest", "discover", "-s", "python/tests", "-v"])
        .current_dir(&repo)
        .env("QUILT_TORCH_LIBRARY", &lib)
        .env_remove("QUILT_ALLOC_CONF")
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("python3 cannot be run here ({e}); the ctypes test did not run"),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the Python test failed:\n{text}");
    assert!(text.contains("OK"), "{text}");
    eprintln!("{text}");
}
