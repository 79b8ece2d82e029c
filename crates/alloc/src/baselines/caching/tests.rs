//! Worked examples of the reference, run on the simulated driver, with the
//! invariant checker after every operation.

use std::sync::Arc;

use quilt_vmm::sim::{Fault, SimVmm};
use quilt_vmm::{CallKind, DevicePtr, StreamId, Vmm};

use crate::api::{Allocation, DeviceAllocator};
use crate::baselines::{CachingAllocator, CachingConfig};
use crate::error::{AllocError, OomVerdict};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn sim(capacity: u64) -> Arc<SimVmm> {
    Arc::new(SimVmm::with_capacity(capacity).unwrap())
}

fn classic_on(vmm: &Arc<SimVmm>, config: CachingConfig) -> CachingAllocator {
    let a = CachingAllocator::new(vmm.clone() as Arc<dyn Vmm>, config).unwrap();
    a.check_invariants().unwrap();
    a
}

fn expandable_on(vmm: &Arc<SimVmm>) -> CachingAllocator {
    let a =
        CachingAllocator::new(vmm.clone() as Arc<dyn Vmm>, CachingConfig::expandable()).unwrap();
    a.check_invariants().unwrap();
    a
}

fn alloc(a: &dyn DeviceAllocator, size: u64, stream: StreamId) -> Allocation {
    let r = a.allocate(size, stream).unwrap();
    a.check_invariants().unwrap();
    r
}

fn free(a: &dyn DeviceAllocator, ptr: DevicePtr) {
    a.free(ptr).unwrap();
    a.check_invariants().unwrap();
}

fn reserved(a: &dyn DeviceAllocator) -> u64 {
    a.stats().reserved_bytes.current
}

#[test]
fn eleven_mib_gets_an_unsplit_twelve_mib_block() {
    let vmm = sim(1 << 30);
    let a = classic_on(&vmm, CachingConfig::classic());
    let x = alloc(&a, 11 * MIB, S0);
    assert_eq!(x.size, 12 * MIB);
    assert_eq!(reserved(&a), 12 * MIB);
    free(&a, x.ptr);
    let y = alloc(&a, 11 * MIB, S0);
    assert_eq!((y.ptr, y.size), (x.ptr, 12 * MIB));
    assert_eq!(reserved(&a), 12 * MIB);
    assert_eq!(a.stats().inactive_split.current, 0);
    free(&a, y.ptr);
}

#[test]
fn segment_sizes_follow_the_table() {
    let vmm = sim(1 << 30);
    let a = classic_on(&vmm, CachingConfig::classic());
    let small = alloc(&a, 1, S0);
    assert_eq!((small.size, reserved(&a)), (512, 2 * MIB));
    let small2 = alloc(&a, 1_000_000, S0);
    assert_eq!(small2.size, 1_000_448);
    assert_eq!(
        small2.ptr,
        small.ptr + 512,
        "small requests share the 2 MiB segment"
    );
    assert_eq!(reserved(&a), 2 * MIB);
    let medium = alloc(&a, MIB + 1, S0);
    assert_eq!((medium.size, reserved(&a)), (1_049_088, 22 * MIB));
    let s = a.stats();
    assert_eq!(
        s.inactive_split_bytes.current,
        2 * MIB - 512 - 1_000_448 + 20 * MIB - 1_049_088
    );
    assert_eq!(s.inactive_split.current, 2);
    // 13.5 MiB fits the 20 MiB segment's remainder; on another stream it gets its own.
    let big = alloc(&a, 13 * MIB + MIB / 2, S1);
    assert_eq!((big.size, reserved(&a)), (14 * MIB, 36 * MIB));
    let ten = alloc(&a, 10 * MIB, StreamId(2));
    assert_eq!((ten.size, reserved(&a)), (10 * MIB, 46 * MIB));
    assert_eq!(a.stats().segment.current, 4);
    for p in [small.ptr, small2.ptr, medium.ptr, big.ptr, ten.ptr] {
        free(&a, p);
    }
    assert_eq!(a.stats().inactive_split.current, 0);
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(reserved(&a), 0);
    assert_eq!(a.stats().reserved_bytes.peak, 46 * MIB);
}

