//! The allocator's state and its algorithms: placement, backing blocks with
//! pages, reclaiming cached pages, freeing, stream events.
//!
//! Everything here runs under the allocator's one lock.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use quilt_pool::{PagePool, PageRun, PoolError};
use quilt_vmm::{DevicePtr, EventId, StreamId, VmmError};

use super::arena::Arena;
use super::config::{QuiltConfig, ReclaimPolicy};
use crate::api::{check_size, round_up, Allocation, MIN_BLOCK_SIZE};
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::stats::{AllocatorStats, Stat};

/// Size class of an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// Requests up to the small size.
    Small,
    /// Larger requests.
    Large,
}

/// What the algorithms need besides the state: the driver, the pool, the policy.
pub(crate) struct Ctx<'a> {
    pub(crate) vmm: &'a dyn quilt_vmm::Vmm,
    pub(crate) pool: &'a PagePool,
    pub(crate) cfg: &'a QuiltConfig,
    pub(crate) page: u64,
    pub(crate) arena_va: u64,
    pub(crate) name: &'a str,
}

/// One block that holds its virtual range: live, or freed and waiting on events.
#[derive(Clone, Debug)]
pub(crate) struct BlockRec {
    pub(crate) arena: usize,
    pub(crate) off: u64,
    pub(crate) size: u64,
    pub(crate) requested: u64,
    pub(crate) stream: StreamId,
    pub(crate) recorded: Vec<StreamId>,
    /// `Some(events)` once freed while recorded on other streams: the range is
    /// reusable when every event has completed.
    pub(crate) pending: Option<Vec<EventId>>,
}

/// How many freed pointers are remembered to tell a double free from an unknown pointer.
const FREED_MEMORY: usize = 1 << 16;

/// The allocator's state.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) arenas: Vec<Arena>,
    /// The stream of each arena (`None`: shared by every stream) and its class.
    pub(crate) arena_meta: Vec<(Option<StreamId>, Kind)>,
    pub(crate) arena_index: HashMap<(Option<StreamId>, Kind), usize>,
    /// Stream -> its hazard bit; streams past the 63rd share bit 63.
    stream_bits: HashMap<StreamId, u32>,
    /// Bit -> the streams it stands for.
    bit_streams: Vec<Vec<StreamId>>,
    /// Streams whose earlier work may still use free pages of the pool (pages
    /// reclaimed from blocks they freed); a stream taking pool pages waits for them.
    pub(crate) pool_hazard: u64,
    pub(crate) blocks: HashMap<DevicePtr, BlockRec>,
    pub(crate) pending: Vec<DevicePtr>,
    freed_recent: HashSet<DevicePtr>,
    freed_order: VecDeque<DevicePtr>,
    /// Mappings with cached pages: (class, tick, arena, start page). See
    /// [`super::arena::Mapping::reclaim_class`].
    pub(crate) reclaim: BTreeSet<(u8, u64, usize, u64)>,
    pub(crate) tick: u64,
    pub(crate) stats: AllocatorStats,
    /// Pool pages that backed live blocks and could not be mapped again after
    /// a reclaim (a driver failure three times over); returned at drop.
    pub(crate) lost_runs: Vec<PageRun>,
}

fn set_stat(stat: &mut Stat, value: u64) {
    if value > stat.current {
        stat.increase(value - stat.current);
    } else if value < stat.current {
        stat.decrease(stat.current - value);
    }
}

impl State {
    /// Bring the listing of mapping `start` of arena `ai` in the reclaim order up to date.
    pub(crate) fn resync(&mut self, ai: usize, start: u64) {
        let Some(m) = self.arenas[ai].mappings.get_mut(&start) else {
            return;
        };
        let want = m.reclaim_class().map(|c| (c, m.tick));
        if m.listed == want {
            return;
        }
        if let Some((c, t)) = m.listed {
            self.reclaim.remove(&(c, t, ai, start));
        }
        if let Some((c, t)) = want {
            self.reclaim.insert((c, t, ai, start));
        }
        m.listed = want;
    }

    fn forget_mapping(&mut self, ai: usize, start: u64) -> Option<super::arena::Mapping> {
        let m = self.arenas[ai].remove_mapping(start)?;
        if let Some((c, t)) = m.listed {
            self.reclaim.remove(&(c, t, ai, start));
        }
        Some(m)
    }

