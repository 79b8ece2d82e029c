//! `offset`: the [`offset_allocator`] crate (Sebastian Aaltonen's O(1)
//! TLSF-style allocator) managing one fixed, contiguous arena the size of the
//! device: what a good classic allocator does with contiguous memory, without
//! any caching or virtual-memory tricks.
//!
//! - The arena is `vmm.mem_info().total` bytes (or [`OffsetConfig::arena_bytes`]),
//!   rounded down to the driver's granularity and capped at 2^31 units, managed
//!   in units of 256 bytes. Requests are rounded up to 512 bytes like the other
//!   baselines.
//! - **Reserved bytes, by choice:** the arena's virtual range is reserved once
//!   up front, but physical memory is created and mapped lazily, in whole
//!   granules, as the arena's high-water mark grows (one handle per growth step,
//!   one map and one set-access), and never unmapped. So `reserved_bytes`
//!   counts the part of the arena ever touched, rounded up to the granularity:
//!   the honest physical footprint of a contiguous allocator. Mapping the whole
//!   arena up front would make the peak reserved the whole device, which says
//!   nothing. `segment` counts those physical handles.
//! - No caching: a freed block goes straight back to the offset allocator, and
//!   `empty_cache` only completes deferred frees. A block recorded on other
//!   streams (`record_stream`) is given back once their events complete, as in
//!   the caching baselines.
//! - **One arena for every stream.** A free gives the block back at once
//!   (its `record_stream` streams aside), so the next block, on any stream,
//!   may land on memory another stream's work still uses. As
//!   `cudaMallocAsync` does for its pool, the allocating stream is then
//!   ordered after that work: before it takes a block, it waits (one event
//!   recorded on the other stream and one `cuStreamWaitEvent`) for every
//!   stream that freed a block, or used one freed since (its own stream and
//!   its `record_stream` streams), since it last waited for that stream.
//!   Which block it gets is the crate's choice, not known before, so the
//!   wait covers every such stream; a single-stream program makes none.
//!   (Without these waits a block freed on one stream was reused at once by
//!   another whose kernels could overwrite it while the first stream's still
//!   ran: a data race the replay's race finder reports.)
//!
//! Invariants (`DeviceAllocator::check_invariants`, with the `invariants`
//! feature): live and pending blocks do
//! not overlap and lie below the mapped high-water mark; the offset allocator's
//! free space equals the arena minus the live and pending units; every
//! statistic equals what it counts.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use offset_allocator::{Allocation as Slot, Allocator};
use quilt_vmm::{DevicePtr, EventId, PhysHandle, StreamId, Vmm, VmmError};

use crate::api::{check_size, round_up, Allocation, DeviceAllocator, MIN_BLOCK_SIZE};
#[cfg(feature = "invariants")]
use crate::error::InvariantViolation;
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};
use crate::stats::AllocatorStats;
#[cfg(feature = "invariants")]
use crate::stats::Stat;

/// Bytes per offset-allocator unit.
pub const UNIT: u64 = 256;
/// The most units one arena may hold (keeps the crate's bin search in range).
pub const MAX_UNITS: u64 = 1 << 31;

/// Settings of [`OffsetAllocator`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OffsetConfig {
    /// Arena size in bytes; `None` = the device total from `mem_info`.
    pub arena_bytes: Option<u64>,
    /// Most live allocations at once (the crate's node pool); `None` = the
    /// crate's default (128 Ki).
    pub max_allocs: Option<u32>,
}

/// One block handed out (or freed and waiting on events).
struct Live {
    slot: Slot<u32>,
    size: u64,
    requested: u64,
    stream: StreamId,
    uses: Vec<StreamId>,
    event_count: u32,
}

/// One physical handle behind the arena, mapped at `offset`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    handle: PhysHandle,
    offset: u64,
    size: u64,
}

