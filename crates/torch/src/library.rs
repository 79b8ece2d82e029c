//! The library's state behind the C functions, in safe Rust: the
//! configuration (read once), one Quilt allocator per device (created on
//! first use), memory fractions, the history, tags and their sleep and
//! wake. Every function returns a
//! `Result` whose error is the message `quilt_last_error` gives back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, SleepMode, SleepPages};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, DevicePtr, StreamId, Vmm};

use crate::conf::{self, Backend, LibraryConf};
use crate::device_stats::{self, Accumulated, QuiltDeviceStats};
use crate::history::History;
use crate::listing::{self, QuiltBlock, QuiltSegment, QuiltTraceEntry};
use crate::private_pools::{CheckpointBlock, Freed, PoolId, PrivatePools, Restored};
use crate::pytorch_snapshot::{self as snapshot, DeviceMemory};

/// The driver's map and unmap count of `alloc`: the mapped memory changes
/// only when it moves ([`History::sync_segments`]).
fn map_mark(alloc: &QuiltAllocator) -> u64 {
    let d = alloc.stats().driver;
    d.count(CallKind::Map) + d.count(CallKind::Unmap)
}

/// One device: its driver backend and its allocator.
pub struct Device {
    index: i32,
    /// The CUDA backend, to adopt the caller's streams (`None` on host and sim).
    cuda: Option<Arc<CudaVmm>>,
    alloc: QuiltAllocator,
    /// The most segments a statistics call or a snapshot has shown.
    segment_peak: AtomicU64,
    /// torch's private pools (CUDA graphs, `MemPool`) on this device.
    pools: Mutex<PrivatePools>,
    /// Requests larger than Quilt could ever map (torch counts them as out
    /// of memory; Quilt refuses them as invalid sizes).
    too_large: AtomicU64,
    /// The accumulated figures at torch's last `resetAccumulatedStats`.
    accumulated_base: Mutex<Accumulated>,
}

impl Device {
    /// The memory a snapshot shows, and its segment count (current, peak).
    fn memory(&self) -> (DeviceMemory, u64, u64) {
        let memory = DeviceMemory::of(self.index, &self.alloc);
        let count = snapshot::segment_count(&memory);
        let peak = self
            .segment_peak
            .fetch_max(count, Ordering::Relaxed)
            .max(count);
        (memory, count, peak)
    }
}

impl Device {
    /// The caller's stream as a `StreamId` of this device's backend.
    fn stream(&self, raw: u64) -> StreamId {
        match &self.cuda {
            Some(c) => c.adopt_stream(raw),
            None => StreamId(raw),
        }
    }
}

/// Why [`Library::torch_malloc`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MallocFailure {
    /// An out of memory (torch raises `OutOfMemoryError`): the device could
    /// not back it, or it is larger than Quilt could ever map.
    pub out_of_memory: bool,
    /// Quilt's message (for an out of memory: the report and its verdict).
    pub message: String,
}

impl MallocFailure {
    fn other(message: String) -> MallocFailure {
        MallocFailure {
            out_of_memory: false,
            message,
        }
    }
}

/// The bytes Quilt may hold on `d` (its limit) and what of them it does not
/// hold now: the device's total and free memory in torch's out-of-memory
/// message and observers.
fn device_memory(d: &Device) -> (u64, u64) {
    let p = d.alloc.pool_stats();
    let total = p.limit_pages * p.page_size;
    let reserved = d.alloc.stats().reserved_bytes.current;
    (total, total.saturating_sub(reserved))
}

/// The library: see the module documentation.
pub struct Library {
    conf_text: String,
    conf: Result<LibraryConf, String>,
    devices: Mutex<BTreeMap<i32, Arc<Device>>>,
    /// Memory fractions set for devices not created yet.
    fractions: Mutex<BTreeMap<i32, f64>>,
    history: History,
}

static LIBRARY: OnceLock<Library> = OnceLock::new();

