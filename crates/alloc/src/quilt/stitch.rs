//! The stitching core: arenas, blocks, the cached-page queue, retired pages,
//! page hazards and frozen arenas, and the operations on them (allocate,
//! free, record-stream, forget-stream, empty-cache, out of memory, pages
//! for a feature's own arena). It knows no feature: growable buffers, tags
//! and exports own their state and call down into it. The algorithms live
//! beside it: `placement`, `backing` and `reclaim`.
//!
//! Everything here runs under the allocator's one lock.

use std::collections::VecDeque;

use rustc_hash::FxHashMap as HashMap;
use rustc_hash::FxHashSet;

use quilt_pool::{MemoryLimit, PageId, PagePool, PoolError};
use quilt_vmm::{DevicePtr, StreamId};

use super::arena::Arena;
use super::config::{ArenaSharing, QuiltConfig};
use super::streams::Streams;
use super::tiling::{Hazard, PieceId, Pruning};
use crate::api::{check_size, Allocation};
use crate::baselines::caching::config::{round_size, RoundupPower2Divisions};
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::stats::{AllocatorStats, Stat};

/// Size class of an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// Requests up to the small size.
    Small,
    /// Larger requests.
    Large,
    /// An arena of its own reservation, holding at most one block at
    /// offset 0 whose length a feature changes (a growable buffer's); its
    /// cached pages are spare pages, the first class reclaimed.
    Own,
    /// Blocks of one isolation group (a tag, by index), never sharing pages
    /// with blocks outside it.
    Isolated(u32),
    /// Blocks kept apart from the small and large ones (torch's private
    /// pools' segments), never sharing pages with them.
    Apart,
}

/// How a reclaim takes cached pages back to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reclaim {
    /// Pages cached at or before this tick, with no synchronisation: a page
    /// whose freeing work is known complete is unmapped; any other is
    /// retired (its handle moves on and carries that work as a hazard, its
    /// old mapping stays until the work is known complete).
    Move { cached_before: u64 },
    /// Every cached and retired page, unmapped after synchronising the
    /// streams whose work may still use it (`empty_cache`).
    Drain,
}

/// Whom free pages are for: it decides whether cached pages of other arenas
/// are moved before the pool grows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PagesFor {
    /// A block of an ordinary arena. The reclaim policy alone decides: under
    /// [`ReclaimPolicy::WhenFull`] cached pages stay mapped where they are,
    /// for the blocks that will land on them again.
    Block,
    /// Pages that no cached page can serve in place: a growable buffer's
    /// growth or a waking tag's pages. A page cached in an ordinary or
    /// tagged arena (never the asking buffer's own, nor a sleeping tag's,
    /// which holds none) whose
    /// work is known complete is moved before the pool grows: a
    /// `cuMemUnmap` instead of a `cuMemCreate` (26 us against 193 us in the
    /// cost model) and no memory added, where growth would leave that page
    /// idle until the device is full.
    Mapping,
}

/// What the algorithms need besides the state: the driver, the pool, the policy.
pub(crate) struct Ctx<'a> {
    pub(crate) vmm: &'a dyn quilt_vmm::Vmm,
    pub(crate) pool: &'a PagePool,
    pub(crate) cfg: &'a QuiltConfig,
    pub(crate) page: u64,
    pub(crate) arena_va: u64,
    pub(crate) name: &'a str,
}

/// One live block.
#[derive(Clone, Debug)]
pub(crate) struct BlockRec {
    pub(crate) arena: usize,
    pub(crate) off: u64,
    pub(crate) size: u64,
    pub(crate) requested: u64,
    /// The streams that use it: its own and those named by `record_stream` (bits).
    pub(crate) streams: u64,
    /// Its piece in the arena's tiling.
    pub(crate) piece: PieceId,
    /// The index of the stream it was allocated on.
    pub(crate) stream: u32,
}

/// A free held for the streams its block was recorded on (see `held.rs`):
/// the block, and the tick of its free.
#[derive(Clone, Debug)]
pub(crate) struct HeldFree {
    pub(crate) block: BlockRec,
    pub(crate) tick: u64,
}

/// A solo run (see `solo.rs`): the one stream allocating, whose frees
/// leave no hazard, since `since`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Solo {
    /// The stream's index (below 63: streams past it share one bit).
    pub(crate) stream: u32,
    /// The tick the run began at: its frees are later.
    pub(crate) since: u64,
}

/// The pool pages last mapped ahead of arena `arena`'s top, at tick `at`:
/// the byte range `start .. end` (see `backing.rs`; none by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MappedAhead {
    pub(crate) arena: usize,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) at: u64,
}

