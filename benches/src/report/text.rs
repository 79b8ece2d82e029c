//! The text outputs: the report of an A/B run (a line saying what ran, the
//! table, a legend of its columns, the out-of-memory and failure notes, and a
//! summary naming the best allocator per column), the table of a scaling
//! run ([`scale_table`]) and the list of the built-in workloads ([`list`]).
//!
//! The default layout ([`Layout::Narrow`]) shows the columns that carry the
//! claims, one block per workload, within [`MAX_WIDTH`] characters;
//! [`Layout::Wide`] shows every column, a line per (workload, allocator).
//! Column names are those of `docs/benchmarks.md`; the legend names the JSON
//! field behind each.

use quilt_alloc::OomVerdict;

use crate::live::trace_stats;
use crate::report::rows::{
    allocator_of, distinct, workload_of, Failure, Measurement, Outcome, ReportRow, ScalePoint,
};
use crate::trace::{Event, Trace};
use crate::units::{gib, size_text as size};
use crate::workloads::WORKLOADS;

/// The widest line the narrow layout prints (allocator specs longer than
/// [`NARROW_ALLOCATOR_WIDTH`] go on a line of their own).
pub const MAX_WIDTH: usize = 100;

/// Allocator specs up to this many characters share their row's line.
pub const NARROW_ALLOCATOR_WIDTH: usize = 12;

/// Which columns the table shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The claims: done, min cap, min cap/ideal, eff., driver ms, calls after
    /// 1st, syncs, waits; a block per workload headed by its peak live and
    /// ideal bytes.
    Narrow,
    /// Every column, a line per (workload, allocator).
    Wide,
}

/// What the run was, for the line above the table and the legend.
#[derive(Clone, Debug, PartialEq)]
pub struct RunContext {
    /// Device capacity of the main replay.
    pub capacity_bytes: u64,
    /// Iterations of each trace.
    pub iterations: u32,
    /// Allocator operations the simulated GPU runs behind the host.
    pub gpu_lag_ops: u64,
    /// Modelled cost of one stream synchronisation, in microseconds.
    pub sync_cost_us: f64,
    /// Whether the minimum capacity was bisected.
    pub bisection: bool,
}

/// The figures a cell is made from.
struct Cell<'a> {
    m: &'a Measurement,
    /// The reference allocator's row on the same workload (the `/classic`
    /// columns divide by it).
    classic: Option<&'a ReportRow>,
}

/// One column: its heading (as in `docs/benchmarks.md`), its line of the
/// legend, whether the narrow layout shows it, and its cell.
struct Column {
    name: &'static str,
    legend: &'static str,
    narrow: bool,
    cell: fn(&Cell<'_>) -> String,
}

/// `a / b` as `1.23x`, or `-` when it has no meaning.
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    }
}

/// `figure` of the cell's row over the same of the reference row.
fn over_reference(c: &Cell<'_>, figure: fn(&ReportRow) -> Option<f64>) -> String {
    ratio(figure(&c.m.row), c.classic.and_then(figure))
}

fn min_cap_over_ideal(r: &ReportRow) -> Option<f64> {
    match r.min_capacity_bytes {
        Some(b) if r.ideal_bytes > 0 => Some(b as f64 / r.ideal_bytes as f64),
        _ => None,
    }
}

