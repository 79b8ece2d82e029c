//! Reports of an A/B run: the rows, the JSON report (the run's parameters and
//! the rows) and the SVG charts. The text table is [`crate::table`].

use std::path::Path;

use plotters::prelude::*;
use quilt_alloc::{OomReport, OomVerdict};
use quilt_vmm::sim::SimConfig;
use quilt_vmm::{CallKind, DriverStats};
use serde::Serialize;

use crate::replay::{ReplayResult, SeriesPoint};

/// The seven VMM driver calls, counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VmmCalls {
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

impl VmmCalls {
    /// The counts of `stats`.
    pub fn from_stats(stats: &DriverStats) -> Self {
        VmmCalls {
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

/// The out-of-memory error that ended a replay, as a row carries it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomRow {
    /// `capacity` or `fragmentation` (the allocator's diagnosis); `null` when
    /// a driver call, not the allocator, reported the shortage.
    pub verdict: Option<&'static str>,
    /// The error as the allocator worded it.
    pub message: String,
    /// The allocator's figures (`null` with the verdict).
    pub report: Option<OomFigures>,
}

/// The figures of an [`OomReport`], in bytes (see its fields' documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct OomFigures {
    /// Bytes asked for.
    pub requested: u64,
    /// The request after the allocator's rounding.
    pub needed: u64,
    /// Bytes of physical memory the allocator had to add for it.
    pub needed_unbacked: u64,
    /// Device capacity or the allocator's limit.
    pub capacity: u64,
    /// Bytes reserved from the driver.
    pub reserved: u64,
    /// Bytes of live allocations.
    pub allocated: u64,
    /// Bytes the device could still create for this allocator.
    pub device_free: u64,
    /// Bytes held but backing no live allocation.
    pub reclaimable: u64,
    /// The largest extent the allocator could hand out whole.
    pub largest_free_extent: u64,
}

/// The verdict's name in reports.
pub fn verdict_name(verdict: OomVerdict) -> &'static str {
    match verdict {
        OomVerdict::Capacity => "capacity",
        OomVerdict::Fragmentation => "fragmentation",
    }
}

impl OomRow {
    /// The row's account of an out-of-memory error: its message and, when
    /// the allocator diagnosed it, its report.
    pub fn new(message: String, report: Option<&OomReport>) -> Self {
        OomRow {
            verdict: report.map(|r| verdict_name(r.verdict)),
            message,
            report: report.map(|r| OomFigures {
                requested: r.requested,
                needed: r.needed,
                needed_unbacked: r.needed_unbacked,
                capacity: r.capacity,
                reserved: r.reserved,
                allocated: r.allocated,
                device_free: r.device_free,
                reclaimable: r.reclaimable,
                largest_free_extent: r.largest_free_extent,
            }),
        }
    }
}

