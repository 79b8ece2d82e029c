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
    PagePool::new(
        v,
        PoolConfig {
            page_size: PageSize::Granularity,
            growth,
            limit,
            create_props: quilt_vmm::CreateProps::default(),
        },
    )
    .unwrap()
}

#[test]
fn grow_take_give_back_trim() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::default(), MemoryLimit::Device);
    assert_eq!(p.page_size(), 2 * MIB);
    assert_eq!(p.grow(4).unwrap(), 4);
    assert_eq!(
        vmm.driver_stats().count(CallKind::Create),
        4,
        "one handle per page"
    );
    assert_eq!(p.free_pages(), 4);
    let pages = p.take(3).unwrap();
    assert_eq!(pages.len(), 3);
    p.check_invariants().unwrap();
    assert!(p.take(2).is_err());
    assert_eq!(p.free_pages(), 1);
    assert_eq!(
        p.trim(0).unwrap(),
        2 * MIB,
        "only the free page is released"
    );
    assert!(p.is_in_use(pages[0].id));
    p.give_back(&pages).unwrap();
    assert!(p.give_back(&pages).is_err(), "double give-back rejected");
    assert!(
        p.give_back(&[pages[0], pages[0]]).is_err(),
        "a page named twice is rejected"
    );
    p.check_invariants().unwrap();
    assert_eq!(p.trim(0).unwrap(), 6 * MIB);
    assert_eq!(p.total_pages(), 0);
    drop(p);
    assert!(vmm.leak_report().is_empty());
}

#[test]
fn every_page_is_one_whole_handle() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::exact(), MemoryLimit::Device);
    p.grow(5).unwrap();
    let pages = p.take(5).unwrap();
    let mut handles: Vec<_> = pages.iter().map(|p| p.handle).collect();
    handles.sort();
    handles.dedup();
    assert_eq!(handles.len(), 5, "five pages, five handles");
    // Each maps whole at offset 0 under CUDA's rule.
    let va = vmm.reserve(10 * MIB, 0).unwrap();
    for (i, pg) in pages.iter().enumerate() {
        vmm.map(va + i as u64 * 2 * MIB, 2 * MIB, pg.handle, 0)
            .unwrap();
    }
    for i in 0..5u64 {
        vmm.unmap(va + i * 2 * MIB, 2 * MIB).unwrap();
    }
    vmm.address_free(va, 10 * MIB).unwrap();
    p.give_back(&pages).unwrap();
    drop(p);
    assert!(vmm.leak_report().is_empty());
}

#[test]
fn growth_margin_and_limit() {
    let vmm = sim(1 << 30);
    let p = pool(
        &vmm,
        GrowthPolicy {
            ahead_divisor: 4,
            max_margin_bytes: 1 << 30,
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
            ahead_divisor: 1,
            max_margin_bytes: 1 << 30,
        },
        MemoryLimit::Device,
    );
    assert_eq!(p.grow(2).unwrap(), 2);
    // The margin (2 pages) cannot all be created: exactly the 2 needed are.
    vmm.inject(Fault::nth(CallKind::Create, 4));
    assert_eq!(p.grow(2).unwrap(), 2);
    assert_eq!(p.total_pages(), 4);
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
fn growth_is_all_or_nothing() {
    let vmm = sim(64 * MIB);
    let p = pool(&vmm, GrowthPolicy::exact(), MemoryLimit::Device);
    assert_eq!(p.grow(3).unwrap(), 3);
    assert_eq!(p.stats().handles_created, 3);
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
fn page_size_is_a_multiple_of_the_granularity() {
    let vmm = sim(200 * MIB);
    let v: Arc<dyn Vmm> = vmm.clone();
    let cfg = |page_size| PoolConfig {
        page_size,
        ..PoolConfig::default()
    };
    let p = PagePool::new(v.clone(), cfg(PageSize::Bytes(20 * MIB))).unwrap();
    assert_eq!(p.page_size(), 20 * MIB);
    assert_eq!(p.limit_pages(), 10);
    p.grow(1).unwrap();
    assert_eq!(vmm.physical_in_use(), 20 * MIB);
    drop(p);
    for bad in [PageSize::Bytes(3 * MIB), PageSize::Bytes(0)] {
        assert!(matches!(
            PagePool::new(v.clone(), cfg(bad)),
            Err(PoolError::InvalidPageSize { .. })
        ));
    }
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
            let p = pool(&vmm, GrowthPolicy { ahead_divisor: 2, max_margin_bytes: 8 * MIB }, MemoryLimit::Device);
            let mut held: Vec<Vec<Page>> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => { let _ = p.grow(n); }
                    1 => if let Ok(r) = p.take(n) {
                        prop_assert_eq!(r.len() as u64, n);
                        held.push(r);
                    },
                    2 => if let Some(r) = held.pop() { p.give_back(&r).unwrap(); },
                    _ => { p.trim(0).unwrap(); }
                }
                p.check_invariants().unwrap();
                let in_use = held.iter().flatten().count() as u64;
                prop_assert_eq!(p.total_pages() - p.free_pages(), in_use);
                prop_assert_eq!(p.pages_in_use().len() as u64, in_use);
            }
            for r in held { p.give_back(&r).unwrap(); }
            drop(p);
            prop_assert!(vmm.leak_report().is_empty());
        }
    }
}

