//! The library's state behind the C functions, in safe Rust: the
//! configuration (read once), one Quilt allocator per device (created on
//! first use), memory fractions, the history, tags and their sleep and
//! wake. Every function returns a
//! `Result` whose error is the message `quilt_last_error` gives back.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use quilt_alloc::baselines::{RoundupPower2Divisions, ROUNDUP_INTERVALS};
use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, SleepMode, SleepPages};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_pool::PoolError;
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, DevicePtr, StreamId, Vmm};

use crate::conf::{self, Backend, LibraryConf};
use crate::device_stats::{self, Accumulated, QuiltDeviceStats};
use crate::history::History;
use crate::listing::{self, QuiltBlock, QuiltSegment, QuiltTraceEntry};
use crate::private_pools::{
    self, CheckpointBlock, Freed, PoolBlock, PoolFigures, PoolId, PrivatePools, Restored,
};
use crate::pytorch_snapshot::{self as snapshot, DeviceMemory};

/// The most devices the library serves: indices 0 to `MAX_DEVICES - 1`.
pub const MAX_DEVICES: usize = 256;

/// Limit `d`'s memory to the fraction `f` of its device, as torch's
/// `set_per_process_memory_fraction` does: any fraction from 0 to 1 is
/// taken. Where live blocks hold more than it allows (after the cache is
/// given back), the limit becomes what the pool holds now: nothing more
/// is mapped, as torch maps no new segment past the fraction, and the
/// fraction takes hold further at each `empty_cache` as memory is freed.
fn apply_fraction(d: &Device, f: f64) -> Result<(), AllocError> {
    match d.alloc.set_memory_limit(MemoryLimit::Fraction(f)) {
        Err(AllocError::Pool(e)) if matches!(*e, PoolError::LimitBelowHeld { .. }) => {
            let held = d.alloc.pool_stats().held_bytes;
            d.alloc
                .set_memory_limit(MemoryLimit::Bytes(held))
                .map(|_| ())
        }
        other => other.map(|_| ()),
    }
}

/// The driver's map and unmap count of `alloc`: the mapped memory changes
/// only when it moves ([`History::sync_segments`]).
fn map_mark(alloc: &QuiltAllocator) -> u64 {
    let d = alloc.vmm().driver_stats();
    d.count(CallKind::Map) + d.count(CallKind::Unmap)
}

/// The driver calls that can change the segments a snapshot shows (maps,
/// unmaps, reservations and their frees: every change of a page's mapping
/// or of an arena is one), counted: while it stands, so do the segments.
fn segments_mark(alloc: &QuiltAllocator) -> u64 {
    let d = alloc.vmm().driver_stats();
    [
        CallKind::Map,
        CallKind::Unmap,
        CallKind::Reserve,
        CallKind::AddressFree,
    ]
    .iter()
    .map(|&k| d.count(k))
    .sum()
}

/// The segments of a device's mapped memory, as last counted
/// ([`Device::segment_count`]).
#[derive(Clone, Debug, Default)]
struct MappedRuns {
    /// The [`segments_mark`] the runs were found at (`None`: never).
    mark: Option<u64>,
    /// The runs of mapped memory (the joined GPU segments): address, bytes.
    runs: Vec<(u64, u64)>,
    /// Their bytes.
    bytes: u64,
    /// The pools' [`PrivatePools::segments_generation`] `listed` was
    /// counted at, with the runs of `mark`.
    generation: Option<u64>,
    /// The segments a listing shows over the runs (the pools' segments cut
    /// out of them, [`PrivatePools::listed_segments_in`]).
    listed: u64,
}

