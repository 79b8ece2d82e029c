//! The tests' reference for `page_table.rs`: the page table it replaced, a
//! value per page in every column (what a block does to its pages is a
//! write on each), with the same operations. A property test runs both
//! through random sequences of what the allocator does to pages (blocks
//! placed and freed, growable extents grown and shrunk, pages mapped ahead,
//! unmapped, retired, cleared, noted) and compares every answer and every
//! page after each operation, and the counts the arena keeps from the
//! answers against the pages.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::ops::Range;

use quilt_pool::Page;

use super::page_table::{PageSlot, Touched, Untouched};

/// The old page table: one column per [`PageSlot`] field.
#[derive(Debug, Default)]
pub(crate) struct ReferenceTable {
    touch: Vec<u32>,
    phys: Vec<Option<Page>>,
    freed_by: Vec<u64>,
    freed_at: Vec<u64>,
    cached_at: Vec<u64>,
    retired: Vec<bool>,
}

impl ReferenceTable {
    pub(crate) fn len(&self) -> usize {
        self.touch.len()
    }

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

    /// `Arena::touch` as it was, over pages.
    pub(crate) fn touch_span(&mut self, first: u64, last: u64, all_mapped: bool) -> Touched {
        let (f, l) = (first as usize, last as usize);
        let touch = &mut self.touch[f..=l];
        let phys = &self.phys[f..=l];
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
            assert!(touch[inner.clone()].iter().all(|&t| t == 0));
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
        Touched {
            unmapped,
            first: fresh,
            first_mapped: fresh_mapped,
        }
    }

    fn leave(&mut self, p: usize, freed: Option<u64>, tick: u64) -> (bool, bool) {
        self.touch[p] = self.touch[p].saturating_sub(1);
        if let Some(streams) = freed {
            self.note_freed(p as u64, streams, tick);
        }
        let untouched = self.touch[p] == 0;
        let cached = untouched && self.phys[p].is_some();
        if cached {
            self.cached_at[p] = tick;
        }
        (untouched, cached)
    }

    /// `Arena::untouch` as it was, over pages (`cached` called a page at a
    /// time where not every page is mapped).
    pub(crate) fn untouch_span(
        &mut self,
        first: u64,
        last: u64,
        freed: Option<u64>,
        tick: u64,
        all_mapped: bool,
        mut cached: impl FnMut(Range<u64>),
    ) -> Untouched {
        let (f, l) = (first as usize, last as usize);
        let (head_untouched, head_cached) = self.leave(f, freed, tick);
        let (tail_untouched, tail_cached) = if l > f {
            self.leave(l, freed, tick)
        } else {
            (false, false)
        };
        let (mut inner_untouched, mut inner_cached) = (0, 0);
        if l > f + 1 {
            let inner = f + 1..l;
            assert!(self.touch[inner.clone()].iter().all(|&n| n == 1));
            inner_untouched = inner.len() as u64;
            self.touch[inner.clone()].fill(0);
            if let Some(streams) = freed {
                for p in inner.clone() {
                    self.freed_by[p] |= streams;
                    self.freed_at[p] = tick;
                }
            }
            if all_mapped {
                self.cached_at[inner].fill(tick);
                inner_cached = inner_untouched;
            } else {
                for p in inner {
                    if self.phys[p].is_some() {
                        self.cached_at[p] = tick;
                        inner_cached += 1;
                    }
                }
            }
        }
        if head_cached {
            cached(first..first + 1);
        }
        if inner_cached == inner_untouched {
            if inner_cached > 0 {
                cached(first + 1..last);
            }
        } else {
            for p in first + 1..last {
                if self.phys[p as usize].is_some() {
                    cached(p..p + 1);
                }
            }
        }
        if tail_cached {
            cached(last..last + 1);
        }
        Untouched {
            untouched: u64::from(head_untouched) + inner_untouched + u64::from(tail_untouched),
            cached: u64::from(head_cached) + inner_cached + u64::from(tail_cached),
        }
    }

    pub(crate) fn note_freed(&mut self, p: u64, streams: u64, tick: u64) {
        let p = p as usize;
        if p < self.len() {
            self.freed_by[p] |= streams;
            self.freed_at[p] = self.freed_at[p].max(tick);
        }
    }

    pub(crate) fn set_mapped(&mut self, p: u64, page: Page, tick: u64) -> bool {
        let p = p as usize;
        self.phys[p] = Some(page);
        self.freed_by[p] = 0;
        self.freed_at[p] = 0;
        if self.touch[p] == 0 {
            self.cached_at[p] = tick;
            true
        } else {
            false
        }
    }

