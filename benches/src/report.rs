//! Reports of an A/B run: the JSON rows, the stdout table and the SVG charts.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use quilt_vmm::{CallKind, DriverStats};
use serde::Serialize;

use crate::replay::{ReplayResult, SeriesPoint};
use crate::units::gib;

/// The seven VMM driver calls, counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverCalls {
    /// `cuMemAddressReserve`.
    pub reserve: u64,
    /// `cuMemCreate`.
    pub create: u64,
    /// `cuMemMap`.
    pub map: u64,
    /// `cuMemSetAccess`.
    pub set_access: u64,
    /// `cuMemUnmap`.
    pub unmap: u64,
    /// `cuMemRelease`.
    pub release: u64,
    /// `cuMemAddressFree`.
    pub address_free: u64,
}

impl DriverCalls {
    /// The counts of `stats`.
    pub fn from_stats(stats: &DriverStats) -> Self {
        DriverCalls {
            reserve: stats.count(CallKind::Reserve),
            create: stats.count(CallKind::Create),
            map: stats.count(CallKind::Map),
            set_access: stats.count(CallKind::SetAccess),
            unmap: stats.count(CallKind::Unmap),
            release: stats.count(CallKind::Release),
            address_free: stats.count(CallKind::AddressFree),
        }
    }

    /// All seven together.
    pub fn total(&self) -> u64 {
        self.reserve
            + self.create
            + self.map
            + self.set_access
            + self.unmap
            + self.release
            + self.address_free
    }
}

/// The stream and event calls, counted: what a GPU pays besides the VMM calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StreamCalls {
    /// `cuStreamSynchronize`.
    pub synchronize: u64,
    /// `cuStreamWaitEvent`.
    pub wait_event: u64,
    /// `cuEventRecord`.
    pub event_record: u64,
    /// `cuEventQuery`.
    pub event_query: u64,
    /// `cuEventDestroy`.
    pub event_destroy: u64,
}

impl StreamCalls {
    /// The counts of `stats`.
    pub fn from_stats(stats: &DriverStats) -> Self {
        StreamCalls {
            synchronize: stats.count(CallKind::StreamSynchronize),
            wait_event: stats.count(CallKind::StreamWaitEvent),
            event_record: stats.count(CallKind::EventRecord),
            event_query: stats.count(CallKind::EventQuery),
            event_destroy: stats.count(CallKind::EventDestroy),
        }
    }

    /// All five together.
    pub fn total(&self) -> u64 {
        self.synchronize
            + self.wait_event
            + self.event_record
            + self.event_query
            + self.event_destroy
    }
}

/// One JSON object of the report: one (workload, allocator) pair. The fields
/// are exactly these, in this order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReportRow {
    /// Workload (generator name, trace file stem or snapshot stem).
    pub workload: String,
    /// Allocator name.
    pub allocator: String,
    /// Simulated device capacity of the main replay.
    pub capacity_bytes: u64,
    /// Whether the main replay completed.
    pub completed: bool,
    /// Out-of-memory errors in the main replay.
    pub ooms: u64,
    /// Events replayed.
    pub events: u64,
    /// Peak live requested bytes.
    pub peak_live_bytes: u64,
    /// Peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Peak live / peak reserved.
    pub efficiency: f64,
    /// The page-granular lower bound.
    pub ideal_bytes: u64,
    /// Minimum capacity at which the replay completes (null under `--no-bisect`,
    /// or when it does not complete at twice the peak live bytes).
    pub min_capacity_bytes: Option<u64>,
    /// Driver calls over the replay.
    pub driver_calls: DriverCalls,
    /// Driver calls over iterations 2..N.
    pub driver_calls_after_first_iteration: DriverCalls,
    /// Stream and event calls over the replay.
    pub stream_calls: StreamCalls,
    /// Stream and event calls over iterations 2..N.
    pub stream_calls_after_first_iteration: StreamCalls,
    /// Modelled driver time in microseconds (create costed by size; every
    /// call of the cost model, stream synchronisations included).
    pub modelled_driver_us: f64,
    /// Median host nanoseconds per allocate or free.
    pub cpu_ns_per_op: u64,
}

/// A row with what the JSON leaves out: the flat-create driver time, the
/// out-of-memory message and the memory series.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// The JSON row.
    pub row: ReportRow,
    /// Modelled driver time with every create costed flat, in microseconds.
    pub modelled_flat_create_us: f64,
    /// The out-of-memory error that ended the main replay, if any.
    pub oom_message: Option<String>,
    /// Live and reserved bytes over the main replay.
    pub series: Vec<SeriesPoint>,
}

