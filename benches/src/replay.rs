//! Replay of a trace through an allocator on a simulated device, with metrics.
//!
//! Rules:
//! - `alloc` calls `allocate(size, StreamId(stream))`; `free` calls `free(ptr)` on
//!   the pointer the allocation got; a stream use (`u`) calls
//!   `record_stream(ptr, StreamId(stream))` (neither timed nor a device-clock
//!   operation).
//! - The simulated GPU runs behind the host: after every allocate or free call
//!   (the trace's events, and the frees and allocations that reset an
//!   iteration) the replay moves the device's operation clock forward by one
//!   ([`SimVmm::advance`]), and work queued on a stream completes
//!   [`ReplayConfig::gpu_lag_ops`] operations after it was queued (once what it
//!   waited on has; a synchronisation completes it at once). With a lag of 0,
//!   every event completes as it is recorded, as when the replay completed all
//!   work after every free. Trace frees are still taken at `free_completed`:
//!   the lag applies to the work the allocator itself orders with events.
//! - Work is queued per stream ([`SimVmm::queue_work`]): before an
//!   allocation on its stream (the program was running there), and before a
//!   free on the streams that used the block last (the kernels that used it
//!   were queued before the free): those of its stream uses if it has any
//!   (made on its own stream, as a copy or a collective produces it, it is
//!   consumed on the others, as `record_stream` says), else its own. An
//!   event the allocator records completes once the work queued on its
//!   stream before it has: a lag after that stream's last operation, at once
//!   on a stream idle for longer, as on a GPU.
//! - With `iterations: N`, the pre-existing prefix is replayed once and the rest
//!   N times. Between iterations, whatever the iteration left live is freed (in
//!   allocation order) and any pre-existing allocation it freed is allocated
//!   again, so every iteration starts from the same live set.
//! - An allocation that fails with out-of-memory counts one OOM and ends the
//!   replay (`completed == false`). Any other allocator error, or a trace that
//!   frees an id that is not live, is a [`ReplayError`].
//! - The serving events (growable buffers, tagged allocations, sleep and
//!   wake) run through [`crate::serving_events`]: natively on an allocator whose
//!   registry entry says so ([`allocators::Entry::native_serving`]: Quilt's
//!   `quilt` preset, built by [`replay_fresh`]), emulated on every other allocator
//!   (and on any allocator given to [`replay`]). A growable buffer's length
//!   counts as live bytes; a sleeping tag's allocations do not. A growth,
//!   creation or wake that runs out of memory ends the replay as an
//!   allocation does. Between iterations, growable buffers left live are
//!   released, and tags are put back to sleep or woken as they were when
//!   the iteration began.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use quilt_alloc::quilt::{AheadMode, MapAhead, ServingStats};
use quilt_alloc::{AllocError, DeviceAllocator, InvariantViolation, OomReport};
use quilt_vmm::sim::{CostModel, SimConfig, SimVmm};
use quilt_vmm::{DriverStats, StreamId, Vmm};

use crate::allocators::{self, Built, RegistryError};
use crate::live::LiveTracker;
use crate::races::RaceTracker;
use crate::serving_events::{GrowthCopies, LiveBlocks, Serving, ServingFailure, Target};
use crate::trace::{Event, Trace};

/// How to replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayConfig {
    /// Times the non-pre-existing part is replayed (at least 1).
    pub iterations: u32,
    /// Check the allocator's invariants every this many events (`None`: never).
    pub check_every: Option<usize>,
    /// Sample live and reserved memory over the replay (for charts).
    pub record_series: bool,
    /// Time every allocate and free call (for `cpu_ns_per_op`).
    pub time_ops: bool,
    /// How many allocator operations the simulated GPU runs behind the host
    /// ([`SimConfig::gpu_lag_ops`]; see `docs/benchmarks.md` for the default).
    pub gpu_lag_ops: u64,
    /// Modelled cost of one `cuStreamSynchronize`, in nanoseconds
    /// ([`CostModel::sync_ns`]).
    pub sync_cost_ns: u64,
    /// Look for memory reused while another stream's work may still use
    /// it, unordered ([`crate::races`]; for `races`).
    pub find_races: bool,
}

