//! One virtual arena: a reserved address range of one stream and one size class,
//! carved into blocks at 512-byte granularity, with the page table behind it.
//!
//! Pure bookkeeping: no driver call is made here.
//!
//! Offsets are relative to the arena's base. The arena keeps:
//! - `occupied`: blocks that hold their range (live, or freed but waiting on
//!   other streams' events), start -> end, never overlapping;
//! - `gaps`: the maximal free ranges between them (the exact complement of
//!   `occupied` inside the arena, coalesced), indexed by start and by
//!   (length, start) for best fit;
//! - `touch[p]`: how many occupied blocks overlap virtual page `p`;
//! - `mappings`: the driver mappings, start page -> [`Mapping`] (one `cuMemMap`
//!   each: a run of neighbouring pages of one pool chunk), never overlapping.
//!
//! Invariants: every page with `touch > 0` lies inside a mapping (a block's pages
//! are always backed); a mapping's `untouched` equals the number of its pages
//! with `touch == 0` (its cached pages); `cached_pages` is their sum and
//! `touched_pages` the number of pages with `touch > 0`.

use std::collections::{BTreeMap, BTreeSet};

use quilt_pool::PageRun;

/// One driver mapping inside an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    /// Number of pages mapped.
    pub(crate) pages: u64,
    /// The pool pages behind it (`run.pages == pages`).
    pub(crate) run: PageRun,
    /// Pages of this mapping that no occupied block touches (cached pages).
    pub(crate) untouched: u64,
    /// Tick of the last change of `untouched` (the reclaim order's age).
    pub(crate) tick: u64,
    /// The key under which this mapping is listed in the reclaim order now.
    pub(crate) listed: Option<(u8, u64)>,
}

impl Mapping {
    /// The key of this mapping in the reclaim order, if it has cached pages:
    /// fully cached mappings first (class 0, one unmap frees them), then partly
    /// cached ones (class 1, need an unmap and a remap of their used pages); the
    /// oldest first within a class.
    pub(crate) fn reclaim_class(&self) -> Option<u8> {
        if self.untouched == 0 {
            None
        } else if self.untouched == self.pages {
            Some(0)
        } else {
            Some(1)
        }
    }
}

/// One arena. See the module documentation.
#[derive(Debug)]
pub(crate) struct Arena {
    /// Base virtual address of the reservation.
    pub(crate) base: u64,
    /// Size of the reservation in bytes (a multiple of the page size).
    pub(crate) size: u64,
    /// Page size in bytes.
    pub(crate) page: u64,
    pub(crate) occupied: BTreeMap<u64, u64>,
    pub(crate) gaps: BTreeMap<u64, u64>,
    pub(crate) gaps_by_size: BTreeSet<(u64, u64)>,
    pub(crate) touch: Vec<u32>,
    /// Per virtual page, the streams (as bits, see `State::stream_bit`) that
    /// freed a block on it and whose later work a new user of the page must
    /// wait for.
    pub(crate) free_mask: Vec<u64>,
    pub(crate) mappings: BTreeMap<u64, Mapping>,
    pub(crate) cached_pages: u64,
    pub(crate) touched_pages: u64,
    pub(crate) mapped_pages: u64,
}

impl Arena {
    /// An empty arena over the reservation `base .. base + size`.
    pub(crate) fn new(base: u64, size: u64, page: u64) -> Arena {
        let mut a = Arena {
            base,
            size,
            page,
            occupied: BTreeMap::new(),
            gaps: BTreeMap::new(),
            gaps_by_size: BTreeSet::new(),
            touch: Vec::new(),
            free_mask: Vec::new(),
            mappings: BTreeMap::new(),
            cached_pages: 0,
            touched_pages: 0,
            mapped_pages: 0,
        };
        a.insert_gap(0, size);
        a
    }

    fn insert_gap(&mut self, start: u64, end: u64) {
        if end > start {
            self.gaps.insert(start, end);
            self.gaps_by_size.insert((end - start, start));
        }
    }

    fn remove_gap(&mut self, start: u64) -> Option<u64> {
        let end = self.gaps.remove(&start)?;
        self.gaps_by_size.remove(&(end - start, start));
        Some(end)
    }

