//! An arena's page table: for each virtual page, how many blocks touch it,
//! the pool page mapped there, and which streams freed blocks on it since,
//! kept so that what a block does to its pages costs the same whatever
//! their number.
//!
//! A block touches its pages `first ..= last`; only its two end pages can
//! be shared with another block, so the pages between them (its interior)
//! all get the same values when it is placed or freed. The table keeps a
//! value per page where pages differ (one column per field, a structure of
//! arrays: end pages, short interiors, each page's mapping) and a long
//! interior as one **run** in a B-tree by first page: every page of a run
//! touched by one block (the block's interior) or by none, with one
//! `freed_by`, `freed_at` and `cached_at` (a stamp), or each page's own
//! entries for those (a run whose pages were never freed alike). A block
//! placed where the last one of its size was finds its interior's run and
//! changes it in place; one placed elsewhere cuts the runs at its edges and
//! changes those inside. A page changed alone (an end page, a hazard noted
//! on it) leaves its run first, taking its values to its own entries. The
//! runs follow the blocks, are changed in place and are never joined on
//! their own, so they live in a `BTreeMap` rather than `rangemap`'s maps
//! (which join neighbours of equal value and change a value only by
//! replacing its range); `rangemap` keeps the sets that do join:
//!
//! - `mapped`: the mapped pages, for counting and listing the mapped or
//!   unmapped pages of a range without a look at each;
//! - `fresh`: the pages mapped and touched by no block since, by the tick
//!   they were mapped at (the pages mapped ahead of an arena's top that no
//!   block has reached, `backing.rs`);
//! - `retired`: the retired pages (a `BTreeSet`).
//!
//! So placing or freeing a block costs a few B-tree operations, logarithmic
//! in the runs, not a write per page: a 1 GiB block costs what a 32 MiB one
//! does. What remains per page is what is done per page anyway (mapping
//! and unmapping: a driver call each; reading values a page at a time once
//! after they were written a page at a time) and the walks over whole
//! arenas (a sleeping tag's, the invariant checker's). [`PageSlot`] is one
//! page read whole.
//!
//! `page_table_reference.rs` keeps the table it replaced (a value per page
//! in every column), as the tests' reference: a property test runs both
//! through random operations and compares every answer.
//!
//! Pure bookkeeping, kept consistent by `arena.rs` (its invariants are
//! stated there).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use quilt_pool::Page;
use rangemap::{RangeMap, RangeSet};

/// Interiors of at least this many pages are kept as runs; shorter ones as
/// a value per page (filling a few entries costs less than a run).
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

/// What touching a span of pages found ([`PageTable::touch_span`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Touched {
    /// Pages of the span that are not mapped.
    pub(crate) unmapped: u64,
    /// Pages touched for the first time (touched by no block before).
    pub(crate) first: u64,
    /// Of those, the mapped ones (cached until now).
    pub(crate) first_mapped: u64,
}

/// What untouching a span of pages did ([`PageTable::untouch_span`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Untouched {
    /// Pages now touched by no block.
    pub(crate) untouched: u64,
    /// Of those, the mapped ones (cached from now on).
    pub(crate) cached: u64,
}

/// The freed-by values of a page (see [`PageSlot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    freed_by: u64,
    freed_at: u64,
    cached_at: u64,
}

impl Stamp {
    /// Freed by `freed` (if any) at `tick`, the latest tick so far, and
    /// cached then.
    fn freed(self, freed: Option<u64>, tick: u64) -> Stamp {
        match freed {
            Some(streams) => Stamp {
                freed_by: self.freed_by | streams,
                freed_at: tick,
                cached_at: tick,
            },
            None => Stamp {
                cached_at: tick,
                ..self
            },
        }
    }
}

/// A run of pages alike, from its key (its first page) to `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    /// The page after the run.
    end: u64,
    /// Every page is touched by one block (whose interior the run is), or
    /// every page by none.
    touched: bool,
    /// Every page's freed-by values; `None`: each page's own entries.
    stamp: Option<Stamp>,
}

