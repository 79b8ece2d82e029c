//! Host CPU time per allocate/free pair (placeholder until the replay engine lands).
fn main() {}