    /// Pages `first ..= last` that a range `off .. off + len` overlaps.
    pub(crate) fn page_span(&self, off: u64, len: u64) -> (u64, u64) {
        (off / self.page, (off + len - 1) / self.page)
    }

    /// The best-fit gap for `len` bytes: the smallest gap that holds it
    /// (lowest address among equals); the block goes at the gap's start, next to
    /// the block before it, so they share their boundary page.
    pub(crate) fn best_fit(&self, len: u64) -> Option<u64> {
        self.gaps_by_size
            .range((len, 0)..)
            .next()
            .map(|&(_, start)| start)
    }

    /// The best-fitting gap of at most `max_len` bytes whose first `len` bytes
    /// lie on mapped pages only (a cached free range), looking at no more than
    /// `tries` candidates.
    pub(crate) fn best_fit_mapped(&self, len: u64, max_len: u64, tries: usize) -> Option<u64> {
        self.gaps_by_size
            .range((len, 0)..)
            .take(tries)
            .take_while(|&&(l, _)| l <= max_len)
            .map(|&(_, start)| start)
            .find(|&start| {
                let (f, l) = self.page_span(start, len);
                self.unmapped_runs(f, l).is_empty()
            })
    }

    /// A page-aligned offset for `len` bytes past everything mapped or
    /// occupied: fresh virtual space whose pages are all unmapped.
    pub(crate) fn fresh_tail(&self, len: u64) -> Option<u64> {
        let (&gs, &ge) = self.gaps.iter().next_back()?;
        let mapped_end = self
            .mappings
            .iter()
            .next_back()
            .map(|(&s, m)| (s + m.pages) * self.page)
            .unwrap_or(0);
        let start = gs.max(mapped_end).div_ceil(self.page) * self.page;
        (ge >= start && ge - start >= len).then_some(start)
    }

    /// Occupy `off .. off + len`, which must lie inside one gap (returns false,
    /// changing nothing, when it does not).
    pub(crate) fn occupy(&mut self, off: u64, len: u64) -> bool {
        let Some((&gs, &ge)) = self.gaps.range(..=off).next_back() else {
            return false;
        };
        let end = match off.checked_add(len) {
            Some(e) => e,
            None => return false,
        };
        if ge < end || len == 0 {
            return false;
        }
        self.remove_gap(gs);
        self.insert_gap(gs, off);
        self.insert_gap(end, ge);
        self.occupied.insert(off, end);
        true
    }

    /// Give back the occupied range starting at `off`; coalesces it with the gaps
    /// beside it. Returns its end, or `None` when nothing starts at `off`.
    pub(crate) fn vacate(&mut self, off: u64) -> Option<u64> {
        let end = self.occupied.remove(&off)?;
        let mut start = off;
        let mut stop = end;
        if let Some((&ps, &pe)) = self.gaps.range(..off).next_back() {
            if pe == off {
                self.remove_gap(ps);
                start = ps;
            }
        }
        if let Some(ne) = self.gaps.get(&end).copied() {
            self.remove_gap(end);
            stop = ne;
        }
        self.insert_gap(start, stop);
        Some(end)
    }

    /// The mapping containing page `p`, as its start page.
    pub(crate) fn mapping_of(&self, p: u64) -> Option<u64> {
        self.mappings
            .range(..=p)
            .next_back()
            .filter(|(&s, m)| s + m.pages > p)
            .map(|(&s, _)| s)
    }

    /// Runs of unmapped pages among pages `first ..= last`, as (start, len).
    pub(crate) fn unmapped_runs(&self, first: u64, last: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut p = first;
        let from = self.mapping_of(first).unwrap_or(first);
        for (&s, m) in self.mappings.range(from..) {
            if p > last || s > last {
                break;
            }
            if s > p {
                out.push((p, s - p));
            }
            p = p.max(s + m.pages);
        }
        if p <= last {
            out.push((p, last + 1 - p));
        }
        out
    }

    fn ensure_touch_len(&mut self, last: u64) {
        let need = last as usize + 1;
        if self.touch.len() < need {
            self.touch.resize(need, 0);
            self.free_mask.resize(need, 0);
        }
    }

