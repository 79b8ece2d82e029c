//! `classic` and `expandable`: PyTorch's CUDA caching allocator
//! (`c10/cuda/CUDACachingAllocator.cpp`), rule for rule, as
//! `../shared/reference/pytorch-caching-allocator.md` describes it. PyTorch
//! itself is one allocator with an `expandable_segments` switch; so is
//! [`CachingAllocator`], with two presets: [`CachingConfig::classic`] (§1–§5,
//! §7) and [`CachingConfig::expandable`] (§6). The name it reports is the
//! preset's.
//!
//! `classic`: requests are rounded to 512 bytes (or by
//! `roundup_power2_divisions`), served best-fit from per-stream free sets
//! ordered by `(stream, size, address)`, split and merged inside segments of
//! 2 MiB (small pool, ≤ 1 MiB), 20 MiB (large requests below 10 MiB) or the
//! request rounded up to 2 MiB. When no cached block fits and the driver is
//! full, the allocator frees cached segments (oversize ones first when
//! `max_split_size` is set, then every whole free segment) and retries before
//! reporting out-of-memory. A segment is a `cudaMalloc`, modelled on the
//! [`Vmm`] as `reserve + create + map + set_access` of the segment size
//! (rounded up to the driver's granularity); freeing it is `unmap + release +
//! address_free`.
//!
//! `expandable` (`expandable_segments:True`): each (stream, pool) gets one
//! virtual range of 9/8 of the device total (rounded up to whole pages), grown
//! by mapping pages of 2 MiB (small pool) or 20 MiB (large pool), one physical
//! handle per page, at the lowest gap that fits; one `set_access` covers each
//! mapped run. Free blocks merge across page boundaries; pages are unmapped
//! only by `empty_cache` or before an out-of-memory (release cached pages,
//! retry). Any block splits when at least 512 bytes remain. As in PyTorch, the
//! `segment` statistic counts `cudaMalloc` segments only and stays 0 there,
//! and `inactive_split` excludes expandable blocks.
//!
//! One deliberate deviation: when `max_split_size` is set, the oversize release
//! step (`release_available_cached_blocks`) frees only free blocks that are whole
//! segments; PyTorch would `cudaFree` the block it finds even if it were part of
//! a split segment (which its own rules make impossible in practice, since only
//! blocks below `max_split_size` are split).
//!
//! Fidelity (`benches/tests/fidelity.rs`): replayed on the simulated driver, the
//! peak reserved bytes equal PyTorch's on four real traces; on the one trace with
//! its raw snapshot, every `cudaMalloc` has PyTorch's size in PyTorch's order and,
//! given PyTorch's segment addresses, every allocation lands at PyTorch's address.
//!
//! Invariants (checked by `check_invariants`, with the `invariants` feature):
//! the blocks of a segment tile it exactly and are linked in address order; no
//! two neighbouring free blocks with the same mapped state are left unmerged; a
//! block is in its pool's free set exactly when it is free and mapped, in the
//! unmapped set exactly when it is unmapped; every statistic equals what it
//! counts.

mod block;
pub mod config;
mod expandable_ops;
#[cfg(feature = "invariants")]
mod invariants;
mod report;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use quilt_vmm::{DevicePtr, EventId, StreamId, Vmm, VmmError};

use crate::api::{check_size, round_up, Allocation, DeviceAllocator};
use crate::error::AllocError;
use crate::snapshot::MemorySnapshot;
use crate::stats::{AllocatorStats, Stat};

use block::{size_key, Block, BlockId, BlockPool, Segment, SegmentKind, Slab};
pub use config::CachingConfig;
use config::{allocation_size, round_size, CachingSettings, PoolKind};

/// Mutable state of the allocator, behind one lock (PyTorch's per-device mutex).
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Every block.
    blocks: Slab<Block>,
    /// Every block by its start address (allocated, pending, free and unmapped).
    by_addr: BTreeMap<DevicePtr, BlockId>,
    /// Small and large pools, indexed by [`PoolKind::index`].
    pools: [BlockPool; 2],
    /// Every segment.
    segments: Slab<Segment>,
    /// Per-stream FIFO of `(event, block)` pairs of deferred frees.
    events: BTreeMap<StreamId, VecDeque<(EventId, BlockId)>>,
    /// Bytes held from the driver (PyTorch's `total_allocated_memory`).
    total_allocated_memory: u64,
    /// Statistics (driver statistics are filled in by `stats()`).
    stats: AllocatorStats,
    /// Blocks handed out that are at least `max_split_size`.
    oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    oversize_segments: Stat,
    /// Driver resources a failed call left behind (a handle whose release
    /// failed, a range whose free failed); retried at drop.
    orphans: Vec<Orphan>,
    /// The report of the last request that ran out of memory.
    last_oom: Option<crate::error::OomReport>,
    /// Streams forgotten ([`CachingAllocator::forget_stream`]) and not named
    /// again since: never handed to the driver (an expandable segment of
    /// one is unmapped without synchronising it: its work was made
    /// complete when it was forgotten).
    forgotten: std::collections::BTreeSet<StreamId>,
}

