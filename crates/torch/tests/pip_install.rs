//! `pip install <checkout>` as a new user does it (pyproject.toml, setup.py):
//! a fresh virtual environment that sees the real torch of
//! `scripts/torch-venv.sh` (a `.pth` file naming that environment's
//! site-packages), `pip install` of this repository, then, from another
//! folder and with no `sys.path` edit, `import quilt_torch`: the library is
//! the one inside the installed package, the C library answers
//! (`quilt_malloc`/`quilt_free` on `backend:host`, through ctypes),
//! `check_configuration()` and `enable()` work, the C++ sources that
//! `enable()` compiles are there, and the version is the workspace's.
//!
//! Ignored, with the reason, where the torch environment was not there when
//! quilt-torch was built (`build.rs`'s `cfg(quilt_no_torch)`). pip's isolated
//! build fetches the build backend (setuptools, setuptools-rust) from the
//! package index, or from `$PIP_FIND_LINKS`/`$PIP_INDEX_URL`: where neither
//! answers the test fails saying so.
//!
//! cargo builds the library into `<target>/pip-install`, its own target
//! folder, kept between runs (the first run builds quilt-torch's dependencies
//! once, later runs only what changed). Not `<target>` itself: `cargo test
//! --workspace` compiles quilt-torch with its dev-dependencies' features
//! (quilt-alloc's `invariants`, `serde`), so nothing of quilt-torch's own
//! tree would be reused, and the pip build would overwrite
//! `<target>/release/deps/libquilt_torch.so`, the library the Python tests
//! that run after this one load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

/// Runs `cmd`, panicking with everything it printed unless it succeeds.
fn run(what: &str, cmd: &mut Command) -> Output {
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => panic!("{what}: cannot run {cmd:?} ({e})"),
    };
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// The site-packages folder of the environment whose python is `python`.
fn site_packages(python: &Path) -> PathBuf {
    let out = run(
        "asking python for its site-packages",
        Command::new(python).args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ]),
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// What the installed package must do, run from a folder outside the
/// checkout. argv: the workspace's version, the checkout's package folder.
const PROBE: &str = r#"
import ctypes, importlib.metadata, os, sys, sysconfig
import quilt_torch

site = sysconfig.get_path("purelib")
package = os.path.dirname(os.path.abspath(quilt_torch.__file__))
assert package == os.path.join(site, "quilt_torch"), (package, site)
library = quilt_torch.library_path()
assert os.path.dirname(library) == package, library
# The C++ sources enable() compiles against the installed torch: package data.
sources = [f for f in os.listdir(sys.argv[2]) if f.endswith(".cpp")]
assert sources, sys.argv[2]
for source in sources:
    assert os.path.isfile(os.path.join(package, source)), (source, os.listdir(package))
version = importlib.metadata.version("quilt-torch")
assert version == sys.argv[1], (version, sys.argv[1])
print("library", library)

# The C library itself, through ctypes, on host memory.
lib = ctypes.CDLL(library)
lib.quilt_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.quilt_malloc.restype = ctypes.c_void_p
lib.quilt_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.quilt_free.restype = None
size = 3 << 20
ptr = lib.quilt_malloc(size, 0, None)
assert ptr, "quilt_malloc returned NULL: " + quilt_torch.last_error()
ctypes.memset(ptr, 0x5A, size)
assert ctypes.string_at(ptr + size - 7, 7) == b"\x5a" * 7
# quilt_torch's functions reach the same library instance.
assert quilt_torch.memory_allocated(0) >= size, quilt_torch.memory_stats(0)
lib.quilt_free(ptr, size, 0, None)
assert quilt_torch.memory_allocated(0) == 0, quilt_torch.memory_stats(0)

stats = quilt_torch.check_configuration()
assert stats["backend"] == "host", stats
print("check_configuration backend", stats["backend"])

import torch
allocator = quilt_torch.enable()
assert allocator is not None
print("enable", type(allocator).__name__, "torch", torch.__version__)
print("probe ok")
"#;

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-torch was built; see the build warning)"
)]
fn pip_install_puts_the_library_inside_the_package() {
    let start = Instant::now();
    let Some(torch_venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    let torch_python = PathBuf::from(torch_venv).join("bin").join("python");
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap();
    // <target>/<profile>/deps/pip_install-<hash>
    let exe = std::env::current_exe().unwrap();
    let target = exe.ancestors().nth(3).unwrap().to_path_buf();
    let cargo_target = target.join("pip-install");
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pip-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();

    // A fresh environment with the torch environment's packages visible.
    let venv = scratch.join("venv");
    run(
        "python -m venv",
        Command::new(&torch_python).arg("-m").arg("venv").arg(&venv),
    );
    let python = venv.join("bin").join("python");
    std::fs::write(
        site_packages(&python).join("quilt-torch-venv.pth"),
        format!("{}\n", site_packages(&torch_python).display()),
    )
    .unwrap();
    let made = start.elapsed();

    // setuptools' scratch folders in this run's own folder.
    let build = scratch.join("build");
    std::fs::create_dir_all(&build).unwrap();
    let config = scratch.join("setup.cfg");
    std::fs::write(
        &config,
        format!(
            "[build]\nbuild_base = {0}\n[egg_info]\negg_base = {0}\n",
            build.display()
        ),
    )
    .unwrap();

    let before = Instant::now();
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
        ])
        .arg(&repo)
        .current_dir(&scratch)
        .env("CARGO_TARGET_DIR", &cargo_target)
        .env("DIST_EXTRA_CONFIG", &config)
        .env_remove("QUILT_TORCH_LIBRARY")
        .output()
        .unwrap();
    let install = before.elapsed();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "pip install {} failed (its isolated build fetches setuptools and setuptools-rust \
         from the package index or $PIP_FIND_LINKS, and runs cargo):\n{text}",
        repo.display()
    );
    assert!(
        text.contains("Successfully installed quilt-torch-"),
        "{text}"
    );

    let out = Command::new(&python)
        .args(["-c", PROBE, env!("CARGO_PKG_VERSION")])
        .arg(repo.join("python").join("quilt_torch"))
        .current_dir(&scratch)
        .env("QUILT_ALLOC_CONF", "backend:host,capacity:256MiB")
        // real_torch.rs's cache (keyed by the C++ sources and torch): what
        // enable() compiles at its first call is compiled once for both.
        .env(
            "QUILT_TORCH_BRIDGE_CACHE",
            exe.parent().unwrap().join("quilt-torch-bridge"),
        )
        .env_remove("QUILT_TORCH_LIBRARY")
        .env_remove("PYTHONPATH")
        .output()
        .unwrap();
    let probe = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && probe.contains("probe ok"),
        "the installed quilt_torch failed:\n{probe}"
    );
    assert!(
        probe.contains(&format!("library {}", venv.display())),
        "{probe}"
    );
    eprintln!(
        "{probe}venv {:.1} s, pip install {:.1} s, all {:.1} s",
        made.as_secs_f64(),
        install.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&scratch);
}
