//! Arenas of their own (`Kind::Own`): one reservation holding at most one
//! block, at offset 0, whose length a feature changes (a growable buffer's).
//! Growing touches the pages the block reaches and backs the unmapped ones
//! exactly as an allocation does; shrinking untouches the pages it leaves,
//! which stay mapped as *spare pages* (the first class of cached pages
//! reclaimed) and carry the block's streams' work as a hazard, like any
//! freed range.

use std::ops::Range;

use super::stitch::{Core, Ctx};
use crate::error::AllocError;

impl Core {
    /// Move the block of arena `ai` from extent `from` to extent `to` (bytes
    /// from offset 0): the pages it leaves are untouched (with `freed`, as
    /// freed now by those streams), those it reaches touched.
    fn set_extent(&mut self, ai: usize, from: u64, to: u64, freed: Option<u64>) {
        let a = &mut self.arenas[ai];
        let page = a.page;
        if from > 0 {
            a.vacate(0);
        }
        if to > 0 {
            a.occupy(0, to);
        }
        let (n_from, n_to) = (from.div_ceil(page), to.div_ceil(page));
        if n_to > n_from {
            a.touch(n_from * page, (n_to - n_from) * page);
        } else if n_to < n_from {
            self.untouch(ai, n_to * page, (n_from - n_to) * page, freed);
        }
    }

    /// Grow the block of arena `ai` on stream index `si` from extent `from`
    /// to `to` (`requested` more bytes asked for): order the stream after
    /// the hazards past the old extent, back the pages it reaches that are
    /// not mapped. Out of memory leaves it as it was. Returns the pages it
    /// reached that were already mapped.
    pub(crate) fn grow_own_block(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (from, to): (u64, u64),
        requested: u64,
        si: u32,
    ) -> Result<u64, AllocError> {
        let (n_from, n_to) = (from.div_ceil(ctx.page), to.div_ceil(ctx.page));
        let need = if n_to > n_from {
            self.arenas[ai].unmapped_in(n_from, n_to - 1)
        } else {
            Vec::new()
        };
        if need.len() as u64 > ctx.pool.limit_pages() {
            return Err(self.oom(ctx, requested, need.len() as u64, 0));
        }
        if to > from {
            self.note_allocating(si);
            // The growth lies in the gap past the block: order the stream
            // after the hazards there before the gap drops them.
            let Some(gap) = self.arenas[ai].gap_at(from) else {
                return Err(AllocError::Internal(format!(
                    "arena {ai}: no gap past its block's extent {from:#x}"
                )));
            };
            self.order_after_hazards(ctx, ai, (from, gap), to - from, si)?;
            let hazard = self.arenas[ai].tiling.hazard_union(gap, from, to - from);
            self.set_extent(ai, from, to, None);
            if !need.is_empty() {
                let backed = self.back_pages(ctx, ai, requested, &need, (si, None));
                if backed.is_err() {
                    self.set_extent(ai, to, from, None);
                    // The range gets back its hazards, as one.
                    let (streams, k) = hazard;
                    if streams != 0 {
                        self.arenas[ai].add_hazard(from, to - from, streams, k);
                    }
                }
                self.sync_stats(ctx);
                backed?;
            }
        }
        self.stats.allocated_bytes.increase(to - from);
        self.stats.active_bytes.increase(to - from);
        Ok((n_to - n_from) - need.len() as u64)
    }

    /// Shrink the block of arena `ai`, used by the streams `streams`, from
    /// extent `from` to `to`: the pages it leaves stay mapped (spare pages),
    /// freed by those streams now.
    pub(crate) fn shrink_own_block(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (from, to): (u64, u64),
        streams: u64,
    ) {
        let tick = self.tick;
        if to < from {
            let track = self.streams.len() > 1;
            self.set_extent(ai, from, to, Some(streams));
            if track {
                self.arenas[ai].add_hazard(to, from - to, streams, tick);
            }
            for s in self.streams.in_mask(streams) {
                self.streams.note_free(ctx.vmm, s, tick, ctx.cfg.events);
            }
        }
        self.stats.allocated_bytes.decrease(from - to);
        self.stats.active_bytes.decrease(from - to);
    }

    /// Empty the block of arena `ai` (extent `from`), used by the streams
    /// `streams`: its pages stay mapped, freed by those streams now (with an
    /// event on each under [`EventTiming::AtFree`](super::config::EventTiming)),
    /// so that a later operation learns when the pages are free.
    pub(crate) fn vacate_own_block(&mut self, ctx: &Ctx<'_>, ai: usize, from: u64, streams: u64) {
        let tick = self.tick;
        self.set_extent(ai, from, 0, Some(streams));
        for s in self.streams.in_mask(streams) {
            self.streams.note_free(ctx.vmm, s, tick, ctx.cfg.events);
        }
        self.stats.allocated_bytes.decrease(from);
        self.stats.active_bytes.decrease(from);
    }

    /// Return to the pool the spare pages of arena `ai` from page `keep`
    /// on (farthest first) whose work is known complete.
    pub(crate) fn return_done_spare_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        keep: u64,
    ) -> Result<(), AllocError> {
        let tick = self.tick;
        let spare: Vec<(usize, u64)> = (keep..self.arenas[ai].pages.len() as u64)
            .rev()
            .filter(|&p| self.arenas[ai].slot(p).is_cached())
            .map(|p| (ai, p))
            .collect();
        let done: Vec<(usize, u64)> = spare
            .into_iter()
            .filter(|&(ai, p)| {
                let s = self.arenas[ai].slot(p);
                self.work_done(ctx, s.freed_by, s.freed_at, tick)
            })
            .collect();
        self.move_cached(ctx, &done, false, false).map(|_| ())
    }

    /// Map the unmapped pages of `pages` in arena `ai` for stream index
    /// `si`, up to the first retired one (mapping there would wait for its
    /// work): from free pool pages beyond `reserve` (kept for others), or
    /// from growth while the pool stays below the map-ahead bound of its
    /// limit. The pages are spare pages: cached, first to be reclaimed.
    /// Returns the pages mapped.
    pub(crate) fn map_ahead_in(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        pages: Range<u64>,
        reserve: u64,
        si: u32,
    ) -> Result<u64, AllocError> {
        let a = &self.arenas[ai];
        let mut need: Vec<u64> = pages
            .take_while(|&p| !a.slot(p).retired)
            .filter(|&p| a.slot(p).phys.is_none())
            .collect();
        let free = ctx.pool.free_pages().saturating_sub(reserve);
        let wanted = need.len() as u64;
        if free < wanted {
            let after = ctx.pool.total_pages() + (wanted - free);
            let grown = after.saturating_mul(1000)
                <= ctx
                    .pool
                    .limit_pages()
                    .saturating_mul(ctx.cfg.map_ahead.below_per_mille)
                && self.try_grow(ctx, wanted - free)?;
            if !grown {
                // The nearest pages the free ones cover.
                need.truncate(free.min(usize::MAX as u64) as usize);
            }
        }
        let n = need.len() as u64;
        if n == 0 {
            return Ok(0);
        }
        self.tick += 1;
        let backed = self.back_pages(ctx, ai, n * ctx.page, &need, (si, None));
        let tick = self.tick;
        if self.reclaim_queue_kept {
            for &p in &need {
                let s = self.arenas[ai].slot(p);
                if s.is_cached() && s.cached_at == tick {
                    self.reclaim_queue.push_back((ai, p, tick));
                }
            }
        }
        self.sync_stats(ctx);
        backed?;
        Ok(n)
    }
}
