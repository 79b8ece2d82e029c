//! Memory pressure: the pool could not grow at its last try (its memory
//! limit or the device's memory reached). Under pressure every new page a
//! block needs is a cached page moved from elsewhere, so a gap whose pages
//! are mapped saves driver calls but no memory: what memory depends on is
//! how many pages blocks touch, that is, how tightly they pack.
//!
//! Pages are what a block costs. A block of `len` bytes at `off` touches
//! the pages `off / page ..= (off + len - 1) / page`; the pages strictly
//! between its two end pages lie inside its gap, touched by no other block,
//! while an end page may already be touched by the block beside the gap
//! (the gap's first page when the gap starts mid-page, its last when it
//! ends mid-page). The bytes of a touched page that no block covers are
//! stranded: only a block placed in the gap beside them can use them. So a
//! placement strands `page` bytes for every page it touches first, less
//! the block's bytes: the fewer untouched pages a place touches
//! ([`first_touches`]), the fewer bytes it strands, and that count is all
//! the memory a place costs under pressure.
//!
//! In a gap `[a, b)` the fewest first touches are at one of its ends
//! ([`packed_in_gap`]): a block at `a` shares `a`'s page with the block
//! before the gap when `a` is mid-page; at `b - len` it shares `b`'s page
//! with the block after it; a block away from both ends shares neither and
//! touches at least `ceil(len / page)` pages, no fewer than either end
//! gives (each end touches at most one page more than that, and shares it
//! when the gap's end is mid-page; where the gap's end is on a page
//! boundary the block's own pages start or end there). The start wins a
//! tie, so a block that gains nothing by its gap's end goes where it went
//! without pressure.
//!
//! Under pressure Quilt's placement (`BestFit::pack`, `placement.rs`)
//! takes, among the same best-fitting gaps it looks at without pressure,
//! the place touching the fewest untouched pages (the better fit on a
//! tie): not the candidate that is mapped or needs no wait. Where retired
//! pages still in use lie in a gap, only places past them count (no
//! synchronisation). Without pressure placement chooses among its
//! candidates as configured: a mapped gap there spares the pool's growth
//! as well as driver calls.

use super::arena::Arena;
use super::stitch::Core;

impl Core {
    /// Note the outcome of a try to grow the pool: refused (the limit or
    /// the device's memory reached) puts the allocator under pressure,
    /// growth ends it.
    pub(super) fn note_growth(&mut self, grew: bool) {
        self.under_pressure = !grew;
    }
}

/// The pages a block of `len` bytes at `off` of `arena` would be the first
/// to touch: the pages it spans, less its end pages that another block
/// already touches.
pub(super) fn first_touches(arena: &Arena, off: u64, len: u64) -> u64 {
    let (first, last) = arena.page_span(off, len);
    let shared_first = arena.slot(first).touch > 0;
    let shared_last = last > first && arena.slot(last).touch > 0;
    last - first + 1 - u64::from(shared_first) - u64::from(shared_last)
}

/// A place for a block under pressure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PackedPlace {
    /// The pages the block would be the first to touch ([`first_touches`]).
    pub(super) first_touches: u64,
    /// The block's offset in its arena.
    pub(super) off: u64,
}

/// Where a block of `len` bytes packs best in gap `start .. end` of
/// `arena` (`start`: the gap's start, or the first place past retired pages
/// still in use): at `start` or flush with `end`, whichever touches fewer
/// untouched pages ([`first_touches`]), `start` on a tie; with the end,
/// `start` as well, for when the end place cannot be taken (a retired page
/// still in use under it). `None` when the block does not fit.
pub(super) fn packed_in_gap(
    arena: &Arena,
    (start, end): (u64, u64),
    len: u64,
) -> Option<(PackedPlace, Option<PackedPlace>)> {
    let last_start = end.checked_sub(len).filter(|&s| s >= start)?;
    let place = |off| PackedPlace {
        first_touches: first_touches(arena, off, len),
        off,
    };
    let at_start = place(start);
    if last_start == start {
        return Some((at_start, None));
    }
    let at_end = place(last_start);
    if at_end.first_touches < at_start.first_touches {
        return Some((at_end, Some(at_start)));
    }
    Some((at_start, None))
}
