//! Growable buffers: a virtual range of a maximum size, reserved once, whose
//! pages are mapped only as it grows. Its address and its contents never
//! move; its pages come from, and go back to, the pool every block uses.
//!
//! Each buffer is an arena of its own (`Kind::Growable`) holding one block
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
//! pages still wait for their work, once the last is unmapped (the arena is
//! a *zombie* until then; a dead arena's slot is reused).

use quilt_vmm::{DevicePtr, StreamId};

use super::arena::Arena;
use super::state::{Ctx, Kind, State};
use super::streams::Streams;
use crate::api::{check_size, round_up, MIN_BLOCK_SIZE};
use crate::error::AllocError;

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

/// How many pages past its end a growable buffer keeps mapped ahead of its
/// growth, and who maps them.
///
/// A buffer keeps as many pages ahead as its last step reached (a growth
/// from a non-empty length: a KV cache's decode step, not its prompt),
/// `pages` before its first step, and never more than `pages`. They come
/// only from the pool's free pages (leaving one for each other live
/// buffer's next growth), or from growth while the pool holds less than
/// `below_per_mille` thousandths of its limit, and they are the
/// first cached pages reclaimed (before the pool grows, and before any
/// other cached page when it cannot). A shrink keeps as many of the pages
/// it leaves mapped, as if mapped ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapAhead {
    /// The most pages kept mapped past each buffer's end (0: none).
    pub pages: u64,
    /// Also grow the pool for pages ahead while it holds less than this many
    /// thousandths of its limit (0: only pages already free in the pool).
    pub below_per_mille: u64,
    /// Who maps them.
    pub mode: AheadMode,
}

/// Who maps the pages ahead of a growable buffer's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AheadMode {
    /// A worker thread of the allocator, woken after each growth.
    Background,
    /// The growing thread, at the end of each growth (deterministic).
    Inline,
    /// Only [`super::QuiltAllocator::map_ahead_now`] (deterministic; tests).
    Manual,
}

impl MapAhead {
    /// Nothing mapped ahead; a shrink keeps no spare page.
    pub const OFF: MapAhead = MapAhead {
        pages: 0,
        below_per_mille: 0,
        mode: AheadMode::Manual,
    };
}

impl Default for MapAhead {
    /// Each buffer's last step ahead, at most 8 pages (16 MiB at 2 MiB
    /// pages: the step of a 7B model's KV cache for 32 tokens), mapped in
    /// the background from pages the pool already holds free: mapping ahead
    /// is a bet on latency and never makes the pool grow (`below_per_mille`
    /// 0), so it adds no memory to what the buffers' growth needs.
    fn default() -> Self {
        MapAhead {
            pages: 8,
            below_per_mille: 0,
            mode: AheadMode::Background,
        }
    }
}

/// What happens to a released (untagged) growable buffer's range: kept
/// whole, its pages still mapped, for the next buffer created with the same
/// maximum (vAttention's deferred reclamation: a new request's KV cache
/// starts on mapped pages, no driver call), up to `max_buffers` of them; the
/// pages are spare pages meanwhile (reclaimed first, before the pool grows
/// once their work is known complete). Past the bound, or with a tag, the
/// range is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recycle {
    /// Released ranges kept at most (0: none).
    pub max_buffers: usize,
}

impl Recycle {
    /// Keep no released range.
    pub const OFF: Recycle = Recycle { max_buffers: 0 };
}

impl Default for Recycle {
    /// None kept: on `quilt-bench`'s `llm-serving-growable` keeping 64 saved
    /// 15 % of the driver calls but held 4.6 % more memory (pages kept
    /// mapped in released ranges while the pool grew), see
    /// `docs/serving.md`.
    fn default() -> Self {
        Recycle::OFF
    }
}

/// Counters of growable buffers and sleep/wake (see
/// [`super::QuiltAllocator::serving_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServingStats {
    /// Growable buffers live now.
    pub growables: u64,
    /// Growable buffers created.
    pub created: u64,
    /// `grow_to` calls that grew a buffer.
    pub grows: u64,
    /// Grows that found every page they reached already mapped (mapped
    /// ahead, or left by a shrink): no driver call.
    pub grows_already_mapped: u64,
    /// Pages grows found already mapped.
    pub pages_found_mapped: u64,
    /// Pages grows had to map themselves.
    pub pages_mapped_on_grow: u64,
    /// Pages mapped ahead of a buffer's end.
    pub pages_mapped_ahead: u64,
    /// Spare pages (mapped ahead or left by a shrink) reclaimed for other use.
    pub spare_pages_reclaimed: u64,
    /// `shrink_to` calls that shrank a buffer.
    pub shrinks: u64,
    /// Tags put to sleep.
    pub sleeps: u64,
    /// Tags woken.
    pub wakes: u64,
    /// Bytes copied to the host by sleeps.
    pub bytes_offloaded: u64,
    /// Bytes copied back to the device by wakes.
    pub bytes_restored: u64,
    /// Stream synchronisations made by sleeps (the work on the memory must be
    /// complete before it is copied or unmapped).
    pub sleep_syncs: u64,
    /// Buffers created in the range of a released one (its pages still
    /// mapped: see [`Recycle`]).
    pub recycled: u64,
    /// Tags the offload tier put to sleep.
    pub tier_offloads: u64,
    /// Requests the offload tier saved from running out of memory.
    pub tier_rescues: u64,
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