struct State {
    arena: Allocator<u32>,
    live: HashMap<DevicePtr, Live>,
    pending: HashMap<DevicePtr, Live>,
    events: BTreeMap<StreamId, VecDeque<(EventId, DevicePtr)>>,
    freed: HashSet<DevicePtr>,
    chunks: Vec<Chunk>,
    mapped: u64,
    stats: AllocatorStats,
    /// The report of the last request that ran out of memory.
    last_oom: Option<OomReport>,
    /// Allocator operations so far (allocate and free).
    tick: u64,
    /// The streams whose work used freed memory: the operation of the last
    /// free naming each (the block's own stream and its `record_stream`s).
    freed_at: BTreeMap<StreamId, u64>,
    /// (waiter, stream): the operation at which the waiter last waited for
    /// the stream's work.
    waited: HashMap<(StreamId, StreamId), u64>,
}

/// The `offset-allocator` crate over one lazily backed arena (see the module docs).
pub struct OffsetAllocator {
    vmm: Arc<dyn Vmm>,
    base: DevicePtr,
    arena_bytes: u64,
    gran: u64,
    state: Mutex<State>,
}

impl fmt::Debug for OffsetAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffsetAllocator")
            .field("base", &self.base)
            .field("arena_bytes", &self.arena_bytes)
            .finish_non_exhaustive()
    }
}