/// One measured (workload, allocator) pair: a JSON row of the report. The
/// fields are exactly these, in this order. The table's columns name them:
/// `done` (`completed`), `peak live GiB`, `peak reserved GiB`, `eff.`
/// (`efficiency`), `ideal GiB`, `min cap GiB` (`min_capacity_bytes`), `VMM
/// calls` (`vmm_calls`), `calls after 1st` (`vmm_calls_after_first_iteration`),
/// `syncs` and `syncs after 1st` (`stream_calls.synchronize`), `waits`
/// (`stream_calls.wait_event`), `copied GiB` (`copied_bytes`), `growth
/// copied GiB` (`growth_copied_bytes`), `grows mapped` (`grows_already_mapped`
/// over `grows`), `driver ms` (`modelled_driver_us`), `CPU ns/op`
/// (`cpu_ns_per_op`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReportRow {
    /// Workload (generator name, trace file stem or snapshot stem).
    pub workload: String,
    /// Allocator spec, as given.
    pub allocator: String,
    /// Simulated device capacity of the main replay.
    pub capacity_bytes: u64,
    /// Whether the main replay completed.
    pub completed: bool,
    /// Out-of-memory errors in the main replay.
    pub ooms: u64,
    /// The out-of-memory error that ended the main replay (`null` when it completed).
    pub oom: Option<OomRow>,
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
    /// VMM driver calls over the replay.
    pub vmm_calls: VmmCalls,
    /// VMM driver calls over iterations 2..N (null when one iteration ran).
    pub vmm_calls_after_first_iteration: Option<VmmCalls>,
    /// Stream and event calls over the replay.
    pub stream_calls: StreamCalls,
    /// Stream and event calls over iterations 2..N (null when one iteration ran).
    pub stream_calls_after_first_iteration: Option<StreamCalls>,
    /// Bytes copied over the replay: between host and device by sleep and
    /// wake (`cuMemcpyDtoH`, `cuMemcpyHtoD`), plus `growth_copied_bytes`.
    pub copied_bytes: u64,
    /// Bytes copied device to device by emulated growth: an allocator
    /// without growable buffers reallocates and copies (0 on Quilt).
    pub growth_copied_bytes: u64,
    /// Growable buffers' `grow_to` calls, on Quilt (null where growth is
    /// emulated by reallocation).
    pub grows: Option<u64>,
    /// Of those, the grows that found every page they reached already mapped
    /// (by map-ahead or a shrink's spare pages): no driver call (null where
    /// growth is emulated).
    pub grows_already_mapped: Option<u64>,
    /// Modelled driver time in microseconds (create costed by size; every
    /// call of the cost model, stream synchronisations included, and the
    /// copies of emulated growth at the cost model's copy figures).
    pub modelled_driver_us: f64,
    /// Median host nanoseconds per allocate or free.
    pub cpu_ns_per_op: u64,
}

/// A row with what the JSON leaves out: the flat-create driver time and the
/// memory series.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// The JSON row.
    pub row: ReportRow,
    /// Modelled driver time with every create costed flat, in microseconds.
    pub modelled_flat_create_us: f64,
    /// Live and reserved memory over the main replay.
    pub series: Vec<SeriesPoint>,
}

impl Measurement {
    /// Assemble a measurement from a replay of `iterations` iterations.
    pub fn new(
        workload: &str,
        allocator: &str,
        capacity_bytes: u64,
        iterations: u32,
        result: ReplayResult,
        min_capacity_bytes: Option<u64>,
    ) -> Self {
        let looped = iterations > 1;
        let growth_ns = result.growth_copies.modelled_ns;
        Measurement {
            row: ReportRow {
                workload: workload.to_string(),
                allocator: allocator.to_string(),
                capacity_bytes,
                completed: result.completed,
                ooms: result.ooms,
                oom: result
                    .oom_message
                    .map(|m| OomRow::new(m, result.oom_report.as_ref())),
                events: result.events,
                peak_live_bytes: result.peak_live_bytes,
                peak_reserved_bytes: result.peak_reserved_bytes,
                efficiency: result.efficiency,
                ideal_bytes: result.ideal_bytes,
                min_capacity_bytes,
                vmm_calls: VmmCalls::from_stats(&result.driver),
                vmm_calls_after_first_iteration: looped
                    .then(|| VmmCalls::from_stats(&result.driver_after_first_iteration)),
                stream_calls: StreamCalls::from_stats(&result.driver),
                stream_calls_after_first_iteration: looped
                    .then(|| StreamCalls::from_stats(&result.driver_after_first_iteration)),
                copied_bytes: result
                    .driver
                    .copied_bytes
                    .saturating_add(result.growth_copies.bytes),
                growth_copied_bytes: result.growth_copies.bytes,
                grows: result.serving_stats.map(|s| s.grows),
                grows_already_mapped: result.serving_stats.map(|s| s.grows_already_mapped),
                modelled_driver_us: growth_ns.saturating_add(result.driver.modelled_ns) as f64
                    / 1000.0,
                cpu_ns_per_op: result.cpu_ns_per_op,
            },
            modelled_flat_create_us: growth_ns.saturating_add(result.driver.modelled_flat_create_ns)
                as f64
                / 1000.0,
            series: result.series,
        }
    }
}

