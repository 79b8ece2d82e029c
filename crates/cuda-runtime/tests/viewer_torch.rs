//! torch's own `_dump_snapshot` under Quilt (`quilt_torch.enable()`,
//! `backend:cuda`) on the simulated GPU, opened in PyTorch's browser viewer
//! (`MemoryViz.js`) in headless Chromium: `scripts/viewer-check/torch_snapshots.py`
//! writes a snapshot per scenario (one stream and two, `empty_cache`,
//! `reclaim:always`, an out of memory, two devices, sleep and wake) through
//! `scripts/simulated-gpu.sh` over the face and the double cargo built for
//! this test, and `scripts/viewer-check/check.mjs` opens each in all three
//! views, the state history selected back to its first event.
//!
//! PyTorch's viewer is not in the repository (it is PyTorch's code; see the
//! docs/pytorch.md's "Snapshots"), so this test is always ignored and is run by hand:
//!
//!     cargo test --release -p quilt-cuda-runtime --test viewer_torch -- --ignored
//!
//! Run so, it fails (never passes) where the torch venv, the viewer,
//! Chromium, node or `npm ci` in scripts/viewer-check is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;
use std::process::Command;

#[test]
#[ignore = "needs PyTorch's MemoryViz.js (third_party/viz, git-ignored), Chromium, node, npm ci in scripts/viewer-check and the torch venv: run with --ignored"]
fn torchs_own_snapshots_under_quilt_open_in_pytorchs_viewer() {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("no torch venv when quilt-cuda-runtime was built (scripts/torch-venv.sh)");
    };
    let python = PathBuf::from(venv).join("bin").join("python");
    let repo = common::repo();
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("viewer-torch");
    let _ = std::fs::remove_dir_all(&out);
    let made = Command::new(&python)
        .arg(repo.join("scripts/viewer-check/torch_snapshots.py"))
        .arg(&out)
        .current_dir(&repo)
        .env("QUILT_SIMULATED_GPU_FACE", common::face())
        .env(
            "QUILT_SIMULATED_GPU_DOUBLE",
            common::built("libquilt_cuda_double.so"),
        )
        .env("QUILT_TORCH_LIBRARY", common::built("libquilt_torch.so"))
        .env(
            "QUILT_TORCH_BRIDGE_CACHE",
            common::deps().join("quilt-torch-bridge"),
        )
        .env("PYTHONPATH", repo.join("python"))
        .env_remove("QUILT_CUDA_DOUBLE_DEVICES")
        .env_remove("QUILT_CUDA_DOUBLE_MEMORY")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .output()
        .unwrap_or_else(|e| panic!("{} cannot be run: {e}", python.display()));
    let listed = String::from_utf8_lossy(&made.stdout).to_string();
    assert!(
        made.status.success(),
        "torch_snapshots.py failed:\n{listed}{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let snapshots: Vec<&str> = listed.lines().collect();
    assert_eq!(snapshots.len(), 7, "{listed}");
    let checked = Command::new("node")
        .arg(repo.join("scripts/viewer-check/check.mjs"))
        .args(&snapshots)
        .output()
        .unwrap_or_else(|e| panic!("node cannot be run: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    assert!(
        checked.status.success(),
        "PyTorch's viewer failed on torch's snapshot under Quilt (exit {:?}):\n{text}",
        checked.status.code()
    );
    // Seven snapshots, one of two devices: 8 devices in 3 views.
    assert!(
        text.contains("viewer-check: 24 of 24 checks passed"),
        "{text}"
    );
    eprintln!("{text}");
}
