//! Segments, blocks and history entries as plain C structs, for torch's
//! allocator class (`python/quilt_torch/torch_allocator.cpp`) to build
//! torch's `SnapshotInfo` from: the same blocks as Quilt's own snapshot
//! ([`crate::pytorch_snapshot`]), with each private pool's segment a
//! segment of its own that names its pool (torch's
//! `owner_private_pool_id`) and shows the pool's blocks, the free ones
//! `inactive` (torch freed them); and the history's entries with their
//! sequence numbers.

use quilt_alloc::BlockState;

use crate::history::TraceEntry;
use crate::private_pools::PrivatePools;
use crate::pytorch_snapshot::DeviceMemory;

/// A block's state: handed out.
pub const BLOCK_ACTIVE_ALLOCATED: i32 = 0;
/// Freed, waiting for another stream's work.
pub const BLOCK_ACTIVE_PENDING_FREE: i32 = 1;
/// Free.
pub const BLOCK_INACTIVE: i32 = 2;

/// One segment: a run of mapped memory on one stream (or, at address 0,
/// the pool's pages mapped nowhere), tiled by its blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltSegment {
    /// The device.
    pub device: i32,
    /// Its first block's index in the block list.
    pub first_block: u32,
    /// Its number of blocks.
    pub block_count: u32,
    /// Its first address.
    pub address: u64,
    /// Its size.
    pub total_size: u64,
    /// The stream it belongs to (a private pool's segment: the caller's
    /// stream it was allocated on).
    pub stream: u64,
    /// torch's `MempoolId_t` (first, second) of the private pool owning it;
    /// (0, 0) for none.
    pub owner_pool: [u64; 2],
}

/// One block of a segment, in address order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltBlock {
    /// Its address.
    pub address: u64,
    /// Its size.
    pub size: u64,
    /// Bytes asked for (0 when free).
    pub requested: u64,
    /// [`BLOCK_ACTIVE_ALLOCATED`], [`BLOCK_ACTIVE_PENDING_FREE`] or
    /// [`BLOCK_INACTIVE`].
    pub state: i32,
}

/// One history entry: torch's `TraceEntry` fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltTraceEntry {
    /// Its sequence number.
    pub seq: u64,
    /// The device.
    pub device: i32,
    /// torch's `TraceEntry::Action` number ([`action_number`]).
    pub action: i32,
    /// The address (for an out of memory: the device's free bytes).
    pub addr: u64,
    /// The size.
    pub size: u64,
    /// The stream.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

/// torch's `TraceEntry::Action` number of a history action (`alloc` 0 ...
/// `oom` 8); -1 for one torch does not know.
pub fn action_number(action: &str) -> i32 {
    match action {
        "alloc" => 0,
        "free_requested" => 1,
        "free_completed" => 2,
        "segment_alloc" => 3,
        "segment_free" => 4,
        "segment_map" => 5,
        "segment_unmap" => 6,
        "snapshot" => 7,
        "oom" => 8,
        _ => -1,
    }
}

/// `t` of `device` as a C struct.
pub fn trace_entry(device: i32, t: &TraceEntry) -> QuiltTraceEntry {
    QuiltTraceEntry {
        seq: t.seq,
        device,
        action: action_number(t.action),
        addr: t.addr,
        size: t.size,
        stream: t.stream,
        time_us: t.time_us,
    }
}

/// Append `memory`'s segments and blocks to `segs` and `blocks`, as
/// torch lists them: each private pool's segment on its own, with the
/// pool's id and the stream it was allocated on, showing the pool's blocks
/// (the free ones [`BLOCK_INACTIVE`]); the runs of other blocks between
/// them as segments of no pool.
pub fn segments(
    memory: &DeviceMemory,
    pools: &PrivatePools,
    segs: &mut Vec<QuiltSegment>,
    blocks: &mut Vec<QuiltBlock>,
) {
    for s in &memory.segments.segments {
        // The run of blocks outside pools begun so far: its address, its
        // first block.
        let mut run: Option<(u64, usize)> = None;
        for b in &s.blocks {
            let owner = match b.state {
                BlockState::Active => pools.segment_owner(b.address),
                _ => None,
            };
            if let (Some((pool, stream)), Some(pieces)) = (owner, pools.pieces(b.address)) {
                push_run(
                    memory.device,
                    s.stream.0,
                    run.take(),
                    b.address,
                    segs,
                    blocks,
                );
                let first = blocks.len();
                blocks.extend(pieces.iter().map(|p| QuiltBlock {
                    address: p.ptr,
                    size: p.size,
                    requested: p.requested,
                    state: if p.live {
                        BLOCK_ACTIVE_ALLOCATED
                    } else {
                        BLOCK_INACTIVE
                    },
                }));
                push_segment(
                    memory.device,
                    (b.address, b.size),
                    stream,
                    [pool.0, pool.1],
                    first,
                    segs,
                    blocks,
                );
                continue;
            }
            let state = match b.state {
                BlockState::Active => BLOCK_ACTIVE_ALLOCATED,
                BlockState::PendingFree => BLOCK_ACTIVE_PENDING_FREE,
                BlockState::Inactive | BlockState::Unmapped => BLOCK_INACTIVE,
            };
            let requested = if state == BLOCK_INACTIVE {
                0
            } else {
                b.requested
            };
            run.get_or_insert((b.address, blocks.len()));
            blocks.push(QuiltBlock {
                address: b.address,
                size: b.size,
                requested,
                state,
            });
        }
        let end = s.address + s.total_size;
        push_run(memory.device, s.stream.0, run, end, segs, blocks);
    }
    if memory.unmapped_pool_bytes > 0 {
        let first = blocks.len();
        blocks.push(QuiltBlock {
            address: 0,
            size: memory.unmapped_pool_bytes,
            requested: 0,
            state: BLOCK_INACTIVE,
        });
        push_segment(
            memory.device,
            (0, memory.unmapped_pool_bytes),
            0,
            NO_POOL,
            first,
            segs,
            blocks,
        );
    }
}

