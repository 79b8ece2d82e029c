//! Driver-call latency micro-benchmark: a plain timing loop over every VMM
//! call, on any backend (the real figures come from the CUDA backend; the host
//! backend gives real `mmap` figures of its emulation; the simulated backend
//! costs nothing and is there for tests).
//!
//! The design follows kvcached's `bench_vmm` (one thread, many 2 MiB pages,
//! each call timed alone with a monotonic clock):
//!
//! 1. the page lifecycle ([`PAGE_LIFECYCLE`]), in batches of `batch` pages:
//!    reserve each page's address range, create each page, map, set access,
//!    unmap, release, address-free (every call on one page, `iters` pages in all);
//! 2. a large handle (`large_size`, 64 MiB by default), `large_iters` times:
//!    create, map, set access, unmap, release, one call each on the whole handle;
//! 3. the stream calls an allocator makes besides them ([`STREAM_CALLS`]),
//!    `iters` times on the default stream: record an event, query it, make
//!    the stream wait for it, ask whether the stream is capturing, destroy
//!    the event (size 0; the cost model prices each as one event call).
//!
//! A few untimed warm-up cycles run first. Results are per-call samples,
//! summarised as median, p99, mean and max in microseconds, and printed as a
//! Markdown table ([`LatencyReport::to_markdown`]). Nothing is asserted about
//! the figures: they are what the machine measured.

use std::fmt::Write as _;
use std::time::Instant;

use quilt_vmm::{CallKind, DevicePtr, EventId, PhysHandle, Result, StreamId, Vmm};

/// The seven VMM calls of one page's life, in the order the page lifecycle
/// makes them: reserve, create, map, set access, unmap, release, address-free.
pub const PAGE_LIFECYCLE: [CallKind; 7] = [
    CallKind::Reserve,
    CallKind::Create,
    CallKind::Map,
    CallKind::SetAccess,
    CallKind::Unmap,
    CallKind::Release,
    CallKind::AddressFree,
];

/// The stream and event calls of the third loop, in the order it makes them.
pub const STREAM_CALLS: [CallKind; 5] = [
    CallKind::EventRecord,
    CallKind::EventQuery,
    CallKind::StreamWaitEvent,
    CallKind::StreamIsCapturing,
    CallKind::EventDestroy,
];

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyConfig {
    /// Pages in the page lifecycle (calls of each kind). Default 1000.
    pub iters: usize,
    /// Pages alive at once in the page lifecycle. Default 1000 (all).
    pub batch: usize,
    /// Bytes per page (a multiple of the granularity). Default 2 MiB.
    pub page_size: u64,
    /// Cycles of the large-handle loop. Default 200.
    pub large_iters: usize,
    /// Bytes of the large handle (a multiple of the granularity). Default 64 MiB.
    pub large_size: u64,
    /// Untimed warm-up cycles of each loop. Default 5.
    pub warmup: usize,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        LatencyConfig {
            iters: 1000,
            batch: 1000,
            page_size: 2 << 20,
            large_iters: 200,
            large_size: 64 << 20,
            warmup: 5,
        }
    }
}

/// The samples of one call kind at one size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatencyRow {
    /// The call measured.
    pub call: CallKind,
    /// Bytes per call (the reservation, handle or range size).
    pub size: u64,
    /// Wall time of each call in nanoseconds, in call order.
    pub samples_ns: Vec<u64>,
}

impl LatencyRow {
    fn sorted(&self) -> Vec<u64> {
        let mut v = self.samples_ns.clone();
        v.sort_unstable();
        v
    }

    /// The `q` quantile (0..=1, nearest rank) in microseconds; 0 without samples.
    pub fn quantile_us(&self, q: f64) -> f64 {
        let v = self.sorted();
        if v.is_empty() {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1] as f64 / 1000.0
    }

    /// Median in microseconds.
    pub fn median_us(&self) -> f64 {
        self.quantile_us(0.5)
    }

    /// 99th percentile in microseconds.
    pub fn p99_us(&self) -> f64 {
        self.quantile_us(0.99)
    }

    /// Mean in microseconds; 0 without samples.
    pub fn mean_us(&self) -> f64 {
        if self.samples_ns.is_empty() {
            return 0.0;
        }
        self.samples_ns.iter().sum::<u64>() as f64 / self.samples_ns.len() as f64 / 1000.0
    }

    /// Maximum in microseconds.
    pub fn max_us(&self) -> f64 {
        self.samples_ns.iter().copied().max().unwrap_or(0) as f64 / 1000.0
    }
}

/// Everything one run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyReport {
    /// The backend's name ("cuda", "host", "simulated").
    pub backend: String,
    /// Words on the machine and backend (device name, driver version, emulation).
    pub description: String,
    /// The backend's granularity in bytes.
    pub granularity: u64,
    /// The configuration used.
    pub config: LatencyConfig,
    /// One row per (call, size), in the order measured.
    pub rows: Vec<LatencyRow>,
}

