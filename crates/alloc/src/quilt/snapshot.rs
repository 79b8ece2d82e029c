//! The memory snapshot: one segment per arena, its blocks and cached gaps.

use super::state::{Kind, State};
use crate::snapshot::{BlockInfo, BlockState, MemorySnapshot, SegmentInfo};

/// Segments (arenas) with their blocks in address order. Gaps beyond an
/// arena's last mapping are left out; a gap with a mapped page is `Inactive`,
/// one without is `Unmapped`.
pub(crate) fn snapshot(st: &State, name: &str, page: u64) -> MemorySnapshot {
    let mut segments = Vec::new();
    for (ai, a) in st.arenas.iter().enumerate() {
        let (stream, kind) = st.arena_meta[ai];
        let high = a
            .pages
            .iter()
            .rposition(|s| s.phys.is_some())
            .map(|p| (p as u64 + 1) * page)
            .unwrap_or(0)
            .max(a.occupied.iter().next_back().map(|(_, &e)| e).unwrap_or(0));
        let mut blocks = Vec::new();
        for (&s, &e) in &a.occupied {
            let b = st.blocks.get(&(a.base + s));
            blocks.push(BlockInfo {
                address: a.base + s,
                size: e - s,
                requested: b.map(|b| b.requested).unwrap_or(0),
                state: BlockState::Active,
            });
        }
        for (&s, &e) in a.gaps.range(..high) {
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
