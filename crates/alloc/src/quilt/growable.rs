//! Growable buffers: a virtual range of a maximum size, reserved once, whose
//! pages are mapped only as it grows. Its address and its contents never
//! move; its pages come from, and go back to, the pool every block uses.
//!
//! Each buffer is an arena of its own (`Kind::Own`) holding one block
//! at offset 0 whose length changes: growing touches the pages it reaches
//! and backs the unmapped ones exactly as an allocation does (`back_pages`:
//! page hazards ordered, one map per page, one set-access per run, undone
//! on failure); shrinking untouches the pages it leaves, which stay mapped
//! as the buffer's *spare pages* (cached pages of its arena) and carry the
//! buffer's streams' work as a hazard, like any freed range. Spare pages are
//! the first cached pages reclaimed: before the pool grows, those whose
//! work is known complete are unmapped (pages mapped ahead are a bet on
//! latency, never a reason for the pool to grow); when the
//! pool cannot grow, every spare page goes before any ordinary cached page
//! (retired if its work may still run: its pool page moves on with that work
//! as a hazard, never a synchronisation).
//!
//! Releasing a buffer unmaps the pages whose work is known complete and
//! retires the others; its reservation is freed at once, or, while retired
//! pages still wait for their work, once the last is unmapped (the core's
//! arena lifecycle).
//!
//! The feature owns its state ([`Growables`]) and calls down into the core;
//! a frozen arena (a sleeping tag's buffer) refuses every change.

use rustc_hash::FxHashMap as HashMap;

use quilt_vmm::{DevicePtr, StreamId};

use super::stitch::{Core, Ctx};
use super::streams::Streams;
use crate::api::{check_size, round_up, MIN_BLOCK_SIZE};
use crate::error::AllocError;
use crate::stats::ServingStats;

/// The id of a growable buffer (unique over the allocator's life).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GrowableId(pub u64);

/// What a growable buffer is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrowableInfo {
    /// The device address of its first byte: fixed for its life.
    pub ptr: DevicePtr,
    /// Its length in bytes (what the last `grow_to` or `shrink_to` asked).
    pub len: u64,
    /// Its maximum length in bytes (the maximum asked for, rounded up to pages).
    pub max_len: u64,
    /// Bytes of pages mapped in its range: those under its length and the
    /// spare pages past it (mapped ahead, or left by a shrink).
    pub mapped_bytes: u64,
    /// The stream it was created on (growth is ordered on it).
    pub stream: StreamId,
    /// Its tag, if any.
    pub tag: Option<String>,
}

/// One live growable buffer.
#[derive(Clone, Debug)]
pub(crate) struct GrowRec {
    /// Its arena (its own reservation).
    pub(crate) arena: usize,
    /// Length in bytes.
    pub(crate) len: u64,
    /// Maximum length in bytes (whole pages: the arena's size).
    pub(crate) max: u64,
    /// The index of its stream.
    pub(crate) stream: u32,
    /// The streams that use it (bits): its own and those recorded.
    pub(crate) streams: u64,
    /// Its tag (index), if any.
    pub(crate) tag: Option<u32>,
    /// Pages its last step reached (a growth from a non-empty length;
    /// `u64::MAX` before the first): the step the next one is expected to
    /// repeat.
    pub(crate) step_pages: u64,
}

impl GrowRec {
    /// The bytes its block covers: the length rounded up to 512 B.
    pub(crate) fn extent(&self) -> u64 {
        extent_of(self.len)
    }
}

/// A length rounded up to 512 B (lengths never exceed 1 TiB: no overflow).
fn extent_of(len: u64) -> u64 {
    round_up(len, MIN_BLOCK_SIZE).unwrap_or(len)
}

/// The growable buffers: live ones by id, recycled ranges, counters.
#[derive(Debug, Default)]
pub(crate) struct Growables {
    /// Live growable buffers by id.
    pub(crate) live: HashMap<u64, GrowRec>,
    /// The id of the next growable buffer.
    next: u64,
    /// Arenas of released growable buffers kept whole (pages mapped) for
    /// the next buffer of the same maximum ([`super::config::Recycle`]).
    pub(crate) recycled: Vec<usize>,
    /// Counters (the growable fields of [`ServingStats`]).
    pub(crate) counts: ServingStats,
}

impl Growables {
    /// The live growable buffer `id`.
    pub(crate) fn get(&self, id: GrowableId) -> Result<&GrowRec, AllocError> {
        self.live
            .get(&id.0)
            .ok_or(AllocError::UnknownGrowable { id: id.0 })
    }

    /// True when a live buffer grows on stream index `si`.
    pub(crate) fn grows_on(&self, si: u32) -> bool {
        self.live.values().any(|g| g.stream == si)
    }