#[test]
fn free_neighbours_merge() {
    let vmm = sim(1 << 30);
    let a = classic_on(&vmm, CachingConfig::classic());
    let x = alloc(&a, 5 * MIB, S0);
    let y = alloc(&a, 5 * MIB, S0);
    let z = alloc(&a, 5 * MIB, S0);
    assert_eq!((y.ptr, z.ptr), (x.ptr + 5 * MIB, x.ptr + 10 * MIB));
    free(&a, x.ptr);
    free(&a, z.ptr);
    assert_eq!(a.stats().inactive_split.current, 2);
    free(&a, y.ptr);
    let s = a.stats();
    assert_eq!(
        (s.inactive_split.current, s.inactive_split_bytes.current),
        (0, 0)
    );
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1);
    assert_eq!(snap.segments[0].blocks[0].size, 20 * MIB);
    // One free 20 MiB block serves a 19 MiB request whole (remainder 1 MiB: no split).
    let w = alloc(&a, 19 * MIB, S0);
    assert_eq!((w.ptr, w.size), (x.ptr, 20 * MIB));
    free(&a, w.ptr);
}

#[test]
fn oversize_blocks_are_not_split_or_given_to_small_requests() {
    let vmm = sim(1 << 30);
    let config = CachingConfig {
        max_split_size: Some(32 * MIB),
        ..CachingConfig::classic()
    };
    let a = classic_on(&vmm, config);
    let big = alloc(&a, 40 * MIB, S0);
    free(&a, big.ptr);
    // 30 MiB < max_split: the cached 40 MiB block is oversize and must not serve it.
    let x = alloc(&a, 30 * MIB, S0);
    assert_ne!(x.ptr, big.ptr);
    assert_eq!(reserved(&a), 70 * MIB);
    // 45 MiB ≥ max_split: a cached 50 MiB block is within 20 MiB, served unsplit.
    let y = alloc(&a, 50 * MIB, S0);
    free(&a, y.ptr);
    let z = alloc(&a, 45 * MIB, S0);
    assert_eq!((z.ptr, z.size), (y.ptr, 50 * MIB));
    // 36 MiB ≥ max_split: the cached 40 MiB block serves it unsplit (40 < 36 + 20).
    let w = alloc(&a, 36 * MIB, S0);
    assert_eq!((w.ptr, w.size), (big.ptr, 40 * MIB));
    assert_eq!(a.stats().inactive_split.current, 0);
    for p in [x.ptr, z.ptr, w.ptr] {
        free(&a, p);
    }
}

#[test]
fn max_split_release_frees_oversize_segments_before_everything() {
    let vmm = sim(100 * MIB);
    let config = CachingConfig {
        max_split_size: Some(20 * MIB),
        ..CachingConfig::classic()
    };
    let a = classic_on(&vmm, config);
    let small = alloc(&a, 5 * MIB, S0); // 20 MiB segment, oversize, split
    let big = alloc(&a, 60 * MIB, S0);
    free(&a, big.ptr);
    // 30 MiB: the cached 60 MiB block is more than 20 MiB larger; device has 20 MiB
    // left; release_available_cached_blocks frees the 60 MiB segment, no full retry.
    let x = alloc(&a, 30 * MIB, S0);
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(reserved(&a), 50 * MIB);
    free(&a, x.ptr);
    free(&a, small.ptr);
}

#[test]
fn release_and_retry_before_out_of_memory() {
    let vmm = sim(64 * MIB);
    let a = classic_on(&vmm, CachingConfig::classic());
    let x = alloc(&a, 40 * MIB, S0);
    free(&a, x.ptr);
    // Stream 1 cannot see stream 0's cache: the device is full until it is released.
    let y = alloc(&a, 40 * MIB, S1);
    let s = a.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.reserved_bytes.current, 40 * MIB);
    assert_eq!(s.reserved_bytes.peak, 40 * MIB);
    free(&a, y.ptr);
}

