//! The allocator's state and its algorithms: placement, backing blocks with
//! pages, ordering streams, reclaiming cached pages, freeing.
//!
//! Everything here runs under the allocator's one lock.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use quilt_pool::{Page, PageId, PagePool, PoolError};
use quilt_vmm::{DevicePtr, StreamId, VmmError};

use super::arena::{Arena, PageSlot};
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

/// How a reclaim takes cached pages back to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reclaim {
    /// Pages cached at or before this tick, with no synchronisation: a page
    /// whose freeing work is known complete is unmapped; any other is
    /// retired (its handle moves on and carries that work as a hazard, its
    /// old mapping stays until the work is known complete).
    Move { cached_before: u64 },
    /// Every cached and retired page, unmapped after synchronising the
    /// streams whose work may still use it (`empty_cache`).
    Drain,
}

/// How good a place for a block is: lower is better, fields compared in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PlaceScore {
    /// Over a retired page still in use (mapping it would need a sync).
    blocked: bool,
    /// Needs new pages.
    needs_pages: bool,
    /// Every page mapped, but another stream's work must be waited for (a
    /// wait costs less than new pages).
    waits_though_mapped: bool,
    /// How many new pages.
    new_pages: u64,
    /// Another stream's work must be waited for.
    waits: bool,
}

impl PlaceScore {
    /// Mapped, wait-free, unblocked: taken at once.
    const PERFECT: PlaceScore = PlaceScore {
        blocked: false,
        needs_pages: false,
        waits_though_mapped: false,
        new_pages: 0,
        waits: false,
    };
}