    fn touch(&mut self, ai: usize, off: u64, len: u64, add: bool) {
        let (first, last) = self.arenas[ai].page_span(off, len);
        let tick = self.tick;
        for start in self.arenas[ai].touch_range(first, last, add, tick) {
            self.resync(ai, start);
        }
    }

    /// Cached pages in every arena (mapped, touched by no block).
    pub(crate) fn cached_pages(&self) -> u64 {
        self.arenas.iter().map(|a| a.cached_pages).sum()
    }

    /// Cached pages that reclaiming can free under the policy: all of them, or
    /// (without remapping live pages) those of mappings no block touches.
    pub(crate) fn reclaimable_pages(&self, cfg: &QuiltConfig) -> u64 {
        if cfg.remap_live_pages {
            return self.cached_pages();
        }
        self.reclaim
            .range((0, 0, 0, 0)..(1, 0, 0, 0))
            .filter_map(|&(_, _, ai, start)| self.arenas[ai].mappings.get(&start))
            .map(|m| m.untouched)
            .sum()
    }

    /// The hazard bit of `stream`.
    fn stream_bit(&mut self, stream: StreamId) -> u64 {
        if let Some(&b) = self.stream_bits.get(&stream) {
            return 1 << b;
        }
        let b = (self.stream_bits.len() as u32).min(63);
        self.stream_bits.insert(stream, b);
        if self.bit_streams.len() <= b as usize {
            self.bit_streams.resize(b as usize + 1, Vec::new());
        }
        self.bit_streams[b as usize].push(stream);
        1 << b
    }

    /// Make `stream` wait for the work of every other stream in `mask`.
    fn wait_for(&mut self, ctx: &Ctx<'_>, stream: StreamId, mask: u64) -> Result<(), AllocError> {
        let mut rest = mask;
        while rest != 0 {
            let b = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let others: Vec<StreamId> = self
                .bit_streams
                .get(b)
                .map(|v| v.iter().copied().filter(|&s| s != stream).collect())
                .unwrap_or_default();
            for donor in others {
                let ev = ctx.vmm.event_record(donor)?;
                let waited = ctx.vmm.stream_wait_event(stream, ev);
                let _ = ctx.vmm.event_destroy(ev);
                waited?;
                self.stats.num_stream_waits += 1;
            }
        }
        Ok(())
    }

    fn arena_for(
        &mut self,
        ctx: &Ctx<'_>,
        stream: StreamId,
        kind: Kind,
    ) -> Result<usize, AllocError> {
        let owner = if ctx.cfg.shared_arena {
            None
        } else {
            Some(stream)
        };
        if let Some(&i) = self.arena_index.get(&(owner, kind)) {
            return Ok(i);
        }
        let base = ctx.vmm.reserve(ctx.arena_va, 0)?;
        let i = self.arenas.len();
        self.arenas.push(Arena::new(base, ctx.arena_va, ctx.page));
        self.arena_meta.push((owner, kind));
        self.arena_index.insert((owner, kind), i);
        Ok(i)
    }

    /// Refresh the statistics derived from the pool and the arenas.
    pub(crate) fn sync_stats(&mut self, ctx: &Ctx<'_>) {
        let ps = ctx.pool.stats();
        set_stat(&mut self.stats.reserved_bytes, ps.held_bytes);
        set_stat(&mut self.stats.segment, ps.chunks);
        let touched: u64 = self.arenas.iter().map(|a| a.touched_pages).sum();
        let split = (touched * ctx.page).saturating_sub(self.stats.active_bytes.current);
        set_stat(&mut self.stats.inactive_split_bytes, split);
        let holes: u64 = self
            .arenas
            .iter()
            .map(|a| (a.gaps.len() as u64).saturating_sub(1))
            .sum();
        set_stat(&mut self.stats.inactive_split, holes);
    }

    fn remember_freed(&mut self, ptr: DevicePtr) {
        if self.freed_recent.insert(ptr) {
            self.freed_order.push_back(ptr);
            if self.freed_order.len() > FREED_MEMORY {
                if let Some(old) = self.freed_order.pop_front() {
                    self.freed_recent.remove(&old);
                }
            }
        }
    }

