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

#[test]
fn answers_to_libcudart_so_13_with_versioned_exports() {
    let lib = common::face();
    let headers = objdump(&["-p"], &lib);
    assert!(
        headers
            .lines()
            .any(|l| l.contains("SONAME") && l.trim_end().ends_with("libcudart.so.13")),
        "{headers}"
    );
    let exports = defined(&lib);
    let cuda: Vec<_> = exports
        .iter()
        .filter(|(n, _)| n.starts_with("cuda") || n.starts_with("__cuda"))
        .collect();
    assert!(cuda.len() > 100, "only {} cuda exports", cuda.len());
    for (name, version) in &exports {
        assert_eq!(version, "libcudart.so.13", "{name} is not versioned");
    }
}

/// Every `cuda*` function the torch wheel's libraries import from
/// `libcudart.so.13` is exported by the face (where the torch venv exists).
#[test]
#[cfg_attr(
    quilt_no_torch,
    ignore = "needs the real torch in the venv of scripts/torch-venv.sh (none when quilt-cuda-runtime was built)"
)]
fn exports_every_runtime_function_torch_imports() {
    let Some(venv) = option_env!("QUILT_TORCH_VENV_FOUND") else {
        panic!("build.rs found the torch venv but did not say where");
    };
    let venv = std::path::PathBuf::from(venv);
    let site = std::fs::read_dir(venv.join("lib"))
        .unwrap()
        .map(|e| e.unwrap().path().join("site-packages/torch/lib"))
        .find(|p| p.exists())
        .expect("torch/lib in the venv");
    let exported: std::collections::HashSet<String> = defined(&common::face())
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut imported = std::collections::BTreeSet::new();
    for lib in ["libtorch_cuda.so", "libc10_cuda.so", "libtorch_python.so"] {
        for line in objdump(&["-T"], &site.join(lib)).lines() {
            if line.contains("*UND*") && line.contains("libcudart.so.13") {
                if let Some(name) = line.split_whitespace().last() {
                    imported.insert(name.to_string());
                }
            }
        }
    }
    assert!(imported.len() > 50, "{imported:?}");
    let missing: Vec<_> = imported.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(missing.is_empty(), "not exported by the face: {missing:?}");
}
