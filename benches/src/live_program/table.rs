//! The text report of a live run, in the style of `ab`'s (within 100
//! characters): a line saying what ran, the table of the claims, a table of
//! the driver calls by kind, a legend, the errors, and the best allocator
//! per column; with `--record`, the replay of the recorded trace beside the
//! live figures.

use super::record::Recorded;
use super::Row;
use crate::units::size_text;

/// Specs up to this many characters share their row's line; longer ones go
/// on a line of their own above it.
const ALLOCATOR_WIDTH: usize = 12;

/// What the run was, for the first line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunContext {
    /// The program and its arguments, as given.
    pub command: String,
    /// The largest device, bytes.
    pub max_memory: u64,
    /// The bisection's step, bytes.
    pub step: u64,
    /// Whether the bisection ran.
    pub bisect: bool,
    /// Devices of the simulated GPU.
    pub devices: String,
}

/// Bytes as whole MiB.
pub fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / (1u64 << 20) as f64)
}

/// A table's lines: the first `left` columns to the left, the others to
/// the right, a rule under the heading; long allocator names (column 0) on
/// a line of their own.
fn aligned(rows: &[Vec<String>]) -> Vec<String> {
    let n = rows.first().map_or(0, Vec::len);
    let short = |r: usize, c: usize, cell: &str| {
        !(c == 0 && r > 0 && cell.chars().count() > ALLOCATOR_WIDTH)
    };
    let widths: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .enumerate()
                .filter_map(|(r, row)| row.get(c).filter(|cell| short(r, c, cell)))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if !short(r, c, cell) {
                    out.push(format!("  {cell}"));
                    " ".repeat(widths[c])
                } else if c == 0 {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push(format!("  {}", cells.join("  ")).trim_end().to_string());
        if r == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            out.push(format!("  {}", rule.join("  ")));
        }
    }
    out
}

/// The smallest device over the peak allocated bytes.
fn over_allocated(r: &Row) -> Option<f64> {
    let min = r.smallest_device_bytes?;
    let alloc = r.largest.figures.peak_allocated_bytes;
    (alloc > 0).then(|| min as f64 / alloc as f64)
}

/// A column of the main table: heading, legend, cell, and, where the
/// summary ranks it, its figure (lower is better) in a row that completed.
struct Column {
    name: &'static str,
    legend: &'static str,
    cell: fn(&Row) -> String,
    rank: Option<fn(&Row) -> Option<u64>>,
}

const COLUMNS: &[Column] = &[
    Column {
        name: "done",
        legend:
            "yes: completed on the largest device; OOM: out of memory there; FAILED: another error",
        cell: |r| match &r.largest.error {
            _ if r.largest.completed => "yes".into(),
            Some(e) if e.oom => "OOM".into(),
            _ => "FAILED".into(),
        },
        rank: None,
    },
    Column {
        name: "reserved MiB",
        legend: "peak reserved on the largest device (torch's reserved_bytes.all.peak)",
        cell: |r| mib(r.largest.figures.peak_reserved_bytes),
        rank: Some(|r| Some(r.largest.figures.peak_reserved_bytes)),
    },
    Column {
        name: "min dev MiB",
        legend: "smallest device on which the program completes (bisection to the step; -: none)",
        cell: |r| r.smallest_device_bytes.map_or_else(|| "-".into(), mib),
        rank: Some(|r| r.smallest_device_bytes),
    },
    Column {
        name: "min/alloc",
        legend: "min dev over the peak allocated bytes (1.000: no overhead at all)",
        cell: |r| over_allocated(r).map_or_else(|| "-".into(), |x| format!("{x:.3}")),
        rank: None,
    },
    Column {
        name: "retries",
        legend: "allocation retries after freeing cached memory, on the smallest device \
                 (num_alloc_retries)",
        cell: |r| {
            r.at_smallest
                .as_ref()
                .map_or_else(|| "-".into(), |p| p.figures.num_alloc_retries.to_string())
        },
        rank: None,
    },
    Column {
        name: "mem calls",
        legend: "driver calls that get or give back memory (VMM + malloc below), largest device",
        cell: |r| r.largest.figures.calls.memory().to_string(),
        rank: Some(|r| Some(r.largest.figures.calls.memory())),
    },
    Column {
        name: "syncs",
        legend:
            "cuStreamSynchronize, cuCtxSynchronize and cuEventSynchronize calls, largest device",
        cell: |r| r.largest.figures.calls.syncs.to_string(),
        rank: Some(|r| Some(r.largest.figures.calls.syncs)),
    },
    Column {
        name: "wall s",
        legend: "seconds of the run on the largest device, Python's start-up included (noisy)",
        cell: |r| format!("{:.1}", r.largest.wall_s),
        rank: None,
    },
];