    /// Complete the frees whose events have all completed.
    pub(crate) fn poll_pending(&mut self, ctx: &Ctx<'_>) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        for ptr in pending {
            let done = match self.blocks.get(&ptr).and_then(|b| b.pending.as_ref()) {
                Some(evs) => evs.iter().all(|&e| ctx.vmm.event_query(e).unwrap_or(false)),
                None => continue,
            };
            if done {
                if let Some(evs) = self.blocks.get(&ptr).and_then(|b| b.pending.clone()) {
                    for e in evs {
                        let _ = ctx.vmm.event_destroy(e);
                    }
                }
                self.finish_free(ptr);
            } else {
                self.pending.push(ptr);
            }
        }
    }

    fn finish_free(&mut self, ptr: DevicePtr) {
        let Some(b) = self.blocks.remove(&ptr) else {
            return;
        };
        self.touch(b.arena, b.off, b.size, false);
        let bit = self.stream_bit(b.stream);
        let (first, last) = self.arenas[b.arena].page_span(b.off, b.size);
        self.arenas[b.arena].mark_freed(first, last, bit);
        self.arenas[b.arena].vacate(b.off);
        self.stats.active_bytes.decrease(b.size);
        self.stats.active.decrease(1);
        self.stats.requested_bytes.decrease(b.requested);
        self.remember_freed(ptr);
    }

    /// Allocate `size` bytes on `stream`.
    pub(crate) fn allocate(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        check_size(size)?;
        let rounded = round_up(size, MIN_BLOCK_SIZE).ok_or(AllocError::InvalidSize {
            size,
            reason: "size overflows when rounded",
        })?;
        self.tick += 1;
        self.poll_pending(ctx);
        let kind = if ctx.cfg.separate_small_arena && size <= ctx.cfg.small_size {
            Kind::Small
        } else {
            Kind::Large
        };
        let whole_pages = rounded.div_ceil(ctx.page);
        if whole_pages > ctx.pool.limit_pages() || rounded > ctx.arena_va {
            return Err(self.oom(ctx, size, whole_pages, 0));
        }
        let ai = self.arena_for(ctx, stream, kind)?;
        let Some(off) = self.place(ctx, ai, kind, size, rounded) else {
            return Err(self.oom(ctx, size, whole_pages, 0));
        };
        self.arenas[ai].occupy(off, rounded);
        if ctx.cfg.single_owner_runs {
            if let Err(e) = self.split_for_block(ctx, ai, off, rounded) {
                self.arenas[ai].vacate(off);
                self.sync_stats(ctx);
                return Err(e);
            }
        }
        self.touch(ai, off, rounded, true);
        let (first, last) = self.arenas[ai].page_span(off, rounded);
        let hazard = self.arenas[ai].hazard(first, last);
        if hazard != 0 {
            if let Err(e) = self.wait_for(ctx, stream, hazard) {
                self.touch(ai, off, rounded, false);
                self.arenas[ai].vacate(off);
                return Err(e);
            }
            self.arenas[ai].clear_hazard_inside(off, rounded);
        }
        let runs = self.arenas[ai].unmapped_runs(first, last);
        let n: u64 = runs.iter().map(|r| r.1).sum();
        if n > 0 {
            let cuts = if ctx.cfg.single_owner_runs {
                block_cuts(off, rounded, ctx.page)
            } else {
                Vec::new()
            };
            if let Err(e) = self.back_pages(ctx, ai, stream, size, runs, n, last, &cuts) {
                self.touch(ai, off, rounded, false);
                self.arenas[ai].vacate(off);
                self.sync_stats(ctx);
                return Err(e);
            }
        }
        let ptr = self.arenas[ai].base + off;
        self.blocks.insert(
            ptr,
            BlockRec {
                arena: ai,
                off,
                size: rounded,
                requested: size,
                stream,
                recorded: Vec::new(),
                pending: None,
            },
        );
        self.freed_recent.remove(&ptr);
        self.stats.allocated_bytes.increase(rounded);
        self.stats.allocation.increase(1);
        self.stats.active_bytes.increase(rounded);
        self.stats.active.increase(1);
        self.stats.requested_bytes.increase(size);
        self.sync_stats(ctx);
        Ok(Allocation { ptr, size: rounded })
    }

    /// Where a block of `rounded` bytes (asked for as `size`) goes in arena `ai`.
    ///
    /// Quilt's default (stitch threshold 0): the best-fitting gap, at its start.
    /// With a stitch threshold (GMLake), a large request below it is served
    /// from a cached range whose pages are all mapped, else from fresh,
    /// page-aligned virtual space past the arena's mapped tail (new pages, no
    /// stitching); a request at or above it reuses a cached range of at most
    /// `reuse_limit` times its size, else is stitched like any Quilt block.
    fn place(&self, ctx: &Ctx<'_>, ai: usize, kind: Kind, size: u64, rounded: u64) -> Option<u64> {
        let a = &self.arenas[ai];
        let threshold = ctx.cfg.stitch_threshold;
        if threshold == 0 || kind == Kind::Small {
            if ctx.cfg.prefer_mapped_tries > 0 {
                if let Some(off) = a.best_fit_mapped(rounded, u64::MAX, ctx.cfg.prefer_mapped_tries)
                {
                    return Some(off);
                }
            }
            return a.best_fit(rounded);
        }
        let limit = if size >= threshold && ctx.cfg.reuse_limit > 0 {
            rounded.saturating_mul(ctx.cfg.reuse_limit)
        } else {
            u64::MAX
        };
        if let Some(off) = a.best_fit_mapped(rounded, limit, 64) {
            return Some(off);
        }
        if size >= threshold {
            return a.best_fit(rounded);
        }
        a.fresh_tail(rounded)
    }

    /// Back the unmapped page runs `runs` of arena `ai` (n pages in all, the
    /// block's last page being `last`) with pool pages.
    #[allow(clippy::too_many_arguments)]
    fn back_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        stream: StreamId,
        size: u64,
        mut runs: Vec<(u64, u64)>,
        n: u64,
        last: u64,
        cuts: &[u64],
    ) -> Result<(), AllocError> {
        self.obtain_free_pages(ctx, size, n)?;
        let mut n = n;
        if ctx.cfg.map_ahead {
            // Only behind a block whose last page is newly mapped, at the tail.
            if runs.last().is_some_and(|r| r.0 + r.1 == last + 1) {
                let extra = self.map_ahead_pages(ctx, ai, last, n);
                if let Some(r) = runs.last_mut() {
                    r.1 += extra;
                    n += extra;
                }
            }
        }
        if self.pool_hazard != 0 {
            let h = self.pool_hazard;
            self.wait_for(ctx, stream, h)?;
        }
        let pruns = ctx.pool.take(n).map_err(pool_err)?;
        if ctx.pool.free_pages() == 0 {
            self.pool_hazard = 0;
        }
        self.map_runs(ctx, ai, &runs, pruns, cuts)
    }

    /// Pages to map ahead of demand behind a block whose last page is `last`:
    /// only when the block extends the arena's mapped tail, only from pages
    /// already free in the pool (its growth margin), at most the margin.
    fn map_ahead_pages(&self, ctx: &Ctx<'_>, ai: usize, last: u64, n: u64) -> u64 {
        let a = &self.arenas[ai];
        if a.mappings.range(last + 1..).next().is_some() {
            return 0;
        }
        let spare = ctx.pool.free_pages().saturating_sub(n);
        let growth = ctx.cfg.pool.growth;
        let held = ctx.pool.total_pages();
        let cap = growth
            .chunk_pages(0, held, ctx.page)
            .min(growth.max_chunk_bytes / ctx.page);
        let room = (a.size / ctx.page).saturating_sub(last + 1);
        spare.min(cap).min(room)
    }

    /// Make at least `n` pages free in the pool: by the reclaim policy, growth,
    /// and reclaiming cached pages when the pool cannot grow.
    fn obtain_free_pages(&mut self, ctx: &Ctx<'_>, size: u64, n: u64) -> Result<(), AllocError> {
        let missing = |pool: &PagePool| n.saturating_sub(pool.free_pages());
        if missing(ctx.pool) == 0 {
            return Ok(());
        }
        match ctx.cfg.reclaim {
            ReclaimPolicy::WhenFull => {}
            ReclaimPolicy::Always => {
                self.reclaim(ctx, missing(ctx.pool), None)?;
            }
            ReclaimPolicy::CachedAbove(per_mille) => {
                let allowed = ctx.pool.total_pages().saturating_mul(per_mille) / 1000;
                let excess = self.cached_pages().saturating_sub(allowed);
                let want = excess.min(missing(ctx.pool));
                if want > 0 {
                    self.reclaim(ctx, want, None)?;
                }
            }
            ReclaimPolicy::IdleFor(k) => {
                let before = self.tick.saturating_sub(k);
                self.reclaim(ctx, missing(ctx.pool), Some(before))?;
            }
        }
        if missing(ctx.pool) == 0 {
            return Ok(());
        }
        if self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        // The pool cannot grow by all that is missing: is there enough at all?
        let growable = ctx.pool.growable_pages().map_err(pool_err)?;
        let cached = self.reclaimable_pages(ctx.cfg);
        if cached + growable < missing(ctx.pool) {
            return Err(self.oom(ctx, size, n, growable));
        }
        self.stats.num_alloc_retries += 1;
        let want = missing(ctx.pool)
            .saturating_sub(growable)
            .max(1)
            .min(cached);
        self.reclaim(ctx, want, None)?;
        if missing(ctx.pool) == 0 {
            return Ok(());
        }
        if self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        // A last resort: everything cached.
        self.reclaim(ctx, u64::MAX, None)?;
        if missing(ctx.pool) == 0 || self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        let growable = ctx.pool.growable_pages().map_err(pool_err)?;
        Err(self.oom(ctx, size, n, growable))
    }

    /// Grow the pool by `pages`; false when the limit or the device says no.
    fn try_grow(&mut self, ctx: &Ctx<'_>, pages: u64) -> Result<bool, AllocError> {
        match ctx.pool.grow(pages) {
            Ok(_) => Ok(true),
            Err(PoolError::LimitReached { .. }) => Ok(false),
            Err(PoolError::Driver(e)) if e.is_out_of_memory() => Ok(false),
            Err(e) => Err(pool_err(e)),
        }
    }

    /// Reclaim cached pages into the pool until `target` pages are gained or
    /// nothing (eligible) is left; with `idle_before`, only mappings whose
    /// cached pages have not changed since that tick. Pages of another stream's arena are
    /// taken only after `stream` waits for that stream's work. Returns the
    /// pages gained.
    pub(crate) fn reclaim(
        &mut self,
        ctx: &Ctx<'_>,
        target: u64,
        idle_before: Option<u64>,
    ) -> Result<u64, AllocError> {
        let mut gained = 0;
        while gained < target {
            let classes = if ctx.cfg.remap_live_pages { 2u8 } else { 1 };
            let key = match idle_before {
                Some(t) => (0u8..classes).find_map(|c| {
                    self.reclaim
                        .range((c, 0, 0, 0)..(c, t.saturating_add(1), 0, 0))
                        .next()
                        .copied()
                }),
                None => self.reclaim.range(..(classes, 0, 0, 0)).next().copied(),
            };
            let Some((_, _, ai, start)) = key else {
                break;
            };
            self.sync_before_unmap(ctx, ai)?;
            gained += self.reclaim_mapping(ctx, ai, start)?;
        }
        Ok(gained)
    }

    /// Synchronise the streams that may use arena `ai` before unmapping pages
    /// of it, if the policy says so.
    fn sync_before_unmap(&self, ctx: &Ctx<'_>, ai: usize) -> Result<(), AllocError> {
        if ctx.cfg.synchronize_before_unmap {
            let streams: Vec<StreamId> = match self.arena_meta[ai].0 {
                Some(s) => vec![s],
                None => self.stream_bits.keys().copied().collect(),
            };
            for s in streams {
                ctx.vmm.stream_synchronize(s)?;
            }
        }
        Ok(())
    }

    /// Keep mappings single-owner for a block about to occupy `off .. off +
    /// len` of arena `ai` (not yet touched): every multi-page mapping over the
    /// block's pages that does not lie wholly inside the pages the block fully
    /// covers is untouched (single-owner invariant), so it is unmapped and
    /// mapped again as pieces cut at the block's boundaries.
    fn split_for_block(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        off: u64,
        len: u64,
    ) -> Result<(), AllocError> {
        let page = ctx.page;
        let (first, last) = self.arenas[ai].page_span(off, len);
        let (inner_first, inner_end) = (off.div_ceil(page), (off + len) / page);
        let from = self.arenas[ai].mapping_of(first).unwrap_or(first);
        let split: Vec<u64> = self.arenas[ai]
            .mappings
            .range(from..=last)
            .filter(|(&s, m)| m.pages > 1 && !(s >= inner_first && s + m.pages <= inner_end))
            .map(|(&s, _)| s)
            .collect();
        if split.is_empty() {
            return Ok(());
        }
        self.sync_before_unmap(ctx, ai)?;
        let cuts = block_cuts(off, len, page);
        for start in split {
            let Some(m) = self.arenas[ai].mappings.get(&start).copied() else {
                continue;
            };
            debug_assert_eq!(m.untouched, m.pages);
            ctx.vmm
                .unmap(self.arenas[ai].page_addr(start), m.pages * page)?;
            self.forget_mapping(ai, start);
            // Pieces of the mapping between consecutive cuts.
            let mut pieces = Vec::new();
            let mut p = start;
            let end = start + m.pages;
            while p < end {
                let q = cuts
                    .iter()
                    .copied()
                    .find(|&c| c > p)
                    .unwrap_or(end)
                    .min(end);
                pieces.push((
                    p,
                    PageRun {
                        chunk: m.run.chunk,
                        handle: m.run.handle,
                        first_page: m.run.first_page + (p - start),
                        pages: q - p,
                    },
                ));
                p = q;
            }
            let mut failed: Option<VmmError> = None;
            let mut give = Vec::new();
            let mut mapped_end = start;
            for (p, run) in pieces {
                if failed.is_some() {
                    give.push((p, run));
                    continue;
                }
                let addr = self.arenas[ai].page_addr(p);
                let bytes = run.pages * page;
                if let Err(e) = ctx.vmm.map(addr, bytes, run.handle, run.first_page * page) {
                    failed = Some(e);
                    give.push((p, run));
                    continue;
                }
                let tick = self.tick;
                self.arenas[ai].add_mapping(p, run, tick);
                self.resync(ai, p);
                mapped_end = p + run.pages;
            }
            // One set-access over the pieces mapped again (a contiguous prefix).
            if mapped_end > start {
                let addr = self.arenas[ai].page_addr(start);
                if let Err(e) = ctx.vmm.set_access(addr, (mapped_end - start) * page) {
                    // Recorded as mapped (they are); cached, reclaimable later.
                    failed.get_or_insert(e);
                }
            }
            if let Some(e) = failed {
                // Pages not mapped again go back to the pool, with the
                // hazards of the virtual pages they left.
                let mut runs = Vec::new();
                for (p, run) in give {
                    self.pool_hazard |= self.arenas[ai].take_hazard(p, run.pages);
                    runs.push(run);
                }
                ctx.pool.give_back(&runs).map_err(pool_err)?;
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Take the cached pages of one mapping back into the pool: unmap it, and
    /// map again the runs of it that blocks still touch. Returns the pages freed.
    fn reclaim_mapping(&mut self, ctx: &Ctx<'_>, ai: usize, start: u64) -> Result<u64, AllocError> {
        let Some(m) = self.arenas[ai].mappings.get(&start).copied() else {
            return Ok(0);
        };
        let va = self.arenas[ai].page_addr(start);
        ctx.vmm.unmap(va, m.pages * ctx.page)?;
        self.forget_mapping(ai, start);
        let mut give = Vec::new();
        let mut keep = Vec::new();
        let mut i = 0;
        while i < m.pages {
            let used = self.arenas[ai].touch_of(start + i) > 0;
            let mut j = i + 1;
            while j < m.pages && (self.arenas[ai].touch_of(start + j) > 0) == used {
                j += 1;
            }
            let run = PageRun {
                chunk: m.run.chunk,
                handle: m.run.handle,
                first_page: m.run.first_page + i,
                pages: j - i,
            };
            if used {
                keep.push((start + i, run));
            } else {
                give.push(run);
            }
            i = j;
        }
        let mut first_err = None;
        let mut lost: Vec<PageRun> = Vec::new();
        for (p, run) in keep {
            let addr = self.arenas[ai].page_addr(p);
            let len = run.pages * ctx.page;
            // Map again (a failure is retried), then set access (likewise);
            // a run mapped is recorded as mapped whatever set-access says, so
            // the bookkeeping always matches the device.
            let mut mapped = Err(VmmError::Unavailable {
                reason: String::new(),
            });
            for _ in 0..3 {
                mapped = ctx
                    .vmm
                    .map(addr, len, run.handle, run.first_page * ctx.page);
                if mapped.is_ok() {
                    break;
                }
            }
            if let Err(e) = mapped {
                tracing::error!(error = %e, "remapping pages of live blocks failed");
                first_err.get_or_insert(e);
                lost.push(run);
                continue;
            }
            let tick = self.tick;
            self.arenas[ai].add_mapping(p, run, tick);
            self.resync(ai, p);
            let mut access = Ok(());
            for _ in 0..3 {
                access = ctx.vmm.set_access(addr, len);
                if access.is_ok() {
                    break;
                }
            }
            if let Err(e) = access {
                tracing::error!(error = %e, "restoring access to live pages failed");
                first_err.get_or_insert(e);
            }
        }
        if !lost.is_empty() {
            // The live pages could not be mapped again: their pool pages stay
            // handed out (the data lives there) and are returned at drop.
            self.lost_runs.extend(lost);
        }
        for (i, p) in (start..start + m.pages).enumerate() {
            let _ = i;
            if self.arenas[ai].touch_of(p) == 0 {
                self.pool_hazard |= self.arenas[ai].take_hazard(p, 1);
            }
        }
        let freed: u64 = give.iter().map(|r| r.pages).sum();
        ctx.pool.give_back(&give).map_err(pool_err)?;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(freed),
        }
    }

    /// Map pool runs `pruns` behind the unmapped virtual page runs `runs` of
    /// arena `ai`: one map call per piece that is neighbouring pages of one
    /// chunk, one set-access per newly mapped range. On error, undoes what it
    /// did and hands the pages back.
    fn map_runs(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        runs: &[(u64, u64)],
        pruns: Vec<PageRun>,
        cuts: &[u64],
    ) -> Result<(), AllocError> {
        let page = ctx.page;
        let mut done: Vec<(u64, PageRun)> = Vec::new();
        let mut pi = 0usize;
        let mut poff = 0u64;
        let mut result: Result<(), VmmError> = Ok(());
        'outer: for &(vs, vl) in runs {
            let mut p = vs;
            let end = vs + vl;
            while p < end {
                let Some(pr) = pruns.get(pi).copied() else {
                    break 'outer;
                };
                let mut k = (pr.pages - poff).min(end - p);
                if ctx.cfg.max_pages_per_map > 0 {
                    k = k.min(ctx.cfg.max_pages_per_map);
                }
                if let Some(&c) = cuts.iter().find(|&&c| c > p) {
                    k = k.min(c - p);
                }
                let piece = PageRun {
                    chunk: pr.chunk,
                    handle: pr.handle,
                    first_page: pr.first_page + poff,
                    pages: k,
                };
                let addr = self.arenas[ai].page_addr(p);
                if let Err(e) = ctx
                    .vmm
                    .map(addr, k * page, pr.handle, piece.first_page * page)
                {
                    result = Err(e);
                    break 'outer;
                }
                done.push((p, piece));
                if ctx.cfg.access_per_map {
                    if let Err(e) = ctx.vmm.set_access(addr, k * page) {
                        result = Err(e);
                        break 'outer;
                    }
                }
                p += k;
                poff += k;
                if poff == pr.pages {
                    pi += 1;
                    poff = 0;
                }
            }
            if !ctx.cfg.access_per_map {
                let addr = self.arenas[ai].page_addr(vs);
                if let Err(e) = ctx.vmm.set_access(addr, vl * page) {
                    result = Err(e);
                    break 'outer;
                }
            }
        }
        let tick = self.tick;
        match result {
            Ok(()) => {
                for (p, piece) in done {
                    self.arenas[ai].add_mapping(p, piece, tick);
                    self.resync(ai, p);
                }
                Ok(())
            }
            Err(e) => {
                // Undo: unmap what was mapped; a piece that cannot be unmapped
                // stays recorded as a mapping (cached, reclaimable later).
                let mut kept: Vec<PageRun> = Vec::new();
                for (p, piece) in done {
                    let addr = self.arenas[ai].page_addr(p);
                    if ctx.vmm.unmap(addr, piece.pages * page).is_err() {
                        self.arenas[ai].add_mapping(p, piece, tick);
                        self.resync(ai, p);
                        kept.push(piece);
                    }
                }
                let give: Vec<PageRun> = subtract_runs(&pruns, &kept);
                ctx.pool.give_back(&give).map_err(pool_err)?;
                Err(e.into())
            }
        }
    }

    /// Free the block at `ptr`.
    pub(crate) fn free(&mut self, ctx: &Ctx<'_>, ptr: DevicePtr) -> Result<(), AllocError> {
        self.tick += 1;
        let Some(b) = self.blocks.get(&ptr) else {
            return Err(if self.freed_recent.contains(&ptr) {
                AllocError::DoubleFree { ptr }
            } else {
                AllocError::UnknownPointer { ptr }
            });
        };
        if b.pending.is_some() {
            return Err(AllocError::DoubleFree { ptr });
        }
        let size = b.size;
        let recorded = b.recorded.clone();
        if !recorded.is_empty() {
            let mut evs = Vec::new();
            for s in recorded {
                match ctx.vmm.event_record(s) {
                    Ok(e) => evs.push(e),
                    Err(err) => {
                        for e in evs {
                            let _ = ctx.vmm.event_destroy(e);
                        }
                        return Err(err.into());
                    }
                }
            }
            if let Some(b) = self.blocks.get_mut(&ptr) {
                b.pending = Some(evs);
            }
            self.pending.push(ptr);
            self.stats.allocated_bytes.decrease(size);
            self.stats.allocation.decrease(1);
        } else {
            self.stats.allocated_bytes.decrease(size);
            self.stats.allocation.decrease(1);
            self.finish_free(ptr);
        }
        self.sync_stats(ctx);
        Ok(())
    }

    /// Note that the block at `ptr` is used on `stream` too.
    pub(crate) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        match self.blocks.get_mut(&ptr) {
            Some(b) if b.pending.is_none() => {
                if b.stream != stream && !b.recorded.contains(&stream) {
                    b.recorded.push(stream);
                }
                Ok(())
            }
            _ => Err(AllocError::UnknownPointer { ptr }),
        }
    }

    /// Release every cached page and every wholly free chunk.
    pub(crate) fn empty_cache(&mut self, ctx: &Ctx<'_>) -> Result<(), AllocError> {
        self.tick += 1;
        self.poll_pending(ctx);
        let r = self.reclaim(ctx, u64::MAX, None);
        let t = ctx.pool.trim(0).map_err(pool_err);
        self.sync_stats(ctx);
        r?;
        t?;
        Ok(())
    }

    /// The out-of-memory error for a request of `size` bytes that needed `n` new pages.
    pub(crate) fn oom(&mut self, ctx: &Ctx<'_>, size: u64, n: u64, growable: u64) -> AllocError {
        self.stats.num_ooms += 1;
        let page = ctx.page;
        let free = ctx.pool.free_pages();
        let cached = self.reclaimable_pages(ctx.cfg);
        let usable = free + cached + growable;
        let report = OomReport {
            allocator: ctx.name.to_string(),
            requested: size,
            needed: n * page,
            capacity: ctx.pool.limit_pages() * page,
            reserved: ctx.pool.total_pages() * page,
            allocated: self.stats.allocated_bytes.current,
            device_free: growable * page,
            reclaimable: (free + cached) * page,
            largest_free_extent: usable * page,
            verdict: if usable < n {
                OomVerdict::Capacity
            } else {
                OomVerdict::Fragmentation
            },
        };
        tracing::debug!(%report, "quilt out of memory");
        AllocError::OutOfMemory(Box::new(report))
    }
}

