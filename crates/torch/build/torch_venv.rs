// Shared by the build scripts of quilt-torch and quilt-cuda-runtime
// (`include!`d): where `scripts/torch-venv.sh` installed the real torch, and
// the `cfg(quilt_no_torch)` their real-torch tests are ignored by.

/// Where `scripts/torch-venv.sh` installs torch (keep the two in step).
fn torch_venv() -> Option<std::path::PathBuf> {
    if let Some(v) = std::env::var_os("QUILT_TORCH_VENV") {
        return Some(std::path::PathBuf::from(v));
    }
    std::env::var_os("HOME").map(|h| {
        std::path::PathBuf::from(h)
            .join(".cache")
            .join("quilt")
            .join("torch-venv")
    })
}

/// Sets `cfg(quilt_no_torch)`, with the reason as a build warning naming
/// `tests` (what is skipped), where the torch venv is not there or its
/// install did not succeed; otherwise `QUILT_TORCH_VENV_FOUND` names it.
fn torch_venv_cfg(tests: &str) {
    println!("cargo::rustc-check-cfg=cfg(quilt_no_torch)");
    println!("cargo::rerun-if-env-changed=QUILT_TORCH_VENV");
    println!("cargo::rerun-if-env-changed=HOME");
    let Some(venv) = torch_venv() else {
        println!("cargo::rustc-cfg=quilt_no_torch");
        println!("cargo::warning={tests} skipped: no HOME or QUILT_TORCH_VENV");
        return;
    };
    // The install script writes `<venv>.status`: "ok torch ..." once the
    // venv's python imports torch, else "skipped: <why>".
    let status_file = std::path::PathBuf::from(format!("{}.status", venv.display()));
    println!("cargo::rerun-if-changed={}", status_file.display());
    let status = std::fs::read_to_string(&status_file).unwrap_or_else(|_| {
        format!(
            "skipped: {} does not exist (run scripts/torch-venv.sh)",
            status_file.display()
        )
    });
    if !status.starts_with("ok") || !venv.join("bin").join("python").exists() {
        println!("cargo::rustc-cfg=quilt_no_torch");
        println!(
            "cargo::warning={tests} {}",
            status.lines().next().unwrap_or("no status")
        );
    } else {
        println!("cargo::rustc-env=QUILT_TORCH_VENV_FOUND={}", venv.display());
    }
}