impl Measurement {
    /// Assemble a measurement from a replay's result.
    pub fn new(
        workload: &str,
        allocator: &str,
        capacity_bytes: u64,
        result: ReplayResult,
        min_capacity_bytes: Option<u64>,
    ) -> Self {
        Measurement {
            row: ReportRow {
                workload: workload.to_string(),
                allocator: allocator.to_string(),
                capacity_bytes,
                completed: result.completed,
                ooms: result.ooms,
                events: result.events,
                peak_live_bytes: result.peak_live_bytes,
                peak_reserved_bytes: result.peak_reserved_bytes,
                efficiency: result.efficiency,
                ideal_bytes: result.ideal_bytes,
                min_capacity_bytes,
                driver_calls: DriverCalls::from_stats(&result.driver),
                driver_calls_after_first_iteration: DriverCalls::from_stats(
                    &result.driver_after_first_iteration,
                ),
                stream_calls: StreamCalls::from_stats(&result.driver),
                stream_calls_after_first_iteration: StreamCalls::from_stats(
                    &result.driver_after_first_iteration,
                ),
                modelled_driver_us: result.driver.modelled_ns as f64 / 1000.0,
                cpu_ns_per_op: result.cpu_ns_per_op,
            },
            modelled_flat_create_us: result.driver.modelled_flat_create_ns as f64 / 1000.0,
            oom_message: result.oom_message,
            series: result.series,
        }
    }
}

/// The JSON report: an array of [`ReportRow`] objects.
pub fn to_json(measurements: &[Measurement]) -> Result<String, serde_json::Error> {
    let rows: Vec<&ReportRow> = measurements.iter().map(|m| &m.row).collect();
    serde_json::to_string_pretty(&rows)
}

/// `a / b` as `1.23x`, or `-` when it has no meaning.
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    }
}

/// The readable table: one row per workload and allocator, with ratios to the
/// `classic` row of the same workload (where there is one).
pub fn table(measurements: &[Measurement]) -> String {
    let header = [
        "workload",
        "allocator",
        "done",
        "live GiB",
        "reserved GiB",
        "eff %",
        "ideal GiB",
        "min cap GiB",
        "min/ideal %",
        "min cap/classic",
        "reserved/classic",
        "driver calls",
        "calls/classic",
        "calls after 1st",
        "syncs",
        "syncs after 1st",
        "waits",
        "driver ms",
        "time/classic",
        "flat-create ms",
        "ns/op",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for m in measurements {
        let r = &m.row;
        let classic = measurements
            .iter()
            .find(|c| c.row.workload == r.workload && c.row.allocator == "classic")
            .map(|c| &c.row);
        let min_cap = r.min_capacity_bytes.map(|b| b as f64);
        let calls = r.driver_calls.total() as f64;
        rows.push(vec![
            r.workload.clone(),
            r.allocator.clone(),
            if r.completed {
                "yes".into()
            } else {
                "OOM".into()
            },
            gib(r.peak_live_bytes),
            gib(r.peak_reserved_bytes),
            format!("{:.1}", 100.0 * r.efficiency),
            gib(r.ideal_bytes),
            r.min_capacity_bytes.map(gib).unwrap_or_else(|| "-".into()),
            match r.min_capacity_bytes {
                Some(b) if r.ideal_bytes > 0 => {
                    format!("{:.1}", 100.0 * b as f64 / r.ideal_bytes as f64)
                }
                _ => "-".into(),
            },
            ratio(
                min_cap,
                classic.and_then(|c| c.min_capacity_bytes.map(|b| b as f64)),
            ),
            ratio(
                Some(r.peak_reserved_bytes as f64),
                classic.map(|c| c.peak_reserved_bytes as f64),
            ),
            r.driver_calls.total().to_string(),
            ratio(Some(calls), classic.map(|c| c.driver_calls.total() as f64)),
            r.driver_calls_after_first_iteration.total().to_string(),
            r.stream_calls.synchronize.to_string(),
            r.stream_calls_after_first_iteration.synchronize.to_string(),
            r.stream_calls.wait_event.to_string(),
            format!("{:.1}", r.modelled_driver_us / 1000.0),
            ratio(
                Some(r.modelled_driver_us),
                classic.map(|c| c.modelled_driver_us),
            ),
            format!("{:.1}", m.modelled_flat_create_us / 1000.0),
            r.cpu_ns_per_op.to_string(),
        ]);
    }
    let columns = header.len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                if c < 2 {
                    format!("{cell:<w$}", w = widths[c])
                } else {
                    format!("{cell:>w$}", w = widths[c])
                }
            })
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(out, "{}", rule.join("  "));
        }
    }
    out
}

