//! Hazards left unbuilt while one stream allocates alone.
//!
//! Once two streams exist, a free leaves a hazard (its range, its streams,
//! its tick) so that another stream placing a block there is ordered after
//! the work that may still use it. Where one stream does all the allocating
//! and another was used once (a CUDA-graph warm-up, a one-off copy on a
//! side stream), no other stream ever reads those hazards, yet every free
//! and allocation cuts, joins and prunes them: measured, 4 to 18 % more host
//! time per operation on the real traces (`docs/benchmarks.md`).
//!
//! So once one stream has made every allocation for [`SOLO_AFTER`]
//! operations, or for an eighth as many as the arenas have pages if that
//! is more, it runs *solo*: its frees (of blocks no other stream used)
//! leave no hazard. The pages still record them, as every free does
//! (`PageSlot::freed_by`, `freed_at`). When another stream next allocates
//! (or grows a block of its own), the solo run ends and the hazards are built from the pages first
//! ([`Arena::add_solo_hazards`]): each page the solo stream freed on since
//! the run began becomes, over its part in a gap not under a hazard
//! already, a hazard of that stream at the page's latest free. That is
//! coarser than the hazards it stands for (a whole page, the page's latest
//! free; the same trade-off as the first stream's frees when a second
//! stream first appears, `Arena::add_first_stream_hazards`), and costs one
//! walk of the arenas' gaps and their pages, which the run's length pays
//! for: a page's visit costs tens of instructions, the hazard upkeep a run
//! saves about 300 per operation (measured on the real traces beside an
//! idle second stream), so a run an eighth as long as the arenas have
//! pages has paid for it. Frees of blocks another stream used
//! (`record_stream`), and frees by other streams, leave their hazards as
//! always.

use super::arena::Arena;
use super::stitch::{Core, Solo};
use super::streams::Streams;

/// Operations one stream must allocate alone, at least, before it runs solo.
pub(crate) const SOLO_AFTER: u64 = 64;

impl Core {
    /// Stream `t` allocates (or grows a block) now: another stream's
    /// allocation ends a solo run, its hazards built first; one stream's
    /// allocations alone for long enough start one.
    pub(crate) fn note_allocating(&mut self, t: u32) {
        if self.streams.len() < 2 {
            return;
        }
        match self.solo {
            Some(solo) if solo.stream == t => return,
            Some(_) => self.end_solo(),
            None => {}
        }
        let (run_stream, run_start) = self.alloc_run;
        if run_stream != t {
            self.alloc_run = (t, self.tick);
            return;
        }
        let run = self.tick - run_start;
        if run < SOLO_AFTER || t >= 63 {
            return;
        }
        let pages: u64 = self.arenas.iter().map(|a| a.pages.len() as u64).sum();
        if run >= pages / 8 {
            self.solo = Some(Solo {
                stream: t,
                since: self.tick,
            });
        }
    }

    /// True when a free of a block used by the streams `mask` leaves no
    /// hazard: the solo stream's own.
    pub(crate) fn free_leaves_no_hazard(&self, mask: u64) -> bool {
        self.solo
            .is_some_and(|solo| Streams::bit(solo.stream) == mask)
    }

    /// End the solo run, if any: the hazards its frees left unbuilt are
    /// built from the pages.
    pub(crate) fn end_solo(&mut self) {
        let Some(solo) = self.solo.take() else {
            return;
        };
        let bit = Streams::bit(solo.stream);
        let mark = self.streams.last_mark(bit);
        for a in &mut self.arenas {
            a.add_solo_hazards(bit, solo.since, mark);
        }
    }
}

impl Arena {
    /// A solo run of the stream `bit` since tick `since` ended: each page
    /// it freed on since (`freed_by` has it, `freed_at` is later) becomes,
    /// over its part in a gap that no hazard covers yet, a hazard of that
    /// stream at the page's latest free. Pieces side by side join, at the
    /// later tick, where both ticks are past `mark` (no event of the stream
    /// recorded since: see `Streams::last_mark`).
    pub(crate) fn add_solo_hazards(&mut self, bit: u64, since: u64, mark: u64) {
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
            let mut new: Vec<super::tiling::Hazard> = Vec::new();
            for p in first..=last {
                let slot = &self.pages[p as usize];
                if slot.freed_by & bit == 0 || slot.freed_at <= since {
                    continue;
                }
                let tick = slot.freed_at;
                let (mut lo, hi) = ((p * self.page).max(start), ((p + 1) * self.page).min(end));
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
                        _ => new.push(super::tiling::Hazard::over(lo, piece_end - lo, bit, tick)),
                    }
                    lo = piece_end;
                }
            }
            self.tiling.add_hazards(id, new);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;
    use crate::quilt::tiling::Hazard;

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
    fn a_solo_run_s_pages_become_hazards_around_those_already_there() {
        // Pages of 100 bytes; pages 0..6 known. Stream bit 1 freed on pages
        // 1 and 2 during the run (ticks 7 and 9), on page 4 before it (tick
        // 3); stream bit 2 freed on page 2 during the run too, with its own
        // hazard over 230..260. A block holds 500..600 (page 5).
        let mut a = Arena::new(0, 1000, 100);
        a.pages.resize(6, Default::default());
        for (p, by, at) in [(1, 1, 7), (2, 3, 9), (4, 1, 3), (5, 1, 8)] {
            a.pages[p].freed_by = by;
            a.pages[p].freed_at = at;
        }
        let g = a.tiling.find(0).unwrap();
        a.tiling.occupy(g, 500, 100).unwrap();
        let g = a.tiling.find(0).unwrap();
        a.tiling.add_hazard(g, Hazard::over(230, 30, 2, 9));
        // The run began at tick 5; the stream's last event was at tick 6.
        a.add_solo_hazards(1, 5, 6);
        assert_eq!(
            hazards(&a),
            vec![
                (100, 230, 1, 9), // pages 1 and 2 joined (ticks past the mark)
                (230, 260, 2, 9), // the hazard already there
                (260, 300, 1, 9), // the rest of page 2
            ],
            "page 4 was freed on before the run, page 5 is under a block"
        );
        a.tiling.check(1000).unwrap();
        // With an event of the stream at tick 7, pages 1 and 2 stay apart.
        let mut b = Arena::new(0, 1000, 100);
        b.pages.resize(3, Default::default());
        for (p, at) in [(1, 7), (2, 9)] {
            b.pages[p].freed_by = 1;
            b.pages[p].freed_at = at;
        }
        b.add_solo_hazards(1, 5, 7);
        assert_eq!(hazards(&b), vec![(100, 200, 1, 7), (200, 300, 1, 9)]);
    }
}
