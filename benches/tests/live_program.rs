//! `quilt-bench live` (the live A/B) as a user runs it: `benches/programs/ci_churn.py`
//! on the simulated GPU, over the face, the cuBLAS faces and the double cargo
//! built for this test, under torch's classic allocator, its expandable
//! segments and Quilt, with a coarse step; the bisection's answers re-run;
//! the errors' exit statuses. The tests that run torch are ignored, with the
//! reason, where the torch venv of `scripts/torch-venv.sh` was not there when
//! this package was built (`build.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::{temp_dir, text};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// The coarse step of the tests' bisections.
const STEP: u64 = 64 * MIB;

/// The folder of the running test binary (`target/<profile>/deps`).
fn deps() -> PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A library cargo built for this test: beside the test binary or one up.
fn built(name: &str) -> PathBuf {
    let here = deps();
    [here.join(name), here.join("..").join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} is not built beside {}", here.display()))
}

fn program() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/programs/ci_churn.py"))
}

/// The torch venv's python, as `build.rs` found it.
#[cfg(not(quilt_no_torch))]
fn python() -> PathBuf {
    PathBuf::from(env!("QUILT_TORCH_VENV_FOUND"))
        .join("bin")
        .join("python")
}

/// `quilt-bench live ...` over this build's libraries.
fn live(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quilt-bench"));
    cmd.arg("live")
        .args(args)
        .env(
            "QUILT_SIMULATED_GPU_FACE",
            built("libquilt_cuda_runtime.so"),
        )
        .env(
            "QUILT_SIMULATED_GPU_DOUBLE",
            built("libquilt_cuda_double.so"),
        )
        .env("QUILT_SIMULATED_GPU_CUBLAS", built("libquilt_cublas.so"))
        .env(
            "QUILT_SIMULATED_GPU_CUBLASLT",
            built("libquilt_cublas_lt.so"),
        )
        .env("QUILT_TORCH_LIBRARY", built("libquilt_torch.so"))
        .env(
            "QUILT_TORCH_BRIDGE_CACHE",
            deps().join("quilt-torch-bridge"),
        )
        .env_remove("QUILT_CUDA_DOUBLE_DEVICES")
        .env_remove("QUILT_CUDA_DOUBLE_RELAX");
    #[cfg(not(quilt_no_torch))]
    cmd.arg("--python").arg(python());
    cmd.output().unwrap()
}