/// A chart could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing chart {path}: {message}")]
pub struct ChartError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Write the charts into `dir` (created if needed): per workload
/// `<workload>.svg` (live memory and each allocator's reserved memory over the
/// replay, Quilt drawn last and thicker, the device and `iterations` in the
/// title), and, when a bisection ran, `min-capacity.svg` (minimum capacity
/// over peak live, by workload and allocator). Returns the files written.
pub fn write_charts(
    dir: &Path,
    measurements: &[Measurement],
    iterations: u32,
) -> Result<Vec<String>, ChartError> {
    let fail = |path: &Path, message: String| ChartError {
        path: path.display().to_string(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| fail(dir, e.to_string()))?;
    let mut workloads: Vec<&str> = Vec::new();
    for m in measurements {
        if !workloads.contains(&m.row.workload.as_str()) {
            workloads.push(&m.row.workload);
        }
    }
    let mut written = Vec::new();
    for w in &workloads {
        let path = dir.join(format!("{}.svg", file_safe(w)));
        let rows: Vec<&Measurement> = measurements
            .iter()
            .filter(|m| m.row.workload == *w)
            .collect();
        memory_chart(&path, w, &rows, iterations).map_err(|e| fail(&path, e))?;
        written.push(path.display().to_string());
    }
    // No bisection (`--no-bisect`), no minimum-capacity chart.
    if measurements
        .iter()
        .any(|m| m.row.min_capacity_bytes.is_some())
    {
        let path = dir.join("min-capacity.svg");
        min_capacity_chart(&path, &workloads, measurements).map_err(|e| fail(&path, e))?;
        written.push(path.display().to_string());
    }
    Ok(written)
}

fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

const GIB: f64 = (1u64 << 30) as f64;

fn iterations_note(iterations: u32) -> String {
    if iterations > 1 {
        format!(", {iterations} iterations")
    } else {
        String::new()
    }
}

fn memory_chart(
    path: &Path,
    workload: &str,
    rows: &[&Measurement],
    iterations: u32,
) -> Result<(), String> {
    let root = SVGBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x_max = rows
        .iter()
        .flat_map(|m| m.series.last().map(|p| p.event))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let y_max = rows
        .iter()
        .flat_map(|m| m.series.iter().map(|p| p.reserved_bytes.max(p.live_bytes)))
        .max()
        .unwrap_or(1) as f64
        / GIB
        * 1.08;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{workload}: live and reserved memory, {} GiB device{}",
                rows.first()
                    .map(|m| m.row.capacity_bytes as f64 / GIB)
                    .map_or_else(String::new, |g| format!("{g:.0}")),
                iterations_note(iterations),
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max.max(0.001))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("events replayed")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("GiB")
        .draw()
        .map_err(|e| e.to_string())?;
    if let Some(first) = rows.iter().max_by_key(|m| m.series.len()) {
        let live: Vec<(f64, f64)> = first
            .series
            .iter()
            .map(|p| (p.event as f64, p.live_bytes as f64 / GIB))
            .collect();
        chart
            .draw_series(LineSeries::new(live, BLACK.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("live (requested)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    }
    // Quilt last and thicker, so that no other line hides it.
    let mut order: Vec<(usize, &&Measurement)> = rows.iter().enumerate().collect();
    order.sort_by_key(|(_, m)| m.row.allocator.starts_with("quilt"));
    for (i, m) in order {
        let color = COLORS[i % COLORS.len()];
        let width = if m.row.allocator.starts_with("quilt") {
            3
        } else {
            1
        };
        let points: Vec<(f64, f64)> = m
            .series
            .iter()
            .map(|p| (p.event as f64, p.reserved_bytes as f64 / GIB))
            .collect();
        let label = if m.row.completed {
            format!("{} reserved", m.row.allocator)
        } else {
            format!("{} reserved (OOM)", m.row.allocator)
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

fn min_capacity_chart(
    path: &Path,
    workloads: &[&str],
    measurements: &[Measurement],
) -> Result<(), String> {
    let mut allocators: Vec<&str> = Vec::new();
    for m in measurements {
        if !allocators.contains(&m.row.allocator.as_str()) {
            allocators.push(&m.row.allocator);
        }
    }
    let ratio_of = |m: &Measurement| -> Option<f64> {
        let cap = m.row.min_capacity_bytes?;
        (m.row.peak_live_bytes > 0).then(|| cap as f64 / m.row.peak_live_bytes as f64)
    };
    let y_max = measurements
        .iter()
        .filter_map(ratio_of)
        .fold(1.1f64, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let groups = workloads.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "minimum capacity / peak live bytes (1.0 = no overhead)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..groups, 1f64..y_max)
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = workloads.iter().map(|w| w.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            let frac = x - x.floor();
            if (frac - 0.5).abs() < 1e-6 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("min capacity / peak live")
        .draw()
        .map_err(|e| e.to_string())?;
    let n = allocators.len().max(1) as f64;
    let width = 0.8 / n;
    for (ai, a) in allocators.iter().enumerate() {
        let color = COLORS[ai % COLORS.len()];
        let mut bars = Vec::new();
        for (wi, w) in workloads.iter().enumerate() {
            let found = measurements
                .iter()
                .find(|m| m.row.workload == *w && m.row.allocator == *a);
            if let Some(r) = found.and_then(ratio_of) {
                let x0 = wi as f64 + 0.1 + ai as f64 * width;
                bars.push(Rectangle::new(
                    [(x0, 1.0), (x0 + width * 0.9, r)],
                    color.filled(),
                ));
            }
        }
        chart
            .draw_series(bars)
            .map_err(|e| e.to_string())?
            .label(a.to_string())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