/// The library of this process, configured from `QUILT_ALLOC_CONF` at the
/// first call.
pub fn library() -> &'static Library {
    LIBRARY.get_or_init(|| Library::new(&std::env::var("QUILT_ALLOC_CONF").unwrap_or_default()))
}

/// `quilt_sleep`'s flag: drop the contents instead of copying them to host
/// memory ([`SleepMode::Discard`]).
pub const SLEEP_DISCARD: i32 = 1;
/// `quilt_sleep`'s flag: release the pages to the device (`cuMemRelease`)
/// instead of keeping them in Quilt's pool ([`SleepPages::ReleaseToDevice`]).
pub const SLEEP_RELEASE: i32 = 2;

/// What `quilt_sleep`'s `flags` ask for: 0 (offload, pages kept in the
/// pool), or [`SLEEP_DISCARD`] and [`SLEEP_RELEASE`] combined; any other bit
/// is an error.
pub fn sleep_options(flags: i32) -> Result<(SleepMode, SleepPages), String> {
    if flags & !(SLEEP_DISCARD | SLEEP_RELEASE) != 0 {
        return Err(format!(
            "quilt_sleep: flags {flags:#x}: only QUILT_SLEEP_DISCARD (1) and QUILT_SLEEP_RELEASE (2) exist"
        ));
    }
    let mode = if flags & SLEEP_DISCARD != 0 {
        SleepMode::Discard
    } else {
        SleepMode::Offload
    };
    let pages = if flags & SLEEP_RELEASE != 0 {
        SleepPages::ReleaseToDevice
    } else {
        SleepPages::KeepInPool
    };
    Ok((mode, pages))
}