impl State {
    /// An empty state with the serving policies of `config`.
    pub(crate) fn with_serving_policies(config: &super::QuiltConfig) -> State {
        let mut st = State::default();
        st.map_ahead = config.map_ahead;
        st.recycle = config.recycle;
        st.offload_tier = config.offload_tier;
        st
    }

    /// The live growable buffer `id`.
    pub(crate) fn growable(&self, id: GrowableId) -> Result<&GrowRec, AllocError> {
        self.growables
            .get(&id.0)
            .ok_or(AllocError::UnknownGrowable { id: id.0 })
    }

    /// Create a growable buffer of at most `max` bytes on `stream`: reserve
    /// its range (rounded up to pages), map nothing.
    pub(crate) fn growable_create(
        &mut self,
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
        if let Some(t) = tag {
            self.tags.check_awake(t)?;
        }
        self.tick += 1;
        let si = self.stream_index(stream);
        if !self.zombies.is_empty() {
            // A driver call follows: learn how far the streams got, and
            // unmap the retired pages of released buffers whose work is
            // done, freeing their ranges (else they would pile up while the
            // pool never runs short).
            self.streams.refresh(ctx.vmm, self.tick);
            self.unmap_retired(ctx, false)?;
        }
        let reuse = self.recycled.iter().rposition(|&ai| {
            let a = &self.arenas[ai];
            a.size == max && a.retired_pages == 0
        });
        let ai = match reuse {
            Some(i) => {
                self.serving.recycled += 1;
                self.recycled.swap_remove(i)
            }
            None => self.growable_arena(ctx, max)?,
        };
        let id = self.next_growable;
        self.next_growable += 1;
        self.growables.insert(
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
        self.stats.allocation.increase(1);
        self.serving.growables += 1;
        self.serving.created += 1;
        Ok(GrowableId(id))
    }

    /// A new arena of `max` bytes for a growable buffer (its own reservation),
    /// in a dead arena's slot if there is one.
    fn growable_arena(&mut self, ctx: &Ctx<'_>, max: u64) -> Result<usize, AllocError> {
        let base = ctx.vmm.reserve(max, 0)?;
        let arena = Arena::new(base, max, ctx.page);
        Ok(match self.free_arena_slots.pop() {
            Some(ai) => {
                self.arenas[ai] = arena;
                self.arena_meta[ai] = (None, Kind::Growable);
                ai
            }
            None => {
                self.arenas.push(arena);
                self.arena_meta.push((None, Kind::Growable));
                self.arenas.len() - 1
            }
        })
    }

    /// What buffer `id` is now.
    pub(crate) fn growable_info(&self, id: GrowableId) -> Result<GrowableInfo, AllocError> {
        let g = self.growable(id)?;
        let a = &self.arenas[g.arena];
        Ok(GrowableInfo {
            ptr: a.base,
            len: g.len,
            max_len: g.max,
            mapped_bytes: a.mapped_pages * a.page,
            stream: self.streams.id(g.stream),
            tag: g.tag.map(|t| self.tags.name(t).to_string()),
        })
    }

    /// Move the block of arena `ai` from extent `from` to extent `to` (bytes
    /// from offset 0): the pages it leaves are untouched (with `freed`, as
    /// freed by those streams at that tick), those it reaches touched.
    fn set_extent(&mut self, ai: usize, from: u64, to: u64, freed: Option<(u64, u64)>) {
        let tick = self.tick;
        let kept = self.reclaim_queue_kept;
        let queue = &mut self.reclaim_queue;
        let a = &mut self.arenas[ai];
        let page = a.page;
        if from > 0 {
            a.vacate(0);
        }
        if to > 0 {
            a.occupy(0, to);
        }
        let (n_from, n_to) = (from.div_ceil(page), to.div_ceil(page));
        if n_to > n_from {
            a.touch(n_from * page, (n_to - n_from) * page);
        } else if n_to < n_from {
            a.untouch(n_to * page, (n_from - n_to) * page, freed, tick, |p| {
                if kept {
                    queue.push_back((ai, p, tick))
                }
            });
        }
    }

    /// Grow buffer `id` to `bytes`: back the pages it reaches that are not
    /// mapped, ordering its stream after any other stream's work on them.
    /// Out of memory leaves it as it was.
    pub(crate) fn growable_grow(
        &mut self,
        ctx: &Ctx<'_>,
        id: GrowableId,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let g = self.growable(id)?.clone();
        if let Some(t) = g.tag {
            self.tags.check_awake(t)?;
        }
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
        self.tick += 1;
        let (from, to) = (g.extent(), extent_of(bytes));
        let ai = g.arena;
        let (n_from, n_to) = (from.div_ceil(ctx.page), to.div_ceil(ctx.page));
        let need = if n_to > n_from {
            self.arenas[ai].unmapped_in(n_from, n_to - 1)
        } else {
            Vec::new()
        };
        if need.len() as u64 > ctx.pool.limit_pages() {
            return Err(self.oom(ctx, bytes - g.len, need.len() as u64, 0));
        }
        if to > from {
            // The growth lies in the gap past the buffer: order the stream
            // after the hazards there before the gap drops them.
            let Some(gap) = self.arenas[ai].gap_at(from) else {
                return Err(AllocError::Internal(format!(
                    "growable {}: no gap past its extent {from:#x}",
                    id.0
                )));
            };
            self.order_after_hazards(ctx, ai, (from, gap), to - from, g.stream)?;
            let hazard = self.arenas[ai].tiling.hazard_union(gap, from, to - from);
            self.set_extent(ai, from, to, None);
            if !need.is_empty() {
                let backed = self.back_pages(ctx, ai, bytes - g.len, &need, g.stream);
                if backed.is_err() {
                    self.set_extent(ai, to, from, None);
                    // The range gets back its hazards, as one.
                    let (streams, k) = hazard;
                    if streams != 0 {
                        self.arenas[ai].add_hazard(from, to - from, streams, k);
                    }
                }
                self.sync_stats(ctx);
                backed?;
            }
        }
        let found = (n_to - n_from) - need.len() as u64;
        self.serving.grows += 1;
        self.serving.pages_found_mapped += found;
        self.serving.pages_mapped_on_grow += need.len() as u64;
        if need.is_empty() {
            self.serving.grows_already_mapped += 1;
        }
        self.stats.allocated_bytes.increase(to - from);
        self.stats.active_bytes.increase(to - from);
        self.stats.requested_bytes.increase(bytes - g.len);
        if let Some(rec) = self.growables.get_mut(&id.0) {
            rec.len = bytes;
            if n_to > n_from && from > 0 {
                rec.step_pages = n_to - n_from;
            }
        }
        self.sync_arena_stats(ctx);
        Ok(())
    }

    /// The pages kept mapped past buffer `g`'s end: as many as its last
    /// growth reached, at most [`MapAhead::pages`].
    fn ahead_pages(&self, g: &GrowRec) -> u64 {
        self.map_ahead.pages.min(g.step_pages)
    }

    /// Shrink buffer `id` to `bytes`: the pages it leaves stay mapped as
    /// spare pages, freed by its streams now; those past the map-ahead
    /// allowance whose work is known complete are unmapped at once.
    pub(crate) fn growable_shrink(
        &mut self,
        ctx: &Ctx<'_>,
        id: GrowableId,
        bytes: u64,
    ) -> Result<(), AllocError> {
        let g = self.growable(id)?.clone();
        if let Some(t) = g.tag {
            self.tags.check_awake(t)?;
        }
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
        self.tick += 1;
        let tick = self.tick;
        let (from, to) = (g.extent(), extent_of(bytes));
        let ai = g.arena;
        if to < from {
            let track = self.streams.len() > 1;
            self.set_extent(ai, from, to, Some((g.streams, tick)));
            if track {
                self.arenas[ai].add_hazard(to, from - to, g.streams, tick);
            }
            for s in self.streams.in_mask(g.streams) {
                self.streams.note_free(ctx.vmm, s, tick, track);
            }
        }
        self.serving.shrinks += 1;
        self.stats.allocated_bytes.decrease(from - to);
        self.stats.active_bytes.decrease(from - to);
        self.stats.requested_bytes.decrease(g.len - bytes);
        if let Some(rec) = self.growables.get_mut(&id.0) {
            rec.len = bytes;
        }
        let spare = self.spare_pages_of(ai, bytes, self.ahead_pages(&g));
        let done: Vec<(usize, u64)> = spare
            .into_iter()
            .filter(|&(ai, p)| {
                let s = self.arenas[ai].slot(p);
                self.work_done(ctx, s.freed_by, s.freed_at, tick)
            })
            .collect();
        let moved = self.move_cached(ctx, &done, false, false);
        self.sync_arena_stats(ctx);
        moved.map(|_| ())
    }

    /// Note that buffer `id` is used on `stream` too.
    pub(crate) fn growable_record_stream(
        &mut self,
        id: GrowableId,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let g = self.growable(id)?;
        if let Some(t) = g.tag {
            self.tags.check_awake(t)?;
        }
        let si = self.stream_index(stream);
        if let Some(g) = self.growables.get_mut(&id.0) {
            g.streams |= Streams::bit(si);
        }
        Ok(())
    }

    /// Release buffer `id`: its pages go back to the pool (unmapped when
    /// their work is known complete, retired otherwise), its reservation is
    /// freed once nothing is mapped in it.
    pub(crate) fn growable_release(
        &mut self,
        ctx: &Ctx<'_>,
        id: GrowableId,
    ) -> Result<(), AllocError> {
        let g = self.growable(id)?.clone();
        if let Some(t) = g.tag {
            self.tags.check_awake(t)?;
        }
        self.growables.remove(&id.0);
        self.tick += 1;
        let tick = self.tick;
        let ai = g.arena;
        let from = g.extent();
        self.set_extent(ai, from, 0, Some((g.streams, tick)));
        // An event on each of its streams (if none covers their frees yet),
        // so that a later operation learns when its retired pages are free.
        for s in self.streams.in_mask(g.streams) {
            self.streams.note_free(ctx.vmm, s, tick, true);
        }
        self.stats.allocated_bytes.decrease(from);
        self.stats.active_bytes.decrease(from);
        self.stats.requested_bytes.decrease(g.len);
        self.stats.allocation.decrease(1);
        self.serving.growables -= 1;
        if g.tag.is_none()
            && self.recycled.len() < self.recycle.max_buffers
            && self.arenas[ai].retired_pages == 0
        {
            // Kept whole for the next buffer of the same maximum: its pages
            // stay mapped as spare pages (reclaimed first), freed by its
            // streams now (a hazard, when streams are tracked).
            if self.streams.len() > 1 && from > 0 {
                self.arenas[ai].add_hazard(0, from, g.streams, tick);
            }
            self.recycled.push(ai);
            self.sync_arena_stats(ctx);
            return Ok(());
        }
        let mapped: Vec<(usize, u64)> = (0..self.arenas[ai].pages.len() as u64)
            .filter(|&p| self.arenas[ai].slot(p).is_cached())
            .map(|p| (ai, p))
            .collect();
        self.zombies.push(ai);
        let moved = self.move_cached(ctx, &mapped, false, false);
        self.free_empty_zombies(ctx);
        self.sync_arena_stats(ctx);
        moved.map(|_| ())
    }

    /// Map the pages among the buffer's `ahead_pages` past buffer `id`'s end
    /// that are not mapped yet: from free pool pages beyond one per other
    /// live buffer (the nearest pages they cover), or from growth while the
    /// pool stays below [`MapAhead::below_per_mille`] of its limit; nothing
    /// for a sleeping tag's buffer. The pages are spare pages: cached, first
    /// to be reclaimed. Returns the pages mapped.
    pub(crate) fn map_ahead_for(
        &mut self,
        ctx: &Ctx<'_>,
        id: GrowableId,
    ) -> Result<u64, AllocError> {
        let Some(g) = self.growables.get(&id.0).cloned() else {
            return Ok(0); // released since
        };
        if g.tag.is_some_and(|t| self.tags.is_asleep(t)) {
            return Ok(0);
        }
        let policy = self.map_ahead;
        let a = &self.arenas[g.arena];
        let first = g.extent().div_ceil(ctx.page);
        let end = (first + self.ahead_pages(&g)).min(g.max / ctx.page);
        // Stop at a retired page: mapping there would wait for its work.
        let mut need: Vec<u64> = (first..end)
            .take_while(|&p| !a.slot(p).retired)
            .filter(|&p| a.slot(p).phys.is_none())
            .collect();
        // Keep one free page for each other live buffer's next growth: pages
        // ahead taken from what that growth needs would come back at once.
        let free = ctx
            .pool
            .free_pages()
            .saturating_sub(self.growables.len() as u64 - 1);
        let wanted = need.len() as u64;
        if free < wanted {
            let after = ctx.pool.total_pages() + (wanted - free);
            let grown = after.saturating_mul(1000)
                <= ctx
                    .pool
                    .limit_pages()
                    .saturating_mul(policy.below_per_mille)
                && self.try_grow(ctx, wanted - free)?;
            if !grown {
                // The nearest pages the free ones cover.
                need.truncate(free.min(usize::MAX as u64) as usize);
            }
        }
        let n = need.len() as u64;
        if n == 0 {
            return Ok(0);
        }
        self.tick += 1;
        let backed = self.back_pages(ctx, g.arena, n * ctx.page, &need, g.stream);
        let tick = self.tick;
        if self.reclaim_queue_kept {
            for &p in &need {
                let s = self.arenas[g.arena].slot(p);
                if s.is_cached() && s.cached_at == tick {
                    self.reclaim_queue.push_back((g.arena, p, tick));
                }
            }
        }
        self.sync_stats(ctx);
        backed?;
        self.serving.pages_mapped_ahead += n;
        Ok(n)
    }

    /// Free the reservation of every zombie arena that no longer holds a
    /// mapping; its slot is reused by the next growable buffer.
    pub(crate) fn free_empty_zombies(&mut self, ctx: &Ctx<'_>) {
        let mut i = 0;
        while i < self.zombies.len() {
            let ai = self.zombies[i];
            let a = &self.arenas[ai];
            if a.mapped_pages > 0 || a.retired_pages > 0 {
                i += 1;
                continue;
            }
            if let Err(e) = ctx.vmm.address_free(a.base, a.size) {
                tracing::warn!(error = %e, "freeing a released growable buffer's range failed");
                i += 1;
                continue;
            }
            let base = a.base;
            self.arenas[ai] = Arena::new(base, 0, ctx.page);
            self.zombies.swap_remove(i);
            self.free_arena_slots.push(ai);
        }
    }

    /// The cached pages of arena `ai` (a growable buffer of length `len`)
    /// past its end and past the first `keep` pages after it, farthest first.
    pub(crate) fn spare_pages_of(&self, ai: usize, len: u64, keep: u64) -> Vec<(usize, u64)> {
        let a = &self.arenas[ai];
        let first = extent_of(len).div_ceil(a.page) + keep;
        (first..a.pages.len() as u64)
            .rev()
            .filter(|&p| a.slot(p).is_cached())
            .map(|p| (ai, p))
            .collect()
    }

    /// Spare pages of every live growable buffer (farthest from each end
    /// first) and of the recycled ranges.
    fn spare_pages(&self) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        for g in self.growables.values() {
            if self.arenas[g.arena].cached_pages > 0 {
                out.extend(self.spare_pages_of(g.arena, g.len, 0));
            }
        }
        for &ai in &self.recycled {
            if self.arenas[ai].cached_pages > 0 {
                out.extend(self.spare_pages_of(ai, 0, 0));
            }
        }
        out
    }

