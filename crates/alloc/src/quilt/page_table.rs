//! An arena's page table: for each virtual page, how many blocks touch it,
//! the pool page mapped there, and which streams freed blocks on it since.
//!
//! One column per field (a structure of arrays): a block's pages are a run
//! of each column, so what a block does to the pages between its ends (a
//! touch, an untouch: the same value written on every one) is a fill over
//! contiguous memory, not a walk over page records; a large block covers
//! hundreds of pages. [`PageSlot`] is one page read whole.
//!
//! Pure bookkeeping, kept consistent by `arena.rs` (its invariants are
//! stated there).

use std::ops::Range;

use quilt_pool::Page;

/// One virtual page, read whole from the table ([`PageTable::get`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageSlot {
    /// Blocks overlapping this page.
    pub(crate) touch: u32,
    /// The pool page mapped here.
    pub(crate) phys: Option<Page>,
    /// Streams (as bits, see `Streams::bit`) that freed a block on this page
    /// since it was mapped: their work may still use it.
    pub(crate) freed_by: u64,
    /// The allocator tick of the last free on this page.
    pub(crate) freed_at: u64,
    /// The tick at which the page last became cached (mapped, untouched): its
    /// entry in the reclaim queue is valid while this matches.
    pub(crate) cached_at: u64,
    /// Retired: the handle once mapped here was moved to another virtual page
    /// while work freed here (`freed_by`, `freed_at`) may still run, so this
    /// page keeps its mapping, backs nothing of its own (`phys` is `None`),
    /// and is unmapped once that work is known complete.
    pub(crate) retired: bool,
}

impl PageSlot {
    /// Mapped and touched by no block.
    pub(crate) fn is_cached(&self) -> bool {
        self.phys.is_some() && self.touch == 0
    }
}

/// The pages of one arena, a column per [`PageSlot`] field, all of the
/// same length (the pages known so far; past them every page reads as
/// [`PageSlot::default`]).
#[derive(Debug, Default)]
pub(crate) struct PageTable {
    pub(crate) touch: Vec<u32>,
    pub(crate) phys: Vec<Option<Page>>,
    pub(crate) freed_by: Vec<u64>,
    pub(crate) freed_at: Vec<u64>,
    pub(crate) cached_at: Vec<u64>,
    pub(crate) retired: Vec<bool>,
}

impl PageTable {
    /// Pages known.
    pub(crate) fn len(&self) -> usize {
        self.touch.len()
    }

    /// No page known (for the invariant checker and the tests).
    #[cfg(any(test, feature = "invariants"))]
    pub(crate) fn is_empty(&self) -> bool {
        self.touch.is_empty()
    }

    /// Page `p` (a default, unmapped slot past the table).
    pub(crate) fn get(&self, p: u64) -> PageSlot {
        let p = p as usize;
        if p >= self.len() {
            return PageSlot::default();
        }
        PageSlot {
            touch: self.touch[p],
            phys: self.phys[p],
            freed_by: self.freed_by[p],
            freed_at: self.freed_at[p],
            cached_at: self.cached_at[p],
            retired: self.retired[p],
        }
    }

    /// Every page known, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = PageSlot> + '_ {
        (0..self.len() as u64).map(|p| self.get(p))
    }

    /// Know at least `n` pages (the new ones default, unmapped).
    #[cold]
    pub(crate) fn grow_to(&mut self, n: usize) {
        if self.len() >= n {
            return;
        }
        self.touch.resize(n, 0);
        self.phys.resize(n, None);
        self.freed_by.resize(n, 0);
        self.freed_at.resize(n, 0);
        self.cached_at.resize(n, 0);
        self.retired.resize(n, false);
    }

    /// A block leaves page `p` (known): one touch less; with `freed`, those
    /// streams freed it at `tick`. Returns whether the page is now
    /// untouched, and whether it is now cached (then stamped `tick`).
    #[inline]
    pub(crate) fn leave(&mut self, p: usize, freed: Option<u64>, tick: u64) -> (bool, bool) {
        self.touch[p] = self.touch[p].saturating_sub(1);
        if let Some(streams) = freed {
            self.note_freed(p, streams, tick);
        }
        let untouched = self.touch[p] == 0;
        let cached = untouched && self.phys[p].is_some();
        if cached {
            self.cached_at[p] = tick;
        }
        (untouched, cached)
    }

    /// [`PageTable::note_freed`] over the run `pages` (known), at `tick`,
    /// the latest tick so far.
    #[inline]
    pub(crate) fn note_freed_range(&mut self, pages: Range<usize>, streams: u64, tick: u64) {
        debug_assert!(self.freed_at[pages.clone()].iter().all(|&k| k <= tick));
        for (by, at) in self.freed_by[pages.clone()]
            .iter_mut()
            .zip(self.freed_at[pages].iter_mut())
        {
            *by |= streams;
            *at = tick;
        }
    }

    /// Note that the streams `streams` freed a block on page `p` (known)
    /// at `tick`: their work up to then may still use it.
    #[inline]
    pub(crate) fn note_freed(&mut self, p: usize, streams: u64, tick: u64) {
        self.freed_by[p] |= streams;
        self.freed_at[p] = self.freed_at[p].max(tick);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;

    #[test]
    fn a_page_past_the_table_reads_default_and_growing_keeps_what_is_there() {
        let mut t = PageTable::default();
        assert!(t.is_empty());
        assert_eq!(t.get(3), PageSlot::default());
        t.grow_to(2);
        t.touch[1] = 2;
        t.note_freed(1, 0b10, 7);
        t.note_freed(1, 0b01, 5);
        t.grow_to(1);
        assert_eq!(t.len(), 2, "never shrinks");
        t.grow_to(4);
        let s = t.get(1);
        assert_eq!((s.touch, s.freed_by, s.freed_at), (2, 0b11, 7));
        assert_eq!(t.get(3), PageSlot::default());
        assert_eq!(t.iter().count(), 4);
    }
}
