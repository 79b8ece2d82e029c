//! One virtual arena: a reserved address range carved into blocks at 512-byte
//! granularity, with the page table behind it.
//!
//! Pure bookkeeping: no driver call is made here.
//!
//! Offsets are relative to the arena's base. The arena keeps:
//! - `tiling`: its blocks and the maximal free ranges between them (gaps,
//!   coalesced) in address order, the gaps indexed by (length, start) for
//!   best fit, each gap with its hazards: the freed byte ranges in it whose
//!   streams' work may still use them (see `tiling.rs`);
//! - `pages` (`page_table.rs`): for virtual page `p`, how many blocks touch
//!   it, the pool page mapped there (one handle, mapped whole at offset 0),
//!   and which streams freed blocks on it since it was mapped, and when.
//!
//! Invariants: every page with `touch > 0` is mapped (a block's pages are
//! always backed); `cached_pages` counts the mapped pages with `touch == 0`,
//! `touched_pages` those with `touch > 0`, `mapped_pages` the mapped ones,
//! `retired_pages` the retired ones (never touched, never mapped to a page
//! of their own; see [`PageSlot::retired`]).

use quilt_pool::Page;

pub(crate) use super::page_table::PageSlot;
use super::page_table::PageTable;
use super::tiling::{Hazard, PieceId, Tiling};

/// One arena. See the module documentation.
#[derive(Debug)]
pub(crate) struct Arena {
    /// Base virtual address of the reservation.
    pub(crate) base: u64,
    /// Size of the reservation in bytes (a multiple of the page size).
    pub(crate) size: u64,
    /// Page size in bytes.
    pub(crate) page: u64,
    /// `log2(page)` where the page size is a power of two (a granularity
    /// the driver reports always is; a configured size need not be): a
    /// shift where a division would cost tens of cycles on every operation.
    page_shift: Option<u32>,
    /// Blocks and gaps in address order, gaps by size.
    pub(crate) tiling: Tiling,
    pub(crate) pages: PageTable,
    pub(crate) cached_pages: u64,
    pub(crate) touched_pages: u64,
    pub(crate) mapped_pages: u64,
    pub(crate) retired_pages: u64,
    /// The end of the highest block ever placed: space above it was never
    /// used (its pages' part above it carries no work to wait for).
    pub(crate) used_to: u64,
}

impl Arena {
    /// An empty arena over the reservation `base .. base + size`.
    pub(crate) fn new(base: u64, size: u64, page: u64) -> Arena {
        Arena {
            base,
            size,
            page,
            page_shift: page.is_power_of_two().then(|| page.trailing_zeros()),
            tiling: Tiling::new(size),
            pages: PageTable::default(),
            cached_pages: 0,
            touched_pages: 0,
            mapped_pages: 0,
            retired_pages: 0,
            used_to: 0,
        }
    }

    /// Pages `first ..= last` that a range `off .. off + len` overlaps.
    #[inline]
    pub(crate) fn page_span(&self, off: u64, len: u64) -> (u64, u64) {
        let last_byte = off + len - 1;
        match self.page_shift {
            Some(s) => (off >> s, last_byte >> s),
            None => (off / self.page, last_byte / self.page),
        }
    }

    /// The blocks in address order, as (start, end).
    pub(crate) fn occupied(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tiling.pieces().filter(|p| !p.2).map(|p| (p.0, p.1))
    }

    /// The gaps in address order, as (start, end).
    pub(crate) fn gaps(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tiling.pieces().filter(|p| p.2).map(|p| (p.0, p.1))
    }

