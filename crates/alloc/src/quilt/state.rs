//! The allocator's state and its algorithms: placement, backing blocks with
//! pages, ordering streams, reclaiming cached pages, freeing.
//!
//! Everything here runs under the allocator's one lock.

use std::collections::{HashMap, HashSet, VecDeque};

use quilt_pool::{Page, PagePool, PoolError};
use quilt_vmm::{DevicePtr, StreamId, VmmError};

use super::arena::Arena;
use super::config::{QuiltConfig, ReclaimPolicy};
use super::streams::Streams;
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

/// One live block.
#[derive(Clone, Debug)]
pub(crate) struct BlockRec {
    pub(crate) arena: usize,
    pub(crate) off: u64,
    pub(crate) size: u64,
    pub(crate) requested: u64,
    /// The streams that use it: its own and those named by `record_stream` (bits).
    pub(crate) streams: u64,
}

/// Which cached pages a reclaim may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reclaim {
    /// Only pages whose freeing streams' work is known complete, cached
    /// at or before this tick: no stream is synchronised.
    KnownComplete { cached_before: u64 },
    /// Any cached page, synchronising the streams whose work may still use it.
    Synchronise,
}

/// How many freed pointers are remembered to tell a double free from an unknown pointer.
const FREED_MEMORY: usize = 1 << 16;

/// How many not-yet-complete pages a reclaim that never synchronises passes
/// over before it stops looking.
const RECLAIM_SKIP: usize = 64;

/// The allocator's state.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) arenas: Vec<Arena>,
    /// The stream of each arena (`None`: shared by every stream) and its class.
    pub(crate) arena_meta: Vec<(Option<StreamId>, Kind)>,
    arena_index: HashMap<(Option<StreamId>, Kind), usize>,
    pub(crate) streams: Streams,
    pub(crate) blocks: HashMap<DevicePtr, BlockRec>,
    freed_recent: HashSet<DevicePtr>,
    freed_order: VecDeque<DevicePtr>,
    /// Pages that became cached, oldest first, as (arena, page, tick it became
    /// cached); an entry whose page has since been touched or unmapped (its
    /// `cached_at` differs) is stale and skipped.
    pub(crate) reclaim_queue: VecDeque<(usize, u64, u64)>,
    /// One tick per allocator operation.
    pub(crate) tick: u64,
    pub(crate) stats: AllocatorStats,
}

fn set_stat(stat: &mut Stat, value: u64) {
    if value > stat.current {
        stat.increase(value - stat.current);
    } else if value < stat.current {
        stat.decrease(stat.current - value);
    }
}

impl State {
    /// Cached pages in every arena (mapped, touched by no block): all of them
    /// can be reclaimed, each being one handle mapped alone.
    pub(crate) fn cached_pages(&self) -> u64 {
        self.arenas.iter().map(|a| a.cached_pages).sum()
    }

