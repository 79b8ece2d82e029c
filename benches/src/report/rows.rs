//! The measured data structures: a row per (workload, allocator) pair of an
//! A/B run ([`ReportRow`], [`Measurement`], [`Failure`]), the run's
//! parameters, and a point of a scaling run ([`ScalePoint`]). The outputs
//! that present them are [`super::text`], [`super::json`] and
//! [`super::charts`].

use quilt_alloc::{OomReport, OomVerdict};
use quilt_vmm::sim::SimConfig;
use quilt_vmm::{CallKind, DriverStats};
use serde::Serialize;

use crate::allocators;
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
    /// `cuStreamIsCapturing`.
    pub is_capturing: u64,
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
            is_capturing: stats.count(CallKind::StreamIsCapturing),
        }
    }

    /// All six together.
    pub fn total(&self) -> u64 {
        self.synchronize
            + self.wait_event
            + self.event_record
            + self.event_query
            + self.event_destroy
            + self.is_capturing
    }
}

/// The out-of-memory error that ended a replay, as a row carries it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OomRow {
    /// `capacity` or `fragmentation` (the allocator's diagnosis); `null` when
    /// a driver call, not the allocator, reported the shortage.
    pub verdict: Option<OomVerdict>,
    /// The error as the allocator worded it.
    pub message: String,
    /// The allocator's report (`null` with the verdict).
    pub report: Option<OomReport>,
}

impl OomRow {
    /// The row's account of an out-of-memory error: its message and, when
    /// the allocator diagnosed it, its report.
    pub fn new(message: String, report: Option<&OomReport>) -> Self {
        OomRow {
            verdict: report.map(|r| r.verdict),
            message,
            report: report.cloned(),
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
/// (`cpu_ns_per_op`), `event records/op` (`event_records_per_op`), `event
/// queries/op` (`event_queries_per_op`), `races` (`races`).
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
    /// `cuEventRecord` calls per allocator operation over the replay.
    pub event_records_per_op: f64,
    /// `cuEventQuery` calls per allocator operation over the replay.
    pub event_queries_per_op: f64,
    /// Allocations given memory that another stream's work, queued before
    /// its free, may still use, with nothing ordering the new block's
    /// stream after that work: data races on a GPU (see `races.rs`).
    pub races: u64,
    /// The first of them, described (`null` when there was none).
    pub first_race: Option<String>,
}

/// A row with what the JSON leaves out: the flat-create driver time, the
/// memory series, and the allocator's roles in the report (from the
/// registry, [`allocators::Entry`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// The JSON row.
    pub row: ReportRow,
    /// Modelled driver time with every create costed flat, in microseconds.
    pub modelled_flat_create_us: f64,
    /// Live and reserved memory over the main replay.
    pub series: Vec<SeriesPoint>,
    /// Whether the allocator is the reference the ratio columns divide by
    /// ([`allocators::is_reference`]).
    pub reference: bool,
    /// Whether it is the allocator under study ([`allocators::is_subject`]).
    pub subject: bool,
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
        let per_op = |calls: u64| per_op(calls, result.ops);
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
                event_records_per_op: per_op(result.driver.count(CallKind::EventRecord)),
                event_queries_per_op: per_op(result.driver.count(CallKind::EventQuery)),
                races: result.races,
                first_race: result.first_race,
            },
            modelled_flat_create_us: growth_ns.saturating_add(result.driver.modelled_flat_create_ns)
                as f64
                / 1000.0,
            series: result.series,
            reference: allocators::is_reference(allocator),
            subject: allocators::is_subject(allocator),
        }
    }
}

/// `calls` per operation of `ops` (0 when none ran).
pub fn per_op(calls: u64, ops: u64) -> f64 {
    if ops == 0 {
        0.0
    } else {
        calls as f64 / ops as f64
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

/// The workload of an outcome.
pub fn workload_of(o: &Outcome) -> &str {
    match o {
        Ok(m) => &m.row.workload,
        Err(f) => &f.workload,
    }
}

/// The allocator spec of an outcome.
pub fn allocator_of(o: &Outcome) -> &str {
    match o {
        Ok(m) => &m.row.allocator,
        Err(f) => &f.allocator,
    }
}

/// The distinct items of `items`, in order of first appearance (the
/// workloads or allocators of a report).
pub fn distinct<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for item in items {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

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

/// One point of a scaling run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScalePoint {
    /// The allocator spec.
    pub allocator: String,
    /// Live blocks kept.
    pub live: u64,
    /// Streams they are spread over.
    pub streams: u64,
    /// Every block's size in bytes (`quilt-bench sizes`); `None`: the
    /// mixed sizes of `quilt-bench scale`.
    pub size_bytes: Option<u64>,
    /// The allocator's host nanoseconds per allocate or free (the simulated
    /// driver's own time taken out): the median over the runs of the mean
    /// over each run's timed steps.
    pub ns_per_op: f64,
    /// Each run's mean, in the order they ran.
    pub runs_ns_per_op: Vec<f64>,
    /// `cuEventRecord` calls per operation of the timed steps.
    pub event_records_per_op: f64,
    /// `cuEventQuery` calls per operation of the timed steps.
    pub event_queries_per_op: f64,
    /// The simulated driver's own host nanoseconds per operation (median).
    pub sim_ns_per_op: f64,
    /// Wall nanoseconds per operation, the simulated driver's time included
    /// (median).
    pub wall_ns_per_op: f64,
    /// Modelled driver nanoseconds per operation (the simulated device's
    /// cost model over the calls the timed steps made).
    pub driver_ns_per_op: f64,
    /// VMM calls (reserve, create, map, set access, unmap, release, free)
    /// per operation.
    pub vmm_calls_per_op: f64,
    /// Stream and event calls per operation.
    pub stream_calls_per_op: f64,
    /// The stream and event calls of the timed steps, by kind.
    pub stream_calls: StreamCalls,
}