    pub(crate) fn set_unmapped(&mut self, p: u64) -> Option<(Page, bool)> {
        let p = p as usize;
        let page = self.phys.get_mut(p)?.take()?;
        self.freed_by[p] = 0;
        self.freed_at[p] = 0;
        Some((page, self.touch[p] == 0))
    }

    pub(crate) fn set_retired(&mut self, p: u64) -> Option<Page> {
        let p = p as usize;
        if p >= self.len() || self.touch[p] != 0 || self.retired[p] {
            return None;
        }
        let page = self.phys[p].take()?;
        self.retired[p] = true;
        Some(page)
    }

    pub(crate) fn clear_retired(&mut self, p: u64) -> bool {
        let p = p as usize;
        if p < self.len() && self.retired[p] {
            self.retired[p] = false;
            self.freed_by[p] = 0;
            self.freed_at[p] = 0;
            true
        } else {
            false
        }
    }

    /// `Arena::unmapped_pages` as it was, less its shortcut.
    pub(crate) fn unmapped_count(&self, first: u64, last: u64) -> u64 {
        (first..=last)
            .filter(|&p| self.get(p).phys.is_none())
            .count() as u64
    }

    pub(crate) fn unmapped_in(&self, first: u64, last: u64) -> Vec<u64> {
        (first..=last)
            .filter(|&p| self.get(p).phys.is_none())
            .collect()
    }

