//! Expandable segments (reference §6): one large virtual range per (stream,
//! pool), mapped page by page at the lowest gap that fits, one physical handle
//! per page, unmapped only by `release_cached_blocks`.

use quilt_vmm::{DevicePtr, PhysHandle};

use super::block::{size_key, Block, BlockId, Segment, SegmentKind};
use super::{
    give_back, insert_into_blocks, try_merge_blocks, CachingAllocator, Orphan, Params, State,
};
use crate::error::AllocError;

impl CachingAllocator {
    /// Page size of a pool's expandable segments.
    fn page_of(&self, pool: super::PoolKind) -> u64 {
        match pool {
            super::PoolKind::Small => self.cfg.small_page,
            super::PoolKind::Large => self.cfg.large_page,
        }
    }

    /// `try_allocate_expandable_block` (§6.3): map enough pages behind the lowest
    /// run of free and unmapped space that holds `p.size`, and take the result
    /// out of the free set. `Ok(None)` when the device cannot back it.
    pub(super) fn try_allocate_expandable_block(
        &self,
        st: &mut State,
        p: &Params,
    ) -> Result<Option<BlockId>, AllocError> {
        let Some(mut cand) = self.find_expandable_block(st, p)? else {
            return Ok(None);
        };
        if !st.blocks[cand].mapped {
            let n = st.blocks[cand].size.min(p.size);
            if !self.map_block(st, cand, n)? {
                return Ok(None);
            }
        }
        while st.blocks[cand].size < p.size {
            let remaining = p.size - st.blocks[cand].size;
            let Some(next) = st.blocks[cand].next else {
                return Ok(None);
            };
            if st.blocks[next].mapped || st.blocks[next].allocated {
                return Ok(None);
            }
            let n = remaining.min(st.blocks[next].size);
            if !self.map_block(st, next, n)? {
                return Ok(None);
            }
            cand = next;
        }
        let key = size_key(&st.blocks[cand]);
        st.pools[p.pool.index()].blocks.remove(&key);
        Ok(Some(cand))
    }