fn size_label(bytes: u64) -> String {
    if bytes == 0 {
        "-".to_owned() // a stream or event call: no size
    } else if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

impl LatencyReport {
    /// The row of `call` at `size`, if measured.
    pub fn row(&self, call: CallKind, size: u64) -> Option<&LatencyRow> {
        self.rows.iter().find(|r| r.call == call && r.size == size)
    }

    /// A Markdown section: a heading line, the conditions, and one table row
    /// per (call, size) with calls, median, p99, mean and max in microseconds.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "#### Driver call latency: {} backend ({})\n",
            self.backend, self.description
        );
        let _ = writeln!(
            out,
            "One thread, each call timed alone (`std::time::Instant`); granularity {}; \
             page lifecycle of {} pages of {} in batches of {}; large handle of {} × {}; \
             {} rounds of the stream calls on the default stream; \
             {} untimed warm-up cycles.\n",
            size_label(self.granularity),
            self.config.iters,
            size_label(self.config.page_size),
            self.config.batch,
            self.config.large_iters,
            size_label(self.config.large_size),
            self.config.iters,
            self.config.warmup
        );
        out.push_str("| call | size | calls | median µs | p99 µs | mean µs | max µs |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.call.driver_name(),
                size_label(r.size),
                r.samples_ns.len(),
                r.median_us(),
                r.p99_us(),
                r.mean_us(),
                r.max_us()
            );
        }
        out
    }
}

/// Collects samples and remembers what is alive, so a failure can clean up.
struct Run<'a> {
    vmm: &'a dyn Vmm,
    rows: Vec<LatencyRow>,
    reserved: Vec<(DevicePtr, u64)>,
    created: Vec<PhysHandle>,
    mapped: Vec<(DevicePtr, u64)>,
    events: Vec<EventId>,
}

impl Run<'_> {
    fn sample(&mut self, call: CallKind, size: u64, ns: u64) {
        match self
            .rows
            .iter_mut()
            .find(|r| r.call == call && r.size == size)
        {
            Some(row) => row.samples_ns.push(ns),
            None => self.rows.push(LatencyRow {
                call,
                size,
                samples_ns: vec![ns],
            }),
        }
    }

    /// Times `f` as one call of `call` on `size` bytes (recorded when `timed`).
    fn timed<T>(
        &mut self,
        timed: bool,
        call: CallKind,
        size: u64,
        f: impl FnOnce(&dyn Vmm) -> Result<T>,
    ) -> Result<T> {
        let started = Instant::now();
        let out = f(self.vmm);
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if timed && out.is_ok() {
            self.sample(call, size, ns);
        }
        out
    }

    /// One batch of the page lifecycle: `n` pages of `size` bytes.
    fn page_batch(&mut self, n: usize, size: u64, timed: bool) -> Result<()> {
        let mut ptrs = Vec::with_capacity(n);
        for _ in 0..n {
            let p = self.timed(timed, CallKind::Reserve, size, |v| v.reserve(size, 0))?;
            self.reserved.push((p, size));
            ptrs.push(p);
        }
        let mut handles = Vec::with_capacity(n);
        for _ in 0..n {
            let h = self.timed(timed, CallKind::Create, size, |v| v.create(size))?;
            self.created.push(h);
            handles.push(h);
        }
        for (p, h) in ptrs.iter().zip(&handles) {
            self.timed(timed, CallKind::Map, size, |v| v.map(*p, size, *h, 0))?;
            self.mapped.push((*p, size));
        }
        for p in &ptrs {
            self.timed(timed, CallKind::SetAccess, size, |v| v.set_access(*p, size))?;
        }
        for p in &ptrs {
            self.timed(timed, CallKind::Unmap, size, |v| v.unmap(*p, size))?;
            self.mapped.retain(|(q, _)| q != p);
        }
        for h in &handles {
            self.timed(timed, CallKind::Release, size, |v| v.release(*h))?;
            self.created.retain(|c| c != h);
        }
        for p in &ptrs {
            self.timed(timed, CallKind::AddressFree, size, |v| {
                v.address_free(*p, size)
            })?;
            self.reserved.retain(|(q, _)| q != p);
        }
        Ok(())
    }

    /// One cycle of the large-handle loop on a reservation of `size` at `va`.
    fn large_cycle(&mut self, va: DevicePtr, size: u64, timed: bool) -> Result<()> {
        let h = self.timed(timed, CallKind::Create, size, |v| v.create(size))?;
        self.created.push(h);
        self.timed(timed, CallKind::Map, size, |v| v.map(va, size, h, 0))?;
        self.mapped.push((va, size));
        self.timed(timed, CallKind::SetAccess, size, |v| v.set_access(va, size))?;
        self.timed(timed, CallKind::Unmap, size, |v| v.unmap(va, size))?;
        self.mapped.clear();
        self.timed(timed, CallKind::Release, size, |v| v.release(h))?;
        self.created.clear();
        Ok(())
    }

    /// One round of the stream calls on the default stream.
    fn stream_round(&mut self, timed: bool) -> Result<()> {
        let s = StreamId::DEFAULT;
        let e = self.timed(timed, CallKind::EventRecord, 0, |v| v.event_record(s))?;
        self.events.push(e);
        self.timed(timed, CallKind::EventQuery, 0, |v| v.event_query(e))?;
        self.timed(timed, CallKind::StreamWaitEvent, 0, |v| {
            v.stream_wait_event(s, e)
        })?;
        self.timed(timed, CallKind::StreamIsCapturing, 0, |v| {
            v.stream_is_capturing(s)
        })?;
        self.timed(timed, CallKind::EventDestroy, 0, |v| v.event_destroy(e))?;
        self.events.clear();
        Ok(())
    }

    /// Gives back whatever a failed run left alive (errors ignored).
    fn clean_up(&mut self) {
        for e in self.events.drain(..) {
            let _ = self.vmm.event_destroy(e);
        }
        for (p, size) in self.mapped.drain(..) {
            let _ = self.vmm.unmap(p, size);
        }
        for h in self.created.drain(..) {
            let _ = self.vmm.release(h);
        }
        for (p, size) in self.reserved.drain(..) {
            let _ = self.vmm.address_free(p, size);
        }
    }
}