const COLUMNS: &[Column] = &[
    Column {
        name: "done",
        legend: "yes: the replay completed on the device; OOM: it ran out of memory (figures up to then)",
        narrow: true,
        cell: |c| if c.m.row.completed { "yes" } else { "OOM" }.into(),
    },
    Column {
        name: "peak live GiB",
        legend: "peak of the live requested bytes",
        narrow: false,
        cell: |c| gib(c.m.row.peak_live_bytes),
    },
    Column {
        name: "peak reserved GiB",
        legend: "peak of the bytes the allocator held from the driver",
        narrow: false,
        cell: |c| gib(c.m.row.peak_reserved_bytes),
    },
    Column {
        name: "ideal GiB",
        legend: "page-granular lower bound: the least any 2 MiB-page allocator could hold",
        narrow: false,
        cell: |c| gib(c.m.row.ideal_bytes),
    },
    Column {
        name: "min cap GiB",
        legend: "smallest device, to 2 MiB, on which the replay completes (bisection; -: --no-bisect)",
        narrow: true,
        cell: |c| c.m.row.min_capacity_bytes.map(gib).unwrap_or_else(|| "-".into()),
    },
    Column {
        name: "min cap/ideal",
        legend: "min cap / ideal GiB, the page-granular lower bound: 1.0000 is no overhead",
        narrow: true,
        cell: |c| min_cap_over_ideal(&c.m.row).map_or_else(|| "-".into(), |r| format!("{r:.4}")),
    },
    Column {
        name: "min cap/classic",
        legend: "min cap over classic's on the same workload (X/classic: the same ratio for X)",
        narrow: false,
        cell: |c| over_reference(c, |r| r.min_capacity_bytes.map(|b| b as f64)),
    },
    Column {
        name: "eff.",
        legend: "efficiency: peak live / peak reserved bytes on the device (1.000: none held idle)",
        narrow: true,
        cell: |c| format!("{:.3}", c.m.row.efficiency),
    },
    Column {
        name: "reserved/classic",
        legend: "peak reserved over classic's",
        narrow: false,
        cell: |c| over_reference(c, |r| Some(r.peak_reserved_bytes as f64)),
    },
    Column {
        name: "VMM calls",
        legend: "reserve, create, map, set-access, unmap, release and address-free calls",
        narrow: false,
        cell: |c| c.m.row.vmm_calls.total().to_string(),
    },
    Column {
        name: "calls/classic",
        legend: "VMM calls over classic's",
        narrow: false,
        cell: |c| over_reference(c, |r| Some(r.vmm_calls.total() as f64)),
    },
    Column {
        name: "calls after 1st",
        legend: "VMM calls in iterations 2..N, steady state (-: one iteration ran; --iterations 3)",
        narrow: true,
        cell: |c| {
            c.m.row
                .vmm_calls_after_first_iteration
                .map_or_else(|| "-".into(), |v| v.total().to_string())
        },
    },
    Column {
        name: "syncs",
        legend: "cuStreamSynchronize calls, each a drain of the GPU's queue",
        narrow: true,
        cell: |c| c.m.row.stream_calls.synchronize.to_string(),
    },
    Column {
        name: "syncs after 1st",
        legend: "cuStreamSynchronize calls in iterations 2..N (-: one iteration ran)",
        narrow: false,
        cell: |c| {
            c.m.row
                .stream_calls_after_first_iteration
                .map_or_else(|| "-".into(), |s| s.synchronize.to_string())
        },
    },
    Column {
        name: "waits",
        legend: "cuStreamWaitEvent calls: one stream ordered after another's work",
        narrow: true,
        cell: |c| c.m.row.stream_calls.wait_event.to_string(),
    },
    Column {
        name: "copied GiB",
        legend: "bytes copied by sleep and wake (to the host and back) and by emulated growth",
        narrow: false,
        cell: |c| gib(c.m.row.copied_bytes),
    },
    Column {
        name: "growth copied GiB",
        legend: "device-to-device bytes of growth emulated by reallocation (0: growable)",
        narrow: false,
        cell: |c| gib(c.m.row.growth_copied_bytes),
    },
    Column {
        name: "grows mapped",
        legend: "share of Quilt's grow_to calls that found their pages mapped (-: emulated or none)",
        narrow: false,
        cell: |c| match (c.m.row.grows, c.m.row.grows_already_mapped) {
            (Some(n), Some(m)) if n > 0 => format!("{:.3}", m as f64 / n as f64),
            _ => "-".to_string(),
        },
    },
    Column {
        name: "driver ms",
        legend: "modelled driver time: every call priced, creates by size, syncs as drains",
        narrow: true,
        cell: |c| format!("{:.1}", c.m.row.modelled_driver_us / 1000.0),
    },
    Column {
        name: "time/classic",
        legend: "driver ms over classic's",
        narrow: false,
        cell: |c| over_reference(c, |r| Some(r.modelled_driver_us)),
    },
    Column {
        name: "flat-create ms",
        legend: "driver ms with every create priced flat, whatever its size",
        narrow: false,
        cell: |c| format!("{:.1}", c.m.modelled_flat_create_us / 1000.0),
    },
    Column {
        name: "CPU ns/op",
        legend: "median host ns per allocate or free (noisy: compare within one run only)",
        narrow: false,
        cell: |c| c.m.row.cpu_ns_per_op.to_string(),
    },
    Column {
        name: "event records/op",
        legend: "cuEventRecord calls per allocator operation (allocate, free, serving call)",
        narrow: false,
        cell: |c| format!("{:.3}", c.m.row.event_records_per_op),
    },
    Column {
        name: "event queries/op",
        legend: "cuEventQuery calls per allocator operation",
        narrow: false,
        cell: |c| format!("{:.3}", c.m.row.event_queries_per_op),
    },
    Column {
        name: "races",
        legend: "allocations reusing memory another stream's work may still use, unordered \
                 (data races)",
        narrow: false,
        cell: |c| c.m.row.races.to_string(),
    },
];

/// The columns of `layout`, in order.
fn columns(layout: Layout) -> Vec<&'static Column> {
    COLUMNS
        .iter()
        .filter(|c| layout == Layout::Wide || c.narrow)
        .collect()
}

