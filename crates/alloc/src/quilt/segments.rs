//! The memory snapshot: one segment per arena, its blocks and cached gaps.

use super::stitch::{Core, Kind};
use crate::snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};

/// Segments (arenas) with their blocks in address order. Gaps beyond an
/// arena's last mapping are left out; a gap with a mapped page is `Inactive`,
/// one without is `Unmapped`.
pub(crate) fn snapshot(st: &Core, name: &str, page: u64) -> MemorySnapshot {
    let mut segments = Vec::new();
    for (ai, a) in st.arenas.iter().enumerate() {
        if a.size == 0 {
            continue; // a released growable buffer's slot
        }
        let (stream, kind) = st.arena_meta[ai];
        let high = a
            .mapped_end()
            .max(a.occupied().last().map(|(_, e)| e).unwrap_or(0));
        let mut blocks = Vec::new();
        for (s, e) in a.occupied() {
            let b = st.blocks.get(&(a.base + s));
            blocks.push(BlockInfo {
                address: a.base + s,
                size: e - s,
                requested: b.map(|b| b.requested).unwrap_or(0),
                state: occupied_state(st, a.base + s),
            });
        }
        for (s, e) in a.gaps().take_while(|&(s, _)| s < high) {
            let e = e.min(high);
            let (f, l) = a.page_span(s, e - s);
            let mapped = (f..=l).any(|p| a.slot(p).phys.is_some());
            blocks.push(BlockInfo {
                address: a.base + s,
                size: e - s,
                requested: 0,
                state: if mapped {
                    BlockState::Inactive
                } else {
                    BlockState::Unmapped
                },
            });
        }
        blocks.sort_by_key(|b| b.address);
        segments.push(SegmentInfo {
            address: a.base,
            total_size: a.size,
            mapped_size: a.mapped_pages * page,
            stream: stream.unwrap_or_default(),
            kind: match (stream, kind) {
                (_, Kind::Own) => "growable",
                (_, Kind::Isolated(_)) => "tagged",
                (_, Kind::Apart) => "apart",
                (None, _) => "shared",
                (_, Kind::Small) => "small",
                (_, Kind::Large) => "large",
            },
            blocks,
        });
    }
    segments.sort_by_key(|s| s.address);
    MemorySnapshot {
        allocator: name.to_string(),
        segments,
    }
}

/// Segments as the GPU sees them: one per maximal run of mapped pages in an
/// arena (a virtual range backed end to end), each tiled exactly by its
/// blocks: live blocks (`Active`) and the free pieces between them
/// (`Inactive`). Unmapped virtual space is left out, so the segments' sizes
/// add up to the mapped pages; pool pages held but mapped nowhere are not a
/// segment (the pool's free pages).
pub(crate) fn mapped_segments(st: &Core, name: &str, page: u64) -> MemorySnapshot {
    let mut segments = Vec::new();
    for (ai, a) in st.arenas.iter().enumerate() {
        let (stream, _) = st.arena_meta[ai];
        // The arena's blocks and gaps, walked once over the runs in order.
        let mut pieces = a.tiling.pieces().peekable();
        let mut p = 0usize;
        while p < a.pages.len() {
            if a.pages.phys[p].is_none() {
                p += 1;
                continue;
            }
            let first = p;
            while p < a.pages.len() && a.pages.phys[p].is_some() {
                p += 1;
            }
            let (rs, re) = (first as u64 * page, p as u64 * page);
            let mut blocks: Vec<BlockInfo> = Vec::new();
            while pieces.next_if(|&(_, e, _)| e <= rs).is_some() {}
            for (s, e, gap) in pieces.clone().take_while(|&(s, _, _)| s < re) {
                if !gap && s >= rs {
                    let b = st.blocks.get(&(a.base + s));
                    blocks.push(BlockInfo {
                        address: a.base + s,
                        size: e.min(re) - s,
                        requested: b.map(|b| b.requested).unwrap_or(0),
                        state: occupied_state(st, a.base + s),
                    });
                    continue;
                }
                let (s, e) = (s.max(rs), e.min(re));
                if gap && e > s {
                    blocks.push(BlockInfo {
                        address: a.base + s,
                        size: e - s,
                        requested: 0,
                        state: BlockState::Inactive,
                    });
                }
            }
            blocks.sort_by_key(|b| b.address);
            segments.push(SegmentInfo {
                address: a.base + rs,
                total_size: re - rs,
                mapped_size: re - rs,
                stream: stream.unwrap_or_default(),
                kind: "mapped",
                blocks,
            });
        }
    }
    segments.sort_by_key(|s| s.address);
    MemorySnapshot {
        allocator: name.to_string(),
        segments,
    }
}

/// The state of the occupied range at `ptr`: pending free when its free is
/// held for the streams it was recorded on (see `held.rs`), else active.
fn occupied_state(st: &Core, ptr: u64) -> BlockState {
    if st.held.contains_key(&ptr) {
        BlockState::PendingFree
    } else {
        BlockState::Active
    }
}
