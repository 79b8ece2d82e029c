//! Memory pressure: the pool could not grow at its last try (its memory
//! limit or the device's memory reached). Under pressure every new page a
//! block needs is a cached page moved from elsewhere, so a gap whose pages
//! are mapped saves driver calls but no memory: what memory depends on is
//! how tightly blocks pack. A block that leaves a larger gap than it must
//! leaves its end page partly used and a remainder that only smaller
//! blocks fill; every gap between blocks holds up to two partly used
//! pages that no other block can use, and a request fails once those and
//! the cached pages no longer hold it. So under pressure Quilt's placement
//! (`BestFit::pack` in `placement.rs`) takes the best fit alone: the
//! smallest gap that holds the block, as
//! [`Placement::BestFit`](super::config::Placement::BestFit) with one
//! candidate does, not the candidate that is mapped or needs no wait;
//! where retired pages still in use lie in fitting gaps, the best fit among
//! the candidates that hold the block past them (no synchronisation).
//! Without pressure placement chooses among its candidates as configured:
//! a mapped gap there spares the pool's growth as well as driver calls.

use super::stitch::Core;

impl Core {
    /// Note the outcome of a try to grow the pool: refused (the limit or
    /// the device's memory reached) puts the allocator under pressure,
    /// growth ends it.
    pub(super) fn note_growth(&mut self, grew: bool) {
        self.under_pressure = !grew;
    }
}
