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

use super::growable::Growables;
use super::sleep::{tag_arenas, SleepMode, SleepPages, Tags};
use super::stitch::{Core, Ctx};
use crate::error::AllocError;

/// What the offload tier works on: the core and the features whose memory
/// it may put to sleep.
pub(crate) struct Tier<'a> {
    pub(crate) core: &'a mut Core,
    pub(crate) growables: &'a mut Growables,
    pub(crate) tags: &'a mut Tags,
}

/// Run `op`; if it runs out of memory and the tier ([`super::config::OffloadTier`])
/// allows, put offloadable tags (other than `exclude`) to sleep and run it
/// again. (Inline: every allocation runs it, few run the retry.)
#[inline]
pub(crate) fn with_offload_tier<T>(
    tier: Tier<'_>,
    ctx: &Ctx<'_>,
    exclude: Option<u32>,
    mut op: impl FnMut(&mut Tier<'_>, &Ctx<'_>) -> Result<T, AllocError>,
) -> Result<T, AllocError> {
    let mut tier = tier;
    let ooms = tier.core.stats.num_ooms;
    let first = op(&mut tier, ctx);
    let needed = match (&first, ctx.cfg.offload_tier) {
        (Err(AllocError::OutOfMemory(r)), super::config::OffloadTier::OffloadableTags) => {
            r.needed.div_ceil(ctx.page)
        }
        _ => return first,
    };
    offload_and_retry(tier, ctx, exclude, op, (first, needed, ooms))
}

/// [`with_offload_tier`] once `op` ran out of memory (`first`) needing
/// `needed` pages, with `ooms` out-of-memory errors counted before it:
/// offloadable tags put to sleep, largest first, `op` run again after each.
/// (Out of line: every operation runs the wrapper, few run this.)
#[cold]
#[inline(never)]
fn offload_and_retry<T>(
    mut tier: Tier<'_>,
    ctx: &Ctx<'_>,
    exclude: Option<u32>,
    mut op: impl FnMut(&mut Tier<'_>, &Ctx<'_>) -> Result<T, AllocError>,
    (first, needed, ooms): (Result<T, AllocError>, u64, u64),
) -> Result<T, AllocError> {
    let Tier {
        core,
        growables,
        tags,
    } = &mut tier;
    let mut candidates: Vec<(u64, u32)> = (0..tags.len())
        .filter(|&t| Some(t) != exclude && tags.is_offloadable(t) && !tags.is_asleep(t))
        .map(|t| {
            let pages = tag_arenas(core, growables, t)
                .iter()
                .map(|&ai| core.arenas[ai].mapped_pages)
                .sum::<u64>();
            (pages, t)
        })
        .filter(|&(pages, _)| pages > 0)
        .collect();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    let held: u64 = candidates.iter().map(|&(p, _)| p).sum();
    let growable = ctx.pool.growable_pages().unwrap_or(0);
    let usable = ctx.pool.free_pages() + core.cached_pages() + growable;
    if usable + held < needed {
        return first; // offloading everything would not be enough
    }
    let mut last = first;
    for (_, t) in candidates {
        let name = tier.tags.name(t).to_string();
        let slept = tier.tags.sleep(
            tier.core,
            tier.growables,
            ctx,
            &name,
            SleepMode::Offload,
            SleepPages::KeepInPool,
        );
        if slept.is_err() {
            break;
        }
        tier.tags.counts.tier_offloads += 1;
        last = op(&mut tier, ctx);
        if last.is_ok() {
            tier.core.stats.num_ooms = ooms;
            tier.tags.counts.tier_rescues += 1;
            break;
        }
    }
    last
}
