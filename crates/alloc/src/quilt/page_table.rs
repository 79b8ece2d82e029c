//! An arena's page table: for each virtual page, how many blocks touch it,
//! the pool page mapped there, and which streams freed blocks on it since,
//! kept so that what a block does to its pages costs the same whatever
//! their number.
//!
//! A block touches its pages `first ..= last`; only its two end pages can
//! be shared with another block, so the pages between them (its interior)
//! all get the same values when it is placed or freed. The table keeps a
//! value per page where pages differ (one column per field, a structure of
//! arrays: the end pages, short interiors, each page's mapping) and keeps a
//! long interior as one run, in a map of ranges (`rangemap`, over a B-tree):
//!
//! - `inner`: runs of pages each touched by one block alone (an interior of
//!   at least [`RUN_PAGES`] pages), which read a touch count of 1 whatever
//!   their `touch` entry says (0);
//! - `stamps`: runs of pages with one `freed_by`, `freed_at` and
//!   `cached_at` (an interior freed), which read those values from the run
//!   instead of their entries; a page changed alone (an end page, a
//!   mapping) leaves its run first, taking its values with it;
//! - `mapped`: the mapped pages as runs, for counting and listing the
//!   mapped or unmapped pages of a range without a look at each;
//! - `fresh`: the pages mapped and touched by no block since, as runs of
//!   the tick they were mapped at (the pages mapped ahead of an arena's top
//!   that no block has reached, `backing.rs`);
//! - `retired`: the retired pages.
//!
//! So placing or freeing a block costs a few operations on these maps
//! (logarithmic in the runs), not a write per page: a 1 GiB block costs
//! what a 16 MiB one does. What remains per page is what is done per page
//! anyway (mapping and unmapping: a driver call each) and the walks of
//! whole arenas (statistics of a sleeping tag, the invariant checker).
//! [`PageSlot`] is one page read whole.
//!
//! `page_table_reference.rs` keeps the table it replaced (a value per page
//! in every column), as the tests' reference: a property test runs both
//! through random operations and compares every answer.
//!
//! Pure bookkeeping, kept consistent by `arena.rs` (its invariants are
//! stated there).

use std::collections::BTreeSet;
use std::ops::Range;

use quilt_pool::Page;
use rangemap::{RangeMap, RangeSet};

/// Interiors of at least this many pages are kept as runs; shorter ones as
/// a value per page (a fill of a few entries costs less than a run).
pub(crate) const RUN_PAGES: u64 = 8;

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
    /// entry in the reclaim queue is valid while this matches. Read only
    /// while the page is cached (every change into that state sets it).
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

/// What touching a run of pages found ([`PageTable::touch_span`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Touched {
    /// Pages of the run that are not mapped.
    pub(crate) unmapped: u64,
    /// Pages touched for the first time (touched by no block before).
    pub(crate) first: u64,
    /// Of those, the mapped ones (cached until now).
    pub(crate) first_mapped: u64,
}

/// What untouching a run of pages did ([`PageTable::untouch_span`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Untouched {
    /// Pages now touched by no block.
    pub(crate) untouched: u64,
    /// Of those, the mapped ones (cached from now on).
    pub(crate) cached: u64,
}

/// The freed-by values of a run of pages (see [`PageSlot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    freed_by: u64,
    freed_at: u64,
    cached_at: u64,
}

/// The pages of one arena (the pages known so far: past them every page
/// reads as [`PageSlot::default`]). See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct PageTable {
    /// Per page: the blocks touching it, but for the touch of a run of
    /// `inner` (0 there).
    touch: Vec<u32>,
    phys: Vec<Option<Page>>,
    /// Per page, where no run of `stamps` covers it.
    freed_by: Vec<u64>,
    freed_at: Vec<u64>,
    cached_at: Vec<u64>,
    inner: RangeSet<u64>,
    stamps: RangeMap<u64, Stamp>,
    mapped: RangeSet<u64>,
    fresh: RangeMap<u64, u64>,
    /// Pages `fresh` may hold (the union of what it was given since it was
    /// last empty): a touch outside it asks the map nothing.
    fresh_bounds: Range<u64>,
    retired: BTreeSet<u64>,
    /// Scratch: the pieces of a run being stamped, and the `inner` runs
    /// under a run being untouched (kept, so that steady state allocates
    /// nothing).
    pieces: Vec<(Range<u64>, Stamp)>,
    runs: Vec<Range<u64>>,
}