/// The default [`ReplayConfig::gpu_lag_ops`]: 64 allocator operations (see
/// "Simulated GPU lag and stream costs" in `docs/benchmarks.md`).
pub const DEFAULT_GPU_LAG_OPS: u64 = 64;

/// The default [`ReplayConfig::sync_cost_ns`]: 100 us, a pipeline drain
/// ([`CostModel::sync_ns`]).
pub const DEFAULT_SYNC_COST_NS: u64 = 100_000;

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            iterations: 1,
            check_every: None,
            record_series: false,
            time_ops: false,
            gpu_lag_ops: DEFAULT_GPU_LAG_OPS,
            sync_cost_ns: DEFAULT_SYNC_COST_NS,
            find_races: true,
        }
    }
}

impl ReplayConfig {
    /// The simulated device a replay of `config` runs on: `capacity` bytes,
    /// its GPU lag and sync cost, every other figure the default.
    pub fn sim_config(&self, capacity: u64) -> SimConfig {
        SimConfig {
            capacity,
            gpu_lag_ops: self.gpu_lag_ops,
            cost: CostModel {
                sync_ns: self.sync_cost_ns,
                ..CostModel::default()
            },
            ..SimConfig::default()
        }
    }
}

/// Samples of a recorded series (about; by a fixed stride; each sample keeps
/// the lowest and highest live bytes since the one before, so a series holds
/// up to three times as many points).
pub const MAX_SERIES_POINTS: usize = 2000;

/// One sample of memory over the replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeriesPoint {
    /// Events replayed so far.
    pub event: u64,
    /// Live requested bytes.
    pub live_bytes: u64,
    /// The allocator's reserved bytes.
    pub reserved_bytes: u64,
}

/// What a replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayResult {
    /// True when every event was replayed.
    pub completed: bool,
    /// Allocations that failed with out-of-memory (0 or 1: the replay stops at the first).
    pub ooms: u64,
    /// The out-of-memory error's message, if one ended the replay.
    pub oom_message: Option<String>,
    /// The allocator's report of that error (`None` when a driver call, not
    /// the allocator, reported it, or when the replay completed).
    pub oom_report: Option<OomReport>,
    /// Events replayed.
    pub events: u64,
    /// Peak of the live requested bytes.
    pub peak_live_bytes: u64,
    /// Peak of the allocator's reserved bytes (`stats().reserved_bytes.peak`).
    pub peak_reserved_bytes: u64,
    /// `peak_live_bytes / peak_reserved_bytes` (0 when nothing was reserved).
    pub efficiency: f64,
    /// Peak of the page-granular lower bound (see [`LiveTracker::ideal_now`]).
    pub ideal_bytes: u64,
    /// Driver calls and modelled time over the whole replay (allocator construction included).
    pub driver: DriverStats,
    /// Driver calls and modelled time over iterations 2..N (zero when N = 1).
    pub driver_after_first_iteration: DriverStats,
    /// The device-to-device copies of emulated growth (allocators without
    /// growable buffers; none on Quilt), over the whole replay. They are no
    /// driver call of [`ReplayResult::driver`]: reports add them to its
    /// copied bytes and modelled time.
    pub growth_copies: GrowthCopies,
    /// The same over iterations 2..N (zero when N = 1).
    pub growth_copies_after_first_iteration: GrowthCopies,
    /// Quilt's counters of growable buffers, map-ahead and sleep when the
    /// serving events ran on its own API (`None` when they were emulated).
    pub serving_stats: Option<ServingStats>,
    /// Median host time of one allocate or free call, in nanoseconds (0 unless timed).
    pub cpu_ns_per_op: u64,
    /// Allocator operations replayed (allocate, free and serving calls, those
    /// that reset an iteration included): what the per-operation figures
    /// divide by.
    pub ops: u64,
    /// Live and reserved memory over the replay (empty unless recorded).
    pub series: Vec<SeriesPoint>,
    /// Allocations given memory that another stream's work, queued before
    /// its free, may still use, with nothing ordering the new block's
    /// stream after that work: data races on a GPU ([`crate::races`]; 0
    /// unless [`ReplayConfig::find_races`]).
    pub races: u64,
    /// The first of them, described.
    pub first_race: Option<String>,
}