    pub(crate) fn mapped_end(&self) -> u64 {
        self.phys
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |p| p as u64 + 1)
    }

    pub(crate) fn retired_in(&self, first: u64, last: u64) -> Vec<u64> {
        (first..=last).filter(|&p| self.get(p).retired).collect()
    }

    /// `MappedAhead::count_in` as it was: the pages cached at `at`, which
    /// are the pages mapped ahead then and reached by no block since (no
    /// page becomes cached otherwise at the tick pages are mapped ahead).
    pub(crate) fn fresh_since(&self, first: u64, last: u64, at: u64) -> u64 {
        (first..=last)
            .map(|p| self.get(p))
            .filter(|s| s.phys.is_some() && s.touch == 0 && s.cached_at == at)
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quilt::page_table::PageTable;
    use proptest::prelude::*;
    use quilt_pool::PageId;
    use quilt_vmm::PhysHandle;

    /// Bytes per page in the model: blocks are placed at byte granularity,
    /// so that neighbours share end pages.
    const PAGE: u64 = 4;
    /// Pages of the arena's ordinary blocks (a growable extent lies past).
    const BLOCK_PAGES: u64 = 48;
    /// Where the growable extent starts, and its most pages.
    const GROW_FROM: u64 = 50;
    const GROW_MAX: u64 = 30;

    /// The two tables, the model around them, and the counts an arena
    /// keeps from their answers.
    #[derive(Default)]
    struct Both {
        new: PageTable,
        old: ReferenceTable,
        /// Live blocks, as byte ranges.
        blocks: Vec<Range<u64>>,
        /// The growable extent's pages (from `GROW_FROM`).
        grown: u64,
        tick: u64,
        /// The ticks pages were mapped ahead at (no page was untouched then).
        ahead_ticks: Vec<u64>,
        next_page: u32,
        touched: u64,
        cached: u64,
        mapped: u64,
        retired: u64,
    }

    impl Both {
        fn page(&mut self) -> Page {
            self.next_page += 1;
            Page {
                id: PageId(self.next_page),
                handle: PhysHandle(u64::from(self.next_page)),
            }
        }

        fn ensure(&mut self, last: u64) {
            self.new.grow_to(last as usize + 1);
            self.old.grow_to(last as usize + 1);
        }

        fn all_mapped(&self) -> bool {
            self.mapped == self.new.len() as u64
        }

        fn touch(&mut self, first: u64, last: u64) {
            self.ensure(last);
            let all = self.all_mapped();
            let (a, b) = (
                self.new.touch_span(first, last, all),
                self.old.touch_span(first, last, all),
            );
            assert_eq!(a, b, "touch {first}..={last}");
            self.touched += a.first;
            self.cached -= a.first_mapped;
            // Back the pages, as an allocation does: retired ones cleared
            // first.
            let need = self.new.unmapped_in(first, last);
            assert_eq!(need, self.old.unmapped_in(first, last));
            assert_eq!(need.len() as u64, a.unmapped);
            for p in need {
                self.clear_retired(p);
                self.map(p);
            }
        }

        fn untouch(&mut self, first: u64, last: u64, freed: Option<u64>) {
            self.tick += 1;
            let all = self.all_mapped();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let a = self
                .new
                .untouch_span(first, last, freed, self.tick, all, |r| got.extend(r));
            let b = self
                .old
                .untouch_span(first, last, freed, self.tick, all, |r| want.extend(r));
            assert_eq!(a, b, "untouch {first}..={last}");
            assert_eq!(got, want, "pages cached by untouch {first}..={last}");
            self.touched -= a.untouched;
            self.cached += a.cached;
        }

        fn map(&mut self, p: u64) {
            self.ensure(p);
            let pg = self.page();
            let a = self.new.set_mapped(p, pg, self.tick);
            assert_eq!(a, self.old.set_mapped(p, pg, self.tick), "map {p}");
            self.mapped += 1;
            self.cached += u64::from(a);
        }

        fn unmap(&mut self, p: u64) {
            let a = self.new.set_unmapped(p);
            assert_eq!(a, self.old.set_unmapped(p), "unmap {p}");
            if let Some((_, untouched)) = a {
                self.mapped -= 1;
                self.cached -= u64::from(untouched);
            }
        }

        fn retire(&mut self, p: u64) {
            let a = self.new.set_retired(p);
            assert_eq!(a, self.old.set_retired(p), "retire {p}");
            if a.is_some() {
                self.mapped -= 1;
                self.cached -= 1;
                self.retired += 1;
            }
        }

        fn clear_retired(&mut self, p: u64) {
            let a = self.new.clear_retired(p);
            assert_eq!(a, self.old.clear_retired(p), "clear {p}");
            self.retired -= u64::from(a);
        }

        /// Every page and every question, both tables alike; the counts
        /// kept from the answers match the pages.
        fn check(&self) {
            let n = self.new.len();
            assert_eq!(n, self.old.len());
            let (mut touched, mut cached, mut mapped, mut retired) = (0, 0, 0, 0);
            for p in 0..n as u64 + 2 {
                let (a, b) = (self.new.get(p), self.old.get(p));
                // `cached_at` is read only while the page is cached.
                let cmp = |s: PageSlot| PageSlot {
                    cached_at: if s.is_cached() { s.cached_at } else { 0 },
                    ..s
                };
                assert_eq!(cmp(a), cmp(b), "page {p}");
                touched += u64::from(b.touch > 0);
                cached += u64::from(b.is_cached());
                mapped += u64::from(b.phys.is_some());
                retired += u64::from(b.retired);
                if (p as usize) < n {
                    assert_eq!(self.new.touch_of(p), b.touch);
                }
            }
            assert_eq!(
                (touched, cached, mapped, retired),
                (self.touched, self.cached, self.mapped, self.retired)
            );
            assert_eq!(self.new.mapped_end(), self.old.mapped_end());
            let runs: Vec<u64> = self.new.mapped_runs().flatten().collect();
            let want: Vec<u64> = (0..n as u64)
                .filter(|&p| self.old.get(p).phys.is_some())
                .collect();
            assert_eq!(runs, want);
            // Every range of a few pages, and the whole table.
            let end = n as u64 + 2;
            let mut ranges: Vec<(u64, u64)> = (0..end)
                .flat_map(|f| {
                    [
                        (f, f),
                        (f, (f + 3).min(end - 1)),
                        (f, (f + 11).min(end - 1)),
                    ]
                })
                .collect();
            ranges.push((0, end - 1));
            for (f, l) in ranges {
                assert_eq!(self.new.unmapped_count(f, l), self.old.unmapped_count(f, l));
                assert_eq!(self.new.unmapped_in(f, l), self.old.unmapped_in(f, l));
                let got: Vec<u64> = self.new.retired_in(f, l).collect();
                assert_eq!(got, self.old.retired_in(f, l));
                for &at in self.ahead_ticks.iter().rev().take(2) {
                    assert_eq!(
                        self.new.fresh_since(f, l, at),
                        self.old.fresh_since(f, l, at),
                        "fresh {f}..={l} at {at}"
                    );
                }
                if l < n as u64 {
                    let mut got = Vec::new();
                    self.new
                        .for_each_freed(f, l, |p, by, at| got.push((p, by, at)));
                    let want: Vec<_> = (f..=l)
                        .map(|p| (p, self.old.get(p).freed_by, self.old.get(p).freed_at))
                        .collect();
                    assert_eq!(got, want);
                }
            }
        }
    }

    /// The free byte ranges below the growable extent's pages.
    fn free_ranges(blocks: &[Range<u64>]) -> Vec<Range<u64>> {
        let mut sorted: Vec<Range<u64>> = blocks.to_vec();
        sorted.sort_by_key(|r| r.start);
        let mut out = Vec::new();
        let mut at = 0;
        for b in sorted {
            if b.start > at {
                out.push(at..b.start);
            }
            at = b.end;
        }
        if at < BLOCK_PAGES * PAGE {
            out.push(at..BLOCK_PAGES * PAGE);
        }
        out
    }

    fn span(r: &Range<u64>) -> (u64, u64) {
        (r.start / PAGE, (r.end - 1) / PAGE)
    }

    /// One operation, from three random numbers.
    fn step(s: &mut Both, (op, x, y): (u8, u64, u64)) {
        match op {
            // Place a block in a free range (short or long).
            0..=3 => {
                let free = free_ranges(&s.blocks);
                if free.is_empty() {
                    return;
                }
                let g = &free[(x as usize) % free.len()];
                let room = g.end - g.start;
                let len = 1 + y % room.min(if op == 3 { 200 } else { 24 });
                let start = g.start + (x / 7) % (room - len + 1);
                let b = start..start + len;
                let (f, l) = span(&b);
                s.touch(f, l);
                s.blocks.push(b);
            }
            // Free a block, as freed by some streams or taken back.
            4..=6 => {
                if s.blocks.is_empty() {
                    return;
                }
                let b = s.blocks.swap_remove((x as usize) % s.blocks.len());
                let (f, l) = span(&b);
                let freed = (op != 6).then_some(1 + y % 7);
                s.untouch(f, l, freed);
            }
            // Grow or shrink the growable extent (whole pages).
            7 => {
                let to = x % (GROW_MAX + 1);
                if to > s.grown {
                    s.touch(GROW_FROM + s.grown, GROW_FROM + to - 1);
                } else if to < s.grown {
                    s.untouch(GROW_FROM + to, GROW_FROM + s.grown - 1, Some(1 << (y % 3)));
                }
                s.grown = to;
            }
            // Map pages ahead: a run of untouched unmapped pages.
            8 => {
                s.tick += 1;
                s.ahead_ticks.push(s.tick);
                let first = x % (GROW_FROM + GROW_MAX);
                for p in first..first + 1 + y % 12 {
                    let slot = s.new.get(p);
                    if slot.phys.is_none() && !slot.retired && slot.touch == 0 {
                        s.map(p);
                    }
                }
            }
            // Unmap or retire cached pages, clear a retired one.
            9 => {
                let p = x % (s.new.len() as u64 + 1);
                if s.new.get(p).is_cached() {
                    if y % 2 == 0 {
                        s.unmap(p);
                    } else {
                        s.retire(p);
                    }
                }
            }
            10 => s.clear_retired(x % (s.new.len() as u64 + 1)),
            // A pool page's hazard noted on a page.
            _ => {
                s.tick += 1;
                let p = x % (s.new.len() as u64 + 1);
                let k = s.tick.saturating_sub(y % 3);
                s.new.note_freed(p, 1 << (y % 5), k);
                s.old.note_freed(p, 1 << (y % 5), k);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Through any sequence of what the allocator does to pages, the
        /// table of runs answers exactly as the table of a value per page.
        #[test]
        fn answers_as_the_table_of_a_value_per_page(
            ops in proptest::collection::vec((0u8..12, 0u64..10_000, 0u64..10_000), 1..150)
        ) {
            let mut s = Both::default();
            for o in ops {
                step(&mut s, o);
                s.check();
            }
        }
    }

    #[test]
    fn a_long_interior_is_one_run_and_costs_no_write_per_page() {
        let mut s = Both::default();
        // A block of 40 pages, mapped, freed by stream bit 2, then a
        // block inside it and one over its end.
        s.touch(2, 41);
        s.check();
        assert_eq!(s.new.run_counts(), (1, 0), "the interior is one run");
        s.untouch(2, 41, Some(2));
        s.check();
        assert_eq!(s.new.run_counts(), (0, 1), "freed as one run of stamps");
        s.touch(10, 12);
        s.touch(40, 45);
        s.check();
        s.untouch(10, 12, Some(1));
        s.untouch(40, 45, Some(4));
        s.check();
    }
}