#[test]
fn oom_verdicts() {
    let vmm = sim(40 * MIB);
    let a = classic_on(&vmm, CachingConfig::classic());
    let err = a.allocate(100 * MIB, S0).unwrap_err();
    a.check_invariants().unwrap();
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Capacity);
    assert_eq!((r.requested, r.capacity), (100 * MIB, 40 * MIB));

    let p = alloc(&a, 5 * MIB, S0);
    let q = alloc(&a, 5 * MIB, S0);
    let c = alloc(&a, 12 * MIB, S0);
    free(&a, p.ptr);
    // 15 MiB cached in the split segment + 8 MiB device free ≥ 16 MiB, but no piece fits.
    let err = a.allocate(16 * MIB, S0).unwrap_err();
    a.check_invariants().unwrap();
    let r = err.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Fragmentation);
    assert_eq!(r.reclaimable, 15 * MIB);
    assert_eq!(r.device_free, 8 * MIB);
    assert_eq!(r.largest_free_extent, 10 * MIB);
    let s = a.stats();
    assert_eq!((s.num_ooms, s.num_alloc_retries), (2, 2));
    // Still usable.
    free(&a, q.ptr);
    let d = alloc(&a, 16 * MIB, S0);
    free(&a, d.ptr);
    free(&a, c.ptr);
}

#[test]
fn memory_fraction_caps_reservations() {
    let vmm = sim(100 * MIB);
    let config = CachingConfig {
        memory_fraction: Some(0.5),
        ..CachingConfig::classic()
    };
    let a = classic_on(&vmm, config);
    let err = a.allocate(60 * MIB, S0).unwrap_err();
    let r = err.oom_report().unwrap();
    assert_eq!((r.capacity, r.verdict), (50 * MIB, OomVerdict::Capacity));
    let x = alloc(&a, 50 * MIB, S0);
    free(&a, x.ptr);
}

#[test]
fn garbage_collection_frees_the_oldest_cached_segments() {
    let vmm = sim(100 * MIB);
    let config = CachingConfig {
        memory_fraction: Some(0.5),
        garbage_collection_threshold: Some(0.5),
        ..CachingConfig::classic()
    };
    let a = classic_on(&vmm, config);
    let x = alloc(&a, 22 * MIB, S0);
    free(&a, x.ptr);
    let y = alloc(&a, 24 * MIB, S0);
    free(&a, y.ptr);
    assert_eq!(reserved(&a), 46 * MIB);
    // 46 MiB held > 25 MiB threshold: the older 22 MiB segment goes, then 26 MiB fits.
    let z = alloc(&a, 26 * MIB, S0);
    assert_eq!(reserved(&a), 50 * MIB);
    assert_eq!(a.stats().num_alloc_retries, 0);
    let w = alloc(&a, 24 * MIB, S0);
    assert_eq!(w.ptr, y.ptr, "the younger 24 MiB segment stayed cached");
    free(&a, z.ptr);
    free(&a, w.ptr);
}

#[test]
fn record_stream_delays_reuse_until_the_event_completes() {
    let vmm = sim(1 << 30);
    let a = classic_on(&vmm, CachingConfig::classic());
    let x = alloc(&a, 5 * MIB, S0);
    a.record_stream(x.ptr, S1).unwrap();
    a.record_stream(x.ptr, S0).unwrap(); // own stream: ignored
    a.check_invariants().unwrap();
    free(&a, x.ptr);
    let s = a.stats();
    assert_eq!(
        (s.allocated_bytes.current, s.active_bytes.current),
        (0, 5 * MIB)
    );
    assert_eq!(
        a.free(x.ptr).unwrap_err(),
        AllocError::DoubleFree { ptr: x.ptr }
    );
    let y = alloc(&a, 5 * MIB, S0);
    assert_ne!(y.ptr, x.ptr, "pending block must not be reused");
    vmm.complete_stream(S1);
    let z = alloc(&a, 5 * MIB, S0);
    assert_eq!(z.ptr, x.ptr, "completed block is reused");
    a.record_stream(z.ptr, S1).unwrap();
    free(&a, z.ptr);
    assert_eq!(a.stats().active.current, 2);
    a.empty_cache().unwrap(); // synchronises
    a.check_invariants().unwrap();
    assert_eq!(a.stats().active.current, 1);
    free(&a, y.ptr);
    a.empty_cache().unwrap();
    assert_eq!(reserved(&a), 0);
    drop(a);
    assert!(vmm.leak_report().is_empty(), "{:?}", vmm.leak_report());
}