/// Why a replay could not run to a result.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace is inconsistent (a free of an id that is not live, an id reused while live).
    #[error("trace `{trace}`, event {event}: {message}")]
    BadTrace {
        /// The trace.
        trace: String,
        /// 0-based index of the event in the trace.
        event: usize,
        /// What is wrong.
        message: String,
    },
    /// The allocator failed in a way other than out-of-memory.
    #[error("allocator `{allocator}` failed at event {event}: {source}")]
    Allocator {
        /// The allocator.
        allocator: String,
        /// 0-based index of the event in the trace.
        event: usize,
        /// Its error.
        source: AllocError,
    },
    /// The invariant checker found a violation.
    #[error("allocator `{allocator}` broke an invariant after event {event}: {source}")]
    Invariant {
        /// The allocator.
        allocator: String,
        /// 0-based index of the event in the trace.
        event: usize,
        /// The violation.
        source: InvariantViolation,
    },
    /// The simulated device could not be built.
    #[error("simulated device: {0}")]
    Device(quilt_vmm::VmmError),
    /// The allocator could not be built.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Build a fresh simulated device of `capacity` bytes
/// ([`ReplayConfig::sim_config`]) and the allocator `name` on it, and replay
/// `trace` (the serving events natively where the registry says the
/// allocator runs them, [`allocators::Entry::native_serving`]: the `quilt`
/// preset; emulated on the others, `gmlake` included: GMLake has no
/// growable buffers). Quilt's
/// map-ahead runs [`AheadMode::Inline`] where its policy says
/// [`AheadMode::Background`] (the same pages, mapped on the replaying
/// thread): a worker thread would make the figures vary from run to run.
pub fn replay_fresh(
    trace: &Trace,
    allocator: &str,
    capacity: u64,
    config: &ReplayConfig,
) -> Result<ReplayResult, ReplayError> {
    replay_fresh_then(trace, allocator, capacity, config, |_| ()).map(|(r, ())| r)
}

/// [`replay_fresh`], then `after` on the allocator as the replay left it.
pub fn replay_fresh_then<T>(
    trace: &Trace,
    allocator: &str,
    capacity: u64,
    config: &ReplayConfig,
    after: impl FnOnce(&dyn DeviceAllocator) -> T,
) -> Result<(ReplayResult, T), ReplayError> {
    let sim = Arc::new(SimVmm::new(config.sim_config(capacity)).map_err(ReplayError::Device)?);
    let vmm: Arc<dyn Vmm> = sim.clone();
    match allocators::build_for_serving(allocator, vmm)? {
        Built::Native(quilt) => {
            // The background worker would race the replay's simulated clock:
            // the same pages are mapped ahead on the replaying thread instead.
            let ahead = quilt.map_ahead();
            if ahead.mode == AheadMode::Background {
                quilt
                    .set_map_ahead(MapAhead {
                        mode: AheadMode::Inline,
                        ..ahead
                    })
                    .map_err(|source| ReplayError::Allocator {
                        allocator: allocator.to_string(),
                        event: 0,
                        source,
                    })?;
            }
            let result = replay_on(trace, Target::Native(&quilt), &sim, config)?;
            Ok((result, after(&quilt)))
        }
        Built::Emulated(alloc) => {
            let result = replay(trace, alloc.as_ref(), &sim, config)?;
            let then = after(alloc.as_ref());
            Ok((result, then))
        }
    }
}

/// The live allocations of a replay, by trace id.
struct Live {
    by_id: LiveBlocks,
    /// The streams each live allocation is used on: the one it was made on,
    /// then those of its stream uses (`u`), without repeats.
    streams: HashMap<u64, Vec<u64>>,
    tracker: LiveTracker,
}

