//! The caching allocator's invariant checker: recompute everything from the block
//! structures and compare.

use std::collections::HashMap;

use super::block::{size_key, SegmentKind};
use super::config::CachingSettings;
use super::State;
use crate::error::InvariantViolation;
use crate::stats::Stat;

fn fail<T>(msg: String) -> Result<T, InvariantViolation> {
    Err(InvariantViolation(msg))
}

/// Check every invariant of `st`; the first violation found is returned.
pub(super) fn check(cfg: &CachingSettings, st: &State) -> Result<(), InvariantViolation> {
    check_index(st)?;
    check_segments(st)?;
    check_pools(st)?;
    check_events(st)?;
    check_stats(cfg, st)
}

/// `by_addr` names every block exactly once, at its start.
fn check_index(st: &State) -> Result<(), InvariantViolation> {
    if st.by_addr.len() != st.blocks.len() {
        return fail(format!(
            "address index holds {} entries for {} blocks",
            st.by_addr.len(),
            st.blocks.len()
        ));
    }
    for (&ptr, &bid) in &st.by_addr {
        if !st.blocks.contains(bid) || st.blocks[bid].ptr != ptr {
            return fail(format!(
                "address index entry {ptr:#x} names a stale block {bid}"
            ));
        }
    }
    Ok(())
}

/// Blocks tile each segment in linked address order; free neighbours are merged;
/// expandable pages are mapped exactly where mapped blocks lie.
fn check_segments(st: &State) -> Result<(), InvariantViolation> {
    let mut seen = 0usize;
    for (sid, seg) in st.segments.iter() {
        let end = seg.base + seg.size;
        let mut expect = seg.base;
        let mut prev: Option<usize> = None;
        let mut mapped_bytes = 0u64;
        for (_, &bid) in st.by_addr.range(seg.base..end) {
            let b = &st.blocks[bid];
            seen += 1;
            if b.segment != sid || b.stream != seg.stream || b.pool != seg.pool {
                return fail(format!(
                    "block {:#x} disagrees with its segment {:#x}",
                    b.ptr, seg.base
                ));
            }
            if b.size == 0 || b.ptr != expect {
                return fail(format!(
                    "segment {:#x}: block at {:#x} (size {}) where {expect:#x} was expected",
                    seg.base, b.ptr, b.size
                ));
            }
            if b.prev != prev {
                return fail(format!("block {:#x}: prev link broken", b.ptr));
            }
            if let Some(p) = prev {
                let pb = &st.blocks[p];
                if pb.next != Some(bid) {
                    return fail(format!("block {:#x}: next link broken", pb.ptr));
                }
                if pb.is_free() && b.is_free() && pb.mapped == b.mapped {
                    return fail(format!(
                        "free neighbours {:#x} and {:#x} are not merged",
                        pb.ptr, b.ptr
                    ));
                }
            }
            if b.mapped {
                mapped_bytes += b.size;
            }
            expect = b.end();
            prev = Some(bid);
        }
        if expect != end {
            return fail(format!(
                "segment {:#x}+{:#x}: blocks end at {expect:#x}",
                seg.base, seg.size
            ));
        }
        if let Some(p) = prev {
            if st.blocks[p].next.is_some() {
                return fail(format!(
                    "last block of segment {:#x} has a next link",
                    seg.base
                ));
            }
        }
        match &seg.kind {
            SegmentKind::Classic { .. } => {
                if mapped_bytes != seg.size {
                    return fail(format!(
                        "classic segment {:#x} has unmapped blocks",
                        seg.base
                    ));
                }
            }
            SegmentKind::Expandable { page, handles } => {
                check_pages(st, seg.base, seg.size, *page, handles)?;
                let pages = handles.iter().filter(|h| h.is_some()).count() as u64;
                if pages * page != mapped_bytes {
                    return fail(format!(
                        "expandable segment {:#x}: {pages} pages mapped but mapped blocks hold {mapped_bytes} bytes",
                        seg.base
                    ));
                }
            }
        }
    }
    if seen != st.blocks.len() {
        return fail(format!(
            "{} blocks lie outside every segment",
            st.blocks.len() - seen
        ));
    }
    Ok(())
}

/// Unmapped blocks of an expandable segment are page-aligned and have no page
/// mapped; every page under a mapped block is mapped.
fn check_pages(
    st: &State,
    base: u64,
    size: u64,
    page: u64,
    handles: &[Option<quilt_vmm::PhysHandle>],
) -> Result<(), InvariantViolation> {
    for (_, &bid) in st.by_addr.range(base..base + size) {
        let b = &st.blocks[bid];
        let first = (b.ptr - base) / page;
        let last = (b.end() - base).div_ceil(page);
        if b.mapped {
            for i in first..last {
                if !handles.get(i as usize).is_some_and(Option::is_some) {
                    return fail(format!(
                        "mapped block {:#x} lies on unmapped page {i}",
                        b.ptr
                    ));
                }
            }
        } else {
            if !(b.ptr - base).is_multiple_of(page) || !b.size.is_multiple_of(page) {
                return fail(format!("unmapped block {:#x} is not page-aligned", b.ptr));
            }
            for i in first..last.min(handles.len() as u64) {
                if handles[i as usize].is_some() {
                    return fail(format!(
                        "unmapped block {:#x} lies on mapped page {i}",
                        b.ptr
                    ));
                }
            }
        }
    }
    Ok(())
}