/// How many freed pointers are remembered to tell a double free from an unknown pointer.
const FREED_MEMORY: usize = 1 << 16;

/// The pointers freed last, at most [`FREED_MEMORY`] (a power of two): a
/// ring, each free writing one entry (the oldest, once full), in no order
/// that matters (it is only searched).
#[derive(Debug, Default)]
struct FreedRing {
    ptrs: Vec<DevicePtr>,
    /// The entry the next free overwrites, once full.
    next: usize,
}

impl FreedRing {
    fn push(&mut self, ptr: DevicePtr) {
        if self.ptrs.len() < FREED_MEMORY {
            self.ptrs.push(ptr);
        } else if let Some(slot) = self.ptrs.get_mut(self.next) {
            *slot = ptr;
            self.next = (self.next + 1) & (FREED_MEMORY - 1);
        }
    }

    fn contains(&self, ptr: &DevicePtr) -> bool {
        self.ptrs.contains(ptr)
    }
}

/// The allocator's state.
#[derive(Debug, Default)]
pub(crate) struct Core {
    pub(crate) arenas: Vec<Arena>,
    /// The stream of each arena (`None`: shared by every stream) and its class.
    pub(crate) arena_meta: Vec<(Option<StreamId>, Kind)>,
    arena_index: HashMap<(Option<StreamId>, Kind), usize>,
    /// The shared small and large arenas (`arena_index`'s entries for
    /// `(None, Small)` and `(None, Large)`), found without hashing.
    shared_arenas: [Option<usize>; 2],
    pub(crate) streams: Streams,
    pub(crate) blocks: HashMap<DevicePtr, BlockRec>,
    /// The last [`FREED_MEMORY`] pointers freed, in a ring (read only on
    /// the error path, to tell a double free from an unknown pointer).
    freed_recent: FreedRing,
    /// Pages that became cached, oldest first, as (arena, page, tick it became
    /// cached); an entry whose page has since been touched or unmapped (its
    /// `cached_at` differs) is stale and skipped.
    pub(crate) reclaim_queue: VecDeque<(usize, u64, u64)>,
    /// Whether the reclaim queue is kept: from the first reclaim on (built
    /// then from the page tables). Until then no operation pays for it.
    pub(crate) reclaim_queue_kept: bool,
    /// Retired virtual pages, in the order they were retired, as (arena,
    /// page, the pool page that was mapped there); an entry whose page is no
    /// longer retired is stale and skipped.
    pub(crate) retired_queue: VecDeque<(usize, u64, PageId)>,
    /// Free pool pages whose last virtual page was retired: the streams
    /// (bits) whose work may still use them and the tick of that work. The
    /// next block they back first orders its stream after that work.
    pub(crate) page_hazards: HashMap<PageId, (u64, u64)>,
    /// One tick per allocator operation.
    pub(crate) tick: u64,
    /// The stream that made the allocations since the tick given, alone
    /// (see `solo.rs`).
    pub(crate) alloc_run: (u32, u64),
    /// The solo run, if one stream allocates alone (see `solo.rs`).
    pub(crate) solo: Option<Solo>,
    /// The pages mapped ahead of an arena's top (see `backing.rs`).
    pub(crate) mapped_ahead: MappedAhead,
    pub(crate) stats: AllocatorStats,
    /// Arenas of their own (a growable buffer's) released while they still
    /// hold mappings (retired pages whose work may still run): their
    /// reservation is freed once the last is unmapped.
    pub(crate) zombies: Vec<usize>,
    /// Dead arenas (size 0, reservation freed), reused by the next arena of
    /// its own.
    pub(crate) free_arena_slots: Vec<usize>,
    /// Frozen arenas (their memory is away: a sleeping tag's), with the
    /// name of what froze them: their blocks may not be recorded or resized
    /// until they thaw; a free waits for the thaw (`freed_asleep`).
    pub(crate) frozen: HashMap<usize, String>,
    /// Blocks of frozen arenas that were freed while their tag slept: they
    /// are freed when it wakes ([`Core::free_thawed`]).
    pub(crate) freed_asleep: FxHashSet<DevicePtr>,
    /// Freed blocks recorded on other streams whose work was not known
    /// complete at the free: held, still occupied, until it is (see
    /// `held.rs`).
    pub(crate) held: HashMap<DevicePtr, HeldFree>,
    /// Cached pages of `Kind::Own` arenas (growable buffers' spare pages)
    /// reclaimed for other use: the first class of cached pages reclaimed.
    pub(crate) spare_pages_reclaimed: u64,
    /// The pool could not grow at its last try (see `pressure.rs`).
    pub(crate) under_pressure: bool,
    /// The report of the last request that ran out of memory
    /// ([`crate::DeviceAllocator::last_oom`]).
    pub(crate) last_oom: Option<OomReport>,
    /// Each arena's touched pages and holes, summed, behind the
    /// inactive-split statistics.
    arena_figures: ArenaFigures,
    /// PyTorch's `roundup_power2_divisions` applied to every request
    /// ([`round_size`]; off: rounded to blocks only).
    pub(crate) roundup: RoundupPower2Divisions,
}

