//! One chunk: a driver handle of many pages, and a bitmap of its free pages.

use bitvec::prelude::*;
use quilt_vmm::PhysHandle;

/// A chunk of physical memory.
///
/// Invariant: `free_count` equals the number of set bits in `free` (a set bit is
/// a free page), and `free.len() == pages`.
pub(crate) struct Chunk {
    pub(crate) handle: PhysHandle,
    pub(crate) pages: u64,
    pub(crate) free_count: u64,
    free: BitVec<u64, Lsb0>,
}

impl Chunk {
    /// A chunk of `pages` pages, all free.
    pub(crate) fn new(handle: PhysHandle, pages: u64) -> Chunk {
        Chunk {
            handle,
            pages,
            free_count: pages,
            free: bitvec![u64, Lsb0; 1; pages as usize],
        }
    }

    pub(crate) fn is_free(&self, page: u64) -> bool {
        self.free.get(page as usize).map(|b| *b).unwrap_or(false)
    }

    pub(crate) fn count_free(&self) -> u64 {
        self.free.count_ones() as u64
    }

    /// True when pages `start .. start + n` exist and are all handed out.
    pub(crate) fn all_used(&self, start: u64, n: u64) -> bool {
        let end = start.saturating_add(n);
        end <= self.pages && self.free[start as usize..end as usize].not_any()
    }

    pub(crate) fn mark_used(&mut self, start: u64, n: u64) {
        self.free[start as usize..(start + n) as usize].fill(false);
        self.free_count -= n;
    }

    pub(crate) fn mark_free(&mut self, start: u64, n: u64) {
        self.free[start as usize..(start + n) as usize].fill(true);
        self.free_count += n;
    }

    /// Maximal runs of free pages as (start, len), in address order.
    pub(crate) fn free_runs(&self) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut i = 0usize;
        let n = self.free.len();
        while i < n {
            match self.free[i..].first_one() {
                None => break,
                Some(off) => {
                    let start = i + off;
                    let len = self.free[start..].first_zero().unwrap_or(n - start);
                    runs.push((start as u64, len as u64));
                    i = start + len;
                }
            }
        }
        runs
    }

    /// The smallest free run of at least `n` pages, as (start, len).
    pub(crate) fn smallest_run_at_least(&self, n: u64) -> Option<(u64, u64)> {
        self.free_runs()
            .into_iter()
            .filter(|r| r.1 >= n)
            .min_by_key(|r| (r.1, r.0))
    }
}