    /// Register `stream`, returning its index. When a second stream appears,
    /// every free range so far becomes a hazard of the first stream's work: it
    /// was freed without one, since no other stream could reuse it then.
    fn stream_index(&mut self, stream: StreamId) -> u32 {
        let (i, new) = self.streams.index(stream);
        if new && self.streams.len() == 2 {
            let bit = Streams::bit(0);
            let tick = self.tick;
            for a in &mut self.arenas {
                let gaps: Vec<(u64, u64)> = a.gaps.iter().map(|(&s, &e)| (s, e)).collect();
                for (s, e) in gaps {
                    a.add_hazard(s, e - s, bit, tick);
                }
            }
        }
        i
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

    /// Refresh the statistics derived from the pool, the arenas and the streams.
    pub(crate) fn sync_stats(&mut self, ctx: &Ctx<'_>) {
        let ps = ctx.pool.stats();
        set_stat(&mut self.stats.reserved_bytes, ps.held_bytes);
        set_stat(&mut self.stats.segment, ps.total_pages);
        let touched: u64 = self.arenas.iter().map(|a| a.touched_pages).sum();
        let split = (touched * ctx.page).saturating_sub(self.stats.active_bytes.current);
        set_stat(&mut self.stats.inactive_split_bytes, split);
        let holes: u64 = self
            .arenas
            .iter()
            .map(|a| (a.gaps.len() as u64).saturating_sub(1))
            .sum();
        set_stat(&mut self.stats.inactive_split, holes);
        self.stats.num_stream_waits = self.streams.waits;
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

    /// Take a block off `off .. off + len` of arena `ai` again (a failed
    /// allocation): its pages lose the touch, nothing is remembered as freed.
    fn undo_occupy(&mut self, ai: usize, off: u64, len: u64) {
        let tick = self.tick;
        let queue = &mut self.reclaim_queue;
        self.arenas[ai].untouch(off, len, None, tick, |p| queue.push_back((ai, p, tick)));
        self.arenas[ai].vacate(off);
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
        let si = self.stream_index(stream);
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
        let Some(off) = self.place(ctx, ai, kind, size, rounded, si) else {
            return Err(self.oom(ctx, size, whole_pages, 0));
        };
        self.arenas[ai].occupy(off, rounded);
        self.arenas[ai].touch(off, rounded);
        if let Err(e) = self.order_after_hazards(ctx, ai, off, rounded, si) {
            self.undo_occupy(ai, off, rounded);
            return Err(e);
        }
        self.arenas[ai].clear_hazards(off, rounded);
        let (first, last) = self.arenas[ai].page_span(off, rounded);
        let need = self.arenas[ai].unmapped_in(first, last);
        if !need.is_empty() {
            if let Err(e) = self.back_pages(ctx, ai, size, &need) {
                self.undo_occupy(ai, off, rounded);
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
                streams: Streams::bit(si),
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

    /// True when a block on stream `t` over `off .. off + len` of arena `ai`
    /// would have to wait for another stream's work.
    fn needs_wait(&mut self, ctx: &Ctx<'_>, ai: usize, off: u64, len: u64, t: u32) -> bool {
        if self.streams.len() < 2 {
            return false;
        }
        let tick = self.tick;
        let hazards: Vec<_> = self.arenas[ai].hazards_over(off, len).collect();
        for (_, h) in hazards {
            for s in self.streams.in_mask(h.streams) {
                if s == t || self.streams.waited(t, s) >= h.tick {
                    continue;
                }
                self.streams.poll(ctx.vmm, s, tick);
                if !self.streams.is_done(s, h.tick) {
                    return true;
                }
            }
        }
        false
    }

    /// Order stream `t` after every other stream's work that may still use
    /// `off .. off + len` of arena `ai`.
    fn order_after_hazards(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        off: u64,
        len: u64,
        t: u32,
    ) -> Result<(), AllocError> {
        if self.streams.len() < 2 {
            return Ok(());
        }
        let tick = self.tick;
        let hazards: Vec<_> = self.arenas[ai].hazards_over(off, len).collect();
        for (_, h) in hazards {
            for s in self.streams.in_mask(h.streams) {
                self.streams.order_after(ctx.vmm, t, s, h.tick, tick)?;
            }
        }
        Ok(())
    }

    /// Where a block of `rounded` bytes (asked for as `size`) on stream `t`
    /// goes in arena `ai`.
    ///
    /// Quilt's default (stitch threshold 0): among the best-fitting gaps, the
    /// first whose pages are all mapped and need no wait for another stream,
    /// then one whose pages are all mapped (a wait costs less than new pages),
    /// then the one needing the fewest new pages; the block goes at the gap's
    /// start. With a stitch threshold (GMLake), a large request below it is
    /// served from a cached range whose pages are all mapped, else from
    /// fresh, page-aligned virtual space past the arena's mapped tail (new
    /// pages, no stitching); a request at or above it reuses a cached range of
    /// at most `reuse_limit` times its size, else is stitched like any Quilt
    /// block.
    fn place(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        kind: Kind,
        size: u64,
        rounded: u64,
        t: u32,
    ) -> Option<u64> {
        let threshold = ctx.cfg.stitch_threshold;
        if threshold > 0 && kind == Kind::Large {
            let a = &self.arenas[ai];
            let limit = if size >= threshold && ctx.cfg.reuse_limit > 0 {
                rounded.saturating_mul(ctx.cfg.reuse_limit)
            } else {
                u64::MAX
            };
            if let Some(off) = a.best_fit_mapped(rounded, limit, 64) {
                return Some(off);
            }
            if size >= threshold {
                return a.fitting_gaps(rounded, 1).next();
            }
            return a.fresh_tail(rounded);
        }
        let n = ctx.cfg.placement_candidates.max(1);
        let candidates: Vec<u64> = self.arenas[ai].fitting_gaps(rounded, n).collect();
        if candidates.len() <= 1 {
            return candidates.first().copied();
        }
        // (needs new pages, waits though mapped, new pages, waits), lowest wins.
        let mut best: Option<((bool, bool, u64, bool), u64)> = None;
        for start in candidates {
            let unmapped = self.arenas[ai].unmapped_pages(start, rounded);
            let wait = self.needs_wait(ctx, ai, start, rounded, t);
            let score = (unmapped > 0, unmapped == 0 && wait, unmapped, wait);
            if score == (false, false, 0, false) {
                return Some(start);
            }
            if best.is_none_or(|(b, _)| score < b) {
                best = Some((score, start));
            }
        }
        best.map(|(_, s)| s)
    }

    /// Back the unmapped virtual pages `need` of arena `ai` (a block's) with
    /// pool pages: one map per page, one set-access per contiguous range.
    fn back_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        size: u64,
        need: &[u64],
    ) -> Result<(), AllocError> {
        let n = need.len() as u64;
        self.obtain_free_pages(ctx, size, n)?;
        let pages = ctx.pool.take(n).map_err(pool_err)?;
        self.map_pages(ctx, ai, need, pages)
    }

    /// Map `pages` (each one whole handle, at offset 0) at the virtual pages
    /// `at` of arena `ai`, and set access. On error, unmaps what it mapped
    /// and hands the pages back.
    fn map_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        at: &[u64],
        pages: Vec<Page>,
    ) -> Result<(), AllocError> {
        let page = ctx.page;
        let mut mapped = 0usize;
        let mut result: Result<(), VmmError> = Ok(());
        for (&p, pg) in at.iter().zip(&pages) {
            let addr = self.arenas[ai].page_addr(p);
            if let Err(e) = ctx.vmm.map(addr, page, pg.handle, 0) {
                result = Err(e);
                break;
            }
            mapped += 1;
            if ctx.cfg.access_per_map {
                if let Err(e) = ctx.vmm.set_access(addr, page) {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() && !ctx.cfg.access_per_map {
            let mut i = 0;
            while i < at.len() {
                let mut j = i + 1;
                while j < at.len() && at[j] == at[j - 1] + 1 {
                    j += 1;
                }
                let addr = self.arenas[ai].page_addr(at[i]);
                if let Err(e) = ctx.vmm.set_access(addr, (j - i) as u64 * page) {
                    result = Err(e);
                    break;
                }
                i = j;
            }
        }
        let tick = self.tick;
        match result {
            Ok(()) => {
                for (&p, &pg) in at.iter().zip(&pages) {
                    self.arenas[ai].set_mapped(p, pg, tick);
                }
                Ok(())
            }
            Err(e) => {
                // Undo: unmap what was mapped; a page that cannot be unmapped
                // stays recorded as mapped (cached once the block is undone,
                // reclaimable later).
                let mut give = Vec::with_capacity(pages.len());
                for (i, (&p, &pg)) in at.iter().zip(&pages).enumerate() {
                    let addr = self.arenas[ai].page_addr(p);
                    if i < mapped && ctx.vmm.unmap(addr, page).is_err() {
                        self.arenas[ai].set_mapped(p, pg, tick);
                    } else {
                        give.push(pg);
                    }
                }
                ctx.pool.give_back(&give).map_err(pool_err)?;
                Err(e.into())
            }
        }
    }

    /// Make at least `n` pages free in the pool: by the reclaim policy, growth,
    /// and reclaiming cached pages when the pool cannot grow.
    fn obtain_free_pages(&mut self, ctx: &Ctx<'_>, size: u64, n: u64) -> Result<(), AllocError> {
        let missing = |pool: &PagePool| n.saturating_sub(pool.free_pages());
        if missing(ctx.pool) == 0 {
            return Ok(());
        }
        // A driver call follows: learn how far every stream got.
        self.streams.refresh(ctx.vmm, self.tick);
        let (want, cached_before) = match ctx.cfg.reclaim {
            ReclaimPolicy::WhenFull => (0, self.tick),
            ReclaimPolicy::Always => (missing(ctx.pool), self.tick),
            ReclaimPolicy::CachedAbove(per_mille) => {
                let allowed = ctx.pool.total_pages().saturating_mul(per_mille) / 1000;
                let excess = self.cached_pages().saturating_sub(allowed);
                (excess.min(missing(ctx.pool)), self.tick)
            }
            ReclaimPolicy::IdleFor(k) => (missing(ctx.pool), self.tick.saturating_sub(k)),
        };
        if want > 0 {
            self.reclaim(ctx, want, Reclaim::KnownComplete { cached_before })?;
            if missing(ctx.pool) == 0 {
                return Ok(());
            }
        }
        if self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        // The pool cannot grow by all that is missing: is there enough at all?
        let growable = ctx.pool.growable_pages().map_err(pool_err)?;
        let cached = self.cached_pages();
        if cached + growable < missing(ctx.pool) {
            return Err(self.oom(ctx, size, n, growable));
        }
        self.stats.num_alloc_retries += 1;
        let want = missing(ctx.pool)
            .saturating_sub(growable)
            .max(1)
            .min(cached);
        self.reclaim(ctx, want, Reclaim::Synchronise)?;
        if missing(ctx.pool) == 0 || self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        // A last resort: everything cached.
        self.reclaim(ctx, u64::MAX, Reclaim::Synchronise)?;
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

    /// Unmap up to `target` cached pages, oldest first, and return them to
    /// the pool; `mode` says which pages may be taken and whether streams
    /// may be synchronised for them. Returns the pages gained.
    fn reclaim(&mut self, ctx: &Ctx<'_>, target: u64, mode: Reclaim) -> Result<u64, AllocError> {
        let tick = self.tick;
        let mut chosen: Vec<(usize, u64)> = Vec::new();
        let mut skipped: Vec<(usize, u64, u64)> = Vec::new();
        // Per stream, the latest free on a chosen page.
        let mut wait_for: Vec<(u32, u64)> = Vec::new();
        while (chosen.len() as u64) < target {
            let Some(entry) = self.reclaim_queue.pop_front() else {
                break;
            };
            let (ai, p, stamp) = entry;
            let slot = self.arenas[ai].slot(p);
            if !slot.is_cached() || slot.cached_at != stamp {
                continue;
            }
            let streams = self.streams.in_mask(slot.freed_by);
            if let Reclaim::KnownComplete { cached_before } = mode {
                if stamp > cached_before {
                    skipped.push(entry);
                    break;
                }
                let mut done = true;
                for &s in &streams {
                    self.streams.poll(ctx.vmm, s, tick);
                    done &= self.streams.is_done(s, slot.freed_at);
                }
                if !done {
                    skipped.push(entry);
                    if skipped.len() >= RECLAIM_SKIP {
                        break;
                    }
                    continue;
                }
            } else {
                for s in streams {
                    match wait_for.iter_mut().find(|w| w.0 == s) {
                        Some(w) => w.1 = w.1.max(slot.freed_at),
                        None => wait_for.push((s, slot.freed_at)),
                    }
                }
            }
            chosen.push((ai, p));
        }
        for entry in skipped.into_iter().rev() {
            self.reclaim_queue.push_front(entry);
        }
        let mut result: Result<(), AllocError> = Ok(());
        for (s, k) in wait_for {
            if let Err(e) = self.streams.complete(ctx.vmm, s, k, tick) {
                result = Err(e.into());
                break;
            }
        }
        let mut give = Vec::with_capacity(chosen.len());
        for &(ai, p) in &chosen {
            if result.is_ok() {
                if let Err(e) = ctx.vmm.unmap(self.arenas[ai].page_addr(p), ctx.page) {
                    result = Err(e.into());
                }
            }
            if result.is_ok() {
                give.extend(self.arenas[ai].set_unmapped(p));
            } else {
                // Still mapped and cached: back in the queue.
                let stamp = self.arenas[ai].slot(p).cached_at;
                self.reclaim_queue.push_front((ai, p, stamp));
            }
        }
        let gained = give.len() as u64;
        ctx.pool.give_back(&give).map_err(pool_err)?;
        self.compact_reclaim_queue();
        result.map(|()| gained)
    }

    /// Drop stale entries from the reclaim queue once they outnumber the
    /// valid ones (amortised O(1) per entry pushed).
    fn compact_reclaim_queue(&mut self) {
        let cached = self.cached_pages() as usize;
        if self.reclaim_queue.len() > 2 * cached + 1024 {
            let arenas = &self.arenas;
            self.reclaim_queue.retain(|&(ai, p, stamp)| {
                let s = arenas[ai].slot(p);
                s.is_cached() && s.cached_at == stamp
            });
        }
    }

    /// Free the block at `ptr`.
    pub(crate) fn free(&mut self, ctx: &Ctx<'_>, ptr: DevicePtr) -> Result<(), AllocError> {
        let Some(b) = self.blocks.remove(&ptr) else {
            return Err(if self.freed_recent.contains(&ptr) {
                AllocError::DoubleFree { ptr }
            } else {
                AllocError::UnknownPointer { ptr }
            });
        };
        self.tick += 1;
        let tick = self.tick;
        let track = self.streams.len() > 1;
        let queue = &mut self.reclaim_queue;
        let a = &mut self.arenas[b.arena];
        let ai = b.arena;
        a.untouch(b.off, b.size, Some((b.streams, tick)), tick, |p| {
            queue.push_back((ai, p, tick))
        });
        if track {
            a.add_hazard(b.off, b.size, b.streams, tick);
        }
        a.vacate(b.off);
        for s in self.streams.in_mask(b.streams) {
            self.streams.note_free(ctx.vmm, s, tick, track);
        }
        if track {
            let streams = &self.streams;
            self.arenas[ai].prune_hazards(|h| {
                streams
                    .in_mask(h.streams)
                    .into_iter()
                    .all(|s| streams.is_done(s, h.tick))
            });
        }
        self.stats.allocated_bytes.decrease(b.size);
        self.stats.allocation.decrease(1);
        self.stats.active_bytes.decrease(b.size);
        self.stats.active.decrease(1);
        self.stats.requested_bytes.decrease(b.requested);
        self.remember_freed(ptr);
        self.compact_reclaim_queue();
        self.sync_stats(ctx);
        Ok(())
    }

    /// Note that the block at `ptr` is used on `stream` too: its free will
    /// wait for that stream's work as well.
    pub(crate) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if !self.blocks.contains_key(&ptr) {
            return Err(AllocError::UnknownPointer { ptr });
        }
        let si = self.stream_index(stream);
        if let Some(b) = self.blocks.get_mut(&ptr) {
            b.streams |= Streams::bit(si);
        }
        Ok(())
    }

    /// Release every cached page (synchronising the streams whose work may
    /// still use them) and every free pool page.
    pub(crate) fn empty_cache(&mut self, ctx: &Ctx<'_>) -> Result<(), AllocError> {
        self.tick += 1;
        let r = self.reclaim(ctx, u64::MAX, Reclaim::Synchronise);
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
        let cached = self.cached_pages();
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
