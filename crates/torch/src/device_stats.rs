//! Quilt's statistics in torch's terms (`c10::CachingDeviceAllocator::
//! DeviceStats`), as the plain C struct that torch's allocator class
//! (`python/quilt_torch/torch_allocator.cpp`) copies into torch's.
//!
//! Quilt has no small and large pools: the figures are the `all` ones.
//! Quilt counts a private pool's segments as allocated; torch counts the
//! blocks the pool hands out of them ([`PoolFigures`]): the free blocks a
//! pool keeps are reserved but not allocated. The segments are those a snapshot shows. The totals
//! (`allocated`, `freed`, and the counts of out of memory, retries and
//! driver allocations) count from torch's last `resetAccumulatedStats`.

use quilt_alloc::{AllocatorStats, Stat};
use quilt_vmm::CallKind;

use crate::private_pools::PoolFigures;

/// One statistic (torch's `Stat`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltStat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Total added since the last accumulated reset.
    pub allocated: i64,
    /// Total removed since the last accumulated reset.
    pub freed: i64,
}

/// One device's statistics, field for field torch's `DeviceStats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuiltDeviceStats {
    /// Live allocations.
    pub allocation: QuiltStat,
    /// Segments (as a snapshot shows them; no totals).
    pub segment: QuiltStat,
    /// Active blocks.
    pub active: QuiltStat,
    /// Free blocks that cannot be released.
    pub inactive_split: QuiltStat,
    /// Allocated bytes.
    pub allocated_bytes: QuiltStat,
    /// Reserved bytes (physical memory held).
    pub reserved_bytes: QuiltStat,
    /// Active bytes.
    pub active_bytes: QuiltStat,
    /// Bytes of free blocks that cannot be released.
    pub inactive_split_bytes: QuiltStat,
    /// Bytes asked for.
    pub requested_bytes: QuiltStat,
    /// Allocations that freed cached memory and retried.
    pub num_alloc_retries: i64,
    /// Out of memory errors (requests larger than Quilt could ever map
    /// included).
    pub num_ooms: i64,
    /// Stream synchronizations.
    pub num_sync_all_streams: i64,
    /// Physical allocations (`cuMemCreate`).
    pub num_device_alloc: i64,
    /// Physical releases (`cuMemRelease`).
    pub num_device_free: i64,
    /// The bytes Quilt may hold on the device (its limit).
    pub device_total: i64,
    /// What of them it does not hold now.
    pub device_free: i64,
    /// Bytes of the free blocks private pools keep (in reserved, not in
    /// allocated).
    pub pool_kept_bytes: i64,
}

/// The accumulated figures at torch's last `resetAccumulatedStats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accumulated {
    /// (allocated, freed) of each statistic, in [`QuiltDeviceStats`] order
    /// (the segment's are unused).
    stats: [(u64, u64); 9],
    retries: u64,
    ooms: u64,
    syncs: u64,
    device_allocs: u64,
    device_frees: u64,
}