/// `range` clipped to `to` (empty when they do not overlap).
fn clip(range: &Range<u64>, to: &Range<u64>) -> Range<u64> {
    range.start.max(to.start)..range.end.min(to.end).max(range.start.max(to.start))
}

/// The pages `range` as indices.
fn idx(range: &Range<u64>) -> Range<usize> {
    range.start as usize..range.end as usize
}

/// Calls `f` with runs of consecutive pages, given in address order, joined.
struct Runs<F: FnMut(Range<u64>)> {
    open: Option<Range<u64>>,
    f: F,
}

impl<F: FnMut(Range<u64>)> Runs<F> {
    fn new(f: F) -> Self {
        Runs { open: None, f }
    }

    fn add(&mut self, r: Range<u64>) {
        if r.is_empty() {
            return;
        }
        match &mut self.open {
            Some(open) if open.end == r.start => open.end = r.end,
            _ => {
                if let Some(done) = self.open.replace(r) {
                    (self.f)(done);
                }
            }
        }
    }

    fn finish(mut self) {
        if let Some(done) = self.open.take() {
            (self.f)(done);
        }
    }
}

impl PageTable {
    /// Pages known.
    pub(crate) fn len(&self) -> usize {
        self.touch.len()
    }

    /// The runs kept, as (interiors touched, stamps): for the tests.
    #[cfg(test)]
    pub(crate) fn run_counts(&self) -> (usize, usize) {
        (self.inner.len(), self.stamps.len())
    }

    /// No page known (for the invariant checker and the tests).
    #[cfg(any(test, feature = "invariants"))]
    pub(crate) fn is_empty(&self) -> bool {
        self.touch.is_empty()
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
    }

    /// Page `p` (a default, unmapped slot past the table).
    pub(crate) fn get(&self, p: u64) -> PageSlot {
        if p >= self.len() as u64 {
            return PageSlot::default();
        }
        let s = self.stamp(p);
        PageSlot {
            touch: self.touch_of(p),
            phys: self.phys[p as usize],
            freed_by: s.freed_by,
            freed_at: s.freed_at,
            cached_at: s.cached_at,
            retired: self.is_retired(p),
        }
    }

