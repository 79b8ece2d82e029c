//! `live --record DIR`: the replay A/B against the live one. One more run of
//! the program under torch's classic allocator, on the largest device, with
//! torch's memory history recorded from the start; its snapshot (the
//! program's own process, device 0) becomes a trace by the bench's importer
//! ([`crate::snapshot_import`]), saved as `DIR/<program>.trace` (with
//! `DIR/<program>.pickle` and `DIR/stats.json`, so that `ab --trace
//! DIR/<program>.trace` runs it), and replayed by `ab`'s machinery
//! ([`crate::ab::measure_all`]: the allocator models, bisection to 2 MiB)
//! under each live allocator's spec.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::allocator::LiveAllocator;
use super::probe::Runner;
use crate::ab;
use crate::replay::ReplayConfig;
use crate::report::rows::{Measurement, ReportRow};
use crate::snapshot_import::load_snapshot;
use crate::trace::to_text;

/// History entries recorded by default (`--record-entries`).
pub const DEFAULT_ENTRIES: u64 = 10_000_000;

/// The recorded trace and its replay.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// The trace file written.
    pub trace_path: PathBuf,
    /// The snapshot pickle it came from.
    pub snapshot_path: PathBuf,
    /// Events of the trace.
    pub events: usize,
    /// Leading allocations live before the recorded history (0 unless the
    /// history overflowed its entries).
    pub preexisting: usize,
    /// The replays that ran, by allocator spec.
    pub replays: Vec<Measurement>,
    /// The replays that failed, each with its allocator.
    pub failures: Vec<String>,
}

impl Recorded {
    /// The replay of `spec`, if it ran.
    pub fn replayed(&self, spec: &str) -> Option<&Measurement> {
        self.replays.iter().find(|m| m.row.allocator == spec)
    }
}

/// The JSON of a [`Recorded`].
#[derive(Serialize)]
pub struct RecordedJson<'a> {
    trace: String,
    snapshot: String,
    events: usize,
    preexisting: usize,
    replays: Vec<&'a ReportRow>,
    failures: &'a [String],
}

impl<'a> RecordedJson<'a> {
    /// The JSON view of `r`.
    pub fn of(r: &'a Recorded) -> Self {
        RecordedJson {
            trace: r.trace_path.display().to_string(),
            snapshot: r.snapshot_path.display().to_string(),
            events: r.events,
            preexisting: r.preexisting,
            replays: r.replays.iter().map(|m| &m.row).collect(),
            failures: &r.failures,
        }
    }
}

/// Record the classic run into `dir` and replay it under `allocators` on a
/// device of `max_memory` bytes. `n` numbers the run's scratch folder.
pub fn record(
    runner: &Runner,
    dir: &Path,
    entries: u64,
    max_memory: u64,
    allocators: &[LiveAllocator],
    n: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Recorded, String> {
    let classic = LiveAllocator::parse("classic")?;
    runner.prepare().map_err(|e| e.to_string())?;
    let probe = runner
        .run(&classic, max_memory, Some(entries), n)
        .map_err(|e| e.to_string())?;
    progress(&format!(
        "live: classic, recording its memory history: {} ({:.1} s)",
        if probe.completed {
            "completed"
        } else {
            "did not complete"
        },
        probe.wall_s
    ));
    let Some(pickle) = probe.snapshot.clone() else {
        runner.forget(n);
        return Err(format!(
            "the recorded classic run wrote no snapshot (its process did not use CUDA, or \
             died before its exit handlers: {})",
            probe
                .error
                .as_ref()
                .map_or_else(|| "no error reported".into(), |e| e.message.clone())
        ));
    };
    let stem = runner
        .program
        .file_stem()
        .map_or_else(|| "program".into(), |s| s.to_string_lossy().into_owned());
    let io = |what: &Path, e: std::io::Error| format!("{}: {e}", what.display());
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let snapshot_path = dir.join(format!("{stem}.pickle"));
    std::fs::copy(&pickle, &snapshot_path).map_err(|e| io(&snapshot_path, e))?;
    runner.forget(n);
    let trace =
        load_snapshot(&snapshot_path).map_err(|e| format!("{}: {e}", snapshot_path.display()))?;
    let trace_path = dir.join(format!("{stem}.trace"));
    std::fs::write(&trace_path, to_text(&trace.events)).map_err(|e| io(&trace_path, e))?;
    write_stats(dir, &format!("{stem}.trace"), trace.preexisting)?;

    progress(&format!(
        "live: replaying {} ({} events) under {} allocator(s)",
        trace_path.display(),
        trace.events.len(),
        allocators.len()
    ));
    let specs: Vec<String> = allocators.iter().map(LiveAllocator::replay_spec).collect();
    let config = ReplayConfig::default();
    let outcomes = ab::measure_all(&ab::Plan {
        traces: std::slice::from_ref(&trace),
        specs: &specs,
        capacity: max_memory,
        config: &config,
        no_bisect: false,
        jobs: None,
        export_snapshot: None,
    })?;
    let mut replays = Vec::new();
    let mut failures = Vec::new();
    for o in outcomes {
        match o {
            Ok(m) => replays.push(m),
            Err(f) => failures.push(format!("{}: {}", f.allocator, f.error)),
        }
    }
    Ok(Recorded {
        trace_path,
        snapshot_path,
        events: trace.events.len(),
        preexisting: trace.preexisting,
        replays,
        failures,
    })
}

/// Set `file`'s `preexisting_allocs` in `dir/stats.json` (the list `ab
/// --trace` reads the pre-existing prefix from), keeping other entries.
fn write_stats(dir: &Path, file: &str, preexisting: usize) -> Result<(), String> {
    let path = dir.join("stats.json");
    let mut entries: Vec<serde_json::Value> = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a list of trace entries: {e}", path.display()))?,
        Err(_) => Vec::new(),
    };
    entries.retain(|e| e.get("file").and_then(|f| f.as_str()) != Some(file));
    entries.push(serde_json::json!({ "file": file, "preexisting_allocs": preexisting }));
    let text = serde_json::to_string_pretty(&entries).map_err(|e| e.to_string())?;
    std::fs::write(&path, format!("{text}\n")).map_err(|e| format!("{}: {e}", path.display()))
}
