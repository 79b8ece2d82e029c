//! Sets `cfg(quilt_no_python3)` where no `python3` runs at build time, so
//! that the Python test (`tests/python.rs`) is reported as ignored there
//! instead of passing without having run.

use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(quilt_no_python3)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PATH");
    let runs = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs {
        println!("cargo::rustc-cfg=quilt_no_python3");
    }
}