/// The state of one replay run.
struct Run<'a> {
    trace: &'a Trace,
    alloc: &'a dyn DeviceAllocator,
    serving: Serving<'a>,
    sim: &'a SimVmm,
    config: &'a ReplayConfig,
    live: Live,
    events: u64,
    stride: u64,
    series: Vec<SeriesPoint>,
    /// The lowest and highest live bytes since the last sample, each with
    /// its event: a sample keeps both, so that no peak falls between samples.
    bucket: Option<((u64, u64), (u64, u64))>,
    op_ns: Vec<u32>,
    /// The allocator's report of the last out-of-memory error.
    oom_report: Option<OomReport>,
    /// Unordered reuse found so far (`None` unless looked for).
    races: Option<RaceTracker>,
}

/// What applying one event came to.
enum Step {
    Done,
    OutOfMemory(String),
}

impl Run<'_> {
    fn bad(&self, event: usize, message: String) -> ReplayError {
        ReplayError::BadTrace {
            trace: self.trace.name.clone(),
            event,
            message,
        }
    }

    /// Allocate `size` bytes on `stream` as `id`, carrying `tag` if any.
    fn allocate(
        &mut self,
        index: usize,
        id: u64,
        size: u64,
        stream: u64,
        tag: Option<u64>,
    ) -> Result<Step, ReplayError> {
        if self.live.by_id.contains_key(&id) || self.serving.is_growable(id) {
            return Err(self.bad(index, format!("id {id} allocated while live")));
        }
        self.sim.queue_work(StreamId(stream));
        let start = self.config.time_ops.then(Instant::now);
        let result = match tag {
            None => self
                .alloc
                .allocate(size, StreamId(stream))
                .map(|a| a.ptr)
                .map_err(|e| {
                    if is_oom(&e) {
                        ServingFailure::OutOfMemory(e)
                    } else {
                        ServingFailure::Allocator(e)
                    }
                }),
            Some(tag) => self.serving.allocate_tagged(id, size, stream, tag),
        };
        if let Some(start) = start {
            self.op_ns.push(elapsed_ns(start));
        }
        if let (Some(races), Ok(ptr)) = (&mut self.races, &result) {
            races.allocated(self.sim, *ptr, size, stream, index);
        }
        self.sim.advance(1);
        match result {
            Ok(ptr) => {
                self.live.by_id.insert(id, (ptr, size));
                self.live.streams.insert(id, vec![stream]);
                self.live.tracker.add(size);
                Ok(Step::Done)
            }
            Err(e) => self.failed(index, e),
        }
    }

    /// What a serving operation's failure comes to: the end of the replay
    /// (out of memory) or an error.
    fn failed(&mut self, index: usize, failure: ServingFailure) -> Result<Step, ReplayError> {
        match failure {
            ServingFailure::OutOfMemory(e) => {
                self.oom_report = e.oom_report().cloned();
                Ok(Step::OutOfMemory(e.to_string()))
            }
            ServingFailure::Allocator(source) => Err(ReplayError::Allocator {
                allocator: self.alloc.name().to_string(),
                event: index,
                source,
            }),
            ServingFailure::BadTrace(message) => Err(self.bad(index, message)),
        }
    }

    /// Run one serving event (not an allocation or a free).
    fn serve(&mut self, index: usize, event: Event) -> Result<Step, ReplayError> {
        let start = self.config.time_ops.then(Instant::now);
        let tracker = &mut self.live.tracker;
        let result = match event {
            Event::CreateGrowable { id, max, stream } => {
                if self.live.by_id.contains_key(&id) {
                    return Err(self.bad(index, format!("id {id} created while live")));
                }
                self.serving.create(id, max, stream)
            }
            Event::Grow { id, bytes } => self.serving.resize(id, bytes, true, tracker),
            Event::Shrink { id, bytes } => self.serving.resize(id, bytes, false, tracker),
            Event::ReleaseGrowable { id } => self.serving.release(id, tracker),
            Event::Sleep { tag } => self.serving.sleep(tag, &mut self.live.by_id, tracker),
            Event::Wake { tag } => self.serving.wake(tag, &mut self.live.by_id, tracker),
            Event::Alloc { .. }
            | Event::Free { .. }
            | Event::AllocTagged { .. }
            | Event::RecordStream { .. } => Ok(()),
        };
        if let Some(start) = start {
            self.op_ns.push(elapsed_ns(start));
        }
        self.sim.advance(1);
        match result {
            Ok(()) => Ok(Step::Done),
            Err(e) => self.failed(index, e),
        }
    }

    fn free(&mut self, index: usize, id: u64) -> Result<(), ReplayError> {
        if let Some(tag) = self.serving.sleeping_tag_of(id) {
            return Err(self.bad(index, format!("free of id {id}, whose tag {tag} sleeps")));
        }
        let Some((ptr, size)) = self.live.by_id.remove(&id) else {
            return Err(self.bad(index, format!("free of id {id}, which is not live")));
        };
        self.serving.forget(id);
        // The kernels that used it last were queued before the free: on
        // the streams it was recorded on if any (its own stream produced it,
        // they consume it), else on its own.
        let used_on = self.live.streams.remove(&id).unwrap_or_default();
        let last_users = if used_on.len() > 1 {
            &used_on[1..]
        } else {
            &used_on[..]
        };
        for &stream in last_users {
            self.sim.queue_work(StreamId(stream));
        }
        if let Some(races) = &mut self.races {
            races.freeing(self.sim, ptr, size, &used_on);
        }
        let start = self.config.time_ops.then(Instant::now);
        let result = self.alloc.free(ptr);
        if let Some(start) = start {
            self.op_ns.push(elapsed_ns(start));
        }
        self.sim.advance(1);
        result.map_err(|source| ReplayError::Allocator {
            allocator: self.alloc.name().to_string(),
            event: index,
            source,
        })?;
        self.live.tracker.remove(size);
        Ok(())
    }

    /// `record_stream` of the live allocation `id` on `stream`: neither timed
    /// nor an operation of the device clock (it queues no work).
    fn record_stream(&mut self, index: usize, id: u64, stream: u64) -> Result<(), ReplayError> {
        let Some(&(ptr, _)) = self.live.by_id.get(&id) else {
            return Err(self.bad(index, format!("stream use of id {id}, which is not live")));
        };
        if let Some(used_on) = self.live.streams.get_mut(&id) {
            if !used_on.contains(&stream) {
                used_on.push(stream);
            }
        }
        self.alloc
            .record_stream(ptr, StreamId(stream))
            .map_err(|source| ReplayError::Allocator {
                allocator: self.alloc.name().to_string(),
                event: index,
                source,
            })
    }

    fn apply(&mut self, index: usize) -> Result<Step, ReplayError> {
        let Some(&event) = self.trace.events.get(index) else {
            return Ok(Step::Done);
        };
        let step = match event {
            Event::Alloc { id, size, stream } => self.allocate(index, id, size, stream, None)?,
            Event::AllocTagged {
                id,
                size,
                stream,
                tag,
            } => self.allocate(index, id, size, stream, Some(tag))?,
            Event::Free { id } => {
                self.free(index, id)?;
                Step::Done
            }
            Event::RecordStream { id, stream } => {
                self.record_stream(index, id, stream)?;
                Step::Done
            }
            serving => self.serve(index, serving)?,
        };
        if let Step::OutOfMemory(_) = step {
            return Ok(step);
        }
        self.events += 1;
        if let Some(k) = self.config.check_every {
            if k > 0 && self.events.is_multiple_of(k as u64) {
                self.check(index)?;
            }
        }
        if self.config.record_series {
            let now = (self.events, self.live.tracker.live_bytes);
            let (lo, hi) = self.bucket.get_or_insert((now, now));
            if now.1 < lo.1 {
                *lo = now;
            }
            if now.1 > hi.1 {
                *hi = now;
            }
            if self.events.is_multiple_of(self.stride) {
                self.sample();
            }
        }
        Ok(Step::Done)
    }

    fn check(&self, index: usize) -> Result<(), ReplayError> {
        self.alloc
            .check_invariants()
            .map_err(|source| ReplayError::Invariant {
                allocator: self.alloc.name().to_string(),
                event: index,
                source,
            })
    }

    /// Record the bucket since the last sample: its lowest and highest live
    /// bytes in event order, then the live bytes now, each with the reserved
    /// bytes now.
    fn sample(&mut self) {
        let reserved_bytes = self.alloc.stats().reserved_bytes.current;
        let mut points: Vec<(u64, u64)> = Vec::with_capacity(3);
        if let Some((lo, hi)) = self.bucket.take() {
            points.push(lo.min(hi));
            points.push(lo.max(hi));
        }
        points.push((self.events, self.live.tracker.live_bytes));
        points.dedup_by_key(|p| p.0);
        for (event, live_bytes) in points {
            if self.series.last().is_some_and(|l| l.event >= event) {
                continue;
            }
            self.series.push(SeriesPoint {
                event,
                live_bytes,
                reserved_bytes,
            });
        }
    }

    /// Free what an iteration left live (in allocation order), release the
    /// growable buffers it left, put tags back to sleep or wake them as they
    /// were at its start (`asleep`), and allocate again the pre-existing
    /// allocations it freed. `pre` lists the prefix's allocations.
    fn reset_iteration(
        &mut self,
        pre: &[Preexisting],
        asleep: &BTreeSet<u64>,
    ) -> Result<Step, ReplayError> {
        let last = self.trace.events.len().saturating_sub(1);
        let now = self.serving.sleeping_tags();
        for &tag in now.difference(asleep) {
            if let Step::OutOfMemory(m) = self.serve(last, Event::Wake { tag })? {
                return Ok(Step::OutOfMemory(m));
            }
        }
        for id in self.serving.growable_ids() {
            self.serve(last, Event::ReleaseGrowable { id })?;
        }
        let pre_ids: std::collections::HashSet<u64> = pre.iter().map(|p| p.id).collect();
        let mut leftovers: Vec<u64> = self
            .live
            .by_id
            .keys()
            .copied()
            .filter(|id| !pre_ids.contains(id))
            .collect();
        leftovers.sort_unstable();
        for id in leftovers {
            self.free(last, id)?;
        }
        for p in pre {
            if !self.live.by_id.contains_key(&p.id) {
                if let Step::OutOfMemory(m) =
                    self.allocate(p.index, p.id, p.size, p.stream, p.tag)?
                {
                    return Ok(Step::OutOfMemory(m));
                }
            }
        }
        let now = self.serving.sleeping_tags();
        for &tag in asleep.difference(&now) {
            if let Step::OutOfMemory(m) = self.serve(last, Event::Sleep { tag })? {
                return Ok(Step::OutOfMemory(m));
            }
        }
        Ok(Step::Done)
    }
}