/// Runs the benchmark on `vmm`; `description` names the machine in the report.
/// On a failing call, whatever was made is given back and the error returned.
pub fn measure(vmm: &dyn Vmm, description: &str, config: &LatencyConfig) -> Result<LatencyReport> {
    let mut run = Run {
        vmm,
        rows: Vec::new(),
        reserved: Vec::new(),
        created: Vec::new(),
        mapped: Vec::new(),
        events: Vec::new(),
    };
    let result = measure_in(&mut run, config);
    run.clean_up();
    result?;
    Ok(LatencyReport {
        backend: vmm.backend_name().to_owned(),
        description: description.to_owned(),
        granularity: vmm.granularity(),
        config: *config,
        rows: run.rows,
    })
}

fn measure_in(run: &mut Run<'_>, config: &LatencyConfig) -> Result<()> {
    let batch = config.batch.max(1);
    for _ in 0..config.warmup {
        run.page_batch(1, config.page_size, false)?;
    }
    let mut left = config.iters;
    while left > 0 {
        let n = left.min(batch);
        run.page_batch(n, config.page_size, true)?;
        left -= n;
    }
    if config.large_iters > 0 {
        let size = config.large_size;
        let va = run.vmm.reserve(size, 0)?;
        run.reserved.push((va, size));
        for _ in 0..config.warmup {
            run.large_cycle(va, size, false)?;
        }
        for _ in 0..config.large_iters {
            run.large_cycle(va, size, true)?;
        }
        run.vmm.address_free(va, size)?;
        run.reserved.clear();
    }
    for _ in 0..config.warmup {
        run.stream_round(false)?;
    }
    for _ in 0..config.iters {
        run.stream_round(true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_vmm::sim::{Fault, SimVmm};

    fn small() -> LatencyConfig {
        LatencyConfig {
            iters: 30,
            batch: 8,
            page_size: 2 << 20,
            large_iters: 4,
            large_size: 8 << 20,
            warmup: 2,
        }
    }

    #[test]
    fn every_call_gets_its_samples_and_nothing_is_left() {
        let vmm = SimVmm::with_capacity(1 << 30).unwrap();
        let report = measure(&vmm, "test", &small()).unwrap();
        let page = 2 << 20;
        for call in PAGE_LIFECYCLE {
            assert_eq!(
                report.row(call, page).unwrap().samples_ns.len(),
                30,
                "{call}"
            );
        }
        for call in [CallKind::Create, CallKind::Map, CallKind::Release] {
            assert_eq!(report.row(call, 8 << 20).unwrap().samples_ns.len(), 4);
        }
        assert!(report.row(CallKind::Reserve, 8 << 20).is_none());
        for call in STREAM_CALLS {
            assert_eq!(report.row(call, 0).unwrap().samples_ns.len(), 30, "{call}");
        }
        assert!(vmm.leak_report().is_empty(), "{}", vmm.leak_report());
        let md = report.to_markdown();
        assert!(
            md.contains("| call | size | calls | median µs | p99 µs |"),
            "{md}"
        );
        assert!(md.contains("| `cuMemCreate` | 8 MiB | 4 |"), "{md}");
        assert!(md.contains("| `cuStreamIsCapturing` | - | 30 |"), "{md}");
        assert_eq!(md.lines().filter(|l| l.starts_with("| `")).count(), 17);
    }

    #[test]
    fn a_failing_call_cleans_up_and_returns_the_error() {
        let vmm = SimVmm::with_capacity(1 << 30).unwrap();
        vmm.inject(Fault::nth(CallKind::SetAccess, 10));
        assert!(measure(&vmm, "test", &small()).is_err());
        assert!(vmm.leak_report().is_empty(), "{}", vmm.leak_report());
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let row = LatencyRow {
            call: CallKind::Map,
            size: 1,
            samples_ns: (1..=100).rev().map(|i| i * 1000).collect(),
        };
        assert_eq!(row.median_us(), 50.0);
        assert_eq!(row.p99_us(), 99.0);
        assert_eq!(row.max_us(), 100.0);
        assert_eq!(row.mean_us(), 50.5);
        assert_eq!(row.quantile_us(0.0), 1.0);
    }
}