fn i(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The nine statistics of `raw`, with the pools' segments (which Quilt
/// counts as allocated and active) replaced by the blocks the pools hand
/// out, in [`QuiltDeviceStats`] order.
fn adjusted(raw: &AllocatorStats, pools: &PoolFigures) -> [Stat; 9] {
    let bytes = |s: &Stat, live: u64| Stat {
        current: (s.current + live).saturating_sub(pools.segments.0),
        peak: s.peak,
        allocated: (s.allocated + pools.handed_total.0).saturating_sub(pools.segments_total.0),
        freed: (s.freed + pools.returned_total.0).saturating_sub(pools.segments_freed_total.0),
    };
    let blocks = |s: &Stat| Stat {
        current: (s.current + pools.live.1).saturating_sub(pools.segments.1),
        peak: s.peak,
        allocated: (s.allocated + pools.handed_total.1).saturating_sub(pools.segments_total.1),
        freed: (s.freed + pools.returned_total.1).saturating_sub(pools.segments_freed_total.1),
    };
    [
        blocks(&raw.allocation),
        raw.segment,
        blocks(&raw.active),
        raw.inactive_split,
        bytes(&raw.allocated_bytes, pools.live.0),
        raw.reserved_bytes,
        bytes(&raw.active_bytes, pools.live.0),
        raw.inactive_split_bytes,
        bytes(&raw.requested_bytes, pools.live_requested),
    ]
}

/// The accumulated figures now (what [`torch_stats`] subtracts after a
/// reset).
pub fn accumulated(raw: &AllocatorStats, pools: &PoolFigures, too_large: u64) -> Accumulated {
    let stats = adjusted(raw, pools).map(|s| (s.allocated, s.freed));
    Accumulated {
        stats,
        retries: raw.num_alloc_retries,
        ooms: raw.num_ooms + too_large,
        syncs: raw.driver.count(CallKind::StreamSynchronize),
        device_allocs: raw.driver.count(CallKind::Create),
        device_frees: raw.driver.count(CallKind::Release),
    }
}

/// torch's statistics from Quilt's `raw` ones, the pools' `pools`, the
/// `segments` a snapshot shows (current, peak), the device's `memory`
/// (total, free: [`QuiltDeviceStats::device_total`]), the requests refused
/// as `too_large`, and the totals at the last reset `base`.
pub fn torch_stats(
    raw: &AllocatorStats,
    pools: &PoolFigures,
    segments: (u64, u64),
    memory: (u64, u64),
    too_large: u64,
    base: &Accumulated,
) -> QuiltDeviceStats {
    let now = accumulated(raw, pools, too_large);
    let mut stats = adjusted(raw, pools).into_iter().enumerate().map(|(k, s)| {
        let (a0, f0) = base.stats[k];
        QuiltStat {
            current: i(s.current),
            peak: i(s.peak.max(s.current)),
            allocated: i(s.allocated.saturating_sub(a0)),
            freed: i(s.freed.saturating_sub(f0)),
        }
    });
    let mut next = || stats.next().unwrap_or_default();
    let mut out = QuiltDeviceStats {
        allocation: next(),
        segment: next(),
        active: next(),
        inactive_split: next(),
        allocated_bytes: next(),
        reserved_bytes: next(),
        active_bytes: next(),
        inactive_split_bytes: next(),
        requested_bytes: next(),
        num_alloc_retries: i(now.retries.saturating_sub(base.retries)),
        num_ooms: i(now.ooms.saturating_sub(base.ooms)),
        num_sync_all_streams: i(now.syncs.saturating_sub(base.syncs)),
        num_device_alloc: i(now.device_allocs.saturating_sub(base.device_allocs)),
        num_device_free: i(now.device_frees.saturating_sub(base.device_frees)),
        device_total: i(memory.0),
        device_free: i(memory.1),
        pool_kept_bytes: i(pools.kept_bytes),
    };
    out.segment = QuiltStat {
        current: i(segments.0),
        peak: i(segments.1.max(segments.0)),
        allocated: 0,
        freed: 0,
    };
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    fn stat(current: u64, peak: u64, allocated: u64) -> Stat {
        Stat {
            current,
            peak,
            allocated,
            freed: allocated - current,
        }
    }

    #[test]
    fn pool_segments_count_their_handed_out_blocks_and_totals_reset() {
        let raw = AllocatorStats {
            allocated_bytes: stat(10 << 20, 12 << 20, 30 << 20),
            reserved_bytes: stat(16 << 20, 16 << 20, 16 << 20),
            allocation: stat(3, 4, 9),
            num_ooms: 2,
            ..AllocatorStats::default()
        };
        // One of Quilt's three blocks is a pool's segment of 8 MiB, with
        // three blocks of 4 MiB in all handed out of it now.
        let pools = PoolFigures {
            segments: (8 << 20, 1),
            live: (4 << 20, 3),
            live_requested: 3 << 20,
            kept_bytes: 4 << 20,
            segments_total: (8 << 20, 1),
            segments_freed_total: (0, 0),
            handed_total: (6 << 20, 5),
            returned_total: (2 << 20, 2),
        };
        let s = torch_stats(
            &raw,
            &pools,
            (2, 3),
            (64 << 20, 48 << 20),
            1,
            &Accumulated::default(),
        );
        assert_eq!(s.allocated_bytes.current, 6 << 20);
        assert_eq!(
            s.allocated_bytes.allocated - s.allocated_bytes.freed,
            s.allocated_bytes.current
        );
        assert_eq!(s.allocation.current, 5);
        assert_eq!(s.allocation.allocated - s.allocation.freed, 5);
        assert_eq!(s.pool_kept_bytes, 4 << 20);
        assert_eq!(s.reserved_bytes.current, 16 << 20);
        assert!(s.reserved_bytes.current >= s.allocated_bytes.current);
        assert_eq!((s.segment.current, s.segment.peak), (2, 3));
        assert_eq!(s.num_ooms, 3);
        assert_eq!((s.device_total, s.device_free), (64 << 20, 48 << 20));
        let base = accumulated(&raw, &pools, 1);
        let r = torch_stats(&raw, &pools, (2, 3), (64 << 20, 48 << 20), 1, &base);
        assert_eq!(
            (r.allocated_bytes.allocated, r.allocated_bytes.freed),
            (0, 0)
        );
        assert_eq!(r.num_ooms, 0);
        assert_eq!(
            r.allocated_bytes.current,
            6 << 20,
            "currents survive a reset"
        );
    }
}