/// The figures of the run, on one line.
pub fn run_line(ctx: &RunContext) -> String {
    let capacity = if ctx.capacity_bytes.is_multiple_of(1 << 30) {
        (ctx.capacity_bytes >> 30).to_string()
    } else {
        gib(ctx.capacity_bytes)
    };
    format!(
        "device {capacity} GiB (simulated), {} iteration{}, GPU {} ops behind the host, \
         {} us per sync{}",
        ctx.iterations,
        if ctx.iterations == 1 { "" } else { "s" },
        ctx.gpu_lag_ops,
        ctx.sync_cost_us,
        if ctx.bisection { "" } else { ", no bisection" }
    )
}

/// The workloads of `outcomes`, in order of first appearance.
fn workloads(outcomes: &[Outcome]) -> Vec<&str> {
    distinct(outcomes.iter().map(workload_of))
}

/// The reference allocator's row on `workload` (see
/// [`Measurement::reference`]), if measured.
fn classic_row<'a>(outcomes: &'a [Outcome], workload: &str) -> Option<&'a ReportRow> {
    outcomes.iter().find_map(|o| match o {
        Ok(m) if m.row.workload == workload && m.reference => Some(&m.row),
        _ => None,
    })
}

/// Lines of cells, aligned: the first `left` columns to the left, the others
/// to the right; a rule under the first line; each line prefixed by `indent`.
fn aligned(rows: &[Vec<String>], left: usize, indent: &str) -> Vec<String> {
    let n = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c < left {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        out.push(
            format!("{indent}{}", cells.join("  "))
                .trim_end()
                .to_string(),
        );
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            out.push(format!("{indent}{}", rule.join("  ")));
        }
    }
    out
}

