//! The real-model programs of `benches/programs` (GPT-2, BERT, Llama, ViT,
//! a model switch, DDP over gloo) on the CPU with tiny settings:
//! `benches/programs/tests/test_programs.py`, run by the python of the torch
//! venv (`scripts/torch-venv.sh`, which installs transformers beside torch).
//! Each parses its arguments, refuses a bad one with status 2, and runs to
//! its summary line. Their runs on the simulated GPU are `quilt-bench
//! live`'s (`tests/live_program.rs`). Ignored, with the reason, where the
//! venv was not there when this package was built (`build.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the torch venv of scripts/torch-venv.sh (none when quilt-bench was built; see the build warning)"
)]
fn the_programs_run_on_the_cpu() {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    let python = std::path::PathBuf::from(venv).join("bin").join("python");
    let out = std::process::Command::new(&python)
        .args(["-m", "unittest", "discover", "-s", "programs/tests", "-v"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| panic!("{} cannot be run: {e}", python.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the programs' CPU tests failed (is transformers in the venv? see its .status file):\n{text}"
    );
    assert!(text.contains("\nOK"), "{text}");
}
