//! Property test of Quilt at a tight capacity: random allocate / free /
//! record-stream / synchronise / empty-cache sequences, the invariants after
//! every step, and the central promise on every failed request: it failed only
//! because fewer pages were free or reclaimable than the new block needed.
//! Every preset runs here; under GMLake's limits the promise covers the
//! requests they stitch (see [`promised`]).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proptest::prelude::*;
use quilt_alloc::quilt::{
    ArenaSharing, Placement, QuiltAllocator, QuiltConfig, ReclaimPolicy, SmallBlocks,
};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    Record { pick: usize, stream: u64 },
    Complete { stream: u64 },
    Sync,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..=MIB, 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        4 => (MIB + 1..40 * MIB, 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        1 => (1u64..4, 0u64..3).prop_map(|(pages, stream)| Op::Alloc { size: pages * PAGE, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0u64..3).prop_map(|(pick, stream)| Op::Record { pick, stream }),
        1 => (0u64..3).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::Sync),
        1 => Just(Op::EmptyCache),
    ]
}

struct Model {
    /// Live blocks: ptr -> (rounded size, streams recorded on).
    live: BTreeMap<u64, (u64, BTreeSet<u64>)>,
    /// The stream each live block was allocated on.
    owner: BTreeMap<u64, u64>,
    /// Freed blocks that were recorded on other streams (ptr -> rounded
    /// size): the allocator may hold them, still touching their pages,
    /// until that work is done (a superset of those it holds: an entry
    /// goes once a block is placed over it, or at `empty_cache`).
    held: BTreeMap<u64, u64>,
}

impl Model {
    /// Pages touched by live blocks (distinct virtual pages; every arena is
    /// page aligned, so these are distinct physical pages too).
    fn touched_pages(&self) -> u64 {
        Self::pages_of(self.live.iter().map(|(&p, &(s, _))| (p, s)))
    }

    /// Pages touched by live blocks or blocks the allocator may hold.
    fn touched_pages_with_held(&self) -> u64 {
        let live = self.live.iter().map(|(&p, &(s, _))| (p, s));
        Self::pages_of(live.chain(self.held.iter().map(|(&p, &s)| (p, s))))
    }

    fn pages_of(blocks: impl Iterator<Item = (u64, u64)>) -> u64 {
        let mut pages = BTreeSet::new();
        for (p, s) in blocks {
            for pg in p / PAGE..=(p + s - 1) / PAGE {
                pages.insert(pg);
            }
        }
        pages.len() as u64
    }
}

/// True when the central promise covers a request of `size` bytes under
/// `config`: every request with best-fit placement; under GMLake's limits, a
/// request in the large arena below the fragment limit is served only from a
/// cached block or fresh address space, and may fail while pages are free.
fn promised(config: &QuiltConfig, size: u64) -> bool {
    match config.placement {
        Placement::BestFit { .. } => true,
        Placement::GmlakeLimits { frag_limit, .. } => {
            size >= frag_limit || config.layout.small.is_small(size)
        }
    }
}