/// The first line: what ran.
fn run_line(rows: &[Row], ctx: &RunContext) -> String {
    let alloc = rows
        .iter()
        .find(|r| r.largest.completed)
        .map(|r| r.largest.figures.peak_allocated_bytes);
    format!(
        "{}: simulated GPU, {} device(s), largest {}, step {}{}{}\n",
        ctx.command,
        ctx.devices,
        size_text(ctx.max_memory),
        size_text(ctx.step),
        if ctx.bisect { "" } else { ", no bisection" },
        alloc.map_or_else(String::new, |a| format!("; peak allocated {} MiB", mib(a)))
    )
}

/// The table of the claims.
pub fn table(rows: &[Row]) -> String {
    let mut lines = vec![std::iter::once("allocator")
        .chain(COLUMNS.iter().map(|c| c.name))
        .map(String::from)
        .collect::<Vec<_>>()];
    for r in rows {
        let mut line = vec![r.allocator.clone()];
        line.extend(COLUMNS.iter().map(|c| (c.cell)(r)));
        lines.push(line);
    }
    let mut out = aligned(&lines).join("\n");
    out.push('\n');
    out
}

/// The driver calls by kind on the largest device.
pub fn calls_table(rows: &[Row]) -> String {
    let mut lines = vec![[
        "allocator",
        "calls",
        "VMM",
        "malloc",
        "syncs",
        "events",
        "waits",
        "launches",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let k = r.largest.figures.calls;
        lines.push(vec![
            r.allocator.clone(),
            k.total.to_string(),
            k.vmm.to_string(),
            k.malloc.to_string(),
            k.syncs.to_string(),
            k.events.to_string(),
            k.waits.to_string(),
            k.launches.to_string(),
        ]);
    }
    let mut out = String::from("driver calls on the largest device, by kind:\n");
    out.push_str(&aligned(&lines).join("\n"));
    out.push('\n');
    out
}

/// The legend of both tables.
pub fn legend() -> String {
    let mut out = String::from("columns:\n");
    for c in COLUMNS {
        out.push_str(&format!("  {}: {}\n", c.name, c.legend));
    }
    for (name, legend) in [
        (
            "calls",
            "every driver call, counted by the double by entry point (--json: each)",
        ),
        (
            "VMM",
            "cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, \
                 cuMemRelease, cuMemAddressFree",
        ),
        (
            "malloc",
            "cuMemAlloc and cuMemFree (cudaMalloc, cudaFree: a free waits for all work)",
        ),
        (
            "events",
            "cuEventRecord and cuEventQuery; waits: cuStreamWaitEvent",
        ),
        (
            "launches",
            "kernel launches (queued as work that computes nothing)",
        ),
    ] {
        out.push_str(&format!("  {name}: {legend}\n"));
    }
    out
}

/// The errors: each allocator's on the largest device, and what failed one
/// step below the smallest device.
pub fn notes(rows: &[Row]) -> String {
    let mut out = String::new();
    for r in rows {
        if let Some(e) = &r.largest.error {
            out.push_str(&format!(
                "{} on the largest device: {}: {}\n",
                r.allocator, e.kind, e.message
            ));
        }
        if let Some(e) = r.below_smallest.as_ref().and_then(|p| p.error.as_ref()) {
            let below = r.below_smallest.as_ref().map_or(0, |p| p.memory_bytes);
            out.push_str(&format!(
                "{} at {} MiB: {}: {}\n",
                r.allocator,
                mib(below),
                e.kind,
                shorten(&e.message, 160)
            ));
        }
    }
    out
}

/// `text` cut to `n` characters, with `...` where cut.
fn shorten(text: &str, n: usize) -> String {
    if text.chars().count() <= n {
        text.to_string()
    } else {
        format!("{}...", text.chars().take(n).collect::<String>())
    }
}

/// The best allocator per ranked column, among those that completed on the
/// largest device (ties name each).
pub fn summary(rows: &[Row]) -> String {
    let mut out = String::from("best per column (lowest; ties name each):\n");
    for c in COLUMNS {
        let Some(figure) = c.rank else { continue };
        let figures: Vec<(&str, u64)> = rows
            .iter()
            .filter(|r| r.largest.completed)
            .filter_map(|r| Some((r.allocator.as_str(), figure(r)?)))
            .collect();
        let best = figures.iter().map(|f| f.1).min();
        let text = match best {
            None => "- (no row to compare)".to_string(),
            Some(_) if figures.len() > 1 && figures.iter().all(|f| Some(f.1) == best) => {
                "all tie".to_string()
            }
            Some(b) => figures
                .iter()
                .filter(|f| f.1 == b)
                .map(|f| f.0)
                .collect::<Vec<_>>()
                .join(", "),
        };
        out.push_str(&format!("  {:<13} {text}\n", format!("{}:", c.name)));
    }
    out
}

/// The replay of the recorded trace beside the live figures: for each
/// allocator, peak reserved and smallest device, live and replayed.
pub fn replay_table(rows: &[Row], recorded: &Recorded) -> String {
    let mut lines = vec![[
        "allocator",
        "live rsvd MiB",
        "replay rsvd MiB",
        "live min MiB",
        "replay min MiB",
        "replay/live",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let replay = recorded.replayed(&r.allocator);
        let replay_min = replay.and_then(|m| m.row.min_capacity_bytes);
        lines.push(vec![
            r.allocator.clone(),
            mib(r.largest.figures.peak_reserved_bytes),
            replay.map_or_else(|| "-".into(), |m| mib(m.row.peak_reserved_bytes)),
            r.smallest_device_bytes.map_or_else(|| "-".into(), mib),
            replay_min.map_or_else(|| "-".into(), mib),
            match (replay_min, r.smallest_device_bytes) {
                (Some(a), Some(b)) if b > 0 => format!("{:.4}", a as f64 / b as f64),
                _ => "-".into(),
            },
        ]);
    }
    let mut out = format!(
        "replay of the classic run's recorded trace ({}, {} events) against live:\n",
        recorded.trace_path.display(),
        recorded.events
    );
    out.push_str(&aligned(&lines).join("\n"));
    out.push('\n');
    out.push_str(
        "  replay: ab's model of each allocator on the trace (device 0, the program's own \
         process);\n  replay/live: replay min MiB over live min MiB\n",
    );
    for f in &recorded.failures {
        out.push_str(&format!("  replay FAILED: {f}\n"));
    }
    out
}

/// The whole report.
pub fn report(rows: &[Row], ctx: &RunContext, recorded: Option<&Recorded>) -> String {
    let mut out = run_line(rows, ctx);
    out.push_str(&table(rows));
    out.push('\n');
    out.push_str(&calls_table(rows));
    out.push('\n');
    out.push_str(&legend());
    let notes = notes(rows);
    if !notes.is_empty() {
        out.push('\n');
        out.push_str(&notes);
    }
    out.push('\n');
    out.push_str(&summary(rows));
    if let Some(rec) = recorded {
        out.push('\n');
        out.push_str(&replay_table(rows, rec));
    }
    out
}
