//! Build-time facts for quilt-bench:
//!
//! - `QUILT_BENCH_GIT_COMMIT`: the commit the binary is built from (the
//!   version line of the JSON report), when git can tell;
//! - the cfg `has_shared_traces` when `../shared/traces/converted` (the real
//!   PyTorch traces, beside the clone) is present, and `has_shared_snapshot`
//!   when its raw snapshot pickle is: the tests that replay them are compiled
//!   as `#[ignore]`d without (they show as ignored, never as passed). After
//!   adding `../shared`, rebuild: `touch benches/build.rs`;
//! - the cfg `no_python3` where no `python3` runs at build time: the tests of
//!   the Python scripts (`tests/scripts.rs`) are then ignored;
//! - the cfg `quilt_no_torch` where the torch venv of `scripts/torch-venv.sh`
//!   is not there (as `crates/torch/build.rs` sets it): the live A/B's tests
//!   that run torch (`tests/live_program.rs`) are then ignored, with the
//!   reason as a build warning; else `QUILT_TORCH_VENV_FOUND` names the venv.

use std::path::Path;
use std::process::Command;

include!("../crates/torch/build/torch_venv.rs");

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let manifest = Path::new(&manifest);

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(has_shared_traces)");
    println!("cargo:rustc-check-cfg=cfg(has_shared_snapshot)");
    println!("cargo:rustc-check-cfg=cfg(no_python3)");
    println!("cargo:rerun-if-env-changed=PATH");
    let python3 = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !python3 {
        println!("cargo:rustc-cfg=no_python3");
    }
    println!("cargo:rerun-if-changed=../crates/torch/build/torch_venv.rs");
    torch_venv_cfg("live A/B tests (tests/live_program.rs)");
    let shared = manifest.join("../../shared/traces");
    let converted = shared.join("converted");
    if converted.join("stats.json").is_file() {
        println!("cargo:rustc-cfg=has_shared_traces");
        // Watched only while present: a missing path would rerun this
        // script, and rebuild the crate, on every build.
        println!("cargo:rerun-if-changed={}", converted.display());
        if shared.join("raw/opt_zo_fedlearn_finetune.pickle").is_file() {
            println!("cargo:rustc-cfg=has_shared_snapshot");
        }
    }

    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(manifest)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
            .filter(|s| !s.is_empty())
    };
    if let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) {
        println!("cargo:rustc-env=QUILT_BENCH_GIT_COMMIT={commit}");
        // Rebuilt when HEAD moves: the branch it names, or HEAD itself.
        if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", manifest.join(&head).display());
        }
        if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
            let path = manifest.join(packed);
            if path.is_file() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if let Some(path) = git(&["rev-parse", "--git-path", &branch]) {
                let path = manifest.join(path);
                if path.is_file() {
                    println!("cargo:rerun-if-changed={}", path.display());
                }
            }
        }
    }
}
