//! Unit tests of the page pool on the simulated backend.

use std::sync::Arc;

use quilt_vmm::sim::{Fault, SimVmm};
use quilt_vmm::{CallKind, Vmm};

use super::*;

const MIB: u64 = 1 << 20;

fn sim(cap: u64) -> Arc<SimVmm> {
    Arc::new(SimVmm::with_capacity(cap).unwrap())
}

fn pool(vmm: &Arc<SimVmm>, growth: GrowthPolicy, limit: MemoryLimit) -> PagePool {
    let v: Arc<dyn Vmm> = vmm.clone();
    PagePool::new(v, PoolConfig { growth, limit }).unwrap()
}

#[test]
fn grow_take_give_back_trim() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::default(), MemoryLimit::Device);
    assert_eq!(p.page_size(), 2 * MIB);
    assert_eq!(p.grow(4).unwrap(), 4);
    assert_eq!(p.free_pages(), 4);
    let runs = p.take(3).unwrap();
    assert_eq!(runs.len(), 1, "one chunk serves three pages as one run");
    assert_eq!(runs[0].pages, 3);
    p.check_invariants().unwrap();
    assert!(p.take(2).is_err());
    assert_eq!(p.free_pages(), 1);
    assert_eq!(p.trim(0).unwrap(), 0, "a chunk with pages in use is kept");
    p.give_back(&runs).unwrap();
    assert!(p.give_back(&runs).is_err(), "double give-back rejected");
    p.check_invariants().unwrap();
    assert_eq!(p.trim(0).unwrap(), 8 * MIB);
    assert_eq!(p.total_pages(), 0);
    drop(p);
    assert!(vmm.leak_report().is_empty());
}

#[test]
fn take_spans_chunks_without_contiguity() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::page_per_chunk(), MemoryLimit::Device);
    for _ in 0..5 {
        p.grow(1).unwrap();
    }
    let a = p.take(2).unwrap();
    assert_eq!(a.len(), 2);
    let b = p.take(3).unwrap();
    assert_eq!(b.iter().map(|r| r.pages).sum::<u64>(), 3);
    p.give_back(&a).unwrap();
    p.give_back(&b).unwrap();
    p.check_invariants().unwrap();
    assert_eq!(vmm.driver_stats().count(CallKind::Create), 5);
}

#[test]
fn growth_margin_and_limit() {
    let vmm = sim(1 << 30);
    let p = pool(
        &vmm,
        GrowthPolicy {
            min_chunk_bytes: 0,
            max_chunk_bytes: 1 << 30,
            ahead_divisor: 4,
            max_handle_bytes: 0,
        },
        MemoryLimit::Bytes(40 * MIB),
    );
    assert_eq!(p.grow(8).unwrap(), 8, "no margin while the pool is empty");
    assert_eq!(p.grow(4).unwrap(), 6, "margin of held/4 pages");
    assert!(matches!(p.grow(8), Err(PoolError::LimitReached { .. })));
    assert_eq!(p.grow(6).unwrap(), 6, "clipped to the limit");
    assert_eq!(p.total_pages(), 20);
    p.check_invariants().unwrap();
}

#[test]
fn failed_growth_leaves_pool_unchanged_and_falls_back_to_exact() {
    let vmm = sim(16 * MIB);
    let p = pool(
        &vmm,
        GrowthPolicy {
            min_chunk_bytes: 64 * MIB,
            max_chunk_bytes: 64 * MIB,
            ahead_divisor: 0,
            max_handle_bytes: 0,
        },
        MemoryLimit::Device,
    );
    // The limit clips the chunk to the device.
    assert_eq!(p.grow(2).unwrap(), 8);
    assert_eq!(p.trim(0).unwrap(), 16 * MIB);
    // When the larger chunk cannot be created, the pool falls back to exactly 2 pages.
    vmm.inject(Fault::nth(CallKind::Create, 1));
    assert_eq!(p.grow(2).unwrap(), 2);
    vmm.inject(Fault::always(CallKind::Create));
    let before = p.stats();
    assert!(p.grow(1).is_err());
    assert_eq!(p.stats(), before);
    vmm.clear_faults();
    p.check_invariants().unwrap();
    drop(p);
    assert!(vmm.leak_report().is_empty());
}

#[test]
fn one_handle_per_page_is_all_or_nothing() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::page_per_chunk(), MemoryLimit::Device);
    assert_eq!(p.grow(3).unwrap(), 3);
    assert_eq!(p.stats().chunks, 3);
    vmm.inject(Fault::nth(CallKind::Create, 2));
    let before = p.stats();
    assert!(p.grow(4).is_err());
    assert_eq!(
        p.stats(),
        before,
        "the handles created before the failure are released"
    );
    p.check_invariants().unwrap();
    drop(p);
    assert!(vmm.leak_report().is_empty());
}

#[test]
fn fraction_limit() {
    let vmm = sim(100 * MIB);
    let p = pool(&vmm, GrowthPolicy::default(), MemoryLimit::Fraction(0.5));
    assert_eq!(p.limit_pages(), 25);
    assert!(p.grow(26).is_err());
    assert_eq!(p.grow(25).unwrap(), 25);
}

#[test]
fn pool_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<PagePool>();
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_take_give(ops in proptest::collection::vec((0u8..4, 1u64..6), 1..60)) {
            let vmm = sim(64 * MIB);
            let p = pool(&vmm, GrowthPolicy { min_chunk_bytes: 0, max_chunk_bytes: 8 * MIB, ahead_divisor: 2, max_handle_bytes: 0 }, MemoryLimit::Device);
            let mut held: Vec<Vec<PageRun>> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => { let _ = p.grow(n); }
                    1 => if let Ok(r) = p.take(n) {
                        prop_assert_eq!(r.iter().map(|x| x.pages).sum::<u64>(), n);
                        held.push(r);
                    },
                    2 => if let Some(r) = held.pop() { p.give_back(&r).unwrap(); },
                    _ => { p.trim(0).unwrap(); }
                }
                p.check_invariants().unwrap();
                let in_use: u64 = held.iter().flatten().map(|r| r.pages).sum();
                prop_assert_eq!(p.total_pages() - p.free_pages(), in_use);
                prop_assert_eq!(p.pages_in_use().len() as u64, in_use);
            }
            for r in held { p.give_back(&r).unwrap(); }
            drop(p);
            prop_assert!(vmm.leak_report().is_empty());
        }
    }
}
