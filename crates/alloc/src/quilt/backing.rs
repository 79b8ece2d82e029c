//! Backing a placed block with pool pages: retired pages under it unmapped
//! first, page hazards ordered, one map per page (one handle each), one
//! set-access per contiguous range, all undone on failure; the pool's
//! spare pages mapped ahead of the arena's top in the same calls
//! ([`MappedAhead`]).

use quilt_pool::{Page, PageId};
use quilt_vmm::VmmError;

use super::config::AccessGranularity;
use super::stitch::{pool_err, Core, Ctx, Kind, MappedAhead, PagesFor};
use super::tiling::{Hazard, PieceId};
use crate::error::AllocError;

impl Core {
    /// Back the unmapped virtual pages `need` of arena `ai` (a block's on
    /// stream `t`, its piece `block` where the caller has it) with pool
    /// pages: one map per page, one set-access per contiguous range. A
    /// retired page among them is unmapped first (its work completed, by a
    /// synchronisation if need be: placement avoids this); a pool page with
    /// a hazard orders `t` after that work first, and the hazard stays over
    /// the rest of the page ([`Core::keep_page_hazard`]).
    pub(super) fn back_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        size: u64,
        need: &[u64],
        (t, block): (u32, Option<PieceId>),
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
        let pages_for = match self.arena_meta[ai].1 {
            Kind::Own => PagesFor::Mapping,
            _ => PagesFor::Block,
        };
        self.obtain_free_pages(ctx, size, n, pages_for)?;
        let spare = ctx.pool.free_pages().saturating_sub(n);
        let ahead = self.pages_ahead(ai, need, spare);
        let mut at = need.to_vec();
        at.extend_from_slice(&ahead);
        let pages = match ctx.pool.take(at.len() as u64) {
            Ok(pages) => pages,
            Err(_) if !ahead.is_empty() => {
                at.truncate(need.len());
                ctx.pool.take(n).map_err(pool_err)?
            }
            Err(e) => return Err(pool_err(e)),
        };
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
        let mut result = self.map_pages(ctx, ai, &at, &pages);
        if result.is_err() && at.len() > need.len() {
            // Mapping ahead only spares later calls: the block's own pages
            // alone, as without it.
            at.truncate(need.len());
            let pages = ctx.pool.take(n).map_err(pool_err)?;
            result = self.map_pages(ctx, ai, &at, &pages);
            return result;
        }
        if result.is_ok() && at.len() > need.len() {
            let ahead = &at[need.len()..];
            if self.reclaim_queue_kept {
                let tick = self.tick;
                self.reclaim_queue
                    .extend(ahead.iter().map(|&p| (ai, p, tick)));
            }
            let page = ctx.page;
            self.mapped_ahead = MappedAhead {
                arena: ai,
                start: ahead[0] * page,
                end: (ahead[ahead.len() - 1] + 1) * page,
                at: self.tick,
            };
        }
        // A page now mapped here carries its hazard from now on: over the
        // rest of the page beside the block, or in its slot where a failed
        // undo left it mapped; the pages given back keep theirs.
        for (&p, pg) in need.iter().zip(&pages) {
            if self.arenas[ai].slot(p).phys == Some(*pg) {
                if let Some(hazard) = self.page_hazards.remove(&pg.id) {
                    if result.is_err() {
                        self.arenas[ai].note_freed(p, hazard.0, hazard.1);
                    } else {
                        self.keep_page_hazard(ai, p, hazard, block);
                    }
                }
            }
        }
        result
    }

    /// The pool page just mapped at virtual page `p` of arena `ai` carried
    /// the hazard `(streams, k)`: work of those streams up to tick `k`, at
    /// another address, may still use it. The block it was taken for
    /// ordered its stream after that work, but a block rarely fills its
    /// page: the rest lies in the gaps beside it (no other block touches a
    /// page that was unmapped), where the next block may be placed on the
    /// same memory, on another stream. So the hazard goes over the page's
    /// part in those gaps (the gaps beside `block`, or found from the
    /// arena's start without it), joined to any hazard there; and on a
    /// page no block touches (mapped ahead of a growable buffer), into its
    /// slot too, which reclaim reads.
    fn keep_page_hazard(
        &mut self,
        ai: usize,
        p: u64,
        (streams, k): (u64, u64),
        block: Option<PieceId>,
    ) {
        let a = &mut self.arenas[ai];
        let page = a.page;
        let gaps = match block {
            Some(b) => a.tiling.beside(b),
            None => [a.gap_at(p * page), a.gap_at((p + 1) * page - 1)],
        };
        for gap in gaps.into_iter().flatten() {
            a.tiling
                .add_hazard_over(gap, Hazard::over(p * page, page, streams, k));
        }
        if a.slot(p).touch == 0 {
            a.note_freed(p, streams, k);
        }
    }

    /// The virtual pages of arena `ai` to map ahead of a block whose new
    /// pages are `need`, with up to `spare` pool pages left free once the
    /// block has its own (the pool's growth margin, see
    /// [`quilt_pool::GrowthPolicy`]): the unmapped pages right after the
    /// block's last one, where the arena's top goes next. They are mapped
    /// in the block's calls, under its one set-access, as expandable
    /// segments map a whole segment at a time: the next blocks at the top
    /// find them mapped and make no driver call. Memory held is unchanged
    /// (the pool holds those pages either way), and so is every placement
    /// ([`MappedAhead`]). A free pool page serves any arena, a page mapped
    /// ahead only this one's top: so only where this is the one arena that
    /// takes pages (an ordinary arena shared by every stream, no other
    /// arena holding a reservation: not beside a small blocks' arena, a
    /// tag's or a growable buffer's, which would move it or grow the pool
    /// anew), while no pool page carries a hazard, and when the block's
    /// last page is new (it ends at the top).
    fn pages_ahead(&self, ai: usize, need: &[u64], spare: u64) -> Vec<u64> {
        let Some(&last) = need.last() else {
            return Vec::new();
        };
        let shared = matches!(self.arena_meta[ai], (None, Kind::Large | Kind::Small));
        if spare == 0 || !shared || !self.page_hazards.is_empty() {
            return Vec::new();
        }
        let alone = self
            .arenas
            .iter()
            .enumerate()
            .all(|(i, a)| i == ai || a.size == 0);
        if !alone {
            return Vec::new();
        }
        let a = &self.arenas[ai];
        let end = a.size / a.page;
        (last + 1..end)
            .take(spare as usize)
            .take_while(|&p| {
                let slot = a.slot(p);
                slot.phys.is_none() && !slot.retired
            })
            .collect()
    }

    /// Map `pages` (each one whole handle, at offset 0) at the virtual pages
    /// `at` of arena `ai`, and set access. On error, unmaps what it mapped
    /// and hands the pages back.
    pub(super) fn map_pages(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        at: &[u64],
        pages: &[Page],
    ) -> Result<(), AllocError> {
        let page = ctx.page;
        let mut mapped = 0usize;
        let mut result: Result<(), VmmError> = Ok(());
        for (&p, pg) in at.iter().zip(pages) {
            let addr = self.arenas[ai].page_addr(p);
            if let Err(e) = ctx.vmm.map(addr, page, pg.handle, 0) {
                result = Err(e);
                break;
            }
            mapped += 1;
            if ctx.cfg.access == AccessGranularity::PerPage {
                if let Err(e) = set_access(ctx, addr, page) {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() && ctx.cfg.access == AccessGranularity::PerRange {
            let mut i = 0;
            while i < at.len() {
                let mut j = i + 1;
                while j < at.len() && at[j] == at[j - 1] + 1 {
                    j += 1;
                }
                let addr = self.arenas[ai].page_addr(at[i]);
                if let Err(e) = set_access(ctx, addr, (j - i) as u64 * page) {
                    result = Err(e);
                    break;
                }
                i = j;
            }
        }
        let tick = self.tick;
        match result {
            Ok(()) => {
                for (&p, &pg) in at.iter().zip(pages) {
                    self.arenas[ai].set_mapped(p, pg, tick);
                }
                Ok(())
            }
            Err(e) => {
                // Undo: unmap what was mapped; a page that cannot be unmapped
                // stays recorded as mapped (cached once the block is undone,
                // reclaimable later).
                let mut give = Vec::with_capacity(pages.len());
                for (i, (&p, &pg)) in at.iter().zip(pages).enumerate() {
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
}

/// The pages last mapped ahead of an arena's top ([`Core::back_pages`];
/// only where that arena is the only one, so one range for the allocator)
/// that no block has reached since are the ones still cached since they
/// were mapped (a block that reaches one touches it, and frees it at a
/// later tick). Placement counts these as the new pages they would be
/// without mapping ahead, so that mapping ahead changes no placement, only
/// the calls a block at the top makes (none: its pages are mapped).
impl MappedAhead {
    /// How many pages of `off .. off + len` of arena `ai` (as `arena`) are
    /// pages mapped ahead that no block has reached; 0 at once for a range
    /// that ends below them, as every candidate but the arena's top does.
    #[inline]
    pub(crate) fn pages_in(
        &self,
        arena: &super::arena::Arena,
        ai: usize,
        off: u64,
        len: u64,
    ) -> u64 {
        if off + len <= self.start || self.end <= off {
            return 0;
        }
        self.count_in(arena, ai, off, len)
    }

    /// [`MappedAhead::pages_in`] for a range that reaches them (the top's
    /// candidate only: out of the hot path's line).
    #[cold]
    #[inline(never)]
    fn count_in(&self, arena: &super::arena::Arena, ai: usize, off: u64, len: u64) -> u64 {
        if ai != self.arena {
            return 0;
        }
        let (lo, hi) = (off.max(self.start), (off + len).min(self.end));
        if lo >= hi {
            return 0;
        }
        let (first, last) = arena.page_span(lo, hi - lo);
        (first..=last)
            .map(|p| arena.slot(p))
            .filter(|s| s.phys.is_some() && s.touch == 0 && s.cached_at == self.at)
            .count() as u64
    }
}

/// `cuMemSetAccess` over `addr..addr + size` for this device, and for the
/// peers of [`crate::quilt::QuiltConfig::peer_access`] in the same call.
fn set_access(ctx: &Ctx<'_>, addr: quilt_vmm::DevicePtr, size: u64) -> Result<(), VmmError> {
    if ctx.cfg.peer_access.is_empty() {
        return ctx.vmm.set_access(addr, size);
    }
    let devices = ctx.cfg.peer_access.access_list(ctx.vmm.caps().ordinal);
    ctx.vmm.set_access_for(addr, size, &devices)
}