/// An allocation of the pre-existing prefix.
struct Preexisting {
    index: usize,
    id: u64,
    size: u64,
    stream: u64,
    tag: Option<u64>,
}

fn elapsed_ns(start: Instant) -> u32 {
    u32::try_from(start.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

/// True for an out-of-memory error, whether the allocator diagnosed it or a
/// driver call reported it.
pub fn is_oom(e: &AllocError) -> bool {
    match e {
        AllocError::OutOfMemory(_) => true,
        AllocError::Driver(v) => v.is_out_of_memory(),
        _ => false,
    }
}

/// Replay `trace` through `alloc`, which runs on `sim`. The GPU lag and costs
/// are `sim`'s own (its [`SimConfig`]; build it with [`ReplayConfig::sim_config`]
/// to follow `config`): a device of [`quilt_vmm::sim::LAG_NEVER`], the default,
/// completes work only when the allocator synchronises. The serving events
/// are emulated whatever `alloc` is ([`replay_on`] with [`Target::Native`]
/// runs them on Quilt's own API).
pub fn replay(
    trace: &Trace,
    alloc: &dyn DeviceAllocator,
    sim: &SimVmm,
    config: &ReplayConfig,
) -> Result<ReplayResult, ReplayError> {
    replay_on(trace, Target::Emulated(alloc), sim, config)
}

/// [`replay`] on `target`: Quilt's own serving API, or any allocator with the
/// serving events emulated ([`crate::serving_events`]).
pub fn replay_on(
    trace: &Trace,
    target: Target<'_>,
    sim: &SimVmm,
    config: &ReplayConfig,
) -> Result<ReplayResult, ReplayError> {
    let alloc = target.allocator();
    let clock_at_start = sim.clock();
    let iterations = config.iterations.max(1);
    let pre_len = trace.preexisting.min(trace.events.len());
    let body_len = trace.events.len() - pre_len;
    let expected =
        (pre_len as u64).saturating_add((body_len as u64).saturating_mul(u64::from(iterations)));
    let mut run = Run {
        trace,
        alloc,
        serving: Serving::new(target, sim.config().cost.clone()),
        sim,
        config,
        live: Live {
            by_id: HashMap::new(),
            streams: HashMap::new(),
            tracker: LiveTracker::new(),
        },
        events: 0,
        stride: (expected / MAX_SERIES_POINTS as u64).max(1),
        series: Vec::new(),
        bucket: None,
        op_ns: Vec::with_capacity(if config.time_ops {
            expected.min(1 << 22) as usize
        } else {
            0
        }),
        oom_report: None,
        races: config.find_races.then(RaceTracker::new),
    };
    let pre: Vec<Preexisting> = trace.events[..pre_len]
        .iter()
        .enumerate()
        .filter_map(|(index, e)| match *e {
            Event::Alloc { id, size, stream } => Some(Preexisting {
                index,
                id,
                size,
                stream,
                tag: None,
            }),
            Event::AllocTagged {
                id,
                size,
                stream,
                tag,
            } => Some(Preexisting {
                index,
                id,
                size,
                stream,
                tag: Some(tag),
            }),
            _ => None,
        })
        .collect();

    let mut oom: Option<String> = None;
    let mut after_first_start: Option<(DriverStats, GrowthCopies)> = None;
    'outer: {
        for index in 0..pre_len {
            if let Step::OutOfMemory(m) = run.apply(index)? {
                oom = Some(m);
                break 'outer;
            }
        }
        let asleep = run.serving.sleeping_tags();
        for iteration in 0..iterations {
            if iteration > 0 {
                if let Step::OutOfMemory(m) = run.reset_iteration(&pre, &asleep)? {
                    oom = Some(m);
                    break 'outer;
                }
            }
            if iteration == 1 {
                after_first_start = Some((sim.driver_stats(), run.serving.growth_copies()));
            }
            for index in pre_len..trace.events.len() {
                if let Step::OutOfMemory(m) = run.apply(index)? {
                    oom = Some(m);
                    break 'outer;
                }
            }
        }
    }
    if config.check_every.is_some() {
        run.check(trace.events.len().saturating_sub(1))?;
    }
    if config.record_series {
        run.sample();
    }
    let driver = sim.driver_stats();
    let growth_copies = run.serving.growth_copies();
    let (driver_after_first_iteration, growth_copies_after_first_iteration) = after_first_start
        .map(|(d, g)| (driver.since(&d), growth_copies.since(&g)))
        .unwrap_or_default();
    let stats = alloc.stats();
    let peak_reserved = stats.reserved_bytes.peak;
    let peak_live = run.live.tracker.peak_live_bytes;
    Ok(ReplayResult {
        completed: oom.is_none(),
        ooms: u64::from(oom.is_some()),
        oom_report: if oom.is_some() {
            run.oom_report.take()
        } else {
            None
        },
        oom_message: oom,
        events: run.events,
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak_reserved,
        efficiency: if peak_reserved == 0 {
            0.0
        } else {
            peak_live as f64 / peak_reserved as f64
        },
        ideal_bytes: run.live.tracker.peak_ideal_bytes,
        driver,
        driver_after_first_iteration,
        growth_copies,
        growth_copies_after_first_iteration,
        serving_stats: run.serving.native_stats(),
        cpu_ns_per_op: median(&mut run.op_ns),
        ops: sim.clock().saturating_sub(clock_at_start),
        series: run.series,
        races: run.races.as_ref().map_or(0, RaceTracker::races),
        first_race: run
            .races
            .as_ref()
            .and_then(|r| r.first().map(str::to_owned)),
    })
}

/// The median of `values` (0 when empty); reorders them.
fn median(values: &mut [u32]) -> u64 {
    if values.is_empty() {
        return 0;
    }
    let mid = values.len() / 2;
    let (_, m, _) = values.select_nth_unstable(mid);
    u64::from(*m)
}