    /// The arenas of the buffers of tag `t`.
    pub(crate) fn tag_arenas(&self, t: u32) -> impl Iterator<Item = usize> + '_ {
        self.live
            .values()
            .filter(move |g| g.tag == Some(t))
            .map(|g| g.arena)
    }

    /// The non-empty buffers of tag `t` as (device address, length, streams mask).
    pub(crate) fn tag_members<'a>(
        &'a self,
        core: &'a Core,
        t: u32,
    ) -> impl Iterator<Item = (DevicePtr, u64, u64)> + 'a {
        self.live
            .values()
            .filter(move |g| g.tag == Some(t) && g.len > 0)
            .map(|g| (core.arenas[g.arena].base, g.len, g.streams))
    }

    /// Create a growable buffer of at most `max` bytes on `stream`: reserve
    /// its range (rounded up to pages), map nothing. The caller checked its
    /// tag (if any) is awake.
    pub(crate) fn create(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        max: u64,
        stream: StreamId,
        tag: Option<u32>,
    ) -> Result<GrowableId, AllocError> {
        check_size(max)?;
        let max = round_up(max, ctx.page).ok_or(AllocError::InvalidSize {
            size: max,
            reason: "size overflows when rounded to pages",
        })?;
        core.tick += 1;
        let si = core.stream_index(stream);
        if !core.zombies.is_empty() {
            // A driver call follows: learn how far the streams got, and
            // unmap the retired pages of released buffers whose work is
            // done, freeing their ranges (else they would pile up while the
            // pool never runs short).
            core.streams.refresh(ctx.vmm, core.tick);
            core.unmap_retired(ctx, false)?;
        }
        let reuse = self.recycled.iter().rposition(|&ai| {
            let a = &core.arenas[ai];
            a.size == max && a.retired_pages == 0
        });
        let ai = match reuse {
            Some(i) => {
                self.counts.recycled += 1;
                self.recycled.swap_remove(i)
            }
            None => core.own_arena(ctx, max)?,
        };
        let id = self.next;
        self.next += 1;
        self.live.insert(
            id,
            GrowRec {
                arena: ai,
                len: 0,
                max,
                stream: si,
                streams: Streams::bit(si),
                tag,
                step_pages: u64::MAX,
            },
        );
        core.stats.allocation.increase(1);
        self.counts.growables += 1;
        self.counts.created += 1;
        Ok(GrowableId(id))
    }

    /// What buffer `id` is now (`tag_name` names its tag).
    pub(crate) fn info(
        &self,
        core: &Core,
        id: GrowableId,
        tag_name: impl Fn(u32) -> String,
    ) -> Result<GrowableInfo, AllocError> {
        let g = self.get(id)?;
        let a = &core.arenas[g.arena];
        Ok(GrowableInfo {
            ptr: a.base,
            len: g.len,
            max_len: g.max,
            mapped_bytes: a.mapped_pages * a.page,
            stream: core.streams.id(g.stream),
            tag: g.tag.map(tag_name),
        })
    }

    /// Grow buffer `id` to `bytes`: back the pages it reaches that are not
    /// mapped, ordering its stream after any other stream's work on them.
    /// Out of memory leaves it as it was.
    pub(crate) fn grow(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        id: GrowableId,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let g = self.get(id)?.clone();
        core.check_not_frozen(g.arena)?;
        let refuse = |reason| AllocError::InvalidResize {
            id: id.0,
            len: g.len,
            max: g.max,
            requested: bytes,
            reason,
        };
        if bytes > g.max {
            return Err(refuse("beyond its maximum length"));
        }
        if bytes < g.len {
            return Err(refuse("grow_to below its length (use shrink_to)"));
        }
        if bytes == g.len {
            return Ok(());
        }
        core.tick += 1;
        let (from, to) = (g.extent(), extent_of(bytes));
        let found = core.grow_own_block(ctx, g.arena, (from, to), bytes - g.len, g.stream)?;
        let (n_from, n_to) = (from.div_ceil(ctx.page), to.div_ceil(ctx.page));
        let mapped = (n_to - n_from) - found;
        self.counts.grows += 1;
        self.counts.pages_found_mapped += found;
        self.counts.pages_mapped_on_grow += mapped;
        if mapped == 0 {
            self.counts.grows_already_mapped += 1;
        }
        core.stats.requested_bytes.increase(bytes - g.len);
        if let Some(rec) = self.live.get_mut(&id.0) {
            rec.len = bytes;
            if n_to > n_from && from > 0 {
                rec.step_pages = n_to - n_from;
            }
        }
        core.sync_arena_stats(ctx);
        Ok(())
    }

    /// The pages kept mapped past buffer `g`'s end: as many as its last
    /// growth reached, at most [`super::config::MapAhead::pages`].
    fn ahead_pages(ctx: &Ctx<'_>, g: &GrowRec) -> u64 {
        ctx.cfg.map_ahead.pages.min(g.step_pages)
    }

    /// Shrink buffer `id` to `bytes`: the pages it leaves stay mapped as
    /// spare pages, freed by its streams now; those past the map-ahead
    /// allowance whose work is known complete are unmapped at once.
    pub(crate) fn shrink(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        id: GrowableId,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let g = self.get(id)?.clone();
        core.check_not_frozen(g.arena)?;
        if bytes > g.len {
            return Err(AllocError::InvalidResize {
                id: id.0,
                len: g.len,
                max: g.max,
                requested: bytes,
                reason: "shrink_to above its length (use grow_to)",
            });
        }
        if bytes == g.len {
            return Ok(());
        }
        core.tick += 1;
        let (from, to) = (g.extent(), extent_of(bytes));
        core.shrink_own_block(ctx, g.arena, (from, to), g.streams);
        self.counts.shrinks += 1;
        core.stats.requested_bytes.decrease(g.len - bytes);
        if let Some(rec) = self.live.get_mut(&id.0) {
            rec.len = bytes;
        }
        // Past the allowance kept ahead, the spare pages whose work is done
        // go back to the pool.
        let keep = extent_of(bytes).div_ceil(ctx.page) + Self::ahead_pages(ctx, &g);
        let moved = core.return_done_spare_pages(ctx, g.arena, keep);
        core.sync_arena_stats(ctx);
        moved
    }

    /// Note that buffer `id` is used on `stream` too.
    pub(crate) fn record_stream(
        &mut self,
        core: &mut Core,
        id: GrowableId,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let g = self.get(id)?;
        core.check_not_frozen(g.arena)?;
        let si = core.stream_index(stream);
        if let Some(g) = self.live.get_mut(&id.0) {
            g.streams |= Streams::bit(si);
        }
        Ok(())
    }

    /// Release buffer `id`: its pages go back to the pool (unmapped when
    /// their work is known complete, retired otherwise), its reservation is
    /// freed once nothing is mapped in it; or, untagged and while fewer
    /// than [`super::config::Recycle::max_buffers`] are kept, its range is
    /// kept whole for the next buffer of the same maximum.
    pub(crate) fn release(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        id: GrowableId,
    ) -> Result<(), AllocError> {
        let g = self.get(id)?.clone();
        core.check_not_frozen(g.arena)?;
        self.live.remove(&id.0);
        core.tick += 1;
        let ai = g.arena;
        let from = g.extent();
        core.vacate_own_block(ctx, ai, from, g.streams);
        core.stats.requested_bytes.decrease(g.len);
        core.stats.allocation.decrease(1);
        self.counts.growables -= 1;
        if g.tag.is_none()
            && self.recycled.len() < ctx.cfg.recycle.max_buffers
            && core.arenas[ai].retired_pages == 0
        {
            // Kept whole for the next buffer of the same maximum: its pages
            // stay mapped as spare pages (reclaimed first), freed by its
            // streams now (a hazard, when streams are tracked).
            if core.streams.len() > 1 && from > 0 {
                let tick = core.tick;
                core.arenas[ai].add_hazard(0, from, g.streams, tick);
            }
            self.recycled.push(ai);
            core.sync_arena_stats(ctx);
            return Ok(());
        }
        let released = core.release_own_arena(ctx, ai);
        core.sync_arena_stats(ctx);
        released
    }

    /// Map the pages among the buffer's ahead pages past buffer `id`'s end
    /// that are not mapped yet: from free pool pages beyond one per other
    /// live buffer (the nearest pages they cover), or from growth while the
    /// pool stays below [`super::config::MapAhead::below_per_mille`] of its
    /// limit; nothing for a frozen buffer. The pages are spare pages:
    /// cached, first to be reclaimed. Returns the pages mapped.
    pub(crate) fn map_ahead(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        id: GrowableId,
    ) -> Result<u64, AllocError> {
        let Some(g) = self.live.get(&id.0).cloned() else {
            return Ok(0); // released since
        };
        if core.check_not_frozen(g.arena).is_err() {
            return Ok(0);
        }
        let first = g.extent().div_ceil(ctx.page);
        let end = (first + Self::ahead_pages(ctx, &g)).min(g.max / ctx.page);
        // Keep one free page for each other live buffer's next growth: pages
        // ahead taken from what that growth needs would come back at once.
        let others = self.live.len() as u64 - 1;
        let n = core.map_ahead_in(ctx, g.arena, first..end, others, g.stream)?;
        self.counts.pages_mapped_ahead += n;
        Ok(n)
    }
}
