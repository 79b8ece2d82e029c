//! The tests against the real torch package: `python/tests_real` (see its
//! docstring) run by the python of the virtual environment that
//! `scripts/torch-venv.sh` installs (`$QUILT_TORCH_VENV`, by default
//! `~/.cache/quilt/torch-venv`; `.ci/run` calls the script first). Where that
//! environment was not there when the crate was built (`build.rs` sets
//! `cfg(quilt_no_torch)` and prints why as a build warning), the test is
//! ignored, so `cargo test` reports it as ignored; where it was there then
//! but torch cannot be run now, the test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::path::PathBuf;
use std::process::Command;

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-torch was built; see the build warning)"
)]
fn quilt_torch_works_with_the_real_torch_package() {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    let python = PathBuf::from(venv).join("bin").join("python");
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libquilt_torch.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bridge_cache = exe.parent().unwrap().join("quilt-torch-bridge");
    let out = match Command::new(&python)
        .args([
            "-m",
            "unittest",
            "discover",
            "-s",
            "python/tests_real",
            "-v",
        ])
        .current_dir(&repo)
        .env("QUILT_TORCH_LIBRARY", &lib)
        .env("QUILT_TORCH_BRIDGE_CACHE", &bridge_cache)
        .env_remove("QUILT_ALLOC_CONF")
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!(
            "{} cannot be run ({e}); the real-torch tests did not run",
            python.display()
        ),
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the real-torch tests failed:\n{text}");
    assert!(text.contains("OK"), "{text}");
    eprintln!("{text}");
}