    /// Before the pool grows: unmap the spare pages (pages mapped ahead
    /// included) whose work is known complete (no synchronisation, no
    /// retirement), up to `want`. Returns the pages gained.
    pub(super) fn reclaim_spare_done(
        &mut self,
        ctx: &Ctx<'_>,
        want: u64,
    ) -> Result<u64, AllocError> {
        if want == 0 || (self.growables.is_empty() && self.recycled.is_empty()) {
            return Ok(0);
        }
        let tick = self.tick;
        let mut chosen = Vec::new();
        for (ai, p) in self.spare_pages() {
            if chosen.len() as u64 >= want {
                break;
            }
            let s = self.arenas[ai].slot(p);
            if self.work_done(ctx, s.freed_by, s.freed_at, tick) {
                chosen.push((ai, p));
            }
        }
        let gained = self.move_cached(ctx, &chosen, false, false)?;
        self.serving.spare_pages_reclaimed += gained;
        Ok(gained)
    }

    /// When the pool cannot grow: move up to `want` spare pages of growable
    /// buffers to the pool before any ordinary cached page (unmapped, or
    /// retired when their work may still run). Returns the pages gained.
    pub(super) fn reclaim_spare_all(
        &mut self,
        ctx: &Ctx<'_>,
        want: u64,
    ) -> Result<u64, AllocError> {
        if want == 0 || (self.growables.is_empty() && self.recycled.is_empty()) {
            return Ok(0);
        }
        let mut chosen = self.spare_pages();
        chosen.truncate(want.min(usize::MAX as u64) as usize);
        let gained = self.move_cached(ctx, &chosen, false, false)?;
        self.serving.spare_pages_reclaimed += gained;
        Ok(gained)
    }
}