/// A (workload, allocator) pair that gave no measurement: its allocator
/// could not be built, the trace was inconsistent, or the allocator failed
/// other than by running out of memory. A JSON row of its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Failure {
    /// The workload.
    pub workload: String,
    /// The allocator spec, as given.
    pub allocator: String,
    /// The device capacity of the main replay.
    pub capacity_bytes: u64,
    /// Always false.
    pub completed: bool,
    /// What failed.
    pub error: String,
}

/// What one (workload, allocator) pair came to.
pub type Outcome = Result<Measurement, Failure>;

/// The simulated device's cost model as the JSON report gives it (the
/// latencies in microseconds).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CostModelParameters {
    /// Allocator operations the simulated GPU runs behind the host.
    pub gpu_lag_ops: u64,
    /// Allocation granularity (the size of one `create` unit) in bytes.
    pub granularity_bytes: u64,
    /// `cuStreamSynchronize`, per call.
    pub sync_us: f64,
    /// `cuMemAddressReserve`, per call.
    pub reserve_us: f64,
    /// `cuMemCreate`, per granule (the proportional model of `driver ms`).
    pub create_us_per_granule: f64,
    /// `cuMemCreate`, per call (the flat model of `flat-create ms`).
    pub create_flat_us: f64,
    /// `cuMemMap`, per call.
    pub map_us: f64,
    /// `cuMemSetAccess`, per call.
    pub set_access_us: f64,
    /// `cuMemUnmap`, per call.
    pub unmap_us: f64,
    /// `cuMemRelease`, per call.
    pub release_us: f64,
    /// `cuMemAddressFree`, per call.
    pub address_free_us: f64,
    /// `cuMemGetInfo`, per call.
    pub mem_info_us: f64,
    /// Event record, query, destroy and stream-wait-event, per call.
    pub event_us: f64,
}

impl CostModelParameters {
    /// The figures of the simulated device `sim`.
    pub fn of(sim: &SimConfig) -> Self {
        let us = |ns: u64| ns as f64 / 1000.0;
        let c = &sim.cost;
        CostModelParameters {
            gpu_lag_ops: sim.gpu_lag_ops,
            granularity_bytes: sim.granularity,
            sync_us: us(c.sync_ns),
            reserve_us: us(c.reserve_ns),
            create_us_per_granule: us(c.create_ns_per_granule),
            create_flat_us: us(c.create_flat_ns),
            map_us: us(c.map_ns),
            set_access_us: us(c.set_access_ns),
            unmap_us: us(c.unmap_ns),
            release_us: us(c.release_ns),
            address_free_us: us(c.address_free_ns),
            mem_info_us: us(c.mem_info_ns),
            event_us: us(c.event_ns),
        }
    }
}

/// The run's parameters, the `parameters` object of the JSON report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunParameters {
    /// `quilt-bench` version and the git commit it was built from
    /// (`0.1.0 (abc123def456)`; `unknown` where git was not available).
    pub version: String,
    /// The allocator specs, in report order, as given.
    pub allocators: Vec<String>,
    /// The workloads, in report order (names made unique).
    pub workloads: Vec<String>,
    /// Device capacity of the main replay.
    pub capacity_bytes: u64,
    /// Times the non-pre-existing part of each trace was replayed.
    pub iterations: u32,
    /// Seed of the built-in workload generators.
    pub seed: u64,
    /// Whether the minimum capacity was bisected (`--no-bisect`: false).
    pub bisection: bool,
    /// The simulated device's cost model.
    pub cost_model: CostModelParameters,
}

/// The version string of [`RunParameters::version`].
pub fn version() -> String {
    format!(
        "{} ({})",
        env!("CARGO_PKG_VERSION"),
        option_env!("QUILT_BENCH_GIT_COMMIT").unwrap_or("unknown")
    )
}

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
    // Wide enough that each workload's name fits under its group: about
    // 7 px per character of the 12 px label font, and a gap between names.
    let longest = workloads
        .iter()
        .map(|w| w.chars().count())
        .max()
        .unwrap_or(0);
    let per_group = (longest as u32 * 7 + 24).max(140);
    let width = (workloads.len().max(1) as u32 * per_group + 100).max(1100);
    let root = SVGBackend::new(path, (width, 620)).into_drawing_area();
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
