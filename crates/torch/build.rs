//! Sets `cfg(quilt_no_python3)` where no `python3` runs at build time, so
//! that the Python test (`tests/python.rs`) is reported as ignored there
//! instead of passing without having run; and `cfg(quilt_no_torch)` where
//! the virtual environment with the real torch (`scripts/torch-venv.sh`) is
//! not there, so that `tests/real_torch.rs` is reported as ignored, with the
//! reason printed as a build warning.

use std::path::PathBuf;
use std::process::Command;

include!("build/torch_venv.rs");

/// Sets `cfg(quilt_no_viewer)` unless everything `tests/viewer.rs` needs is
/// here: PyTorch's viewer (`third_party/viz/MemoryViz.js`, git-ignored, or
/// `$QUILT_MEMORY_VIZ`), `npm ci` done in `scripts/viewer-check`, `node`,
/// `python3` and Chromium (`/usr/bin/chromium` or `$QUILT_CHROMIUM`); the
/// test is then ignored, the reason a build warning. Those present are
/// watched; after adding one that was missing, `touch crates/torch/build.rs`.
fn viewer_check() {
    println!("cargo::rustc-check-cfg=cfg(quilt_no_viewer)");
    println!("cargo::rerun-if-env-changed=QUILT_MEMORY_VIZ");
    println!("cargo::rerun-if-env-changed=QUILT_CHROMIUM");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let repo = manifest.join("..").join("..");
    let check = repo.join("scripts").join("viewer-check");
    let viewer = std::env::var_os("QUILT_MEMORY_VIZ")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("third_party").join("viz").join("MemoryViz.js"));
    let chromium = std::env::var_os("QUILT_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    let files = [
        ("PyTorch's viewer", viewer),
        ("Chromium", chromium),
        (
            "d3 (npm ci in scripts/viewer-check)",
            check.join("node_modules").join("d3").join("package.json"),
        ),
        (
            "playwright-core (npm ci in scripts/viewer-check)",
            check
                .join("node_modules")
                .join("playwright-core")
                .join("package.json"),
        ),
    ];
    let mut missing: Vec<String> = Vec::new();
    for (what, path) in &files {
        if path.is_file() {
            println!("cargo::rerun-if-changed={}", path.display());
        } else {
            missing.push(format!("{what} ({})", path.display()));
        }
    }
    for program in ["node", "python3"] {
        let runs = Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !runs {
            missing.push(format!("{program} on PATH"));
        }
    }
    if !missing.is_empty() {
        println!("cargo::rustc-cfg=quilt_no_viewer");
        println!(
            "cargo::warning=viewer test ignored: no {}",
            missing.join(", no ")
        );
    }
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(quilt_no_python3)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build/torch_venv.rs");
    viewer_check();
    let runs = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs {
        println!("cargo::rustc-cfg=quilt_no_python3");
        // Looked for again when PATH changes, so that a python3 installed
        // later is found. Not where one runs: `pip install .` builds this
        // crate under PATHs with fresh temporary folders (its isolated build
        // environment), which would otherwise rebuild quilt-torch, and
        // everything above it, at each install and at the next `cargo test`.
        println!("cargo::rerun-if-env-changed=PATH");
    }
    torch_venv_cfg("real-torch tests");
}