/// One device: its driver backend and its allocator.
pub struct Device {
    index: i32,
    /// The CUDA backend, to adopt the caller's streams (`None` on host and sim).
    cuda: Option<Arc<CudaVmm>>,
    alloc: QuiltAllocator,
    /// The most segments a statistics call or a snapshot has shown.
    segment_peak: AtomicU64,
    /// The segments of the mapped memory, counted again only when the
    /// mapping changed.
    mapped_runs: Mutex<MappedRuns>,
    /// torch's private pools (CUDA graphs, `MemPool`) on this device; only
    /// through [`Device::pools`].
    pools: Mutex<PrivatePools>,
    /// Whether `pools` holds a pool or a block: an allocation or a free
    /// outside a pool asks the pools nothing (takes no lock) while none does.
    pools_in_use: AtomicBool,
    /// Requests larger than Quilt could ever map (torch counts them as out
    /// of memory; Quilt refuses them as invalid sizes).
    too_large: AtomicU64,
    /// The accumulated figures at torch's last `resetAccumulatedStats`.
    accumulated_base: Mutex<Accumulated>,
}

/// The pools of a device, locked; dropping it updates
/// [`Device::pools_in_use`].
struct PoolsGuard<'a> {
    pools: MutexGuard<'a, PrivatePools>,
    in_use: &'a AtomicBool,
}

impl Deref for PoolsGuard<'_> {
    type Target = PrivatePools;
    fn deref(&self) -> &PrivatePools {
        &self.pools
    }
}

impl DerefMut for PoolsGuard<'_> {
    fn deref_mut(&mut self) -> &mut PrivatePools {
        &mut self.pools
    }
}

impl Drop for PoolsGuard<'_> {
    fn drop(&mut self) {
        self.in_use.store(!self.pools.is_empty(), Ordering::Release);
    }
}

thread_local! {
    /// The stream this thread last named to a CUDA device: (the adoption
    /// generation, the device's address, the caller's handle, its id).
    static ADOPTED: Cell<(u64, usize, u64, StreamId)> =
        const { Cell::new((0, 0, 0, StreamId(0))) };
}

/// Bumped whenever an adopted stream may have gone stale (a stream
/// forgotten, a device created, perhaps where a dropped one lay): each
/// thread's [`ADOPTED`] holds only for the generation it was made in.
static ADOPTION_GENERATION: AtomicU64 = AtomicU64::new(1);

impl Device {
    /// The memory a snapshot shows.
    fn memory(&self) -> DeviceMemory {
        DeviceMemory::of(self.index, &self.alloc)
    }

    /// The segments and blocks a snapshot lists ([`listing::segments`]),
    /// appended to `segs` and `blocks`; the segment peak raised to their
    /// number.
    fn list(&self, segs: &mut Vec<QuiltSegment>, blocks: &mut Vec<QuiltBlock>) -> u64 {
        let memory = self.memory();
        let before = segs.len();
        listing::segments(&memory, &lock(&self.pools), segs, blocks);
        let count = (segs.len() - before) as u64;
        self.segment_peak.fetch_max(count, Ordering::Relaxed);
        count
    }

    /// The segments a snapshot would show with `reserved` bytes reserved
    /// ([`listing::segments`]), and their peak, without walking the
    /// blocks: the runs of mapped memory are found again only when a map,
    /// an unmap or a reservation was made since ([`segments_mark`]), and
    /// the pools' segments cut out of them only when those runs or the
    /// pools' segments changed ([`PrivatePools::segments_generation`]).
    /// The marks are read before the count, so a change made meanwhile is
    /// counted at the next call.
    fn segment_count(&self, reserved: u64) -> (u64, u64) {
        let mark = segments_mark(&self.alloc);
        let (listed, bytes) = {
            let mut c = lock(&self.mapped_runs);
            if c.mark != Some(mark) {
                let joined = snapshot::joined(self.alloc.gpu_segments());
                c.runs = joined
                    .segments
                    .iter()
                    .map(|s| (s.address, s.total_size))
                    .collect();
                c.bytes = c.runs.iter().map(|r| r.1).sum();
                c.mark = Some(mark);
                c.generation = None;
            }
            let pools = lock(&self.pools);
            let generation = pools.segments_generation();
            if c.generation != Some(generation) {
                c.listed = c.runs.iter().map(|&r| pools.listed_segments_in(r)).sum();
                c.generation = Some(generation);
            }
            (c.listed, c.bytes)
        };
        let count = listed + u64::from(reserved > bytes);
        let peak = self
            .segment_peak
            .fetch_max(count, Ordering::Relaxed)
            .max(count);
        (count, peak)
    }