/// Each arena's figures behind the inactive-split statistics (touched
/// pages; holes: gaps less one) as last looked at, and their sums: an
/// operation that changed one arena updates the sums from that arena
/// alone rather than summing over every arena.
#[derive(Debug, Default)]
struct ArenaFigures {
    each: Vec<(u64, u64)>,
    total: (u64, u64),
}

impl ArenaFigures {
    fn of(a: &Arena) -> (u64, u64) {
        (
            a.touched_pages,
            (a.tiling.gap_count() as u64).saturating_sub(1),
        )
    }

    /// Look at every arena again. (Out of line: an operation that changed
    /// one arena looks at that one alone.)
    #[inline(never)]
    fn sync_all(&mut self, arenas: &[Arena]) {
        self.each.clear();
        self.each.extend(arenas.iter().map(ArenaFigures::of));
        self.total = self
            .each
            .iter()
            .fold((0, 0), |(t, h), &(at, ah)| (t + at, h + ah));
    }

    /// Look at arena `ai` again, the others being as last looked at.
    fn sync_one(&mut self, arenas: &[Arena], ai: usize) {
        let (Some(a), Some(old)) = (arenas.get(ai), self.each.get_mut(ai)) else {
            return self.sync_all(arenas);
        };
        let new = ArenaFigures::of(a);
        self.total.0 = self.total.0 - old.0 + new.0;
        self.total.1 = self.total.1 - old.1 + new.1;
        *old = new;
    }
}

/// Move `stat` to `value` (a decrease by 0 where it is there already:
/// nothing changes).
fn set_stat(stat: &mut Stat, value: u64) {
    if value > stat.current {
        stat.increase(value - stat.current);
    } else {
        stat.decrease(stat.current - value);
    }
}

impl Core {
    /// Cached pages in every arena (mapped, touched by no block): all of them
    /// can be reclaimed, each being one handle mapped alone.
    pub(crate) fn cached_pages(&self) -> u64 {
        self.arenas.iter().map(|a| a.cached_pages).sum()
    }

    /// Register `stream`, returning its index. When a second stream appears,
    /// every page freed on so far becomes, over its part in a gap, a hazard
    /// of the first stream's work at the page's latest free (it was freed
    /// without a hazard, since no other stream could reuse it then);
    /// pristine space does not ([`Arena::add_hazards_from_pages`]).
    pub(super) fn stream_index(&mut self, stream: StreamId) -> u32 {
        let (i, new) = self.streams.index(stream);
        if new && self.streams.len() == 2 {
            let bit = Streams::bit(0);
            let mark = self.streams.last_mark(bit);
            for a in &mut self.arenas {
                a.add_hazards_from_pages(bit, 0, mark);
            }
        }
        i
    }

    fn arena_for(
        &mut self,
        ctx: &Ctx<'_>,
        stream: StreamId,
        kind: Kind,
    ) -> Result<usize, AllocError> {
        let owner = match ctx.cfg.layout.sharing {
            ArenaSharing::Shared => None,
            ArenaSharing::PerStream => Some(stream),
        };
        let shared_slot = match (owner, kind) {
            (None, Kind::Small) => Some(0),
            (None, Kind::Large) => Some(1),
            _ => None,
        };
        if let Some(i) = shared_slot.and_then(|s| self.shared_arenas[s]) {
            return Ok(i);
        }
        if let Some(&i) = self.arena_index.get(&(owner, kind)) {
            return Ok(i);
        }
        let base = ctx.vmm.reserve(ctx.arena_va, 0).map_err(|e| {
            if e.is_address_space_exhausted() {
                AllocError::AddressSpaceExhausted {
                    requested: ctx.arena_va,
                    reservations: self.arenas.iter().filter(|a| a.size > 0).count(),
                    source: e,
                }
            } else {
                e.into()
            }
        })?;
        let i = self.arenas.len();
        self.arenas.push(Arena::new(base, ctx.arena_va, ctx.page));
        self.arena_meta.push((owner, kind));
        self.arena_index.insert((owner, kind), i);
        if let Some(s) = shared_slot {
            self.shared_arenas[s] = Some(i);
        }
        Ok(i)
    }

