//! torch's private memory pools (CUDA graphs, `torch.cuda.MemPool`), kept
//! in front of Quilt, one [`PrivatePools`] per device.
//!
//! A pool is named by torch's `MempoolId_t` (two integers). It owns
//! segments, blocks of Quilt memory it allocated, each on one stream, and
//! hands out blocks carved from them as torch's own private pools do: a
//! request takes the smallest free block of its pool, stream and kind that
//! is large enough (requests of at most 1 MiB from segments of 2 MiB, larger
//! ones from segments of their size rounded up to Quilt's 2 MiB page, where
//! torch rounds those under 10 MiB up to 20 MiB), split when what is left is
//! worth keeping (512 bytes in a small segment, more than 1 MiB in a large
//! one); a freed block merges with the free blocks beside it, in its
//! segment or in a segment of the same pool, stream and kind right before
//! or after it (Quilt places segments side by side in its address space:
//! the pools' segments in an arena of their own, apart from the blocks
//! outside pools, as torch's private pools own their segments).
//! Where no free block fits, a pool whose free block ends its memory grows
//! by a segment placed right after it, when Quilt places it there
//! ([`PrivatePools::extension`]), else by a segment of the whole request.
//!
//! While a pool is used (its use count above 0: a `MemPool` object, a graph
//! captured into it, an allocation context routed to it), its segments stay
//! its own: a block torch frees serves only later allocations into the same
//! pool on the same stream (torch's allocator class orders that stream
//! after the streams the block was recorded on, and the segments are
//! recorded on them for Quilt). A captured graph's replays write into its
//! intermediates' memory, so that memory must never serve anything else
//! while the graph lives. When the use count drops to 0
//! ([`PrivatePools::release`]), the pool's wholly free segments go back to
//! Quilt at once and the others as their last block is freed; the pool is
//! gone when it holds nothing.
//!
//! This module only keeps the books: it says which block to hand out and
//! which segments to give back to Quilt; [`crate::library`] does the
//! allocating.

use std::collections::{BTreeMap, BTreeSet};

/// torch's `MempoolId_t`.
pub type PoolId = (u64, u64);

/// Blocks are multiples of this (torch's `kMinBlockSize`).
const MIN_BLOCK: u64 = 512;
/// Requests up to this are small (torch's `kSmallSize`); a large block is
/// split only when more than this would be left.
const SMALL_REQUEST: u64 = 1 << 20;
/// The segment small requests are carved from (torch's `kSmallBuffer`), and
/// Quilt's page, which large segments are rounded up to.
const PAGE: u64 = 2 << 20;

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to).saturating_mul(to)
}

/// The size of the block a request of `size` bytes takes (torch's
/// `round_size`).
pub fn block_size(size: u64) -> u64 {
    round_up(size.max(1), MIN_BLOCK)
}

/// The segment Quilt allocates for a request of `size` bytes that no free
/// block of its pool serves: 2 MiB for a small request, else the block
/// rounded up to Quilt's 2 MiB page.
pub fn segment_size(size: u64) -> u64 {
    round_up(block_size(size), PAGE)
}

fn is_small(block: u64) -> bool {
    block <= SMALL_REQUEST
}

/// One segment: a block of Quilt memory a pool owns, carved into blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    pool: PoolId,
    size: u64,
    stream: u64,
    /// Carved for small requests only.
    small: bool,
}

/// One block of a pool, handed out or free. The blocks of a pool tile its
/// segments; a block may run on from one segment into the next of the same
/// pool, stream and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    pool: PoolId,
    size: u64,
    /// The bytes torch asked for when it was last handed out (0: free).
    requested: u64,
    stream: u64,
    small: bool,
    /// Handed out now (false: free, kept by the pool).
    live: bool,
}

impl Block {
    /// Whether `other` is free and may merge with this block.
    fn merges_with(&self, other: &Block) -> bool {
        !other.live
            && other.pool == self.pool
            && other.stream == self.stream
            && other.small == self.small
    }
}

/// A free block in the order best fit searches: pool, stream, kind, size,
/// address.
type FreeKey = (PoolId, u64, bool, u64, u64);

fn free_key(ptr: u64, b: &Block) -> FreeKey {
    (b.pool, b.stream, b.small, b.size, ptr)
}

#[derive(Debug, Default)]
struct Pool {
    use_count: u32,
    /// torch's `setNoSplit`: its blocks are its segments, handed out whole.
    no_split: bool,
}

/// What happens to a freed pointer ([`PrivatePools::free`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Freed {
    /// No pool owns it: Quilt frees it.
    NotPooled,
    /// Its pool keeps it, free, for the pool's later allocations.
    KeptByPool,
    /// Its pool is released: the block serves nothing more; the segments
    /// at these addresses, wholly free now, go back to Quilt.
    Released(Vec<u64>),
}

/// The pools' figures for torch's statistics: Quilt counts a pool's
/// segments as allocated; torch counts the blocks handed out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFigures {
    /// Bytes and number of the segments the pools hold now.
    pub segments: (u64, u64),
    /// Bytes and number of the blocks handed out now.
    pub live: (u64, u64),
    /// Bytes torch asked for, of the blocks handed out now.
    pub live_requested: u64,
    /// Bytes of the segments not handed out (free blocks the pools keep).
    pub kept_bytes: u64,
    /// Segments allocated from Quilt, in total (bytes, number).
    pub segments_total: (u64, u64),
    /// Segments given back to Quilt, in total.
    pub segments_freed_total: (u64, u64),
    /// Blocks handed out, in total.
    pub handed_total: (u64, u64),
    /// Blocks freed (by torch, or by a restore), in total.
    pub returned_total: (u64, u64),
}

/// The private pools of one device.
#[derive(Debug, Default)]
pub struct PrivatePools {
    pools: BTreeMap<PoolId, Pool>,
    segments: BTreeMap<u64, Segment>,
    /// Every block of every pool, by address.
    blocks: BTreeMap<u64, Block>,
    /// The free blocks, for best fit.
    free_blocks: BTreeSet<FreeKey>,
    /// Kept as blocks and segments change.
    figures: PoolFigures,
    /// Bumped whenever a segment is added or dropped: while it stands, so
    /// do the segments a listing shows ([`PrivatePools::listed_segments_in`]).
    generation: u64,
}

/// A pool's block as torch last had it ([`PrivatePools::free`] gives it
/// back): what torch asked for and the stream it was handed out on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolBlock {
    /// The bytes torch asked for.
    pub requested: u64,
    /// The stream.
    pub stream: u64,
}

/// A block of a pool within one segment, as a listing shows it
/// ([`PrivatePools::pieces`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Its address (the segment's, for a block begun in the segment before).
    pub ptr: u64,
    /// Its bytes in the segment.
    pub size: u64,
    /// What torch asked for (handed out and begun here), or 0.
    pub requested: u64,
    /// Handed out now.
    pub live: bool,
    /// The block begins here (not in the segment before).
    pub begins: bool,
}

fn add(total: &mut (u64, u64), bytes: u64) {
    total.0 += bytes;
    total.1 += 1;
}

fn remove(total: &mut (u64, u64), bytes: u64) {
    total.0 -= bytes;
    total.1 -= 1;
}

impl PrivatePools {
    /// Create the pool `id` with a use count of 1, or add 1 to its count
    /// (torch's `createOrIncrefPool`; `beginAllocateToPool` does it too).
    pub fn create_or_incref(&mut self, id: PoolId) {
        self.pools.entry(id).or_default().use_count += 1;
    }

    /// The pool's use count (0 for a pool that does not exist or is released).
    pub fn use_count(&self, id: PoolId) -> u32 {
        self.pools.get(&id).map_or(0, |p| p.use_count)
    }

    /// Whether `id` exists and is used (allocations may go into it).
    pub fn is_used(&self, id: PoolId) -> bool {
        self.use_count(id) > 0
    }