/// The pages of one arena (the pages known so far: past them every page
/// reads as [`PageSlot::default`]). See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct PageTable {
    /// Per page: the blocks touching it (0 under a run, which says).
    touch: Vec<u32>,
    phys: Vec<Option<Page>>,
    /// Per page, where no run's stamp covers it.
    freed_by: Vec<u64>,
    freed_at: Vec<u64>,
    cached_at: Vec<u64>,
    /// The runs, by first page (disjoint).
    runs: BTreeMap<u64, Run>,
    mapped: RangeSet<u64>,
    fresh: RangeMap<u64, u64>,
    /// Pages `fresh` may hold (the union of what it was given since it was
    /// last empty): a touch outside it asks the map nothing.
    fresh_bounds: Range<u64>,
    retired: BTreeSet<u64>,
    /// Scratch (kept, so that steady state allocates nothing): the runs
    /// over a span, and the pieces of a run being stamped.
    found: Vec<(u64, Run)>,
    pieces: Vec<(Range<u64>, Stamp)>,
}

/// `range` clipped to `to` (empty when they do not overlap).
fn clip(range: &Range<u64>, to: &Range<u64>) -> Range<u64> {
    let start = range.start.max(to.start);
    start..range.end.min(to.end).max(start)
}

/// The pages `range` as indices.
fn idx(range: &Range<u64>) -> Range<usize> {
    range.start as usize..range.end as usize
}

/// Calls `f` with runs of consecutive pages, given in address order, joined.
struct Joined<F: FnMut(Range<u64>)> {
    open: Option<Range<u64>>,
    f: F,
}

impl<F: FnMut(Range<u64>)> Joined<F> {
    fn new(f: F) -> Self {
        Joined { open: None, f }
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

    /// No page known (for the invariant checker and the tests).
    #[cfg(any(test, feature = "invariants"))]
    pub(crate) fn is_empty(&self) -> bool {
        self.touch.is_empty()
    }

    /// The runs kept: for the tests.
    #[cfg(test)]
    pub(crate) fn run_count(&self) -> usize {
        self.runs.len()
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
        let run = self.run_at(p).map(|(_, r)| r);
        let i = p as usize;
        let s = run.and_then(|r| r.stamp).unwrap_or(Stamp {
            freed_by: self.freed_by[i],
            freed_at: self.freed_at[i],
            cached_at: self.cached_at[i],
        });
        PageSlot {
            touch: self.touch[i] + u32::from(run.is_some_and(|r| r.touched)),
            phys: self.phys[i],
            freed_by: s.freed_by,
            freed_at: s.freed_at,
            cached_at: s.cached_at,
            retired: !self.retired.is_empty() && self.retired.contains(&p),
        }
    }

    /// Every page known, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = PageSlot> + '_ {
        (0..self.len() as u64).map(|p| self.get(p))
    }

    /// The blocks touching page `p` (known).
    #[inline]
    pub(crate) fn touch_of(&self, p: u64) -> u32 {
        let run = self.run_at(p).is_some_and(|(_, r)| r.touched);
        self.touch[p as usize] + u32::from(run)
    }

    /// The run holding page `p`, with its first page.
    #[inline]
    fn run_at(&self, p: u64) -> Option<(u64, Run)> {
        if self.runs.is_empty() {
            return None;
        }
        self.runs
            .range(..=p)
            .next_back()
            .filter(|(_, r)| r.end > p)
            .map(|(&s, &r)| (s, r))
    }

    /// The runs overlapping `first ..= last`, in address order, into
    /// `self.found`.
    fn find_runs(&mut self, first: u64, last: u64) {
        self.found.clear();
        if self.runs.is_empty() {
            return;
        }
        for (&s, &r) in self.runs.range(..=last).rev() {
            if r.end <= first {
                break;
            }
            self.found.push((s, r));
        }
        self.found.reverse();
    }

    /// No run holds both page `x - 1` and page `x` (one that does is cut
    /// in two there).
    fn cut_at(&mut self, x: u64) {
        if let Some((s, r)) = self.run_at(x) {
            if s < x {
                if let Some(head) = self.runs.get_mut(&s) {
                    head.end = x;
                }
                self.runs.insert(x, r);
            }
        }
    }

