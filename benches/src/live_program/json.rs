//! The JSON report of a live run: `{"parameters": {...}, "rows": [...],
//! "replay": {...} or null}`, a row per allocator ([`super::Row`]: the run
//! on the largest device, the smallest device, the runs at it and one step
//! below, the sizes probed), each run with torch's figures and the driver
//! calls by kind and by entry point.

use serde::Serialize;

use super::record::{Recorded, RecordedJson};
use super::Row;

/// What the run was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Parameters {
    /// `quilt-bench`'s version and commit.
    pub version: String,
    /// The program.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The Python interpreter.
    pub python: String,
    /// The largest device, bytes.
    pub max_memory_bytes: u64,
    /// The bisection's step, bytes.
    pub step_bytes: u64,
    /// Whether the bisection ran.
    pub bisection: bool,
    /// Devices of the simulated GPU (`QUILT_CUDA_DOUBLE_DEVICES`).
    pub devices: String,
}

/// The JSON text of a run.
pub fn to_json(
    parameters: &Parameters,
    rows: &[Row],
    recorded: Option<&Recorded>,
) -> Result<String, serde_json::Error> {
    #[derive(Serialize)]
    struct Report<'a> {
        parameters: &'a Parameters,
        rows: &'a [Row],
        replay: Option<RecordedJson<'a>>,
    }
    serde_json::to_string_pretty(&Report {
        parameters,
        rows,
        replay: recorded.map(RecordedJson::of),
    })
}
