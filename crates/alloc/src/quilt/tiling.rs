//! The tiling of an arena: its pieces (blocks and gaps) in address order,
//! and its gaps indexed by size for best fit.
//!
//! Pure bookkeeping. Offsets are relative to the arena's base. The pieces
//! are a doubly linked list over a slab (a piece keeps its slot, its
//! [`PieceId`], for as long as it lives), so a block's neighbours are found
//! without a search: occupying part of a gap and vacating a block each change
//! at most three pieces and make at most three changes to the size index,
//! however many pieces the arena holds. Callers find a block's piece through
//! their own record of it (the allocator keeps it with the block), a gap's
//! through the size index.
//!
//! Each gap keeps its own [`Hazard`]s: freed byte ranges inside it whose
//! streams' work may still use them (a short list in address order, kept
//! with the gap's slot: no search). Occupying part of a gap hands the
//! hazards before and after the block to the gaps left beside it and drops
//! those under the block (the caller orders the block's stream after them
//! first, see [`Tiling::hazards_over`]); vacating a block joins the lists of
//! the gaps it coalesces with. Lists move rather than copy, and a list
//! emptied (a block's, a joined neighbour's, one whose hazards were all
//! forgotten) is kept as a spare for the next gap that receives hazards, so
//! hazards moving from gap to gap allocate nothing once the spares suffice.
//!
//! Invariants ([`Tiling::check`]): the pieces cover `0 .. size` exactly, in
//! order, none empty; no two gaps are adjacent (a vacated block coalesces
//! with the gaps beside it); the size index holds every gap, and only gaps,
//! as `(length, start) -> piece`; the block count counts the blocks; a gap's
//! hazards are non-empty, disjoint, in address order and inside the gap; a
//! block has none.

use super::gap_index::GapIndex;

/// A piece of a tiling (its slot), stable while the piece lives.
pub(crate) type PieceId = u32;

/// No piece (the end of the list).
const NIL: PieceId = PieceId::MAX;

/// A freed byte range whose streams' work may still read or write it: a new
/// block over it on another stream must wait for that work first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hazard {
    /// Start of the range.
    pub(crate) start: u64,
    /// End of the range (exclusive).
    pub(crate) end: u64,
    /// The streams that used it (bits, see `Streams::bit`).
    pub(crate) streams: u64,
    /// The allocator tick of the free.
    pub(crate) tick: u64,
}

impl Hazard {
    /// The hazard of `streams`' work up to `tick` over `start .. start + len`.
    pub(crate) fn over(start: u64, len: u64, streams: u64, tick: u64) -> Hazard {
        Hazard {
            start,
            end: start + len,
            streams,
            tick,
        }
    }
}

/// How an operation forgets the completed hazards of the gap it changes:
/// unless the gap's list was pruned at `progress` already (what is known
/// complete has not changed since: every hazard it kept is still pending),
/// the hazards for which `completed` is true are dropped, and the list is
/// pruned at `progress`.
pub(crate) struct Pruning<C> {
    /// What is known complete now (`Streams::progress`): a list pruned at
    /// this progress holds no completed hazard.
    pub(crate) progress: u64,
    /// Whether a hazard's work is known complete.
    pub(crate) completed: C,
}

/// One piece: a block or a gap.
#[derive(Clone, Copy, Debug)]
struct Piece {
    start: u64,
    end: u64,
    prev: PieceId,
    next: PieceId,
    /// A gap (free) rather than a block.
    free: bool,
    /// The slot holds a piece of the tiling (not a vacant slot).
    live: bool,
}

/// A slot of a tiling: a piece (or a vacant slot) and its hazards.
#[derive(Debug)]
#[repr(align(64))]
struct Slot {
    piece: Piece,
    /// The hazards of the gap in address order (empty for a block or a
    /// vacant slot).
    hazards: Vec<Hazard>,
    /// The progress (`Streams::progress`) at which the gap's hazards were
    /// last all checked and the completed ones dropped ([`NEVER`] when some
    /// were not).
    pruned: u64,
}

/// The pieces of one arena. See the module documentation.
#[derive(Debug, Default)]
pub(crate) struct Tiling {
    /// Each slot's piece with its hazards and pruning, one cache line a
    /// slot: an operation on a piece and its neighbours touches their
    /// lines alone.
    slots: Vec<Slot>,
    /// Slots of `pieces` not in use, reused first.
    vacant: Vec<PieceId>,
    head: PieceId,
    tail: PieceId,
    /// Every gap as `(length, start) -> piece`: best fit is the first entry
    /// at or past `(len, 0)` (smallest gap, lowest address among equals).
    by_size: GapIndex<PieceId>,
    blocks: usize,
    /// Emptied hazard lists kept for reuse (at most [`SPARE_LISTS`]):
    /// hazards move from gap to gap as blocks come and go, and a gap that
    /// receives some takes a spare list rather than allocating one, while a
    /// block gives its list back. Without them a churn on several streams
    /// allocates a list at most operations.
    spare_lists: Vec<Vec<Hazard>>,
    /// Hazard lists allocated because no spare was left (for tests).
    lists_allocated: u64,
}

/// Most emptied hazard lists kept for reuse.
const SPARE_LISTS: usize = 1024;

/// A hazard list not pruned at any progress (see `Tiling::pruned`).
const NEVER: u64 = u64::MAX;

impl Tiling {
    /// One gap over `0 .. size` (nothing for a size of 0).
    pub(crate) fn new(size: u64) -> Tiling {
        let mut t = Tiling {
            head: NIL,
            tail: NIL,
            ..Tiling::default()
        };
        if size > 0 {
            let id = t.new_piece(0, size, true);
            t.head = id;
            t.tail = id;
            t.by_size.insert((size, 0), id);
        }
        t
    }

    fn new_piece(&mut self, start: u64, end: u64, free: bool) -> PieceId {
        let p = Piece {
            start,
            end,
            prev: NIL,
            next: NIL,
            free,
            live: true,
        };
        match self.vacant.pop() {
            Some(id) => {
                let slot = &mut self.slots[id as usize];
                slot.piece = p;
                slot.pruned = NEVER;
                id
            }
            None => {
                self.slots.push(Slot {
                    piece: p,
                    hazards: Vec::new(),
                    pruned: NEVER,
                });
                (self.slots.len() - 1) as PieceId
            }
        }
    }

    fn get(&self, id: PieceId) -> Option<&Piece> {
        self.slots
            .get(id as usize)
            .map(|s| &s.piece)
            .filter(|p| p.live)
    }

    /// Link the new piece `id` after `at` (`NIL`: at the head).
    fn link_after(&mut self, at: PieceId, id: PieceId) {
        let next = if at == NIL {
            self.head
        } else {
            self.slots[at as usize].piece.next
        };
        self.slots[id as usize].piece.prev = at;
        self.slots[id as usize].piece.next = next;
        if at == NIL {
            self.head = id;
        } else {
            self.slots[at as usize].piece.next = id;
        }
        if next == NIL {
            self.tail = id;
        } else {
            self.slots[next as usize].piece.prev = id;
        }
    }