    /// The values of page `p` of run `r` to its own entries.
    fn take_out(&mut self, p: u64, r: Run) {
        let i = p as usize;
        self.touch[i] = u32::from(r.touched);
        if let Some(s) = r.stamp {
            self.freed_by[i] = s.freed_by;
            self.freed_at[i] = s.freed_at;
            self.cached_at[i] = s.cached_at;
        }
    }

    /// Page `p` (known) out of its run, if any, its values to its own
    /// entries: before a change to that page alone.
    #[inline]
    fn detach(&mut self, p: u64) {
        let Some((s, r)) = self.run_at(p) else {
            return;
        };
        self.take_out(p, r);
        if s < p {
            if let Some(head) = self.runs.get_mut(&s) {
                head.end = p;
            }
        } else {
            self.runs.remove(&s);
        }
        if p + 1 < r.end {
            self.runs.insert(p + 1, r);
        }
    }

    /// Page `p` (known) with its freed-by values in its own entries (out of
    /// a run with a stamp; a run without keeps it).
    fn own_stamp(&mut self, p: u64) {
        if self.run_at(p).is_some_and(|(_, r)| r.stamp.is_some()) {
            self.detach(p);
        }
    }

    /// Every page of `range` (known, short) out of the runs.
    fn detach_range(&mut self, range: &Range<u64>) {
        if range.is_empty() || self.runs.is_empty() {
            return;
        }
        self.cut_at(range.start);
        self.cut_at(range.end);
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(self.runs.range(range.clone()).map(|(&s, &r)| (s, r)));
        for &(s, r) in &found {
            for p in s..r.end {
                self.take_out(p, r);
            }
            self.runs.remove(&s);
        }
        self.found = found;
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
        if self.fresh.is_empty() {
            return 0;
        }
        let range = first..last + 1;
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
        let own = |q: u64| (self.freed_by[q as usize], self.freed_at[q as usize]);
        let mut p = first;
        let runs = self
            .runs
            .range(..range.end)
            .rev()
            .take_while(|(_, r)| r.end > first)
            .collect::<Vec<_>>();
        for (&s, r) in runs.into_iter().rev() {
            let c = clip(&(s..r.end), &range);
            for q in p..c.start {
                let (by, at) = own(q);
                f(q, by, at);
            }
            for q in c.clone() {
                let (by, at) = r.stamp.map_or_else(|| own(q), |s| (s.freed_by, s.freed_at));
                f(q, by, at);
            }
            p = c.end;
        }
        for q in p..range.end {
            let (by, at) = own(q);
            f(q, by, at);
        }
    }

