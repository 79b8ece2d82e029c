//! Quilt on the host backend, where bytes are real and the ledger enforces
//! CUDA's map rule (one whole handle per mapping, at offset 0): every live
//! allocation holds its own byte pattern through thousands of random
//! operations on three streams under memory pressure (cached pages unmapped
//! one by one and mapped again elsewhere, for another stream or arena).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{KIB, MIB};
use quilt_alloc::quilt::{
    ArenaLayout, ArenaSharing, PageSize, QuiltAllocator, QuiltConfig, ReclaimPolicy, SmallBlocks,
};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::host::HostVmm;
use quilt_vmm::{StreamId, Vmm};

fn check_all(host: &HostVmm, live: &BTreeMap<u64, (u64, u8)>) {
    for (&p, &(len, byte)) in live {
        assert!(
            host.check_filled(p, len, byte).unwrap(),
            "allocation {p:#x} lost its pattern"
        );
    }
}

fn stress(config: QuiltConfig, seed: u64) {
    let granularity = 64 * KIB;
    let capacity = 16 * MIB;
    let host = common::host(granularity, capacity);
    let v: Arc<dyn Vmm> = host.clone();
    let a = QuiltAllocator::new(v, config).unwrap();
    let mut live: BTreeMap<u64, (u64, u8)> = BTreeMap::new();
    let mut live_bytes = 0u64;
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ooms = 0;
    for i in 0..2000u64 {
        let r = next();
        let free_now = live_bytes > capacity * 3 / 4 || (r % 5 < 2 && !live.is_empty());
        if r % 23 == 0 && !live.is_empty() {
            // Another stream uses a live block too: its free orders later
            // users after that stream as well.
            let k = (next() as usize) % live.len();
            let p = *live.keys().nth(k).unwrap();
            a.record_stream(p, StreamId(next() % 3)).unwrap();
        } else if free_now && !live.is_empty() {
            let k = (next() as usize) % live.len();
            let p = *live.keys().nth(k).unwrap();
            let (len, byte) = live.remove(&p).unwrap();
            assert!(host.check_filled(p, len, byte).unwrap());
            a.free(p).unwrap();
            live_bytes -= len;
        } else {
            let size = match r % 4 {
                0 => 1 + next() % (8 * KIB),
                1 => 1 + next() % (256 * KIB),
                _ => 1 + next() % (3 * MIB),
            };
            let stream = StreamId(next() % 3);
            match a.allocate(size, stream) {
                Ok(al) => {
                    let byte = (i % 251) as u8 + 1;
                    host.fill(al.ptr, size, byte).unwrap();
                    live.insert(al.ptr, (size, byte));
                    live_bytes += size;
                }
                Err(e) => {
                    // A map the ledger refused (not one whole handle at
                    // offset 0) would surface here as a driver error.
                    assert!(e.oom_report().is_some(), "{e}");
                    ooms += 1;
                }
            }
        }
        if i % 500 == 499 {
            a.empty_cache().unwrap();
        }
        if i % 50 == 0 {
            check_all(&host, &live);
        }
        a.check_invariants().unwrap();
    }
    check_all(&host, &live);
    a.check_invariants().unwrap();
    let st = a.stats();
    assert!(
        st.driver.count(quilt_vmm::CallKind::Unmap) > 0,
        "the run never reclaimed a cached page"
    );
    assert_eq!(
        st.driver.failed.iter().sum::<u64>(),
        0,
        "a driver call failed"
    );
    let page = a.pool_stats().page_size;
    assert!(
        st.driver.count(quilt_vmm::CallKind::Create) * page >= st.reserved_bytes.peak,
        "one handle per page"
    );
    eprintln!(
        "host stress: {ooms} OOMs, {} retries, {} stream waits, {} unmaps",
        st.num_alloc_retries,
        st.num_stream_waits,
        st.driver.count(quilt_vmm::CallKind::Unmap)
    );
    for &p in live.keys() {
        a.free(p).unwrap();
    }
    drop(a);
    assert!(host.leak_report().is_clean(), "{:?}", host.leak_report());
}

#[test]
fn patterns_survive_reclaim_and_remap() {
    stress(QuiltConfig::default(), 0x9e37_79b9_7f4a_7c15);
}

#[test]
fn patterns_survive_with_four_granule_pages() {
    let mut config = QuiltConfig::default();
    config.pool.page_size = PageSize::Bytes(4 * 64 * KIB);
    stress(config, 0x5851_f42d_4c95_7f2d);
}

#[test]
fn patterns_survive_eager_reclaim() {
    let config = QuiltConfig {
        reclaim: ReclaimPolicy::Always,
        ..QuiltConfig::default()
    };
    stress(config, 0x1405_7b7e_f767_814f);
}

#[test]
fn patterns_survive_the_gmlake_preset() {
    stress(QuiltConfig::gmlake(), 0x6a09_e667_f3bc_c909);
}

#[test]
fn patterns_survive_with_per_stream_and_small_arenas() {
    let config = QuiltConfig {
        layout: ArenaLayout {
            sharing: ArenaSharing::PerStream,
            small: SmallBlocks::PYTORCH,
            ..QuiltConfig::default().layout
        },
        ..QuiltConfig::default()
    };
    stress(config, 0x2545_f491_4f6c_dd1d);
}