    /// The private pools, locked.
    fn pools(&self) -> PoolsGuard<'_> {
        PoolsGuard {
            pools: lock(&self.pools),
            in_use: &self.pools_in_use,
        }
    }

    /// The caller's stream as a `StreamId` of this device's backend: on
    /// CUDA, adopted ([`CudaVmm::adopt_stream`]) the first time this
    /// thread names it (again after a change of [`ADOPTION_GENERATION`]).
    fn stream(&self, raw: u64) -> StreamId {
        let Some(c) = &self.cuda else {
            return StreamId(raw);
        };
        let generation = ADOPTION_GENERATION.load(Ordering::Acquire);
        let me = self as *const Device as usize;
        ADOPTED.with(|a| {
            let (g, device, handle, id) = a.get();
            if (g, device, handle) == (generation, me, raw) {
                return id;
            }
            let id = c.adopt_stream(raw);
            a.set((generation, me, raw, id));
            id
        })
    }

    /// The caller's handle of the stream `id` ([`Device::stream`] the other
    /// way): a thread's per-thread default stream is `0x2` again.
    fn raw_stream(&self, id: StreamId) -> u64 {
        match &self.cuda {
            // Per-thread ids are `2 + 8n`, which no stream pointer is.
            Some(c) if id.0 > 2 && id.0 % 8 == 2 && c.per_thread_owner(id).is_some() => {
                quilt_vmm::cuda::CU_STREAM_PER_THREAD
            }
            _ => id.0,
        }
    }

    /// Give back `ptr` if this device allocated it (a pool's block stays
    /// the pool's): what torch asked for, its stream, and whether a pool
    /// kept it; `None` when this device did not allocate it (nothing
    /// changed).
    fn free_owned(&self, ptr: DevicePtr) -> Result<Option<(PoolBlock, bool)>, String> {
        if self.pools_in_use.load(Ordering::Acquire) {
            let mut pools = self.pools();
            match pools.free(ptr)? {
                (Freed::KeptByPool, Some(b)) => return Ok(Some((b, true))),
                (Freed::Released(segments), Some(b)) => {
                    for s in segments {
                        self.alloc.free(s).map_err(|e| e.to_string())?;
                    }
                    return Ok(Some((b, false)));
                }
                // No live block of a pool, but a pool's segment starts there
                // (Quilt's block under the pool's memory): not torch's to
                // free (a second free of the pool's first block).
                _ if pools.segment_owner(ptr).is_some() => return Ok(None),
                _ => {}
            }
        }
        match self.alloc.free_owned(ptr) {
            Ok(Some(b)) => Ok(Some((
                PoolBlock {
                    requested: b.requested,
                    stream: self.raw_stream(b.stream),
                },
                false,
            ))),
            Ok(None) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// What [`Library::torch_free`] gave back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TorchFreed {
    /// The device that had allocated it.
    pub device: i32,
    /// The bytes torch asked for.
    pub size: u64,
    /// The stream it was allocated on (the caller's handle).
    pub stream: u64,
    /// The sequence number of its `free_requested` history entry (0 when
    /// history is off).
    pub seq: u64,
    /// Whether a private pool kept it.
    pub kept_by_pool: bool,
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
/// hold now (`reserved` held): the device's total and free memory in
/// torch's out-of-memory message and observers.
fn device_memory(d: &Device, reserved: u64) -> (u64, u64) {
    let p = d.alloc.pool_stats();
    let total = p.limit_pages * p.page_size;
    (total, total.saturating_sub(reserved))
}

/// The library: see the module documentation.
pub struct Library {
    conf_text: String,
    conf: Result<LibraryConf, String>,
    /// Each device, by index, once created: found without a lock.
    devices: Box<[OnceLock<Device>]>,
    /// Taken to create a device (creations one at a time).
    creating: Mutex<()>,
    /// One past the highest index of a device created.
    devices_top: AtomicUsize,
    /// Memory fractions set for devices not created yet.
    fractions: Mutex<BTreeMap<i32, f64>>,
    /// torch's `roundup_power2_divisions`, applied to every device's
    /// requests ([`Library::set_roundup_power2_divisions`]).
    roundup: Mutex<RoundupPower2Divisions>,
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
            devices: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            creating: Mutex::new(()),
            devices_top: AtomicUsize::new(0),
            fractions: Mutex::new(BTreeMap::new()),
            roundup: Mutex::new(RoundupPower2Divisions::OFF),
            history: History::default(),
        }
    }

    fn conf(&self) -> Result<&LibraryConf, String> {
        self.conf
            .as_ref()
            .map_err(|e| format!("{e}; Quilt refuses to allocate until it is fixed"))
    }

    /// The device `index`, created on first use.
    fn device(&self, index: i32) -> Result<&Device, String> {
        let conf = self.conf()?;
        let slot = usize::try_from(index)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                format!(
                    "device {index} is not a device index (Quilt serves devices 0 to {})",
                    MAX_DEVICES - 1
                )
            })?;
        if let Some(d) = slot.get() {
            return Ok(d);
        }
        let _creating = lock(&self.creating);
        if let Some(d) = slot.get() {
            return Ok(d);
        }
        let (vmm, cuda): (Arc<dyn Vmm>, Option<Arc<CudaVmm>>) =
            match conf.backend {
                Backend::Cuda => {
                    let c = Arc::new(CudaVmm::new(index as usize).map_err(|e| {
                        format!("device {index}: the CUDA backend is unavailable: {e}")
                    })?);
                    // CUDA state from here on: a forked child must not touch it.
                    crate::ffi::watch_fork();
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
        // Held until the device is in place: a rounding set meanwhile
        // reaches it.
        let roundup = lock(&self.roundup);
        alloc
            .set_roundup_power2_divisions(*roundup)
            .map_err(|e| format!("device {index}: {e}"))?;
        let d = slot.get_or_init(|| Device {
            index,
            cuda,
            alloc,
            segment_peak: AtomicU64::new(0),
            mapped_runs: Mutex::new(MappedRuns::default()),
            pools: Mutex::new(PrivatePools::default()),
            pools_in_use: AtomicBool::new(false),
            too_large: AtomicU64::new(0),
            accumulated_base: Mutex::new(Accumulated::default()),
        });
        drop(roundup);
        // Streams adopted for a device that lay at this address before.
        ADOPTION_GENERATION.fetch_add(1, Ordering::AcqRel);
        self.devices_top
            .fetch_max(index as usize + 1, Ordering::AcqRel);
        Ok(d)
    }

    /// The device `index` if it was created.
    fn created(&self, index: i32) -> Option<&Device> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.devices.get(i))
            .and_then(OnceLock::get)
    }

    /// The devices created so far, by index.
    fn existing(&self) -> impl Iterator<Item = &Device> {
        let top = self.devices_top.load(Ordering::Acquire);
        self.devices[..top.min(MAX_DEVICES)]
            .iter()
            .filter_map(OnceLock::get)
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
        let mut pools = pool.map(|_| d.pools());
        if let (Some(id), Some(p)) = (pool, pools.as_mut()) {
            if let Some(ptr) = p.take(id, size, stream).map_err(MallocFailure::other)? {
                let seq = self
                    .history
                    .record(device, "alloc", ptr, size, stream, "quilt_malloc");
                return Ok((ptr, seq));
            }
        }
        // Into a pool: first, a segment right after a free block at the end
        // of the pool's memory, so that the two serve the request; Quilt
        // places it where it will, so one placed elsewhere (handed out to
        // nobody yet) goes back at once.
        if let (Some(id), Some(p)) = (pool, pools.as_mut()) {
            if let Some((end, extra)) = p.extension(id, size, stream) {
                let made = match tag {
                    Some(t) => d.alloc.allocate_tagged(extra, s, t),
                    None => d.alloc.allocate_apart(extra, s),
                };
                if let Ok(a) = made {
                    if a.ptr == end {
                        p.adopt_free(id, a.ptr, extra, stream)
                            .map_err(MallocFailure::other)?;
                        if let Some(ptr) = p.take(id, size, stream).map_err(MallocFailure::other)? {
                            self.sync_segments(d, "quilt_malloc");
                            let seq = self.history.record(
                                device,
                                "alloc",
                                ptr,
                                size,
                                stream,
                                "quilt_malloc",
                            );
                            return Ok((ptr, seq));
                        }
                    } else {
                        d.alloc
                            .free(a.ptr)
                            .map_err(|e| MallocFailure::other(e.to_string()))?;
                    }
                }
            }
        }
        // Into a pool: a segment the pool carves its blocks from, apart
        // from the blocks outside pools (as torch's private pools own their
        // segments), unless a tag's arena holds it.
        let quilt_size = match pool {
            Some(_) => private_pools::segment_size(size),
            None => size,
        };
        let made = match (tag, pool) {
            (Some(t), _) => d.alloc.allocate_tagged(quilt_size, s, t),
            (None, Some(_)) => d.alloc.allocate_apart(quilt_size, s),
            (None, None) => d.alloc.allocate(quilt_size, s),
        };
        self.sync_segments(d, "quilt_malloc");
        match made {
            Ok(a) => {
                if let (Some(id), Some(p)) = (pool, pools.as_mut()) {
                    if let Err(e) = p.adopt(id, a.ptr, quilt_size, size, stream) {
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
                        let reserved = d.alloc.stats().reserved_bytes.current;
                        let (_, free) = device_memory(d, reserved);
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

    /// `quilt_free`: give back the block at `ptr` of `device` (`size` and
    /// `stream` are the caller's, for the history).
    pub fn free(&self, ptr: DevicePtr, size: u64, device: i32, stream: u64) -> Result<(), String> {
        if ptr == 0 {
            return Err("free of a null pointer".into());
        }
        let Some(d) = self.created(device) else {
            self.conf()?;
            return Err(format!(
                "free of {ptr:#x} on device {device}, which has allocated nothing"
            ));
        };
        if d.free_owned(ptr)?.is_none() {
            // Not a live block: the allocator tells a double free from an
            // unknown pointer.
            return d.alloc.free(ptr).map_err(|e| e.to_string());
        }
        self.record_free(d, ptr, size, stream);
        Ok(())
    }

    /// torch's allocator class's free: the device that allocated `ptr` gives
    /// it back (the devices asked in turn, each a lookup in its own blocks
    /// until one has it); a block of a used private pool stays the pool's
    /// (free, for the pool's later allocations); any other goes back to
    /// Quilt. Returns what torch asked for, its device and stream, the
    /// sequence number of its `free_requested` history entry (0 when
    /// history is off) and whether a pool kept it.
    pub fn torch_free(&self, ptr: DevicePtr) -> Result<TorchFreed, String> {
        if ptr == 0 {
            return Err("free of a null pointer".into());
        }
        for d in self.existing() {
            if let Some((b, kept_by_pool)) = d.free_owned(ptr)? {
                let seq = self.record_free(d, ptr, b.requested, b.stream);
                return Ok(TorchFreed {
                    device: d.index,
                    size: b.requested,
                    stream: b.stream,
                    seq,
                    kept_by_pool,
                });
            }
        }
        Err(self.not_freed(ptr))
    }

    /// Why `ptr` is no live block of any device (nothing is freed to find
    /// out: another thread may have been handed the same address since).
    #[cold]
    fn not_freed(&self, ptr: DevicePtr) -> String {
        match self.conf() {
            Err(e) => e,
            Ok(_) if self.existing().next().is_none() => {
                format!("free of {ptr:#x}: no device has allocated anything")
            }
            Ok(_) => format!(
                "free of {ptr:#x}, which is no live block of any device (a double free, or a \
                 pointer Quilt did not hand out)"
            ),
        }
    }

    /// The history of a free of `ptr` on `d` (`size` and `stream` as torch
    /// had them): its `free_requested` entry's sequence number (0 when off).
    fn record_free(&self, d: &Device, ptr: DevicePtr, size: u64, stream: u64) -> u64 {
        let seq = self
            .history
            .record(d.index, "free_requested", ptr, size, stream, "quilt_free");
        self.history
            .record(d.index, "free_completed", ptr, size, stream, "quilt_free");
        self.sync_segments(d, "quilt_free");
        seq
    }

    /// The bytes torch asked for the live block at `ptr` (torch's
    /// `getBaseAllocation`), on whichever device has it; `None` for any
    /// other pointer.
    pub fn block_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.existing().find_map(|d| {
            if d.pools_in_use.load(Ordering::Acquire) {
                if let Some(n) = d.pools().live_requested(ptr) {
                    return Some(n);
                }
            }
            d.alloc.block(ptr).map(|b| b.requested)
        })
    }

    /// torch's `createOrIncrefPool` (and `beginAllocateToPool`, which uses
    /// the pool once more): see [`PrivatePools::create_or_incref`].
    pub fn pool_create_or_incref(&self, device: i32, id: PoolId) -> Result<(), String> {
        let d = self.device(device)?;
        d.pools().create_or_incref(id);
        Ok(())
    }

    /// torch's `releasePool`: one use fewer; at none, the pool's free
    /// blocks go back to Quilt ([`PrivatePools::release`]).
    pub fn pool_release(&self, device: i32, id: PoolId) -> Result<(), String> {
        let d = self.device(device)?;
        let back = d.pools().release(id)?;
        let mut errors = Vec::new();
        for ptr in back {
            if let Err(e) = d.alloc.free(ptr) {
                errors.push(format!("{ptr:#x}: {e}"));
            }
        }
        self.sync_segments(d, "quilt_pool_release");
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "releasePool of {id:?} on device {device}: {}",
                errors.join("; ")
            ))
        }
    }

    /// torch's `setNoSplit` ([`PrivatePools::set_no_split`]).
    pub fn pool_set_no_split(&self, device: i32, id: PoolId) -> Result<(), String> {
        let d = self.device(device)?;
        let done = d.pools().set_no_split(id);
        done
    }

    /// torch's `getPoolUseCount`.
    pub fn pool_use_count(&self, device: i32, id: PoolId) -> Result<u32, String> {
        let d = self.device(device)?;
        let n = lock(&d.pools).use_count(id);
        Ok(n)
    }

    /// `quilt_check_configuration`: the configuration parses and its
    /// backend can start, checked without creating any device's allocator
    /// (on CUDA: the driver and device 0 are asked, with no context made,
    /// so a process that never uses device 0 has none there). Returns the
    /// backend's name.
    pub fn check_configuration(&self) -> Result<&'static str, String> {
        let conf = self.conf()?;
        if conf.backend == Backend::Cuda {
            CudaVmm::check_device(0)
                .map_err(|e| format!("device 0: the CUDA backend is unavailable: {e}"))?;
        }
        Ok(conf.backend.name())
    }

    /// torch's `enablePeerAccess(peer, device)`: device `peer` may reach
    /// `device`'s memory, every page mapped now and later
    /// ([`QuiltAllocator::add_peer_access`], as torch's expandable
    /// segments' `addPeerAccess`).
    pub fn enable_peer_access(&self, device: i32, peer: i32) -> Result<(), String> {
        let d = self.device(device)?;
        let peer =
            u32::try_from(peer).map_err(|_| format!("device {peer} is not a device index"))?;
        d.alloc
            .add_peer_access(peer)
            .map_err(|e| format!("device {device}: access for device {peer}: {e}"))
    }

    /// torch's `getCheckpointState`: pool `id`'s blocks and which are
    /// handed out ([`PrivatePools::checkpoint`]).
    pub fn pool_checkpoint(&self, device: i32, id: PoolId) -> Result<Vec<CheckpointBlock>, String> {
        let d = self.device(device)?;
        let state = d.pools().checkpoint(id);
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
        let mut pools = d.pools();
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
                    b.requested,
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
        let live = d.pools().live_blocks(id);
        live
    }

    /// torch's `getDeviceStats`: Quilt's figures in torch's terms
    /// ([`device_stats::torch_stats`]), from counters kept as blocks change
    /// (Quilt's, the pools', and the segments counted again only when the
    /// mapping changed): no walk over the blocks.
    pub fn device_stats(&self, device: i32) -> Result<QuiltDeviceStats, String> {
        let d = self.device(device)?;
        let raw = d.alloc.stats();
        let segments = d.segment_count(raw.reserved_bytes.current);
        Ok(self.torch_stats(d, &raw, segments))
    }

    /// [`Library::device_stats`] with the segments counted by walking every
    /// block of the device, as a snapshot does (its figures must be the
    /// same: for tests and checks).
    pub fn device_stats_walked(&self, device: i32) -> Result<QuiltDeviceStats, String> {
        let d = self.device(device)?;
        let segments = d.list(&mut Vec::new(), &mut Vec::new());
        let peak = d.segment_peak.load(Ordering::Relaxed);
        let raw = d.alloc.stats();
        Ok(self.torch_stats(d, &raw, (segments, peak)))
    }

    fn torch_stats(
        &self,
        d: &Device,
        raw: &quilt_alloc::AllocatorStats,
        segments: (u64, u64),
    ) -> QuiltDeviceStats {
        let pools: PoolFigures = lock(&d.pools).figures();
        let memory = device_memory(d, raw.reserved_bytes.current);
        let base = *lock(&d.accumulated_base);
        device_stats::torch_stats(
            raw,
            &pools,
            segments,
            memory,
            d.too_large.load(Ordering::Relaxed),
            &base,
        )
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
            self.sync_segments(d, "quilt_segments");
            d.list(&mut segs, &mut blocks);
        }
        Ok((segs, blocks))
    }

    /// `quilt_history_last_seq`: the sequence number of the last history
    /// entry recorded so far (0: none).
    pub fn history_last_seq(&self) -> u64 {
        self.history.last_seq()
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
            self.sync_segments(d, "quilt_segments");
            let memory = d.memory();
            let pools = lock(&d.pools);
            starts.insert(
                d.index,
                snapshot::viewer_start(&memory, |a| {
                    pools.pieces(a).map(|ps| {
                        ps.iter()
                            .filter(|p| p.live && p.begins)
                            .map(|p| (p.ptr, p.requested))
                            .collect()
                    })
                }),
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

    /// Record in the history how `d`'s mapped memory changed, if it did
    /// (inlined: while recording is off, one load at the call site).
    #[inline]
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
            .filter_map(|d| {
                let mut done = d.alloc.empty_cache();
                // A fraction below what live blocks held when it was set
                // takes hold as far as the memory given back now allows.
                let fraction = lock(&self.fractions).get(&d.index).copied();
                if let (Ok(()), Some(f)) = (&done, fraction) {
                    done = apply_fraction(d, f);
                }
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
        let forgotten = self.existing().try_for_each(|d| {
            d.alloc
                .forget_stream(d.stream(stream))
                .map_err(|e| format!("forget_stream of {stream:#x} on device {}: {e}", d.index))
        });
        // Every thread adopts its streams anew (this one may be adopted
        // again, a new stream with the same handle).
        ADOPTION_GENERATION.fetch_add(1, Ordering::AcqRel);
        forgotten
    }

    /// `quilt_record_stream`: the block at `ptr` is used on `stream` too.
    pub fn record_stream(&self, ptr: DevicePtr, stream: u64) -> Result<(), String> {
        if ptr == 0 {
            return Err("record_stream of a null pointer".into());
        }
        for d in self.existing() {
            // A block of a pool's segment: the segment is used on `stream`
            // (when it goes back to Quilt, Quilt waits for that work).
            let segments = if d.pools_in_use.load(Ordering::Acquire) {
                d.pools().segments_under(ptr)
            } else {
                Vec::new()
            };
            if !segments.is_empty() {
                for s in segments {
                    d.alloc
                        .record_stream(s, d.stream(stream))
                        .map_err(|e| e.to_string())?;
                }
                return Ok(());
            }
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
        match self.created(device) {
            Some(d) => {
                let done = apply_fraction(d, f);
                self.sync_segments(d, "quilt_set_memory_fraction");
                if done.is_ok() {
                    lock(&self.fractions).insert(device, f);
                }
                done.map_err(|e| format!("device {device}: {e}"))
            }
            None => {
                lock(&self.fractions).insert(device, f);
                Ok(())
            }
        }
    }

    /// `quilt_set_roundup_power2_divisions`: torch's
    /// `roundup_power2_divisions` setting, its table of divisions by size
    /// interval as torch keeps it (`AcceleratorAllocatorConfig::
    /// roundup_power2_divisions()`: one entry per power of two from 1 MiB,
    /// [`ROUNDUP_INTERVALS`] entries, each 0 or a power of two), applied to
    /// every later request on every device by torch's rule
    /// ([`QuiltAllocator::set_roundup_power2_divisions`]). All zeros: off.
    pub fn set_roundup_power2_divisions(&self, table: &[u64]) -> Result<(), String> {
        self.conf()?;
        let divisions: [u64; ROUNDUP_INTERVALS] = table.try_into().map_err(|_| {
            format!(
                "roundup_power2_divisions: {} intervals given, torch has {ROUNDUP_INTERVALS}",
                table.len()
            )
        })?;
        let divisions = RoundupPower2Divisions(divisions);
        divisions
            .validate()
            .map_err(|e| format!("roundup_power2_divisions {table:?}: {e}"))?;
        let mut roundup = lock(&self.roundup);
        for d in self.existing() {
            d.alloc
                .set_roundup_power2_divisions(divisions)
                .map_err(|e| format!("device {}: {e}", d.index))?;
        }
        *roundup = divisions;
        Ok(())
    }

    /// `quilt_reset_peak_stats`: every peak of `device`'s statistics set to
    /// its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self, device: i32) -> Result<(), String> {
        let d = self.device(device)?;
        d.alloc.reset_peak_stats().map_err(|e| e.to_string())?;
        let (segments, _) = d.segment_count(d.alloc.stats().reserved_bytes.current);
        d.segment_peak.store(segments, Ordering::Relaxed);
        Ok(())
    }

    /// `quilt_stats_json`: the statistics of `device`, as JSON text.
    pub fn stats_json(&self, device: i32) -> Result<String, String> {
        let conf = self.conf()?;
        let d = self.device(device)?;
        let s = d.alloc.stats();
        let (segments, segment_peak) = d.segment_count(s.reserved_bytes.current);
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
            "num_recorded_frees_forced": s.num_recorded_frees_forced,
            "cached_bytes": d.alloc.cached_bytes(),
            "driver_calls": calls,
        });
        Ok(v.to_string())
    }

    /// The devices whose allocator knows `tag`, with whether it sleeps there.
    fn tag_devices(&self, tag: &str) -> Result<Vec<(&Device, bool)>, String> {
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
                self.sync_segments(d, "quilt_sleep");
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
                self.sync_segments(d, "quilt_wake");
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
        let existing: Vec<&Device> = self.existing().collect();
        for d in &existing {
            // The history ends where the snapshot is: PyTorch's viewer
            // replays it backwards from the segments.
            self.sync_segments(d, "quilt_dump_snapshot");
        }
        let devices: Vec<DeviceMemory> = existing.iter().map(|d| d.memory()).collect();
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
