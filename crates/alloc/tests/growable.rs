//! Growable buffers: real bytes on the host backend (address and contents
//! never move; pages flow between growable buffers and ordinary blocks
//! through one pool), typed errors, out of memory leaving the buffer as it
//! was, stream ordering on the simulated device (waits, never a sync), and
//! a property test of random grow/shrink/allocate/free sequences with the
//! invariants checked after every operation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

#[allow(dead_code)] // its `main` is the example's, run by a test here
#[path = "../examples/serving.rs"]
mod serving_example;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{quilt_exact as quilt, read, KIB, MIB};
use proptest::prelude::*;
use quilt_alloc::quilt::{
    AheadMode, GrowableBuffer, GrowableId, MapAhead, QuiltAllocator, Recycle,
};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::host::HostVmm;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, StreamId, Vmm};

const PAGE: u64 = 64 * KIB;

/// The host backend, `capacity` bytes in 64 KiB pages.
fn host(capacity: u64) -> Arc<HostVmm> {
    common::host(PAGE, capacity)
}

/// Drop the allocator (its last handle) and check that it left nothing
/// behind on the simulated device.
fn assert_no_leaks_once_dropped(s: &SimVmm, a: Arc<QuiltAllocator>) {
    drop(a);
    assert!(s.leak_report().is_empty(), "{}", s.leak_report());
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

#[test]
fn growable_host_bytes_stay_put_and_pages_flow_both_ways() {
    let h = host(4 * MIB);
    let a = quilt(h.clone(), 4 * MIB);
    let buf = GrowableBuffer::new(a.clone(), 3 * MIB, StreamId::DEFAULT).unwrap();
    let ptr = buf.ptr();
    buf.grow_to(100 * KIB).unwrap();
    let first = pattern(7, (100 * KIB) as usize);
    h.write_bytes(ptr, &first).unwrap();
    a.check_invariants().unwrap();

    // Grow: same address, old bytes intact.
    buf.grow_to(2 * MIB).unwrap();
    assert_eq!(buf.ptr(), ptr);
    assert_eq!(a.growable_info(buf.id()).unwrap().ptr, ptr);
    assert_eq!(read(&h, ptr, 100 * KIB), first);
    let second = pattern(99, (2 * MIB - 100 * KIB) as usize);
    h.write_bytes(ptr + 100 * KIB, &second).unwrap();
    a.check_invariants().unwrap();

    // Shrink: what stays below the new length is intact. The host backend
    // completes work at once, so the pages past the shrink's allowance go
    // straight back to the pool (their work is learnt done at the shrink).
    let free_before_shrink = a.pool_stats().free_pages;
    buf.shrink_to(300 * KIB).unwrap();
    let returned_at_shrink = a.pool_stats().free_pages - free_before_shrink;
    assert_eq!(read(&h, ptr, 100 * KIB), first);
    assert_eq!(
        read(&h, ptr + 100 * KIB, 200 * KIB),
        second[..(200 * KIB) as usize]
    );
    a.check_invariants().unwrap();

    // An ordinary allocation that only fits in the pages the shrink left:
    // the pool is at its limit, so they must be reused.
    let reserved_before = a.stats().reserved_bytes.current;
    let block = a.allocate(3 * MIB + 512 * KIB, StreamId::DEFAULT).unwrap();
    assert!(a.stats().reserved_bytes.current <= 4 * MIB);
    assert!(
        returned_at_shrink + a.serving_stats().spare_pages_reclaimed >= 24,
        "the shrink's pages were not reused: {returned_at_shrink} returned at the shrink, {:?}",
        a.serving_stats()
    );
    assert!(reserved_before <= 4 * MIB);
    h.fill(block.ptr, block.size, 0xEE).unwrap();
    assert_eq!(
        read(&h, ptr, 100 * KIB),
        first,
        "the block overwrote the buffer"
    );
    a.check_invariants().unwrap();
    a.free(block.ptr).unwrap();

    // The other way: the freed block's pages serve the buffer's growth.
    buf.grow_to(3 * MIB).unwrap();
    assert_eq!(buf.ptr(), ptr);
    assert!(a.stats().reserved_bytes.current <= 4 * MIB);
    assert_eq!(read(&h, ptr, 100 * KIB), first);
    h.fill(ptr + 300 * KIB, 3 * MIB - 300 * KIB, 0x5A).unwrap();
    assert!(h
        .check_filled(ptr + 300 * KIB, 3 * MIB - 300 * KIB, 0x5A)
        .unwrap());
    a.check_invariants().unwrap();

    buf.release().unwrap();
    assert_eq!(a.stats().allocated_bytes.current, 0);
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    drop(a);
    let leaks = h.leak_report();
    assert!(leaks.is_empty(), "{leaks}");
}

#[test]
fn growable_oom_leaves_the_buffer_as_it_was() {
    let h = host(2 * MIB);
    let a = quilt(h.clone(), 2 * MIB);
    let buf = GrowableBuffer::new(a.clone(), 8 * MIB, StreamId(3)).unwrap();
    buf.grow_to(MIB).unwrap();
    let bytes = pattern(3, MIB as usize);
    h.write_bytes(buf.ptr(), &bytes).unwrap();
    let other = a.allocate(512 * KIB, StreamId(3)).unwrap();
    let before = (
        a.growable_info(buf.id()).unwrap(),
        a.stats().allocated_bytes.current,
    );
    let err = buf.grow_to(2 * MIB).unwrap_err();
    let report = err.oom_report().expect("an out-of-memory report");
    assert_eq!(report.verdict, OomVerdict::Capacity);
    assert_eq!(report.needed, 16 * PAGE);
    assert_eq!(
        (
            a.growable_info(buf.id()).unwrap(),
            a.stats().allocated_bytes.current
        ),
        before
    );
    assert_eq!(read(&h, buf.ptr(), MIB), bytes);
    a.check_invariants().unwrap();
    // Growth that fits still works afterwards.
    a.free(other.ptr).unwrap();
    buf.grow_to(2 * MIB).unwrap();
    assert_eq!(read(&h, buf.ptr(), MIB), bytes);
    a.check_invariants().unwrap();
}

#[test]
fn growable_errors_are_typed_and_change_nothing() {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let a = quilt(vmm, 64 * MIB);
    let id = a.create_growable(10 * MIB, StreamId::DEFAULT).unwrap();
    assert_eq!(a.growable_info(id).unwrap().max_len, 10 * MIB);
    a.grow_to(id, 4 * MIB).unwrap();
    let before = a.growable_info(id).unwrap();
    let stats = a.stats();
    for r in [
        a.grow_to(id, 10 * MIB + 1),
        a.grow_to(id, MIB),
        a.shrink_to(id, 5 * MIB),
    ] {
        assert!(matches!(r, Err(AllocError::InvalidResize { .. })), "{r:?}");
    }
    assert!(matches!(
        a.grow_to(GrowableId(999), MIB),
        Err(AllocError::UnknownGrowable { id: 999 })
    ));
    assert!(matches!(
        a.create_growable(0, StreamId::DEFAULT),
        Err(AllocError::InvalidSize { .. })
    ));
    assert_eq!(a.growable_info(id).unwrap(), before);
    assert_eq!(a.stats().allocated_bytes, stats.allocated_bytes);
    a.grow_to(id, 4 * MIB).unwrap(); // no-op
    a.shrink_to(id, 4 * MIB).unwrap(); // no-op
    a.check_invariants().unwrap();
    a.release_growable(id).unwrap();
    for r in [
        a.grow_to(id, 5 * MIB),
        a.shrink_to(id, 0),
        a.release_growable(id),
        a.record_growable_stream(id, StreamId(2)),
    ] {
        assert!(
            matches!(r, Err(AllocError::UnknownGrowable { .. })),
            "{r:?}"
        );
    }
    a.check_invariants().unwrap();
}

/// The simulated device never catches up by itself: every stream's work
/// stays pending unless a test completes it.
fn sim(capacity: u64) -> (Arc<SimVmm>, Arc<QuiltAllocator>) {
    let s = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let a = quilt(s.clone(), capacity);
    (s, a)
}

#[test]
fn growable_shrunk_pages_reused_on_another_stream_wait_never_sync() {
    let (s, a) = sim(32 * MIB);
    let (sa, sb) = (StreamId(1), StreamId(2));
    let buf = GrowableBuffer::new(a.clone(), 32 * MIB, sa).unwrap();
    buf.grow_to(32 * MIB).unwrap();
    let _b_seen = a.allocate(512, sb); // stream B is known; the pool is full
    buf.shrink_to(0).unwrap();
    let before = s.driver_stats();
    // Every page is the buffer's, freed by stream A's pending work: a block on
    // stream B takes them after a wait, with no synchronisation.
    let block = a.allocate(16 * MIB, sb).unwrap();
    let since = s.driver_stats().since(&before);
    assert_eq!(since.count(CallKind::StreamSynchronize), 0);
    assert!(since.count(CallKind::StreamWaitEvent) >= 1, "{since:?}");
    a.check_invariants().unwrap();
    // And the other way: B's freed block serves the growth of another
    // buffer on stream A after a wait. (The first buffer's own range keeps
    // the retired mappings of its pages until A's work is known complete:
    // growing it back over them would synchronise A, the price of reclaim
    // under pressure.)
    a.free(block.ptr).unwrap();
    let buf2 = GrowableBuffer::new(a.clone(), 32 * MIB, sa).unwrap();
    let before = s.driver_stats();
    buf2.grow_to(30 * MIB).unwrap();
    let since = s.driver_stats().since(&before);
    assert_eq!(since.count(CallKind::StreamSynchronize), 0);
    assert!(since.count(CallKind::StreamWaitEvent) >= 1, "{since:?}");
    a.check_invariants().unwrap();
    drop(buf);
    drop(buf2);
    a.check_invariants().unwrap();
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_regrow_over_spare_pages_makes_no_driver_call() {
    let (s, a) = sim(256 * MIB);
    a.set_map_ahead(MapAhead {
        pages: 4,
        below_per_mille: 1000,
        mode: AheadMode::Manual,
    })
    .unwrap();
    let buf = GrowableBuffer::new(a.clone(), 64 * MIB, StreamId(5)).unwrap();
    buf.grow_to(20 * MIB).unwrap();
    buf.shrink_to(14 * MIB).unwrap(); // 3 pages of 2 MiB left spare (kept: allowance 4)
    let before = s.driver_stats();
    buf.grow_to(20 * MIB).unwrap();
    assert_eq!(s.driver_stats().since(&before).vmm_calls(), 0);
    let st = a.serving_stats();
    assert_eq!(
        (st.grows, st.grows_already_mapped, st.pages_found_mapped),
        (2, 1, 3)
    );
    a.check_invariants().unwrap();
}

#[test]
fn growable_release_with_pending_work_frees_its_range_later() {
    let (s, a) = sim(64 * MIB);
    a.set_recycle(Recycle::OFF).unwrap(); // released ranges are not kept
    let buf = GrowableBuffer::new(a.clone(), 16 * MIB, StreamId(1)).unwrap();
    let _other = a.allocate(MIB, StreamId(2)).unwrap(); // two streams: hazards tracked
    buf.grow_to(16 * MIB).unwrap();
    buf.release().unwrap();
    a.check_invariants().unwrap();
    // Its pool pages are free at once; the mappings wait for stream 1.
    assert_eq!(
        a.pool_stats().free_pages * a.pool_stats().page_size,
        16 * MIB
    );
    s.complete_all();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    // The slot is reused by the next buffer.
    let again = GrowableBuffer::new(a.clone(), 8 * MIB, StreamId(1)).unwrap();
    again.grow_to(8 * MIB).unwrap();
    a.check_invariants().unwrap();
    drop(again);
    assert_no_leaks_once_dropped(&s, a);
}

#[derive(Clone, Debug)]
enum Op {
    Create { max_pages: u64, stream: u8 },
    Grow { which: usize, per_mille: u64 },
    Shrink { which: usize, per_mille: u64 },
    Release { which: usize },
    Alloc { bytes: u64, stream: u8 },
    Free { which: usize },
    Record { which: usize, stream: u8 },
    Complete { stream: u8 },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..24, 0u8..3).prop_map(|(max_pages, stream)| Op::Create { max_pages, stream }),
        6 => (any::<usize>(), 0u64..1100).prop_map(|(which, per_mille)| Op::Grow { which, per_mille }),
        3 => (any::<usize>(), 0u64..=1000).prop_map(|(which, per_mille)| Op::Shrink { which, per_mille }),
        1 => (any::<usize>()).prop_map(|which| Op::Release { which }),
        3 => (1u64..(12 * MIB), 0u8..3).prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        2 => (any::<usize>()).prop_map(|which| Op::Free { which }),
        1 => (any::<usize>(), 0u8..3).prop_map(|(which, stream)| Op::Record { which, stream }),
        1 => (0u8..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

/// The length a `Grow` op asks for: `per_mille` of the way from the length
/// to the maximum; past 1000 beyond the maximum, past 1050 below the length.
fn grow_target(len: u64, max: u64, per_mille: u64) -> u64 {
    match per_mille {
        0..=1000 => len + (max - len) * per_mille / 1000,
        1001..=1050 => max + per_mille,
        _ => len.saturating_sub(1),
    }
}

fn ahead() -> impl Strategy<Value = MapAhead> {
    prop_oneof![
        Just(MapAhead::OFF),
        (1u64..4, 500u64..1001).prop_map(|(pages, below_per_mille)| MapAhead {
            pages,
            below_per_mille,
            mode: AheadMode::Inline,
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random growable and ordinary traffic on three streams under a 48 MiB
    /// limit: invariants after every operation; a failed growth or
    /// allocation is capacity (never fragmentation) and changes nothing.
    #[test]
    fn growable_random_sequences_keep_invariants(ops in proptest::collection::vec(op(), 1..120), policy in ahead()) {
        let (s, a) = sim(48 * MIB);
        a.set_map_ahead(policy).unwrap();
        let mut bufs: Vec<(GrowableId, u64, u64)> = Vec::new(); // id, len, max
        let mut blocks: BTreeMap<u64, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Create { max_pages, stream } => {
                    let id = a.create_growable(max_pages * 2 * MIB, StreamId(stream as u64)).unwrap();
                    bufs.push((id, 0, max_pages * 2 * MIB));
                }
                Op::Grow { which, per_mille } if !bufs.is_empty() => {
                    let i = which % bufs.len();
                    let (id, len, max) = bufs[i];
                    let bytes = grow_target(len, max, per_mille);
                    let before = a.growable_info(id).unwrap();
                    match a.grow_to(id, bytes) {
                        Ok(()) => {
                            prop_assert!(bytes >= len && bytes <= max);
                            bufs[i].1 = bytes;
                            prop_assert_eq!(a.growable_info(id).unwrap().ptr, before.ptr);
                        }
                        Err(AllocError::InvalidResize { .. }) => prop_assert!(bytes < len || bytes > max),
                        Err(AllocError::OutOfMemory(r)) => {
                            prop_assert_eq!(r.verdict, OomVerdict::Capacity);
                            prop_assert_eq!(a.growable_info(id).unwrap().len, len);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Shrink { which, per_mille } if !bufs.is_empty() => {
                    let i = which % bufs.len();
                    let (id, len, _) = bufs[i];
                    let to = len * per_mille / 1000;
                    a.shrink_to(id, to).unwrap();
                    bufs[i].1 = to;
                }
                Op::Release { which } if !bufs.is_empty() => {
                    let (id, _, _) = bufs.swap_remove(which % bufs.len());
                    a.release_growable(id).unwrap();
                }
                Op::Alloc { bytes, stream } => match a.allocate(bytes, StreamId(stream as u64)) {
                    Ok(b) => { blocks.insert(b.ptr, b.size); }
                    Err(AllocError::OutOfMemory(r)) => prop_assert_eq!(r.verdict, OomVerdict::Capacity),
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::Free { which } if !blocks.is_empty() => {
                    let p = *blocks.keys().nth(which % blocks.len()).unwrap();
                    blocks.remove(&p);
                    a.free(p).unwrap();
                }
                Op::Record { which, stream } if !bufs.is_empty() => {
                    let (id, _, _) = bufs[which % bufs.len()];
                    a.record_growable_stream(id, StreamId(stream as u64)).unwrap();
                }
                Op::Complete { stream } => s.complete_stream(StreamId(stream as u64)),
                Op::EmptyCache => a.empty_cache().unwrap(),
                _ => {}
            }
            a.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(a.stats().reserved_bytes.current <= 48 * MIB);
        }
        for (id, _, _) in bufs {
            a.release_growable(id).unwrap();
        }
        for p in blocks.into_keys() {
            a.free(p).unwrap();
        }
        a.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
        drop(a);
        prop_assert!(s.leak_report().is_empty(), "{}", s.leak_report());
    }
}

fn ahead_policy(pages: u64, below_per_mille: u64, mode: AheadMode) -> MapAhead {
    MapAhead {
        pages,
        below_per_mille,
        mode,
    }
}

#[test]
fn growable_map_ahead_inline_serves_each_growth_from_mapped_pages() {
    let (s, a) = sim(256 * MIB);
    a.set_map_ahead(ahead_policy(2, 1000, AheadMode::Inline))
        .unwrap();
    let buf = GrowableBuffer::new(a.clone(), 64 * MIB, StreamId(1)).unwrap();
    assert_eq!(a.growable_info(buf.id()).unwrap().mapped_bytes, 4 * MIB);
    for i in 1..=10u64 {
        buf.grow_to(i * 2 * MIB).unwrap();
        a.check_invariants().unwrap();
    }
    let st = a.serving_stats();
    assert_eq!((st.grows, st.grows_already_mapped), (10, 10));
    assert_eq!(st.pages_mapped_on_grow, 0);
    // Its steps reach one page each: one page is kept ahead (of at most 2).
    assert_eq!(a.growable_info(buf.id()).unwrap().mapped_bytes, 22 * MIB);
    drop(buf);
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_map_ahead_follows_the_last_step_up_to_its_bound() {
    let (s, a) = sim(512 * MIB);
    a.set_map_ahead(ahead_policy(4, 0, AheadMode::Manual))
        .unwrap();
    // Free pool pages to map ahead from: a released buffer's.
    let other = GrowableBuffer::new(a.clone(), 64 * MIB, StreamId(1)).unwrap();
    other.grow_to(64 * MIB).unwrap();
    other.release().unwrap();
    s.complete_all();
    let buf = GrowableBuffer::new(a.clone(), 256 * MIB, StreamId(1)).unwrap();
    let mapped = |a: &QuiltAllocator| a.growable_info(buf.id()).unwrap().mapped_bytes;
    // No step seen yet: the bound, 4 pages.
    assert_eq!(a.map_ahead_now().unwrap(), 4);
    // The first growth (from empty: a prompt, not a step) changes nothing.
    buf.grow_to(20 * MIB).unwrap();
    assert_eq!(a.map_ahead_now().unwrap(), 4);
    assert_eq!(mapped(&a), 28 * MIB);
    // A step of 3 pages: 3 kept ahead.
    buf.grow_to(26 * MIB).unwrap();
    a.map_ahead_now().unwrap();
    assert_eq!(mapped(&a), 32 * MIB);
    // A step of 6 pages: the bound, 4.
    buf.grow_to(38 * MIB).unwrap();
    a.map_ahead_now().unwrap();
    assert_eq!(mapped(&a), 46 * MIB);
    a.check_invariants().unwrap();
    drop(buf);
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_map_ahead_manual_makes_growth_free_of_driver_calls_and_stops_under_pressure() {
    let (s, a) = sim(32 * MIB);
    a.set_map_ahead(ahead_policy(4, 500, AheadMode::Manual))
        .unwrap();
    let buf = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    assert_eq!(a.map_ahead_now().unwrap(), 4);
    let before = s.driver_stats();
    buf.grow_to(8 * MIB).unwrap();
    assert_eq!(s.driver_stats().since(&before).vmm_calls(), 0);
    // With this block the pool holds 14 MiB of 32: 4 more pages would take
    // it past 16 MiB (500 per mille), so nothing is mapped ahead.
    let block = a.allocate(6 * MIB, StreamId(1)).unwrap();
    assert_eq!(a.map_ahead_now().unwrap(), 0, "mapped ahead under pressure");
    a.free(block.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn growable_pages_mapped_ahead_are_reclaimed_before_ordinary_cached_pages() {
    let (s, a) = sim(16 * MIB);
    a.set_map_ahead(ahead_policy(2, 1000, AheadMode::Manual))
        .unwrap();
    let buf = GrowableBuffer::new(a.clone(), 16 * MIB, StreamId(1)).unwrap();
    buf.grow_to(2 * MIB).unwrap();
    assert_eq!(a.map_ahead_now().unwrap(), 2);
    assert_eq!(a.pool_stats().total_pages, 3);
    // An ordinary block with no free page in the pool: the 2 pages ahead
    // (never used, so no work on them) are taken before the pool grows.
    let before = s.driver_stats();
    let old = a.allocate(4 * MIB, StreamId(1)).unwrap();
    assert_eq!(s.driver_stats().since(&before).count(CallKind::Create), 0);
    assert_eq!(a.pool_stats().total_pages, 3);
    assert_eq!(a.serving_stats().spare_pages_reclaimed, 2);
    assert_eq!(a.growable_info(buf.id()).unwrap().mapped_bytes, 2 * MIB);
    a.check_invariants().unwrap();
    // Freed, its 2 pages are cached in the shared arena; 2 pages are mapped
    // ahead again (the pool grows: below 1000 per mille).
    a.free(old.ptr).unwrap();
    assert_eq!(a.map_ahead_now().unwrap(), 2);
    assert_eq!(a.cached_bytes(), 8 * MIB);
    // 14 MiB more at the 16 MiB limit: the buffer holds 1 page and 2 ahead,
    // the cache 2, the pool can grow by 3; the pages ahead go first, then 2
    // ordinary cached pages.
    let big = a.allocate(14 * MIB, StreamId(1)).unwrap();
    assert_eq!(a.serving_stats().spare_pages_reclaimed, 4);
    assert_eq!(a.growable_info(buf.id()).unwrap().mapped_bytes, 2 * MIB);
    assert_eq!(a.cached_bytes(), 0);
    a.check_invariants().unwrap();
    a.free(big.ptr).unwrap();
}

#[test]
fn growable_map_ahead_background_worker_maps_and_stops_with_the_allocator() {
    let (s, a) = sim(256 * MIB);
    a.set_map_ahead(ahead_policy(3, 1000, AheadMode::Background))
        .unwrap();
    let buf = GrowableBuffer::new(a.clone(), 64 * MIB, StreamId(1)).unwrap();
    buf.grow_to(MIB).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.growable_info(buf.id()).unwrap().mapped_bytes < 6 * MIB {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker mapped nothing ahead"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    a.check_invariants().unwrap();
    buf.grow_to(6 * MIB).unwrap();
    assert!(a.serving_stats().grows_already_mapped >= 1);
    drop(buf);
    assert_no_leaks_once_dropped(&s, a); // stops and joins the worker
}

#[test]
fn growable_serving_example_runs() {
    host(MIB); // fails here, with the reason, where the host backend is missing
    serving_example::main().unwrap();
}

#[test]
fn growable_released_buffers_do_not_pile_up_while_the_pool_has_room() {
    let (s, a) = sim(1 << 30);
    s.set_gpu_lag_ops(4);
    let mut peak_reserved_va = 0;
    for i in 0..2000u64 {
        let buf = GrowableBuffer::new(a.clone(), 512 * MIB, StreamId(1)).unwrap();
        buf.grow_to((1 + i % 7) * 3 * MIB).unwrap();
        drop(buf);
        s.advance(1);
        peak_reserved_va = peak_reserved_va.max(s.reserved_bytes());
    }
    a.check_invariants().unwrap();
    // The device is 4 operations behind: a handful of released ranges wait
    // for their work at any time, never thousands.
    assert!(
        peak_reserved_va <= 16 * 512 * MIB,
        "{} GiB of ranges reserved",
        peak_reserved_va >> 30
    );
    assert_eq!(s.driver_stats().count(CallKind::StreamSynchronize), 0);
}

#[test]
fn growable_threads_grow_and_shrink_their_buffers_beside_the_map_ahead_worker() {
    let h = host(32 * MIB);
    let a = quilt(h.clone(), 32 * MIB);
    a.set_map_ahead(ahead_policy(2, 900, AheadMode::Background))
        .unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let (a, h) = (a.clone(), h.clone());
            scope.spawn(move || {
                let stream = StreamId(t as u64 + 1);
                let buf = GrowableBuffer::new(a.clone(), 6 * MIB, stream).unwrap();
                let mut len = 0u64;
                for i in 0..200u64 {
                    let next = if i % 50 == 49 {
                        len / 3
                    } else {
                        (len + 40 * KIB).min(6 * MIB)
                    };
                    if next > len {
                        buf.grow_to(next).unwrap();
                        h.fill(buf.ptr() + len, next - len, t + 1).unwrap();
                    } else {
                        buf.shrink_to(next).unwrap();
                    }
                    len = next;
                    if len > 0 {
                        assert!(h.check_filled(buf.ptr(), len, t + 1).unwrap());
                    }
                }
                let block = a.allocate(MIB, stream).unwrap();
                h.fill(block.ptr, block.size, 0xCC).unwrap();
                assert!(h.check_filled(buf.ptr(), len, t + 1).unwrap() || len == 0);
                a.free(block.ptr).unwrap();
            });
        }
    });
    a.check_invariants().unwrap();
    assert_eq!(a.serving_stats().growables, 0);
    assert!(a.serving_stats().grows_already_mapped > 0);
}

#[test]
fn growable_released_range_serves_the_next_buffer_on_its_mapped_pages() {
    let (s, a) = sim(64 * MIB);
    a.set_recycle(Recycle { max_buffers: 4 }).unwrap();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let first = GrowableBuffer::new(a.clone(), 32 * MIB, s1).unwrap();
    let ptr = first.ptr();
    first.grow_to(20 * MIB).unwrap();
    drop(first);
    a.check_invariants().unwrap();
    // The next buffer of the same maximum starts on its mapped pages.
    let second = GrowableBuffer::new(a.clone(), 32 * MIB, s1).unwrap();
    assert_eq!(second.ptr(), ptr);
    let before = s.driver_stats();
    second.grow_to(20 * MIB).unwrap();
    assert_eq!(s.driver_stats().since(&before).vmm_calls(), 0);
    assert_eq!(a.serving_stats().recycled, 1);
    // Another maximum: a fresh range.
    let other = GrowableBuffer::new(a.clone(), 16 * MIB, s1).unwrap();
    assert_ne!(other.ptr(), ptr);
    drop(other);
    a.check_invariants().unwrap();
    // On another stream, the reuse waits for the first stream's work.
    let _seen = a.allocate(512, s2).unwrap(); // two streams: hazards tracked
    drop(second);
    let third = GrowableBuffer::new(a.clone(), 32 * MIB, s2).unwrap();
    let before = s.driver_stats();
    third.grow_to(20 * MIB).unwrap();
    let since = s.driver_stats().since(&before);
    assert_eq!(since.vmm_calls(), 0);
    assert_eq!(since.count(CallKind::StreamSynchronize), 0);
    assert!(since.count(CallKind::StreamWaitEvent) >= 1, "{since:?}");
    drop(third);
    // Under pressure its pages go before any other: an ordinary block
    // takes the whole device.
    let all = a.allocate(64 * MIB - 2 * MIB, s1).unwrap();
    assert!(a.serving_stats().spare_pages_reclaimed >= 10);
    a.free(all.ptr).unwrap();
    a.check_invariants().unwrap();
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_growth_moves_done_cached_pages_before_the_pool_grows() {
    let (s, a) = sim(64 * MIB);
    // An ordinary block, freed: under `when_full` its 4 pages stay cached in
    // the shared arena, where no growable buffer can use them in place.
    let old = a.allocate(8 * MIB, StreamId(1)).unwrap();
    a.free(old.ptr).unwrap();
    assert_eq!(a.cached_bytes(), 8 * MIB);
    let buf = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    // One stream: no event marks its frees until a driver call is near. The
    // first growth records one and finds it pending: the pool grows.
    buf.grow_to(2 * MIB).unwrap();
    assert_eq!(a.pool_stats().total_pages, 5);
    assert_eq!(a.cached_bytes(), 8 * MIB);
    s.complete_all();
    let before = s.driver_stats();
    buf.grow_to(10 * MIB).unwrap();
    let since = s.driver_stats().since(&before);
    // That work is now known done: the cached pages are unmapped and moved,
    // no page is created.
    assert_eq!(a.pool_stats().total_pages, 5);
    assert_eq!(a.cached_bytes(), 0);
    assert_eq!(since.count(CallKind::Create), 0, "{since:?}");
    assert_eq!(since.count(CallKind::Unmap), 4, "{since:?}");
    assert_eq!(since.count(CallKind::StreamSynchronize), 0);
    a.check_invariants().unwrap();
    // A freed block whose work may still run stays where it is (no wait, no
    // synchronisation): the pool grows instead.
    let pending = a.allocate(8 * MIB, StreamId(1)).unwrap();
    a.free(pending.ptr).unwrap();
    assert_eq!(a.pool_stats().total_pages, 9);
    let before = s.driver_stats();
    buf.grow_to(18 * MIB).unwrap();
    let since = s.driver_stats().since(&before);
    assert_eq!(a.cached_bytes(), 8 * MIB);
    assert_eq!(a.pool_stats().total_pages, 13);
    assert_eq!(since.count(CallKind::Create), 4, "{since:?}");
    assert_eq!(since.count(CallKind::Unmap), 0, "{since:?}");
    assert_eq!(since.count(CallKind::StreamSynchronize), 0);
    a.check_invariants().unwrap();
    drop(buf);
    s.complete_all();
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_default_map_ahead_maps_only_free_pool_pages() {
    let (s, a) = sim(64 * MIB);
    let policy = MapAhead {
        mode: AheadMode::Manual,
        ..MapAhead::default()
    };
    assert_eq!(policy.below_per_mille, 0);
    a.set_map_ahead(policy).unwrap();
    let buf = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    buf.grow_to(4 * MIB).unwrap();
    // No free page in the pool: nothing is mapped ahead, the pool holds what
    // the buffer uses.
    assert_eq!(a.map_ahead_now().unwrap(), 0);
    assert_eq!(a.pool_stats().total_pages, 2);
    // A released buffer's pages are free in the pool: both are mapped ahead
    // (of the 8 wanted: no step seen yet), the nearest first.
    let other = GrowableBuffer::new(a.clone(), 8 * MIB, StreamId(1)).unwrap();
    other.grow_to(4 * MIB).unwrap();
    other.release().unwrap();
    assert_eq!(a.pool_stats().free_pages, 2);
    assert_eq!(a.map_ahead_now().unwrap(), 2);
    assert_eq!(a.pool_stats().total_pages, 4);
    assert_eq!(a.growable_info(buf.id()).unwrap().mapped_bytes, 8 * MIB);
    a.check_invariants().unwrap();
    drop(buf);
    s.complete_all();
    assert_no_leaks_once_dropped(&s, a);
}

#[test]
fn growable_map_ahead_leaves_a_free_page_for_each_other_buffer() {
    let (s, a) = sim(64 * MIB);
    a.set_map_ahead(ahead_policy(4, 0, AheadMode::Manual))
        .unwrap();
    let x = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    let y = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    let z = GrowableBuffer::new(a.clone(), 32 * MIB, StreamId(1)).unwrap();
    x.grow_to(2 * MIB).unwrap();
    y.grow_to(2 * MIB).unwrap();
    // Three free pages: z's release.
    z.grow_to(6 * MIB).unwrap();
    z.release().unwrap();
    s.complete_all();
    assert_eq!(a.pool_stats().free_pages, 3);
    // Two live buffers: each maps ahead only what leaves one free page for
    // the other's next growth (a page taken from it would come back at once):
    // x takes 2 of the 4 it wants, y none.
    assert_eq!(a.map_ahead_now().unwrap(), 2);
    assert_eq!(a.pool_stats().free_pages, 1);
    assert_eq!(a.growable_info(y.id()).unwrap().mapped_bytes, 2 * MIB);
    let before = s.driver_stats();
    y.grow_to(4 * MIB).unwrap(); // the kept page: no page ahead taken back
    let since = s.driver_stats().since(&before);
    assert_eq!(since.count(CallKind::Unmap), 0, "{since:?}");
    assert_eq!(since.count(CallKind::Create), 0, "{since:?}");
    assert_eq!(a.serving_stats().spare_pages_reclaimed, 0);
    a.check_invariants().unwrap();
    drop((x, y));
    assert_no_leaks_once_dropped(&s, a);
}