/// How many freed pointers are remembered to tell a double free from an unknown pointer.
const FREED_MEMORY: usize = 1 << 16;

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
    /// Whether the reclaim queue is kept: from the first reclaim on (built
    /// then from the page tables). Until then no operation pays for it.
    pub(crate) reclaim_queue_kept: bool,
    /// Scratch space of placement, kept to spare an allocation per request.
    scratch: Vec<u64>,
    /// Retired virtual pages, in the order they were retired, as (arena,
    /// page, the pool page that was mapped there); an entry whose page is no
    /// longer retired is stale and skipped.
    pub(crate) retired_queue: VecDeque<(usize, u64, PageId)>,
    /// Free pool pages whose last virtual page was retired: the streams
    /// (bits) whose work may still use them and the tick of that work. The
    /// next block they back first orders its stream after that work.
    pub(crate) page_hazards: HashMap<PageId, (u64, u64)>,
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

    /// Refresh the statistics derived from the pool, the arenas and the
    /// streams: after anything that may have grown or trimmed the pool.
    pub(crate) fn sync_stats(&mut self, ctx: &Ctx<'_>) {
        let ps = ctx.pool.stats();
        set_stat(&mut self.stats.reserved_bytes, ps.held_bytes);
        set_stat(&mut self.stats.segment, ps.total_pages);
        self.sync_arena_stats(ctx);
    }

    /// Refresh the statistics derived from the arenas and the streams (the
    /// pool's change only where the pool grows or is trimmed).
    fn sync_arena_stats(&mut self, ctx: &Ctx<'_>) {
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
        let kept = self.reclaim_queue_kept;
        let queue = &mut self.reclaim_queue;
        self.arenas[ai].untouch(off, len, None, tick, |p| {
            if kept {
                queue.push_back((ai, p, tick))
            }
        });
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
            let backed = self.back_pages(ctx, ai, size, &need, si);
            if backed.is_err() {
                self.undo_occupy(ai, off, rounded);
            }
            self.sync_stats(ctx);
            backed?;
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
        self.sync_arena_stats(ctx);
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
        let mut candidates = std::mem::take(&mut self.scratch);
        candidates.clear();
        candidates.extend(self.arenas[ai].fitting_gaps(rounded, n));
        if self.arenas[ai].retired_pages > 0 {
            let moved: Vec<u64> = candidates
                .iter()
                .filter_map(|&g| self.past_retired_in_use(ctx, ai, g, rounded))
                .collect();
            // If every fitting gap is blocked, a retired page will be
            // synchronised for (rare; only after reclaim moved pages).
            if !moved.is_empty() {
                candidates = moved;
            }
        }
        let chosen = self.best_candidate(ctx, ai, rounded, t, &candidates);
        self.scratch = candidates;
        chosen
    }

    /// The best of `candidates` (starts of a block of `rounded` bytes on
    /// stream `t` in arena `ai`), by [`PlaceScore`].
    fn best_candidate(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        rounded: u64,
        t: u32,
        candidates: &[u64],
    ) -> Option<u64> {
        if candidates.len() <= 1 {
            return candidates.first().copied();
        }
        let mut best: Option<(PlaceScore, u64)> = None;
        for &start in candidates {
            let blocked = self.arenas[ai].retired_pages > 0
                && self.last_retired_in_use(ctx, ai, start, rounded).is_some();
            let unmapped = self.arenas[ai].unmapped_pages(start, rounded);
            let wait = self.needs_wait(ctx, ai, start, rounded, t);
            let score = PlaceScore {
                blocked,
                needs_pages: unmapped > 0,
                waits_though_mapped: unmapped == 0 && wait,
                new_pages: unmapped,
                waits: wait,
            };
            if score == PlaceScore::PERFECT {
                return Some(start);
            }
            if best.is_none_or(|(b, _)| score < b) {
                best = Some((score, start));
            }
        }
        best.map(|(_, s)| s)
    }

    /// The last retired page under `off .. off + len` of arena `ai` whose
    /// freeing work is not known complete (a block there would need a
    /// synchronisation before that page could be mapped again).
    fn last_retired_in_use(&mut self, ctx: &Ctx<'_>, ai: usize, off: u64, len: u64) -> Option<u64> {
        let tick = self.tick;
        let retired: Vec<(u64, PageSlot)> = self.arenas[ai].retired_in(off, len).collect();
        retired
            .into_iter()
            .rev()
            .find(|(_, slot)| !self.work_done(ctx, slot.freed_by, slot.freed_at, tick))
            .map(|(p, _)| p)
    }

    /// Where in the gap starting at `gap` a block of `len` bytes can go
    /// without covering a retired page still in use: the gap's start, or
    /// the first page boundary past such pages; `None` when it no longer fits.
    fn past_retired_in_use(&mut self, ctx: &Ctx<'_>, ai: usize, gap: u64, len: u64) -> Option<u64> {
        if self.arenas[ai].retired_pages == 0 {
            return Some(gap);
        }
        let end = *self.arenas[ai].gaps.get(&gap)?;
        let mut start = gap;
        while let Some(p) = self.last_retired_in_use(ctx, ai, start, len) {
            start = (p + 1) * ctx.page;
            if start.checked_add(len).is_none_or(|e| e > end) {
                return None;
            }
        }
        Some(start)
    }

    /// True when the work of every stream in `mask` up to tick `k` is known
    /// complete (after at most one query per stream this operation).
    fn work_done(&mut self, ctx: &Ctx<'_>, mask: u64, k: u64, tick: u64) -> bool {
        self.streams.in_mask(mask).all(|s| {
            self.streams.poll(ctx.vmm, s, tick);
            self.streams.is_done(s, k)
        })
    }

    /// Back the unmapped virtual pages `need` of arena `ai` (a block's on
    /// stream `t`) with pool pages: one map per page, one set-access per
    /// contiguous range. A retired page among them is unmapped first (its
    /// work completed, by a synchronisation if need be: placement avoids
    /// this); a pool page with a hazard orders `t` after that work first.
    fn back_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        size: u64,
        need: &[u64],
        t: u32,
    ) -> Result<(), AllocError> {
        let tick = self.tick;
        for &p in need {
            let slot = self.arenas[ai].slot(p);
            if !slot.retired {
                continue;
            }
            for s in self.streams.in_mask(slot.freed_by) {
                self.streams.complete(ctx.vmm, s, slot.freed_at, tick)?;
            }
            ctx.vmm.unmap(self.arenas[ai].page_addr(p), ctx.page)?;
            self.arenas[ai].clear_retired(p);
        }
        let n = need.len() as u64;
        self.obtain_free_pages(ctx, size, n)?;
        let pages = ctx.pool.take(n).map_err(pool_err)?;
        let hazards: Vec<(PageId, (u64, u64))> = pages
            .iter()
            .filter_map(|pg| self.page_hazards.get(&pg.id).map(|&h| (pg.id, h)))
            .collect();
        let mut ordered: Result<(), AllocError> = Ok(());
        'order: for &(_, (mask, k)) in &hazards {
            for s in self.streams.in_mask(mask) {
                if let Err(e) = self.streams.order_after(ctx.vmm, t, s, k, tick) {
                    ordered = Err(e.into());
                    break 'order;
                }
            }
        }
        if let Err(e) = ordered {
            ctx.pool.give_back(&pages).map_err(pool_err)?;
            return Err(e);
        }
        let result = self.map_pages(ctx, ai, need, pages.clone());
        // A page now mapped here (the block's, or left mapped by a failed
        // undo) carries its hazard in its slot from now on; the pages given
        // back keep theirs.
        for (&p, pg) in need.iter().zip(&pages) {
            if self.arenas[ai].slot(p).phys == Some(*pg) {
                if let Some((mask, k)) = self.page_hazards.remove(&pg.id) {
                    if result.is_err() {
                        self.arenas[ai].note_freed(p, mask, k);
                    }
                }
            }
        }
        result
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
        // A driver call follows: learn how far every stream got, and unmap
        // the retired pages whose work is done.
        self.streams.refresh(ctx.vmm, self.tick);
        self.unmap_retired(ctx, false)?;
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
            self.reclaim(ctx, want, Reclaim::Move { cached_before })?;
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
        let all = Reclaim::Move {
            cached_before: u64::MAX,
        };
        self.reclaim(ctx, want, all)?;
        if missing(ctx.pool) == 0 || self.try_grow(ctx, missing(ctx.pool))? {
            return Ok(());
        }
        // A last resort: everything cached.
        self.reclaim(ctx, u64::MAX, all)?;
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

    /// Take up to `target` cached pages, oldest first, back to the pool;
    /// `mode` says which pages may be taken and how (see [`Reclaim`]).
    /// Returns the pages gained.
    fn reclaim(&mut self, ctx: &Ctx<'_>, target: u64, mode: Reclaim) -> Result<u64, AllocError> {
        let tick = self.tick;
        self.keep_reclaim_queue();
        let mut chosen: Vec<(usize, u64)> = Vec::new();
        while (chosen.len() as u64) < target {
            let Some(entry) = self.reclaim_queue.pop_front() else {
                break;
            };
            let (ai, p, stamp) = entry;
            let slot = self.arenas[ai].slot(p);
            if !slot.is_cached() || slot.cached_at != stamp {
                continue;
            }
            if let Reclaim::Move { cached_before } = mode {
                if stamp > cached_before {
                    self.reclaim_queue.push_front(entry);
                    break;
                }
            }
            chosen.push((ai, p));
        }
        let mut result: Result<(), AllocError> = Ok(());
        if mode == Reclaim::Drain {
            // Per stream, the latest free on a chosen page.
            let mut wait_for: Vec<(u32, u64)> = Vec::new();
            for &(ai, p) in &chosen {
                let slot = self.arenas[ai].slot(p);
                for s in self.streams.in_mask(slot.freed_by) {
                    match wait_for.iter_mut().find(|w| w.0 == s) {
                        Some(w) => w.1 = w.1.max(slot.freed_at),
                        None => wait_for.push((s, slot.freed_at)),
                    }
                }
            }
            for (s, k) in wait_for {
                if let Err(e) = self.streams.complete(ctx.vmm, s, k, tick) {
                    result = Err(e.into());
                    break;
                }
            }
        }
        let mut give = Vec::with_capacity(chosen.len());
        for &(ai, p) in &chosen {
            let slot = self.arenas[ai].slot(p);
            if result.is_ok() && !self.work_done(ctx, slot.freed_by, slot.freed_at, tick) {
                // Still in use by queued work: move the handle on, leave the
                // mapping until that work is done.
                if let Some(pg) = self.arenas[ai].set_retired(p) {
                    self.page_hazards
                        .insert(pg.id, (slot.freed_by, slot.freed_at));
                    self.retired_queue.push_back((ai, p, pg.id));
                    give.push(pg);
                }
                continue;
            }
            if result.is_ok() {
                if let Err(e) = ctx.vmm.unmap(self.arenas[ai].page_addr(p), ctx.page) {
                    result = Err(e.into());
                }
            }
            if result.is_ok() {
                give.extend(self.arenas[ai].set_unmapped(p));
            } else {
                // Still mapped and cached: back in the queue.
                self.reclaim_queue.push_front((ai, p, slot.cached_at));
            }
        }
        let gained = give.len() as u64;
        ctx.pool.give_back(&give).map_err(pool_err)?;
        self.compact_reclaim_queue();
        result.map(|()| gained)
    }

    /// Unmap retired pages, oldest first, whose freeing work is known
    /// complete; with `synchronise`, all of them, completing that work first.
    /// Without it a failed unmap is only logged (the page stays retired, to
    /// be tried again).
    fn unmap_retired(&mut self, ctx: &Ctx<'_>, synchronise: bool) -> Result<(), AllocError> {
        let tick = self.tick;
        while let Some(&(ai, p, id)) = self.retired_queue.front() {
            let slot = self.arenas[ai].slot(p);
            if !slot.retired {
                self.retired_queue.pop_front();
                continue;
            }
            if !self.work_done(ctx, slot.freed_by, slot.freed_at, tick) {
                if !synchronise {
                    break;
                }
                for s in self.streams.in_mask(slot.freed_by) {
                    self.streams.complete(ctx.vmm, s, slot.freed_at, tick)?;
                }
            }
            if let Err(e) = ctx.vmm.unmap(self.arenas[ai].page_addr(p), ctx.page) {
                if synchronise {
                    return Err(e.into());
                }
                tracing::warn!(error = %e, "unmapping a retired page failed");
                break;
            }
            self.arenas[ai].clear_retired(p);
            self.retired_queue.pop_front();
            // The page's hazard is this same work, now done.
            if self.page_hazards.get(&id) == Some(&(slot.freed_by, slot.freed_at)) {
                self.page_hazards.remove(&id);
            }
        }
        Ok(())
    }

    /// Start keeping the reclaim queue, if it is not kept yet: every cached
    /// page, oldest first (by the tick it became cached).
    fn keep_reclaim_queue(&mut self) {
        if self.reclaim_queue_kept {
            return;
        }
        let mut cached: Vec<(u64, usize, u64)> = Vec::new();
        for (ai, a) in self.arenas.iter().enumerate() {
            for (p, slot) in a.pages.iter().enumerate() {
                if slot.is_cached() {
                    cached.push((slot.cached_at, ai, p as u64));
                }
            }
        }
        cached.sort_unstable();
        self.reclaim_queue = cached.into_iter().map(|(t, ai, p)| (ai, p, t)).collect();
        self.reclaim_queue_kept = true;
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
        let kept = self.reclaim_queue_kept;
        let queue = &mut self.reclaim_queue;
        let a = &mut self.arenas[b.arena];
        let ai = b.arena;
        a.untouch(b.off, b.size, Some((b.streams, tick)), tick, |p| {
            if kept {
                queue.push_back((ai, p, tick))
            }
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
        self.sync_arena_stats(ctx);
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

    /// Release every cached and retired page (synchronising the streams
    /// whose work may still use them) and every free pool page.
    pub(crate) fn empty_cache(&mut self, ctx: &Ctx<'_>) -> Result<(), AllocError> {
        self.tick += 1;
        let r = self
            .reclaim(ctx, u64::MAX, Reclaim::Drain)
            .and_then(|_| self.unmap_retired(ctx, true));
        if r.is_ok() {
            // Every retired page's work is done, so is every page hazard's.
            self.page_hazards.clear();
        }
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
