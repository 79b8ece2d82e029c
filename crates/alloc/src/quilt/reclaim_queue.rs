//! The reclaim queue: the pages that became cached, oldest first, each with
//! the tick it became cached at (its stamp). An entry whose page was since
//! touched or unmapped (its `cached_at` differs) is stale; whoever takes
//! entries skips those. Kept as runs (one arena's consecutive pages cached
//! at one tick: a block freed whole is one run, whatever its pages), read
//! and taken a page at a time, in the order the pages were queued.

use std::collections::VecDeque;
use std::ops::Range;

/// Consecutive pages of one arena queued at one stamp.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Run {
    arena: usize,
    pages: Range<u64>,
    stamp: u64,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct ReclaimQueue {
    runs: VecDeque<Run>,
    /// Pages queued, over every run.
    pages: u64,
}

impl ReclaimQueue {
    /// Pages queued (valid or stale).
    pub(crate) fn pages(&self) -> u64 {
        self.pages
    }

    /// No page queued.
    #[cfg(any(test, feature = "invariants"))]
    pub(crate) fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Queue the pages `pages` of arena `arena`, cached at `stamp`, after
    /// every page queued.
    pub(crate) fn push_back(&mut self, arena: usize, pages: Range<u64>, stamp: u64) {
        if pages.is_empty() {
            return;
        }
        self.pages += pages.end - pages.start;
        match self.runs.back_mut() {
            Some(r) if r.arena == arena && r.stamp == stamp && r.pages.end == pages.start => {
                r.pages.end = pages.end;
            }
            _ => self.runs.push_back(Run {
                arena,
                pages,
                stamp,
            }),
        }
    }

    /// Queue page `p` of arena `arena`, cached at `stamp`, before every page
    /// queued (one taken and given back).
    pub(crate) fn push_front(&mut self, (arena, p, stamp): (usize, u64, u64)) {
        self.pages += 1;
        match self.runs.front_mut() {
            Some(r) if r.arena == arena && r.stamp == stamp && r.pages.start == p + 1 => {
                r.pages.start = p;
            }
            _ => self.runs.push_front(Run {
                arena,
                pages: p..p + 1,
                stamp,
            }),
        }
    }

    /// The first page queued, as (arena, page, stamp), taken off the queue.
    pub(crate) fn pop_front(&mut self) -> Option<(usize, u64, u64)> {
        let r = self.runs.front_mut()?;
        let entry = (r.arena, r.pages.start, r.stamp);
        r.pages.start += 1;
        if r.pages.is_empty() {
            self.runs.pop_front();
        }
        self.pages -= 1;
        Some(entry)
    }

    /// Every page queued, in order, as (arena, page, stamp).
    #[cfg(any(test, feature = "invariants"))]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        self.runs
            .iter()
            .flat_map(|r| r.pages.clone().map(move |p| (r.arena, p, r.stamp)))
    }

    /// Keep only the pages for which `keep(arena, page, stamp)` holds, in
    /// order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(usize, u64, u64) -> bool) {
        let old = std::mem::take(self);
        for r in old.runs {
            let mut start = r.pages.start;
            for p in r.pages.clone() {
                if !keep(r.arena, p, r.stamp) {
                    self.push_back(r.arena, start..p, r.stamp);
                    start = p + 1;
                }
            }
            self.push_back(r.arena, start..r.pages.end, r.stamp);
        }
    }
}

impl FromIterator<(usize, u64, u64)> for ReclaimQueue {
    /// The pages given, in order, as (arena, page, stamp).
    fn from_iter<I: IntoIterator<Item = (usize, u64, u64)>>(pages: I) -> Self {
        let mut q = ReclaimQueue::default();
        for (arena, p, stamp) in pages {
            q.push_back(arena, p..p + 1, stamp);
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_out_one_at_a_time_in_the_order_queued() {
        let mut q = ReclaimQueue::default();
        q.push_back(0, 3..6, 7);
        q.push_back(0, 6..8, 7); // joins the run before it
        q.push_back(1, 8..9, 7);
        q.push_back(0, 2..3, 9);
        q.push_back(0, 9..9, 9); // nothing
        assert_eq!(q.pages(), 7);
        assert_eq!(q.runs.len(), 3);
        assert_eq!(q.pop_front(), Some((0, 3, 7)));
        q.push_front((0, 3, 7)); // given back where it was
        assert_eq!(q.runs.len(), 3);
        let all: Vec<_> = q.iter().collect();
        assert_eq!(
            all,
            vec![
                (0, 3, 7),
                (0, 4, 7),
                (0, 5, 7),
                (0, 6, 7),
                (0, 7, 7),
                (1, 8, 7),
                (0, 2, 9)
            ]
        );
        q.retain(|_, p, _| p % 2 == 1);
        let kept: Vec<_> = q.iter().collect();
        assert_eq!(kept, vec![(0, 3, 7), (0, 5, 7), (0, 7, 7)]);
        assert_eq!(q.pages(), 3);
        let mut popped = Vec::new();
        while let Some(e) = q.pop_front() {
            popped.push(e);
        }
        assert_eq!(popped, kept);
        assert!(q.is_empty() && q.pages() == 0);
        let built: ReclaimQueue = [(2, 1, 4), (2, 2, 4), (2, 4, 4)].into_iter().collect();
        assert_eq!(built.runs.len(), 2);
    }
}