fn bytes(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("not a byte count: {v}"))
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-bench was built; see the build warning)"
)]
fn ci_churn_completes_under_every_allocator_and_its_smallest_devices_hold() {
    let dir = temp_dir("live");
    let json = dir.join("live.json");
    let record = dir.join("record");
    let svg = dir.join("svg");
    let out = live(&[
        program().to_str().unwrap(),
        "--step",
        "64MiB",
        "--max-memory",
        "2GiB",
        "--json",
        json.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
        "--record",
        record.to_str().unwrap(),
    ]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    for line in [
        "min dev MiB",
        "best per column",
        "replay of the classic run",
    ] {
        assert!(report.contains(line), "missing {line:?}: {report}");
    }
    assert!(svg.join("ci_churn-live.svg").is_file());

    let json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(bytes(&json["parameters"]["max_memory_bytes"]), 2 << 30);
    assert_eq!(bytes(&json["parameters"]["step_bytes"]), STEP);
    let rows = json["rows"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["classic", "expandable", "quilt"]);
    let mut smallest = Vec::new();
    for r in rows {
        let name = r["allocator"].as_str().unwrap();
        let largest = &r["largest"];
        assert_eq!(largest["completed"], true, "{name}: {largest}");
        assert!(largest["error"].is_null(), "{name}: {largest}");
        assert!(largest["wall_s"].as_f64().unwrap() > 0.0);
        let figures = &largest["figures"];
        let peak = bytes(&figures["peak_allocated_bytes"]);
        let reserved = bytes(&figures["peak_reserved_bytes"]);
        assert!(peak > 100 * MIB && reserved >= peak, "{name}: {figures}");
        for key in ["num_ooms", "num_alloc_retries"] {
            assert!(figures[key].is_u64(), "{name}: {key} in {figures}");
        }
        // The double counted the calls each allocator makes.
        let calls = &figures["calls"];
        assert!(
            bytes(&calls["syncs"]) > 0 && bytes(&calls["launches"]) > 0,
            "{calls}"
        );
        if name == "classic" {
            assert!(
                bytes(&calls["malloc"]) > 0 && bytes(&calls["vmm"]) == 0,
                "{calls}"
            );
        } else {
            assert!(bytes(&calls["vmm"]) > 0, "{name}: {calls}");
        }
        assert!(bytes(&figures["driver_calls"]["cuInit"]) >= 1);

        let min = bytes(&r["smallest_device_bytes"]);
        assert!(
            min >= peak,
            "{name}: smallest device {min} below the peak {peak}"
        );
        assert_eq!(min % STEP, 0);
        assert!(min <= 2 << 30);
        assert_eq!(r["at_smallest"]["completed"], true, "{name}");
        assert!(!r["probes"].as_array().unwrap().is_empty(), "{name}");
        smallest.push((name.to_string(), min, r["at_smallest"]["figures"].clone()));
    }

    // The recorded trace is one `ab --trace` runs, and its replay sits
    // beside the live figures.
    let trace = record.join("ci_churn.trace");
    assert!(trace.is_file() && record.join("stats.json").is_file());
    let replay = &json["replay"];
    assert!(bytes(&replay["events"]) > 1000, "{replay}");
    let replays = replay["replays"].as_array().unwrap();
    assert_eq!(replays.len(), 3, "{replay}");
    for r in replays {
        assert!(bytes(&r["min_capacity_bytes"]) > 100 * MIB, "{r}");
    }
    let ab = Command::new(env!("CARGO_BIN_EXE_quilt-bench"))
        .args(["ab", "--allocators", "classic", "--no-bisect", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(ab.status.success(), "{}", text(&ab));

    // Re-run at the answers: each completes there, with the same figures as
    // its probe there (the runs are deterministic), and not one step below.
    for (name, min, figures) in smallest {
        let at = live(&[
            program().to_str().unwrap(),
            "--allocators",
            &name,
            "--no-bisect",
            "--max-memory",
            &format!("{}MiB", min / MIB),
            "--json",
            "-",
        ]);
        assert!(at.status.success(), "{name} at {min}: {}", text(&at));
        let again: Value = serde_json::from_slice(&at.stdout).unwrap();
        let got = &again["rows"][0]["largest"]["figures"];
        assert_eq!(
            got, &figures,
            "{name}: the figures at {min} differ between runs"
        );

        let below = live(&[
            program().to_str().unwrap(),
            "--allocators",
            &name,
            "--no-bisect",
            "--max-memory",
            &format!("{}MiB", (min - STEP) / MIB),
        ]);
        assert_eq!(
            below.status.code(),
            Some(1),
            "{name} below {min}: {}",
            text(&below)
        );
        let says = text(&below);
        assert!(
            says.contains("OutOfMemoryError") && says.contains("fails under every allocator"),
            "{says}"
        );
    }
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-bench was built; see the build warning)"
)]
fn a_program_failing_everywhere_is_reported_with_its_error() {
    let dir = temp_dir("live-fails");
    let failing = dir.join("fails.py");
    std::fs::write(&failing, "raise ValueError('this program always fails')\n").unwrap();
    let out = live(&[
        failing.to_str().unwrap(),
        "--no-bisect",
        "--max-memory",
        "1GiB",
    ]);
    let says = text(&out);
    assert_eq!(out.status.code(), Some(1), "{says}");
    assert!(
        says.contains("fails under every allocator")
            && says.contains("ValueError: this program always fails"),
        "{says}"
    );
    assert!(says.contains("FAILED"), "{says}");
}

#[test]
fn a_missing_program_or_a_bad_argument_exits_2_naming_it() {
    let program = program();
    let program = program.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["no/such/program.py"], "no/such/program.py"),
        (
            &[program, "--allocator", "quilt:reclaim=sometimes"],
            "quilt:reclaim=sometimes",
        ),
        (&[program, "--allocators", "gmlake"], "gmlake"),
        (&[program, "--allocator", "quilt:backend=host"], "backend"),
        (&[program, "--step", "3MiB"], "--step"),
        (
            &[program, "--step", "64MiB", "--max-memory", "100MiB"],
            "--max-memory",
        ),
    ];
    for (args, named) in cases {
        let out = live(args);
        let says = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {says}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(named),
            "{args:?} should name {named}: {says}"
        );
    }
}
