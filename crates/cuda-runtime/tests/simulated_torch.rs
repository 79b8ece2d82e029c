//! The real torch (`scripts/torch-venv.sh`'s venv) on the simulated GPU:
//! `python/tests_sim` run through `scripts/simulated-gpu.sh` over the face
//! and the double cargo built for this test, once per allocator (torch's
//! classic caching allocator, its expandable segments, Quilt's
//! `backend:cuda` through `quilt_torch.enable()`), each in one python
//! process, plus the unmap under queued work. Ignored, with the reason, where
//! the venv was not there when this package was built (`build.rs`); a venv
//! that was there but cannot run now fails them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn python() -> PathBuf {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    PathBuf::from(venv).join("bin").join("python")
}

/// `scripts/simulated-gpu.sh PYTHON ARGS...` with `vars`, over this build's
/// face and double, on devices of 4 GiB.
fn run(args: &[&str], vars: &[(&str, &str)]) -> (Output, String) {
    let repo = common::repo();
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join("scripts/simulated-gpu.sh"))
        .arg(python())
        .args(args)
        .current_dir(&repo)
        .env("QUILT_SIMULATED_GPU_FACE", common::face())
        .env(
            "QUILT_SIMULATED_GPU_DOUBLE",
            common::built("libquilt_cuda_double.so"),
        )
        .env("QUILT_CUDA_DOUBLE_MEMORY", "4GiB")
        .env_remove("QUILT_CUDA_DOUBLE_DEVICES")
        .env_remove("QUILT_CUDA_DOUBLE_RELAX")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("QUILT_ALLOC_CONF");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("scripts/simulated-gpu.sh cannot be run: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

/// The scenarios of `python/tests_sim` under one allocator.
fn scenarios(allocator: &str, vars: &[(&str, &str)]) {
    let mut all = vec![("QUILT_SIM_ALLOCATOR", allocator)];
    all.extend_from_slice(vars);
    let (out, text) = run(
        &["-m", "unittest", "discover", "-s", "python/tests_sim", "-v"],
        &all,
    );
    eprintln!("{text}");
    assert!(
        out.status.success(),
        "the simulated-GPU torch scenarios failed under {allocator}:\n{text}"
    );
    assert!(text.contains("\nOK"), "{text}");
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built; see the build warning)"
)]
fn torch_classic_allocator_on_the_simulated_gpu() {
    // Three devices: torch's device count follows the double's.
    scenarios("classic", &[("QUILT_CUDA_DOUBLE_DEVICES", "3")]);
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built; see the build warning)"
)]
fn torch_expandable_segments_on_the_simulated_gpu() {
    scenarios(
        "expandable",
        &[("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")],
    );
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built; see the build warning)"
)]
fn quilt_backend_cuda_under_torch_on_the_simulated_gpu() {
    let lib = common::built("libquilt_torch.so");
    let bridge_cache = common::deps().join("quilt-torch-bridge");
    let python_path = common::repo().join("python");
    scenarios(
        "quilt",
        &[
            ("QUILT_ALLOC_CONF", "backend:cuda"),
            ("QUILT_TORCH_LIBRARY", lib.to_str().unwrap()),
            ("QUILT_TORCH_BRIDGE_CACHE", bridge_cache.to_str().unwrap()),
            ("PYTHONPATH", python_path.to_str().unwrap()),
        ],
    );
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built; see the build warning)"
)]
fn the_double_refuses_an_unmap_under_torchs_queued_work() {
    let (out, text) = run(&["python/tests_sim/unmap_under_queued_work.py"], &[]);
    eprintln!("{text}");
    assert!(out.status.success(), "{text}");
    for line in [
        "side stream busy: True",
        "cuMemGetAddressRange: 0",
        "cuMemUnmap under queued work: 0",
        "quilt-cuda-double: illegal address: queued work writes",
        "synchronize raised:",
        "an illegal memory access was encountered",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}
