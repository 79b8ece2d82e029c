//! Property test of Quilt's default policy on generated loops at ample
//! capacity, the GPU running behind the host: random loop bodies (sizes from
//! 512 B to 256 MiB, random lifetimes, one to four streams, some
//! `record_stream`), each replayed several times.
//!
//! What the policy promises there, and why:
//! - **No stream synchronisation, no unmap.** Cached pages are reclaimed only
//!   when the pool cannot grow (`ReclaimPolicy::WhenFull`), and only reclaim
//!   unmaps or synchronises.
//! - **The loop settles.** Pages stay where they were mapped. On one stream
//!   no iteration after the first calls the driver: placement prefers mapped
//!   gaps, and the first iteration mapped a place for every block. With
//!   several streams, which gaps need a wait depends on how far the GPU got,
//!   so a later iteration may place a block elsewhere and map a few pages
//!   more; those calls add up to less than the first iteration's (measured
//!   over 8 iterations), and they never unmap.
//! - **Waits are rare**: at most one per pair of streams per allocation, and
//!   none on one stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use proptest::prelude::*;
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{CallKind, DriverStats, StreamId, Vmm};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// One allocation of a loop body: its size, stream, how many later
/// allocations it outlives, and whether another stream also uses it.
#[derive(Clone, Debug)]
struct Alloc {
    size: u64,
    stream: u64,
    lifetime: usize,
    shared: bool,
}

fn alloc(streams: u64) -> impl Strategy<Value = Alloc> {
    let size = prop_oneof![
        3 => 512u64..MIB,
        4 => MIB..32 * MIB,
        2 => 32 * MIB..256 * MIB,
        1 => (1u64..64).prop_map(|p| p * 2 * MIB),
    ];
    (size, 0..streams, 0usize..24, prop::bool::weighted(0.1)).prop_map(
        |(size, stream, lifetime, shared)| Alloc {
            size,
            stream,
            lifetime,
            shared,
        },
    )
}

fn body() -> impl Strategy<Value = (u64, Vec<Alloc>, u64)> {
    (1u64..=4)
        .prop_flat_map(|streams| {
            (
                Just(streams),
                prop::collection::vec(alloc(streams), 10..120),
                prop_oneof![Just(0u64), Just(8), Just(64)],
            )
        })
        .prop_map(|(s, v, lag)| (s, v, lag))
}

/// The VMM calls (not events or stream calls) in `d`.
fn vmm_calls(d: &DriverStats) -> u64 {
    [
        CallKind::Create,
        CallKind::Map,
        CallKind::Unmap,
        CallKind::SetAccess,
        CallKind::Release,
    ]
    .iter()
    .map(|&k| d.count(k))
    .sum()
}

/// Replay `body` (on `streams` streams) `iterations` times; the driver
/// calls of each iteration.
fn replay(body: &[Alloc], streams: u64, lag: u64, iterations: usize) -> Vec<DriverStats> {
    let sim = Arc::new(
        SimVmm::new(SimConfig {
            capacity: 16 << 30,
            gpu_lag_ops: lag,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, QuiltConfig::default()).unwrap();
    let mut per_iteration = Vec::new();
    for _ in 0..iterations {
        let before = sim.driver_stats();
        // (index of the allocation it dies after, ptr)
        let mut live: Vec<(usize, u64)> = Vec::new();
        for (i, b) in body.iter().enumerate() {
            let got = a.allocate(b.size, StreamId(b.stream)).unwrap();
            sim.advance(1);
            if b.shared {
                a.record_stream(got.ptr, StreamId((b.stream + 1) % streams))
                    .unwrap();
            }
            live.push((i + b.lifetime, got.ptr));
            let (dead, keep): (Vec<_>, Vec<_>) = live.into_iter().partition(|&(end, _)| end <= i);
            live = keep;
            for (_, p) in dead {
                a.free(p).unwrap();
                sim.advance(1);
            }
            a.check_invariants().unwrap();
        }
        for (_, p) in live {
            a.free(p).unwrap();
            sim.advance(1);
        }
        a.check_invariants().unwrap();
        per_iteration.push(sim.driver_stats().since(&before));
    }
    per_iteration
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn loops_settle_without_syncs_or_unmaps((streams, body, lag) in body()) {
        let iterations = replay(&body, streams, lag, 8);
        let allocations = body.len() as u64;
        for (i, d) in iterations.iter().enumerate() {
            prop_assert_eq!(d.count(CallKind::StreamSynchronize), 0, "iteration {}", i);
            prop_assert_eq!(d.count(CallKind::Unmap), 0, "iteration {}", i);
            let waits = d.count(CallKind::StreamWaitEvent);
            if streams == 1 {
                prop_assert_eq!(waits, 0, "iteration {}", i);
            }
            prop_assert!(waits <= allocations * (streams - 1).max(1), "iteration {}: {} waits", i, waits);
        }
        if streams == 1 {
            for (i, d) in iterations.iter().enumerate().skip(1) {
                prop_assert_eq!(vmm_calls(d), 0, "lag {}: iteration {} called the driver: {:?}", lag, i, d);
            }
        } else {
            let first = vmm_calls(&iterations[0]);
            let later: u64 = iterations.iter().skip(1).map(vmm_calls).sum();
            prop_assert!(later < first, "{} streams, lag {}: {} calls after the first iteration, {} in it", streams, lag, later, first);
        }
    }
}

/// A fixed case, documented: a loop of growing buffers (each reallocated 64
/// MiB larger, the old one freed after the copy) settles after one pass.
#[test]
fn growing_buffers_settle_after_one_iteration() {
    let mut body = Vec::new();
    for step in 1..40u64 {
        for (j, stream) in [(0u64, 0u64), (1, 0)] {
            body.push(Alloc {
                size: (step + j) * 64 * MIB + 4 * KIB,
                stream,
                lifetime: 2,
                shared: false,
            });
        }
    }
    let iterations = replay(&body, 1, 64, 4);
    for (i, d) in iterations.iter().enumerate().skip(1) {
        assert_eq!(vmm_calls(d), 0, "iteration {i}: {d:?}");
    }
}
