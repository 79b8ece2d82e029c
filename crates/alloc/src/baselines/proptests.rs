//! Random operation sequences against every baseline on a small simulated
//! device: every error is typed, the invariants hold after every operation, and
//! nothing leaks at drop.

use std::sync::Arc;

use proptest::prelude::*;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

use super::offset::{OffsetAllocator, OffsetConfig};
use super::{CachingAllocator, CachingConfig};
use crate::api::DeviceAllocator;
use crate::error::AllocError;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64, u64),
    Free(usize),
    Record(usize, u64),
    Complete(u64),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1u64..4096, 4096u64..MIB, MIB..12 * MIB, 12 * MIB..40 * MIB,];
    prop_oneof![
        6 => (size, 0u64..3).prop_map(|(s, st)| Op::Alloc(s, st)),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), 0u64..3).prop_map(|(i, s)| Op::Record(i, s)),
        1 => (0u64..3).prop_map(Op::Complete),
        1 => Just(Op::EmptyCache),
    ]
}

fn run(kind: usize, config: u8, ops: &[Op]) {
    let sim = Arc::new(SimVmm::with_capacity(160 * MIB).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let max_split = (config & 1 == 1).then_some(24 * MIB);
    let fraction = (config & 2 == 2).then_some(0.75);
    let gc = (config & 4 == 4).then_some(0.5);
    let a: Box<dyn DeviceAllocator> = match kind {
        0 => Box::new(
            CachingAllocator::new(
                vmm,
                CachingConfig {
                    max_split_size: max_split,
                    memory_fraction: fraction,
                    garbage_collection_threshold: gc,
                    ..CachingConfig::classic()
                },
            )
            .unwrap(),
        ),
        1 => Box::new(
            CachingAllocator::new(
                vmm,
                CachingConfig {
                    max_split_size: max_split,
                    memory_fraction: fraction,
                    garbage_collection_threshold: gc,
                    ..CachingConfig::expandable()
                },
            )
            .unwrap(),
        ),
        _ => Box::new(OffsetAllocator::new(vmm, OffsetConfig::default()).unwrap()),
    };
    let mut live = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc(size, s) => match a.allocate(size, StreamId(s)) {
                Ok(x) => {
                    assert!(x.size >= size);
                    live.push(x.ptr);
                }
                Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => panic!("unexpected error {e}"),
            },
            Op::Free(i) if !live.is_empty() => {
                let p = live.swap_remove(i % live.len());
                a.free(p).unwrap();
                assert!(a.free(p).is_err());
            }
            Op::Record(i, s) if !live.is_empty() => {
                a.record_stream(live[i % live.len()], StreamId(s)).unwrap();
            }
            Op::Complete(s) => sim.complete_stream(StreamId(s)),
            Op::EmptyCache => a.empty_cache().unwrap(),
            _ => {}
        }
        a.check_invariants().unwrap();
        let s = a.stats();
        assert!(s.allocated_bytes.current <= s.reserved_bytes.current);
        assert!(s.reserved_bytes.current <= 160 * MIB);
    }
    for p in live.drain(..) {
        a.free(p).unwrap();
        a.check_invariants().unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!((s.allocated_bytes.current, s.active_bytes.current), (0, 0));
    if kind < 2 {
        assert_eq!(
            s.reserved_bytes.current, 0,
            "empty_cache releases everything"
        );
    }
    drop(a);
    assert!(sim.leak_report().is_empty(), "{:?}", sim.leak_report());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_operations_keep_every_baseline_consistent(
        kind in 0usize..3,
        config in 0u8..8,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(kind, config, &ops);
    }
}