    /// An error when arena `ai` is frozen (nothing to look up while none
    /// is: the free path pays nothing for it).
    pub(crate) fn check_not_frozen(&self, ai: usize) -> Result<(), AllocError> {
        if self.frozen.is_empty() {
            return Ok(());
        }
        match self.frozen.get(&ai) {
            None => Ok(()),
            Some(tag) => Err(AllocError::TagState {
                tag: tag.clone(),
                reason: "the tag is asleep: wake it first",
            }),
        }
    }

    /// Freeze arena `ai` (its memory goes away), naming what froze it.
    pub(crate) fn freeze(&mut self, ai: usize, by: &str) {
        self.frozen.insert(ai, by.to_string());
    }

    /// Thaw arena `ai`.
    pub(crate) fn thaw(&mut self, ai: usize) {
        self.frozen.remove(&ai);
    }

    /// The arenas of isolation group `group` (one per stream with per-stream
    /// arenas).
    pub(crate) fn group_arenas(&self, group: u32) -> impl Iterator<Item = usize> + '_ {
        (0..self.arenas.len()).filter(move |&ai| self.arena_meta[ai].1 == Kind::Isolated(group))
    }

    /// A new arena of its own reservation of `size` bytes (whole pages), in
    /// a dead arena's slot if there is one.
    pub(crate) fn own_arena(&mut self, ctx: &Ctx<'_>, size: u64) -> Result<usize, AllocError> {
        let base = ctx.vmm.reserve(size, 0)?;
        let arena = Arena::new(base, size, ctx.page);
        Ok(match self.free_arena_slots.pop() {
            Some(ai) => {
                self.arenas[ai] = arena;
                self.arena_meta[ai] = (None, Kind::Own);
                ai
            }
            None => {
                self.arenas.push(arena);
                self.arena_meta.push((None, Kind::Own));
                self.arenas.len() - 1
            }
        })
    }

    /// Release arena `ai` of its own: its cached pages go back to the pool
    /// (unmapped when their work is known complete, retired otherwise); its
    /// reservation is freed once nothing is mapped in it (a zombie until
    /// then).
    pub(crate) fn release_own_arena(&mut self, ctx: &Ctx<'_>, ai: usize) -> Result<(), AllocError> {
        let mapped: Vec<(usize, u64)> = (0..self.arenas[ai].pages.len() as u64)
            .filter(|&p| self.arenas[ai].slot(p).is_cached())
            .map(|p| (ai, p))
            .collect();
        self.zombies.push(ai);
        let moved = self.move_cached(ctx, &mapped, false, false);
        self.free_empty_zombies(ctx);
        moved.map(|_| ())
    }

    /// Free the reservation of every zombie arena that no longer holds a
    /// mapping; its slot is reused by the next arena of its own.
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
                tracing::warn!(error = %e, "freeing a released arena's range failed");
                i += 1;
                continue;
            }
            let base = a.base;
            self.arenas[ai] = Arena::new(base, 0, ctx.page);
            self.zombies.swap_remove(i);
            self.free_arena_slots.push(ai);
        }
    }

    /// Refresh the statistics derived from the pool, the arenas and the
    /// streams: after anything that may have grown or trimmed the pool.
    pub(crate) fn sync_stats(&mut self, ctx: &Ctx<'_>) {
        let ps = ctx.pool.stats();
        set_stat(&mut self.stats.reserved_bytes, ps.held_bytes);
        set_stat(&mut self.stats.segment, ps.total_pages);
        self.sync_arena_stats(ctx);
    }

    /// Refresh the statistics derived from the arenas and the streams (the
    /// pool's change only where the pool grows or is trimmed), every arena
    /// looked at again.
    pub(super) fn sync_arena_stats(&mut self, ctx: &Ctx<'_>) {
        self.arena_figures.sync_all(&self.arenas);
        self.publish_arena_stats(ctx);
    }

    /// [`Core::sync_arena_stats`] after an operation that changed arena
    /// `ai` alone (an allocation served from its mapped pages, a free):
    /// only that arena is looked at again.
    fn sync_one_arena_stats(&mut self, ctx: &Ctx<'_>, ai: usize) {
        self.arena_figures.sync_one(&self.arenas, ai);
        self.publish_arena_stats(ctx);
    }

    fn publish_arena_stats(&mut self, ctx: &Ctx<'_>) {
        let (touched, holes) = self.arena_figures.total;
        let split = (touched * ctx.page).saturating_sub(self.stats.active_bytes.current);
        set_stat(&mut self.stats.inactive_split_bytes, split);
        set_stat(&mut self.stats.inactive_split, holes);
        self.stats.num_stream_waits = self.streams.waits;
    }

    pub(super) fn remember_freed(&mut self, ptr: DevicePtr) {
        self.freed_recent.push(ptr);
    }

    /// The error for a free of `ptr`, which is no live block: a double free
    /// if it is among the pointers freed last, else an unknown pointer (a
    /// scan, on the error path only).
    #[cold]
    #[inline(never)]
    fn not_live(&self, ptr: DevicePtr) -> AllocError {
        if self.freed_recent.contains(&ptr) {
            AllocError::DoubleFree { ptr }
        } else {
            AllocError::UnknownPointer { ptr }
        }
    }

    /// A block over `off .. off + len` of arena `ai` is gone (with
    /// `freed`, freed now by those streams; see
    /// [`Arena::untouch`](super::arena::Arena::untouch)): the pages that
    /// become cached join the reclaim queue, where it is kept.
    pub(crate) fn untouch(&mut self, ai: usize, off: u64, len: u64, freed: Option<u64>) {
        let tick = self.tick;
        let kept = self.reclaim_queue_kept;
        let queue = &mut self.reclaim_queue;
        self.arenas[ai].untouch(off, len, freed, tick, |pages| {
            if kept {
                queue.extend(pages.map(|p| (ai, p, tick)));
            }
        });
    }

    /// Take block `piece` off `off .. off + len` of arena `ai` again (a
    /// failed allocation): its pages lose the touch, nothing is remembered as
    /// freed; the range gets back the hazards it had, as one (`hazard`: the
    /// streams and latest tick of those dropped when it was occupied; none
    /// when `hazard.0` is 0).
    fn undo_occupy(&mut self, ai: usize, piece: PieceId, off: u64, len: u64, hazard: (u64, u64)) {
        self.untouch(ai, off, len, None);
        self.arenas[ai].vacate_block(piece);
        let (streams, tick) = hazard;
        self.arenas[ai]
            .tiling
            .add_hazard(piece, Hazard::over(off, len, streams, tick));
    }

    /// Allocate `size` bytes on `stream`.
    pub(crate) fn allocate(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        self.allocate_in(ctx, size, stream, None)
    }

    /// Allocate `size` bytes on `stream`; with an arena kind
    /// ([`Kind::Isolated`], [`Kind::Apart`]), in an arena of that kind, so
    /// that its pages are never shared with blocks of other kinds (a frozen
    /// group arena refuses); without, in the small or large arena by size.
    pub(crate) fn allocate_in(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        stream: StreamId,
        kind: Option<Kind>,
    ) -> Result<Allocation, AllocError> {
        if self.held.is_empty() {
            return self.allocate_once(ctx, size, stream, kind);
        }
        self.allocate_releasing_held(ctx, size, stream, kind)
    }

    /// [`Core::allocate_in`]'s one try.
    pub(super) fn allocate_once(
        &mut self,
        ctx: &Ctx<'_>,
        size: u64,
        stream: StreamId,
        kind: Option<Kind>,
    ) -> Result<Allocation, AllocError> {
        check_size(size)?;
        let rounded = round_size(size, &self.roundup);
        self.tick += 1;
        let si = self.stream_index(stream);
        self.note_allocating(si);
        let kind = match kind {
            Some(k) => k,
            None if ctx.cfg.layout.small.is_small(size) => Kind::Small,
            None => Kind::Large,
        };
        // More whole pages than the limit (no division: `rounded` past the
        // limit's bytes), or more than an arena.
        let limit_bytes = ctx.pool.limit_pages().saturating_mul(ctx.page);
        if rounded > limit_bytes || rounded > ctx.arena_va {
            return Err(self.oom(ctx, size, rounded.div_ceil(ctx.page), 0));
        }
        let ai = self.arena_for(ctx, stream, kind)?;
        self.check_not_frozen(ai)?;
        let Some(placed) = self.place(ctx, ai, kind, size, rounded, si) else {
            return Err(self.oom(ctx, size, rounded.div_ceil(ctx.page), 0));
        };
        let (off, gap) = (placed.off, placed.gap);
        // A single stream has no hazards.
        let (piece, hazard) = if self.streams.len() > 1 {
            self.take_hazards_under(ctx, ai, (off, gap), rounded, placed.wait_free, si)?
        } else {
            let Some(piece) = self.arenas[ai].occupy_gap(gap, off, rounded) else {
                return Err(outside_its_gap(off, rounded));
            };
            (piece, (0, 0))
        };
        let unmapped = self.arenas[ai].touch(off, rounded);
        if unmapped > 0 {
            self.back_block(ctx, (ai, piece, off, rounded), size, hazard, si)?;
        }
        let ptr = self.arenas[ai].base + off;
        self.blocks.insert(
            ptr,
            BlockRec {
                arena: ai,
                off,
                size: rounded,
                requested: size,
                streams: Streams::bit(si),
                piece,
                stream: si,
            },
        );
        self.stats.allocated_bytes.increase(rounded);
        self.stats.allocation.increase(1);
        self.stats.active_bytes.increase(rounded);
        self.stats.active.increase(1);
        self.stats.requested_bytes.increase(size);
        self.sync_one_arena_stats(ctx, ai);
        Ok(Allocation { ptr, size: rounded })
    }

    /// Order stream `si` after the hazards under a block placed at `off`
    /// in gap `gap` (`rounded` bytes; `wait_free`: placement found, this
    /// operation, that none needs a wait), then occupy the block, the gap
    /// forgetting its completed hazards in the same walk (see
    /// [`Tiling::occupy_pruning`](super::tiling::Tiling::occupy_pruning)). Returns the block's piece and the
    /// hazards it dropped, as one (see [`Core::undo_occupy`]); an error when
    /// the range is not inside the gap. A failed wait changes nothing else.
    /// (Out of line: a single stream has no hazards.)
    #[inline(never)]
    fn take_hazards_under(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (off, gap): (u64, PieceId),
        rounded: u64,
        wait_free: bool,
        si: u32,
    ) -> Result<(PieceId, (u64, u64)), AllocError> {
        if !wait_free {
            self.order_after_hazards(ctx, ai, (off, gap), rounded, si)?;
        }
        self.arenas[ai]
            .tiling
            .occupy_pruning(gap, off, rounded, completed_hazards(&self.streams))
            .ok_or_else(|| outside_its_gap(off, rounded))
    }

    /// Back the pages of block `piece` over `off .. off + rounded` of arena
    /// `ai` (`size` bytes asked for, on stream index `si`) that are not
    /// mapped; out of memory takes the block off again, its range getting
    /// back `hazard`. (Out of line: once the pages are mapped, an
    /// allocation finds them so.)
    #[inline(never)]
    fn back_block(
        &mut self,
        ctx: &Ctx<'_>,
        (ai, piece, off, rounded): (usize, PieceId, u64, u64),
        size: u64,
        hazard: (u64, u64),
        si: u32,
    ) -> Result<(), AllocError> {
        let (first, last) = self.arenas[ai].page_span(off, rounded);
        let need = self.arenas[ai].unmapped_in(first, last);
        let backed = self.back_pages(ctx, ai, size, &need, (si, Some(piece)));
        if backed.is_err() {
            self.undo_occupy(ai, piece, off, rounded, hazard);
        }
        self.sync_stats(ctx);
        backed
    }

    /// Free the block at `ptr`: no driver call but, under
    /// [`EventTiming::AtFree`](super::config::EventTiming) once several
    /// streams exist, an event on each of the block's streams
    /// (`Streams::note_free`: asked whether it captures first). A block freed while its
    /// stream captures a CUDA graph is reused in the capture by that stream
    /// only (in stream order, as the graph orders it); another stream finds
    /// its range under a hazard of the capturing stream and places nothing
    /// there until the capture ends (see `placement.rs`).
    pub(crate) fn free(&mut self, ctx: &Ctx<'_>, ptr: DevicePtr) -> Result<(), AllocError> {
        if !self.frozen.is_empty() {
            // Only while something is frozen: the free path pays nothing else.
            if let Some(b) = self.blocks.get(&ptr) {
                if self.frozen.contains_key(&b.arena) {
                    // A sleeping tag's block: its memory is away, so it is
                    // freed when the tag wakes (once: a second free is a
                    // double free).
                    if !self.freed_asleep.insert(ptr) {
                        return Err(AllocError::DoubleFree { ptr });
                    }
                    return Ok(());
                }
            }
        }
        self.free_now(ctx, ptr)
    }

    /// Free the blocks of `arenas`, just thawed, that were freed while they
    /// were frozen.
    pub(crate) fn free_thawed(
        &mut self,
        ctx: &Ctx<'_>,
        arenas: &[usize],
    ) -> Result<(), AllocError> {
        if self.freed_asleep.is_empty() {
            return Ok(());
        }
        let mut due: Vec<DevicePtr> = self
            .freed_asleep
            .iter()
            .copied()
            .filter(|p| {
                self.blocks
                    .get(p)
                    .is_some_and(|b| arenas.contains(&b.arena))
            })
            .collect();
        due.sort_unstable();
        for ptr in due {
            self.freed_asleep.remove(&ptr);
            self.free_now(ctx, ptr)?;
        }
        Ok(())
    }

    /// Forget `stream`: its owner is destroying it (see
    /// [`crate::quilt::QuiltAllocator::forget_stream`]).
    pub(crate) fn forget_stream(
        &mut self,
        ctx: &Ctx<'_>,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if stream == StreamId::DEFAULT {
            return Err(AllocError::StreamBusy {
                stream: stream.0,
                reason: "the default stream cannot be forgotten",
            });
        }
        self.tick += 1;
        if let Some(i) = self.streams.find(stream) {
            if self.streams.capturing(ctx.vmm, i, self.tick) {
                return Err(AllocError::StreamBusy {
                    stream: stream.0,
                    reason: "it is capturing a CUDA graph: forget it after the capture ends",
                });
            }
            self.streams.forget(ctx.vmm, i, self.tick)?;
        }
        ctx.vmm.forget_stream(stream)?;
        self.sync_arena_stats(ctx);
        Ok(())
    }

    /// The free itself: the block's range becomes free memory (with a
    /// hazard of its streams' work where several streams exist).
    fn free_now(&mut self, ctx: &Ctx<'_>, ptr: DevicePtr) -> Result<(), AllocError> {
        let Some(b) = self.blocks.remove(&ptr) else {
            return Err(self.not_live(ptr));
        };
        self.tick += 1;
        let b = match self.hold_free(ctx, ptr, b) {
            Ok(()) => return Ok(()),
            Err(b) => b,
        };
        self.stats.allocated_bytes.decrease(b.size);
        self.stats.allocation.decrease(1);
        self.stats.requested_bytes.decrease(b.requested);
        self.remember_freed(ptr);
        self.vacate(ctx, b);
        Ok(())
    }

    /// Vacate the freed block `b` at this tick (its allocated statistics
    /// already lowered): its range becomes free memory, with a hazard of
    /// its streams' work where several streams exist.
    pub(super) fn vacate(&mut self, ctx: &Ctx<'_>, b: BlockRec) {
        self.vacate_at(ctx, b, self.tick);
    }

    /// [`Core::vacate`] of a block freed at tick `freed_at`, its streams
    /// told of the free then (a held free, see `held.rs`): the hazard it
    /// leaves covers their work up to that free, not to this tick.
    pub(super) fn vacate_at(&mut self, ctx: &Ctx<'_>, b: BlockRec, freed_at: u64) {
        let tick = freed_at;
        let track = self.streams.len() > 1 && !self.free_leaves_no_hazard(b.streams);
        let ai = b.arena;
        self.untouch(ai, b.off, b.size, Some(b.streams));
        if !track {
            self.arenas[ai].vacate_block(b.piece);
        }
        for s in self.streams.in_mask(b.streams) {
            if freed_at != self.tick {
                break; // told at the free
            }
            // With events at frees, a solo run's frees record theirs too
            // (not `track`): the hazards built from the pages when the run
            // ends carry these frees' ticks, and only an event recorded at
            // the free tells exactly when that work is complete.
            self.streams.note_free(ctx.vmm, s, tick, ctx.cfg.events);
        }
        // A hazard left behind reads what the streams know once they know
        // of the free: that range is vacated only then.
        if track {
            self.leave_hazard(&b, tick);
        }
        self.stats.active_bytes.decrease(b.size);
        self.stats.active.decrease(1);
        self.compact_reclaim_queue();
        self.sync_one_arena_stats(ctx, ai);
    }

    /// Vacate the freed block `b`, leaving a hazard of its streams' work up
    /// to `tick` over its range, and forget the completed hazards of the
    /// gap that holds it, in one walk (see [`Tiling::vacate_leaving`](super::tiling::Tiling::vacate_leaving)).
    /// (Out of line: a single stream, or a solo run's, leaves none.)
    #[inline(never)]
    fn leave_hazard(&mut self, b: &BlockRec, tick: u64) {
        // Its hazard, unless its streams are all known done (forgotten
        // ones), is pending: the gap's last pruning still holds with it.
        let streams = &self.streams;
        let fresh = (!streams.all_freed_done(b.streams, tick))
            .then(|| Hazard::over(b.off, b.size, b.streams, tick));
        self.arenas[b.arena].tiling.vacate_leaving(
            b.piece,
            fresh,
            || streams.last_mark(b.streams),
            completed_hazards(streams),
        );
    }

    /// Note that the block at `ptr` is used on `stream` too: its free will
    /// wait for that stream's work as well.
    pub(crate) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let Some(b) = self.blocks.get(&ptr) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        self.check_not_frozen(b.arena)?;
        let si = self.stream_index(stream);
        if let Some(b) = self.blocks.get_mut(&ptr) {
            b.streams |= Streams::bit(si);
        }
        Ok(())
    }

    /// Release every cached and retired page (synchronising the streams
    /// whose work may still use them) and every free pool page.
    pub(crate) fn empty_cache(&mut self, ctx: &Ctx<'_>) -> Result<(), AllocError> {
        self.release_held_completing(ctx)?;
        self.tick += 1;
        let r = self
            .reclaim(ctx, u64::MAX, Reclaim::Drain)
            .and_then(|_| self.unmap_retired(ctx, true));
        if r.is_ok() {
            // Every retired page's work is done, so is every page hazard's.
            self.page_hazards.clear();
        }
        let t = ctx.pool.trim(0).map_err(pool_err);
        self.sync_stats(ctx);
        r?;
        t?;
        Ok(())
    }

    /// Change the pool's memory limit; below what the pool holds, first
    /// drain the cache (see [`crate::quilt::QuiltAllocator::set_memory_limit`]).
    /// Returns the limit in force, in bytes.
    pub(crate) fn set_memory_limit(
        &mut self,
        ctx: &Ctx<'_>,
        limit: MemoryLimit,
    ) -> Result<u64, AllocError> {
        let wanted = limit.resolve(ctx.pool.device_total()) / ctx.page;
        if wanted < ctx.pool.total_pages() {
            self.empty_cache(ctx)?;
        }
        let set = ctx.pool.set_limit(limit).map_err(pool_err);
        self.sync_stats(ctx);
        Ok(set? * ctx.page)
    }

    /// The out-of-memory error for a request of `size` bytes that needed `n` new pages.
    #[cold]
    pub(crate) fn oom(&mut self, ctx: &Ctx<'_>, size: u64, n: u64, growable: u64) -> AllocError {
        self.stats.num_ooms += 1;
        let page = ctx.page;
        let free = ctx.pool.free_pages();
        let cached = self.cached_pages();
        // What the pool could still grow by, whatever the caller knew (a
        // request refused before any growth was tried passes 0).
        let growable = ctx.pool.growable_pages().unwrap_or(growable);
        let usable = free + cached + growable;
        // The request as placed: rounded to blocks, then to whole pages.
        let needed = if check_size(size).is_ok() {
            round_size(size, &self.roundup)
                .div_ceil(page)
                .saturating_mul(page)
        } else {
            u64::MAX
        };
        let report = OomReport {
            allocator: ctx.name.to_string(),
            requested: size,
            needed,
            needed_unbacked: n.saturating_mul(page),
            capacity: ctx.pool.limit_pages() * page,
            reserved: ctx.pool.total_pages() * page,
            allocated: self.stats.allocated_bytes.current,
            device_free: growable * page,
            reclaimable: (free + cached) * page,
            largest_free_extent: usable * page,
            verdict: if usable < n {
                OomVerdict::Capacity
            } else {
                OomVerdict::Fragmentation
            },
        };
        tracing::debug!(%report, "quilt out of memory");
        self.last_oom = Some(report.clone());
        AllocError::OutOfMemory(Box::new(report))
    }
}