/// A tag as the C functions accept it: not empty (`quilt_clear_tag` is how
/// allocations stop carrying one).
pub fn check_tag(tag: &str) -> Result<(), String> {
    if tag.is_empty() {
        return Err("the tag is empty (quilt_clear_tag ends tagging)".into());
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Library {
    /// A library configured by `conf_text` (`QUILT_ALLOC_CONF`'s grammar).
    pub fn new(conf_text: &str) -> Library {
        Library {
            conf_text: conf_text.to_string(),
            conf: conf::parse(conf_text),
            devices: Mutex::new(BTreeMap::new()),
            fractions: Mutex::new(BTreeMap::new()),
            history: History::default(),
        }
    }

    fn conf(&self) -> Result<&LibraryConf, String> {
        self.conf
            .as_ref()
            .map_err(|e| format!("{e}; Quilt refuses to allocate until it is fixed"))
    }

    /// The device `index`, created on first use.
    fn device(&self, index: i32) -> Result<Arc<Device>, String> {
        let conf = self.conf()?;
        if index < 0 {
            return Err(format!("device {index} is not a device index"));
        }
        let mut devices = lock(&self.devices);
        if let Some(d) = devices.get(&index) {
            return Ok(d.clone());
        }
        let (vmm, cuda): (Arc<dyn Vmm>, Option<Arc<CudaVmm>>) =
            match conf.backend {
                Backend::Cuda => {
                    let c = Arc::new(CudaVmm::new(index as usize).map_err(|e| {
                        format!("device {index}: the CUDA backend is unavailable: {e}")
                    })?);
                    (c.clone(), Some(c))
                }
                Backend::Host => (
                    Arc::new(
                        HostVmm::new(HostConfig {
                            capacity: conf.capacity,
                            ..HostConfig::default()
                        })
                        .map_err(|e| format!("device {index}: the host backend failed: {e}"))?,
                    ),
                    None,
                ),
                Backend::Sim => (
                    Arc::new(SimVmm::with_capacity(conf.capacity).map_err(|e| {
                        format!("device {index}: the simulated backend failed: {e}")
                    })?),
                    None,
                ),
            };
        // `QUILT_ALLOC_CONF`'s `memory_fraction` or `memory_limit` is in
        // `conf.quilt`; a fraction set for this device before it existed
        // replaces it (as `set_memory_fraction` does afterwards).
        let mut config = conf.quilt;
        if let Some(&f) = lock(&self.fractions).get(&index) {
            config = config.with_limit(MemoryLimit::Fraction(f));
        }
        let alloc = QuiltAllocator::new(vmm, config)
            .map_err(|e| format!("device {index}: cannot build the allocator: {e}"))?;
        let d = Arc::new(Device {
            index,
            cuda,
            alloc,
            segment_peak: AtomicU64::new(0),
            pools: Mutex::new(PrivatePools::default()),
            too_large: AtomicU64::new(0),
            accumulated_base: Mutex::new(Accumulated::default()),
        });
        devices.insert(index, d.clone());
        Ok(d)
    }

    fn existing(&self) -> Vec<Arc<Device>> {
        lock(&self.devices).values().cloned().collect()
    }

    /// `quilt_malloc`: a block of `size` bytes on `device`, ordered on `stream`.
    pub fn malloc(&self, size: u64, device: i32, stream: u64) -> Result<DevicePtr, String> {
        self.malloc_tagged(size, device, stream, None)
    }

    /// `quilt_malloc` under a tag (`quilt_set_tag`): with `Some(tag)` the
    /// block is a member of `tag` on its device
    /// ([`QuiltAllocator::allocate_tagged`]: an arena of the tag's own), so
    /// that [`Library::sleep`] and [`Library::wake`] take it along.
    pub fn malloc_tagged(
        &self,
        size: u64,
        device: i32,
        stream: u64,
        tag: Option<&str>,
    ) -> Result<DevicePtr, String> {
        self.torch_malloc(size, device, stream, tag, None)
            .map(|(ptr, _)| ptr)
            .map_err(|f| f.message)
    }

    /// The allocation of torch's allocator class: as
    /// [`Library::malloc_tagged`], into the private pool `pool` when given
    /// (a free block of the pool on the same stream if one fits, else a new
    /// one from Quilt that the pool owns). Returns the pointer and the
    /// sequence number of its `alloc` history entry (0 when history is off).
    /// A request larger than Quilt could ever map is an out of memory here,
    /// as in torch.
    pub fn torch_malloc(
        &self,
        size: u64,
        device: i32,
        stream: u64,
        tag: Option<&str>,
        pool: Option<PoolId>,
    ) -> Result<(DevicePtr, u64), MallocFailure> {
        if let Some(t) = tag {
            check_tag(t).map_err(MallocFailure::other)?;
        }
        let d = self.device(device).map_err(MallocFailure::other)?;
        let s = d.stream(stream);
        let mut pools = pool.map(|_| lock(&d.pools));
        if let (Some(id), Some(p)) = (pool, pools.as_mut()) {
            if let Some(ptr) = p.take(id, size, stream).map_err(MallocFailure::other)? {
                let seq = self
                    .history
                    .record(device, "alloc", ptr, size, stream, "quilt_malloc");
                return Ok((ptr, seq));
            }
        }
        let made = match tag {
            Some(t) => d.alloc.allocate_tagged(size, s, t),
            None => d.alloc.allocate(size, s),
        };
        self.sync_segments(&d, "quilt_malloc");
        match made {
            Ok(a) => {
                if let (Some(id), Some(p)) = (pool, pools.as_mut()) {
                    if let Err(e) = p.adopt(id, a.ptr, size, stream) {
                        let _ = d.alloc.free(a.ptr);
                        return Err(MallocFailure::other(e));
                    }
                }
                let seq = self
                    .history
                    .record(device, "alloc", a.ptr, size, stream, "quilt_malloc");
                Ok((a.ptr, seq))
            }
            Err(e) => {
                let out_of_memory = match &e {
                    AllocError::OutOfMemory(r) => {
                        self.history.record(
                            device,
                            "oom",
                            r.device_free,
                            size,
                            stream,
                            "quilt_malloc",
                        );
                        true
                    }
                    AllocError::InvalidSize { size: n, .. } if *n > quilt_alloc::MAX_ALLOCATION => {
                        d.too_large.fetch_add(1, Ordering::Relaxed);
                        let (_, free) = device_memory(&d);
                        self.history
                            .record(device, "oom", free, size, stream, "quilt_malloc");
                        true
                    }
                    _ => false,
                };
                Err(MallocFailure {
                    out_of_memory,
                    message: e.to_string(),
                })
            }
        }
    }

    /// `quilt_free`: give back the block at `ptr` of `device`.
    pub fn free(&self, ptr: DevicePtr, size: u64, device: i32, stream: u64) -> Result<(), String> {
        self.torch_free(ptr, size, device, stream).map(|_| ())
    }

    /// `quilt_free` and torch's allocator class's free: a block of a used
    /// private pool stays the pool's (free, for the pool's later
    /// allocations); any other goes back to Quilt. Returns the sequence
    /// number of its `free_requested` history entry (0 when history is off)
    /// and whether a pool kept it.
    pub fn torch_free(
        &self,
        ptr: DevicePtr,
        size: u64,
        device: i32,
        stream: u64,
    ) -> Result<(u64, bool), String> {
        if ptr == 0 {
            return Err("free of a null pointer".into());
        }
        let existing = lock(&self.devices).get(&device).cloned();
        let Some(d) = existing else {
            self.conf()?;
            return Err(format!(
                "free of {ptr:#x} on device {device}, which has allocated nothing"
            ));
        };
        let mut pools = lock(&d.pools);
        let freed = pools.free(ptr)?;
        if freed != Freed::KeptByPool {
            d.alloc.free(ptr).map_err(|e| e.to_string())?;
        }
        drop(pools);
        let seq = self
            .history
            .record(device, "free_requested", ptr, size, stream, "quilt_free");
        self.history
            .record(device, "free_completed", ptr, size, stream, "quilt_free");
        self.sync_segments(&d, "quilt_free");
        Ok((seq, freed == Freed::KeptByPool))
    }

    /// torch's `createOrIncrefPool` (and `beginAllocateToPool`, which uses
    /// the pool once more): see [`PrivatePools::create_or_incref`].
    pub fn pool_create_or_incref(&self, device: i32, id: PoolId) -> Result<(), String> {
        let d = self.device(device)?;
        lock(&d.pools).create_or_incref(id);
        Ok(())
    }

    /// torch's `releasePool`: one use fewer; at none, the pool's free
    /// blocks go back to Quilt ([`PrivatePools::release`]).
    pub fn pool_release(&self, device: i32, id: PoolId) -> Result<(), String> {
        let d = self.device(device)?;
        let back = lock(&d.pools).release(id)?;
        let mut errors = Vec::new();
        for ptr in back {
            if let Err(e) = d.alloc.free(ptr) {
                errors.push(format!("{ptr:#x}: {e}"));
            }
        }
        self.sync_segments(&d, "quilt_pool_release");
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "releasePool of {id:?} on device {device}: {}",
                errors.join("; ")
            ))
        }
    }

    /// torch's `getPoolUseCount`.
    pub fn pool_use_count(&self, device: i32, id: PoolId) -> Result<u32, String> {
        let d = self.device(device)?;
        let n = lock(&d.pools).use_count(id);
        Ok(n)
    }

    /// torch's `getCheckpointState`: pool `id`'s blocks and which are
    /// handed out ([`PrivatePools::checkpoint`]).
    pub fn pool_checkpoint(&self, device: i32, id: PoolId) -> Result<Vec<CheckpointBlock>, String> {
        let d = self.device(device)?;
        let state = lock(&d.pools).checkpoint(id);
        state
    }

    /// torch's `setCheckpointPoolState` ([`PrivatePools::restore`]), when
    /// the blocks it frees are at most `room` (the caller's array):
    /// `Ok(Err(n))` says that `n` would be, with nothing changed. The
    /// history shows each block freed and handed out again.
    pub fn pool_restore(
        &self,
        device: i32,
        id: PoolId,
        state: &[CheckpointBlock],
        room: usize,
    ) -> Result<Result<Restored, usize>, String> {
        let d = self.device(device)?;
        let mut pools = lock(&d.pools);
        let live = pools.live_blocks(id)?.len();
        if live > room {
            return Ok(Err(live));
        }
        let r = pools.restore(id, state)?;
        drop(pools);
        for b in &r.freed {
            for action in ["free_requested", "free_completed"] {
                self.history.record(
                    device,
                    action,
                    b.ptr,
                    b.size,
                    b.stream,
                    "quilt_pool_restore",
                );
            }
        }
        for b in &r.allocated {
            self.history.record(
                device,
                "alloc",
                b.ptr,
                b.requested,
                b.stream,
                "quilt_pool_restore",
            );
        }
        Ok(Ok(r))
    }

    /// torch's `checkPoolLiveAllocations`: the blocks of pool `id` handed
    /// out now ([`PrivatePools::live_blocks`]).
    pub fn pool_live_blocks(&self, device: i32, id: PoolId) -> Result<Vec<u64>, String> {
        let d = self.device(device)?;
        let live = lock(&d.pools).live_blocks(id);
        live
    }

    /// torch's `getDeviceStats`: Quilt's figures in torch's terms
    /// ([`device_stats::torch_stats`]).
    pub fn device_stats(&self, device: i32) -> Result<QuiltDeviceStats, String> {
        let d = self.device(device)?;
        let (_, segments, segment_peak) = d.memory();
        let raw = d.alloc.stats();
        let pools = lock(&d.pools).figures();
        let (total, free) = device_memory(&d);
        let base = *lock(&d.accumulated_base);
        Ok(device_stats::torch_stats(
            &raw,
            &pools,
            (segments, segment_peak),
            (total, free),
            d.too_large.load(Ordering::Relaxed),
            &base,
        ))
    }

    /// torch's `resetAccumulatedStats`: the totals (allocated, freed, out
    /// of memory, retries, driver allocations) count from now.
    pub fn reset_accumulated_stats(&self, device: i32) -> Result<(), String> {
        let d = self.device(device)?;
        let raw = d.alloc.stats();
        let pools = lock(&d.pools).figures();
        *lock(&d.accumulated_base) =
            device_stats::accumulated(&raw, &pools, d.too_large.load(Ordering::Relaxed));
        Ok(())
    }

    /// The memory fraction of `device` (the last set, else
    /// `QUILT_ALLOC_CONF`'s `memory_fraction`, else 1).
    pub fn memory_fraction(&self, device: i32) -> Result<f64, String> {
        let conf = self.conf()?;
        if let Some(&f) = lock(&self.fractions).get(&device) {
            return Ok(f);
        }
        Ok(match conf.quilt.pool.limit {
            MemoryLimit::Fraction(f) => f,
            _ => 1.0,
        })
    }

    /// The segments and blocks of `device` (every device created so far
    /// when `None`) as a snapshot shows them ([`listing::segments`]; the
    /// free blocks private pools keep are `inactive`).
    pub fn segments(
        &self,
        device: Option<i32>,
    ) -> Result<(Vec<QuiltSegment>, Vec<QuiltBlock>), String> {
        self.conf()?;
        let mut segs = Vec::new();
        let mut blocks = Vec::new();
        for d in self.existing() {
            if device.is_some_and(|i| i != d.index) {
                continue;
            }
            self.sync_segments(&d, "quilt_segments");
            let (memory, _, _) = d.memory();
            let pools = lock(&d.pools);
            listing::segments(&memory, &pools, &mut segs, &mut blocks);
        }
        Ok((segs, blocks))
    }

    /// The history entries after sequence number `seq`, in recording order.
    /// From 0 (a snapshot's whole history), as PyTorch's viewer must read
    /// them against the segments shown now
    /// ([`snapshot::viewer_replay::for_viewer`]).
    pub fn history_since(&self, seq: u64) -> Vec<QuiltTraceEntry> {
        if seq == 0 {
            return self.history_for_viewer();
        }
        self.history
            .entries_since(seq)
            .iter()
            .map(|(d, t)| listing::trace_entry(*d, t))
            .collect()
    }

    /// The whole history, rewritten for PyTorch's viewer from the segments
    /// and live blocks of every device now, in recording order.
    fn history_for_viewer(&self) -> Vec<QuiltTraceEntry> {
        let mut starts = BTreeMap::new();
        for d in self.existing() {
            self.sync_segments(&d, "quilt_segments");
            let (memory, _, _) = d.memory();
            let pools = lock(&d.pools);
            starts.insert(
                d.index,
                snapshot::viewer_start(&memory, |a| pools.is_kept_free(a)),
            );
        }
        let traces = snapshot::viewer_replay::for_viewer(&self.history.entries(), &starts);
        let mut all: Vec<(i32, &crate::history::TraceEntry)> = traces
            .iter()
            .flat_map(|(&d, es)| es.iter().map(move |t| (d, t)))
            .collect();
        // Stable: a map's parts and the entries written beside them keep
        // their place.
        all.sort_by_key(|(_, t)| t.seq);
        all.iter()
            .map(|(d, t)| listing::trace_entry(*d, t))
            .collect()
    }

    /// Forget the history recorded so far (torch's `clearHistory`).
    pub fn clear_history(&self) {
        self.history.clear();
    }

    /// Record in the history how `d`'s mapped memory changed, if it did.
    fn sync_segments(&self, d: &Device, source: &'static str) {
        if self.history.is_on() {
            self.history.sync_segments(
                d.index,
                map_mark(&d.alloc),
                || snapshot::runs_of(&d.alloc),
                source,
            );
        }
    }

    /// `quilt_empty_cache`: every device's cached pages go back to the driver.
    pub fn empty_cache(&self) -> Result<(), String> {
        let errors: Vec<String> = self
            .existing()
            .iter()
            .filter_map(|d| {
                let done = d.alloc.empty_cache();
                self.sync_segments(d, "quilt_empty_cache");
                done.err().map(|e| format!("device {}: {e}", d.index))
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// `quilt_forget_stream`: forgets `stream` on every device created so far: its pending work is
    /// waited for once, its cached memory becomes plain free memory, and its
    /// handle is never passed to the driver again (call it before the
    /// stream is destroyed). The default streams (`NULL`, `0x1`) cannot be
    /// forgotten; `0x2` is the calling thread's per-thread stream.
    pub fn forget_stream(&self, stream: u64) -> Result<(), String> {
        if stream == 0 || stream == 0x1 {
            return Err(format!(
                "forget_stream of {stream:#x}: the legacy default stream cannot be forgotten"
            ));
        }
        for d in self.existing() {
            d.alloc
                .forget_stream(d.stream(stream))
                .map_err(|e| format!("forget_stream of {stream:#x} on device {}: {e}", d.index))?;
        }
        Ok(())
    }

    /// `quilt_record_stream`: the block at `ptr` is used on `stream` too.
    pub fn record_stream(&self, ptr: DevicePtr, stream: u64) -> Result<(), String> {
        if ptr == 0 {
            return Err("record_stream of a null pointer".into());
        }
        for d in self.existing() {
            match d.alloc.record_stream(ptr, d.stream(stream)) {
                Ok(()) => return Ok(()),
                Err(AllocError::UnknownPointer { .. }) => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!(
            "record_stream of {ptr:#x}, which no device allocated"
        ))
    }

    /// `quilt_set_memory_fraction`: the share of `device` Quilt may hold.
    pub fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), String> {
        self.conf()?;
        let f = conf::check_fraction(fraction)?;
        if device < 0 {
            return Err(format!("device {device} is not a device index"));
        }
        let existing = lock(&self.devices).get(&device).cloned();
        match existing {
            Some(d) => {
                let done = d.alloc.set_memory_limit(MemoryLimit::Fraction(f));
                self.sync_segments(&d, "quilt_set_memory_fraction");
                if done.is_ok() {
                    lock(&self.fractions).insert(device, f);
                }
                done.map(|_| ())
                    .map_err(|e| format!("device {device}: {e}"))
            }
            None => {
                lock(&self.fractions).insert(device, f);
                Ok(())
            }
        }
    }

    /// `quilt_reset_peak_stats`: every peak of `device`'s statistics set to
    /// its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self, device: i32) -> Result<(), String> {
        let d = self.device(device)?;
        d.alloc.reset_peak_stats().map_err(|e| e.to_string())?;
        let (_, segments, _) = d.memory();
        d.segment_peak.store(segments, Ordering::Relaxed);
        Ok(())
    }

    /// `quilt_stats_json`: the statistics of `device`, as JSON text.
    pub fn stats_json(&self, device: i32) -> Result<String, String> {
        let conf = self.conf()?;
        let d = self.device(device)?;
        let (_, segments, segment_peak) = d.memory();
        let s = d.alloc.stats();
        let stat = |x: &quilt_alloc::Stat| {
            serde_json::json!({
                "current": x.current, "peak": x.peak, "allocated": x.allocated, "freed": x.freed
            })
        };
        let calls: serde_json::Map<String, serde_json::Value> = [
            ("reserve", CallKind::Reserve),
            ("create", CallKind::Create),
            ("map", CallKind::Map),
            ("set_access", CallKind::SetAccess),
            ("unmap", CallKind::Unmap),
            ("release", CallKind::Release),
            ("address_free", CallKind::AddressFree),
            ("synchronize", CallKind::StreamSynchronize),
            ("wait_event", CallKind::StreamWaitEvent),
            ("event_record", CallKind::EventRecord),
            ("event_query", CallKind::EventQuery),
            ("event_destroy", CallKind::EventDestroy),
            ("is_capturing", CallKind::StreamIsCapturing),
        ]
        .into_iter()
        .map(|(k, c)| (k.to_string(), serde_json::json!(s.driver.count(c))))
        .collect();
        let page = d.alloc.pool_stats().page_size;
        let v = serde_json::json!({
            "device": device,
            "allocator": d.alloc.name(),
            "backend": conf.backend.name(),
            "capacity_bytes": d.alloc.pool_stats().limit_pages * page,
            "page_size": page,
            "allocated_bytes": stat(&s.allocated_bytes),
            "reserved_bytes": stat(&s.reserved_bytes),
            "active_bytes": stat(&s.active_bytes),
            "requested_bytes": stat(&s.requested_bytes),
            "inactive_split_bytes": stat(&s.inactive_split_bytes),
            "allocation": stat(&s.allocation),
            // The segments a snapshot shows (runs of mapped memory, and the
            // pool's pages mapped nowhere; the peak is the most a statistics
            // call or a snapshot saw); Quilt's physical chunks are
            // `physical_chunk`.
            "segment": { "current": segments, "peak": segment_peak },
            "physical_chunk": stat(&s.segment),
            "active": stat(&s.active),
            "inactive_split": stat(&s.inactive_split),
            "num_alloc_retries": s.num_alloc_retries,
            "num_ooms": s.num_ooms,
            "num_stream_waits": s.num_stream_waits,
            "cached_bytes": d.alloc.cached_bytes(),
            "driver_calls": calls,
        });
        Ok(v.to_string())
    }

    /// The devices whose allocator knows `tag`, with whether it sleeps there.
    fn tag_devices(&self, tag: &str) -> Result<Vec<(Arc<Device>, bool)>, String> {
        self.conf()?;
        check_tag(tag)?;
        let mut out = Vec::new();
        for d in self.existing() {
            match d.alloc.is_asleep(tag) {
                Ok(asleep) => out.push((d, asleep)),
                Err(AllocError::TagState { .. }) => {} // unknown on this device
                Err(e) => return Err(format!("device {}: {e}", d.index)),
            }
        }
        if out.is_empty() {
            return Err(format!(
                "tag {tag:?}: unknown tag: no allocation carried it (allocate under quilt_set_tag first)"
            ));
        }
        Ok(out)
    }

    /// `quilt_sleep`: put `tag` to sleep on every device where it is awake
    /// ([`QuiltAllocator::sleep_with`]: contents to host memory or dropped,
    /// pages unmapped and kept in the pool or released to the device,
    /// addresses kept). An error when no device knows the tag, or when it
    /// sleeps on every device that does. A failure on one device leaves the
    /// devices done before it asleep: calling again sleeps the rest.
    pub fn sleep(&self, tag: &str, mode: SleepMode, pages: SleepPages) -> Result<(), String> {
        let devices = self.tag_devices(tag)?;
        if devices.iter().all(|(_, asleep)| *asleep) {
            return Err(format!("tag {tag:?}: the tag is already asleep"));
        }
        for (d, asleep) in devices {
            if !asleep {
                let done = d.alloc.sleep_with(tag, mode, pages);
                self.sync_segments(&d, "quilt_sleep");
                done.map_err(|e| format!("device {}: {e}", d.index))?;
            }
        }
        Ok(())
    }

    /// `quilt_wake`: wake `tag` on every device where it sleeps (same
    /// addresses, contents copied back when it was offloaded). An error when
    /// no device knows the tag or it sleeps nowhere. A failure on one device
    /// (out of memory: the tag stays asleep there, its host copy intact)
    /// leaves the devices woken before it awake: calling again wakes the rest.
    pub fn wake(&self, tag: &str) -> Result<(), String> {
        let devices = self.tag_devices(tag)?;
        if devices.iter().all(|(_, asleep)| !*asleep) {
            return Err(format!("tag {tag:?}: the tag is awake"));
        }
        for (d, asleep) in devices {
            if asleep {
                let done = d.alloc.wake(tag);
                self.sync_segments(&d, "quilt_wake");
                done.map_err(|e| format!("device {}: {e}", d.index))?;
            }
        }
        Ok(())
    }

    /// `quilt_is_asleep`: whether `tag` sleeps on some device (an error when
    /// no device knows it).
    pub fn is_asleep(&self, tag: &str) -> Result<bool, String> {
        Ok(self.tag_devices(tag)?.iter().any(|(_, asleep)| *asleep))
    }

    /// `quilt_record_history`.
    /// Starting takes every device's mapped memory as the history's
    /// baseline: the segment events that follow say how it changes.
    pub fn record_history(&self, enabled: bool, max_entries: usize) {
        self.history.set(enabled, max_entries);
        if enabled {
            for d in self.existing() {
                self.history
                    .baseline(d.index, map_mark(&d.alloc), snapshot::runs_of(&d.alloc));
            }
        }
    }

    /// The snapshot of every device, as a pickle (PyTorch's layout).
    pub fn snapshot_pickle(&self) -> Result<Vec<u8>, String> {
        self.conf()?;
        let existing = self.existing();
        for d in &existing {
            // The history ends where the snapshot is: PyTorch's viewer
            // replays it backwards from the segments.
            self.sync_segments(d, "quilt_dump_snapshot");
        }
        let devices: Vec<DeviceMemory> = existing.iter().map(|d| d.memory().0).collect();
        let value = snapshot::snapshot(&devices, &self.history.entries(), &self.conf_text);
        serde_pickle::value_to_vec(&value, serde_pickle::SerOptions::new())
            .map_err(|e| format!("encoding the snapshot: {e}"))
    }

    /// `quilt_dump_snapshot`: the snapshot, written to `path`.
    pub fn dump_snapshot(&self, path: &str) -> Result<(), String> {
        let bytes = self.snapshot_pickle()?;
        std::fs::write(path, bytes).map_err(|e| format!("writing the snapshot to {path}: {e}"))
    }
}