    /// Every page known, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = PageSlot> + '_ {
        (0..self.len() as u64).map(|p| self.get(p))
    }

    /// The blocks touching page `p` (known).
    #[inline]
    pub(crate) fn touch_of(&self, p: u64) -> u32 {
        let run = !self.inner.is_empty() && self.inner.contains(&p);
        self.touch[p as usize] + u32::from(run)
    }

    fn is_retired(&self, p: u64) -> bool {
        !self.retired.is_empty() && self.retired.contains(&p)
    }

    /// The freed-by values of page `p` (known): its run's, or its own.
    fn stamp(&self, p: u64) -> Stamp {
        if !self.stamps.is_empty() {
            if let Some(&s) = self.stamps.get(&p) {
                return s;
            }
        }
        let i = p as usize;
        Stamp {
            freed_by: self.freed_by[i],
            freed_at: self.freed_at[i],
            cached_at: self.cached_at[i],
        }
    }

    /// Take page `p` (known) out of its run of `stamps`, if any, its values
    /// going to its own entries: before a change to that page alone.
    #[inline]
    fn detach(&mut self, p: u64) {
        if self.stamps.is_empty() {
            return;
        }
        if let Some(&s) = self.stamps.get(&p) {
            let i = p as usize;
            self.freed_by[i] = s.freed_by;
            self.freed_at[i] = s.freed_at;
            self.cached_at[i] = s.cached_at;
            self.stamps.remove(p..p + 1);
        }
    }

    /// Mapped pages among `range` (known).
    fn mapped_in(&self, range: &Range<u64>) -> u64 {
        if range.is_empty() {
            return 0;
        }
        self.mapped
            .overlapping(range)
            .map(|r| {
                let c = clip(r, range);
                c.end - c.start
            })
            .sum()
    }

    /// Pages among `first ..= last` that are not mapped (past the table,
    /// every page).
    pub(crate) fn unmapped_count(&self, first: u64, last: u64) -> u64 {
        let known = self.len() as u64;
        let known_part = first.min(known)..(last + 1).min(known);
        let beyond = (last + 1).saturating_sub(first.max(known));
        let n = known_part.end - known_part.start;
        n - self.mapped_in(&known_part) + beyond
    }

    /// Pages `first ..= last` that are not mapped, in order.
    pub(crate) fn unmapped_in(&self, first: u64, last: u64) -> Vec<u64> {
        let known = self.len() as u64;
        let range = first..last + 1;
        let known_part = clip(&range, &(0..known));
        let mut out = Vec::new();
        if !known_part.is_empty() {
            for gap in self.mapped.gaps(&known_part) {
                out.extend(gap);
            }
        }
        out.extend(first.max(known)..last + 1);
        out
    }

    /// The page after the last mapped one (0: none is mapped).
    pub(crate) fn mapped_end(&self) -> u64 {
        self.mapped.last().map_or(0, |r| r.end)
    }

    /// The runs of mapped pages, in order.
    pub(crate) fn mapped_runs(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        self.mapped.iter().cloned()
    }

    /// The retired pages among `first ..= last`, in order.
    pub(crate) fn retired_in(&self, first: u64, last: u64) -> impl Iterator<Item = u64> + '_ {
        self.retired.range(first..=last).copied()
    }

    /// Pages among `first ..= last` mapped at tick `at` and touched by no
    /// block since (nor unmapped): the pages cached at `at`, where no page
    /// became cached at that tick but by being mapped.
    pub(crate) fn fresh_since(&self, first: u64, last: u64, at: u64) -> u64 {
        let range = first..last + 1;
        if self.fresh.is_empty() {
            return 0;
        }
        self.fresh
            .overlapping(&range)
            .filter(|(_, &tick)| tick == at)
            .map(|(r, _)| {
                let c = clip(r, &range);
                c.end - c.start
            })
            .sum()
    }

    /// The pages of `range` touched or unmapped: no longer fresh.
    #[inline]
    fn not_fresh(&mut self, range: Range<u64>) {
        if range.start >= self.fresh_bounds.end || range.end <= self.fresh_bounds.start {
            return;
        }
        self.fresh.remove(range);
        if self.fresh.is_empty() {
            self.fresh_bounds = 0..0;
        }
    }

    /// Call `f(page, freed_by, freed_at)` for each page of `first ..= last`
    /// (known), in order.
    pub(crate) fn for_each_freed(&self, first: u64, last: u64, mut f: impl FnMut(u64, u64, u64)) {
        let range = first..last + 1;
        let mut p = first;
        if !self.stamps.is_empty() {
            for (r, s) in self.stamps.overlapping(&range) {
                let c = clip(r, &range);
                for q in p..c.start {
                    f(q, self.freed_by[q as usize], self.freed_at[q as usize]);
                }
                for q in c.clone() {
                    f(q, s.freed_by, s.freed_at);
                }
                p = c.end;
            }
        }
        for q in p..range.end {
            f(q, self.freed_by[q as usize], self.freed_at[q as usize]);
        }
    }

    /// A block now covers the pages `first ..= last` (known): one touch more
    /// on each. Its interior (the pages between its end pages) is touched by
    /// no other block, so each is a first touch: one run, or a fill where
    /// short. `all_mapped`: every page known is mapped (no page is looked
    /// up).
    pub(crate) fn touch_span(&mut self, first: u64, last: u64, all_mapped: bool) -> Touched {
        let mut t = Touched::default();
        let ends = if last > first { 2 } else { 1 };
        for e in [first, last].into_iter().take(ends) {
            debug_assert!(
                self.inner.is_empty() || !self.inner.contains(&e),
                "an end page of a new block lies inside another block"
            );
            let i = e as usize;
            self.touch[i] += 1;
            let mapped = u64::from(self.phys[i].is_some());
            let first_touch = u64::from(self.touch[i] == 1);
            t.unmapped += 1 - mapped;
            t.first += first_touch;
            t.first_mapped += first_touch & mapped;
        }
        if last > first + 1 {
            let inner = first + 1..last;
            let n = inner.end - inner.start;
            debug_assert!(
                self.touch[idx(&inner)].iter().all(|&t| t == 0)
                    && (self.inner.is_empty() || !self.inner.overlaps(&inner)),
                "a page inside a new block is touched"
            );
            if n >= RUN_PAGES {
                self.inner.insert(inner.clone());
            } else {
                self.touch[idx(&inner)].fill(1);
            }
            let unmapped = if all_mapped {
                0
            } else {
                n - self.mapped_in(&inner)
            };
            t.unmapped += unmapped;
            t.first += n;
            t.first_mapped += n - unmapped;
        }
        self.not_fresh(first..last + 1);
        t
    }

    /// A block over the pages `first ..= last` (known) is gone: one touch
    /// less on each. With `freed`, those streams freed it at `tick` (the
    /// latest tick so far), which the pages remember. Calls `cached` with
    /// the pages that become cached, in address order, a run at a time.
    /// (As in [`PageTable::touch_span`], the pages between the end pages
    /// were touched by the block alone, so each becomes untouched: one run
    /// of values, or a fill where short.)
    pub(crate) fn untouch_span(
        &mut self,
        first: u64,
        last: u64,
        freed: Option<u64>,
        tick: u64,
        all_mapped: bool,
        cached: impl FnMut(Range<u64>),
    ) -> Untouched {
        let inner = if last > first + 1 {
            first + 1..last
        } else {
            first + 1..first + 1
        };
        let n = inner.end - inner.start;
        self.untouch_counts(first, last, &inner);
        // The end pages, perhaps shared with the blocks beside them.
        let (head_untouched, head_cached) = self.leave(first, freed, tick);
        let (tail_untouched, tail_cached) = if last > first {
            self.leave(last, freed, tick)
        } else {
            (false, false)
        };
        // The pages between: the same values on each.
        if n > 0 {
            let stamped = !self.stamps.is_empty() && self.stamps.overlaps(&inner);
            if n >= RUN_PAGES || stamped {
                self.stamp_run(&inner, freed, tick);
            } else {
                if let Some(streams) = freed {
                    for i in idx(&inner) {
                        self.freed_by[i] |= streams;
                        self.freed_at[i] = tick;
                    }
                }
                self.cached_at[idx(&inner)].fill(tick);
            }
        }
        // The pages that became cached, in address order.
        let inner_cached = if all_mapped {
            n
        } else {
            self.mapped_in(&inner)
        };
        let mut runs = Runs::new(cached);
        if head_cached {
            runs.add(first..first + 1);
        }
        if inner_cached == n {
            runs.add(inner.clone());
        } else {
            for r in self.mapped.overlapping(&inner) {
                runs.add(clip(r, &inner));
            }
        }
        if tail_cached {
            runs.add(last..last + 1);
        }
        runs.finish();
        Untouched {
            untouched: u64::from(head_untouched) + n + u64::from(tail_untouched),
            cached: u64::from(head_cached) + inner_cached + u64::from(tail_cached),
        }
    }

    /// The touch counts of [`PageTable::untouch_span`] for the interior
    /// `inner` of `first ..= last`: its pages go to 0 (from their run of
    /// `inner`, or their own entry); an end page under a run (a block
    /// shrunk to within a range touched whole: a growable buffer's) moves
    /// to its own entry, with its touch of 1, for [`PageTable::leave`].
    fn untouch_counts(&mut self, first: u64, last: u64, inner: &Range<u64>) {
        let span = first..last + 1;
        self.runs.clear();
        if !self.inner.is_empty() {
            self.runs.extend(self.inner.overlapping(&span).cloned());
        }
        if !self.runs.is_empty() {
            self.inner.remove(span);
        }
        let mut p = inner.start;
        for r in &self.runs {
            if r.contains(&first) {
                self.touch[first as usize] = 1;
            }
            if r.contains(&last) {
                self.touch[last as usize] = 1;
            }
            let c = clip(r, inner);
            if !c.is_empty() {
                untouch_entries(&mut self.touch, p..c.start);
                p = c.end;
            }
        }
        untouch_entries(&mut self.touch, p..inner.end.max(p));
    }

    /// Stamp the run of pages `range` (known) as freed by `freed` at
    /// `tick` (the latest tick so far) and cached at `tick`: the run of
    /// `stamps` over it, one per distinct `freed_by` (the pages' own
    /// entries, where no run covered them, read once and joined).
    fn stamp_run(&mut self, range: &Range<u64>, freed: Option<u64>, tick: u64) {
        self.pieces.clear();
        let mut p = range.start;
        for (r, &s) in self.stamps.overlapping(range) {
            let c = clip(r, range);
            own_pieces(&self.freed_by, &self.freed_at, p..c.start, &mut self.pieces);
            self.pieces.push((c.clone(), s));
            p = c.end;
        }
        own_pieces(
            &self.freed_by,
            &self.freed_at,
            p..range.end.max(p),
            &mut self.pieces,
        );
        let stamp = |s: Stamp| match freed {
            Some(streams) => Stamp {
                freed_by: s.freed_by | streams,
                freed_at: tick,
                cached_at: tick,
            },
            None => Stamp {
                cached_at: tick,
                ..s
            },
        };
        let one = self.pieces.first().map(|(_, s)| stamp(*s));
        if self.pieces.iter().all(|(_, s)| Some(stamp(*s)) == one) {
            if let Some(s) = one {
                self.stamps.insert(range.clone(), s);
            }
            return;
        }
        let pieces = std::mem::take(&mut self.pieces);
        for (r, s) in &pieces {
            self.stamps.insert(r.clone(), stamp(*s));
        }
        self.pieces = pieces;
    }

    /// A block leaves page `p` (known, its touch in its own entry): one
    /// touch less; with `freed`, those streams freed it at `tick`. Returns
    /// whether the page is now untouched, and whether it is now cached
    /// (then stamped `tick`).
    #[inline]
    fn leave(&mut self, p: u64, freed: Option<u64>, tick: u64) -> (bool, bool) {
        self.detach(p);
        let i = p as usize;
        self.touch[i] = self.touch[i].saturating_sub(1);
        if let Some(streams) = freed {
            self.freed_by[i] |= streams;
            self.freed_at[i] = self.freed_at[i].max(tick);
        }
        let untouched = self.touch[i] == 0;
        let cached = untouched && self.phys[i].is_some();
        if cached {
            self.cached_at[i] = tick;
        }
        (untouched, cached)
    }

    /// Note that the streams `streams` freed a block on page `p` at `tick`:
    /// their work up to then may still use it (nothing past the table).
    pub(crate) fn note_freed(&mut self, p: u64, streams: u64, tick: u64) {
        if p >= self.len() as u64 {
            return;
        }
        self.detach(p);
        let i = p as usize;
        self.freed_by[i] |= streams;
        self.freed_at[i] = self.freed_at[i].max(tick);
    }

    /// Record that `page` is mapped at page `p` (known, unmapped). Returns
    /// true when the page is cached (no block touches it; then fresh).
    pub(crate) fn set_mapped(&mut self, p: u64, page: Page, tick: u64) -> bool {
        self.detach(p);
        let i = p as usize;
        self.phys[i] = Some(page);
        self.mapped.insert(p..p + 1);
        self.freed_by[i] = 0;
        self.freed_at[i] = 0;
        if self.touch_of(p) != 0 {
            return false;
        }
        self.cached_at[i] = tick;
        self.fresh.insert(p..p + 1, tick);
        self.fresh_bounds = if self.fresh_bounds.is_empty() {
            p..p + 1
        } else {
            self.fresh_bounds.start.min(p)..self.fresh_bounds.end.max(p + 1)
        };
        true
    }

    /// Record that page `p` is unmapped; returns the pool page that was
    /// there, and whether no block touches the page.
    pub(crate) fn set_unmapped(&mut self, p: u64) -> Option<(Page, bool)> {
        let page = self.phys.get_mut(p as usize)?.take()?;
        self.detach(p);
        let i = p as usize;
        self.freed_by[i] = 0;
        self.freed_at[i] = 0;
        self.mapped.remove(p..p + 1);
        self.not_fresh(p..p + 1);
        Some((page, self.touch_of(p) == 0))
    }

    /// Retire the cached page `p`: its pool page is handed on (returned)
    /// while its mapping stays. `None` (changing nothing) unless `p` is
    /// cached.
    pub(crate) fn set_retired(&mut self, p: u64) -> Option<Page> {
        if p >= self.len() as u64 || self.touch_of(p) != 0 || self.is_retired(p) {
            return None;
        }
        let page = self.phys[p as usize].take()?;
        self.retired.insert(p);
        self.mapped.remove(p..p + 1);
        self.not_fresh(p..p + 1);
        Some(page)
    }

    /// The retired page `p` was unmapped; false (changing nothing) unless it
    /// was retired.
    pub(crate) fn clear_retired(&mut self, p: u64) -> bool {
        if p >= self.len() as u64 || !self.retired.remove(&p) {
            return false;
        }
        self.detach(p);
        let i = p as usize;
        self.freed_by[i] = 0;
        self.freed_at[i] = 0;
        true
    }
}

