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
//! ([`Arena::add_hazards_from_pages`](super::arena::Arena::add_hazards_from_pages)): each page the solo stream freed on since
//! the run began becomes, over its part in a gap not under a hazard
//! already, a hazard of that stream at the page's latest free. That is
//! coarser than the hazards it stands for (a whole page, the page's latest
//! free; the same walk builds the first stream's hazards when a second
//! stream first appears), and costs one
//! walk of the arenas' gaps and their pages, which the run's length pays
//! for: a page's visit costs tens of instructions, the hazard upkeep a run
//! saves about 300 per operation (measured on the real traces beside an
//! idle second stream), so a run an eighth as long as the arenas have
//! pages has paid for it. Frees of blocks another stream used
//! (`record_stream`), and frees by other streams, leave their hazards as
//! always.

use super::stitch::{Core, Solo};
use super::streams::Streams;

/// Operations one stream must allocate alone, at least, before it runs solo.
pub(crate) const SOLO_AFTER: u64 = 64;

impl Core {
    /// Stream `t` allocates (or grows a block) now: another stream's
    /// allocation ends a solo run, its hazards built first; one stream's
    /// allocations alone for long enough start one.
    #[inline]
    pub(crate) fn note_allocating(&mut self, t: u32) {
        if self.streams.len() >= 2 {
            self.note_allocating_among_streams(t);
        }
    }

    /// [`Core::note_allocating`] once several streams exist. (Out of line:
    /// one stream alone has no run to start or end.)
    #[inline(never)]
    fn note_allocating_among_streams(&mut self, t: u32) {
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
            a.add_hazards_from_pages(bit, solo.since, mark);
        }
    }
}
