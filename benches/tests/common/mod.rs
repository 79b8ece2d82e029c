//! Helpers shared by quilt-bench's integration tests: a test file that
//! needs them declares `mod common;`.
#![allow(dead_code)] // each test file uses a part

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Output;

use serde_pickle::{HashableValue, Value};

/// The converted real traces (`*.trace`), in `../shared` beside the checkout.
pub fn traces_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/converted"
    ))
}

/// A fresh folder under the system's temporary directory, named after
/// `tag` and this process.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("quilt-bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A finished process's exit status, stdout and stderr, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A pickle string key.
pub fn s(text: &str) -> HashableValue {
    HashableValue::String(text.into())
}

/// A pickle dict of `items`.
pub fn dict(items: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        items
            .into_iter()
            .map(|(k, v)| (s(k), v))
            .collect::<BTreeMap<_, _>>(),
    )
}