/// A driver resource the allocator no longer uses but could not give back.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Orphan {
    /// A physical handle to release.
    Handle(quilt_vmm::PhysHandle),
    /// A mapping to unmap.
    Mapping(DevicePtr, u64),
    /// A reservation to free.
    Range(DevicePtr, u64),
}

/// Run a clean-up call; on failure remember what it was meant to give back.
pub(crate) fn give_back(
    vmm: &dyn Vmm,
    orphans: &mut Vec<Orphan>,
    what: Orphan,
) -> Result<(), VmmError> {
    let r = match what {
        Orphan::Handle(h) => vmm.release(h),
        Orphan::Mapping(p, s) => vmm.unmap(p, s),
        Orphan::Range(p, s) => vmm.address_free(p, s),
    };
    if r.is_err() {
        orphans.push(what);
    }
    r
}

/// PyTorch's caching allocator over a [`Vmm`]: `classic` or, with
/// expandable segments, `expandable` ([`CachingConfig`]).
#[derive(Debug)]
pub struct CachingAllocator {
    name: &'static str,
    vmm: Arc<dyn Vmm>,
    cfg: CachingSettings,
    state: Mutex<State>,
}

/// What a request needs, computed once (PyTorch's `AllocParams`).
#[derive(Clone, Copy, Debug)]
struct Params {
    orig: u64,
    size: u64,
    alloc_size: u64,
    pool: PoolKind,
    stream: StreamId,
}