#[test]
fn the_limit_can_change_but_not_below_what_is_held() {
    let sim = Arc::new(SimVmm::with_capacity(64 << 20).unwrap());
    let pool = PagePool::new(sim, PoolConfig::default()).unwrap();
    assert_eq!(pool.limit_pages(), 32);
    pool.grow(4).unwrap();
    let held = pool.total_pages();
    assert_eq!(pool.set_limit(MemoryLimit::Fraction(0.5)).unwrap(), 16);
    assert!(matches!(pool.grow(16), Err(PoolError::LimitReached { .. })));
    assert!(matches!(
        pool.set_limit(MemoryLimit::Bytes(2 << 20)),
        Err(PoolError::LimitBelowHeld { .. })
    ));
    assert_eq!(pool.limit_pages(), 16, "a refused limit changes nothing");
    assert_eq!(pool.total_pages(), held);
    pool.check_invariants().unwrap();
}

#[test]
fn pages_request_the_configured_handle_types() {
    let vmm = sim(64 * MIB);
    let v: Arc<dyn Vmm> = vmm.clone();
    let shareable = PagePool::new(
        v.clone(),
        PoolConfig {
            create_props: quilt_vmm::CreateProps {
                handle_types: quilt_vmm::HandleTypes::POSIX_FD,
                gpu_direct_rdma: true,
            },
            ..PoolConfig::default()
        },
    )
    .unwrap();
    shareable.grow(2).unwrap();
    let pages = shareable.take(2).unwrap();
    for pg in &pages {
        assert!(vmm
            .export_handle(pg.handle, quilt_vmm::HandleKind::PosixFd)
            .is_ok());
    }
    shareable.give_back(&pages).unwrap();
    let plain = PagePool::new(v, PoolConfig::default()).unwrap();
    plain.grow(1).unwrap();
    let pages = plain.take(1).unwrap();
    assert!(vmm
        .export_handle(pages[0].handle, quilt_vmm::HandleKind::PosixFd)
        .is_err());
    plain.give_back(&pages).unwrap();
    // A type the device does not report fails the growth, typed, and
    // leaves the pool as it was.
    let fabric = PagePool::new(
        vmm.clone(),
        PoolConfig {
            create_props: quilt_vmm::CreateProps {
                handle_types: quilt_vmm::HandleTypes {
                    posix_fd: false,
                    fabric: true,
                },
                gpu_direct_rdma: false,
            },
            ..PoolConfig::default()
        },
    )
    .unwrap();
    assert!(fabric.grow(1).is_err());
    assert_eq!(fabric.total_pages(), 0);
    fabric.check_invariants().unwrap();
}