fn bad_input_is_rejected(a: &dyn DeviceAllocator) {
    for size in [0, u64::MAX, usize::MAX as u64, (1 << 40) + 1] {
        assert!(matches!(
            a.allocate(size, S0),
            Err(AllocError::InvalidSize { .. })
        ));
        a.check_invariants().unwrap();
    }
    let x = alloc(a, 3 * MIB, S0);
    for ptr in [0, 0xdead, x.ptr + 512, x.ptr + 3 * MIB] {
        assert_eq!(a.free(ptr).unwrap_err(), AllocError::UnknownPointer { ptr });
        assert!(a.record_stream(ptr, S1).is_err());
        a.check_invariants().unwrap();
    }
    free(a, x.ptr);
    assert_eq!(
        a.free(x.ptr).unwrap_err(),
        AllocError::DoubleFree { ptr: x.ptr }
    );
    assert_eq!(
        a.record_stream(x.ptr, S1).unwrap_err(),
        AllocError::UnknownPointer { ptr: x.ptr }
    );
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocation.current, 0);
}

#[test]
fn bad_input_gives_typed_errors() {
    let vmm = sim(1 << 30);
    bad_input_is_rejected(&classic_on(&vmm, CachingConfig::classic()));
    bad_input_is_rejected(&expandable_on(&vmm));
    assert!(CachingAllocator::new(
        vmm.clone(),
        CachingConfig {
            max_split_size: Some(MIB),
            ..CachingConfig::classic()
        }
    )
    .is_err());
    assert!(CachingAllocator::new(
        vmm.clone(),
        CachingConfig {
            garbage_collection_threshold: Some(1.5),
            ..CachingConfig::classic()
        }
    )
    .is_err());
    for va_reserve_bytes in [Some(0), Some(1 << 30)] {
        let classic = CachingConfig {
            va_reserve_bytes,
            ..CachingConfig::classic()
        };
        assert!(matches!(
            CachingAllocator::new(vmm.clone(), classic),
            Err(AllocError::InvalidSize { .. })
        ));
    }
    let no_reservation = CachingConfig {
        va_reserve_bytes: Some(0),
        ..CachingConfig::expandable()
    };
    assert!(CachingAllocator::new(vmm.clone(), no_reservation).is_err());
}

#[test]
fn the_presets_name_the_allocator() {
    let vmm = sim(1 << 30);
    assert_eq!(CachingConfig::default(), CachingConfig::classic());
    assert_eq!(classic_on(&vmm, CachingConfig::classic()).name(), "classic");
    assert_eq!(expandable_on(&vmm).name(), "expandable");
}

#[test]
fn expandable_maps_twenty_mib_pages_at_the_tail() {
    let vmm = sim(1 << 30);
    let a = expandable_on(&vmm);
    let mut live = Vec::new();
    let mut seen = Vec::new();
    for _ in 0..8 {
        live.push(alloc(&a, 16 * MIB, S0));
        seen.push(reserved(&a) / MIB);
    }
    assert_eq!(seen, [20, 40, 60, 80, 80, 100, 120, 140]);
    assert_eq!(vmm.driver_stats().count(CallKind::Create), 7);
    for w in live.windows(2) {
        assert_eq!(w[1].ptr, w[0].ptr + 16 * MIB, "blocks are contiguous");
    }
    for x in &live {
        free(&a, x.ptr);
    }
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1);
    assert_eq!(snap.segments[0].blocks[0].size, 140 * MIB);
    let calls = vmm.driver_stats().vmm_calls();
    let again: Vec<_> = (0..4).map(|_| alloc(&a, 32 * MIB, S0)).collect();
    assert_eq!(
        vmm.driver_stats().vmm_calls(),
        calls,
        "no driver call for cached pages"
    );
    for x in &again {
        free(&a, x.ptr);
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(reserved(&a), 0);
    assert_eq!(vmm.leak_report().reservations.len(), 0);
    assert_eq!(a.stats().segment.current, 0);
}