/// The entries `range` of `touch` (the interior of a block: each 1) go to 0.
fn untouch_entries(touch: &mut [u32], range: Range<u64>) {
    if range.is_empty() {
        return;
    }
    let entries = &mut touch[idx(&range)];
    debug_assert!(
        entries.iter().all(|&n| n == 1),
        "a page inside a block is shared"
    );
    entries.fill(0);
}

/// The pages `range` by their own entries, as pieces of equal `freed_by`
/// and `freed_at` (their `cached_at` is about to be overwritten), appended
/// to `out`.
fn own_pieces(
    freed_by: &[u64],
    freed_at: &[u64],
    range: Range<u64>,
    out: &mut Vec<(Range<u64>, Stamp)>,
) {
    let mut p = range.start;
    while p < range.end {
        let i = p as usize;
        let (by, at) = (freed_by[i], freed_at[i]);
        let mut q = p + 1;
        while q < range.end && freed_by[q as usize] == by && freed_at[q as usize] == at {
            q += 1;
        }
        out.push((
            p..q,
            Stamp {
                freed_by: by,
                freed_at: at,
                cached_at: 0,
            },
        ));
        p = q;
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
        t.touch_span(1, 1, false);
        t.note_freed(1, 0b10, 7);
        t.note_freed(1, 0b01, 5);
        t.grow_to(1);
        assert_eq!(t.len(), 2, "never shrinks");
        t.grow_to(4);
        let s = t.get(1);
        assert_eq!((s.touch, s.freed_by, s.freed_at), (1, 0b11, 7));
        assert_eq!(t.get(3), PageSlot::default());
        assert_eq!(t.iter().count(), 4);
    }
}