impl OffsetAllocator {
    /// An offset allocator on `vmm`: reserves the arena's address range. Fails
    /// with [`AllocError::InvalidSize`] for an arena smaller than one granule or
    /// a bad `max_allocs`, [`AllocError::Driver`] when the reservation fails.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let alloc = OffsetAllocator::new(vmm, OffsetConfig::default())?;
    /// let a = alloc.allocate(1000, StreamId::DEFAULT)?;
    /// alloc.free(a.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(vmm: Arc<dyn Vmm>, config: OffsetConfig) -> Result<Self, AllocError> {
        let gran = vmm.granularity().max(UNIT);
        let wanted = match config.arena_bytes {
            Some(b) => b,
            None => vmm.mem_info()?.total,
        };
        let arena_bytes = (wanted.min(MAX_UNITS * UNIT) / gran) * gran;
        if arena_bytes == 0 {
            return Err(AllocError::InvalidSize {
                size: wanted,
                reason: "the arena must hold at least one granule",
            });
        }
        let units = (arena_bytes / UNIT) as u32;
        let arena = match config.max_allocs {
            None => Allocator::new(units),
            Some(n) if (2..u32::MAX - 1).contains(&n) => Allocator::with_max_allocs(units, n),
            Some(n) => {
                return Err(AllocError::InvalidSize {
                    size: u64::from(n),
                    reason: "max_allocs must lie in 2..u32::MAX-1",
                })
            }
        };
        let base = vmm.reserve(arena_bytes, 0)?;
        Ok(OffsetAllocator {
            vmm,
            base,
            arena_bytes,
            gran,
            state: Mutex::new(State {
                arena,
                live: HashMap::new(),
                pending: HashMap::new(),
                events: BTreeMap::new(),
                freed: HashSet::new(),
                chunks: Vec::new(),
                mapped: 0,
                stats: AllocatorStats::default(),
                last_oom: None,
                tick: 0,
                freed_at: BTreeMap::new(),
                waited: HashMap::new(),
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, AllocError> {
        self.state.lock().map_err(|_| AllocError::Poisoned)
    }

    /// Back the arena up to `end` bytes: one handle for the new granules, one map,
    /// one set-access. On failure everything this call did is undone.
    fn grow(&self, st: &mut State, end: u64) -> Result<(), VmmError> {
        let Some(target) = round_up(end, self.gran) else {
            return Ok(());
        };
        if target <= st.mapped {
            return Ok(());
        }
        let size = target - st.mapped;
        let at = self.base + st.mapped;
        let handle = self.vmm.create(size)?;
        if let Err(e) = self.vmm.map(at, size, handle, 0) {
            let _ = self.vmm.release(handle);
            return Err(e);
        }
        if let Err(e) = self.vmm.set_access(at, size) {
            let _ = self.vmm.unmap(at, size);
            let _ = self.vmm.release(handle);
            return Err(e);
        }
        st.chunks.push(Chunk {
            handle,
            offset: st.mapped,
            size,
        });
        st.mapped = target;
        st.stats.reserved_bytes.increase(size);
        st.stats.segment.increase(1);
        Ok(())
    }

    /// Order `stream` after the work of every other stream that freed
    /// memory (or used memory freed) since `stream` last waited for it: an
    /// event recorded there and one `cuStreamWaitEvent` each. A failed call
    /// leaves the waits made so far (harmless: more order than needed).
    fn order_after_frees(&self, st: &mut State, stream: StreamId) -> Result<(), AllocError> {
        let due: Vec<StreamId> = st
            .freed_at
            .iter()
            .filter(|&(&s, &at)| s != stream && st.waited.get(&(stream, s)).is_none_or(|&w| w < at))
            .map(|(&s, _)| s)
            .collect();
        for s in due {
            let e = self.vmm.event_record(s)?;
            let waited = self.vmm.stream_wait_event(stream, e);
            self.vmm.event_destroy(e)?;
            waited?;
            st.waited.insert((stream, s), st.tick);
        }
        Ok(())
    }

    /// Complete deferred frees whose events have completed.
    fn process_events(&self, st: &mut State, sync: bool) -> Result<(), AllocError> {
        let streams: Vec<StreamId> = st.events.keys().copied().collect();
        for s in streams {
            if sync {
                self.vmm.stream_synchronize(s)?;
            }
            while let Some(&(ev, ptr)) = st.events.get(&s).and_then(VecDeque::front) {
                if !sync && !self.vmm.event_query(ev)? {
                    break;
                }
                if let Some(q) = st.events.get_mut(&s) {
                    q.pop_front();
                }
                let done = st.pending.get_mut(&ptr).is_some_and(|b| {
                    b.event_count = b.event_count.saturating_sub(1);
                    b.event_count == 0
                });
                if done {
                    if let Some(b) = st.pending.remove(&ptr) {
                        release_block(st, b);
                    }
                }
                self.vmm.event_destroy(ev)?;
            }
            if st.events.get(&s).is_some_and(VecDeque::is_empty) {
                st.events.remove(&s);
            }
        }
        Ok(())
    }

    fn oom(&self, st: &mut State, requested: u64, needed: u64) -> AllocError {
        st.stats.num_ooms += 1;
        let info = self.vmm.mem_info().unwrap_or_default();
        let report = st.arena.storage_report();
        let free_units = u64::from(report.total_free_space);
        let hwm_free = st
            .mapped
            .saturating_sub(st.stats.active_bytes.current.min(st.mapped));
        let device_free = info.free.min(self.arena_bytes - st.mapped);
        let reclaimable = hwm_free;
        let verdict = if free_units * UNIT >= needed && hwm_free + device_free >= needed {
            OomVerdict::Fragmentation
        } else {
            OomVerdict::Capacity
        };
        let oom_report = OomReport {
            allocator: "offset".into(),
            requested,
            needed,
            needed_unbacked: needed,
            capacity: self.arena_bytes.min(info.total.max(st.mapped)),
            reserved: st.mapped,
            allocated: st.stats.allocated_bytes.current,
            device_free,
            reclaimable,
            largest_free_extent: u64::from(report.largest_free_region) * UNIT,
            verdict,
        };
        st.last_oom = Some(oom_report.clone());
        AllocError::OutOfMemory(Box::new(oom_report))
    }
}

/// Give a block's units back to the arena and count it inactive.
fn release_block(st: &mut State, b: Live) {
    st.arena.free(b.slot);
    st.stats.active.decrease(1);
    st.stats.active_bytes.decrease(b.size);
    st.stats.requested_bytes.decrease(b.requested);
}

impl DeviceAllocator for OffsetAllocator {
    fn name(&self) -> &str {
        "offset"
    }

    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        check_size(size)?;
        let mut guard = self.lock()?;
        let st = &mut *guard;
        st.tick += 1;
        self.order_after_frees(st, stream)?;
        self.process_events(st, false)?;
        let rounded = round_up(size, MIN_BLOCK_SIZE).unwrap_or(u64::MAX);
        if rounded > self.arena_bytes {
            return Err(self.oom(st, size, rounded));
        }
        let units = (rounded / UNIT) as u32;
        let Some(slot) = st.arena.allocate(units) else {
            return Err(self.oom(st, size, rounded));
        };
        let offset = u64::from(slot.offset) * UNIT;
        if let Err(e) = self.grow(st, offset + rounded) {
            st.arena.free(slot);
            return Err(if e.is_out_of_memory() {
                self.oom(st, size, rounded)
            } else {
                AllocError::Driver(e)
            });
        }
        let ptr = self.base + offset;
        st.freed.remove(&ptr);
        st.live.insert(
            ptr,
            Live {
                slot,
                size: rounded,
                requested: size,
                stream,
                uses: Vec::new(),
                event_count: 0,
            },
        );
        let s = &mut st.stats;
        s.allocation.increase(1);
        s.allocated_bytes.increase(rounded);
        s.active.increase(1);
        s.active_bytes.increase(rounded);
        s.requested_bytes.increase(size);
        Ok(Allocation { ptr, size: rounded })
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        let Some(b) = st.live.get(&ptr) else {
            return Err(
                if st.pending.contains_key(&ptr) || st.freed.contains(&ptr) {
                    AllocError::DoubleFree { ptr }
                } else {
                    AllocError::UnknownPointer { ptr }
                },
            );
        };
        let mut recorded = Vec::with_capacity(b.uses.len());
        for &s in &b.uses {
            match self.vmm.event_record(s) {
                Ok(e) => recorded.push((s, e)),
                Err(e) => {
                    for (_, ev) in recorded {
                        let _ = self.vmm.event_destroy(ev);
                    }
                    return Err(AllocError::Driver(e));
                }
            }
        }
        let Some(mut b) = st.live.remove(&ptr) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        st.tick += 1;
        for s in b.uses.iter().chain(std::iter::once(&b.stream)) {
            st.freed_at.insert(*s, st.tick);
        }
        st.freed.insert(ptr);
        st.stats.allocation.decrease(1);
        st.stats.allocated_bytes.decrease(b.size);
        b.uses.clear();
        if recorded.is_empty() {
            release_block(st, b);
        } else {
            b.event_count = recorded.len() as u32;
            st.pending.insert(ptr, b);
            for (s, e) in recorded {
                st.events.entry(s).or_default().push_back((e, ptr));
            }
        }
        Ok(())
    }

    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        let b = guard
            .live
            .get_mut(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        if b.stream != stream && !b.uses.contains(&stream) {
            b.uses.push(stream);
        }
        Ok(())
    }

    fn empty_cache(&self) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        self.process_events(&mut guard, true)
    }

    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.lock()?.stats.reset_peaks();
        Ok(())
    }

    fn stats(&self) -> AllocatorStats {
        let mut s = match self.state.lock() {
            Ok(st) => st.stats.clone(),
            Err(p) => p.into_inner().stats.clone(),
        };
        s.driver = self.vmm.driver_stats();
        s
    }

    fn snapshot(&self) -> MemorySnapshot {
        let st = match self.state.lock() {
            Ok(st) => st,
            Err(p) => p.into_inner(),
        };
        let mut blocks: Vec<BlockInfo> = st
            .live
            .iter()
            .map(|(&p, b)| (p, b, BlockState::Active))
            .chain(
                st.pending
                    .iter()
                    .map(|(&p, b)| (p, b, BlockState::PendingFree)),
            )
            .map(|(address, b, state)| BlockInfo {
                address,
                size: b.size,
                requested: b.requested,
                state,
            })
            .collect();
        blocks.sort_by_key(|b| b.address);
        MemorySnapshot {
            allocator: "offset".into(),
            segments: vec![SegmentInfo {
                address: self.base,
                total_size: self.arena_bytes,
                mapped_size: st.mapped,
                stream: StreamId::DEFAULT,
                kind: "arena",
                blocks,
            }],
        }
    }

    fn last_oom(&self) -> Option<OomReport> {
        self.lock().ok().and_then(|st| st.last_oom.clone())
    }

    #[cfg(feature = "invariants")]
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let st = self
            .state
            .lock()
            .map_err(|_| InvariantViolation("allocator state poisoned".into()))?;
        check(&st, self.base, self.arena_bytes)
    }

