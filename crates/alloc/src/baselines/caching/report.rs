//! Snapshots and out-of-memory reports of the caching allocator.

use quilt_vmm::{StreamId, Vmm};

use super::block::SegmentKind;
use super::config::{CachingSettings, PoolKind};
use super::State;
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};

/// The state of a block as a snapshot shows it.
fn block_state(b: &super::Block) -> BlockState {
    if b.allocated {
        BlockState::Active
    } else if b.event_count > 0 {
        BlockState::PendingFree
    } else if b.mapped {
        BlockState::Inactive
    } else {
        BlockState::Unmapped
    }
}

/// Segments in address order; an expandable segment shows as one segment per
/// contiguous mapped run, as PyTorch's snapshot does.
pub(super) fn snapshot(name: &str, st: &State) -> MemorySnapshot {
    let mut segments = Vec::new();
    let mut segs: Vec<_> = st.segments.iter().map(|(_, s)| s).collect();
    segs.sort_by_key(|s| s.base);
    for seg in segs {
        let end = seg.base + seg.size;
        let expandable = matches!(seg.kind, SegmentKind::Expandable { .. });
        let mut current: Option<SegmentInfo> = None;
        for (_, &bid) in st.by_addr.range(seg.base..end) {
            let b = &st.blocks[bid];
            if !b.mapped {
                segments.extend(current.take());
                continue;
            }
            let info = current.get_or_insert_with(|| SegmentInfo {
                address: b.ptr,
                total_size: 0,
                mapped_size: 0,
                stream: seg.stream,
                kind: if expandable {
                    "expandable"
                } else {
                    seg.pool.name()
                },
                blocks: Vec::new(),
            });
            info.total_size += b.size;
            info.mapped_size += b.size;
            info.blocks.push(BlockInfo {
                address: b.ptr,
                size: b.size,
                requested: b.requested,
                state: block_state(b),
            });
        }
        segments.extend(current.take());
    }
    MemorySnapshot {
        allocator: name.to_string(),
        segments,
    }
}

/// Build the out-of-memory error: figures after the retry chain ran, and the
/// verdict (fragmentation when free cached bytes plus device free cover the
/// new memory the request needed, capacity otherwise). `needed` is the
/// rounded request (the block), `segment` the size of the segment a fixed
/// segment allocator would have created for it (PyTorch's allocation size);
/// with expandable segments the new memory is the block rounded to the
/// granularity (the pages mapped at a segment's end).
#[allow(clippy::too_many_arguments)]
pub(super) fn oom(
    name: &str,
    vmm: &dyn Vmm,
    cfg: &CachingSettings,
    st: &State,
    requested: u64,
    needed: u64,
    segment: u64,
    pool: PoolKind,
    stream: StreamId,
) -> AllocError {
    let info = vmm.mem_info().unwrap_or_default();
    let (capacity, device_free) = match cfg.allowed_memory_maximum {
        Some(max) => (
            max,
            info.free.min(max.saturating_sub(st.total_allocated_memory)),
        ),
        None => (info.total, info.free),
    };
    let reserved = st.total_allocated_memory;
    let reclaimable = reserved.saturating_sub(st.stats.active_bytes.current);
    let largest_cached = st.pools[pool.index()]
        .blocks
        .range((stream, 0, 0)..=(stream, u64::MAX, u64::MAX))
        .next_back()
        .map_or(0, |(k, _)| k.1);
    let gran = vmm.granularity().max(1);
    let largest_free_extent = largest_cached.max(device_free / gran * gran);
    let needed_unbacked = if cfg.expandable {
        needed.div_ceil(gran).saturating_mul(gran)
    } else {
        segment.max(needed)
    };
    let verdict = if reclaimable.saturating_add(device_free) >= needed_unbacked {
        OomVerdict::Fragmentation
    } else {
        OomVerdict::Capacity
    };
    AllocError::OutOfMemory(Box::new(OomReport {
        allocator: name.to_string(),
        requested,
        needed,
        needed_unbacked,
        capacity,
        reserved,
        allocated: st.stats.allocated_bytes.current,
        device_free,
        reclaimable,
        largest_free_extent,
        verdict,
    }))
}