/// The table of `outcomes` in `layout` (no legend; see [`report`]).
pub fn table(outcomes: &[Outcome], layout: Layout) -> String {
    let cols = columns(layout);
    let mut lines = Vec::new();
    match layout {
        Layout::Wide => {
            let mut rows = vec![["workload", "allocator"]
                .into_iter()
                .chain(cols.iter().map(|c| c.name))
                .map(str::to_string)
                .collect::<Vec<_>>()];
            for o in outcomes {
                let Ok(m) = o else { continue };
                let cell = Cell {
                    m,
                    classic: classic_row(outcomes, &m.row.workload),
                };
                let mut row = vec![m.row.workload.clone(), m.row.allocator.clone()];
                row.extend(cols.iter().map(|c| (c.cell)(&cell)));
                rows.push(row);
            }
            lines.extend(aligned(&rows, 2, ""));
            for f in outcomes.iter().filter_map(|o| o.as_ref().err()) {
                lines.push(format!(
                    "{}  {}  FAILED (see below)",
                    f.workload, f.allocator
                ));
            }
        }
        Layout::Narrow => {
            let header: Vec<String> = std::iter::once("allocator")
                .chain(cols.iter().map(|c| c.name))
                .map(str::to_string)
                .collect();
            for (i, w) in workloads(outcomes).into_iter().enumerate() {
                let mine: Vec<&Outcome> = outcomes.iter().filter(|o| workload_of(o) == w).collect();
                let measured: Vec<&Measurement> =
                    mine.iter().filter_map(|o| o.as_ref().ok()).collect();
                if i > 0 {
                    lines.push(String::new());
                }
                let peak = measured.iter().map(|m| m.row.peak_live_bytes).max();
                let ideal = measured.iter().map(|m| m.row.ideal_bytes).max();
                lines.push(match (peak, ideal) {
                    (Some(p), Some(i)) => {
                        format!("{w}: peak live {} GiB, ideal {} GiB", gib(p), gib(i))
                    }
                    _ => format!("{w}:"),
                });
                let mut rows = vec![header.clone()];
                // Specs too long for the column go on a line of their own,
                // above an unnamed row: (row index, spec).
                let mut long_names: Vec<(usize, String)> = Vec::new();
                for o in &mine {
                    let name = allocator_of(o);
                    let short = name.chars().count() <= NARROW_ALLOCATOR_WIDTH;
                    if !short {
                        long_names.push((rows.len(), name.to_string()));
                    }
                    let mut row = vec![if short {
                        name.to_string()
                    } else {
                        String::new()
                    }];
                    match o {
                        Ok(m) => {
                            let cell = Cell {
                                m,
                                classic: classic_row(outcomes, w),
                            };
                            row.extend(cols.iter().map(|c| (c.cell)(&cell)));
                        }
                        Err(_) => {
                            row.push("FAILED".into());
                            row.extend(cols.iter().skip(1).map(|_| String::new()));
                        }
                    }
                    rows.push(row);
                }
                let block = aligned(&rows, 1, "  ");
                for (k, line) in block.into_iter().enumerate() {
                    // Row r of `rows` is line r + 1 of the block (the rule).
                    if let Some((_, name)) = long_names.iter().find(|(r, _)| *r + 1 == k) {
                        lines.push(format!("  {name}"));
                    }
                    lines.push(line);
                }
            }
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// The legend of `layout`'s columns: a line per column.
pub fn legend(layout: Layout) -> String {
    let mut out = String::from("columns:\n");
    for c in columns(layout) {
        out.push_str(&format!("  {}: {}\n", c.name, c.legend));
    }
    out
}

/// The unsafe rows (memory reused unordered: their count and the first), the
/// out-of-memory errors, a note per row that ran out (its verdict, the
/// request, the device, the allocator's memory), and the failed pairs.
pub fn notes(outcomes: &[Outcome]) -> String {
    let mut out = String::new();
    for o in outcomes {
        match o {
            Ok(m) => {
                let who = format!("{} / {}", m.row.workload, m.row.allocator);
                if let Some(first) = &m.row.first_race {
                    out.push_str(&format!(
                        "{who}: UNSAFE: {} allocations reuse memory another stream's work may \
                         still use, unordered (data races on a GPU); it competes for no claim. \
                         First: {first}\n",
                        m.row.races
                    ));
                }
                let Some(oom) = &m.row.oom else { continue };
                match (&oom.report, oom.verdict) {
                    (Some(r), Some(verdict)) => {
                        out.push_str(&format!(
                            "{who}: out of memory after {} events; verdict: {}\n",
                            m.row.events,
                            verdict_name(verdict)
                        ));
                        out.push_str(&format!(
                            "    asked {}, {} rounded, {} of new memory; device {}, {} free\n",
                            size(r.requested),
                            size(r.needed),
                            size(r.needed_unbacked),
                            size(r.capacity),
                            size(r.device_free)
                        ));
                        out.push_str(&format!(
                            "    held {}, live {}, reclaimable {}, largest free extent {}\n",
                            size(r.reserved),
                            size(r.allocated),
                            size(r.reclaimable),
                            size(r.largest_free_extent)
                        ));
                    }
                    _ => out.push_str(&format!(
                        "{who}: out of memory after {} events: {}\n",
                        m.row.events, oom.message
                    )),
                }
            }
            Err(Failure {
                workload,
                allocator,
                error,
                ..
            }) => out.push_str(&format!("{workload} / {allocator}: FAILED: {error}\n")),
        }
    }
    out
}

/// The verdict as the notes name it (as the JSON does).
fn verdict_name(verdict: OomVerdict) -> &'static str {
    match verdict {
        OomVerdict::Capacity => "capacity",
        OomVerdict::Fragmentation => "fragmentation",
    }
}

/// Which way a column is better, and its figure (rounded as printed) in a
/// row, where the row competes.
struct Claim {
    name: &'static str,
    better: &'static str,
    lower_is_better: bool,
    figure: fn(&ReportRow) -> Option<f64>,
}

const CLAIMS: &[Claim] = &[
    Claim {
        name: "min cap GiB",
        better: "lowest",
        lower_is_better: true,
        figure: |r| r.min_capacity_bytes.map(|b| b as f64),
    },
    Claim {
        name: "eff.",
        better: "highest",
        lower_is_better: false,
        figure: |r| r.completed.then(|| (r.efficiency * 1000.0).round()),
    },
    Claim {
        name: "driver ms",
        better: "lowest",
        lower_is_better: true,
        figure: |r| r.completed.then(|| (r.modelled_driver_us / 100.0).round()),
    },
    Claim {
        name: "calls after 1st",
        better: "fewest",
        lower_is_better: true,
        figure: |r| {
            r.completed
                .then_some(r.vmm_calls_after_first_iteration)
                .flatten()
                .map(|v| v.total() as f64)
        },
    },
    Claim {
        name: "syncs",
        better: "fewest",
        lower_is_better: true,
        figure: |r| r.completed.then_some(r.stream_calls.synchronize as f64),
    },
    Claim {
        name: "waits",
        better: "fewest",
        lower_is_better: true,
        figure: |r| r.completed.then_some(r.stream_calls.wait_event as f64),
    },
];

/// The best allocator per column: for each claim, how many workloads each
/// allocator is best on (ties count for each; only rows that completed
/// compete, except for min cap, and no row that reused memory unordered),
/// the winner first.
pub fn summary(outcomes: &[Outcome]) -> String {
    let ws = workloads(outcomes);
    let allocators = distinct(outcomes.iter().map(allocator_of));
    let mut out = format!(
        "best per column ({} allocator{} on {} workload{}; ties count for each):\n",
        allocators.len(),
        if allocators.len() == 1 { "" } else { "s" },
        ws.len(),
        if ws.len() == 1 { "" } else { "s" },
    );
    let label_width = CLAIMS
        .iter()
        .map(|c| c.name.len() + c.better.len() + 4)
        .max()
        .unwrap_or(0);
    for claim in CLAIMS {
        let mut wins = vec![0usize; allocators.len()];
        let mut contested = 0;
        for w in &ws {
            let figures: Vec<(usize, f64)> = outcomes
                .iter()
                .filter_map(|o| o.as_ref().ok())
                .filter(|m| m.row.workload == *w && m.row.races == 0)
                .filter_map(|m| {
                    let a = allocators.iter().position(|a| *a == m.row.allocator)?;
                    Some((a, (claim.figure)(&m.row)?))
                })
                .collect();
            let best = figures.iter().map(|f| f.1).reduce(|x, y| {
                if claim.lower_is_better {
                    x.min(y)
                } else {
                    x.max(y)
                }
            });
            let Some(best) = best else { continue };
            contested += 1;
            for (a, f) in figures {
                if f == best {
                    wins[a] += 1;
                }
            }
        }
        let label = format!("{} ({}):", claim.name, claim.better);
        let text = if contested == 0 {
            if claim.name == "calls after 1st" {
                "- (one iteration ran: --iterations 3 gives the steady state)".to_string()
            } else {
                "- (no row to compare)".to_string()
            }
        } else {
            let mut ranked: Vec<(usize, &str)> = wins
                .iter()
                .copied()
                .zip(allocators.iter().copied())
                .filter(|(n, _)| *n > 0)
                .collect();
            ranked.sort_by_key(|r| std::cmp::Reverse(r.0));
            let all_tie =
                ranked.len() == allocators.len() && ranked.iter().all(|r| r.0 == contested);
            if all_tie && allocators.len() > 1 {
                "all tie".to_string()
            } else {
                let parts: Vec<String> = ranked
                    .iter()
                    .map(|(n, a)| format!("{a} {n}/{contested}"))
                    .collect();
                parts.join(", ")
            }
        };
        out.push_str(&format!("  {label:<label_width$} {text}\n"));
    }
    out
}

/// A workload named `FAMILY-N` whose `N` is its number of streams
/// (`many-streams-10`, `offload-pipeline-4`, `multistream-traces.py`'s
/// `pipeline-10`): its family and `N`. The drawn traces
/// (`family-SEED`) are numbered by seed, not streams: none.
fn family_and_streams(workload: &str) -> Option<(&str, u64)> {
    let (family, n) = workload.rsplit_once('-')?;
    if family == "family" {
        return None;
    }
    Some((family, n.parse().ok()?))
}

/// Host time and event calls per operation against the number of streams,
/// for every allocator, on each family of workloads that the run measured
/// at two stream counts or more (`many-streams-4`, `-10`, `-32`): a line per
/// allocator and stream count, with the host time over classic's on the
/// same workload. Empty when the run has no such family.
pub fn streams_table(outcomes: &[Outcome]) -> String {
    let names = workloads(outcomes);
    let mut families: Vec<&str> = Vec::new();
    for w in &names {
        if let Some((f, _)) = family_and_streams(w) {
            let counts = names
                .iter()
                .filter(|o| family_and_streams(o).is_some_and(|(g, _)| g == f))
                .count();
            if counts >= 2 && !families.contains(&f) {
                families.push(f);
            }
        }
    }
    let mut out = String::new();
    for family in families {
        let mut rows = vec![[
            "allocator",
            "streams",
            "CPU ns/op",
            "/classic",
            "event records/op",
            "event queries/op",
            "waits",
        ]
        .map(String::from)
        .to_vec()];
        let allocators = distinct(
            outcomes
                .iter()
                .filter_map(|o| o.as_ref().ok())
                .map(|m| m.row.allocator.as_str()),
        );
        for a in allocators {
            let mut points: Vec<(u64, &ReportRow)> = outcomes
                .iter()
                .filter_map(|o| o.as_ref().ok())
                .filter(|m| m.row.allocator == a)
                .filter_map(|m| {
                    let (f, n) = family_and_streams(&m.row.workload)?;
                    (f == family).then_some((n, &m.row))
                })
                .collect();
            points.sort_by_key(|(n, _)| *n);
            for (n, r) in points {
                let classic = classic_row(outcomes, &r.workload)
                    .map(|c| c.cpu_ns_per_op as f64)
                    .filter(|&c| c > 0.0);
                rows.push(vec![
                    a.to_string(),
                    n.to_string(),
                    r.cpu_ns_per_op.to_string(),
                    classic.map_or("-".into(), |c| {
                        format!("{:.2}x", r.cpu_ns_per_op as f64 / c)
                    }),
                    format!("{:.3}", r.event_records_per_op),
                    format!("{:.3}", r.event_queries_per_op),
                    r.stream_calls.wait_event.to_string(),
                ]);
            }
        }
        out.push_str(&format!(
            "{family}-N: host time and event calls per operation against streams\n"
        ));
        for line in aligned(&rows, 1, "  ") {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// The whole text report: the run line, the table, the legend, the notes
/// and the summary.
pub fn report(outcomes: &[Outcome], layout: Layout, ctx: &RunContext) -> String {
    let mut out = run_line(ctx);
    out.push_str("\n\n");
    out.push_str(&table(outcomes, layout));
    out.push('\n');
    let streams = streams_table(outcomes);
    if !streams.is_empty() {
        out.push_str(&streams);
        out.push('\n');
    }
    out.push_str(&legend(layout));
    let notes = notes(outcomes);
    if !notes.is_empty() {
        out.push('\n');
        out.push_str(&notes);
    }
    out.push('\n');
    out.push_str(&summary(outcomes));
    out
}

/// The width of the allocator column of a table of scaling points.
fn allocator_width(points: &[ScalePoint]) -> usize {
    points
        .iter()
        .map(|p| p.allocator.chars().count())
        .max()
        .unwrap_or(0)
        .max("allocator".len())
}

/// A point's fastest and slowest runs, host ns per operation.
fn fastest_and_slowest(p: &ScalePoint) -> (f64, f64) {
    let runs = p.runs_ns_per_op.iter().copied();
    (
        runs.clone().fold(f64::INFINITY, f64::min),
        runs.fold(0.0, f64::max),
    )
}

/// The table of a scaling run: one line per point, with the host time's
/// median, fastest and slowest runs, and the median against the same
/// allocator's at the same live count and the fewest streams measured; the
/// event records and queries per operation beside them; then
/// what a GPU would charge besides: the modelled driver time and the stream
/// and event calls per operation, and host plus driver time against the
/// fewest-streams point's.
pub fn scale_table(points: &[ScalePoint]) -> String {
    let width = allocator_width(points);
    let mut out = format!(
        "{:<width$} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>10} {:>10} {:>6} {:>8} {:>7} {:>7}\n",
        "", "", "", "host", "", "", "host", "event", "event", "sim", "driver", "stream", "total"
    );
    out += &format!(
        "{:<width$} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>10} {:>10} {:>6} {:>8} {:>7} {:>7}\n",
        "allocator",
        "live",
        "streams",
        "ns/op",
        "fastest",
        "slowest",
        "/fewest",
        "records/op",
        "queries/op",
        "ns/op",
        "ns/op",
        "calls",
        "/fewest"
    );
    for p in points {
        let fewest = points
            .iter()
            .filter(|q| q.allocator == p.allocator && q.live == p.live)
            .min_by_key(|q| q.streams)
            .unwrap_or(p);
        let (fastest, slowest) = fastest_and_slowest(p);
        let total = |q: &ScalePoint| q.ns_per_op + q.driver_ns_per_op;
        out += &format!(
            "{:<width$} {:>7} {:>7} {:>7.0} {:>7.0} {:>7.0} {:>6.2}x {:>10.3} {:>10.3} {:>6.0} {:>8.0} {:>7.2} {:>6.2}x\n",
            p.allocator,
            p.live,
            p.streams,
            p.ns_per_op,
            fastest,
            slowest,
            p.ns_per_op / fewest.ns_per_op,
            p.event_records_per_op,
            p.event_queries_per_op,
            p.sim_ns_per_op,
            p.driver_ns_per_op,
            p.stream_calls_per_op,
            total(p) / total(fewest),
        );
    }
    out += "host: the allocator's host time (median of the runs), the simulated driver's \
            own time\n(sim) taken out; event records/op, event queries/op: cuEventRecord and \
            cuEventQuery calls\nper operation; driver: what the cost model charges for the calls of \
            the timed steps;\nstream calls: stream and event calls per operation; total: \
            host + driver;\n/fewest: against the same allocator and live count at the \
            fewest streams.\n";
    out
}

/// The table of `quilt-bench sizes`: one line per point (allocator and
/// block size), each against the same allocator's point at the smallest size.
pub fn sizes_table(points: &[ScalePoint]) -> String {
    let width = allocator_width(points);
    let mut out = format!(
        "{:<width$} {:>10} {:>7} {:>7} {:>7} {:>7} {:>9} {:>7} {:>8}\n",
        "", "", "", "host", "", "", "host", "sim", "vmm"
    );
    out += &format!(
        "{:<width$} {:>10} {:>7} {:>7} {:>7} {:>7} {:>9} {:>7} {:>8}\n",
        "allocator",
        "size",
        "streams",
        "ns/op",
        "fastest",
        "slowest",
        "/smallest",
        "ns/op",
        "calls/op"
    );
    for p in points {
        let smallest = points
            .iter()
            .filter(|q| q.allocator == p.allocator && q.streams == p.streams)
            .min_by_key(|q| q.size_bytes)
            .unwrap_or(p);
        let (fastest, slowest) = fastest_and_slowest(p);
        let size = p
            .size_bytes
            .map_or_else(|| "mixed".to_string(), |b| size(b).replace(".00", ""));
        out += &format!(
            "{:<width$} {:>10} {:>7} {:>7.0} {:>7.0} {:>7.0} {:>8.2}x {:>7.0} {:>8.3}\n",
            p.allocator,
            size,
            p.streams,
            p.ns_per_op,
            fastest,
            slowest,
            p.ns_per_op / smallest.ns_per_op,
            p.sim_ns_per_op,
            p.vmm_calls_per_op,
        );
    }
    out += "host: the allocator's host time per allocate or free (median of the runs), the \
            simulated\ndriver's own time (sim) taken out; /smallest: against the same \
            allocator at the smallest size;\nvmm calls: driver VMM calls per operation of \
            the timed steps (0 once the blocks are mapped).\n";
    out
}

/// Upper bounds (inclusive) of the size classes of `list --sizes`.
const SIZE_CLASSES: [(u64, &str); 5] = [
    (1 << 20, "<=1MiB"),
    (16 << 20, "<=16MiB"),
    (128 << 20, "<=128MiB"),
    (1 << 30, "<=1GiB"),
    (u64::MAX, ">1GiB"),
];

/// A trace's size mix: per size class, the share of allocations and of bytes allocated.
pub fn size_mix(trace: &Trace) -> String {
    let mut counts = [0u64; SIZE_CLASSES.len()];
    let mut bytes = [0u64; SIZE_CLASSES.len()];
    for e in &trace.events {
        if let Event::Alloc { size, .. } = *e {
            let class = SIZE_CLASSES
                .iter()
                .position(|(bound, _)| size <= *bound)
                .unwrap_or(SIZE_CLASSES.len() - 1);
            counts[class] += 1;
            bytes[class] = bytes[class].saturating_add(size);
        }
    }
    let n: u64 = counts.iter().sum::<u64>().max(1);
    let b: u64 = bytes.iter().sum::<u64>().max(1);
    let cells: Vec<String> = SIZE_CLASSES
        .iter()
        .enumerate()
        .map(|(i, (_, label))| {
            format!(
                "{label} {:.1}% of allocs, {:.1}% of bytes",
                100.0 * counts[i] as f64 / n as f64,
                100.0 * bytes[i] as f64 / b as f64
            )
        })
        .collect();
    format!("    size mix: {}\n", cells.join("; "))
}

/// The text of `quilt-bench list` (with `sizes`, each workload's size mix too).
pub fn list(seed: u64, sizes: bool) -> String {
    let mut out = String::new();
    for w in WORKLOADS {
        let trace = (w.generate)(seed);
        let s = trace_stats(&trace);
        out.push_str(&format!(
            "{:<22} {:>6} events  peak live {:>6} GiB  max alloc {:>5} MiB  {} stream(s)  {}\n",
            w.name,
            s.events,
            gib(s.peak_live_bytes),
            s.max_alloc_bytes >> 20,
            s.streams,
            w.description
        ));
        if sizes {
            out.push_str(&size_mix(&trace));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use crate::report::rows::{StreamCalls, VmmCalls};

    fn row(workload: &str, allocator: &str, completed: bool, eff: f64, min: u64) -> Outcome {
        Ok(Measurement {
            row: ReportRow {
                workload: workload.into(),
                allocator: allocator.into(),
                capacity_bytes: 80 << 30,
                completed,
                ooms: u64::from(!completed),
                oom: None,
                events: 10,
                peak_live_bytes: 1 << 30,
                peak_reserved_bytes: 1 << 30,
                efficiency: eff,
                ideal_bytes: 1 << 30,
                min_capacity_bytes: Some(min),
                vmm_calls: VmmCalls::default(),
                vmm_calls_after_first_iteration: None,
                stream_calls: StreamCalls::default(),
                stream_calls_after_first_iteration: None,
                copied_bytes: 0,
                growth_copied_bytes: 0,
                grows: None,
                grows_already_mapped: None,
                modelled_driver_us: 1000.0,
                cpu_ns_per_op: 100,
                event_records_per_op: 0.5,
                event_queries_per_op: 0.25,
                races: 0,
                first_race: None,
            },
            modelled_flat_create_us: 1000.0,
            series: Vec::new(),
            reference: allocator == "classic",
            subject: allocator == "quilt",
        })
    }

    fn line<'a>(text: &'a str, start: &str) -> &'a str {
        text.lines()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no `{start}` in {text}"))
    }

    #[test]
    fn the_streams_table_lines_up_each_family_by_streams_against_classic() {
        let mut outcomes = Vec::new();
        for (n, quilt_ns) in [(32, 300), (4, 150)] {
            for (a, ns) in [("quilt", quilt_ns), ("classic", 100)] {
                let mut o = row(&format!("many-streams-{n}"), a, true, 0.9, 1 << 30);
                if let Ok(m) = &mut o {
                    m.row.cpu_ns_per_op = ns;
                    m.row.stream_calls.wait_event = n;
                }
                outcomes.push(o);
            }
        }
        // One stream count only, and drawn traces (numbered by seed): no table.
        outcomes.push(row("offload-pipeline-4", "quilt", true, 0.9, 1 << 30));
        outcomes.push(row("family-003", "quilt", true, 0.9, 1 << 30));
        outcomes.push(row("family-057", "quilt", true, 0.9, 1 << 30));
        let t = streams_table(&outcomes);
        assert!(
            t.starts_with("many-streams-N: host time and event calls per operation"),
            "{t}"
        );
        assert!(!t.contains("offload") && !t.contains("family"), "{t}");
        let quilt: Vec<&str> = t
            .lines()
            .filter(|l| l.trim_start().starts_with("quilt"))
            .collect();
        assert_eq!(quilt.len(), 2, "{t}");
        // Fewest streams first, the ratio to classic beside the time.
        assert!(
            quilt[0].contains(" 4 ") && quilt[0].contains("1.50x"),
            "{t}"
        );
        assert!(
            quilt[1].contains(" 32 ") && quilt[1].contains("3.00x"),
            "{t}"
        );
        assert!(quilt[1].trim_end().ends_with("32"), "{t}");
        assert!(streams_table(&outcomes[4..]).is_empty());
    }

    #[test]
    fn the_summary_counts_ties_for_each_and_lets_only_completed_rows_win() {
        let outcomes = vec![
            // w1: `a` ran out of memory, so its higher efficiency does not count.
            row("w1", "a", false, 0.99, 4 << 30),
            row("w1", "b", true, 0.90, 2 << 30),
            // w2: a tie in efficiency, `a` the smaller minimum capacity.
            row("w2", "a", true, 0.95, 1 << 30),
            row("w2", "b", true, 0.95, 2 << 30),
        ];
        let s = summary(&outcomes);
        assert!(
            s.starts_with("best per column (2 allocators on 2 workloads"),
            "{s}"
        );
        assert!(line(&s, "eff. (highest):").ends_with("b 2/2, a 1/2"), "{s}");
        assert!(
            line(&s, "min cap GiB (lowest):").ends_with("a 1/2, b 1/2"),
            "{s}"
        );
        // Equal driver time: on w1 only `b` completed, on w2 both tie.
        assert!(
            line(&s, "driver ms (lowest):").ends_with("b 2/2, a 1/2"),
            "{s}"
        );
        let both = vec![
            row("w", "a", true, 0.9, 1 << 30),
            row("w", "b", true, 0.9, 1 << 30),
        ];
        assert!(line(&summary(&both), "eff. (highest):").ends_with("all tie"));
        assert!(
            line(&s, "calls after 1st (fewest):").contains("one iteration ran"),
            "{s}"
        );
    }

    #[test]
    fn a_row_that_reused_memory_unordered_wins_nothing_and_is_named_in_the_notes() {
        let mut unsafe_row = row("w", "a", true, 0.99, 1 << 30);
        if let Ok(m) = &mut unsafe_row {
            m.row.races = 3;
            m.row.first_race = Some("event 7: ...".into());
        }
        let outcomes = vec![unsafe_row, row("w", "b", true, 0.90, 2 << 30)];
        let s = summary(&outcomes);
        assert!(line(&s, "eff. (highest):").ends_with("b 1/1"), "{s}");
        assert!(line(&s, "min cap GiB (lowest):").ends_with("b 1/1"), "{s}");
        let n = notes(&outcomes);
        assert!(
            n.starts_with("w / a: UNSAFE: 3 allocations reuse memory") && n.contains("event 7"),
            "{n}"
        );
        assert_eq!(n.lines().count(), 1, "{n}");
    }

    #[test]
    fn the_narrow_table_puts_long_specs_on_their_own_line_and_fits_100_columns() {
        let long = "gmlake:frag_limit=32MiB,reuse_limit=4";
        let mut outcomes = vec![row("w", "quilt", true, 0.99, 1 << 30)];
        outcomes.push(row("w", long, true, 0.98, 1 << 30));
        outcomes.push(Err(Failure {
            workload: "w".into(),
            allocator: "classic".into(),
            capacity_bytes: 80 << 30,
            completed: false,
            error: "it broke".into(),
        }));
        let t = table(&outcomes, Layout::Narrow);
        assert!(t.lines().all(|l| l.chars().count() <= MAX_WIDTH), "{t}");
        let lines: Vec<&str> = t.lines().collect();
        let at = lines.iter().position(|l| l.trim() == long).unwrap();
        assert!(lines[at + 1].trim_start().starts_with("yes"), "{t}");
        assert!(line(&t, "classic").contains("FAILED"), "{t}");
        assert!(notes(&outcomes).contains("w / classic: FAILED: it broke"));
        // Every column of the narrow layout has a legend line within the width.
        let narrow = legend(Layout::Narrow);
        assert!(
            narrow.lines().all(|l| l.chars().count() <= MAX_WIDTH),
            "{narrow}"
        );
        assert_eq!(narrow.lines().count(), 1 + columns(Layout::Narrow).len());
        let wide = legend(Layout::Wide);
        assert!(
            wide.lines().all(|l| l.chars().count() <= MAX_WIDTH),
            "{wide}"
        );
    }
}