    /// A block now covers the pages `first ..= last` (known): one touch more
    /// on each. Its interior (the pages between its end pages) is touched by
    /// no other block, so each is a first touch: its run's, or a fill where
    /// short. `all_mapped`: every page known is mapped (no page is looked
    /// up).
    pub(crate) fn touch_span(&mut self, first: u64, last: u64, all_mapped: bool) -> Touched {
        let inner = interior(first, last);
        let n = inner.end - inner.start;
        self.find_runs(first, last);
        let by_run = n >= RUN_PAGES;
        match self.found[..] {
            [] if by_run => {
                self.runs.insert(
                    inner.start,
                    Run {
                        end: inner.end,
                        touched: true,
                        stamp: None,
                    },
                );
            }
            [] => {}
            // Where the last block of its size was: its interior's run.
            [(s, r)] if by_run && s == inner.start && r.end == inner.end && !r.touched => {
                if let Some(run) = self.runs.get_mut(&s) {
                    run.touched = true;
                }
            }
            _ => {
                self.detach(first);
                self.detach(last);
                if by_run {
                    self.touch_runs(&inner);
                } else {
                    self.detach_range(&inner);
                }
            }
        }
        let mut t = Touched::default();
        let ends = if last > first { 2 } else { 1 };
        for e in [first, last].into_iter().take(ends) {
            let i = e as usize;
            self.touch[i] += 1;
            let mapped = u64::from(self.phys[i].is_some());
            let first_touch = u64::from(self.touch[i] == 1);
            t.unmapped += 1 - mapped;
            t.first += first_touch;
            t.first_mapped += first_touch & mapped;
        }
        if n > 0 {
            if !by_run {
                debug_assert!(
                    self.touch[idx(&inner)].iter().all(|&t| t == 0),
                    "a page inside a new block is touched"
                );
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

    /// The interior `inner` of a new block (untouched) touched by runs: the
    /// runs within it cut at its edges and touched, the pages between them
    /// (their own entries) a run of their own each.
    fn touch_runs(&mut self, inner: &Range<u64>) {
        self.cut_at(inner.start);
        self.cut_at(inner.end);
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(self.runs.range(inner.clone()).map(|(&s, &r)| (s, r)));
        let mut p = inner.start;
        let gap = |end| Run {
            end,
            touched: true,
            stamp: None,
        };
        for &(s, r) in &found {
            debug_assert!(!r.touched, "a page inside a new block is touched");
            if p < s {
                self.runs.insert(p, gap(s));
            }
            if let Some(run) = self.runs.get_mut(&s) {
                run.touched = true;
            }
            p = r.end;
        }
        if p < inner.end {
            self.runs.insert(p, gap(inner.end));
        }
        self.found = found;
    }

    /// A block over the pages `first ..= last` (known) is gone: one touch
    /// less on each. With `freed`, those streams freed it at `tick` (the
    /// latest tick so far), which the pages remember. Calls `cached` with
    /// the pages that become cached, in address order, a run at a time.
    /// (As in [`PageTable::touch_span`], the pages between the end pages
    /// were touched by the block alone, so each becomes untouched: its run
    /// changed in place, or a fill where short.)
    pub(crate) fn untouch_span(
        &mut self,
        first: u64,
        last: u64,
        freed: Option<u64>,
        tick: u64,
        all_mapped: bool,
        cached: impl FnMut(Range<u64>),
    ) -> Untouched {
        let inner = interior(first, last);
        let n = inner.end - inner.start;
        self.find_runs(first, last);
        match self.found[..] {
            [] => self.untouch_own(&inner, freed, tick),
            // A block's interior: its run, changed in place.
            [(
                s,
                Run {
                    end,
                    touched: true,
                    stamp: Some(stamp),
                },
            )] if s == inner.start && end == inner.end => {
                if let Some(run) = self.runs.get_mut(&s) {
                    run.touched = false;
                    run.stamp = Some(stamp.freed(freed, tick));
                }
            }
            _ => {
                self.detach(first);
                self.detach(last);
                self.untouch_runs(&inner, freed, tick);
            }
        }
        // The end pages, perhaps shared with the blocks beside them.
        let (head_untouched, head_cached) = self.leave(first, freed, tick);
        let (tail_untouched, tail_cached) = if last > first {
            self.leave(last, freed, tick)
        } else {
            (false, false)
        };
        // The pages that became cached, in address order.
        let inner_cached = if all_mapped {
            n
        } else {
            self.mapped_in(&inner)
        };
        let mut joined = Joined::new(cached);
        if head_cached {
            joined.add(first..first + 1);
        }
        if inner_cached == n {
            joined.add(inner.clone());
        } else {
            for r in self.mapped.overlapping(&inner) {
                joined.add(clip(r, &inner));
            }
        }
        if tail_cached {
            joined.add(last..last + 1);
        }
        joined.finish();
        Untouched {
            untouched: u64::from(head_untouched) + n + u64::from(tail_untouched),
            cached: u64::from(head_cached) + inner_cached + u64::from(tail_cached),
        }
    }

    /// The pages `range` (known, under no run, each touched once) become
    /// untouched, freed by `freed` at `tick`: their own entries.
    fn untouch_own(&mut self, range: &Range<u64>, freed: Option<u64>, tick: u64) {
        if range.is_empty() {
            return;
        }
        let entries = &mut self.touch[idx(range)];
        debug_assert!(
            entries.iter().all(|&n| n == 1),
            "a page inside a block is shared"
        );
        entries.fill(0);
        if let Some(streams) = freed {
            for i in idx(range) {
                self.freed_by[i] |= streams;
                self.freed_at[i] = tick;
            }
        }
        self.cached_at[idx(range)].fill(tick);
    }

    /// The interior `inner` of a block gone, as [`PageTable::untouch_own`],
    /// where runs lie: each run within it (cut at its edges) untouched and
    /// stamped in place (a run without a stamp by its pages' own entries, a
    /// run per distinct `freed_by` and `freed_at`), the pages between the
    /// runs by their own entries; then runs alike side by side joined.
    fn untouch_runs(&mut self, inner: &Range<u64>, freed: Option<u64>, tick: u64) {
        if inner.is_empty() {
            return;
        }
        self.cut_at(inner.start);
        self.cut_at(inner.end);
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(self.runs.range(inner.clone()).map(|(&s, &r)| (s, r)));
        let mut p = inner.start;
        for &(s, r) in &found {
            debug_assert!(r.touched, "a page inside a block is untouched");
            self.untouch_own(&(p..s), freed, tick);
            match r.stamp {
                Some(stamp) => {
                    if let Some(run) = self.runs.get_mut(&s) {
                        run.touched = false;
                        run.stamp = Some(stamp.freed(freed, tick));
                    }
                }
                None => {
                    self.pieces.clear();
                    own_pieces(&self.freed_by, &self.freed_at, s..r.end, &mut self.pieces);
                    for &(ref piece, stamp) in &self.pieces {
                        self.runs.insert(
                            piece.start,
                            Run {
                                end: piece.end,
                                touched: false,
                                stamp: Some(stamp.freed(freed, tick)),
                            },
                        );
                    }
                }
            }
            p = r.end;
        }
        self.untouch_own(&(p..inner.end.max(p)), freed, tick);
        self.found = found;
        self.join_runs(inner);
    }

    /// Runs alike side by side over `range` (and at its edges) joined.
    fn join_runs(&mut self, range: &Range<u64>) {
        let from = self
            .run_at(range.start.saturating_sub(1))
            .map_or(range.start, |(s, _)| s);
        let mut found = std::mem::take(&mut self.found);
        found.clear();
        found.extend(self.runs.range(from..=range.end).map(|(&s, &r)| (s, r)));
        let mut open: Option<(u64, Run)> = None;
        for &(s, r) in &found {
            match open {
                Some((os, o)) if o.end == s && o.touched == r.touched && o.stamp == r.stamp => {
                    self.runs.remove(&s);
                    if let Some(run) = self.runs.get_mut(&os) {
                        run.end = r.end;
                    }
                    open = Some((os, Run { end: r.end, ..o }));
                }
                _ => open = Some((s, r)),
            }
        }
        self.found = found;
    }

    /// A block leaves page `p` (known, under no run): one touch less; with
    /// `freed`, those streams freed it at `tick`. Returns whether the page
    /// is now untouched, and whether it is now cached (then stamped
    /// `tick`).
    #[inline]
    fn leave(&mut self, p: u64, freed: Option<u64>, tick: u64) -> (bool, bool) {
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
        self.own_stamp(p);
        let i = p as usize;
        self.freed_by[i] |= streams;
        self.freed_at[i] = self.freed_at[i].max(tick);
    }

    /// Record that `page` is mapped at page `p` (known, unmapped). Returns
    /// true when the page is cached (no block touches it; then fresh).
    pub(crate) fn set_mapped(&mut self, p: u64, page: Page, tick: u64) -> bool {
        self.own_stamp(p);
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
        self.own_stamp(p);
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
        if p >= self.len() as u64 || self.touch_of(p) != 0 || self.retired.contains(&p) {
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
        self.own_stamp(p);
        let i = p as usize;
        self.freed_by[i] = 0;
        self.freed_at[i] = 0;
        true
    }
}

/// The pages strictly between `first` and `last` (empty unless two apart).
fn interior(first: u64, last: u64) -> Range<u64> {
    if last > first + 1 {
        first + 1..last
    } else {
        first + 1..first + 1
    }
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
