//! One policy, validated once: every run-time setter validates the whole
//! configuration, `config()` returns what is in force, and the memory limit
//! changes under the allocator's lock with any limit up to the device's
//! size honoured.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::quilt::{
    AheadMode, MapAhead, MemoryLimit, OffloadTier, QuiltAllocator, QuiltConfig, Recycle,
};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

const GIB: u64 = 1 << 30;

fn quilt(capacity: u64, limit: MemoryLimit) -> QuiltAllocator {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    QuiltAllocator::new(vmm, QuiltConfig::default().with_limit(limit)).unwrap()
}

#[test]
fn setters_validate_and_config_returns_what_is_in_force() {
    let a = quilt(GIB, MemoryLimit::Device);
    let before = a.config();
    let bad = MapAhead {
        pages: 4,
        below_per_mille: 5000,
        mode: AheadMode::Manual,
    };
    assert!(matches!(
        a.set_map_ahead(bad),
        Err(AllocError::InvalidConfig { .. })
    ));
    assert_eq!(a.config(), before, "a refused setting changes nothing");
    let good = MapAhead {
        below_per_mille: 500,
        ..bad
    };
    a.set_map_ahead(good).unwrap();
    a.set_recycle(Recycle { max_buffers: 3 }).unwrap();
    a.set_offload_tier(OffloadTier::OffloadableTags).unwrap();
    let now = a.config();
    assert_eq!(now.map_ahead, good);
    assert_eq!(a.map_ahead(), good);
    assert_eq!(now.recycle, Recycle { max_buffers: 3 });
    assert_eq!(now.offload_tier, OffloadTier::OffloadableTags);
    assert_eq!(now.placement, before.placement);
    a.check_invariants().unwrap();
}

#[test]
fn a_limit_raised_at_run_time_is_honoured() {
    // 3 % of an 8 GiB device, then all of it: the arena was sized from the
    // device, so a 3 GiB block fits at once, and the first refusal says
    // capacity, never fragmentation.
    let a = quilt(8 * GIB, MemoryLimit::Fraction(0.03));
    let small = a.allocate(64 << 20, StreamId::DEFAULT).unwrap();
    match a.allocate(3 * GIB, StreamId::DEFAULT) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.verdict, OomVerdict::Capacity),
        other => panic!("3 GiB under a 3 % limit: {other:?}"),
    }
    a.free(small.ptr).unwrap();
    let bytes = a.set_memory_limit(MemoryLimit::Fraction(1.0)).unwrap();
    assert_eq!(bytes, 8 * GIB);
    assert_eq!(a.config().pool.limit, MemoryLimit::Fraction(1.0));
    assert_eq!(
        a.pool_stats().limit_pages * a.pool_stats().page_size,
        8 * GIB
    );
    let big = a.allocate(3 * GIB, StreamId::DEFAULT).unwrap();
    a.check_invariants().unwrap();
    // Below what live blocks hold: refused, nothing changes.
    assert!(matches!(
        a.set_memory_limit(MemoryLimit::Bytes(GIB)),
        Err(AllocError::Pool(_))
    ));
    assert_eq!(a.config().pool.limit, MemoryLimit::Fraction(1.0));
    a.free(big.ptr).unwrap();
    // Below what the pool holds but nothing live: the cache is drained first.
    a.set_memory_limit(MemoryLimit::Bytes(GIB)).unwrap();
    assert!(a.pool_stats().total_pages * a.pool_stats().page_size <= GIB);
    a.check_invariants().unwrap();
}