    /// Add `delta` (+1 or -1) to the touch count of pages `first ..= last`.
    /// Returns the mappings whose `untouched` changed (start pages), so that the
    /// caller can update the reclaim order.
    pub(crate) fn touch_range(&mut self, first: u64, last: u64, add: bool, tick: u64) -> Vec<u64> {
        self.ensure_touch_len(last);
        // The mappings overlapping the range, in order, with the count of
        // their pages whose touch count crosses zero.
        let from = self.mapping_of(first).unwrap_or(first);
        let mut maps: Vec<(u64, u64, u64)> = self
            .mappings
            .range(from..=last)
            .map(|(&s, m)| (s, s + m.pages, 0))
            .collect();
        let mut mi = 0;
        let mut crossed = 0u64;
        for p in first..=last {
            let t = &mut self.touch[p as usize];
            let transition = if add {
                *t += 1;
                *t == 1
            } else {
                *t = t.saturating_sub(1);
                *t == 0
            };
            if !transition {
                continue;
            }
            crossed += 1;
            while mi < maps.len() && maps[mi].1 <= p {
                mi += 1;
            }
            if let Some(m) = maps.get_mut(mi) {
                if m.0 <= p {
                    m.2 += 1;
                }
            }
        }
        if add {
            self.touched_pages += crossed;
        } else {
            self.touched_pages -= crossed;
        }
        let mut changed = Vec::new();
        for (start, _, n) in maps {
            if n == 0 {
                continue;
            }
            if let Some(m) = self.mappings.get_mut(&start) {
                if add {
                    m.untouched -= n;
                    self.cached_pages -= n;
                } else {
                    m.untouched += n;
                    self.cached_pages += n;
                }
                m.tick = tick;
                changed.push(start);
            }
        }
        changed
    }

    /// Note that the stream with bit `bit` freed a block on pages `first ..= last`.
    pub(crate) fn mark_freed(&mut self, first: u64, last: u64, bit: u64) {
        self.ensure_touch_len(last);
        for p in first..=last {
            self.free_mask[p as usize] |= bit;
        }
    }

    /// The streams that freed blocks on pages `first ..= last` (union of bits).
    pub(crate) fn hazard(&self, first: u64, last: u64) -> u64 {
        (first..=last)
            .map(|p| self.free_mask.get(p as usize).copied().unwrap_or(0))
            .fold(0, |a, b| a | b)
    }

    /// Forget the hazards of the pages lying wholly inside `off .. off + len`
    /// (their new user has waited for those streams); a partly covered
    /// boundary page keeps them for the bytes beside the block.
    pub(crate) fn clear_hazard_inside(&mut self, off: u64, len: u64) {
        let first = off.div_ceil(self.page);
        let end = (off + len) / self.page;
        for p in first..end {
            if let Some(m) = self.free_mask.get_mut(p as usize) {
                *m = 0;
            }
        }
    }

    /// Take the hazards of pages `first .. first + n` (they leave this
    /// virtual range: unmapped), returning their union.
    pub(crate) fn take_hazard(&mut self, first: u64, n: u64) -> u64 {
        let mut out = 0;
        for p in first..first + n {
            if let Some(m) = self.free_mask.get_mut(p as usize) {
                out |= *m;
                *m = 0;
            }
        }
        out
    }

    /// Touch count of page `p`.
    pub(crate) fn touch_of(&self, p: u64) -> u32 {
        self.touch.get(p as usize).copied().unwrap_or(0)
    }

    /// Record a new mapping of `run` at page `start`.
    pub(crate) fn add_mapping(&mut self, start: u64, run: PageRun, tick: u64) {
        let untouched = (start..start + run.pages)
            .filter(|&p| self.touch_of(p) == 0)
            .count() as u64;
        self.cached_pages += untouched;
        self.mapped_pages += run.pages;
        self.mappings.insert(
            start,
            Mapping {
                pages: run.pages,
                run,
                untouched,
                tick,
                listed: None,
            },
        );
    }

    /// Forget the mapping at page `start`.
    pub(crate) fn remove_mapping(&mut self, start: u64) -> Option<Mapping> {
        let m = self.mappings.remove(&start)?;
        self.cached_pages -= m.untouched;
        self.mapped_pages -= m.pages;
        Some(m)
    }

    /// The virtual address of page `p`.
    pub(crate) fn page_addr(&self, p: u64) -> u64 {
        self.base + p * self.page
    }
}
