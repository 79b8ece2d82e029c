//! Free pages for a request: the reclaim policy before growth, growth,
//! moving cached pages (unmapping those whose work is done, retiring the
//! others) when the pool cannot grow, and the retired pages' deferred unmap.

use quilt_pool::{PagePool, PoolError};

use super::config::ReclaimPolicy;
use super::stitch::{pool_err, Core, Ctx, Kind, PagesFor, Reclaim};
use crate::error::AllocError;

impl Core {
    /// Make at least `n` pages free in the pool: by the reclaim policy, growth,
    /// and reclaiming cached pages when the pool cannot grow.
    pub(super) fn obtain_free_pages(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        n: u64,
        pages_for: PagesFor,
    ) -> Result<(), AllocError> {
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
        // Spare pages (of arenas of their own) whose work is done come first.
        self.reclaim_spare_done(ctx, missing(ctx.pool))?;
        if want > 0 && missing(ctx.pool) > 0 {
            self.reclaim(ctx, want, Reclaim::Move { cached_before })?;
        }
        if pages_for == PagesFor::Mapping {
            self.reclaim_done_elsewhere(ctx, missing(ctx.pool))?;
        }
        if missing(ctx.pool) == 0 {
            return Ok(());
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
        // Spare pages before any other cached page.
        let spare = self.reclaim_spare_all(ctx, want)?;
        if spare < want {
            self.reclaim(ctx, want - spare, all)?;
        }
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

    /// Grow the pool by `pages`; false when the limit or the device says no
    /// (the allocator is then under pressure, see `pressure.rs`).
    pub(super) fn try_grow(&mut self, ctx: &Ctx<'_>, pages: u64) -> Result<bool, AllocError> {
        let grew = match ctx.pool.grow(pages) {
            Ok(_) => true,
            Err(PoolError::LimitReached { .. }) => false,
            Err(PoolError::Driver(e)) if e.is_out_of_memory() => false,
            Err(e) => return Err(pool_err(e)),
        };
        self.note_growth(grew);
        Ok(grew)
    }

    /// Take up to `target` cached pages, oldest first, back to the pool;
    /// `mode` says which pages may be taken and how (see [`Reclaim`]).
    /// Returns the pages gained.
    pub(super) fn reclaim(
        &mut self,
        ctx: &Ctx<'_>,
        target: u64,
        mode: Reclaim,
    ) -> Result<u64, AllocError> {
        self.keep_reclaim_queue();
        let mut chosen: Vec<(usize, u64)> = Vec::new();
        while (chosen.len() as u64) < target {
            let Some(entry) = self.pop_cached() else {
                break;
            };
            let (ai, p, stamp) = entry;
            if let Reclaim::Move { cached_before } = mode {
                if stamp > cached_before {
                    self.reclaim_queue.push_front(entry);
                    break;
                }
            }
            chosen.push((ai, p));
        }
        self.move_cached(ctx, &chosen, mode == Reclaim::Drain, true)
    }

    /// The oldest entry of the reclaim queue that is still valid (its page
    /// cached since that stamp), taken off the queue; stale entries on the
    /// way are dropped.
    fn pop_cached(&mut self) -> Option<(usize, u64, u64)> {
        while let Some(entry) = self.reclaim_queue.pop_front() {
            let (ai, p, stamp) = entry;
            let slot = self.arenas[ai].slot(p);
            if slot.is_cached() && slot.cached_at == stamp {
                return Some(entry);
            }
        }
        None
    }

    /// Unmap up to `want` cached pages of ordinary and tagged arenas, oldest
    /// first, whose work is known complete (no
    /// synchronisation, no retirement); the scan stops at the first page
    /// whose work may still run (the pages after it were freed later).
    /// Growable buffers' spare pages are not taken here. Returns the pages
    /// gained.
    fn reclaim_done_elsewhere(&mut self, ctx: &Ctx<'_>, want: u64) -> Result<u64, AllocError> {
        if want == 0 || self.cached_pages() == 0 {
            return Ok(0);
        }
        self.keep_reclaim_queue();
        let tick = self.tick;
        let mut chosen: Vec<(usize, u64)> = Vec::new();
        let mut passed: Vec<(usize, u64, u64)> = Vec::new();
        while (chosen.len() as u64) < want {
            let Some(entry) = self.pop_cached() else {
                break;
            };
            let (ai, p, _) = entry;
            let slot = self.arenas[ai].slot(p);
            if self.arena_meta[ai].1 == Kind::Own {
                passed.push(entry);
                continue;
            }
            if !self.work_done(ctx, slot.freed_by, slot.freed_at, tick) {
                passed.push(entry);
                break;
            }
            chosen.push((ai, p));
        }
        for entry in passed.into_iter().rev() {
            self.reclaim_queue.push_front(entry);
        }
        self.move_cached(ctx, &chosen, false, true)
    }

    /// Move the cached pages `chosen` to the pool: a page whose freeing work
    /// is known complete is unmapped, any other retired (with `drain`, the
    /// streams whose work may still use them are synchronised first, and
    /// every page is unmapped). A page left cached by an error goes back to
    /// the front of the reclaim queue when `requeue` (it was taken from it).
    /// Returns the pages gained.
    pub(super) fn move_cached(
        &mut self,
        ctx: &Ctx<'_>,
        chosen: &[(usize, u64)],
        drain: bool,
        requeue: bool,
    ) -> Result<u64, AllocError> {
        let tick = self.tick;
        let mut result: Result<(), AllocError> = Ok(());
        if drain {
            // Per stream, the latest free on a chosen page.
            let mut wait_for: Vec<(u32, u64)> = Vec::new();
            for &(ai, p) in chosen {
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
        for &(ai, p) in chosen {
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
            } else if requeue {
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
    pub(super) fn unmap_retired(
        &mut self,
        ctx: &Ctx<'_>,
        synchronise: bool,
    ) -> Result<(), AllocError> {
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
        self.free_empty_zombies(ctx);
        Ok(())
    }

    /// Start keeping the reclaim queue, if it is not kept yet: every cached
    /// page, oldest first (by the tick it became cached).
    pub(super) fn keep_reclaim_queue(&mut self) {
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
    #[inline]
    pub(super) fn compact_reclaim_queue(&mut self) {
        // A queue within the least bound needs no sum over the arenas.
        if self.reclaim_queue.len() > 1024 {
            self.compact_long_reclaim_queue();
        }
    }

    /// [`Core::compact_reclaim_queue`] for a queue past the least bound.
    /// (Out of line: every free asks, few queues are that long.)
    #[inline(never)]
    fn compact_long_reclaim_queue(&mut self) {
        let cached = self.cached_pages() as usize;
        if self.reclaim_queue.len() > 2 * cached + 1024 {
            let arenas = &self.arenas;
            self.reclaim_queue.retain(|&(ai, p, stamp)| {
                let s = arenas[ai].slot(p);
                s.is_cached() && s.cached_at == stamp
            });
        }
    }

    /// The spare pages: the cached pages of every arena of its own
    /// (`Kind::Own`: a growable buffer's pages mapped past its end, ahead
    /// or left by a shrink, or a recycled range's), arena by arena, the
    /// farthest from the arena's start first. They are the first class of
    /// cached pages reclaimed.
    fn spare_pages(&self) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        for (ai, a) in self.arenas.iter().enumerate() {
            if self.arena_meta[ai].1 != Kind::Own || a.cached_pages == 0 {
                continue;
            }
            out.extend(
                (0..a.pages.len() as u64)
                    .rev()
                    .filter(|&p| a.slot(p).is_cached())
                    .map(|p| (ai, p)),
            );
        }
        out
    }

    /// Before the pool grows: unmap the spare pages whose work is known
    /// complete (no synchronisation, no retirement), up to `want`. Returns
    /// the pages gained.
    fn reclaim_spare_done(&mut self, ctx: &Ctx<'_>, want: u64) -> Result<u64, AllocError> {
        if want == 0 {
            return Ok(0);
        }
        let tick = self.tick;
        let mut chosen = Vec::new();
        for (ai, p) in self.spare_pages() {
            if chosen.len() as u64 >= want {
                break;
            }
            let s = self.arenas[ai].slot(p);
            if self.work_done(ctx, s.freed_by, s.freed_at, tick) {
                chosen.push((ai, p));
            }
        }
        let gained = self.move_cached(ctx, &chosen, false, false)?;
        self.spare_pages_reclaimed += gained;
        Ok(gained)
    }

    /// When the pool cannot grow: move up to `want` spare pages to the pool
    /// before any other cached page (unmapped, or retired when their work
    /// may still run). Returns the pages gained.
    fn reclaim_spare_all(&mut self, ctx: &Ctx<'_>, want: u64) -> Result<u64, AllocError> {
        if want == 0 {
            return Ok(0);
        }
        let mut chosen = self.spare_pages();
        chosen.truncate(want.min(usize::MAX as u64) as usize);
        let gained = self.move_cached(ctx, &chosen, false, false)?;
        self.spare_pages_reclaimed += gained;
        Ok(gained)
    }
}