    /// `find_expandable_block`: the lowest-addressed unmapped range of this
    /// stream (starting at the free block just before it, if any) from which a
    /// chain of free and unmapped blocks holds `p.size` bytes; otherwise a new
    /// expandable segment. `Ok(None)` when no address space can be reserved.
    fn find_expandable_block(
        &self,
        st: &mut State,
        p: &Params,
    ) -> Result<Option<BlockId>, AllocError> {
        let allocatable = |st: &State, b: Option<BlockId>| {
            b.is_some_and(|b| !st.blocks[b].allocated && st.blocks[b].event_count == 0)
        };
        let pool = &st.pools[p.pool.index()];
        for (&(stream, _), &id) in pool.unmapped.range((p.stream, 0)..) {
            if stream != p.stream {
                break;
            }
            let mut c = id;
            if let Some(pv) = st.blocks[id].prev {
                if allocatable(st, Some(pv)) {
                    c = pv;
                }
            }
            let mut bytes = 0u64;
            let mut b = Some(c);
            while bytes < p.size && allocatable(st, b) {
                if let Some(id) = b {
                    bytes += st.blocks[id].size;
                    b = st.blocks[id].next;
                }
            }
            if bytes >= p.size {
                return Ok(Some(c));
            }
        }
        let page = self.page_of(p.pool);
        let va = self
            .cfg
            .expandable_va_bytes
            .div_ceil(page)
            .saturating_mul(page);
        let base = match self.vmm.reserve(va, 0) {
            Ok(b) => b,
            Err(e) if e.is_out_of_memory() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let seg = st.segments.insert(Segment {
            base,
            size: va,
            stream: p.stream,
            pool: p.pool,
            kind: SegmentKind::Expandable {
                page,
                handles: Vec::new(),
            },
        });
        let bid = st
            .blocks
            .insert(Block::free(base, va, p.stream, p.pool, seg, false));
        st.by_addr.insert(base, bid);
        st.pools[p.pool.index()]
            .unmapped
            .insert((p.stream, base), bid);
        Ok(Some(bid))
    }

    /// `map_block` (§6.4): map the pages covering the first `size` bytes of the
    /// unmapped block `bid` (create one handle per page, map each, one
    /// set-access over the run), split off the rest as a new unmapped block,
    /// merge with free mapped neighbours and insert into the free set.
    /// `Ok(false)` when the device is out of memory (nothing changed).
    fn map_block(&self, st: &mut State, bid: BlockId, size: u64) -> Result<bool, AllocError> {
        let b = &st.blocks[bid];
        let seg_id = b.segment;
        let seg = &st.segments[seg_id];
        let SegmentKind::Expandable { page, .. } = seg.kind else {
            return Ok(false);
        };
        let base = seg.base;
        let begin = (b.ptr - base) / page;
        let end = (b.ptr + size - base).div_ceil(page);
        if begin >= end {
            return Ok(false);
        }
        let vmm = &*self.vmm;
        let mut handles: Vec<PhysHandle> = Vec::with_capacity((end - begin) as usize);
        let orphans = &mut st.orphans;
        let mut undo = |handles: &[PhysHandle], mapped: usize| {
            for (k, h) in handles.iter().enumerate() {
                if k < mapped {
                    let at = base + (begin + k as u64) * page;
                    let _ = give_back(vmm, orphans, Orphan::Mapping(at, page));
                }
                let _ = give_back(vmm, orphans, Orphan::Handle(*h));
            }
        };
        for _ in begin..end {
            match vmm.create(page) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    undo(&handles, 0);
                    return if e.is_out_of_memory() {
                        Ok(false)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        for (k, h) in handles.iter().enumerate() {
            if let Err(e) = vmm.map(base + (begin + k as u64) * page, page, *h, 0) {
                undo(&handles, k);
                return if e.is_out_of_memory() {
                    Ok(false)
                } else {
                    Err(e.into())
                };
            }
        }
        if let Err(e) = vmm.set_access(base + begin * page, (end - begin) * page) {
            undo(&handles, handles.len());
            return if e.is_out_of_memory() {
                Ok(false)
            } else {
                Err(e.into())
            };
        }
        if let SegmentKind::Expandable { handles: slots, .. } = &mut st.segments[seg_id].kind {
            if slots.len() < end as usize {
                slots.resize(end as usize, None);
            }
            for (k, h) in handles.into_iter().enumerate() {
                slots[begin as usize + k] = Some(h);
            }
        }
        let mapped = (end - begin) * page;

        let b = &mut st.blocks[bid];
        let (ptr, stream, pool, old_size, next) = (b.ptr, b.stream, b.pool, b.size, b.next);
        st.pools[pool.index()].unmapped.remove(&(stream, ptr));
        b.mapped = true;
        if mapped < old_size {
            b.size = mapped;
            let rest = st.blocks.insert(Block {
                prev: Some(bid),
                next,
                ..Block::free(ptr + mapped, old_size - mapped, stream, pool, seg_id, false)
            });
            if let Some(nx) = next {
                st.blocks[nx].prev = Some(rest);
            }
            st.blocks[bid].next = Some(rest);
            st.by_addr.insert(ptr + mapped, rest);
            st.pools[pool.index()]
                .unmapped
                .insert((stream, ptr + mapped), rest);
        }
        let (prev, next) = (st.blocks[bid].prev, st.blocks[bid].next);
        try_merge_blocks(st, bid, prev);
        try_merge_blocks(st, bid, next);
        insert_into_blocks(st, bid);
        st.total_allocated_memory += mapped;
        st.stats.reserved_bytes.increase(mapped);
        Ok(true)
    }

    /// `unmap_block` (§6.5): unmap the pages lying wholly inside the free block
    /// `bid` (after synchronising its stream), leaving `[free before][unmapped]
    /// [free after]`; the unmapped part merges with unmapped neighbours. If a
    /// driver call fails part-way, the pages already unmapped are accounted for
    /// and the error is returned.
    pub(super) fn unmap_block(&self, st: &mut State, bid: BlockId) -> Result<(), AllocError> {
        let b = &st.blocks[bid];
        let seg_id = b.segment;
        let seg = &st.segments[seg_id];
        let SegmentKind::Expandable { page, ref handles } = seg.kind else {
            return Ok(());
        };
        let base = seg.base;
        let begin = (b.ptr - base).div_ceil(page);
        let end = (b.end() - base) / page;
        if begin >= end {
            return Ok(());
        }
        if !st.forgotten.contains(&seg.stream) {
            // A forgotten stream's work was made complete when it was
            // forgotten, and its handle is gone.
            self.vmm.stream_synchronize(seg.stream)?;
        }
        let to_release: Vec<Option<PhysHandle>> = (begin..end)
            .map(|i| handles.get(i as usize).copied().flatten())
            .collect();
        let mut done = begin;
        let mut error = None;
        for (k, h) in to_release.into_iter().enumerate() {
            let i = begin + k as u64;
            if let Err(e) = self.vmm.unmap(base + i * page, page) {
                error = Some(e);
                break;
            }
            if let Some(h) = h {
                if let Err(e) = give_back(&*self.vmm, &mut st.orphans, Orphan::Handle(h)) {
                    error.get_or_insert(e);
                }
            }
            done = i + 1;
        }
        if let SegmentKind::Expandable { handles, .. } = &mut st.segments[seg_id].kind {
            for i in begin..done {
                if let Some(slot) = handles.get_mut(i as usize) {
                    *slot = None;
                }
            }
            while handles.last().is_some_and(Option::is_none) {
                handles.pop();
            }
        }
        if done > begin {
            self.account_unmapped(st, bid, base + begin * page, (done - begin) * page);
        }
        match error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Block bookkeeping of an unmap of `[un_ptr, un_ptr + un_size)` inside the
    /// free mapped block `bid`.
    fn account_unmapped(&self, st: &mut State, bid: BlockId, un_ptr: DevicePtr, un_size: u64) {
        let b = &st.blocks[bid];
        let (ptr, size, stream, pool, seg, prev, next) =
            (b.ptr, b.size, b.stream, b.pool, b.segment, b.prev, b.next);
        let key = size_key(b);
        st.pools[pool.index()].blocks.remove(&key);
        st.by_addr.remove(&ptr);
        let free_piece = |st: &mut State, p: DevicePtr, s: u64, pv, nx| {
            let id = st.blocks.insert(Block {
                prev: pv,
                next: nx,
                ..Block::free(p, s, stream, pool, seg, true)
            });
            st.by_addr.insert(p, id);
            id
        };
        let before = un_ptr - ptr;
        if before > 0 {
            let id = free_piece(st, ptr, before, prev, Some(bid));
            st.blocks[id].handed_out = st.blocks[bid].handed_out;
            if let Some(pv) = prev {
                st.blocks[pv].next = Some(id);
            }
            st.blocks[bid].prev = Some(id);
            insert_into_blocks(st, id);
        }
        let after = size - before - un_size;
        if after > 0 {
            let id = free_piece(st, un_ptr + un_size, after, Some(bid), next);
            if let Some(nx) = next {
                st.blocks[nx].prev = Some(id);
            }
            st.blocks[bid].next = Some(id);
            insert_into_blocks(st, id);
        }
        let b = &mut st.blocks[bid];
        b.ptr = un_ptr;
        b.size = un_size;
        b.mapped = false;
        b.handed_out = false;
        st.by_addr.insert(un_ptr, bid);
        let (prev, next) = (st.blocks[bid].prev, st.blocks[bid].next);
        try_merge_blocks(st, bid, prev);
        try_merge_blocks(st, bid, next);
        let b = &st.blocks[bid];
        st.pools[pool.index()]
            .unmapped
            .insert((b.stream, b.ptr), bid);
        st.total_allocated_memory -= un_size;
        st.stats.reserved_bytes.decrease(un_size);
    }

    /// `release_expandable_segment`: free the address range of an expandable
    /// segment that is one unmapped block.
    pub(super) fn release_expandable_segment(
        &self,
        st: &mut State,
        bid: BlockId,
    ) -> Result<(), AllocError> {
        let b = &st.blocks[bid];
        let (ptr, stream, pool, seg_id) = (b.ptr, b.stream, b.pool, b.segment);
        let seg = &st.segments[seg_id];
        let (base, size) = (seg.base, seg.size);
        self.vmm.address_free(base, size)?;
        st.pools[pool.index()].unmapped.remove(&(stream, ptr));
        st.by_addr.remove(&ptr);
        st.blocks.remove(bid);
        st.segments.remove(seg_id);
        Ok(())
    }
}
