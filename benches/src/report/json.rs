//! The JSON outputs: the report of an A/B run (`{"parameters": {...},
//! "rows": [...]}`), of a sweep (the same with the swept value), and the
//! points of a scaling run.

use serde::Serialize;

use crate::report::rows::{Failure, Outcome, ReportRow, RunParameters, ScalePoint};

/// A row of the JSON report: a measurement or a failure.
#[derive(Serialize)]
#[serde(untagged)]
enum JsonRow<'a> {
    Measured(&'a ReportRow),
    Failed(&'a Failure),
}

impl<'a> JsonRow<'a> {
    fn of(outcome: &'a Outcome) -> Self {
        match outcome {
            Ok(m) => JsonRow::Measured(&m.row),
            Err(f) => JsonRow::Failed(f),
        }
    }
}

/// The JSON report: `{"parameters": {...}, "rows": [...]}`, a row per
/// outcome, in order ([`ReportRow`]s, and [`Failure`]s where a pair failed).
pub fn to_json(
    parameters: &RunParameters,
    outcomes: &[Outcome],
) -> Result<String, serde_json::Error> {
    #[derive(Serialize)]
    struct Report<'a> {
        parameters: &'a RunParameters,
        rows: Vec<JsonRow<'a>>,
    }
    serde_json::to_string_pretty(&Report {
        parameters,
        rows: outcomes.iter().map(JsonRow::of).collect(),
    })
}

/// The JSON report of a sweep: as [`to_json`], with each row's `value` of
/// the swept key, and `vary` (the key) among the parameters.
pub fn sweep_json(
    parameters: &RunParameters,
    key: &str,
    values: &[String],
    outcomes: &[Outcome],
) -> Result<String, serde_json::Error> {
    #[derive(Serialize)]
    struct SweepParameters<'a> {
        #[serde(flatten)]
        run: &'a RunParameters,
        vary: &'a str,
    }
    #[derive(Serialize)]
    struct SweepRow<'a> {
        #[serde(flatten)]
        row: JsonRow<'a>,
        value: &'a str,
    }
    #[derive(Serialize)]
    struct Report<'a> {
        parameters: SweepParameters<'a>,
        rows: Vec<SweepRow<'a>>,
    }
    serde_json::to_string_pretty(&Report {
        parameters: SweepParameters {
            run: parameters,
            vary: key,
        },
        rows: values
            .iter()
            .zip(outcomes)
            .map(|(value, o)| SweepRow {
                row: JsonRow::of(o),
                value,
            })
            .collect(),
    })
}

/// The JSON of a scaling run: its points, in order.
pub fn scale_json(points: &[ScalePoint]) -> Result<String, serde_json::Error> {
    serde_json::to_string_pretty(points)
}