/// The page boundaries at which a single-owner mapping must be cut around a
/// block at `off .. off + len`: its first page, the start and end of the pages
/// it covers wholly, the page past its last (sorted, deduplicated).
fn block_cuts(off: u64, len: u64, page: u64) -> Vec<u64> {
    let mut cuts = vec![
        off / page,
        off.div_ceil(page),
        (off + len) / page,
        (off + len - 1) / page + 1,
    ];
    cuts.dedup();
    cuts
}

/// `all` minus the pages listed in `kept` (each `kept` run lies inside one `all` run).
fn subtract_runs(all: &[PageRun], kept: &[PageRun]) -> Vec<PageRun> {
    let mut out: Vec<PageRun> = all.to_vec();
    for k in kept {
        let mut next = Vec::with_capacity(out.len() + 1);
        for r in out {
            let (rs, re) = (r.first_page, r.first_page + r.pages);
            let (ks, ke) = (k.first_page, k.first_page + k.pages);
            if r.chunk != k.chunk || ke <= rs || ks >= re {
                next.push(r);
                continue;
            }
            if ks > rs {
                next.push(PageRun {
                    pages: ks - rs,
                    ..r
                });
            }
            if ke < re {
                next.push(PageRun {
                    first_page: ke,
                    pages: re - ke,
                    ..r
                });
            }
        }
        out = next;
    }
    out
}

/// A pool error as an allocator error.
pub(crate) fn pool_err(e: PoolError) -> AllocError {
    match e {
        PoolError::Driver(v) => AllocError::Driver(v),
        PoolError::Poisoned => AllocError::Poisoned,
        other => AllocError::Driver(VmmError::Unavailable {
            reason: other.to_string(),
        }),
    }
}