    /// torch's `setNoSplit`: pool `id` hands its segments out whole, never
    /// split nor merged (a segment serves a request when it does not waste
    /// more than the request or 1 MiB, whichever is more). An error for a
    /// pool that does not exist.
    pub fn set_no_split(&mut self, id: PoolId) -> Result<(), String> {
        let pool = self
            .pools
            .get_mut(&id)
            .ok_or_else(|| format!("setNoSplit of pool {id:?}, which does not exist"))?;
        pool.no_split = true;
        Ok(())
    }

    fn is_no_split(&self, id: PoolId) -> bool {
        self.pools.get(&id).is_some_and(|p| p.no_split)
    }

    /// torch's `releasePool`: one use fewer. At 0 the addresses of the
    /// pool's wholly free segments are returned (for Quilt to free); the
    /// others go as their blocks are freed. An error for a pool that does
    /// not exist or is released.
    pub fn release(&mut self, id: PoolId) -> Result<Vec<u64>, String> {
        let pool = self
            .pools
            .get_mut(&id)
            .filter(|p| p.use_count > 0)
            .ok_or_else(|| format!("releasePool of pool {id:?}, which is not in use"))?;
        pool.use_count -= 1;
        if pool.use_count > 0 {
            return Ok(Vec::new());
        }
        let mine: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.pool == id)
            .map(|(&s, _)| s)
            .collect();
        let free = self.drop_free_segments(&mine);
        self.drop_if_empty(id);
        Ok(free)
    }

    /// The segments of `candidates` that no handed-out block touches,
    /// forgotten (Quilt frees them): their addresses.
    fn drop_free_segments(&mut self, candidates: &[u64]) -> Vec<u64> {
        let free: Vec<u64> = candidates
            .iter()
            .copied()
            .filter(|&s| self.is_wholly_free(s))
            .collect();
        for &s in &free {
            self.drop_segment(s);
        }
        free
    }

    /// Whether the segment at `s` exists and no handed-out block touches it.
    fn is_wholly_free(&self, s: u64) -> bool {
        let Some(seg) = self.segments.get(&s) else {
            return false;
        };
        self.blocks
            .range(..s + seg.size)
            .rev()
            .take_while(|(&p, b)| p + b.size > s)
            .all(|(_, b)| !b.live)
    }

    /// Forget the wholly free segment at `s` (Quilt frees it): the free
    /// block over it keeps what lies before and after it.
    fn drop_segment(&mut self, s: u64) {
        let Some(seg) = self.segments.remove(&s) else {
            return;
        };
        self.generation += 1;
        let end = s + seg.size;
        if let Some((&p, b)) = self.blocks.range(..=s).next_back() {
            let b = *b;
            if !b.live && p + b.size >= end {
                self.free_blocks.remove(&free_key(p, &b));
                self.blocks.remove(&p);
                if p < s {
                    self.insert_free(p, Block { size: s - p, ..b });
                }
                if p + b.size > end {
                    self.insert_free(
                        end,
                        Block {
                            size: p + b.size - end,
                            ..b
                        },
                    );
                }
            }
        }
        self.figures.kept_bytes -= seg.size;
        remove(&mut self.figures.segments, seg.size);
        add(&mut self.figures.segments_freed_total, seg.size);
    }

    fn insert_free(&mut self, ptr: u64, b: Block) {
        self.blocks.insert(ptr, b);
        self.free_blocks.insert(free_key(ptr, &b));
    }

    fn drop_if_empty(&mut self, id: PoolId) {
        let used = self.use_count(id) > 0;
        if !used && !self.segments.values().any(|s| s.pool == id) {
            self.pools.remove(&id);
        }
    }

    /// Hand out the free block at `ptr` for a request of `size` bytes,
    /// split when what is left is worth keeping. False (nothing changed)
    /// when no free block large enough is there.
    fn carve(&mut self, ptr: u64, size: u64) -> bool {
        let want = block_size(size);
        let Some(mut b) = self
            .blocks
            .get(&ptr)
            .copied()
            .filter(|b| !b.live && b.size >= want)
        else {
            return false;
        };
        self.free_blocks.remove(&free_key(ptr, &b));
        let rest = b.size - want;
        let split = if self.is_no_split(b.pool) {
            false
        } else if b.small {
            rest >= MIN_BLOCK
        } else {
            rest > SMALL_REQUEST
        };
        if split {
            self.insert_free(ptr + want, Block { size: rest, ..b });
            b.size = want;
        }
        b.live = true;
        b.requested = size;
        self.blocks.insert(ptr, b);
        self.figures.kept_bytes -= b.size;
        add(&mut self.figures.live, b.size);
        self.figures.live_requested += size;
        add(&mut self.figures.handed_total, b.size);
        true
    }

    /// A block of pool `id` on `stream` for a request of `size` bytes (the
    /// smallest free one large enough, of the request's kind), now handed
    /// out; None when there is none (the caller allocates a segment, see
    /// [`PrivatePools::extension`] and [`PrivatePools::adopt`]). An error
    /// for a pool not in use.
    pub fn take(&mut self, id: PoolId, size: u64, stream: u64) -> Result<Option<u64>, String> {
        if !self.is_used(id) {
            return Err(format!(
                "allocation into pool {id:?}, which is not in use (released or never created)"
            ));
        }
        let want = block_size(size);
        let small = is_small(want);
        let most = if self.is_no_split(id) {
            want.saturating_add(want.max(SMALL_REQUEST))
        } else {
            u64::MAX
        };
        let found = self
            .free_blocks
            .range((id, stream, small, want, 0)..=(id, stream, small, most, u64::MAX))
            .next()
            .map(|k| k.4);
        Ok(found.filter(|&ptr| self.carve(ptr, size)))
    }

    /// Where pool `id` could grow for a large request of `size` bytes on
    /// `stream` that no free block serves: the end of its largest free
    /// block of the kind that ends a segment with no block after it, and the
    /// bytes a segment placed there needs for the two to serve the request.
    /// None for a small request or where no such block is.
    pub fn extension(&self, id: PoolId, size: u64, stream: u64) -> Option<(u64, u64)> {
        let want = block_size(size);
        if is_small(want) || self.is_no_split(id) {
            return None;
        }
        let (t, ptr) = self
            .free_blocks
            .range((id, stream, false, 0, 0)..=(id, stream, false, u64::MAX, u64::MAX))
            .filter(|k| !self.blocks.contains_key(&(k.4 + k.3)))
            .map(|k| (k.3, k.4))
            .max()?;
        (t < want).then(|| (ptr + t, round_up(want - t, PAGE)))
    }

    /// The segment of `segment` bytes at `ptr`, just allocated from Quilt
    /// for pool `id` on `stream`, is the pool's, free, for large requests
    /// (merged with a free block of the pool's that ends at `ptr`: see
    /// [`PrivatePools::extension`]). An error as for [`PrivatePools::adopt`].
    pub fn adopt_free(
        &mut self,
        id: PoolId,
        ptr: u64,
        segment: u64,
        stream: u64,
    ) -> Result<(), String> {
        self.adopt_segment(id, ptr, segment, stream, false)?;
        self.merge(ptr);
        Ok(())
    }

    /// The segment of `segment` bytes at `ptr`, just allocated from Quilt
    /// for pool `id` on `stream`, is the pool's; a request of `size` bytes
    /// is handed out at its start. An error for a pool not in use, a segment
    /// too small for the request or overlapping one a pool owns.
    pub fn adopt(
        &mut self,
        id: PoolId,
        ptr: u64,
        segment: u64,
        size: u64,
        stream: u64,
    ) -> Result<(), String> {
        if segment < block_size(size) {
            return Err(format!(
                "adopting {ptr:#x} into pool {id:?}: a segment of {segment} bytes for a request of {size}"
            ));
        }
        self.adopt_segment(id, ptr, segment, stream, is_small(block_size(size)))?;
        if let Some(b) = self.blocks.get(&ptr).copied() {
            self.free_blocks.insert(free_key(ptr, &b));
        }
        self.carve(ptr, size);
        Ok(())
    }

    /// A new segment of the pool, of one free block (not indexed yet).
    fn adopt_segment(
        &mut self,
        id: PoolId,
        ptr: u64,
        segment: u64,
        stream: u64,
        small: bool,
    ) -> Result<(), String> {
        if !self.is_used(id) {
            return Err(format!(
                "adopting {ptr:#x} into pool {id:?}, which is not in use"
            ));
        }
        let end = ptr
            .checked_add(segment)
            .filter(|_| segment > 0)
            .ok_or_else(|| {
                format!("adopting {ptr:#x} into pool {id:?}: a segment of {segment} bytes")
            })?;
        let before = self
            .segments
            .range(..end)
            .next_back()
            .filter(|(&s, seg)| s + seg.size > ptr);
        if let Some((&s, seg)) = before {
            return Err(format!(
                "adopting {ptr:#x} into pool {id:?}: pool {:?}'s segment at {s:#x} has it already",
                seg.pool
            ));
        }
        self.generation += 1;
        self.segments.insert(
            ptr,
            Segment {
                pool: id,
                size: segment,
                stream,
                small,
            },
        );
        self.blocks.insert(
            ptr,
            Block {
                pool: id,
                size: segment,
                requested: 0,
                stream,
                small,
                live: false,
            },
        );
        add(&mut self.figures.segments, segment);
        self.figures.kept_bytes += segment;
        add(&mut self.figures.segments_total, segment);
        Ok(())
    }

    /// The block at `ptr`, handed out, is free: merged with the free blocks
    /// beside it, kept for the pool's later allocations. Returns the
    /// address of the merged free block.
    fn make_free(&mut self, ptr: u64) -> u64 {
        let Some(b) = self.blocks.get_mut(&ptr) else {
            return ptr;
        };
        let (size, requested) = (b.size, b.requested);
        b.live = false;
        b.requested = 0;
        self.figures.kept_bytes += size;
        remove(&mut self.figures.live, size);
        self.figures.live_requested -= requested;
        add(&mut self.figures.returned_total, size);
        self.merge(ptr)
    }

    /// The free block at `ptr` (not in the free index) merged with the free
    /// blocks right before and after it of the same pool, stream and kind
    /// (in its segment or in one beside it), and indexed. Returns the
    /// address of the merged block.
    fn merge(&mut self, ptr: u64) -> u64 {
        let Some(mut b) = self.blocks.get(&ptr).copied() else {
            return ptr;
        };
        if self.is_no_split(b.pool) {
            self.insert_free(ptr, b);
            return ptr;
        }
        let end = ptr + b.size;
        let mut start = ptr;
        if let Some((&p, prev)) = self.blocks.range(..ptr).next_back() {
            if p + prev.size == ptr && b.merges_with(prev) {
                self.free_blocks.remove(&free_key(p, prev));
                b.size += prev.size;
                start = p;
                self.blocks.remove(&ptr);
            }
        }
        if let Some(next) = self.blocks.get(&end).copied() {
            if b.merges_with(&next) {
                self.free_blocks.remove(&free_key(end, &next));
                self.blocks.remove(&end);
                b.size += next.size;
            }
        }
        self.insert_free(start, b);
        start
    }

    /// The segments a block from `ptr` over `size` bytes touches.
    fn segments_over(&self, ptr: u64, size: u64) -> Vec<u64> {
        let first = self.segment_of(ptr).unwrap_or(ptr);
        self.segments
            .range(first..ptr.saturating_add(size))
            .map(|(&s, _)| s)
            .collect()
    }

    /// torch frees `ptr`: see [`Freed`], with the block as torch had it
    /// when a pool owned it. An error for a pool's block that is free
    /// already (a double free).
    pub fn free(&mut self, ptr: u64) -> Result<(Freed, Option<PoolBlock>), String> {
        let Some(b) = self.blocks.get(&ptr).copied() else {
            return Ok((Freed::NotPooled, None));
        };
        if !b.live {
            return Err(format!(
                "double free of {ptr:#x}, free in pool {:?} already",
                b.pool
            ));
        }
        let had = Some(PoolBlock {
            requested: b.requested,
            stream: b.stream,
        });
        let at = self.make_free(ptr);
        if self.is_used(b.pool) {
            return Ok((Freed::KeptByPool, had));
        }
        let size = self.blocks.get(&at).map_or(0, |m| m.size);
        let touched = self.segments_over(at, size);
        let back = self.drop_free_segments(&touched);
        self.drop_if_empty(b.pool);
        Ok((Freed::Released(back), had))
    }

    /// Whether any pool exists or owns a segment: where none does, a free or
    /// an allocation has nothing to ask the pools.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.segments.is_empty()
    }

    /// The pool owning the block at `ptr` (handed out or free), if any.
    pub fn owner(&self, ptr: u64) -> Option<PoolId> {
        self.blocks.get(&ptr).map(|b| b.pool)
    }

    /// The address of the pool segment holding `ptr` (any byte of it).
    pub fn segment_of(&self, ptr: u64) -> Option<u64> {
        self.segments
            .range(..=ptr)
            .next_back()
            .filter(|(&s, seg)| ptr < s + seg.size)
            .map(|(&s, _)| s)
    }

    /// The segments under the pool's block at `ptr` (the segment holding
    /// `ptr` for any other address in one): those a stream that uses it
    /// must be recorded on for Quilt.
    pub fn segments_under(&self, ptr: u64) -> Vec<u64> {
        match self.blocks.get(&ptr) {
            Some(b) => self.segments_over(ptr, b.size),
            None => self.segment_of(ptr).into_iter().collect(),
        }
    }

    /// What torch asked for the pool's live block at `ptr`, if it is one.
    pub fn live_requested(&self, ptr: u64) -> Option<u64> {
        self.blocks
            .get(&ptr)
            .filter(|b| b.live)
            .map(|b| b.requested)
    }

    /// Whether `ptr` is a pool's free block (Quilt has it allocated; torch
    /// does not).
    pub fn is_kept_free(&self, ptr: u64) -> bool {
        self.blocks.get(&ptr).is_some_and(|b| !b.live)
    }

    /// Bumped whenever a pool's segment is added or dropped.
    pub fn segments_generation(&self) -> u64 {
        self.generation
    }

    /// How many segments a listing shows over the run of Quilt's memory at
    /// `addr` (`size` bytes), as [`crate::listing::segments`] cuts it: each
    /// pool segment in it, and each stretch of other memory before, between
    /// and after them (Quilt's blocks tile the run). No walk over the
    /// blocks: the pools' segments in the run only.
    pub fn listed_segments_in(&self, (addr, size): (u64, u64)) -> u64 {
        let end = addr.saturating_add(size);
        let (mut count, mut at) = (0, addr);
        for (&s, seg) in self.segments.range(addr..end) {
            count += u64::from(s > at) + 1;
            at = s + seg.size;
        }
        count + u64::from(end > at)
    }

    /// The pool owning the segment at `ptr` and the stream it was allocated
    /// on, if a pool owns a segment there: a listing shows it as that pool's
    /// segment.
    pub fn segment_owner(&self, ptr: u64) -> Option<(PoolId, u64)> {
        self.segments.get(&ptr).map(|s| (s.pool, s.stream))
    }

    /// The pool's blocks over the segment at `ptr`, cut to it, in address
    /// order, if a pool owns a segment there: a listing shows them in place
    /// of Quilt's one block.
    pub fn pieces(&self, ptr: u64) -> Option<Vec<Piece>> {
        let seg = self.segments.get(&ptr)?;
        let end = ptr + seg.size;
        let first = self
            .blocks
            .range(..=ptr)
            .next_back()
            .map_or(ptr, |(&p, _)| p);
        Some(
            self.blocks
                .range(first..end)
                .filter(|(&p, b)| p + b.size > ptr)
                .map(|(&p, b)| {
                    let from = p.max(ptr);
                    Piece {
                        ptr: from,
                        size: (p + b.size).min(end) - from,
                        requested: if b.live && p == from { b.requested } else { 0 },
                        live: b.live,
                        begins: p == from,
                    }
                })
                .collect(),
        )
    }

    /// Bytes and number of the free blocks the pools keep: reserved, not
    /// allocated, in torch's statistics. A walk over the blocks (the
    /// figures keep the bytes as a counter, [`PrivatePools::figures`]).
    pub fn kept_free(&self) -> (u64, u64) {
        self.blocks
            .values()
            .filter(|b| !b.live)
            .fold((0, 0), |(bytes, n), b| (bytes + b.size, n + 1))
    }

    /// The figures for torch's statistics (kept as blocks change: no walk).
    pub fn figures(&self) -> PoolFigures {
        self.figures
    }

    /// Bytes each pool's segments hold, for pools that hold any.
    pub fn bytes_by_pool(&self) -> BTreeMap<PoolId, u64> {
        let mut out = BTreeMap::new();
        for s in self.segments.values() {
            *out.entry(s.pool).or_insert(0) += s.size;
        }
        out
    }

    /// The pools that exist (used, or released with live blocks).
    pub fn pool_count(&self) -> usize {
        self.pools.len()
    }
}