    fn vmm(&self) -> &Arc<dyn Vmm> {
        &self.vmm
    }
}

#[cfg(feature = "invariants")]
fn check_stat(name: &str, stat: &Stat, actual: u64) -> Result<(), InvariantViolation> {
    if stat.current != actual
        || stat.allocated.checked_sub(stat.freed) != Some(stat.current)
        || stat.peak < stat.current
    {
        return Err(InvariantViolation(format!(
            "offset: stat {name} {stat:?} but counted {actual}"
        )));
    }
    Ok(())
}

#[cfg(feature = "invariants")]
fn check(st: &State, base: DevicePtr, arena_bytes: u64) -> Result<(), InvariantViolation> {
    let fail = |m: String| Err(InvariantViolation(format!("offset: {m}")));
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for (&ptr, b) in st.live.iter().chain(st.pending.iter()) {
        let offset = u64::from(b.slot.offset) * UNIT;
        if ptr != base + offset || b.size % MIN_BLOCK_SIZE != 0 {
            return fail(format!(
                "block {ptr:#x} disagrees with its arena slot, or has a bad size"
            ));
        }
        spans.push((offset, offset + b.size));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return fail(format!("blocks at {:#x} and {:#x} overlap", w[0].0, w[1].0));
        }
    }
    if spans.last().is_some_and(|s| s.1 > st.mapped) {
        return fail("a block lies above the mapped high-water mark".into());
    }
    let used: u64 = spans.iter().map(|s| s.1 - s.0).sum();
    let report = st.arena.storage_report();
    if st.chunks.iter().map(|c| c.size).sum::<u64>() != st.mapped {
        return fail("chunks do not add up to the mapped size".into());
    }
    let mut expect = 0;
    for c in &st.chunks {
        if c.offset != expect {
            return fail("chunks do not tile the mapped prefix".into());
        }
        expect += c.size;
    }
    // (The crate reports 0 free space when its node pool is exhausted.)
    let free = u64::from(report.total_free_space) * UNIT;
    if free != 0 && free + used != arena_bytes {
        return fail(format!(
            "arena reports {free} bytes free, blocks use {used}, arena is {arena_bytes}"
        ));
    }
    for b in st.live.values() {
        if b.event_count != 0 || b.uses.contains(&b.stream) {
            return fail("a live block has events or records its own stream".into());
        }
    }
    let mut queued: HashMap<DevicePtr, u32> = HashMap::new();
    for q in st.events.values() {
        for &(_, p) in q {
            *queued.entry(p).or_default() += 1;
        }
    }
    for (&p, b) in &st.pending {
        if queued.get(&p).copied().unwrap_or(0) != b.event_count || b.event_count == 0 {
            return fail(format!("pending block {p:#x} has wrong events"));
        }
    }
    if queued.len() != st.pending.len() {
        return fail("events queued for blocks that are not pending".into());
    }
    let s = &st.stats;
    let live_bytes: u64 = st.live.values().map(|b| b.size).sum();
    let active_bytes = used;
    let requested: u64 = st
        .live
        .values()
        .chain(st.pending.values())
        .map(|b| b.requested)
        .sum();
    check_stat("allocation", &s.allocation, st.live.len() as u64)?;
    check_stat("allocated_bytes", &s.allocated_bytes, live_bytes)?;
    check_stat(
        "active",
        &s.active,
        (st.live.len() + st.pending.len()) as u64,
    )?;
    check_stat("active_bytes", &s.active_bytes, active_bytes)?;
    check_stat("requested_bytes", &s.requested_bytes, requested)?;
    check_stat("reserved_bytes", &s.reserved_bytes, st.mapped)?;
    check_stat("segment", &s.segment, st.chunks.len() as u64)?;
    Ok(())
}

