//! The offload tier: when a request would run out of memory, put tags the
//! program marked offloadable to sleep ([`SleepMode::Offload`]: their
//! contents to host memory, their pages to the pool) and try again.
//!
//! A tag is offloadable only when its owner says so
//! ([`super::QuiltAllocator::set_offloadable`]): the tier takes its memory
//! away at any moment, and the owner must check
//! [`super::QuiltAllocator::is_asleep`] and `wake` it before using its
//! memory again (a kernel reading an unmapped address faults; nothing wakes
//! a tag behind the program's back).

use super::sleep::{SleepMode, SleepPages};
use super::state::{Ctx, State};
use crate::error::AllocError;

/// What happens when a request would run out of memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadTier {
    /// Nothing: the request fails with [`AllocError::OutOfMemory`].
    #[default]
    Off,
    /// Put awake offloadable tags to sleep (offload mode), those holding the
    /// most pages first, retrying the request after each, when the pages
    /// they hold with what is free, cached and creatable cover the request;
    /// never the tag the request is for.
    OffloadableTags,
}

impl State {
    /// Run `op`; if it runs out of memory and the tier allows, put
    /// offloadable tags (other than `exclude`) to sleep and run it again.
    pub(crate) fn with_offload_tier<T>(
        &mut self,
        ctx: &Ctx<'_>,
        exclude: Option<u32>,
        mut op: impl FnMut(&mut State, &Ctx<'_>) -> Result<T, AllocError>,
    ) -> Result<T, AllocError> {
        let ooms = self.stats.num_ooms;
        let first = op(self, ctx);
        let needed = match (&first, self.offload_tier) {
            (Err(AllocError::OutOfMemory(r)), OffloadTier::OffloadableTags) => {
                r.needed.div_ceil(ctx.page)
            }
            _ => return first,
        };
        let mut candidates: Vec<(u64, u32)> = (0..self.tags.len())
            .filter(|&t| {
                Some(t) != exclude && self.tags.is_offloadable(t) && !self.tags.is_asleep(t)
            })
            .map(|t| {
                let pages = self
                    .tag_arenas(t)
                    .iter()
                    .map(|&ai| self.arenas[ai].mapped_pages)
                    .sum::<u64>();
                (pages, t)
            })
            .filter(|&(pages, _)| pages > 0)
            .collect();
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        let held: u64 = candidates.iter().map(|&(p, _)| p).sum();
        let growable = ctx.pool.growable_pages().unwrap_or(0);
        let usable = ctx.pool.free_pages() + self.cached_pages() + growable;
        if usable + held < needed {
            return first; // offloading everything would not be enough
        }
        let mut last = first;
        for (_, t) in candidates {
            let name = self.tags.name(t).to_string();
            if self
                .sleep(ctx, &name, SleepMode::Offload, SleepPages::KeepInPool)
                .is_err()
            {
                break;
            }
            self.serving.tier_offloads += 1;
            last = op(self, ctx);
            if last.is_ok() {
                self.stats.num_ooms = ooms;
                self.serving.tier_rescues += 1;
                break;
            }
        }
        last
    }
}
