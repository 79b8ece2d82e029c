//! Helpers shared by quilt-bench's integration tests: a test file that
//! needs them declares `mod common;`.
#![allow(dead_code)] // each test file uses a part

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_pickle::{HashableValue, Value};

/// The converted real traces (`*.trace`), in `../shared` beside the checkout.
pub fn traces_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/converted"
    ))
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