    /// Up to `n` gaps that hold `len` bytes, best fit first (smallest gap,
    /// lowest address among equals), as (start, gap). A block goes at its
    /// gap's start, next to the block before it, so they share their
    /// boundary page.
    pub(crate) fn fitting_gaps(
        &self,
        len: u64,
        n: usize,
    ) -> impl Iterator<Item = (u64, PieceId)> + '_ {
        self.tiling
            .fitting(len)
            .take(n)
            .map(|(_, start, id)| (start, id))
    }

    /// The best-fitting gap of at least `len` bytes, as (start, gap): the
    /// first of [`Arena::fitting_gaps`].
    pub(crate) fn best_fit(&self, len: u64) -> Option<(u64, PieceId)> {
        self.tiling.best_fit(len)
    }

    /// The best-fitting gap of at most `max_len` bytes whose first `len` bytes
    /// lie on mapped pages only (a cached free range), looking at no more than
    /// `tries` candidates, as (start, gap).
    pub(crate) fn best_fit_mapped(
        &self,
        len: u64,
        max_len: u64,
        tries: usize,
    ) -> Option<(u64, PieceId)> {
        self.tiling
            .fitting(len)
            .take(tries)
            .take_while(|&(l, _, _)| l <= max_len)
            .map(|(_, start, id)| (start, id))
            .find(|&(start, _)| self.unmapped_pages(start, len) == 0)
    }

    /// The end of the last mapped page (0: none is mapped), in bytes.
    pub(crate) fn mapped_end(&self) -> u64 {
        self.pages
            .phys
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |p| (p as u64 + 1) * self.page)
    }

    /// A page-aligned offset for `len` bytes past everything mapped or
    /// occupied: fresh virtual space whose pages are all unmapped, as
    /// (offset, gap).
    pub(crate) fn fresh_tail(&self, len: u64) -> Option<(u64, PieceId)> {
        let (gs, ge, id) = self.tiling.last_gap()?;
        let start = gs.max(self.mapped_end()).div_ceil(self.page) * self.page;
        (ge >= start && ge - start >= len).then_some((start, id))
    }

    /// Occupy `off .. off + len`, which must lie inside one gap (returns false,
    /// changing nothing, when it does not). Finds the gap by walking the
    /// arena from its start: for arenas of few pieces (a growable buffer's);
    /// the allocator's blocks use [`Arena::occupy_gap`].
    pub(crate) fn occupy(&mut self, off: u64, len: u64) -> bool {
        self.tiling
            .find(off)
            .and_then(|g| self.tiling.occupy(g, off, len))
            .is_some()
    }

    /// Occupy `off .. off + len` of gap `gap`; returns the block's piece, or
    /// `None` (changing nothing) when the range does not lie inside that gap.
    pub(crate) fn occupy_gap(&mut self, gap: PieceId, off: u64, len: u64) -> Option<PieceId> {
        self.tiling.occupy(gap, off, len)
    }

    /// Give back the occupied range starting at `off`; coalesces it with the
    /// gaps beside it. Returns its end, or `None` when no block starts at
    /// `off`. Finds the block by walking the arena from its start: for
    /// arenas of few pieces (a growable buffer's); the allocator's blocks use
    /// [`Arena::vacate_block`].
    pub(crate) fn vacate(&mut self, off: u64) -> Option<u64> {
        let id = self.tiling.find(off)?;
        match self.tiling.block(id) {
            Some((s, _)) if s == off => self.tiling.vacate(id).map(|(_, e)| e),
            _ => None,
        }
    }

    /// Give back block `id`, coalescing it with the gaps beside it. Returns
    /// its range, or `None` when `id` is no block.
    pub(crate) fn vacate_block(&mut self, id: PieceId) -> Option<(u64, u64)> {
        self.tiling.vacate(id)
    }

    /// The slot of page `p` (a default, unmapped slot past the table).
    pub(crate) fn slot(&self, p: u64) -> PageSlot {
        self.pages.get(p)
    }

    fn ensure_len(&mut self, last: u64) {
        if self.pages.len() <= last as usize {
            self.pages.grow_to(last as usize + 1);
        }
    }

    /// Pages among `off .. off + len` that are not mapped.
    pub(crate) fn unmapped_pages(&self, off: u64, len: u64) -> u64 {
        let (first, last) = self.page_span(off, len);
        let known = self.pages.len() as u64;
        if last < known && self.mapped_pages == known {
            return 0; // every page of the table is mapped
        }
        let known_part = first.min(known)..(last + 1).min(known);
        let beyond = (last + 1).saturating_sub(first.max(known));
        let known_unmapped = self.pages.phys[known_part.start as usize..known_part.end as usize]
            .iter()
            .filter(|p| p.is_none())
            .count() as u64;
        known_unmapped + beyond
    }

    /// Pages `first ..= last` that are not mapped, in order.
    pub(crate) fn unmapped_in(&self, first: u64, last: u64) -> Vec<u64> {
        (first..=last)
            .filter(|&p| self.slot(p).phys.is_none())
            .collect()
    }

    /// A block now covers `off .. off + len`: add one to the touch count of
    /// its pages. Returns how many of them are not mapped.
    ///
    /// Only the block's two end pages can be shared with another block
    /// (blocks never overlap): the pages between them are touched by no
    /// other, so each is a first touch and costs a store and, unless every
    /// page of the table is mapped, a look at its mapping (a large block
    /// touches hundreds of pages).
    pub(crate) fn touch(&mut self, off: u64, len: u64) -> u64 {
        self.used_to = self.used_to.max(off + len);
        let (first, last) = self.page_span(off, len);
        self.ensure_len(last);
        let all_mapped = self.mapped_pages == self.pages.len() as u64;
        let (f, l) = (first as usize, last as usize);
        let touch = &mut self.pages.touch[f..=l];
        let phys = &self.pages.phys[f..=l];
        let n = touch.len();
        let (mut unmapped, mut fresh, mut fresh_mapped) = (0, 0, 0);
        for i in [0, n - 1].into_iter().take(if n > 1 { 2 } else { 1 }) {
            touch[i] += 1;
            let mapped = u64::from(phys[i].is_some());
            let first_touch = u64::from(touch[i] == 1);
            unmapped += 1 - mapped;
            fresh += first_touch;
            fresh_mapped += first_touch & mapped;
        }
        if n > 2 {
            let inner = 1..n - 1;
            debug_assert!(
                touch[inner.clone()].iter().all(|&t| t == 0),
                "a page inside a new block is touched"
            );
            touch[inner.clone()].fill(1);
            let inner_unmapped = if all_mapped {
                0
            } else {
                phys[inner.clone()].iter().filter(|p| p.is_none()).count() as u64
            };
            let inner_len = inner.len() as u64;
            unmapped += inner_unmapped;
            fresh += inner_len;
            fresh_mapped += inner_len - inner_unmapped;
        }
        self.touched_pages += fresh;
        self.cached_pages -= fresh_mapped;
        unmapped
    }

    /// A block over `off .. off + len` is gone: take one from the touch
    /// count of its pages. With `freed`, the block was freed now (at `tick`,
    /// the latest tick so far; not rolled back) by those streams, which the
    /// pages remember. Calls `cached` with the pages that become cached, in
    /// address order, a run at a time. (As in [`Arena::touch`], the pages
    /// between the block's ends were touched by it alone, so each becomes
    /// untouched: the same values are written on each.)
    pub(crate) fn untouch(
        &mut self,
        off: u64,
        len: u64,
        freed: Option<u64>,
        tick: u64,
        mut cached: impl FnMut(std::ops::Range<u64>),
    ) {
        let (first, last) = self.page_span(off, len);
        self.ensure_len(last);
        let all_mapped = self.mapped_pages == self.pages.len() as u64;
        let (f, l) = (first as usize, last as usize);
        let t = &mut self.pages;
        // The end pages, perhaps shared with the blocks beside them.
        let (head_untouched, head_cached) = t.leave(f, freed, tick);
        let (tail_untouched, tail_cached) = if l > f {
            t.leave(l, freed, tick)
        } else {
            (false, false)
        };
        // The pages between: touched by this block alone, so the same
        // values are written on each.
        let (mut inner_untouched, mut inner_cached) = (0, 0);
        if l > f + 1 {
            let inner = f + 1..l;
            debug_assert!(
                t.touch[inner.clone()].iter().all(|&n| n == 1),
                "a page inside a block is shared"
            );
            inner_untouched = inner.len() as u64;
            t.touch[inner.clone()].fill(0);
            if let Some(streams) = freed {
                t.note_freed_range(inner.clone(), streams, tick);
            }
            if all_mapped {
                t.cached_at[inner].fill(tick);
                inner_cached = inner_untouched;
            } else {
                // Some may not be mapped (a block taken back before it was
                // backed): only the mapped ones become cached.
                for p in inner {
                    if t.phys[p].is_some() {
                        t.cached_at[p] = tick;
                        inner_cached += 1;
                    }
                }
            }
        }
        // The pages that became cached, in address order.
        if head_cached {
            cached(first..first + 1);
        }
        if inner_cached == inner_untouched {
            if inner_cached > 0 {
                cached(first + 1..last);
            }
        } else {
            for p in first + 1..last {
                if t.phys[p as usize].is_some() {
                    cached(p..p + 1);
                }
            }
        }
        if tail_cached {
            cached(last..last + 1);
        }
        self.touched_pages -=
            u64::from(head_untouched) + inner_untouched + u64::from(tail_untouched);
        self.cached_pages += u64::from(head_cached) + inner_cached + u64::from(tail_cached);
    }

    /// Record that `page` is mapped at virtual page `p` (which must be
    /// unmapped). Returns true when the page is cached (no block touches it).
    pub(crate) fn set_mapped(&mut self, p: u64, page: Page, tick: u64) -> bool {
        self.ensure_len(p);
        let (p, t) = (p as usize, &mut self.pages);
        t.phys[p] = Some(page);
        t.freed_by[p] = 0;
        t.freed_at[p] = 0;
        self.mapped_pages += 1;
        if t.touch[p] == 0 {
            t.cached_at[p] = tick;
            self.cached_pages += 1;
            true
        } else {
            false
        }
    }

    /// Retire the cached virtual page `p`: its pool page is handed on (and
    /// returned) while its mapping stays until the work freed here is known
    /// complete. `None` (changing nothing) unless `p` is cached.
    pub(crate) fn set_retired(&mut self, p: u64) -> Option<Page> {
        let (p, t) = (p as usize, &mut self.pages);
        if p >= t.len() || t.touch[p] != 0 || t.retired[p] {
            return None;
        }
        let page = t.phys[p].take()?;
        t.retired[p] = true;
        self.mapped_pages -= 1;
        self.cached_pages -= 1;
        self.retired_pages += 1;
        Some(page)
    }

    /// The retired virtual page `p` was unmapped.
    pub(crate) fn clear_retired(&mut self, p: u64) {
        let (p, t) = (p as usize, &mut self.pages);
        if p < t.len() && t.retired[p] {
            t.retired[p] = false;
            t.freed_by[p] = 0;
            t.freed_at[p] = 0;
            self.retired_pages -= 1;
        }
    }

    /// Note that the streams `mask`, at tick `k`, may still use the physical
    /// page now mapped at virtual page `p`.
    pub(crate) fn note_freed(&mut self, p: u64, mask: u64, k: u64) {
        if (p as usize) < self.pages.len() {
            self.pages.note_freed(p as usize, mask, k);
        }
    }

    /// The retired pages among `off .. off + len`.
    pub(crate) fn retired_in(
        &self,
        off: u64,
        len: u64,
    ) -> impl Iterator<Item = (u64, PageSlot)> + '_ {
        let (first, last) = self.page_span(off, len);
        let any = self.retired_pages > 0;
        (first..=last)
            .filter(move |_| any)
            .map(|p| (p, self.slot(p)))
            .filter(|(_, s)| s.retired)
    }

    /// Record that virtual page `p` is unmapped; returns the pool page that
    /// was there.
    pub(crate) fn set_unmapped(&mut self, p: u64) -> Option<Page> {
        let (p, t) = (p as usize, &mut self.pages);
        let page = t.phys.get_mut(p)?.take()?;
        t.freed_by[p] = 0;
        t.freed_at[p] = 0;
        self.mapped_pages -= 1;
        if t.touch[p] == 0 {
            self.cached_pages -= 1;
        }
        Some(page)
    }

    /// Note a freed range `off .. off + len` (inside one gap) whose
    /// `streams` may still use it. Finds the gap by walking the arena from
    /// its start: for arenas of few pieces (a growable buffer's); the
    /// allocator's frees add to the gap of the vacated block directly.
    pub(crate) fn add_hazard(&mut self, off: u64, len: u64, streams: u64, tick: u64) {
        if let Some(id) = self.gap_at(off) {
            self.tiling
                .add_hazard(id, Hazard::over(off, len, streams, tick));
        }
    }

    /// Hazards of the stream `bit`'s frees since tick `since` that left
    /// none, built from the pages: each page it freed on since (`freed_by`
    /// has it, `freed_at` is later) becomes, over its part in a gap that no
    /// hazard covers yet, a hazard of that stream at the page's latest free.
    /// Pieces side by side join, at the later tick, where both ticks are
    /// past `mark` (no event of the stream recorded since: see
    /// `Streams::last_mark`). For the frees a single stream made before a
    /// second appeared (`since` 0) and those of a solo run (`solo.rs`).
    /// Pristine space (never used, or unmapped since: an unmap waits for
    /// the work) gets none, nor the part of a page above the highest block
    /// ever placed (`used_to`).
    pub(crate) fn add_hazards_from_pages(&mut self, bit: u64, since: u64, mark: u64) {
        let known = self.pages.len() as u64;
        if known == 0 {
            return;
        }
        for (id, start, end) in self.tiling.gap_ids() {
            let (first, last) = self.page_span(start, end - start);
            let last = last.min(known - 1);
            if first > last {
                continue;
            }
            let existing = self.tiling.gap_hazards(id);
            let mut under = 0; // the first existing hazard not wholly before
            let mut new: Vec<Hazard> = Vec::new();
            for p in first..=last {
                let (freed_by, tick) = (
                    self.pages.freed_by[p as usize],
                    self.pages.freed_at[p as usize],
                );
                if freed_by & bit == 0 || tick <= since {
                    continue;
                }
                let (mut lo, hi) = (
                    (p * self.page).max(start),
                    ((p + 1) * self.page).min(end).min(self.used_to),
                );
                // The parts of `lo .. hi` between the existing hazards.
                while lo < hi {
                    while existing.get(under).is_some_and(|h| h.end <= lo) {
                        under += 1;
                    }
                    let piece_end = match existing.get(under) {
                        Some(h) if h.start <= lo => {
                            lo = h.end.min(hi);
                            continue;
                        }
                        Some(h) => h.start.min(hi),
                        None => hi,
                    };
                    match new.last_mut() {
                        Some(prev) if prev.end == lo && prev.tick > mark && tick > mark => {
                            prev.end = piece_end;
                            prev.tick = prev.tick.max(tick);
                        }
                        _ => new.push(Hazard::over(lo, piece_end - lo, bit, tick)),
                    }
                    lo = piece_end;
                }
            }
            self.tiling.add_hazards(id, new);
        }
    }

    /// The gap holding `off`, walking the arena from its start (see
    /// [`Arena::add_hazard`]); `None` when a block holds it.
    pub(crate) fn gap_at(&self, off: u64) -> Option<PieceId> {
        self.tiling
            .find(off)
            .filter(|&id| self.tiling.gap(id).is_some())
    }

    /// The virtual address of page `p`.
    pub(crate) fn page_addr(&self, p: u64) -> u64 {
        self.base + p * self.page
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;

    #[test]
    fn page_span_shifts_or_divides_alike() {
        const MIB: u64 = 1 << 20;
        for page in [2 * MIB, 64 << 10, 20 * MIB, 3 * 4096] {
            let a = Arena::new(0, 64 * page, page);
            assert_eq!(a.page_shift.is_some(), page.is_power_of_two());
            for (off, len) in [
                (0, 1),
                (0, page),
                (1, page),
                (page - 1, 2),
                (5 * page + 7, 3 * page),
            ] {
                let want = (off / page, (off + len - 1) / page);
                assert_eq!(a.page_span(off, len), want, "page {page}, {off} + {len}");
            }
        }
    }

    /// The hazards of `a`, as (start, end, streams, tick).
    fn hazards(a: &Arena) -> Vec<(u64, u64, u64, u64)> {
        a.tiling
            .gap_ids()
            .into_iter()
            .flat_map(|(id, _, _)| a.tiling.gap_hazards(id).to_vec())
            .map(|h| (h.start, h.end, h.streams, h.tick))
            .collect()
    }

    #[test]
    fn pages_freed_on_since_become_hazards_around_those_already_there() {
        // Pages of 100 bytes; pages 0..6 known. Stream bit 1 freed on pages
        // 1 and 2 during the run (ticks 7 and 9), on page 4 before it (tick
        // 3); stream bit 2 freed on page 2 during the run too, with its own
        // hazard over 230..260. A block holds 500..600 (page 5).
        let mut a = Arena::new(0, 1000, 100);
        a.pages.grow_to(6);
        for (p, by, at) in [(1, 1, 7), (2, 3, 9), (4, 1, 3), (5, 1, 8)] {
            a.pages.freed_by[p] = by;
            a.pages.freed_at[p] = at;
        }
        let g = a.tiling.find(0).unwrap();
        a.tiling.occupy(g, 500, 100).unwrap();
        a.used_to = 600;
        let g = a.tiling.find(0).unwrap();
        a.tiling.add_hazard(g, Hazard::over(230, 30, 2, 9));
        // Since tick 5 (a solo run's start); the stream's last event was at tick 6.
        a.add_hazards_from_pages(1, 5, 6);
        assert_eq!(
            hazards(&a),
            vec![
                (100, 230, 1, 9), // pages 1 and 2 joined (ticks past the mark)
                (230, 260, 2, 9), // the hazard already there
                (260, 300, 1, 9), // the rest of page 2
            ],
            "page 4 was freed on before tick 5, page 5 is under a block"
        );
        a.tiling.check(1000).unwrap();
        // With an event of the stream at tick 7, pages 1 and 2 stay apart.
        let mut b = Arena::new(0, 1000, 100);
        b.pages.grow_to(3);
        b.used_to = 300;
        for (p, at) in [(1, 7), (2, 9)] {
            b.pages.freed_by[p] = 1;
            b.pages.freed_at[p] = at;
        }
        b.add_hazards_from_pages(1, 5, 7);
        assert_eq!(hazards(&b), vec![(100, 200, 1, 7), (200, 300, 1, 9)]);
    }

    #[test]
    fn a_page_above_the_highest_block_ever_placed_is_a_hazard_only_below_it() {
        // Pages of 100 bytes: blocks were placed up to 250 and freed on
        // pages 1 and 2 (tick 7); 250..300 of page 2 was never used.
        let mut a = Arena::new(0, 1000, 100);
        a.pages.grow_to(3);
        for p in [1, 2] {
            a.pages.freed_by[p] = 1;
            a.pages.freed_at[p] = 7;
        }
        a.used_to = 250;
        a.add_hazards_from_pages(1, 0, 7);
        assert_eq!(hazards(&a), vec![(100, 200, 1, 7), (200, 250, 1, 7)]);
        a.tiling.check(1000).unwrap();
    }
}