    /// Unlink piece `id` and free its slot.
    fn remove_piece(&mut self, id: PieceId) {
        let Piece { prev, next, .. } = self.slots[id as usize].piece;
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].piece.next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].piece.prev = prev;
        }
        self.slots[id as usize].piece.live = false;
        self.vacant.push(id);
    }

    /// The hazard list of gap `id`, to be filled (taken out of its slot): a
    /// spare when the slot has no room of its own.
    fn list_to_fill(&mut self, id: PieceId) -> Vec<Hazard> {
        let list = std::mem::take(&mut self.slots[id as usize].hazards);
        if list.capacity() > 0 {
            return list;
        }
        self.spare_lists.pop().unwrap_or_else(|| {
            self.lists_allocated += 1;
            Vec::new()
        })
    }

    /// The hazards of `front` then those of `back`, in whichever of the two
    /// lists avoids a copy; the other, emptied, goes to the spares.
    fn joined(&mut self, mut front: Vec<Hazard>, mut back: Vec<Hazard>) -> Vec<Hazard> {
        if front.is_empty() {
            std::mem::swap(&mut front, &mut back);
        } else {
            front.append(&mut back);
        }
        self.spare(back);
        front
    }

    /// Keep the emptied list `list` for reuse (dropped beyond
    /// [`SPARE_LISTS`], or when it holds no room).
    fn spare(&mut self, mut list: Vec<Hazard>) {
        if list.capacity() > 0 && self.spare_lists.len() < SPARE_LISTS {
            list.clear();
            self.spare_lists.push(list);
        }
    }

    /// Gaps.
    pub(crate) fn gap_count(&self) -> usize {
        self.by_size.len()
    }

    /// Blocks.
    #[cfg(feature = "invariants")]
    pub(crate) fn block_count(&self) -> usize {
        self.blocks
    }

    /// Gaps of at least `len` bytes, best fit first (smallest, then lowest
    /// address), as (start, piece).
    pub(crate) fn fitting(&self, len: u64) -> impl Iterator<Item = (u64, u64, PieceId)> + '_ {
        self.by_size
            .from((len, 0))
            .map(|((l, start), id)| (l, start, id))
    }

    /// The best-fitting gap of at least `len` bytes, as (start, piece):
    /// the first of [`Tiling::fitting`].
    pub(crate) fn best_fit(&self, len: u64) -> Option<(u64, PieceId)> {
        self.by_size
            .first_from((len, 0))
            .map(|((_, start), id)| (start, id))
    }

    /// The range of gap `id`; `None` when `id` is no gap.
    pub(crate) fn gap(&self, id: PieceId) -> Option<(u64, u64)> {
        self.get(id).filter(|p| p.free).map(|p| (p.start, p.end))
    }

    /// The hazards of gap `id` overlapping `off .. off + len` (none for a
    /// block or no piece).
    pub(crate) fn hazards_over(
        &self,
        id: PieceId,
        off: u64,
        len: u64,
    ) -> impl Iterator<Item = &Hazard> + '_ {
        let end = off.saturating_add(len);
        self.gap_hazards(id)
            .iter()
            .skip_while(move |h| h.end <= off)
            .take_while(move |h| h.start < end)
    }

    /// The hazards of gap `id` over `off .. off + len` as one: the union of
    /// their streams and their latest tick (`(0, 0)` when there are none).
    pub(crate) fn hazard_union(&self, id: PieceId, off: u64, len: u64) -> (u64, u64) {
        self.hazards_over(id, off, len)
            .fold((0, 0), |(s, k), h| (s | h.streams, k.max(h.tick)))
    }

    /// The hazards of gap `id`.
    pub(crate) fn gap_hazards(&self, id: PieceId) -> &[Hazard] {
        self.slots
            .get(id as usize)
            .map_or(&[][..], |s| s.hazards.as_slice())
    }

    /// Every hazard, in address order.
    #[cfg(feature = "invariants")]
    pub(crate) fn all_hazards(&self) -> impl Iterator<Item = &Hazard> + '_ {
        let mut id = self.head;
        std::iter::from_fn(move || {
            let p = self.get(id)?;
            let list = &self.slots[id as usize].hazards;
            id = p.next;
            Some(list.iter())
        })
        .flatten()
    }

    /// Note the hazard `h` in gap `id`, in address order (nothing when `id`
    /// is no gap or `h` is empty; `h` must lie inside the gap, overlapping
    /// none of its hazards).
    pub(crate) fn add_hazard(&mut self, id: PieceId, h: Hazard) {
        if self.insert_hazard(id, h) {
            self.slots[id as usize].pruned = NEVER;
        }
    }

    /// [`Tiling::add_hazard`] for a hazard whose work is known not to be
    /// complete (a free's, noted at its own tick, the latest of any hazard):
    /// the gap's last pruning still holds. It joins the hazards right
    /// beside it that name the same streams at a tick past `mark()`, the
    /// joined hazard taking the latest tick: the caller vouches that no
    /// decision tells those ticks apart (no event of those streams was
    /// recorded since, see `Streams::last_mark`; asked only when such a
    /// neighbour exists). A stream whose progress nobody asks for (no other
    /// stream reaches for the memory it frees) thus leaves one hazard per
    /// run of its frees, not one per free. (A step that
    /// [`Tiling::vacate_leaving`] takes in its one walk: the tests check
    /// that against these steps.)
    #[cfg(test)]
    pub(crate) fn add_fresh_hazard(&mut self, id: PieceId, h: Hazard, mark: impl FnOnce() -> u64) {
        if h.start < h.end && !self.join_beside(id, h, mark) {
            self.insert_hazard(id, h);
        }
    }

    /// Join `h` (not empty) to the hazards of gap `id` right beside it that
    /// name the same streams at a tick past `mark()` (see
    /// [`Tiling::add_fresh_hazard`]); false when none does.
    #[cfg(test)]
    fn join_beside(&mut self, id: PieceId, h: Hazard, mark: impl FnOnce() -> u64) -> bool {
        let Some(list) = self.slots.get_mut(id as usize).map(|s| &mut s.hazards) else {
            return false;
        };
        let at = list.partition_point(|x| x.start < h.start);
        let left = at
            .checked_sub(1)
            .filter(|&i| list[i].end == h.start && list[i].streams == h.streams);
        let right = Some(at).filter(|&i| {
            list.get(i)
                .is_some_and(|x| x.start == h.end && x.streams == h.streams)
        });
        if left.is_none() && right.is_none() {
            return false;
        }
        let mark = mark();
        match (
            left.filter(|&i| list[i].tick > mark),
            right.filter(|&i| list[i].tick > mark),
        ) {
            (Some(l), Some(r)) => {
                let right = list.remove(r);
                let l = &mut list[l];
                l.end = right.end;
                l.tick = l.tick.max(right.tick).max(h.tick);
            }
            (Some(l), None) => {
                list[l].end = h.end;
                list[l].tick = list[l].tick.max(h.tick);
            }
            (None, Some(r)) => {
                list[r].start = h.start;
                list[r].tick = list[r].tick.max(h.tick);
            }
            (None, None) => return false,
        }
        true
    }

    /// Add the hazards `new` (in address order, disjoint, inside gap `id`,
    /// overlapping none of its hazards) to gap `id`, in one merge.
    pub(crate) fn add_hazards(&mut self, id: PieceId, new: Vec<Hazard>) {
        if new.is_empty() || self.gap(id).is_none() {
            return;
        }
        let old = self.list_to_fill(id);
        let mut list = Vec::with_capacity(old.len() + new.len());
        let mut new = new.into_iter().peekable();
        for &h in &old {
            while let Some(n) = new.next_if(|n| n.start < h.start) {
                list.push(n);
            }
            list.push(h);
        }
        list.extend(new);
        self.spare(old);
        self.slots[id as usize].hazards = list;
        self.slots[id as usize].pruned = NEVER;
    }

    /// Note the hazard `h` over the part of gap `id` it covers, whatever
    /// hazards lie there already: where it overlaps one, the two become one
    /// naming the streams of both at the later tick (asking no less of any
    /// stream than either did); elsewhere it is added as it is. Nothing
    /// when `id` is no gap or `h` misses it.
    pub(crate) fn add_hazard_over(&mut self, id: PieceId, h: Hazard) {
        let Some((start, end)) = self.gap(id) else {
            return;
        };
        let h = Hazard {
            start: h.start.max(start),
            end: h.end.min(end),
            ..h
        };
        if h.start >= h.end || h.streams == 0 {
            return;
        }
        let old = self.list_to_fill(id);
        let mut list = Vec::with_capacity(old.len() + 3);
        // The part of `h` from here on is not in `list` yet.
        let mut from = h.start;
        for &x in &old {
            if x.end <= h.start {
                list.push(x);
                continue;
            }
            if x.start >= h.end {
                if from < h.end {
                    list.push(Hazard { start: from, ..h });
                    from = h.end;
                }
                list.push(x);
                continue;
            }
            if from < x.start {
                list.push(Hazard {
                    start: from,
                    end: x.start,
                    ..h
                });
            }
            if x.streams | h.streams == x.streams && x.tick >= h.tick {
                // It asks all that `h` does: kept whole.
                from = x.end.min(h.end);
                list.push(x);
                continue;
            }
            if x.start < h.start {
                list.push(Hazard { end: h.start, ..x });
            }
            let both = Hazard {
                start: x.start.max(h.start),
                end: x.end.min(h.end),
                streams: x.streams | h.streams,
                tick: x.tick.max(h.tick),
            };
            from = both.end;
            list.push(both);
            if x.end > h.end {
                list.push(Hazard { start: h.end, ..x });
            }
        }
        if from < h.end {
            list.push(Hazard { start: from, ..h });
        }
        self.spare(old);
        self.slots[id as usize].hazards = list;
        self.slots[id as usize].pruned = NEVER;
    }

    /// The pieces right before and after piece `id` (`None` at the arena's
    /// ends, or when `id` is no piece).
    pub(crate) fn beside(&self, id: PieceId) -> [Option<PieceId>; 2] {
        let Some(p) = self.get(id) else {
            return [None, None];
        };
        let live = |n: PieceId| self.get(n).is_some().then_some(n);
        [live(p.prev), live(p.next)]
    }

    /// Insert `h` in gap `id`'s list; false (nothing done) when `id` is no
    /// gap or `h` is empty.
    fn insert_hazard(&mut self, id: PieceId, h: Hazard) -> bool {
        if h.start >= h.end || h.streams == 0 || self.gap(id).is_none() {
            return false;
        }
        let mut list = self.list_to_fill(id);
        let at = list.partition_point(|x| x.start < h.start);
        list.insert(at, h);
        self.slots[id as usize].hazards = list;
        true
    }

    /// Drop the hazards of gap `id` for which `completed` is true, unless
    /// the gap was pruned at `progress` already (what is known complete has
    /// not changed since: every hazard it kept is still pending). (A step
    /// that [`Tiling::occupy_pruning`] and [`Tiling::vacate_leaving`] take
    /// in their one walk: the tests check that against these steps.)
    #[cfg(test)]
    pub(crate) fn prune_hazards(
        &mut self,
        id: PieceId,
        progress: u64,
        mut completed: impl FnMut(&Hazard) -> bool,
    ) {
        let Some(&pruned) = self.slots.get(id as usize).map(|s| &s.pruned) else {
            return;
        };
        if pruned == progress {
            return;
        }
        self.slots[id as usize].pruned = progress;
        let list = &mut self.slots[id as usize].hazards;
        list.retain(|h| !completed(h));
        if list.is_empty() {
            let list = std::mem::take(list);
            self.spare(list);
        }
    }

    /// The gaps in address order, as (piece, start, end).
    pub(crate) fn gap_ids(&self) -> Vec<(PieceId, u64, u64)> {
        let mut out = Vec::new();
        let mut id = self.head;
        while let Some(&p) = self.get(id) {
            if p.free {
                out.push((id, p.start, p.end));
            }
            id = p.next;
        }
        out
    }

    /// The range of block `id`; `None` when `id` is no block.
    pub(crate) fn block(&self, id: PieceId) -> Option<(u64, u64)> {
        self.get(id).filter(|p| !p.free).map(|p| (p.start, p.end))
    }

    /// The gap at the highest address, as (start, end, piece).
    pub(crate) fn last_gap(&self) -> Option<(u64, u64, PieceId)> {
        let mut id = self.tail;
        while let Some(p) = self.get(id) {
            if p.free {
                return Some((p.start, p.end, id));
            }
            id = p.prev;
        }
        None
    }

    /// The piece holding offset `off`, walking from the lowest address:
    /// linear in the pieces before it, for callers without a record of the
    /// piece (a growable buffer's arena holds at most two).
    pub(crate) fn find(&self, off: u64) -> Option<PieceId> {
        let mut id = self.head;
        while let Some(p) = self.get(id) {
            if p.start <= off && off < p.end {
                return Some(id);
            }
            if p.start > off {
                return None;
            }
            id = p.next;
        }
        None
    }

    /// Occupy `off .. off + len` of gap `gap` with a block: the parts of the
    /// gap before and after it stay gaps, with the hazards over them (cut at
    /// the block); the hazards under the block are dropped. Returns the
    /// block's piece, or `None` (changing nothing) when `gap` is no gap,
    /// `len` is 0 or the range does not lie inside it.
    pub(crate) fn occupy(&mut self, gap: PieceId, off: u64, len: u64) -> Option<PieceId> {
        self.occupy_with(gap, off, len, None::<Pruning<fn(&Hazard) -> bool>>)
            .map(|(id, _)| id)
    }

    /// [`Tiling::occupy`] that first forgets the gap's completed hazards
    /// (see [`Pruning`]), in the same walk that
    /// cuts the others at the block. Returns the block's piece and the
    /// pending hazards it dropped, as one: the union of their streams and
    /// their latest tick (`(0, 0)` when none), as [`Tiling::hazard_union`]
    /// over the block's range once pruned would.
    pub(crate) fn occupy_pruning(
        &mut self,
        gap: PieceId,
        off: u64,
        len: u64,
        prune: Pruning<impl FnMut(&Hazard) -> bool>,
    ) -> Option<(PieceId, (u64, u64))> {
        self.occupy_with(gap, off, len, Some(prune))
    }

    #[inline]
    fn occupy_with<C: FnMut(&Hazard) -> bool>(
        &mut self,
        gap: PieceId,
        off: u64,
        len: u64,
        prune: Option<Pruning<C>>,
    ) -> Option<(PieceId, (u64, u64))> {
        let g = *self.get(gap).filter(|p| p.free)?;
        let end = off.checked_add(len)?;
        if len == 0 || off < g.start || end > g.end {
            return None;
        }
        // The block takes the gap's slot; what is left of the gap becomes
        // new pieces beside it, the first of them taking the gap's entry
        // in the size index.
        let b = &mut self.slots[gap as usize].piece;
        b.start = off;
        b.end = end;
        b.free = false;
        let mut old_key = Some((g.end - g.start, g.start));
        let (mut left, mut right) = (NIL, NIL);
        if off > g.start {
            left = self.new_piece(g.start, off, true);
            self.link_after(g.prev, left);
            self.index_gap(&mut old_key, (off - g.start, g.start), left);
        }
        if end < g.end {
            right = self.new_piece(end, g.end, true);
            self.link_after(gap, right);
            self.index_gap(&mut old_key, (g.end - end, end), right);
        }
        if let Some(key) = old_key {
            self.by_size.remove(&key);
        }
        let mut dropped = (0, 0);
        if !self.slots[gap as usize].hazards.is_empty() {
            dropped = self.split_hazards(gap, (left, right), (off, end), prune);
        } else {
            // A block holds no hazards: an empty list's room goes to the
            // spares rather than sit idle in the block's slot.
            let list = std::mem::take(&mut self.slots[gap as usize].hazards);
            self.spare(list);
        }
        self.blocks += 1;
        Some((gap, dropped))
    }

    /// Hand the hazards of the gap whose slot `block` now holds
    /// `off .. end` on to the gaps `left` and `right` beside it (`NIL`:
    /// none), cut at the block; drop those under it, returning them as one
    /// (see [`Tiling::occupy_pruning`]). With `prune`, unless the gap was
    /// pruned at its progress already, the completed ones are dropped
    /// first, in the same walk. The parts keep the gap's pruning (the one
    /// just made, if any) while some hazard is left. One walk: the list
    /// itself goes on to the gap after the block (else before it), cut and
    /// pruned in place; only the hazards before a block with a gap on
    /// either side are copied. (Out of line: with one stream no gap has
    /// hazards, and occupy's code stays short.)
    #[inline(never)]
    fn split_hazards<C: FnMut(&Hazard) -> bool>(
        &mut self,
        block: PieceId,
        (left, right): (PieceId, PieceId),
        (off, end): (u64, u64),
        prune: Option<Pruning<C>>,
    ) -> (u64, u64) {
        let slot = &mut self.slots[block as usize];
        let mut list = std::mem::take(&mut slot.hazards);
        let (progress, mut completed) = match prune {
            Some(p) if p.progress != slot.pruned => (p.progress, Some(p.completed)),
            Some(p) => (p.progress, None),
            None => (slot.pruned, None),
        };
        // Hazards before the block when the list itself goes after it.
        let mut before = Vec::new();
        let (mut kept, mut dropped, mut w) = (false, (0, 0), 0);
        for r in 0..list.len() {
            let h = list[r];
            if completed.as_mut().is_some_and(|c| c(&h)) {
                continue;
            }
            kept = true;
            if h.start < end && h.end > off {
                dropped = (dropped.0 | h.streams, u64::max(dropped.1, h.tick));
            }
            // A hazard before (after) the block lies in the gap, so the gap
            // left there exists.
            if h.start < off {
                let part = Hazard {
                    end: h.end.min(off),
                    ..h
                };
                if right == NIL {
                    list[w] = part;
                    w += 1;
                } else {
                    if before.capacity() == 0 {
                        before = self.list_to_fill(left);
                    }
                    before.push(part);
                }
            }
            if h.end > end {
                list[w] = Hazard {
                    start: h.start.max(end),
                    ..h
                };
                w += 1;
            }
        }
        list.truncate(w);
        let into = if right != NIL { right } else { left };
        if into != NIL && !list.is_empty() {
            let old = std::mem::replace(&mut self.slots[into as usize].hazards, list);
            self.spare(old);
        } else {
            // A block holds no hazards: its list goes back to the spares.
            self.spare(list);
        }
        if !before.is_empty() {
            self.slots[left as usize].hazards = before;
        }
        if kept {
            // Parts of a pruned list are pruned as it was.
            for side in [left, right] {
                if side != NIL {
                    self.slots[side as usize].pruned = progress;
                }
            }
        }
        dropped
    }

    /// Index gap `id` under `key`: in place of the entry `old` (taken,
    /// one move in the index instead of a remove and an insert) if there
    /// is one, else a new entry.
    fn index_gap(&mut self, old: &mut Option<(u64, u64)>, key: (u64, u64), id: PieceId) {
        match old.take() {
            Some(old) => self.by_size.rekey(&old, key, id),
            None => self.by_size.insert(key, id),
        }
    }

    /// Vacate block `id`: it becomes a gap, coalesced with the gaps beside
    /// it. Returns the block's range, or `None` (changing nothing) when `id`
    /// is no block.
    pub(crate) fn vacate(&mut self, id: PieceId) -> Option<(u64, u64)> {
        self.vacate_with(id, |t, prev, next| {
            let holds = |t: &Tiling, side: Option<PieceId>| {
                side.is_some_and(|s| !t.slots[s as usize].hazards.is_empty())
            };
            if holds(t, prev) || holds(t, next) {
                t.join_hazards(id, prev, next);
            } else {
                // None beside it (always so with one stream): the joined
                // gap holds none either.
                t.slots[id as usize].pruned = NEVER;
            }
        })
    }

    /// [`Tiling::vacate`] that leaves the hazard `fresh` over the block,
    /// if any, and forgets the completed hazards of the joined gap (see
    /// [`Pruning`]): the neighbours' lists are joined, the fresh hazard
    /// placed and the rest pruned in one walk. The fresh hazard's work is
    /// known not complete (a free's, noted at its own tick, the latest of
    /// any hazard): it keeps the gap's pruning. It joins the hazards right
    /// beside it that name the same streams at a tick past `mark()`, the
    /// joined hazard taking the latest tick: the caller vouches that no
    /// decision tells those ticks apart (no event of those streams was
    /// recorded since, see `Streams::last_mark`; asked only when such a
    /// neighbour exists). A stream whose progress nobody asks for (no other
    /// stream reaches for the memory it frees) thus leaves one hazard per
    /// run of its frees, not one per free.
    pub(crate) fn vacate_leaving(
        &mut self,
        id: PieceId,
        fresh: Option<Hazard>,
        mark: impl FnOnce() -> u64,
        prune: Pruning<impl FnMut(&Hazard) -> bool>,
    ) -> Option<(u64, u64)> {
        self.vacate_with(id, |t, prev, next| {
            t.join_leaving(id, (prev, next), fresh, mark, prune);
        })
    }

    /// Vacate block `id`, `join` giving it the hazards of the gaps before
    /// and after it (if gaps) before they are swallowed.
    #[inline]
    fn vacate_with(
        &mut self,
        id: PieceId,
        join: impl FnOnce(&mut Tiling, Option<PieceId>, Option<PieceId>),
    ) -> Option<(u64, u64)> {
        let b = *self.get(id).filter(|p| !p.free)?;
        let prev = Some(b.prev).filter(|&p| self.get(p).is_some_and(|p| p.free));
        let next = Some(b.next).filter(|&n| self.get(n).is_some_and(|n| n.free));
        join(self, prev, next);
        let (mut start, mut end) = (b.start, b.end);
        // The joined gap takes the size index entry of a gap it swallows.
        let mut old_key = None;
        if let Some(p) = prev.map(|p| self.slots[p as usize].piece) {
            old_key = Some((p.end - p.start, p.start));
            self.remove_piece(b.prev);
            start = p.start;
        }
        if let Some(n) = next.map(|n| self.slots[n as usize].piece) {
            let key = (n.end - n.start, n.start);
            match old_key {
                None => old_key = Some(key),
                Some(_) => {
                    self.by_size.remove(&key);
                }
            }
            self.remove_piece(b.next);
            end = n.end;
        }
        let g = &mut self.slots[id as usize].piece;
        g.start = start;
        g.end = end;
        g.free = true;
        self.index_gap(&mut old_key, (end - start, start), id);
        self.blocks -= 1;
        Some((b.start, b.end))
    }

    /// The pruning (see [`Pruning`]) that the lists of the
    /// gaps `prev` and `next` beside a block being vacated share: the
    /// progress at which every non-empty one was pruned, `NEVER` when they
    /// differ or none holds a hazard.
    fn joint_pruning(&self, prev: Option<PieceId>, next: Option<PieceId>) -> u64 {
        let mut pruned = None;
        for side in [prev, next].into_iter().flatten() {
            let s = &self.slots[side as usize];
            if !s.hazards.is_empty() {
                pruned = match pruned {
                    None => Some(s.pruned),
                    Some(p) if p == s.pruned => Some(p),
                    Some(_) => Some(NEVER),
                };
            }
        }
        pruned.unwrap_or(NEVER)
    }

    /// Give block `id`, being vacated, the hazards of the gaps `prev` and
    /// `next` beside it that it joins, in address order (the gap before's,
    /// the block's: none, the gap after's), pruned at a progress only if
    /// every non-empty part was pruned at that one. (Out of line: with one
    /// stream no gap has hazards, and vacate's code stays short.)
    #[inline(never)]
    fn join_hazards(&mut self, id: PieceId, prev: Option<PieceId>, next: Option<PieceId>) {
        let pruned = self.joint_pruning(prev, next);
        let mut list = std::mem::take(&mut self.slots[id as usize].hazards);
        for (side, before) in [(prev, true), (next, false)] {
            let Some(side) = side else { continue };
            let part = std::mem::take(&mut self.slots[side as usize].hazards);
            list = if before {
                self.joined(part, list)
            } else {
                self.joined(list, part)
            };
        }
        self.slots[id as usize].hazards = list;
        self.slots[id as usize].pruned = pruned;
    }

    /// [`Tiling::join_hazards`] with the fresh hazard of the block between
    /// the two lists, joined with its neighbours, then the completed
    /// hazards forgotten (see [`Tiling::vacate_leaving`]). The list before
    /// the block (else the one after it) takes the rest. (Out of line: a
    /// free on several streams.)
    #[inline(never)]
    fn join_leaving<C: FnMut(&Hazard) -> bool>(
        &mut self,
        id: PieceId,
        (prev, next): (Option<PieceId>, Option<PieceId>),
        fresh: Option<Hazard>,
        mark: impl FnOnce() -> u64,
        mut prune: Pruning<C>,
    ) {
        let pruned = self.joint_pruning(prev, next);
        let mut take = |side: Option<PieceId>| {
            side.map_or_else(Vec::new, |s| {
                std::mem::take(&mut self.slots[s as usize].hazards)
            })
        };
        let (mut front, mut back) = (take(prev), take(next));
        // The fresh hazard, joined with the hazards right beside it (the
        // last before the block, the first after it); joined with the one
        // after, it takes that one's place.
        let mut mid = fresh.filter(|h| h.start < h.end && h.streams != 0);
        if let Some(mut h) = mid {
            let beside = |x: Option<&Hazard>, at: fn(&Hazard) -> u64, edge: u64| {
                x.is_some_and(|x| at(x) == edge && x.streams == h.streams)
            };
            let l = beside(front.last(), |x| x.end, h.start);
            let r = beside(back.first(), |x| x.start, h.end);
            if l || r {
                let mark = mark();
                if let Some(l) = front.last().copied().filter(|x| l && x.tick > mark) {
                    h.start = l.start;
                    h.tick = h.tick.max(l.tick);
                    front.pop();
                    mid = Some(h);
                }
                if let Some(r) = back.first_mut().filter(|x| r && x.tick > mark) {
                    r.start = h.start;
                    r.tick = r.tick.max(h.tick);
                    mid = None;
                }
            }
        }
        // The list before the block takes the rest, unless it is empty.
        let mut list;
        if front.is_empty() {
            self.spare(front);
            list = back;
            if let Some(h) = mid {
                if list.capacity() == 0 {
                    list = self.list_to_fill(id);
                }
                list.insert(0, h);
            }
        } else {
            list = front;
            list.extend(mid);
            list.extend_from_slice(&back);
            self.spare(back);
        }
        // Pruned unless every part was pruned at this progress (the fresh
        // hazard, pending, keeps a pruning).
        let any = !list.is_empty();
        if any && pruned != prune.progress {
            list.retain(|h| !(prune.completed)(h));
        }
        if list.is_empty() {
            self.spare(list);
        } else {
            self.slots[id as usize].hazards = list;
        }
        self.slots[id as usize].pruned = if any { prune.progress } else { NEVER };
    }

    /// Every piece in address order, as (start, end, is a gap).
    pub(crate) fn pieces(&self) -> impl Iterator<Item = (u64, u64, bool)> + Clone + '_ {
        let mut id = self.head;
        std::iter::from_fn(move || {
            let p = self.get(id)?;
            id = p.next;
            Some((p.start, p.end, p.free))
        })
    }

    /// Check the invariants (see the module documentation) for an arena of
    /// `size` bytes.
    #[cfg(feature = "invariants")]
    pub(crate) fn check(&self, size: u64) -> Result<(), String> {
        let (mut pos, mut prev, mut id) = (0u64, NIL, self.head);
        let (mut gaps, mut blocks, mut live, mut last_free) = (0usize, 0usize, 0usize, false);
        while id != NIL {
            let Some(p) = self.get(id) else {
                return Err(format!("piece {id} is linked but not live"));
            };
            live += 1;
            if live > self.slots.len() {
                return Err("the list of pieces loops".into());
            }
            if p.prev != prev {
                return Err(format!("piece {id} at {:#x}: back link wrong", p.start));
            }
            if p.start != pos || p.end <= p.start {
                return Err(format!(
                    "piece at {:#x}..{:#x} is empty or does not follow {pos:#x}",
                    p.start, p.end
                ));
            }
            let hz = &self.slots[id as usize].hazards;
            if !p.free && !hz.is_empty() {
                return Err(format!("block at {:#x} has hazards", p.start));
            }
            let mut at = p.start;
            for h in hz {
                if h.start < at || h.end <= h.start || h.end > p.end || h.streams == 0 {
                    return Err(format!(
                        "gap at {:#x}: hazard {:#x}..{:#x} out of order, empty or outside",
                        p.start, h.start, h.end
                    ));
                }
                at = h.end;
            }
            if p.free {
                if last_free {
                    return Err(format!("uncoalesced gap at {:#x}", p.start));
                }
                if self.by_size.get(&(p.end - p.start, p.start)) != Some(id) {
                    return Err(format!("gap at {:#x} missing from the size index", p.start));
                }
                gaps += 1;
            } else {
                blocks += 1;
            }
            last_free = p.free;
            pos = p.end;
            prev = id;
            id = p.next;
        }
        if pos != size || self.tail != prev {
            return Err(format!(
                "pieces stop at {pos:#x} of {size:#x}, or the tail is wrong"
            ));
        }
        if gaps != self.by_size.len() {
            return Err(format!(
                "{gaps} gaps but {} in the size index",
                self.by_size.len()
            ));
        }
        if blocks != self.blocks {
            return Err(format!("{blocks} blocks but {} counted", self.blocks));
        }
        if live + self.vacant.len() != self.slots.len() {
            return Err("vacant slots out of date".into());
        }
        if self
            .vacant
            .iter()
            .any(|&v| !self.slots[v as usize].hazards.is_empty())
        {
            return Err("hazards of vacant slots".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap as Map;

    /// The same tiling kept the obvious way: blocks by start.
    fn gaps_of(blocks: &Map<u64, u64>, size: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut pos = 0;
        for (&s, &e) in blocks {
            if s > pos {
                out.push((pos, s));
            }
            pos = e;
        }
        if pos < size {
            out.push((pos, size));
        }
        out
    }

    #[test]
    fn occupy_and_vacate_coalesce_and_refuse_bad_ranges() {
        let mut t = Tiling::new(1000);
        let (_, _, g) = t.fitting(100).next().unwrap();
        assert_eq!(t.occupy(g, 990, 20), None, "past the gap");
        assert_eq!(t.occupy(g, 10, 0), None, "empty");
        let a = t.occupy(g, 100, 100).unwrap();
        t.check(1000).unwrap();
        assert_eq!(t.occupy(a, 100, 10), None, "a block is no gap");
        assert_eq!(t.gap_count(), 2);
        let (_, _, g) = t.fitting(800).next().unwrap();
        let b = t.occupy(g, 200, 50).unwrap();
        assert_eq!(t.vacate(12345), None, "no such piece");
        t.check(1000).unwrap();
        assert_eq!(t.vacate(a), Some((100, 200)));
        assert_eq!(t.vacate(a), None);
        assert_eq!(t.find(150), Some(a));
        assert_eq!(t.vacate(b), Some((200, 250)));
        t.check(1000).unwrap();
        assert_eq!(t.pieces().collect::<Vec<_>>(), vec![(0, 1000, true)]);
        assert_eq!(t.block_count(), 0);
        assert!(Tiling::new(0).check(0).is_ok());
    }

    #[test]
    fn a_gap_is_pruned_again_only_after_progress() {
        // One gap over the arena; "completed" here is a tick of at most
        // `done`, as a caller's knowledge would say.
        let mut t = Tiling::new(1000);
        let g = t.find(0).unwrap();
        let walks = std::cell::Cell::new(0);
        let prune = |t: &mut Tiling, id: PieceId, progress: u64, done: u64| {
            t.prune_hazards(id, progress, |h| {
                walks.set(walks.get() + 1);
                h.tick <= done
            })
        };
        t.add_hazard(g, Hazard::over(0, 100, 1, 1));
        t.add_hazard(g, Hazard::over(200, 100, 1, 5));
        prune(&mut t, g, 1, 1);
        assert_eq!(t.gap_hazards(g).len(), 1, "tick 1 is done");
        assert_eq!(walks.replace(0), 2);
        // No progress since: not walked again.
        prune(&mut t, g, 1, 1);
        assert_eq!(walks.replace(0), 0);
        // A fresh hazard keeps the pruning; any other undoes it.
        t.add_fresh_hazard(g, Hazard::over(400, 100, 1, 9), || u64::MAX);
        prune(&mut t, g, 1, 1);
        assert_eq!(walks.replace(0), 0);
        t.add_hazard(g, Hazard::over(600, 100, 1, 1));
        prune(&mut t, g, 1, 1);
        assert_eq!(walks.replace(0), 3);
        assert_eq!(t.gap_hazards(g).len(), 2);
        // Cut: both parts inherit the pruning.
        let b = t.occupy(g, 300, 50).unwrap();
        let (left, right) = (t.find(0).unwrap(), t.find(400).unwrap());
        prune(&mut t, left, 1, 1);
        prune(&mut t, right, 1, 1);
        assert_eq!(walks.replace(0), 0);
        // Progress: walked, and what completed is dropped.
        prune(&mut t, right, 2, 9);
        assert_eq!(walks.replace(0), 1);
        assert!(t.gap_hazards(right).is_empty());
        // Joined with parts pruned at different progress: walked again.
        t.vacate(b).unwrap();
        let joined = t.find(0).unwrap();
        prune(&mut t, joined, 2, 1);
        assert_eq!(walks.replace(0), 1, "the left part was pruned at 1 only");
        t.check(1000).unwrap();
    }

    #[test]
    fn a_hazard_over_others_joins_them_where_they_overlap_and_stays_in_its_gap() {
        // A block at 500..600 of a 1000-byte arena: gaps 0..500, 600..1000.
        let mut t = Tiling::new(1000);
        let whole = t.find(0).unwrap();
        let b = t.occupy(whole, 500, 100).unwrap();
        let (left, right) = (t.find(0).unwrap(), t.find(600).unwrap());
        assert_eq!(t.beside(b), [Some(left), Some(right)]);
        assert_eq!(t.beside(left), [None, Some(b)]);
        t.add_hazard(left, Hazard::over(0, 100, 0b001, 3));
        t.add_hazard(left, Hazard::over(150, 100, 0b010, 9));
        t.add_hazard(left, Hazard::over(300, 50, 0b100, 4));
        // 50..400 over them, and past the gap's end (cut at 500).
        t.add_hazard_over(left, Hazard::over(50, 900, 0b1000, 5));
        let got: Vec<(u64, u64, u64, u64)> = t
            .gap_hazards(left)
            .iter()
            .map(|h| (h.start, h.end, h.streams, h.tick))
            .collect();
        assert_eq!(
            got,
            [
                (0, 50, 0b0001, 3),
                (50, 100, 0b1001, 5),
                (100, 150, 0b1000, 5),
                (150, 250, 0b1010, 9),
                (250, 300, 0b1000, 5),
                (300, 350, 0b1100, 5),
                (350, 500, 0b1000, 5),
            ]
        );
        // Inside one hazard; then on a gap without any; a block takes none.
        t.add_hazard_over(left, Hazard::over(160, 10, 0b10, 1));
        assert_eq!(t.gap_hazards(left)[3], Hazard::over(150, 100, 0b1010, 9));
        assert_eq!(
            t.gap_hazards(left).len(),
            7,
            "asking no more, it changes nothing"
        );
        t.add_hazard_over(right, Hazard::over(0, 700, 0b1, 2));
        assert_eq!(t.gap_hazards(right), [Hazard::over(600, 100, 0b1, 2)]);
        t.add_hazard_over(b, Hazard::over(500, 100, 0b1, 2));
        assert!(t.gap_hazards(b).is_empty());
        t.check(1000).unwrap();
    }

    #[test]
    fn a_fresh_hazard_joins_its_neighbours_of_the_same_streams_past_the_mark() {
        // Blocks of 100 bytes at 0, 100, ... 500 of a 1000-byte arena.
        let mut t = Tiling::new(1000);
        let occupy = |t: &mut Tiling, i: u64| {
            let g = t.find(i * 100).unwrap();
            t.occupy(g, i * 100, 100).unwrap()
        };
        let mut blocks: Vec<PieceId> = (0..6).map(|i| occupy(&mut t, i)).collect();
        let free = |t: &mut Tiling, blocks: &[PieceId], i: usize, streams, tick, mark| {
            t.vacate(blocks[i]).unwrap();
            let h = Hazard::over(i as u64 * 100, 100, streams, tick);
            t.add_fresh_hazard(blocks[i], h, || mark);
            t.check(1000).unwrap();
        };
        let hazards = |t: &Tiling| -> Vec<(u64, u64, u64, u64)> {
            t.all_hazards()
                .map(|h| (h.start, h.end, h.streams, h.tick))
                .collect()
        };
        free(&mut t, &blocks, 0, 1, 10, 0);
        // Same streams, no mark since tick 10: one hazard at the later tick.
        free(&mut t, &blocks, 1, 1, 11, 9);
        assert_eq!(hazards(&t), vec![(0, 200, 1, 11)]);
        // Other streams beside it: kept apart.
        free(&mut t, &blocks, 2, 2, 12, 0);
        // A mark at tick 12 (an event of those streams since): kept apart.
        free(&mut t, &blocks, 3, 2, 13, 12);
        assert_eq!(
            hazards(&t),
            vec![(0, 200, 1, 11), (200, 300, 2, 12), (300, 400, 2, 13)]
        );
        // Occupied again (the hazards under the blocks dropped), then freed
        // outside in: the last free joins both neighbours.
        for i in 0..4 {
            blocks[i as usize] = occupy(&mut t, i);
        }
        assert!(hazards(&t).is_empty(), "dropped under the blocks");
        free(&mut t, &blocks, 0, 1, 20, 0);
        free(&mut t, &blocks, 2, 1, 21, 0);
        free(&mut t, &blocks, 1, 1, 22, 0);
        assert_eq!(hazards(&t), vec![(0, 300, 1, 22)], "left and right joined");
    }

    #[test]
    fn hazard_lists_are_reused_not_allocated_again() {
        // Blocks at 0..100, 100..200 and 200..300 of a 1000-byte arena; each
        // round frees the middle one (a hazard), joins it with no gap, and
        // occupies it again, the hazard handed to the pieces beside the new
        // block and back.
        let mut t = Tiling::new(1000);
        let at = |t: &mut Tiling, off: u64| {
            let g = t.find(off).unwrap();
            t.occupy(g, off, 100).unwrap()
        };
        at(&mut t, 0);
        let mut mid = at(&mut t, 100);
        at(&mut t, 200);
        let mut allocated = Vec::new();
        for round in 0..50u64 {
            t.vacate(mid).unwrap();
            t.add_hazard(mid, Hazard::over(100, 100, 1, round + 1));
            t.check(1000).unwrap();
            // The new block covers the middle of the hazard: both sides keep
            // a part of it.
            let g = t.find(150).unwrap();
            mid = t.occupy(g, 140, 20).unwrap();
            t.check(1000).unwrap();
            assert_eq!(t.all_hazards().count(), 2, "round {round}");
            t.vacate(mid).unwrap();
            t.check(1000).unwrap();
            assert_eq!(t.all_hazards().count(), 2, "round {round}: cut, not joined");
            // Occupied whole again: the hazards under it are dropped.
            let g = t.find(150).unwrap();
            mid = t.occupy(g, 100, 100).unwrap();
            t.check(1000).unwrap();
            assert_eq!(t.all_hazards().count(), 0, "round {round}");
            allocated.push(t.lists_allocated);
        }
        // The first rounds allocate lists; later ones take spares only.
        assert!(allocated[0] >= 1, "{allocated:?}");
        assert_eq!(allocated[10], allocated[49], "{allocated:?}");
        assert!(!t.spare_lists.is_empty());
    }

    /// The steps the allocator made one after another before
    /// [`Tiling::occupy_pruning`] made them in one walk: prune the gap (if
    /// it holds hazards), take the union of those under the block, occupy.
    fn occupy_in_steps(
        t: &mut Tiling,
        gap: PieceId,
        (off, len): (u64, u64),
        progress: u64,
        done: u64,
    ) -> Option<(PieceId, (u64, u64))> {
        if !t.gap_hazards(gap).is_empty() {
            t.prune_hazards(gap, progress, |h| h.tick <= done);
        }
        let union = t.hazard_union(gap, off, len);
        t.occupy(gap, off, len).map(|id| (id, union))
    }

    /// The steps before [`Tiling::vacate_leaving`]: vacate, add the fresh
    /// hazard, prune the gap (if it holds hazards).
    fn vacate_in_steps(
        t: &mut Tiling,
        id: PieceId,
        fresh: Option<Hazard>,
        mark: u64,
        (progress, done): (u64, u64),
    ) -> Option<(u64, u64)> {
        let range = t.vacate(id)?;
        if let Some(h) = fresh {
            t.add_fresh_hazard(id, h, || mark);
        }
        if !t.gap_hazards(id).is_empty() {
            t.prune_hazards(id, progress, |h| h.tick <= done);
        }
        Some(range)
    }

    /// Each live gap's hazards and pruning.
    fn gaps_and_pruning(t: &Tiling) -> Vec<(u64, u64, Vec<Hazard>, u64)> {
        t.gap_ids()
            .into_iter()
            .map(|(id, s, e)| {
                (
                    s,
                    e,
                    t.gap_hazards(id).to_vec(),
                    t.slots[id as usize].pruned,
                )
            })
            .collect()
    }

    #[test]
    fn occupying_prunes_cuts_and_reports_what_it_drops_in_one_walk() {
        // Hazards at 0..100 (tick 1, done), 100..300 (streams 2, tick 5)
        // and 400..500 (streams 4, tick 6) in one gap; a block over
        // 50..350 drops the first (completed), cuts the second and is
        // ordered after it alone.
        let mut t = Tiling::new(1000);
        let g = t.find(0).unwrap();
        t.add_hazard(g, Hazard::over(0, 100, 1, 1));
        t.add_hazard(g, Hazard::over(100, 200, 2, 5));
        t.add_hazard(g, Hazard::over(400, 100, 4, 6));
        let prune = Pruning {
            progress: 1,
            completed: |h: &Hazard| h.tick <= 1,
        };
        let (b, dropped) = t.occupy_pruning(g, 150, 200, prune).unwrap();
        assert_eq!(dropped, (2, 5), "the pending hazard under the block");
        t.check(1000).unwrap();
        assert_eq!(t.block(b), Some((150, 350)));
        let hazards: Vec<_> = t.all_hazards().map(|h| (h.start, h.end, h.tick)).collect();
        assert_eq!(hazards, vec![(100, 150, 5), (400, 500, 6)]);
        for (_, _, _, pruned) in gaps_and_pruning(&t) {
            assert_eq!(pruned, 1, "both parts pruned at the progress");
        }
        // Pruned at that progress already: nothing is asked again.
        let (left, right) = (t.find(0).unwrap(), t.find(400).unwrap());
        let never = Pruning {
            progress: 1,
            completed: |_: &Hazard| -> bool { panic!("pruned already") },
        };
        assert_eq!(t.occupy_pruning(left, 120, 10, never).unwrap().1, (2, 5));
        // No hazard under the block: none reported.
        let none = Pruning {
            progress: 2,
            completed: |_: &Hazard| false,
        };
        assert_eq!(t.occupy_pruning(right, 360, 20, none).unwrap().1, (0, 0));
        t.check(1000).unwrap();
    }

    #[test]
    fn vacating_joins_the_fresh_hazard_and_prunes_in_one_walk() {
        // Blocks at 0..100, 100..200 and 200..300; the outer ones freed
        // (hazards of stream 1 at ticks 2 and 3), then the middle one with
        // a fresh hazard of stream 1 at tick 9 and no mark since tick 2:
        // it joins the right one (tick 3) but not the left (tick 2); after
        // progress, what is done (tick 2) is dropped.
        let mut t = Tiling::new(1000);
        let blocks: Vec<PieceId> = (0..3)
            .map(|i| {
                let g = t.find(i * 100).unwrap();
                t.occupy(g, i * 100, 100).unwrap()
            })
            .collect();
        t.vacate(blocks[0]).unwrap();
        t.add_hazard(blocks[0], Hazard::over(0, 100, 1, 2));
        t.vacate(blocks[2]).unwrap();
        t.add_hazard(blocks[2], Hazard::over(200, 100, 1, 3));
        let prune = Pruning {
            progress: 7,
            completed: |h: &Hazard| h.tick <= 2,
        };
        let fresh = Some(Hazard::over(100, 100, 1, 9));
        assert_eq!(
            t.vacate_leaving(blocks[1], fresh, || 2, prune),
            Some((100, 200))
        );
        t.check(1000).unwrap();
        let hazards: Vec<_> = t.all_hazards().map(|h| (h.start, h.end, h.tick)).collect();
        assert_eq!(hazards, vec![(100, 300, 9)]);
        assert_eq!(t.slots[blocks[1] as usize].pruned, 7);
        assert_eq!(
            t.vacate_leaving(
                blocks[0],
                None,
                || 0,
                Pruning {
                    progress: 7,
                    completed: |_: &Hazard| false
                }
            ),
            None,
            "no block"
        );
    }

    proptest! {
        /// The one-walk occupation and vacation decide exactly what the
        /// steps they replace did: the same pieces, hazards, pruning and
        /// hazards reported, over any sequence on three streams with work
        /// completing as it goes.
        #[test]
        fn one_walk_matches_the_steps(ops in prop::collection::vec((0u64..3, 1u64..300, 0u64..1000, 0u64..8), 1..200)) {
            let size = 4096;
            let (mut a, mut b) = (Tiling::new(size), Tiling::new(size));
            let mut blocks: Vec<PieceId> = Vec::new();
            let (mut done, mut progress) = (0u64, 0u64);
            for (step, (kind, len, pick, streams)) in ops.into_iter().enumerate() {
                let tick = step as u64 + 1;
                // Some earlier work becomes known complete.
                if pick % 4 == 0 && done + 1 < tick {
                    done += (pick / 4) % (tick - done);
                    progress += 1;
                }
                let completed = |h: &Hazard| h.tick <= done;
                if kind == 0 && !blocks.is_empty() {
                    let id = blocks.swap_remove(pick as usize % blocks.len());
                    let (s, e) = a.block(id).unwrap();
                    let streams = streams % 7 + 1;
                    // Streams 4 alone stand for forgotten ones: no hazard.
                    let fresh = (streams != 4).then(|| Hazard::over(s, e - s, streams, tick));
                    let mark = pick % tick;
                    let want = vacate_in_steps(&mut a, id, fresh, mark, (progress, done));
                    let got = b.vacate_leaving(id, fresh, || mark, Pruning { progress, completed });
                    prop_assert_eq!(want, got);
                } else if let Some((l, s, g)) = a.best_fit(len).map(|(s, g)| (a.gap(g).unwrap().1 - s, s, g)) {
                    let off = s + pick % (l - len + 1);
                    let want = occupy_in_steps(&mut a, g, (off, len), progress, done);
                    let got = b.occupy_pruning(g, off, len, Pruning { progress, completed });
                    prop_assert_eq!(want, got);
                    blocks.push(got.unwrap().0);
                }
                a.check(size).map_err(TestCaseError::fail)?;
                b.check(size).map_err(TestCaseError::fail)?;
                prop_assert_eq!(gaps_and_pruning(&a), gaps_and_pruning(&b));
            }
        }

        /// Any sequence of occupations (at a gap's start, middle or end) and
        /// vacations keeps the tiling equal to the obvious model, best fit
        /// included.
        #[test]
        fn matches_the_obvious_model(ops in prop::collection::vec((0u64..4, 1u64..300, 0u64..1000), 1..200)) {
            let size = 4096;
            let mut t = Tiling::new(size);
            let mut model: Map<u64, u64> = Map::new();
            let mut ids: Map<u64, PieceId> = Map::new();
            // The hazards, byte by byte: a freed block's bytes carry the
            // step of its free until a block covers them again.
            let mut freed: Map<u64, u64> = Map::new();
            for (step, (kind, len, pick)) in ops.into_iter().enumerate() {
                let step = step as u64 + 1;
                if kind == 0 && !ids.is_empty() {
                    let (&s, &id) = ids.iter().nth(pick as usize % ids.len()).unwrap();
                    let e = model[&s];
                    prop_assert_eq!(t.vacate(id), Some((s, e)));
                    t.add_hazard(id, Hazard { start: s, end: e, streams: 1 << (pick % 3), tick: step });
                    freed.extend((s..e).map(|b| (b, step)));
                    model.remove(&s);
                    ids.remove(&s);
                } else {
                    let gaps = gaps_of(&model, size);
                    let best = gaps.iter().filter(|g| g.1 - g.0 >= len).min_by_key(|g| (g.1 - g.0, g.0)).copied();
                    let found = t.fitting(len).next().map(|(l, s, id)| (s, s + l, id));
                    prop_assert_eq!(best, found.map(|(s, e, _)| (s, e)));
                    if let Some((s, e, id)) = found {
                        let off = s + (pick % (e - s - len + 1));
                        // What the block must be ordered after: exactly the
                        // freed bytes under it.
                        let under: std::collections::BTreeSet<u64> = t
                            .hazards_over(id, off, len)
                            .flat_map(|h| (h.start.max(off)..h.end.min(off + len)).map(move |_| h.tick))
                            .collect();
                        let want: std::collections::BTreeSet<u64> =
                            freed.range(off..off + len).map(|(_, &k)| k).collect();
                        prop_assert_eq!(under, want);
                        freed.retain(|&b, _| b < off || b >= off + len);
                        let b = t.occupy(id, off, len).unwrap();
                        model.insert(off, off + len);
                        ids.insert(off, b);
                    }
                }
                t.check(size).map_err(TestCaseError::fail)?;
                let gaps: Vec<(u64, u64)> = t.pieces().filter(|p| p.2).map(|p| (p.0, p.1)).collect();
                prop_assert_eq!(gaps, gaps_of(&model, size));
                prop_assert_eq!(t.block_count(), model.len());
                let bytes: Map<u64, u64> = t
                    .all_hazards()
                    .flat_map(|h| (h.start..h.end).map(move |b| (b, h.tick)))
                    .collect();
                prop_assert_eq!(&bytes, &freed);
                prop_assert_eq!(t.last_gap().map(|g| (g.0, g.1)), gaps_of(&model, size).last().copied());
            }
        }
    }
}
