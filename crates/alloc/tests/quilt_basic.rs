//! Quilt on the simulated backend: packing, caching, streams, bad input, drop, threads.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::sim::{Fault, SimVmm};
use quilt_vmm::{CallKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn setup(capacity: u64) -> (Arc<SimVmm>, QuiltAllocator) {
    setup_with(capacity, QuiltConfig::default())
}

fn setup_with(capacity: u64, config: QuiltConfig) -> (Arc<SimVmm>, QuiltAllocator) {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, config).unwrap();
    (sim, a)
}

fn per_stream() -> QuiltConfig {
    QuiltConfig {
        shared_arena: false,
        ..QuiltConfig::default()
    }
}

fn ok(a: &QuiltAllocator) {
    a.check_invariants().unwrap();
}

#[test]
fn neighbours_share_boundary_pages() {
    let (sim, a) = setup(1 << 30);
    let size = 2 * MIB + MIB / 4; // 2.25 MiB
    let mut ptrs = Vec::new();
    for _ in 0..16 {
        let al = a.allocate(size, S0).unwrap();
        assert_eq!(al.size, size);
        ptrs.push(al.ptr);
        ok(&a);
    }
    for w in ptrs.windows(2) {
        assert_eq!(w[1] - w[0], size, "blocks are VA neighbours");
    }
    // 16 x 2.25 MiB = 36 MiB = 18 pages, not 16 x 4 MiB.
    assert_eq!(a.touched_bytes(), 36 * MIB);
    let st = a.stats();
    assert_eq!(st.allocated_bytes.current, 16 * size);
    for p in ptrs {
        a.free(p).unwrap();
        ok(&a);
    }
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn freed_blocks_are_reused_without_driver_calls() {
    let (_sim, a) = setup(1 << 30);
    let sizes = [3 * MIB + 512, 700 * 1024, 17 * MIB, 4096, 2 * MIB];
    let mut ptrs: Vec<u64> = sizes
        .iter()
        .map(|&s| a.allocate(s, S0).unwrap().ptr)
        .collect();
    for p in ptrs.drain(..) {
        a.free(p).unwrap();
    }
    let before = a.vmm().driver_stats().vmm_calls();
    for _ in 0..3 {
        let ps: Vec<u64> = sizes
            .iter()
            .map(|&s| a.allocate(s, S0).unwrap().ptr)
            .collect();
        for p in ps.into_iter().rev() {
            a.free(p).unwrap();
            ok(&a);
        }
    }
    assert_eq!(a.vmm().driver_stats().vmm_calls(), before);
}

#[test]
fn small_requests_pack_inside_pages() {
    let (_sim, a) = setup(1 << 30);
    let mut ptrs = Vec::new();
    for i in 0..1000u64 {
        ptrs.push(a.allocate(1 + (i % 8) * 512, S0).unwrap());
    }
    let used: u64 = ptrs.iter().map(|p| p.size).sum();
    assert!(a.touched_bytes() <= used.div_ceil(2 * MIB) * 2 * MIB);
    ok(&a);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (sim, a) = setup(256 * MIB);
    assert!(matches!(
        a.allocate(0, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.allocate(u64::MAX, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.allocate(u64::MAX - 10, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    let e = a.allocate(512 * MIB, S0).unwrap_err();
    let r = e.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Capacity);
    ok(&a);
    assert!(matches!(a.free(0), Err(AllocError::UnknownPointer { .. })));
    assert!(matches!(
        a.free(0xdead_beef),
        Err(AllocError::UnknownPointer { .. })
    ));
    let x = a.allocate(5 * MIB, S0).unwrap();
    assert!(matches!(
        a.free(x.ptr + 512),
        Err(AllocError::UnknownPointer { .. })
    ));
    a.free(x.ptr).unwrap();
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    assert!(a.record_stream(x.ptr, S1).is_err());
    ok(&a);
    let y = a.allocate(5 * MIB, S0).unwrap();
    a.free(y.ptr).unwrap();
    ok(&a);
    assert_eq!(a.stats().num_ooms, 1);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn drop_with_live_blocks_releases_everything() {
    let (sim, a) = setup(256 * MIB);
    for i in 0..20 {
        a.allocate(MIB * (i + 1) / 2 + 100, StreamId(i % 3))
            .unwrap();
    }
    let x = a.allocate(3 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty(), "{:?}", sim.leak_report());
}

#[test]
fn record_stream_delays_reuse_until_event_completes() {
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    let y = a.allocate(4 * MIB, S0).unwrap();
    assert_ne!(y.ptr, x.ptr, "still pending on stream 1");
    assert_eq!(a.stats().active.current, 2);
    sim.complete_stream(S1);
    a.free(y.ptr).unwrap();
    let z = a.allocate(4 * MIB, S0).unwrap();
    ok(&a);
    assert_eq!(a.stats().active.current, 1);
    a.free(z.ptr).unwrap();
    ok(&a);
}

#[test]
fn shared_arena_reuses_another_streams_block_after_a_wait() {
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let calls = sim.driver_stats().vmm_calls();
    let y = a.allocate(40 * MIB, S1).unwrap();
    assert_eq!(y.ptr, x.ptr, "the block freed on stream 0 serves stream 1");
    assert_eq!(sim.driver_stats().vmm_calls(), calls, "no VMM call");
    assert_eq!(
        a.stats().num_stream_waits,
        1,
        "stream 1 waited for stream 0"
    );
    // Reuse on the freeing stream itself needs no wait.
    a.free(y.ptr).unwrap();
    let z = a.allocate(40 * MIB, S1).unwrap();
    assert_eq!(a.stats().num_stream_waits, 1);
    a.free(z.ptr).unwrap();
    ok(&a);
}

#[test]
fn cached_pages_move_to_another_stream_under_pressure() {
    let (sim, a) = setup_with(64 * MIB, per_stream());
    let x = a.allocate(60 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    // Stream 1 needs the pages cached by stream 0: it waits on stream 0's event.
    let y = a.allocate(40 * MIB, S1).unwrap();
    ok(&a);
    let st = a.stats();
    assert!(st.num_stream_waits >= 1);
    assert!(sim.driver_stats().count(CallKind::StreamWaitEvent) >= 1);
    assert!(st.reserved_bytes.current <= 64 * MIB);
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

#[test]
fn scattered_pages_serve_a_large_request() {
    // 64 MiB device: fill it with 2 MiB blocks, free every other one, then ask
    // for 32 MiB: only scattered pages are left, and they suffice.
    let (_sim, a) = setup(64 * MIB);
    let ptrs: Vec<u64> = (0..32)
        .map(|_| a.allocate(2 * MIB, S0).unwrap().ptr)
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    ok(&a);
    let big = a.allocate(32 * MIB, S0).unwrap();
    ok(&a);
    assert!(a.allocate(2 * MIB + 1, S0).is_err());
    a.free(big.ptr).unwrap();
    ok(&a);
}

#[test]
fn driver_failures_leave_state_consistent() {
    for kind in [
        CallKind::Create,
        CallKind::Map,
        CallKind::SetAccess,
        CallKind::Reserve,
    ] {
        let (sim, a) = setup(64 * MIB);
        let keep = a.allocate(3 * MIB, S0).unwrap();
        sim.inject(Fault::nth(kind, 1));
        let r = a.allocate(20 * MIB, S1);
        ok(&a);
        if let Ok(x) = r {
            a.free(x.ptr).unwrap();
        }
        let x = a.allocate(20 * MIB, S1).unwrap();
        a.free(x.ptr).unwrap();
        a.free(keep.ptr).unwrap();
        ok(&a);
        drop(a);
        assert!(sim.leak_report().is_empty(), "{kind:?}");
    }
    // A failing unmap during reclaim (per-stream arenas: stream 1 must take
    // stream 0's cached pages apart).
    let (sim, a) = setup_with(32 * MIB, per_stream());
    let x = a.allocate(30 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    sim.inject(Fault::nth(CallKind::Unmap, 1));
    assert!(a.allocate(20 * MIB, S1).is_err());
    ok(&a);
    let y = a.allocate(20 * MIB, S1).unwrap();
    a.free(y.ptr).unwrap();
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn memory_limit_is_honoured() {
    let sim = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(
        v,
        QuiltConfig::default().with_limit(MemoryLimit::Bytes(64 * MIB)),
    )
    .unwrap();
    let x = a.allocate(60 * MIB, S0).unwrap();
    let e = a.allocate(8 * MIB, S0).unwrap_err();
    assert_eq!(e.oom_report().unwrap().verdict, OomVerdict::Capacity);
    assert!(a.stats().reserved_bytes.peak <= 64 * MIB);
    a.free(x.ptr).unwrap();
    ok(&a);
}

#[test]
fn eight_threads_on_eight_streams() {
    let (sim, a) = setup(2 << 30);
    let a = Arc::new(a);
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut live = Vec::new();
                let mut x = t * 7919 + 1;
                for i in 0..400u64 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if live.len() > 20 || (i % 3 == 2 && !live.is_empty()) {
                        let idx = (x >> 33) as usize % live.len();
                        let p: u64 = live.swap_remove(idx);
                        a.free(p).unwrap();
                    } else {
                        let size = 1 + (x >> 40) % (12 * MIB);
                        if let Ok(al) = a.allocate(size, StreamId(t)) {
                            live.push(al.ptr);
                        }
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocation.current, 0);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn allocator_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<QuiltAllocator>();
}

#[test]
fn gmlake_preset_is_a_configuration() {
    let sim = Arc::new(SimVmm::with_capacity(2 << 30).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, QuiltConfig::gmlake()).unwrap();
    assert_eq!(a.name(), "gmlake");
    let before = sim.driver_stats();
    let x = a.allocate(10 * MIB, S0).unwrap();
    let d = sim.driver_stats().since(&before);
    // One 2 MiB handle per page, mapped and access-set one by one.
    assert_eq!(d.count(CallKind::Create), 5);
    assert_eq!(d.count(CallKind::Map), 5);
    assert_eq!(d.count(CallKind::SetAccess), 5);
    // Below the stitch threshold, fresh blocks start on a page: no boundary sharing.
    let y = a.allocate(3 * MIB, S0).unwrap();
    let z = a.allocate(3 * MIB, S0).unwrap();
    assert_eq!(y.ptr % (2 * MIB), 0);
    assert_eq!(z.ptr - y.ptr, 4 * MIB);
    ok(&a);
    // A cached block is reused without driver calls.
    a.free(x.ptr).unwrap();
    let calls = sim.driver_stats().vmm_calls();
    let x2 = a.allocate(10 * MIB, S0).unwrap();
    assert_eq!(x2.ptr, x.ptr);
    assert_eq!(sim.driver_stats().vmm_calls(), calls);
    // At or above the threshold, requests are stitched from pages anywhere.
    let big = a.allocate(600 * MIB, S0).unwrap();
    ok(&a);
    for p in [x2.ptr, y.ptr, z.ptr, big.ptr] {
        a.free(p).unwrap();
    }
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn gmlake_preset_survives_pressure() {
    let sim = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, QuiltConfig::gmlake()).unwrap();
    let ptrs: Vec<u64> = (0..16)
        .map(|_| a.allocate(3 * MIB, S0).unwrap().ptr)
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    ok(&a);
    // 8 x 4 MiB of pages are cached: a fresh 30 MiB block needs 15 of them.
    let big = a.allocate(30 * MIB, S1).unwrap();
    ok(&a);
    a.free(big.ptr).unwrap();
    for p in ptrs.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
    }
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

#[test]
fn single_owner_runs_map_whole_runs_and_split_cached_ones() {
    let cfg = QuiltConfig::default().with_limit(MemoryLimit::Bytes(16 * MIB));
    assert!(cfg.single_owner_runs && !cfg.remap_live_pages);
    let (sim, a) = setup_with(1 << 30, cfg);
    // A page-aligned 8 MiB block: its four pages in one map call.
    let maps = sim.driver_stats().count(CallKind::Map);
    let big = a.allocate(8 * MIB, S0).unwrap();
    ok(&a);
    let big_maps = sim.driver_stats().count(CallKind::Map) - maps;
    assert!(
        big_maps <= 2,
        "{big_maps} map calls for one run (and map-ahead)"
    );
    a.free(big.ptr).unwrap();
    ok(&a);
    // Blocks that cover the cached run in part split it; every step keeps
    // every multi-page mapping single-owner (checked by check_invariants).
    let mut live = Vec::new();
    for size in [3 * MIB, MIB + MIB / 2, 5 * MIB, 512 * 1024, 2 * MIB] {
        live.push(a.allocate(size, S0).unwrap().ptr);
        ok(&a);
    }
    // Free every other block, then fill the limit: all cached pages must be
    // reclaimable without touching the live ones.
    for p in live.iter().step_by(2) {
        a.free(*p).unwrap();
        ok(&a);
    }
    let fill = 16 * MIB - a.touched_bytes() - 2 * MIB;
    let f = a.allocate(fill, S0).unwrap();
    ok(&a);
    a.free(f.ptr).unwrap();
    for p in live.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
        ok(&a);
    }
    drop(a);
    assert!(sim.leak_report().is_empty());
}
