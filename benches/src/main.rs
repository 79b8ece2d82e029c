//! The `quilt-bench` command line.
fn main() {}
