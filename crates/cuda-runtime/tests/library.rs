//! The face as a library: its soname, and every export under the
//! `libcudart.so.13` version node, as the CUDA 13 wheels' libraries import
//! them (`objdump -T`, from binutils, which the face's link needs anyway).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::process::Command;

fn objdump(args: &[&str], lib: &std::path::Path) -> String {
    let out = Command::new("objdump")
        .args(args)
        .arg(lib)
        .output()
        .expect("objdump (binutils) runs");
    assert!(out.status.success(), "objdump {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The dynamic symbols defined in `lib` (`objdump -T` rows with a section).
fn defined(lib: &std::path::Path) -> Vec<(String, String)> {
    objdump(&["-T"], lib)
        .lines()
        .filter(|l| l.contains(" DF ") && !l.contains("*UND*"))
        .filter_map(|l| {
            let mut f = l.split_whitespace().rev();
            let name = f.next()?.to_string();
            let version = f.next()?.to_string();
            Some((name, version))
        })
        .collect()
}

/// `lib` answers to `soname`, exports more than `at_least` functions whose
/// names start with one of `prefixes`, and every export is versioned
/// `soname`.
fn answers_to(lib: &std::path::Path, soname: &str, prefixes: &[&str], at_least: usize) {
    let headers = objdump(&["-p"], lib);
    assert!(
        headers
            .lines()
            .any(|l| l.contains("SONAME") && l.trim_end().ends_with(soname)),
        "{headers}"
    );
    let exports = defined(lib);
    let api = exports
        .iter()
        .filter(|(n, _)| prefixes.iter().any(|p| n.starts_with(p)))
        .count();
    assert!(api > at_least, "only {api} exports of {prefixes:?}");
    for (name, version) in &exports {
        assert_eq!(version, soname, "{name} is not versioned");
    }
}

#[test]
fn answers_to_libcudart_so_13_with_versioned_exports() {
    answers_to(&common::face(), "libcudart.so.13", &["cuda", "__cuda"], 100);
}

#[test]
fn the_cublas_faces_answer_to_their_sonames_with_versioned_exports() {
    let blas = common::built("libquilt_cublas.so");
    answers_to(&blas, "libcublas.so.13", &["cublas"], 150);
    let lt = common::built("libquilt_cublas_lt.so");
    answers_to(&lt, "libcublasLt.so.13", &["cublasLt"], 20);
}

/// Every `cuda*` function the torch wheel's libraries import from
/// `libcudart.so.13` is exported by the face (where the torch venv exists).
/// Every function the torch wheel's libraries `users` import from
/// `version` (more than `at_least`) is exported by `face`.
fn exports_what_torch_imports(
    face: &std::path::Path,
    version: &str,
    users: &[&str],
    at_least: usize,
) {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    let venv = std::path::PathBuf::from(venv);
    let site = std::fs::read_dir(venv.join("lib"))
        .unwrap()
        .map(|e| e.unwrap().path().join("site-packages/torch/lib"))
        .find(|p| p.exists())
        .expect("torch/lib in the venv");
    let exported: std::collections::HashSet<String> =
        defined(face).into_iter().map(|(n, _)| n).collect();
    let mut imported = std::collections::BTreeSet::new();
    for lib in users {
        for line in objdump(&["-T"], &site.join(lib)).lines() {
            if line.contains("*UND*") && line.contains(&format!("({version})")) {
                if let Some(name) = line.split_whitespace().last() {
                    imported.insert(name.to_string());
                }
            }
        }
    }
    assert!(imported.len() > at_least, "{imported:?}");
    let missing: Vec<_> = imported.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "not exported by {}: {missing:?}",
        face.display()
    );
}

#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built)"
)]
fn exports_every_runtime_function_torch_imports() {
    let users = ["libtorch_cuda.so", "libc10_cuda.so", "libtorch_python.so"];
    exports_what_torch_imports(&common::face(), "libcudart.so.13", &users, 50);
}

/// Every `cublas*` and `cublasLt*` function torch's CUDA libraries import
/// (`libtorch_cuda_linalg.so`'s too, which the face refuses by name).
#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built)"
)]
fn the_cublas_faces_export_every_function_torch_imports() {
    let users = ["libtorch_cuda.so", "libtorch_cuda_linalg.so"];
    let blas = common::built("libquilt_cublas.so");
    exports_what_torch_imports(&blas, "libcublas.so.13", &users, 150);
    let lt = common::built("libquilt_cublas_lt.so");
    exports_what_torch_imports(&lt, "libcublasLt.so.13", &users, 15);
}