/// One block of a pool as a checkpoint keeps it ([`PrivatePools::checkpoint`]),
/// laid out as the C struct `QuiltPoolBlock` of torch's allocator class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointBlock {
    /// Its address.
    pub ptr: u64,
    /// Its bytes.
    pub size: u64,
    /// The bytes torch asked for when it was last handed out.
    pub requested: u64,
    /// The stream it belongs to.
    pub stream: u64,
    /// 1: handed out at the checkpoint; 0: free, kept by the pool.
    pub live: i32,
}

/// What [`PrivatePools::restore`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// The blocks that were handed out and are now free (without torch
    /// freeing them): torch's `CheckpointDelta::ptrs_freed`.
    pub freed: Vec<CheckpointBlock>,
    /// The blocks handed out again, at the checkpoint's addresses: torch's
    /// `CheckpointDelta::dataptrs_allocd`. A block may be in both.
    pub allocated: Vec<CheckpointBlock>,
}

/// CUDA graph trees (`torch.compile(mode="reduce-overhead")`): a pool's
/// state checkpointed and restored, and its live blocks checked, with the
/// semantics of torch's `getCheckpointState`, `setCheckpointPoolState` and
/// `checkPoolLiveAllocations`. A pool's segments never leave it while it is
/// used, so a checkpoint is the list of the blocks tiling them and whether
/// each was handed out; a restore carves the pool so again.
impl PrivatePools {
    fn known(&self, id: PoolId, what: &str) -> Result<(), String> {
        match self.pools.get(&id) {
            None => Err(format!("{what}: could not find pool {id:?}")),
            Some(_) => Ok(()),
        }
    }