#[test]
fn expandable_small_pool_uses_two_mib_pages_and_refills_holes() {
    let vmm = sim(1 << 30);
    let a = expandable_on(&vmm);
    let x = alloc(&a, 1, S0);
    assert_eq!((x.size, reserved(&a)), (512, 2 * MIB));
    let big: Vec<_> = (0..3).map(|_| alloc(&a, 30 * MIB, S0)).collect();
    assert_eq!(reserved(&a), 2 * MIB + 100 * MIB);
    // Free the middle block and release: its whole pages are unmapped.
    free(&a, big[1].ptr);
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let after_release = reserved(&a);
    assert!(after_release < 2 * MIB + 100 * MIB);
    // A new block refills the hole (lowest gap) before the tail grows.
    let y = alloc(&a, 30 * MIB, S0);
    assert_eq!(y.ptr, big[1].ptr);
    assert_eq!(reserved(&a), 2 * MIB + 100 * MIB);
    for p in [x.ptr, big[0].ptr, big[2].ptr, y.ptr] {
        free(&a, p);
    }
}

#[test]
fn expandable_releases_and_retries_before_oom() {
    let vmm = sim(100 * MIB);
    let a = expandable_on(&vmm);
    let x = alloc(&a, 60 * MIB, S0);
    free(&a, x.ptr);
    let y = alloc(&a, 60 * MIB, S1);
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(reserved(&a), 60 * MIB);
    let err = a.allocate(60 * MIB, S1).unwrap_err();
    a.check_invariants().unwrap();
    assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::Capacity);
    free(&a, y.ptr);
    drop(a);
    assert!(vmm.leak_report().is_empty());
}

/// Run a small mixed workload, failing the `k`th VMM call; every error is typed
/// and the invariants hold after each step.
fn workload_with_fault(a: &dyn DeviceAllocator) {
    let sizes = [512, 3 * MIB, 700_000, 12 * MIB, 25 * MIB, 1, 5 * MIB];
    let mut live = Vec::new();
    for round in 0..3u64 {
        for (i, &s) in sizes.iter().enumerate() {
            let stream = StreamId((i as u64 + round) % 2);
            if let Ok(x) = a.allocate(s, stream) {
                live.push(x.ptr);
            }
            a.check_invariants().unwrap();
            if i % 3 == 2 && !live.is_empty() {
                let p = live.remove(0);
                if a.free(p).is_err() {
                    live.push(p);
                }
                a.check_invariants().unwrap();
            }
        }
        let _ = a.empty_cache();
        a.check_invariants().unwrap();
    }
    for p in live {
        let _ = a.free(p);
        a.check_invariants().unwrap();
    }
    let _ = a.empty_cache();
    a.check_invariants().unwrap();
}

#[test]
fn driver_faults_leave_the_allocator_consistent() {
    for expandable in [false, true] {
        for k in 1..60 {
            let vmm = sim(200 * MIB);
            let a: Box<dyn DeviceAllocator> = if expandable {
                Box::new(expandable_on(&vmm))
            } else {
                Box::new(classic_on(&vmm, CachingConfig::classic()))
            };
            vmm.inject(Fault::nth_overall(k));
            workload_with_fault(&*a);
            vmm.clear_faults();
            drop(a);
            let leaks = vmm.leak_report();
            assert!(leaks.is_empty(), "k={k} expandable={expandable}: {leaks:?}");
        }
    }
}