impl Drop for OffsetAllocator {
    /// Give the arena back: every chunk unmapped and released, the range freed.
    fn drop(&mut self) {
        let st = match self.state.get_mut() {
            Ok(st) => st,
            Err(p) => p.into_inner(),
        };
        for (_, q) in std::mem::take(&mut st.events) {
            for (ev, _) in q {
                let _ = self.vmm.event_destroy(ev);
            }
        }
        for c in st.chunks.drain(..) {
            let _ = self.vmm.unmap(self.base + c.offset, c.size);
            let _ = self.vmm.release(c.handle);
        }
        let _ = self.vmm.address_free(self.base, self.arena_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_vmm::sim::{Fault, SimVmm};
    use quilt_vmm::CallKind;

    const MIB: u64 = 1 << 20;
    const S0: StreamId = StreamId(0);
    const S1: StreamId = StreamId(1);

    fn setup(capacity: u64, arena: Option<u64>) -> (Arc<SimVmm>, OffsetAllocator) {
        let vmm = Arc::new(SimVmm::with_capacity(capacity).unwrap());
        let config = OffsetConfig {
            arena_bytes: arena,
            max_allocs: None,
        };
        let a = OffsetAllocator::new(vmm.clone(), config).unwrap();
        a.check_invariants().unwrap();
        (vmm, a)
    }

    fn alloc(a: &OffsetAllocator, size: u64, stream: StreamId) -> Allocation {
        let x = a.allocate(size, stream).unwrap();
        a.check_invariants().unwrap();
        x
    }

    fn free(a: &OffsetAllocator, ptr: DevicePtr) {
        a.free(ptr).unwrap();
        a.check_invariants().unwrap();
    }

    #[test]
    fn backs_the_arena_lazily_up_to_its_high_water_mark() {
        let (vmm, a) = setup(1 << 30, None);
        let x = alloc(&a, 1, S0);
        assert_eq!(x.size, 512);
        assert_eq!(a.stats().reserved_bytes.current, 2 * MIB);
        let y = alloc(&a, 3 * MIB, S0);
        assert_eq!(y.ptr, x.ptr + 512);
        assert_eq!(a.stats().reserved_bytes.current, 4 * MIB);
        assert_eq!(a.stats().segment.current, 2);
        free(&a, x.ptr);
        free(&a, y.ptr);
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(
            (s.reserved_bytes.current, s.allocated_bytes.current),
            (4 * MIB, 0)
        );
        let z = alloc(&a, 3 * MIB, S1);
        assert_eq!(
            a.stats().reserved_bytes.current,
            4 * MIB,
            "freed space is reused"
        );
        free(&a, z.ptr);
        drop(a);
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn oom_verdicts() {
        let (_vmm, a) = setup(1 << 30, Some(8 * MIB));
        let err = a.allocate(100 * MIB, S0).unwrap_err();
        assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::Capacity);
        let xs: Vec<_> = (0..4).map(|_| alloc(&a, 2 * MIB, S0)).collect();
        free(&a, xs[0].ptr);
        free(&a, xs[2].ptr);
        let err = a.allocate(4 * MIB, S0).unwrap_err();
        a.check_invariants().unwrap();
        let r = err.oom_report().unwrap();
        assert_eq!(r.verdict, OomVerdict::Fragmentation);
        assert_eq!(r.reclaimable, 4 * MIB);
        assert_eq!(a.stats().num_ooms, 2);
        // A device smaller than the arena: running past it is capacity.
        let (_vmm, b) = setup(4 * MIB, Some(64 * MIB));
        let _x = b.allocate(3 * MIB, S0).unwrap();
        let err = b.allocate(3 * MIB, S0).unwrap_err();
        b.check_invariants().unwrap();
        assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::Capacity);
    }

    #[test]
    fn record_stream_delays_reuse() {
        let (vmm, a) = setup(1 << 30, None);
        let x = alloc(&a, MIB, S0);
        a.record_stream(x.ptr, S1).unwrap();
        free(&a, x.ptr);
        assert_eq!(
            a.free(x.ptr).unwrap_err(),
            AllocError::DoubleFree { ptr: x.ptr }
        );
        let y = alloc(&a, MIB, S0);
        assert_ne!(y.ptr, x.ptr);
        vmm.complete_stream(S1);
        let z = alloc(&a, MIB, S0);
        assert_eq!(z.ptr, x.ptr);
        a.record_stream(z.ptr, S1).unwrap();
        free(&a, z.ptr);
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().active.current, 1);
        free(&a, y.ptr);
        drop(a);
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn a_stream_waits_for_the_streams_that_freed_before_it_allocates() {
        let (vmm, a) = setup(1 << 30, None);
        let calls = |kind| vmm.driver_stats().count(kind);
        // One stream: no event, no wait.
        let x = alloc(&a, MIB, S0);
        free(&a, x.ptr);
        let x2 = alloc(&a, MIB, S0);
        assert_eq!(calls(CallKind::EventRecord), 0);
        free(&a, x2.ptr);
        // Another stream waits for S0's frees, once, then takes the memory.
        let y = alloc(&a, MIB, S1);
        assert_eq!(y.ptr, x.ptr);
        let z = alloc(&a, MIB, S1);
        assert_eq!(
            (
                calls(CallKind::EventRecord),
                calls(CallKind::StreamWaitEvent)
            ),
            (1, 1)
        );
        // S1's frees (and a block S0 made and S1 used) make S0 wait next
        // time, once, for S1 alone.
        free(&a, y.ptr);
        let w = alloc(&a, MIB, S0);
        a.record_stream(w.ptr, S1).unwrap();
        assert_eq!(calls(CallKind::StreamWaitEvent), 2);
        free(&a, w.ptr);
        let v = alloc(&a, MIB, S0);
        assert_eq!(calls(CallKind::StreamWaitEvent), 3);
        let u = alloc(&a, MIB, S0);
        assert_eq!(calls(CallKind::StreamWaitEvent), 3);
        for p in [z.ptr, v.ptr, u.ptr] {
            free(&a, p);
        }
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
        drop(a);
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn bad_input_gives_typed_errors() {
        let (_vmm, a) = setup(1 << 30, None);
        for size in [0, u64::MAX, usize::MAX as u64, (1 << 40) + 1] {
            assert!(matches!(
                a.allocate(size, S0),
                Err(AllocError::InvalidSize { .. })
            ));
            a.check_invariants().unwrap();
        }
        let x = alloc(&a, 3 * MIB, S0);
        for ptr in [0, 0xdead, x.ptr + 512] {
            assert_eq!(a.free(ptr).unwrap_err(), AllocError::UnknownPointer { ptr });
            assert!(a.record_stream(ptr, S1).is_err());
            a.check_invariants().unwrap();
        }
        free(&a, x.ptr);
        assert_eq!(
            a.free(x.ptr).unwrap_err(),
            AllocError::DoubleFree { ptr: x.ptr }
        );
        assert!(a.record_stream(x.ptr, S1).is_err());
        a.check_invariants().unwrap();
        let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
        let tiny = OffsetConfig {
            arena_bytes: Some(4096),
            max_allocs: None,
        };
        assert!(OffsetAllocator::new(vmm, tiny).is_err());
    }

    #[test]
    fn driver_faults_leave_it_consistent() {
        for k in 1..20 {
            let (vmm, a) = setup(64 * MIB, None);
            vmm.inject(Fault::nth_overall(k));
            let mut live = Vec::new();
            for (i, size) in [512, 3 * MIB, 5 * MIB, 1, 20 * MIB, 7 * MIB]
                .iter()
                .enumerate()
            {
                if let Ok(x) = a.allocate(*size, S0) {
                    live.push(x.ptr);
                }
                a.check_invariants().unwrap();
                if i % 2 == 1 {
                    let p = live.remove(0);
                    let _ = a.free(p);
                    a.check_invariants().unwrap();
                }
            }
            vmm.clear_faults();
            drop(a);
            assert!(
                vmm.leak_report().is_empty(),
                "k={k}: {:?}",
                vmm.leak_report()
            );
        }
    }
}