/// The pool id of a segment no private pool owns (torch's `{0, 0}`).
const NO_POOL: [u64; 2] = [0, 0];

/// Append the run of blocks outside pools begun at `run` (its address, its
/// first block), if one was, as a segment of no pool ending at `end`.
fn push_run(
    device: i32,
    stream: u64,
    run: Option<(u64, usize)>,
    end: u64,
    segs: &mut Vec<QuiltSegment>,
    blocks: &[QuiltBlock],
) {
    if let Some((address, first)) = run {
        push_segment(
            device,
            (address, end - address),
            stream,
            NO_POOL,
            first,
            segs,
            blocks,
        );
    }
}

/// Append the segment of `device` at `range` (address, size) on `stream`,
/// owned by `pool`, tiled by the blocks from `first` to the end of
/// `blocks`.
fn push_segment(
    device: i32,
    range: (u64, u64),
    stream: u64,
    pool: [u64; 2],
    first: usize,
    segs: &mut Vec<QuiltSegment>,
    blocks: &[QuiltBlock],
) {
    segs.push(QuiltSegment {
        device,
        first_block: u32::try_from(first).unwrap_or(u32::MAX),
        block_count: u32::try_from(blocks.len() - first).unwrap_or(u32::MAX),
        address: range.0,
        total_size: range.1,
        stream,
        owner_pool: pool,
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use quilt_alloc::{BlockInfo, MemorySnapshot, SegmentInfo};
    use quilt_vmm::StreamId;

    #[test]
    fn blocks_tile_their_segments_and_each_pool_segment_is_its_own_with_its_pool() {
        let block = |address, size, state| BlockInfo {
            address,
            size,
            requested: size,
            state,
        };
        let memory = DeviceMemory {
            device: 1,
            segments: MemorySnapshot {
                allocator: "quilt".into(),
                segments: vec![SegmentInfo {
                    address: 0x1000,
                    total_size: 0x3000,
                    mapped_size: 0x3000,
                    stream: StreamId(7),
                    kind: "arena",
                    blocks: vec![
                        block(0x1000, 0x1000, BlockState::Active),
                        block(0x2000, 0x1000, BlockState::Active),
                        block(0x3000, 0x1000, BlockState::Inactive),
                    ],
                }],
            },
            unmapped_pool_bytes: 0x2000,
        };
        let mut pools = PrivatePools::default();
        pools.create_or_incref((1, 0));
        // A pool's segment, carved, allocated on the caller's stream 9: a
        // segment of its own, with its pool and stream, showing its blocks;
        // the blocks on either side of it segments of no pool.
        pools.adopt((1, 0), 0x2000, 0x1000, 0x700, 9).unwrap();
        let (mut segs, mut blocks) = (Vec::new(), Vec::new());
        segments(&memory, &pools, &mut segs, &mut blocks);
        assert_eq!(
            segs.iter()
                .map(|s| (s.address, s.total_size, s.stream, s.owner_pool))
                .collect::<Vec<_>>(),
            [
                (0x1000, 0x1000, 7, NO_POOL),
                (0x2000, 0x1000, 9, [1, 0]),
                (0x3000, 0x1000, 7, NO_POOL),
                (0, 0x2000, 0, NO_POOL),
            ]
        );
        for s in &segs {
            let bs = &blocks[s.first_block as usize..(s.first_block + s.block_count) as usize];
            assert_eq!(bs.iter().map(|b| b.size).sum::<u64>(), s.total_size);
            if s.address != 0 {
                assert_eq!(bs[0].address, s.address);
            }
            assert_eq!(s.device, 1);
        }
        let states: Vec<i32> = blocks.iter().map(|b| b.state).collect();
        assert_eq!(
            states,
            [
                BLOCK_ACTIVE_ALLOCATED,
                BLOCK_ACTIVE_ALLOCATED,
                BLOCK_INACTIVE,
                BLOCK_INACTIVE,
                BLOCK_INACTIVE
            ]
        );
        assert_eq!(
            blocks[1..3]
                .iter()
                .map(|b| (b.address, b.size, b.requested))
                .collect::<Vec<_>>(),
            [(0x2000, 0x800, 0x700), (0x2800, 0x800, 0)]
        );
        assert_eq!(action_number("segment_unmap"), 6);
        assert_eq!(action_number("oom"), 8);
    }
}