fn run(ops: Vec<Op>, capacity: u64, config: QuiltConfig) -> Result<(), TestCaseError> {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, config).unwrap();
    let mut m = Model {
        live: BTreeMap::new(),
        owner: BTreeMap::new(),
        held: BTreeMap::new(),
    };
    for op in ops {
        match op {
            Op::Alloc { size, stream } => match a.allocate(size, StreamId(stream)) {
                Ok(al) => {
                    prop_assert!(al.size >= size);
                    prop_assert!(m.live.insert(al.ptr, (al.size, BTreeSet::new())).is_none());
                    m.owner.insert(al.ptr, stream);
                    // A block placed over a held one: that one was released.
                    m.held
                        .retain(|&p, &mut s| p + s <= al.ptr || al.ptr + al.size <= p);
                }
                Err(AllocError::OutOfMemory(r)) if !promised(&config, size) => {
                    // No promise, but a true verdict: capacity only when the
                    // pages were missing.
                    prop_assert!(
                        r.verdict == OomVerdict::Fragmentation
                            || r.reclaimable + r.device_free < r.needed,
                        "{}",
                        r
                    );
                }
                Err(AllocError::OutOfMemory(r)) => {
                    // The allocator's own account: not enough free, cached or creatable pages.
                    prop_assert_eq!(r.verdict, OomVerdict::Capacity, "{}", r);
                    prop_assert!(r.reclaimable + r.device_free < r.needed, "{}", r);
                    // The independent account: capacity minus pages backing blocks.
                    let available = capacity / PAGE - m.touched_pages();
                    let whole = size.div_ceil(512) * 512;
                    prop_assert!(
                        available < whole.div_ceil(PAGE),
                        "request of {} bytes failed with {} pages available: {}",
                        size,
                        available,
                        r
                    );
                }
                Err(e) => prop_assert!(false, "unexpected error {e}"),
            },
            Op::Free { pick } => {
                if m.live.is_empty() {
                    continue;
                }
                let ptr = *m.live.keys().nth(pick % m.live.len()).unwrap();
                a.free(ptr).unwrap();
                let (size, recorded) = m.live.remove(&ptr).unwrap();
                m.owner.remove(&ptr);
                if !recorded.is_empty() {
                    m.held.insert(ptr, size);
                }
                let again = matches!(a.free(ptr), Err(AllocError::DoubleFree { .. }));
                prop_assert!(again, "double free not reported");
            }
            Op::Record { pick, stream } => {
                if m.live.is_empty() {
                    continue;
                }
                let ptr = *m.live.keys().nth(pick % m.live.len()).unwrap();
                a.record_stream(ptr, StreamId(stream)).unwrap();
                // Recording on the block's own stream is a no-op.
                if m.owner[&ptr] != stream {
                    m.live.get_mut(&ptr).unwrap().1.insert(stream);
                }
            }
            Op::Complete { stream } => {
                sim.complete_stream(StreamId(stream));
            }
            Op::Sync => {
                sim.complete_all();
            }
            Op::EmptyCache => {
                a.empty_cache().unwrap();
                prop_assert_eq!(a.cached_bytes(), 0);
                m.held.clear();
            }
        }
        a.check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Live blocks' pages, and some of the held blocks'.
        prop_assert!(a.touched_bytes() >= m.touched_pages() * PAGE);
        prop_assert!(a.touched_bytes() <= m.touched_pages_with_held() * PAGE);
        prop_assert!(a.stats().reserved_bytes.current <= capacity);
        // No page under a live block is ever unmapped: every page of every
        // live block translates to a physical page, each one a whole handle.
        for (&p, &(s, _)) in &m.live {
            for pg in p / PAGE..=(p + s - 1) / PAGE {
                let t = sim.translate(pg * PAGE);
                prop_assert!(
                    t.is_some(),
                    "page {:#x} of live block {:#x} unmapped",
                    pg * PAGE,
                    p
                );
            }
        }
    }
    for &ptr in m.live.keys() {
        a.free(ptr).unwrap();
    }
    sim.complete_all();
    a.empty_cache().unwrap();
    a.check_invariants()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(a.stats().reserved_bytes.current, 0);
    drop(a);
    prop_assert!(sim.leak_report().is_empty());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn central_promise_and_invariants_at_64_mib(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, 64 * MIB, QuiltConfig::default())?;
    }

    #[test]
    fn central_promise_and_invariants_at_128_mib(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, 128 * MIB, QuiltConfig::default())?;
    }

    #[test]
    fn invariants_with_separate_small_arenas(ops in proptest::collection::vec(op(), 1..120)) {
        let mut config = QuiltConfig::default();
        config.layout.small = SmallBlocks::PYTORCH;
        run(ops, 96 * MIB, config)?;
    }

    #[test]
    fn central_promise_with_per_stream_arenas(ops in proptest::collection::vec(op(), 1..120)) {
        let mut config = QuiltConfig::default();
        config.layout.sharing = ArenaSharing::PerStream;
        run(ops, 64 * MIB, config)?;
    }

    #[test]
    fn central_promise_with_every_reclaim_policy(
        ops in proptest::collection::vec(op(), 1..120),
        policy in prop_oneof![
            Just(ReclaimPolicy::WhenFull),
            Just(ReclaimPolicy::Always),
            (0u64..200).prop_map(ReclaimPolicy::CachedAbove),
            (0u64..50).prop_map(ReclaimPolicy::IdleFor),
        ],
        candidates in 1usize..10,
    ) {
        let config = QuiltConfig { reclaim: policy, placement: Placement::BestFit { candidates }, ..QuiltConfig::default() };
        run(ops, 64 * MIB, config)?;
    }

    #[test]
    fn central_promise_with_the_gmlake_preset(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops, 64 * MIB, QuiltConfig::gmlake())?;
    }

    #[test]
    fn central_promise_with_gmlake_limits_below_the_requests(
        ops in proptest::collection::vec(op(), 1..120),
        frag_mib in 2u64..24,
        reuse_limit in 0u64..4,
    ) {
        // A fragment limit inside the generated sizes: requests on both sides.
        let config = QuiltConfig {
            placement: Placement::GmlakeLimits { frag_limit: frag_mib * MIB, reuse_limit },
            ..QuiltConfig::gmlake()
        };
        run(ops, 64 * MIB, config)?;
    }

    #[test]
    fn invariants_with_a_large_growth_margin(ops in proptest::collection::vec(op(), 1..120)) {
        let mut config = QuiltConfig::default();
        config.pool.growth.ahead_divisor = 2;
        run(ops, 96 * MIB, config)?;
    }
}
