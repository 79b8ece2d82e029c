//! The double's ABI from C: `tests/c/client.c`, a client that knows only
//! cuda.h's declarations (copied into it, `_v2` names included), is built
//! with the C compiler the Rust toolchain links with (`cc`), linked with
//! `-lcuda` against the double's private folder of `libcuda` links, and run
//! over the double: a typical VMM allocator's sequence, every result and
//! byte checked by the client itself.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use quilt_cuda_double::harness;

/// A fresh folder for this run's build, under cargo's scratch folder for
/// integration tests.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("quilt-cuda-double-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `cmd`, failing the test with a clear message where the program is
/// missing.
fn run(cmd: &mut Command, what: &str) -> Output {
    match cmd.output() {
        Ok(out) => out,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "{what}: {:?} was not found ({e}). The C compiler `cc` is required: the Rust \
             toolchain links with it, so it is installed wherever these tests can be built",
            cmd.get_program()
        ),
        Err(e) => panic!("{what}: starting {:?}: {e}", cmd.get_program()),
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Builds `tests/c/client.c` into `dir` with `-lcuda` resolved against
/// `libs` (the double's links); the executable.
fn build_client(dir: &Path, libs: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/client.c");
    let exe = dir.join("client");
    let out = run(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
            .arg(&exe)
            .arg(&source)
            .arg("-L")
            .arg(libs)
            .arg("-lcuda"),
        "compiling tests/c/client.c",
    );
    assert!(
        out.status.success(),
        "cc failed on {} ({}):\n{}{}",
        source.display(),
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    exe
}

#[test]
fn a_c_client_of_cuda_h_runs_a_vmm_allocator_sequence_over_the_double() {
    let libs = harness::library_dir(&harness::library().unwrap()).unwrap();
    let dir = scratch("c-client");
    let exe = build_client(&dir, &libs);
    let out = run(
        &mut harness::command(&exe).unwrap(),
        "running the C client over the double",
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success(),
        "the C client failed over the double ({}):\n{stdout}{stderr}",
        out.status
    );
    assert!(
        stdout.contains("client: all checks passed"),
        "the C client did not finish:\n{stdout}"
    );
    for step in [
        "ok contexts",
        "ok reserve, create, map, set access",
        "ok streams and events",
        "ok export and import of a POSIX descriptor",
        "ok teardown",
    ] {
        assert!(stdout.contains(step), "missing step {step:?}:\n{stdout}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_c_client_asks_for_libcuda_so_1_and_fails_without_the_double() {
    let libs = harness::library_dir(&harness::library().unwrap()).unwrap();
    let dir = scratch("c-client-soname");
    let exe = build_client(&dir, &libs);
    // Linked against the double's soname, as against the real driver's.
    // (readelf comes with the binutils beside `cc`; where it is missing,
    // this part is skipped.)
    if let Some(needed) = Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
        .ok()
        .filter(|o| o.status.success())
    {
        let dynamic = text(&needed.stdout);
        assert!(
            dynamic.contains("[libcuda.so.1]"),
            "the client does not need libcuda.so.1:\n{dynamic}"
        );
    }
    // Without the double's folder on the library path it cannot start (or
    // finds a real driver): never a silent pass over something else.
    let out = run(
        Command::new(&exe).env_remove("LD_LIBRARY_PATH"),
        "running the C client without the double",
    );
    let stdout = text(&out.stdout);
    assert!(
        !stdout.contains("Quilt CUDA double"),
        "the double was found without its folder on the library path:\n{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
