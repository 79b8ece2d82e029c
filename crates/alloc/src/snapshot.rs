//! A snapshot of an allocator's segments and blocks.

use quilt_vmm::{DevicePtr, StreamId};

/// State of one block in a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out to a live allocation.
    Active,
    /// Freed by the caller but waiting on events of other streams.
    PendingFree,
    /// Free and cached (still backed by physical memory).
    Inactive,
    /// Virtual range with no physical memory behind it.
    Unmapped,
}

/// One block inside a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Start address.
    pub address: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Bytes the caller asked for (0 when free).
    pub requested: u64,
    /// State.
    pub state: BlockState,
}

/// One segment: a virtual range the allocator carves blocks from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Start address.
    pub address: DevicePtr,
    /// Size of the virtual range in bytes.
    pub total_size: u64,
    /// Physical bytes mapped behind it.
    pub mapped_size: u64,
    /// The stream that owns it.
    pub stream: StreamId,
    /// A short kind: `large`, `small`, `expandable`, `arena`, `stitched`, ...
    pub kind: &'static str,
    /// Its blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// All segments of an allocator, in address order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// The allocator's name.
    pub allocator: String,
    /// Segments.
    pub segments: Vec<SegmentInfo>,
}

/// `snap` with every segment cut at its `Unmapped` blocks: each maximal run
/// of other blocks becomes a segment of its own, whose size is theirs.
pub fn without_unmapped(snap: MemorySnapshot) -> MemorySnapshot {
    let mut segments = Vec::new();
    for s in snap.segments {
        let mut run: Vec<BlockInfo> = Vec::new();
        let mut flush = |run: &mut Vec<BlockInfo>| {
            if let Some(first) = run.first() {
                let total: u64 = run.iter().map(|b| b.size).sum();
                segments.push(SegmentInfo {
                    address: first.address,
                    total_size: total,
                    mapped_size: total,
                    stream: s.stream,
                    kind: s.kind,
                    blocks: std::mem::take(run),
                });
            }
        };
        for b in s.blocks {
            if b.state == BlockState::Unmapped {
                flush(&mut run);
            } else {
                run.push(b);
            }
        }
        flush(&mut run);
    }
    MemorySnapshot {
        allocator: snap.allocator,
        segments,
    }
}
