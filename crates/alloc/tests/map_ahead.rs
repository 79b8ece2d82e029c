//! A block that makes the pool grow maps the growth's margin pages right
//! after it, under its one set-access: the next blocks at the arena's top
//! find them mapped and make no driver call, and the memory held is what
//! the pool created either way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::quilt::{GrowthPolicy, QuiltAllocator, QuiltConfig, SmallBlocks};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
const S0: StreamId = StreamId(0);

fn count(sim: &SimVmm, kind: CallKind) -> u64 {
    sim.driver_stats().count(kind)
}

#[test]
fn the_growth_margin_is_mapped_after_the_block_that_grew_the_pool() {
    let sim = Arc::new(SimVmm::with_capacity(4096 * MIB).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap();
    // 512 pages: the pool held nothing, so no margin.
    let x = a.allocate(512 * PAGE, S0).unwrap();
    assert_eq!(count(&sim, CallKind::Create), 512);
    assert_eq!(count(&sim, CallKind::Map), 512);
    assert_eq!(count(&sim, CallKind::SetAccess), 1);

    // One more page: the pool grows by it and by a margin of 512 / 256 = 2
    // pages, which are mapped after the block in the same calls.
    let y = a.allocate(PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(y.ptr, x.ptr + 512 * PAGE, "at the arena's top");
    assert_eq!(count(&sim, CallKind::Create), 515);
    assert_eq!(count(&sim, CallKind::Map), 515, "the margin is mapped too");
    assert_eq!(
        count(&sim, CallKind::SetAccess),
        2,
        "under the block's one set-access"
    );
    assert_eq!(
        a.stats().reserved_bytes.current,
        515 * PAGE,
        "memory held unchanged"
    );

    // The next blocks at the top land on the margin: no driver call.
    let calls = sim.driver_stats().vmm_calls();
    let z = a.allocate(PAGE + MIB, S0).unwrap();
    let w = a.allocate(MIB, S0).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(z.ptr, y.ptr + PAGE);
    assert_eq!(w.ptr, z.ptr + PAGE + MIB);
    assert_eq!(
        sim.driver_stats().vmm_calls(),
        calls,
        "no VMM call on the margin"
    );

    // Past the margin the top needs new pages again.
    let v = a.allocate(PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(v.ptr, w.ptr + MIB);
    assert!(sim.driver_stats().vmm_calls() > calls);
    for b in [x, y, z, w, v] {
        a.free(b.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn without_a_growth_margin_only_the_block_is_mapped() {
    let sim = Arc::new(SimVmm::with_capacity(4096 * MIB).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let mut cfg = QuiltConfig::default();
    cfg.pool.growth = GrowthPolicy::exact();
    let a = QuiltAllocator::new(vmm, cfg).unwrap();
    let x = a.allocate(512 * PAGE, S0).unwrap();
    let y = a.allocate(PAGE, S0).unwrap();
    assert_eq!(count(&sim, CallKind::Create), 513);
    assert_eq!(count(&sim, CallKind::Map), 513, "nothing mapped ahead");
    let calls = sim.driver_stats().vmm_calls();
    let z = a.allocate(PAGE, S0).unwrap();
    assert!(
        sim.driver_stats().vmm_calls() > calls,
        "the next page is new"
    );
    for b in [x, y, z] {
        a.free(b.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn beside_another_arena_the_margin_stays_in_the_pool() {
    let sim = Arc::new(SimVmm::with_capacity(4096 * MIB).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let mut cfg = QuiltConfig::default();
    cfg.layout.small = SmallBlocks::PYTORCH;
    let a = QuiltAllocator::new(vmm, cfg).unwrap();
    // A small block: an arena of its own for small blocks, one page.
    let s = a.allocate(4096, S0).unwrap();
    let x = a.allocate(512 * PAGE, S0).unwrap();
    let maps = sim.driver_stats().count(CallKind::Map);
    // The pool grows by the page and a margin of 2 pages, which the small
    // blocks' arena may want: they stay free in the pool, unmapped.
    let y = a.allocate(PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(sim.driver_stats().count(CallKind::Map), maps + 1);
    assert_eq!(a.stats().reserved_bytes.current, 516 * PAGE);
    for b in [s, x, y] {
        a.free(b.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

/// Blocks of three streams, each stream's work 16 operations behind (so
/// another stream's freed memory needs a wait for a while), replayed
/// through `cfg`: the addresses handed out, and the set-access calls made.
fn replay_three_streams(cfg: QuiltConfig) -> (Vec<u64>, u64) {
    let sim = Arc::new(SimVmm::with_capacity(64 << 30).unwrap());
    sim.set_gpu_lag_ops(16);
    let vmm: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(vmm, cfg).unwrap();
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut live: Vec<(u64, StreamId)> = Vec::new();
    let mut placed = Vec::new();
    for _ in 0..4000 {
        let r = next();
        if live.len() > 40 || (!live.is_empty() && r % 3 == 0) {
            let (ptr, s) = live.swap_remove((r / 3) as usize % live.len());
            sim.queue_work(s);
            a.free(ptr).unwrap();
        } else {
            let s = StreamId(r % 3);
            let size = 4096 + (next() % (24 * MIB));
            sim.queue_work(s);
            let b = a.allocate(size, s).unwrap();
            placed.push(b.ptr);
            live.push((b.ptr, s));
        }
        sim.advance(1);
    }
    a.check_invariants().unwrap();
    (placed, count(&sim, CallKind::SetAccess))
}

#[test]
fn mapping_ahead_changes_no_placement() {
    let (ahead, ahead_calls) = replay_three_streams(QuiltConfig::default());
    let mut exact = QuiltConfig::default();
    exact.pool.growth = GrowthPolicy::exact();
    let (plain, plain_calls) = replay_three_streams(exact);
    assert_eq!(ahead.len(), plain.len());
    let first = ahead.iter().zip(&plain).position(|(a, b)| a != b);
    assert_eq!(
        first, None,
        "the same places with and without mapping ahead"
    );
    // Here (work pending on three streams) the pool's pages carry hazards
    // often enough that mapping ahead rarely engages: it must cost no call.
    // That it spares calls where it engages is the first test's.
    assert!(
        ahead_calls <= plain_calls,
        "mapping ahead costs no set-access call: {ahead_calls} against {plain_calls}"
    );
}