/// How an operation forgets the completed hazards of the gap it changes,
/// as `streams` know them now: a hazard whose streams' work, as far as
/// the memory they freed can depend on it, is all known complete
/// constrains nothing.
fn completed_hazards(streams: &Streams) -> Pruning<impl FnMut(&Hazard) -> bool + '_> {
    Pruning {
        progress: streams.progress,
        completed: |h: &Hazard| streams.all_freed_done(h.streams, h.tick),
    }
}

/// The error for a placement at `off` (`len` bytes) outside its gap.
#[cold]
#[inline(never)]
fn outside_its_gap(off: u64, len: u64) -> AllocError {
    AllocError::Internal(format!(
        "placement chose {off:#x} (+{len:#x}) outside its gap"
    ))
}

/// A pool error as an allocator error.
pub(crate) fn pool_err(e: PoolError) -> AllocError {
    match e {
        PoolError::Driver(v) => AllocError::Driver(v),
        PoolError::Poisoned => AllocError::Poisoned,
        e @ PoolError::InvalidPageSize { .. } => AllocError::InvalidConfig {
            reason: e.to_string(),
        },
        other => AllocError::Pool(Box::new(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_freed_ring_keeps_the_last_pointers_freed() {
        let mut ring = FreedRing::default();
        let n = FREED_MEMORY as u64;
        for p in 0..n + 3 {
            ring.push(p * 512);
        }
        assert_eq!(ring.ptrs.len(), FREED_MEMORY);
        for p in 0..3 {
            assert!(!ring.contains(&(p * 512)), "pointer {p} is past the memory");
        }
        for p in 3..n + 3 {
            assert!(ring.contains(&(p * 512)), "pointer {p} is among the last");
        }
    }
}