impl CachingAllocator {
    /// PyTorch's caching allocator on `vmm`, as `config` sets it up
    /// ([`CachingConfig::classic`] or [`CachingConfig::expandable`], changed
    /// or not). Fails with [`AllocError::InvalidSize`] for a setting out of
    /// range, or [`AllocError::Driver`] if `mem_info` fails.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
    /// use quilt_alloc::DeviceAllocator;
    /// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
    ///
    /// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
    /// let config = CachingConfig { max_split_size: Some(256 << 20), ..CachingConfig::classic() };
    /// let classic = CachingAllocator::new(vmm.clone(), config)?;
    /// assert_eq!(classic.name(), "classic");
    /// let a = classic.allocate(5 << 20, StreamId::DEFAULT)?;
    /// assert_eq!(classic.stats().reserved_bytes.current, 20 << 20, "a 20 MiB segment, as PyTorch");
    /// classic.free(a.ptr)?;
    ///
    /// let expandable = CachingAllocator::new(vmm, CachingConfig::expandable())?;
    /// assert_eq!(expandable.name(), "expandable");
    /// let b = expandable.allocate(30 << 20, StreamId::DEFAULT)?;
    /// expandable.free(b.ptr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(vmm: Arc<dyn Vmm>, config: CachingConfig) -> Result<Self, AllocError> {
        let cfg = config.settings(&*vmm)?;
        Ok(CachingAllocator {
            name: config.name(),
            vmm,
            cfg,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, AllocError> {
        self.state.lock().map_err(|_| AllocError::Poisoned)
    }

    fn gc_enabled(&self) -> bool {
        self.cfg.allowed_memory_maximum.is_some() && self.cfg.gc_threshold > 0.0
    }

    // ---------------------------------------------------------------- malloc

    /// `get_free_block` (§3.2): best fit on `(stream, size, ptr)` plus the
    /// expandable tail walk and the oversize rules.
    fn get_free_block(&self, st: &mut State, p: &Params) -> Option<BlockId> {
        let gc = self.gc_enabled();
        let State {
            blocks,
            pools,
            segments,
            ..
        } = st;
        let pool = &mut pools[p.pool.index()];
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        let mut range = pool.blocks.range((p.stream, p.size, 0)..);
        let (&first_key, &first_id) = range.next()?;
        if first_key.0 != p.stream {
            return None;
        }
        let (mut key, mut id) = (first_key, first_id);
        if self.cfg.expandable && segments[blocks[id].segment].is_expandable() {
            let expandable_size = |b: BlockId| {
                let blk = &blocks[b];
                let tail = blk
                    .next
                    .filter(|&n| !blocks[n].mapped)
                    .map_or(0, |n| blocks[n].size);
                blk.size + tail
            };
            for (&k, &n) in range {
                if k.0 != p.stream || expandable_size(n) >= expandable_size(id) {
                    break;
                }
                key = k;
                id = n;
            }
        }
        let candidate = key.1;
        let max_split = self.cfg.max_split_size;
        if p.size < max_split && candidate >= max_split {
            return None;
        }
        if p.size >= max_split
            && candidate >= p.size.saturating_add(self.cfg.max_non_split_rounding_size)
        {
            return None;
        }
        pool.blocks.remove(&key);
        Some(id)
    }

    /// `should_split` (§3.3).
    fn should_split(&self, block: &Block, size: u64) -> bool {
        let remaining = block.size - size;
        if block.pool == PoolKind::Small || self.cfg.expandable {
            remaining >= crate::api::MIN_BLOCK_SIZE
        } else {
            size < self.cfg.max_split_size && remaining > crate::api::SMALL_SIZE
        }
    }

    /// `alloc_block` (§3.4): new memory from the driver. `Ok(None)` when the
    /// device (or the memory fraction) cannot back it.
    fn alloc_block(
        &self,
        st: &mut State,
        p: &Params,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            st.stats.num_alloc_retries += 1;
        }
        if let Some(max) = self.cfg.allowed_memory_maximum {
            if st.total_allocated_memory.saturating_add(p.alloc_size) > max {
                return Ok(None);
            }
        }
        if self.cfg.expandable {
            return self.try_allocate_expandable_block(st, p);
        }
        let Some((base, handle, phys_size)) = self.cuda_malloc(p.alloc_size, &mut st.orphans)?
        else {
            return Ok(None);
        };
        let seg = st.segments.insert(Segment {
            base,
            size: p.alloc_size,
            stream: p.stream,
            pool: p.pool,
            kind: SegmentKind::Classic { handle, phys_size },
        });
        let bid = st
            .blocks
            .insert(Block::free(base, p.alloc_size, p.stream, p.pool, seg, true));
        st.by_addr.insert(base, bid);
        st.total_allocated_memory += p.alloc_size;
        st.stats.segment.increase(1);
        st.stats.reserved_bytes.increase(p.alloc_size);
        if p.alloc_size >= self.cfg.max_split_size {
            st.oversize_segments.increase(1);
        }
        Ok(Some(bid))
    }

    /// A `cudaMalloc` of `size` bytes: `reserve + create + map + set_access`.
    /// `Ok(None)` when the driver is out of memory; every partial step is undone.
    fn cuda_malloc(
        &self,
        size: u64,
        orphans: &mut Vec<Orphan>,
    ) -> Result<Option<(DevicePtr, quilt_vmm::PhysHandle, u64)>, AllocError> {
        let vmm = &*self.vmm;
        let gran = vmm.granularity();
        let Some(phys) = round_up(size, gran) else {
            return Ok(None);
        };
        let oom_or = |e: VmmError| -> Result<Option<_>, AllocError> {
            if e.is_out_of_memory() {
                Ok(None)
            } else {
                Err(AllocError::Driver(e))
            }
        };
        let base = match vmm.reserve(phys, 0) {
            Ok(b) => b,
            Err(e) => return oom_or(e),
        };
        let handle = match vmm.create(phys) {
            Ok(h) => h,
            Err(e) => {
                let _ = give_back(vmm, orphans, Orphan::Range(base, phys));
                return oom_or(e);
            }
        };
        if let Err(e) = vmm.map(base, phys, handle, 0) {
            let _ = give_back(vmm, orphans, Orphan::Handle(handle));
            let _ = give_back(vmm, orphans, Orphan::Range(base, phys));
            return oom_or(e);
        }
        if let Err(e) = vmm.set_access(base, phys) {
            let _ = give_back(vmm, orphans, Orphan::Mapping(base, phys));
            let _ = give_back(vmm, orphans, Orphan::Handle(handle));
            let _ = give_back(vmm, orphans, Orphan::Range(base, phys));
            return oom_or(e);
        }
        Ok(Some((base, handle, phys)))
    }

    /// `alloc_found_block` (§3.6): carve `p.size` from the front of `bid` when
    /// splitting, mark it allocated and count it. Returns the handed-out block.
    fn alloc_found_block(&self, st: &mut State, bid: BlockId, p: &Params, split: bool) -> BlockId {
        let already_split = st.blocks[bid].is_split();
        let expandable = st.segments[st.blocks[bid].segment].is_expandable();
        let out = if split {
            let rem = bid;
            let (ptr, prev, stream, pool, segment) = {
                let r = &st.blocks[rem];
                (r.ptr, r.prev, r.stream, r.pool, r.segment)
            };
            let front = st.blocks.insert(Block {
                prev,
                next: Some(rem),
                ..Block::free(ptr, p.size, stream, pool, segment, true)
            });
            if let Some(pv) = prev {
                st.blocks[pv].next = Some(front);
            }
            st.by_addr.insert(ptr, front);
            let r = &mut st.blocks[rem];
            r.prev = Some(front);
            r.handed_out = false;
            r.ptr += p.size;
            r.size -= p.size;
            let (rptr, rsize) = (r.ptr, r.size);
            st.by_addr.insert(rptr, rem);
            insert_into_blocks(st, rem);
            if !expandable {
                if already_split {
                    st.stats.inactive_split_bytes.decrease(p.size);
                } else {
                    st.stats.inactive_split_bytes.increase(rsize);
                    st.stats.inactive_split.increase(1);
                }
            }
            front
        } else {
            if already_split && !expandable {
                let size = st.blocks[bid].size;
                st.stats.inactive_split_bytes.decrease(size);
                st.stats.inactive_split.decrease(1);
            }
            bid
        };
        let b = &mut st.blocks[out];
        b.allocated = true;
        b.handed_out = true;
        b.requested = p.orig;
        let size = b.size;
        st.stats.allocation.increase(1);
        st.stats.allocated_bytes.increase(size);
        st.stats.active.increase(1);
        st.stats.active_bytes.increase(size);
        st.stats.requested_bytes.increase(p.orig);
        if size >= self.cfg.max_split_size {
            st.oversize_allocations.increase(1);
        }
        out
    }

    // ------------------------------------------------------------ free path

    /// `free_block` (§4): the block becomes reusable; merge with free
    /// neighbours and return it to its pool.
    fn free_block(&self, st: &mut State, bid: BlockId) {
        let (orig_size, requested, prev, next) = {
            let b = &st.blocks[bid];
            (b.size, b.requested, b.prev, b.next)
        };
        let expandable = st.segments[st.blocks[bid].segment].is_expandable();
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        for cand in [prev, next] {
            let subsumed = try_merge_blocks(st, bid, cand);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        st.blocks[bid].requested = 0;
        insert_into_blocks(st, bid);
        if st.blocks[bid].is_split() {
            net_blocks += 1;
            net_bytes += st.blocks[bid].size as i64;
        }
        if !expandable {
            apply_net(&mut st.stats.inactive_split, net_blocks);
            apply_net(&mut st.stats.inactive_split_bytes, net_bytes);
        }
        st.stats.active.decrease(1);
        st.stats.active_bytes.decrease(orig_size);
        st.stats.requested_bytes.decrease(requested);
    }

    /// `process_events`: complete deferred frees whose events have completed,
    /// stopping at each stream's first incomplete event.
    fn process_events(&self, st: &mut State) -> Result<(), AllocError> {
        if st.events.is_empty() {
            return Ok(());
        }
        let streams: Vec<StreamId> = st.events.keys().copied().collect();
        for s in streams {
            while let Some(&(ev, bid)) = st.events.get(&s).and_then(VecDeque::front) {
                if !self.vmm.event_query(ev)? {
                    break;
                }
                if let Some(q) = st.events.get_mut(&s) {
                    q.pop_front();
                }
                self.complete_event(st, bid);
                self.vmm.event_destroy(ev)?;
            }
            if st.events.get(&s).is_some_and(VecDeque::is_empty) {
                st.events.remove(&s);
            }
        }
        Ok(())
    }

    fn complete_event(&self, st: &mut State, bid: BlockId) {
        let b = &mut st.blocks[bid];
        b.event_count = b.event_count.saturating_sub(1);
        if b.event_count == 0 {
            self.free_block(st, bid);
        }
    }

    /// `synchronize_and_free_events`: wait for every stream with pending frees
    /// and complete them all.
    fn synchronize_and_free_events(&self, st: &mut State) -> Result<(), AllocError> {
        while let Some((&s, _)) = st.events.iter().next() {
            self.vmm.stream_synchronize(s)?;
            let queue = st.events.remove(&s).unwrap_or_default();
            let mut first_err = None;
            for (ev, bid) in queue {
                self.complete_event(st, bid);
                if let Err(e) = self.vmm.event_destroy(ev) {
                    first_err.get_or_insert(e);
                }
            }
            if let Some(e) = first_err {
                return Err(e.into());
            }
        }
        Ok(())
    }

    // -------------------------------------------------------- releasing

    /// `release_cached_blocks` (§5).
    fn release_cached_blocks(&self, st: &mut State) -> Result<(), AllocError> {
        self.synchronize_and_free_events(st)?;
        self.release_blocks(st, PoolKind::Large)?;
        self.release_blocks(st, PoolKind::Small)
    }

    /// `release_blocks`: free every whole free segment of the pool, unmap every
    /// free expandable page, and free expandable segments left wholly unmapped.
    fn release_blocks(&self, st: &mut State, pool: PoolKind) -> Result<(), AllocError> {
        let ids: Vec<BlockId> = st.pools[pool.index()].blocks.values().copied().collect();
        let mut to_unmap = Vec::new();
        for bid in ids {
            let b = &st.blocks[bid];
            if st.segments[b.segment].is_expandable() {
                to_unmap.push(bid);
            } else if !b.is_split() {
                self.release_block(st, bid)?;
            }
        }
        for bid in to_unmap {
            self.unmap_block(st, bid)?;
            if !st.blocks[bid].is_split() && !st.blocks[bid].mapped {
                self.release_expandable_segment(st, bid)?;
            }
        }
        Ok(())
    }

    /// `release_block`: `cudaFree` a free block that is a whole classic
    /// segment, synchronising the device first as `cudaFree` does (one
    /// [`Vmm::device_synchronize`], counted as one stream synchronisation).
    fn release_block(&self, st: &mut State, bid: BlockId) -> Result<(), AllocError> {
        let b = &st.blocks[bid];
        let seg_id = b.segment;
        let seg = &st.segments[seg_id];
        let SegmentKind::Classic { handle, phys_size } = seg.kind else {
            return Ok(());
        };
        let (base, size, pool, key) = (seg.base, seg.size, b.pool, size_key(b));
        // `cudaFree` synchronises the device before it frees: no work queued
        // on any stream may still use the segment when it is unmapped.
        self.vmm.device_synchronize()?;
        self.vmm.unmap(base, phys_size)?;
        let released = give_back(&*self.vmm, &mut st.orphans, Orphan::Handle(handle));
        let freed = give_back(&*self.vmm, &mut st.orphans, Orphan::Range(base, phys_size));
        st.pools[pool.index()].blocks.remove(&key);
        st.by_addr.remove(&base);
        st.blocks.remove(bid);
        st.segments.remove(seg_id);
        st.total_allocated_memory -= size;
        st.stats.segment.decrease(1);
        st.stats.reserved_bytes.decrease(size);
        if size >= self.cfg.max_split_size {
            st.oversize_segments.decrease(1);
        }
        released?;
        freed?;
        Ok(())
    }

    /// `release_available_cached_blocks` (§3.5): with `max_split_size` set, free
    /// one cached oversize segment big enough, or several from the largest down.
    fn release_available_cached_blocks(
        &self,
        st: &mut State,
        p: &Params,
    ) -> Result<bool, AllocError> {
        let max_split = self.cfg.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let target = p.size.max(max_split);
        let pool = &st.pools[p.pool.index()];
        let single = pool
            .blocks
            .range((p.stream, target, 0)..)
            .next()
            .filter(|(k, &id)| k.0 == p.stream && is_releasable(st, id))
            .map(|(_, &id)| id);
        if let Some(bid) = single {
            self.release_block(st, bid)?;
            return Ok(true);
        }
        let walk: Vec<(u64, BlockId)> = pool
            .blocks
            .range(..(p.stream, target, 0))
            .rev()
            .take_while(|(k, _)| k.0 == p.stream && k.1 >= max_split)
            .map(|(k, &id)| (k.1, id))
            .collect();
        let mut released = 0u64;
        for (size, bid) in walk {
            if released >= target {
                break;
            }
            if is_releasable(st, bid) {
                self.release_block(st, bid)?;
                released += size;
            }
        }
        Ok(released >= target)
    }

    /// `garbage_collect_cached_blocks` (§3.7): free aged, unsplit large blocks
    /// until usage falls under the threshold.
    fn garbage_collect_cached_blocks(&self, st: &mut State) -> Result<(), AllocError> {
        let Some(allowed) = self.cfg.allowed_memory_maximum else {
            return Ok(());
        };
        let threshold = (self.cfg.gc_threshold * allowed as f64) as u64;
        if st.total_allocated_memory <= threshold {
            return Ok(());
        }
        let target = st.total_allocated_memory - threshold;
        let large = PoolKind::Large.index();
        let freeable = |st: &State| -> Vec<(BlockId, u64, u64)> {
            let clock = st.pools[large].get_free_blocks_call_count;
            st.pools[large]
                .blocks
                .values()
                .filter(|&&id| {
                    let b = &st.blocks[id];
                    !b.is_split() && !st.segments[b.segment].is_expandable()
                })
                .map(|&id| {
                    let b = &st.blocks[id];
                    (id, clock.saturating_sub(b.gc_count_base), b.size)
                })
                .collect()
        };
        let initial = freeable(st);
        let mut total_age: u64 = initial.iter().map(|c| c.1).sum();
        let mut count = initial.len() as u64;
        if count == 0 {
            return Ok(());
        }
        let mut reclaimed = 0u64;
        let mut block_freed = true;
        while reclaimed < target && block_freed && count > 0 {
            let age_threshold = total_age as f64 / count as f64;
            block_freed = false;
            for (bid, age, size) in freeable(st) {
                if age as f64 >= age_threshold {
                    block_freed = true;
                    reclaimed += size;
                    total_age = total_age.saturating_sub(age);
                    count -= 1;
                    self.release_block(st, bid)?;
                }
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------ reports

    /// The out-of-memory error for a request nothing could serve (§3.8).
    fn out_of_memory(&self, st: &mut State, p: &Params) -> AllocError {
        st.stats.num_ooms += 1;
        let err = report::oom(
            self.name,
            &*self.vmm,
            &self.cfg,
            st,
            p.orig,
            p.size,
            p.alloc_size,
            p.pool,
            p.stream,
        );
        st.last_oom = err.oom_report().cloned();
        err
    }
}

impl DeviceAllocator for CachingAllocator {
    /// The driver backend.
    fn vmm(&self) -> &Arc<dyn Vmm> {
        &self.vmm
    }

    /// `classic` or `expandable`.
    fn name(&self) -> &str {
        self.name
    }

    /// `malloc` (reference §3.1).
    fn allocate(&self, orig: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        check_size(orig)?;
        let mut guard = self.lock()?;
        let st = &mut *guard;
        if !st.forgotten.is_empty() {
            st.forgotten.remove(&stream); // named again: a new stream
        }
        self.process_events(st)?;
        let size = round_size(orig, &self.cfg.divisions);
        let p = Params {
            orig,
            size,
            alloc_size: allocation_size(size),
            pool: PoolKind::of(size),
            stream,
        };
        let mut found = self.get_free_block(st, &p);
        if found.is_none() {
            if self.gc_enabled() {
                self.garbage_collect_cached_blocks(st)?;
            }
            found = self.alloc_block(st, &p, false)?;
            if found.is_none() && self.release_available_cached_blocks(st, &p)? {
                found = self.alloc_block(st, &p, false)?;
            }
            if found.is_none() {
                self.release_cached_blocks(st)?;
                found = self.alloc_block(st, &p, true)?;
            }
        }
        let Some(bid) = found else {
            return Err(self.out_of_memory(st, &p));
        };
        let split = self.should_split(&st.blocks[bid], p.size);
        let bid = self.alloc_found_block(st, bid, &p, split);
        let b = &st.blocks[bid];
        Ok(Allocation {
            ptr: b.ptr,
            size: b.size,
        })
    }

    /// `free` (§4): the caller gives `ptr` back.
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        let bid = live_block(st, ptr)?;
        let uses = std::mem::take(&mut st.blocks[bid].stream_uses);
        let mut recorded = Vec::with_capacity(uses.len());
        for &s in &uses {
            match self.vmm.event_record(s) {
                Ok(e) => recorded.push((s, e)),
                Err(e) => {
                    for (_, ev) in recorded {
                        let _ = self.vmm.event_destroy(ev);
                    }
                    st.blocks[bid].stream_uses = uses;
                    return Err(AllocError::Driver(e));
                }
            }
        }
        let b = &mut st.blocks[bid];
        b.allocated = false;
        let size = b.size;
        st.stats.allocation.decrease(1);
        st.stats.allocated_bytes.decrease(size);
        if size >= self.cfg.max_split_size {
            st.oversize_allocations.decrease(1);
        }
        if recorded.is_empty() {
            self.free_block(st, bid);
        } else {
            st.blocks[bid].event_count = recorded.len() as u32;
            for (s, e) in recorded {
                st.events.entry(s).or_default().push_back((e, bid));
            }
        }
        Ok(())
    }

    /// `recordStream`: note a use of the live block at `ptr` on `stream`.
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        let bid = live_block(st, ptr).map_err(|_| AllocError::UnknownPointer { ptr })?;
        if !st.forgotten.is_empty() {
            st.forgotten.remove(&stream); // named again: a new stream
        }
        let b = &mut st.blocks[bid];
        if b.stream != stream && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Forget `stream` (its owner is destroying it): synchronise it once,
    /// complete its deferred frees, drop it from the recorded uses of live
    /// blocks (their uses on it are complete), and have the backend forget
    /// it; from then on no call names it (its blocks cached in the pools
    /// stay, free, for a later stream of the same id; its expandable
    /// segments are unmapped without synchronising it). The default stream
    /// cannot be forgotten ([`AllocError::StreamBusy`]).
    fn forget_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        if stream == StreamId::DEFAULT {
            return Err(AllocError::StreamBusy {
                stream: stream.0,
                reason: "the default stream cannot be forgotten",
            });
        }
        let mut guard = self.lock()?;
        let st = &mut *guard;
        if st.forgotten.contains(&stream) {
            return Ok(());
        }
        self.vmm.stream_synchronize(stream)?;
        let mut first_err = None;
        for (ev, bid) in st.events.remove(&stream).unwrap_or_default() {
            self.complete_event(st, bid);
            if let Err(e) = self.vmm.event_destroy(ev) {
                first_err.get_or_insert(e);
            }
        }
        let users: Vec<BlockId> = st
            .blocks
            .iter()
            .filter(|(_, b)| b.stream_uses.contains(&stream))
            .map(|(id, _)| id)
            .collect();
        for bid in users {
            st.blocks[bid].stream_uses.retain(|s| *s != stream);
        }
        st.forgotten.insert(stream);
        self.vmm.forget_stream(stream)?;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// `empty_cache`: `release_cached_blocks`.
    fn empty_cache(&self) -> Result<(), AllocError> {
        let mut guard = self.lock()?;
        self.release_cached_blocks(&mut guard)
    }

    /// Sets every peak to its current value.
    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.lock()?.stats.reset_peaks();
        Ok(())
    }

    /// Statistics, with the driver's counters.
    fn stats(&self) -> AllocatorStats {
        let mut s = match self.state.lock() {
            Ok(st) => st.stats.clone(),
            Err(poisoned) => poisoned.into_inner().stats.clone(),
        };
        s.driver = self.vmm.driver_stats();
        s
    }

    /// Segments and blocks.
    fn snapshot(&self) -> MemorySnapshot {
        match self.state.lock() {
            Ok(st) => report::snapshot(self.name, &st),
            Err(poisoned) => report::snapshot(self.name, &poisoned.into_inner()),
        }
    }

    /// The invariant checker.
    #[cfg(feature = "invariants")]
    fn check_invariants(&self) -> Result<(), crate::error::InvariantViolation> {
        let st = self
            .state
            .lock()
            .map_err(|_| crate::error::InvariantViolation("allocator state poisoned".into()))?;
        invariants::check(&self.cfg, &st)
    }

    /// The report of the last request that ran out of memory.
    fn last_oom(&self) -> Option<crate::error::OomReport> {
        match self.state.lock() {
            Ok(st) => st.last_oom.clone(),
            Err(poisoned) => poisoned.into_inner().last_oom.clone(),
        }
    }
}

impl Drop for CachingAllocator {
    /// Give every driver resource back (live blocks included: the allocator is
    /// going away), so the backend's leak report stays empty.
    fn drop(&mut self) {
        let st = match self.state.get_mut() {
            Ok(st) => st,
            Err(poisoned) => poisoned.into_inner(),
        };
        for (_, queue) in std::mem::take(&mut st.events) {
            for (ev, _) in queue {
                let _ = self.vmm.event_destroy(ev);
            }
        }
        for (_, seg) in st.segments.iter() {
            match &seg.kind {
                SegmentKind::Classic { handle, phys_size } => {
                    let _ = self.vmm.unmap(seg.base, *phys_size);
                    let _ = self.vmm.release(*handle);
                    let _ = self.vmm.address_free(seg.base, *phys_size);
                }
                SegmentKind::Expandable { page, handles } => {
                    for (i, h) in handles.iter().enumerate() {
                        if let Some(h) = h {
                            let _ = self.vmm.unmap(seg.base + i as u64 * page, *page);
                            let _ = self.vmm.release(*h);
                        }
                    }
                    let _ = self.vmm.address_free(seg.base, seg.size);
                }
            }
        }
        for orphan in std::mem::take(&mut st.orphans) {
            let _ = give_back(&*self.vmm, &mut Vec::new(), orphan);
        }
    }
}

/// The allocated block that starts at `ptr`, or the error for a pointer that is
/// not live: [`AllocError::DoubleFree`] for the start of a free or pending
/// block, [`AllocError::UnknownPointer`] otherwise.
fn live_block(st: &State, ptr: DevicePtr) -> Result<BlockId, AllocError> {
    match st.by_addr.get(&ptr) {
        Some(&bid) if st.blocks[bid].allocated => Ok(bid),
        Some(&bid) if st.blocks[bid].handed_out => Err(AllocError::DoubleFree { ptr }),
        _ => Err(AllocError::UnknownPointer { ptr }),
    }
}

/// A free block that is a whole classic segment (what `cudaFree` can take).
fn is_releasable(st: &State, bid: BlockId) -> bool {
    let b = &st.blocks[bid];
    !b.is_split() && !st.segments[b.segment].is_expandable()
}

/// `insert_into_blocks`: put a free mapped block into its pool's set and stamp
/// its GC age.
fn insert_into_blocks(st: &mut State, bid: BlockId) {
    let b = &mut st.blocks[bid];
    let pool = &mut st.pools[b.pool.index()];
    b.gc_count_base = pool.get_free_blocks_call_count;
    pool.blocks.insert(size_key(b), bid);
}

/// `try_merge_blocks`: absorb the neighbour `src` into `dst` when it is free with
/// the same mapped state. `dst` must not be in any pool set. Returns the bytes
/// absorbed (0 when no merge).
fn try_merge_blocks(st: &mut State, dst: BlockId, src: Option<BlockId>) -> u64 {
    let Some(src) = src else {
        return 0;
    };
    let s = &st.blocks[src];
    if !s.is_free() || s.mapped != st.blocks[dst].mapped {
        return 0;
    }
    let (s_ptr, s_size, s_prev, s_next, s_mapped, s_stream, s_handed_out) = (
        s.ptr,
        s.size,
        s.prev,
        s.next,
        s.mapped,
        s.stream,
        s.handed_out,
    );
    let pool = &mut st.pools[s.pool.index()];
    if s_mapped {
        pool.blocks.remove(&size_key(s));
    } else {
        pool.unmapped.remove(&(s_stream, s_ptr));
    }
    st.by_addr.remove(&s_ptr);
    if st.blocks[dst].prev == Some(src) {
        let old = st.blocks[dst].ptr;
        st.by_addr.remove(&old);
        st.by_addr.insert(s_ptr, dst);
        let d = &mut st.blocks[dst];
        d.ptr = s_ptr;
        d.prev = s_prev;
        d.handed_out = s_handed_out;
        if let Some(pv) = s_prev {
            st.blocks[pv].next = Some(dst);
        }
    } else {
        st.blocks[dst].next = s_next;
        if let Some(nx) = s_next {
            st.blocks[nx].prev = Some(dst);
        }
    }
    st.blocks[dst].size += s_size;
    st.blocks.remove(src);
    s_size
}

/// Apply a signed net change to a statistic, as PyTorch does.
fn apply_net(stat: &mut Stat, net: i64) {
    if net > 0 {
        stat.increase(net as u64);
    } else if net < 0 {
        stat.decrease(net.unsigned_abs());
    }
}

#[cfg(test)]
mod tests;