/// A block is in its pool's free set exactly when free and mapped, in the
/// unmapped set exactly when unmapped, under its current key.
fn check_pools(st: &State) -> Result<(), InvariantViolation> {
    let mut want_free = 0;
    let mut want_unmapped = 0;
    for (bid, b) in st.blocks.iter() {
        let pool = &st.pools[b.pool.index()];
        let in_free = pool.blocks.get(&size_key(b)) == Some(&bid);
        let in_unmapped = pool.unmapped.get(&(b.stream, b.ptr)) == Some(&bid);
        if b.allocated && b.event_count > 0 {
            return fail(format!("allocated block {:#x} has pending events", b.ptr));
        }
        if !b.allocated && !b.stream_uses.is_empty() {
            return fail(format!("free block {:#x} keeps stream uses", b.ptr));
        }
        if b.stream_uses.contains(&b.stream) {
            return fail(format!(
                "block {:#x} records a use on its own stream",
                b.ptr
            ));
        }
        if !b.mapped && (b.allocated || b.event_count > 0) {
            return fail(format!("unmapped block {:#x} is in use", b.ptr));
        }
        if in_free != (b.is_free() && b.mapped) {
            return fail(format!(
                "block {:#x}: in free set = {in_free}, but free = {}, mapped = {}",
                b.ptr,
                b.is_free(),
                b.mapped
            ));
        }
        if in_unmapped == b.mapped {
            return fail(format!("block {:#x}: unmapped-set membership wrong", b.ptr));
        }
        if b.is_free() && b.requested != 0 {
            return fail(format!("free block {:#x} keeps a requested size", b.ptr));
        }
        want_free += usize::from(in_free);
        want_unmapped += usize::from(in_unmapped);
    }
    let have_free: usize = st.pools.iter().map(|p| p.blocks.len()).sum();
    let have_unmapped: usize = st.pools.iter().map(|p| p.unmapped.len()).sum();
    if have_free != want_free || have_unmapped != want_unmapped {
        return fail(format!(
            "pool sets hold {have_free} free / {have_unmapped} unmapped entries, blocks say {want_free} / {want_unmapped}"
        ));
    }
    Ok(())
}

/// Every pending block has exactly `event_count` queued events.
fn check_events(st: &State) -> Result<(), InvariantViolation> {
    let mut queued: HashMap<usize, u32> = HashMap::new();
    for queue in st.events.values() {
        if queue.is_empty() {
            return fail("an empty event queue is kept".into());
        }
        for &(_, bid) in queue {
            if !st.blocks.contains(bid) {
                return fail(format!("event queued for a stale block {bid}"));
            }
            *queued.entry(bid).or_default() += 1;
        }
    }
    for (bid, b) in st.blocks.iter() {
        let n = queued.get(&bid).copied().unwrap_or(0);
        if n != b.event_count {
            return fail(format!(
                "block {:#x}: event_count {} but {n} queued events",
                b.ptr, b.event_count
            ));
        }
    }
    Ok(())
}

fn check_stat(name: &str, stat: &Stat, actual: u64) -> Result<(), InvariantViolation> {
    if stat.current != actual {
        return fail(format!(
            "stat {name}: current {} but counted {actual}",
            stat.current
        ));
    }
    if stat.allocated.checked_sub(stat.freed) != Some(stat.current) || stat.peak < stat.current {
        return fail(format!("stat {name} is inconsistent: {stat:?}"));
    }
    Ok(())
}

/// Every statistic equals what it counts.
fn check_stats(cfg: &CachingSettings, st: &State) -> Result<(), InvariantViolation> {
    let (mut alloc_n, mut alloc_b, mut active_n, mut active_b, mut req_b) = (0, 0, 0, 0, 0);
    let (mut split_n, mut split_b, mut oversize_n) = (0, 0, 0);
    for (_, b) in st.blocks.iter() {
        if b.allocated {
            alloc_n += 1;
            alloc_b += b.size;
            if b.size >= cfg.max_split_size {
                oversize_n += 1;
            }
        }
        if b.allocated || b.event_count > 0 {
            active_n += 1;
            active_b += b.size;
            req_b += b.requested;
        }
        if b.is_free() && b.mapped && b.is_split() && !st.segments[b.segment].is_expandable() {
            split_n += 1;
            split_b += b.size;
        }
    }
    let (mut seg_n, mut reserved, mut oversize_seg) = (0, 0, 0);
    for (_, seg) in st.segments.iter() {
        match &seg.kind {
            SegmentKind::Classic { .. } => {
                seg_n += 1;
                reserved += seg.size;
                if seg.size >= cfg.max_split_size {
                    oversize_seg += 1;
                }
            }
            SegmentKind::Expandable { page, handles } => {
                reserved += page * handles.iter().filter(|h| h.is_some()).count() as u64;
            }
        }
    }
    let s = &st.stats;
    check_stat("allocation", &s.allocation, alloc_n)?;
    check_stat("allocated_bytes", &s.allocated_bytes, alloc_b)?;
    check_stat("active", &s.active, active_n)?;
    check_stat("active_bytes", &s.active_bytes, active_b)?;
    check_stat("requested_bytes", &s.requested_bytes, req_b)?;
    check_stat("inactive_split", &s.inactive_split, split_n)?;
    check_stat("inactive_split_bytes", &s.inactive_split_bytes, split_b)?;
    check_stat("segment", &s.segment, seg_n)?;
    check_stat("reserved_bytes", &s.reserved_bytes, reserved)?;
    check_stat("oversize_allocations", &st.oversize_allocations, oversize_n)?;
    check_stat("oversize_segments", &st.oversize_segments, oversize_seg)?;
    if st.total_allocated_memory != reserved {
        return fail(format!(
            "total_allocated_memory {} but segments hold {reserved}",
            st.total_allocated_memory
        ));
    }
    Ok(())
}