    fn used(&self, id: PoolId, what: &str) -> Result<(), String> {
        self.known(id, what)?;
        if !self.is_used(id) {
            return Err(format!(
                "{what}: pool {id:?} is released (a freeable pool is not checkpointed)"
            ));
        }
        Ok(())
    }

    fn checkpoint_block(ptr: u64, b: &Block) -> CheckpointBlock {
        CheckpointBlock {
            ptr,
            size: b.size,
            requested: b.requested,
            stream: b.stream,
            live: i32::from(b.live),
        }
    }

    /// The state of pool `id`: its blocks, in address order, with whether
    /// each is handed out (torch's `getCheckpointState`). An error for a
    /// pool that does not exist or is released.
    pub fn checkpoint(&self, id: PoolId) -> Result<Vec<CheckpointBlock>, String> {
        self.used(id, "getCheckpointState")?;
        Ok(self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id)
            .map(|(&ptr, b)| Self::checkpoint_block(ptr, b))
            .collect())
    }

    /// Whether every block of `state` lies in segments of pool `id` of its
    /// stream and of one kind, side by side, no two blocks overlapping: the
    /// kind of each block, in the state's order.
    fn check_state(&self, id: PoolId, state: &[CheckpointBlock]) -> Result<Vec<bool>, String> {
        let mut kinds = Vec::with_capacity(state.len());
        for c in state {
            let what = format!(
                "setCheckpointPoolState: {:#x} ({} bytes on stream {:#x}) of pool {id:?}",
                c.ptr, c.size, c.stream
            );
            let end = c
                .ptr
                .checked_add(c.size)
                .filter(|_| c.size > 0)
                .ok_or_else(|| format!("{what}: not a block"))?;
            let mut at = c.ptr;
            let mut kind = None;
            while at < end {
                let seg = self
                    .segment_of(at)
                    .and_then(|s| self.segments.get(&s).map(|g| (s, *g)));
                match seg {
                    Some((s, g))
                        if g.pool == id
                            && g.stream == c.stream
                            && kind.is_none_or(|k| k == g.small) =>
                    {
                        kind = Some(g.small);
                        at = s + g.size;
                    }
                    Some((s, g)) => {
                        return Err(format!(
                            "{what}: the segment at {s:#x} is now pool {:?}'s on stream {:#x}",
                            g.pool, g.stream
                        ))
                    }
                    None => return Err(format!("{what}: {at:#x} is in no segment of a pool now")),
                }
            }
            kinds.push(kind.unwrap_or(false));
        }
        let mut sorted: Vec<&CheckpointBlock> = state.iter().collect();
        sorted.sort_by_key(|c| c.ptr);
        for w in sorted.windows(2) {
            if w[0].ptr + w[0].size > w[1].ptr {
                return Err(format!(
                    "setCheckpointPoolState: {:#x} of pool {id:?} overlaps {:#x} (listed twice?)",
                    w[1].ptr, w[0].ptr
                ));
            }
        }
        Ok(kinds)
    }

    /// Put pool `id` back in the state `state` ([`PrivatePools::checkpoint`]
    /// gave it): every block handed out now is free, then the pool is
    /// carved as the state says, its handed-out blocks handed out again at
    /// their addresses (torch's `setCheckpointPoolState`). What the state
    /// does not cover (segments the pool gained since) is free. An error,
    /// with nothing changed, for a pool that does not exist or is released,
    /// or a state that does not lie in the pool's segments as they are
    /// (another pool's, another stream, blocks listed twice or overlapping).
    pub fn restore(&mut self, id: PoolId, state: &[CheckpointBlock]) -> Result<Restored, String> {
        self.used(id, "setCheckpointPoolState")?;
        let kinds = self.check_state(id, state)?;
        let mut out = Restored::default();
        let live: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && b.live)
            .map(|(&p, _)| p)
            .collect();
        for p in live {
            if let Some(b) = self.blocks.get(&p) {
                out.freed.push(Self::checkpoint_block(p, b));
            }
            self.make_free(p);
        }
        // The pool is all free now: carve it anew, the state's blocks
        // first, free blocks in what they leave, merged.
        let mine: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id)
            .map(|(&p, _)| p)
            .collect();
        for p in mine {
            if let Some(b) = self.blocks.remove(&p) {
                self.free_blocks.remove(&free_key(p, &b));
            }
        }
        for (c, &small) in state.iter().zip(&kinds) {
            let live = c.live != 0;
            self.blocks.insert(
                c.ptr,
                Block {
                    pool: id,
                    size: c.size,
                    requested: if live { c.requested } else { 0 },
                    stream: c.stream,
                    small,
                    live,
                },
            );
            if live {
                self.figures.kept_bytes -= c.size;
                add(&mut self.figures.live, c.size);
                self.figures.live_requested += c.requested;
                add(&mut self.figures.handed_total, c.size);
                out.allocated.push(*c);
            }
        }
        let segments: Vec<(u64, Segment)> = self
            .segments
            .iter()
            .filter(|(_, s)| s.pool == id)
            .map(|(&s, g)| (s, *g))
            .collect();
        let mut gaps = Vec::new();
        for (s, g) in segments {
            let end = s + g.size;
            let mut at = s;
            // A block begun in the segment before covers the start.
            if let Some((&p, b)) = self.blocks.range(..s).next_back() {
                if b.pool == id && p + b.size > s {
                    at = (p + b.size).min(end);
                }
            }
            let inside: Vec<(u64, u64)> = self
                .blocks
                .range(s..end)
                .map(|(&p, b)| (p, b.size))
                .collect();
            for (p, size) in inside {
                if p > at {
                    gaps.push((at, p - at, g));
                }
                at = at.max(p + size);
            }
            if at < end {
                gaps.push((at, end - at, g));
            }
        }
        for (p, size, g) in gaps {
            self.blocks.insert(
                p,
                Block {
                    pool: id,
                    size,
                    requested: 0,
                    stream: g.stream,
                    small: g.small,
                    live: false,
                },
            );
        }
        let free: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && !b.live)
            .map(|(&p, _)| p)
            .collect();
        for p in free {
            if self.blocks.contains_key(&p) {
                self.merge(p);
            }
        }
        Ok(out)
    }

    /// The blocks of pool `id` handed out now, in address order (torch's
    /// `checkPoolLiveAllocations` compares them with the tensors it knows).
    /// An error for a pool that does not exist (a released pool with live
    /// blocks exists until they are freed).
    pub fn live_blocks(&self, id: PoolId) -> Result<Vec<u64>, String> {
        self.known(id, "checkPoolLiveAllocations")?;
        Ok(self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && b.live)
            .map(|(&p, _)| p)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    const A: PoolId = (1, 0);
    const B: PoolId = (0, 1);
    const MIB: u64 = 1 << 20;

    /// The books hold together: each pool's blocks tile its segments
    /// exactly (a block runs on only into a segment of the same pool, stream
    /// and kind right after), no two free blocks that could merge lie side
    /// by side, the free index is the free blocks, and the figures are
    /// those of a walk.
    fn check_books(p: &PrivatePools) -> Result<(), String> {
        let mut at: Option<(u64, Block)> = None; // the block being walked through
        for (&s, g) in &p.segments {
            let end = s + g.size;
            let mut pos = s;
            if let Some((bp, b)) = at {
                if bp + b.size > s {
                    if (b.pool, b.stream, b.small) != (g.pool, g.stream, g.small) {
                        return Err(format!(
                            "block {bp:#x} runs into segment {s:#x} of another kind"
                        ));
                    }
                    pos = (bp + b.size).min(end);
                    if bp + b.size > end {
                        at = Some((bp, b));
                        continue;
                    }
                }
            }
            at = None;
            while pos < end {
                let Some(b) = p.blocks.get(&pos) else {
                    return Err(format!("no block at {pos:#x} in segment {s:#x}"));
                };
                if (b.pool, b.stream, b.small) != (g.pool, g.stream, g.small) {
                    return Err(format!(
                        "block {pos:#x} is not of its segment's pool, stream or kind"
                    ));
                }
                if b.size == 0 || (!b.small && b.size % MIN_BLOCK != 0) {
                    return Err(format!("block {pos:#x} of {} bytes", b.size));
                }
                if pos + b.size > end {
                    let next = p.segments.get(&end);
                    if next
                        .is_none_or(|n| (n.pool, n.stream, n.small) != (g.pool, g.stream, g.small))
                    {
                        return Err(format!("block {pos:#x} runs out of its segment's memory"));
                    }
                    at = Some((pos, *b));
                }
                pos += b.size;
            }
        }
        if let Some((bp, _)) = at {
            return Err(format!("block {bp:#x} runs past the last segment"));
        }
        let mut walked = 0;
        for (&ptr, b) in &p.blocks {
            if p.segment_of(ptr).is_none() {
                return Err(format!("block {ptr:#x} is in no segment"));
            }
            if !b.live {
                walked += b.size;
                if !p.free_blocks.contains(&free_key(ptr, b)) {
                    return Err(format!("free block {ptr:#x} is not indexed"));
                }
                if let Some(n) = p.blocks.get(&(ptr + b.size)) {
                    if b.merges_with(n) && !p.is_no_split(b.pool) {
                        return Err(format!(
                            "free blocks {ptr:#x} and {:#x} not merged",
                            ptr + b.size
                        ));
                    }
                }
            }
        }
        for k in &p.free_blocks {
            if p.blocks
                .get(&k.4)
                .is_none_or(|b| b.live || free_key(k.4, b) != *k)
            {
                return Err(format!("stale free index entry {k:?}"));
            }
        }
        let f = p.figures();
        let live: Vec<&Block> = p.blocks.values().filter(|b| b.live).collect();
        let seg_bytes: u64 = p.segments.values().map(|s| s.size).sum();
        let checks = [
            (f.kept_bytes, walked, "kept bytes"),
            (f.live.0, live.iter().map(|b| b.size).sum(), "live bytes"),
            (f.live.1, live.len() as u64, "live blocks"),
            (
                f.live_requested,
                live.iter().map(|b| b.requested).sum(),
                "live requested",
            ),
            (f.segments.0, seg_bytes, "segment bytes"),
            (f.segments.1, p.segments.len() as u64, "segments"),
            (
                f.kept_bytes + f.live.0,
                seg_bytes,
                "kept and live make the segments",
            ),
            (
                f.live.0,
                f.handed_total.0 - f.returned_total.0,
                "live from the totals",
            ),
            (
                f.segments.0,
                f.segments_total.0 - f.segments_freed_total.0,
                "segments from the totals",
            ),
        ];
        for (got, want, what) in checks {
            if got != want {
                return Err(format!("{what}: counted {got}, walked {want}"));
            }
        }
        Ok(())
    }

    /// A pool's segments allocated at `next` on, side by side, as Quilt
    /// places them where nothing is in between: take, else an extension
    /// when it lands where wanted (`lands`), else a segment of the request.
    fn alloc(
        p: &mut PrivatePools,
        id: PoolId,
        size: u64,
        stream: u64,
        next: &mut u64,
        lands: bool,
    ) -> u64 {
        if let Some(ptr) = p.take(id, size, stream).unwrap() {
            return ptr;
        }
        if let Some((end, extra)) = p.extension(id, size, stream) {
            if lands && end == *next {
                p.adopt_free(id, end, extra, stream).unwrap();
                *next += extra;
                return p
                    .take(id, size, stream)
                    .unwrap()
                    .expect("the extension serves it");
            }
        }
        let seg = segment_size(size);
        let ptr = *next;
        *next += seg;
        p.adopt(id, ptr, seg, size, stream).unwrap();
        ptr
    }

    #[test]
    fn sizes_are_torchs_blocks_in_segments_of_whole_pages() {
        assert_eq!(block_size(0), 512);
        assert_eq!(block_size(1), 512);
        assert_eq!(block_size(513), 1024);
        assert_eq!(segment_size(1), 2 * MIB);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 1), 2 * MIB);
        assert_eq!(segment_size(4 * MIB + 1), 6 * MIB);
        assert_eq!(segment_size(64 * MIB), 64 * MIB);
    }

    #[test]
    fn a_block_freed_in_a_used_pool_serves_only_that_pool_and_stream() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x20_0000, 2 * MIB, 4096, 7).unwrap();
        assert_eq!(
            p.free(0x20_0000).unwrap(),
            (
                Freed::KeptByPool,
                Some(PoolBlock {
                    requested: 4096,
                    stream: 7
                })
            )
        );
        assert_eq!(p.kept_free(), (2 * MIB, 1), "merged back into its segment");
        assert_eq!(p.take(B, 4096, 7).unwrap(), None);
        assert_eq!(p.take(A, 4096, 8).unwrap(), None);
        assert_eq!(
            p.take(A, 4 * MIB, 7).unwrap(),
            None,
            "a large request is not served from a small segment"
        );
        assert_eq!(p.take(A, 4096, 7).unwrap(), Some(0x20_0000));
        assert!(p.free(0x20_0000).is_ok());
        assert!(p.free(0x20_0000).is_err(), "a double free is refused");
        assert_eq!(p.free(0x9999).unwrap(), (Freed::NotPooled, None));
        check_books(&p).unwrap();
    }

    #[test]
    fn blocks_are_split_and_merged_within_a_segment() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        let s = 0x4000_0000u64;
        p.adopt(A, s, 16 * MIB, 16 * MIB, 0).unwrap();
        p.free(s).unwrap();
        // Four 4 MiB blocks from the one segment.
        let got: Vec<u64> = (0..4)
            .map(|_| p.take(A, 4 * MIB, 0).unwrap().unwrap())
            .collect();
        assert_eq!(got, vec![s, s + 4 * MIB, s + 8 * MIB, s + 12 * MIB]);
        assert_eq!(p.take(A, 4 * MIB, 0).unwrap(), None);
        check_books(&p).unwrap();
        // Freed out of order, they merge; the middle two serve 8 MiB.
        p.free(s + 4 * MIB).unwrap();
        p.free(s + 8 * MIB).unwrap();
        assert_eq!(p.take(A, 8 * MIB, 0).unwrap(), Some(s + 4 * MIB));
        check_books(&p).unwrap();
        // What is left over 1 MiB is split off; 1 MiB or less is handed out whole.
        p.free(s + 4 * MIB).unwrap();
        assert_eq!(p.take(A, 7 * MIB, 0).unwrap(), Some(s + 4 * MIB));
        assert_eq!(
            p.figures().live.0,
            4 * MIB + 8 * MIB + 4 * MIB,
            "7 MiB took the 8 MiB block whole"
        );
        p.free(s + 4 * MIB).unwrap();
        assert_eq!(p.take(A, 5 * MIB, 0).unwrap(), Some(s + 4 * MIB));
        assert_eq!(
            p.figures().live.0,
            4 * MIB + 5 * MIB + 4 * MIB,
            "3 MiB split off"
        );
        for ptr in [s, s + 4 * MIB, s + 12 * MIB] {
            p.free(ptr).unwrap();
        }
        assert_eq!(p.kept_free(), (16 * MIB, 1));
        assert_eq!(p.take(A, 16 * MIB, 0).unwrap(), Some(s));
        check_books(&p).unwrap();
    }

    #[test]
    fn small_blocks_come_from_small_segments_split_to_512_bytes() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        let s = 0x4000_0000u64;
        p.adopt(A, s, 2 * MIB, 1000, 0).unwrap();
        assert_eq!(p.take(A, 100, 0).unwrap(), Some(s + 1024));
        assert_eq!(p.take(A, MIB, 0).unwrap(), Some(s + 1536));
        assert_eq!(
            p.take(A, MIB, 0).unwrap(),
            None,
            "what is left is under 1 MiB"
        );
        assert_eq!(p.live_requested(s + 1024), Some(100));
        check_books(&p).unwrap();
    }

    #[test]
    fn a_pool_grows_by_a_segment_right_after_its_free_end() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        let s = 0x4000_0000u64;
        p.adopt(A, s, 8 * MIB, 4 * MIB, 0).unwrap();
        assert_eq!(p.extension(A, MIB, 0), None, "not for a small request");
        assert_eq!(p.extension(A, 4 * MIB, 0), None, "a free block serves it");
        // 4 MiB free at the end: 12 MiB needs 8 more right after.
        assert_eq!(p.extension(A, 12 * MIB, 0), Some((s + 8 * MIB, 8 * MIB)));
        assert_eq!(
            p.extension(A, 12 * MIB, 1),
            None,
            "another stream has nothing"
        );
        p.adopt_free(A, s + 8 * MIB, 8 * MIB, 0).unwrap();
        check_books(&p).unwrap();
        assert_eq!(p.take(A, 12 * MIB, 0).unwrap(), Some(s + 4 * MIB));
        check_books(&p).unwrap();
        // The block runs over both segments; the listing cuts it.
        let first = p.pieces(s).unwrap();
        let second = p.pieces(s + 8 * MIB).unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(
            (
                first[1].ptr,
                first[1].size,
                first[1].requested,
                first[1].begins
            ),
            (s + 4 * MIB, 4 * MIB, 12 * MIB, true)
        );
        assert_eq!(
            (
                second[0].ptr,
                second[0].size,
                second[0].live,
                second[0].begins
            ),
            (s + 8 * MIB, 8 * MIB, true, false)
        );
        assert_eq!(p.segments_under(s + 4 * MIB), vec![s, s + 8 * MIB]);
        // Released with blocks live in the first segment only: the second
        // goes back at once, the first with its last block.
        p.free(s + 4 * MIB).unwrap();
        assert_eq!(p.take(A, 4 * MIB, 0).unwrap(), Some(s + 4 * MIB));
        assert_eq!(
            p.release(A).unwrap(),
            vec![s + 8 * MIB],
            "the second segment is wholly free"
        );
        check_books(&p).unwrap();
        assert_eq!(p.free(s).unwrap().0, Freed::Released(vec![]));
        assert_eq!(p.free(s + 4 * MIB).unwrap().0, Freed::Released(vec![s]));
        assert_eq!(p.pool_count(), 0);
        assert!(p.is_empty());
        check_books(&p).unwrap();
    }

    #[test]
    fn a_no_split_pool_hands_its_segments_out_whole() {
        let mut p = PrivatePools::default();
        assert!(p.set_no_split(A).is_err(), "no such pool");
        p.create_or_incref(A);
        p.set_no_split(A).unwrap();
        let s = 0x4000_0000u64;
        p.adopt(A, s, 16 * MIB, 9 * MIB, 0).unwrap();
        p.adopt(A, s + 16 * MIB, 4 * MIB, 4 * MIB, 0).unwrap();
        assert_eq!(p.figures().live.0, 20 * MIB, "not split");
        assert_eq!(p.extension(A, 64 * MIB, 0), None);
        p.free(s).unwrap();
        p.free(s + 16 * MIB).unwrap();
        assert_eq!(p.kept_free(), (20 * MIB, 2), "side by side, not merged");
        assert_eq!(
            p.take(A, 5 * MIB, 0).unwrap(),
            None,
            "16 MiB wastes too much for 5"
        );
        assert_eq!(p.take(A, 8 * MIB, 0).unwrap(), Some(s));
        assert_eq!(p.take(A, 3 * MIB, 0).unwrap(), Some(s + 16 * MIB));
        check_books(&p).unwrap();
        let state = p.checkpoint(A).unwrap();
        p.free(s).unwrap();
        p.restore(A, &state).unwrap();
        assert_eq!(p.checkpoint(A).unwrap(), state);
        check_books(&p).unwrap();
    }

    #[test]
    fn release_returns_free_segments_now_and_the_others_when_freed() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(A); // a second graph shares it
        p.adopt(A, 0x20_0000, 2 * MIB, 4096, 0).unwrap();
        p.adopt(A, 0x80_0000, 2 * MIB, 4096, 1).unwrap();
        p.free(0x20_0000).unwrap();
        assert_eq!(p.release(A).unwrap(), Vec::<u64>::new(), "still used once");
        assert_eq!(p.release(A).unwrap(), vec![0x20_0000]);
        assert_eq!(p.use_count(A), 0);
        assert!(p.take(A, 16, 0).is_err(), "a released pool takes nothing");
        assert_eq!(
            p.free(0x80_0000).unwrap().0,
            Freed::Released(vec![0x80_0000])
        );
        assert_eq!(p.pool_count(), 0);
        assert!(p.release(A).is_err());
        check_books(&p).unwrap();
    }

    #[test]
    fn segments_of_pools_never_overlap() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.adopt(A, 0x40_0000, 4 * MIB, 4 * MIB, 0).unwrap();
        assert!(p.adopt(A, 0x60_0000, 2 * MIB, 16, 0).is_err());
        assert!(p.adopt(A, 0x20_0000, 4 * MIB, 4 * MIB, 0).is_err());
        assert!(
            p.adopt(A, 0x80_0000, 2 * MIB, 4 * MIB, 0).is_err(),
            "too small for the request"
        );
        assert!(p.adopt_free(A, 0x80_0000, 0, 0).is_err());
        assert!(
            p.adopt(B, 0x80_0000, 2 * MIB, 16, 0).is_err(),
            "B is not in use"
        );
        check_books(&p).unwrap();
    }

    fn live(p: &PrivatePools, id: PoolId) -> Vec<u64> {
        p.live_blocks(id).unwrap()
    }

    #[test]
    fn a_restore_frees_what_is_live_and_hands_back_what_was_live_at_the_same_addresses() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        let s = 0x4000_0000u64;
        p.adopt(A, s, 12 * MIB, 4 * MIB, 7).unwrap(); // live at the checkpoint
        let b = p.take(A, 4 * MIB, 7).unwrap().unwrap(); // live at the checkpoint, and after
        let c = p.take(A, 4 * MIB, 7).unwrap().unwrap();
        p.free(c).unwrap(); // free at the checkpoint
        let state = p.checkpoint(A).unwrap();
        assert_eq!(
            state
                .iter()
                .map(|c| (c.ptr, c.size, c.live))
                .collect::<Vec<_>>(),
            vec![(s, 4 * MIB, 1), (b, 4 * MIB, 1), (c, 4 * MIB, 0)]
        );
        // Since: s freed, 6 MiB over s and c's space... and a new segment.
        p.free(s).unwrap();
        let x = p.take(A, 2 * MIB, 7).unwrap().unwrap();
        let mut next = s + 12 * MIB;
        let y = alloc(&mut p, A, 8 * MIB, 7, &mut next, false);
        assert_eq!((x, y), (s, s + 12 * MIB));
        assert_eq!(live(&p, A), vec![s, b, y]);

        let r = p.restore(A, &state).unwrap();
        check_books(&p).unwrap();
        let ptrs = |v: &[CheckpointBlock]| v.iter().map(|c| c.ptr).collect::<Vec<_>>();
        assert_eq!(ptrs(&r.freed), vec![s, b, y]);
        assert_eq!(ptrs(&r.allocated), vec![s, b]);
        assert_eq!(live(&p, A), vec![s, b]);
        // What was free at the checkpoint, and what came since, is the
        // pool's, free (one block: the new segment lies right after).
        assert_eq!(p.kept_free(), (4 * MIB + 8 * MIB, 1));
        assert!(p.is_kept_free(c) && p.segment_of(y) == Some(y));
        // The restored blocks are freed as any other; the pool hands out its free ones.
        assert_eq!(p.free(s).unwrap().0, Freed::KeptByPool);
        assert!(p.free(s).is_err(), "a double free is refused");
        assert_eq!(p.take(A, 4 * MIB, 7).unwrap(), Some(s));
        // Restoring again gives the same state, the pool's blocks as they were.
        p.restore(A, &state).unwrap();
        assert_eq!(live(&p, A), vec![s, b]);
        let again = p.checkpoint(A).unwrap();
        assert_eq!(&again[..2], &state[..2]);
        assert_eq!(
            (again[2].ptr, again[2].size, again[2].live),
            (c, 12 * MIB, 0),
            "merged with the new segment"
        );
        assert_eq!(again.len(), 3);
        check_books(&p).unwrap();
    }

    #[test]
    fn a_restore_touches_only_its_pool() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x20_0000, 2 * MIB, 4096, 0).unwrap();
        p.adopt(B, 0x40_0000, 2 * MIB, 4096, 0).unwrap();
        let state = p.checkpoint(A).unwrap();
        let b2 = p.take(B, 4096, 0).unwrap().unwrap();
        p.restore(A, &state).unwrap();
        assert_eq!(live(&p, B), vec![0x40_0000, b2]);
        assert_eq!(live(&p, A), vec![0x20_0000]);
        check_books(&p).unwrap();
    }

    #[test]
    fn a_state_that_no_longer_matches_the_pool_is_refused_and_changes_nothing() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x20_0000, 2 * MIB, 4096, 0).unwrap();
        p.adopt(B, 0x40_0000, 2 * MIB, 4096, 0).unwrap();
        let a2 = p.take(A, 4096, 0).unwrap().unwrap();
        let state = p.checkpoint(A).unwrap();
        let with = |f: &dyn Fn(&mut CheckpointBlock)| {
            let mut s = state.clone();
            f(&mut s[0]);
            s
        };
        let bad = [
            with(&|c| c.ptr = 0x40_0000),   // another pool's segment
            with(&|c| c.ptr = 0x9000_0000), // no segment at all
            with(&|c| c.size = 4 * MIB),    // past the pool's memory
            with(&|c| c.size = 0),          // no block
            with(&|c| c.stream = 3),        // another stream
            with(&|c| c.ptr = a2),          // listed twice
        ];
        p.free(a2).unwrap();
        let before = p.checkpoint(A).unwrap();
        for s in &bad {
            let e = p.restore(A, s).unwrap_err();
            assert!(e.contains("setCheckpointPoolState"), "{e}");
            assert_eq!(p.checkpoint(A).unwrap(), before, "nothing changed");
        }
        assert!(
            p.restore(B, &[]).is_ok(),
            "an empty state frees the pool's blocks"
        );
        assert_eq!(live(&p, B), Vec::<u64>::new());
        assert_eq!(p.kept_free().0, 2 * MIB + p.kept_free().0 - 2 * MIB);
        check_books(&p).unwrap();
    }

    #[test]
    fn unknown_and_released_pools_are_not_checkpointed() {
        let mut p = PrivatePools::default();
        assert!(p.checkpoint(A).unwrap_err().contains("could not find pool"));
        assert!(p.restore(A, &[]).is_err());
        assert!(p.live_blocks(A).is_err());
        p.create_or_incref(A);
        assert_eq!(p.checkpoint(A).unwrap(), vec![]);
        p.adopt(A, 0x20_0000, 2 * MIB, 4096, 0).unwrap();
        let state = p.checkpoint(A).unwrap();
        p.release(A).unwrap();
        // Released, with a live block: it exists until the block is freed.
        assert_eq!(live(&p, A), vec![0x20_0000]);
        assert!(p.checkpoint(A).unwrap_err().contains("released"));
        assert!(p.restore(A, &state).unwrap_err().contains("released"));
        assert_eq!(
            p.free(0x20_0000).unwrap().0,
            Freed::Released(vec![0x20_0000])
        );
        assert!(p.live_blocks(A).is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Incref(usize),
        Release(usize),
        Alloc {
            pool: Option<usize>,
            size: u64,
            stream: u64,
            lands: bool,
        },
        Free(usize),
    }

    /// Sizes from 256 bytes to 9 MiB, small ones as often as large.
    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![1..(MIB + 1), (MIB + 1)..(9 * MIB)]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3usize).prop_map(Op::Incref),
            (0..3usize).prop_map(Op::Release),
            (prop::option::of(0..3usize), size(), 0..2u64, any::<bool>()).prop_map(
                |(pool, size, stream, lands)| {
                    Op::Alloc {
                        pool,
                        size,
                        stream,
                        lands,
                    }
                }
            ),
            (0..64usize).prop_map(Op::Free),
            (0..64usize).prop_map(Op::Free),
        ]
    }

    const IDS: [PoolId; 3] = [(1, 0), (0, 1), (2, 0)];

    proptest! {
        /// Against a model of Quilt (the segments it has handed out): what
        /// torch holds never overlaps; a pool's memory never serves
        /// anything outside its pool or stream; the books hold together
        /// after every operation; once every pool is released and every
        /// block freed, all memory is back with Quilt.
        #[test]
        fn no_pool_memory_escapes_and_all_comes_back(ops in prop::collection::vec(op(), 1..150)) {
            let mut p = PrivatePools::default();
            // Quilt's blocks: address -> bytes (segments, and blocks of no pool).
            let mut quilt: BTreeMap<u64, u64> = BTreeMap::new();
            let mut next = 0x10_0000_0000u64;
            // What torch holds: (ptr, bytes, pool, stream).
            let mut held: Vec<(u64, u64, Option<PoolId>, u64)> = Vec::new();
            let mut counts: HashMap<PoolId, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Incref(i) => {
                        p.create_or_incref(IDS[i]);
                        *counts.entry(IDS[i]).or_default() += 1;
                    }
                    Op::Release(i) => {
                        let c = counts.entry(IDS[i]).or_default();
                        let got = p.release(IDS[i]);
                        if *c == 0 {
                            prop_assert!(got.is_err());
                        } else {
                            *c -= 1;
                            for ptr in got.unwrap() {
                                let n = quilt.remove(&ptr);
                                prop_assert!(n.is_some(), "{ptr:#x} returned twice");
                                let n = n.unwrap();
                                prop_assert!(held.iter().all(|h| h.0 + h.1 <= ptr || ptr + n <= h.0), "{ptr:#x} is held");
                            }
                        }
                    }
                    Op::Alloc { pool, size, stream, lands } => {
                        let id = pool.map(|i| IDS[i]);
                        let ptr = match id {
                            Some(id) if counts.get(&id).copied().unwrap_or(0) > 0 => {
                                let before: BTreeSet<u64> = p.segments.keys().copied().collect();
                                let ptr = alloc(&mut p, id, size, stream, &mut next, lands);
                                for (&s, g) in &p.segments {
                                    if !before.contains(&s) {
                                        quilt.insert(s, g.size);
                                    }
                                }
                                prop_assert_eq!(p.owner(ptr), Some(id));
                                let s = p.segment_of(ptr).unwrap();
                                prop_assert_eq!((p.segments[&s].pool, p.segments[&s].stream), (id, stream));
                                ptr
                            }
                            Some(id) => {
                                prop_assert!(p.take(id, size, stream).is_err());
                                continue;
                            }
                            None => {
                                let ptr = next;
                                next += segment_size(size);
                                quilt.insert(ptr, segment_size(size));
                                ptr
                            }
                        };
                        prop_assert!(held.iter().all(|h| h.0 + h.1 <= ptr || ptr + size <= h.0), "{ptr:#x} overlaps a held block");
                        held.push((ptr, size, id, stream));
                    }
                    Op::Free(i) => {
                        if held.is_empty() {
                            continue;
                        }
                        let (ptr, _, id, stream) = held.remove(i % held.len());
                        match p.free(ptr).unwrap() {
                            (Freed::KeptByPool, b) => {
                                prop_assert!(p.is_used(id.unwrap()));
                                prop_assert_eq!(b.unwrap().stream, stream);
                            }
                            (Freed::Released(back), _) => {
                                prop_assert!(!p.is_used(id.unwrap()));
                                for s in back {
                                    prop_assert!(quilt.remove(&s).is_some());
                                }
                            }
                            (Freed::NotPooled, _) => {
                                prop_assert!(id.is_none());
                                prop_assert!(quilt.remove(&ptr).is_some());
                            }
                        }
                    }
                }
                check_books(&p).map_err(TestCaseError::fail)?;
                // Every segment is Quilt's; a released pool keeps no wholly free one.
                for (&s, g) in &p.segments {
                    prop_assert_eq!(quilt.get(&s), Some(&g.size));
                    if !p.is_used(g.pool) {
                        prop_assert!(!p.is_wholly_free(s), "a released pool keeps {s:#x}");
                    }
                }
                for (ptr, _, id, _) in &held {
                    prop_assert_eq!(p.owner(*ptr), *id);
                }
                for (&id, &c) in &counts {
                    prop_assert_eq!(p.use_count(id), c);
                }
            }
            // Everything back.
            for (ptr, _, _, _) in std::mem::take(&mut held) {
                match p.free(ptr).unwrap().0 {
                    Freed::KeptByPool => {}
                    Freed::Released(back) => back.iter().for_each(|s| { quilt.remove(s); }),
                    Freed::NotPooled => { quilt.remove(&ptr); }
                }
            }
            for (&id, &c) in &counts {
                for _ in 0..c {
                    for ptr in p.release(id).unwrap() {
                        quilt.remove(&ptr);
                    }
                }
            }
            prop_assert!(quilt.is_empty(), "left with Quilt: {quilt:?}");
            prop_assert_eq!(p.pool_count(), 0);
            prop_assert!(p.is_empty());
            prop_assert_eq!(p.kept_free(), (0, 0));
            check_books(&p).map_err(TestCaseError::fail)?;
        }
    }

    /// One pool's allocations and frees, as (is an allocation, size,
    /// stream, whether an extension lands, which held block to free).
    fn pool_ops() -> impl Strategy<Value = Vec<(bool, u64, u64, bool, usize)>> {
        prop::collection::vec(
            (any::<bool>(), size(), 0..2u64, any::<bool>(), 0..32usize),
            0..40,
        )
    }

    fn run_pool_ops(
        p: &mut PrivatePools,
        ops: &[(bool, u64, u64, bool, usize)],
        held: &mut Vec<u64>,
        next: &mut u64,
    ) {
        for &(is_alloc, size, stream, lands, i) in ops {
            if is_alloc {
                let ptr = alloc(p, A, size, stream, next, lands);
                assert!(!held.contains(&ptr), "{ptr:#x} handed out twice");
                held.push(ptr);
            } else if !held.is_empty() {
                let ptr = held.remove(i % held.len());
                assert_eq!(p.free(ptr).unwrap().0, Freed::KeptByPool);
            }
            check_books(p).unwrap();
        }
    }

    proptest! {
        /// Whatever happened since a checkpoint, a restore leaves handed
        /// out exactly the blocks handed out at the checkpoint, at their
        /// addresses, with the pool carved exactly as it was where it had
        /// memory then; everything else the pool has is free and serves its
        /// later allocations; the books hold together.
        #[test]
        fn a_restore_gives_back_the_checkpoint(before in pool_ops(), after in pool_ops(), later in pool_ops()) {
            let mut p = PrivatePools::default();
            p.create_or_incref(A);
            let mut held = Vec::new();
            let mut next = 0x10_0000_0000u64;
            run_pool_ops(&mut p, &before, &mut held, &mut next);
            let state = p.checkpoint(A).unwrap();
            let end_then = next;
            let mut at_checkpoint = held.clone();
            at_checkpoint.sort_unstable();
            run_pool_ops(&mut p, &after, &mut held, &mut next);
            let r = p.restore(A, &state).unwrap();
            check_books(&p).map_err(TestCaseError::fail)?;
            let mut now_live = held.clone();
            now_live.sort_unstable();
            prop_assert_eq!(r.freed.iter().map(|c| c.ptr).collect::<Vec<_>>(), now_live);
            prop_assert_eq!(r.allocated.iter().map(|c| c.ptr).collect::<Vec<_>>(), at_checkpoint.clone());
            prop_assert_eq!(p.live_blocks(A).unwrap(), at_checkpoint.clone());
            // The pool is carved as at the checkpoint: each block there
            // again, a free one perhaps merged with memory gained since
            // right after it (segments come at higher addresses).
            let again: BTreeMap<u64, CheckpointBlock> = p.checkpoint(A).unwrap().into_iter().map(|c| (c.ptr, c)).collect();
            for c in &state {
                let Some(a) = again.get(&c.ptr) else {
                    return Err(TestCaseError::fail(format!("{c:?} not restored")));
                };
                prop_assert_eq!((a.live, a.requested, a.stream), (c.live, c.requested, c.stream));
                if c.live == 1 || c.ptr + c.size < end_then {
                    prop_assert_eq!(a.size, c.size);
                } else {
                    prop_assert!(a.size >= c.size);
                }
            }
            // torch holds what the checkpoint held; the pool goes on.
            held = at_checkpoint;
            run_pool_ops(&mut p, &later, &mut held, &mut next);
            held.sort_unstable();
            prop_assert_eq!(p.live_blocks(A).unwrap(), held.clone());
            for ptr in held {
                p.free(ptr).unwrap();
            }
            let mut back = p.release(A).unwrap();
            back.sort_unstable();
            prop_assert_eq!(back.len() as u64, p.figures().segments_freed_total.1);
            prop_assert_eq!(p.pool_count(), 0);
            prop_assert!(p.is_empty());
        }
    }
}
