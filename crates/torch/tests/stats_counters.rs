//! torch's statistics from counters ([`Library::device_stats`]: no walk over
//! the blocks) against the same figures with the segments counted by a walk
//! ([`Library::device_stats_walked`], what `device_stats` did before) and
//! against the snapshot's listing, after every operation of random
//! sequences over two host-backend devices: allocations of many sizes on four
//! streams, into private pools and under tags, frees by pointer alone
//! (torch's deleter: the device found by Quilt) and by the pluggable
//! allocator's call, `record_stream`, pools used and released, tags asleep
//! and awake, `empty_cache`, memory fractions, forgotten streams and both
//! resets. Each free by pointer alone must also give back the device, size
//! and stream the block was allocated with.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use proptest::prelude::*;
use quilt_alloc::quilt::{SleepMode, SleepPages};
use quilt_torch::library::Library;
use quilt_torch::listing::BLOCK_ACTIVE_ALLOCATED;

const MIB: u64 = 1 << 20;
const STREAMS: [u64; 4] = [0, 0x1000, 0x2000, 0x3000];
const POOLS: [(u64, u64); 2] = [(1, 0), (2, 0)];
const TAGS: [&str; 2] = ["weights", "cache"];

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        device: i32,
        size: u64,
        stream: usize,
        pool: Option<usize>,
        tag: Option<usize>,
    },
    /// torch's deleter: the pointer alone.
    Free(usize),
    /// `quilt_free`: the pointer with its size, device and stream.
    FreeWithDevice(usize),
    RecordStream(usize, usize),
    PoolIncref(usize),
    PoolRelease(usize),
    Sleep(usize),
    Wake(usize),
    EmptyCache,
    Fraction(u8),
    ForgetStream(usize),
    ResetPeak,
    ResetAccumulated,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        1..4096u64,
        4096..(2 * MIB),
        (2 * MIB)..(24 * MIB),
        Just(64 * MIB),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..2i32, size(), 0..4usize, prop::option::weighted(0.15, 0..2usize),
              prop::option::weighted(0.1, 0..2usize))
            .prop_map(|(device, size, stream, pool, tag)| Op::Malloc { device, size, stream, pool, tag }),
        5 => any::<usize>().prop_map(Op::Free),
        1 => any::<usize>().prop_map(Op::FreeWithDevice),
        1 => (any::<usize>(), 0..4usize).prop_map(|(i, s)| Op::RecordStream(i, s)),
        1 => (0..2usize).prop_map(Op::PoolIncref),
        1 => (0..2usize).prop_map(Op::PoolRelease),
        1 => (0..2usize).prop_map(Op::Sleep),
        1 => (0..2usize).prop_map(Op::Wake),
        1 => Just(Op::EmptyCache),
        1 => (1..=4u8).prop_map(Op::Fraction),
        1 => (1..4usize).prop_map(Op::ForgetStream),
        1 => Just(Op::ResetPeak),
        1 => Just(Op::ResetAccumulated),
    ]
}

/// A block torch holds.
#[derive(Clone, Copy, Debug)]
struct Held {
    ptr: u64,
    device: i32,
    size: u64,
    stream: u64,
}

/// The counters' figures against the walk's, and against the listing of
/// the segments a snapshot shows: its segments and their bytes always, its
/// allocated blocks and their bytes while no tag sleeps (a sleeping tag's
/// blocks are allocated but mapped nowhere) and no pool was used (torch's
/// statistics take a block a pool keeps off the allocated bytes by the size
/// torch asked for, the listing by the block's).
fn check(
    lib: &Library,
    device: i32,
    (asleep, pooled): (bool, bool),
    after: &Op,
) -> Result<(), TestCaseError> {
    let counted = lib.device_stats(device).unwrap();
    let walked = lib.device_stats_walked(device).unwrap();
    prop_assert_eq!(counted, walked, "device {} after {:?}", device, after);
    let (segs, blocks) = lib.segments(Some(device)).unwrap();
    let s = counted;
    prop_assert_eq!(
        (
            segs.len() as i64,
            segs.iter().map(|s| s.total_size).sum::<u64>() as i64
        ),
        (s.segment.current, s.reserved_bytes.current),
        "segments and reserved bytes on device {} after {:?}",
        device,
        after
    );
    if asleep || pooled {
        return Ok(());
    }
    let allocated: Vec<_> = blocks
        .iter()
        .filter(|b| b.state == BLOCK_ACTIVE_ALLOCATED)
        .collect();
    let listed = (
        allocated.iter().map(|b| b.size).sum::<u64>() as i64,
        allocated.len() as i64,
    );
    prop_assert_eq!(
        listed,
        (s.allocated_bytes.current, s.allocation.current),
        "allocated bytes and blocks on device {} after {:?}",
        device,
        after
    );
    Ok(())
}

fn run(conf: &str, ops: Vec<Op>) -> Result<(), TestCaseError> {
    // The host backend: every device its own addresses, as under CUDA's
    // unified addressing (a free by pointer alone relies on it; the
    // simulated backend gives each device the same addresses).
    let lib = Library::new(conf);
    let mut held: Vec<Held> = Vec::new();
    let mut created = [false; 2];
    let mut asleep = [false; 2];
    let mut pooled = false;
    for op in &ops {
        match *op {
            Op::Malloc {
                device,
                size,
                stream,
                pool,
                tag,
            } => {
                created[device as usize] = true;
                let stream = STREAMS[stream];
                let made = lib.torch_malloc(
                    size,
                    device,
                    stream,
                    tag.map(|t| TAGS[t]),
                    pool.map(|p| POOLS[p]),
                );
                if let Ok((ptr, _)) = made {
                    prop_assert!(
                        held.iter().all(|h| h.ptr != ptr),
                        "{ptr:#x} handed out twice"
                    );
                    held.push(Held {
                        ptr,
                        device,
                        size,
                        stream,
                    });
                }
            }
            Op::Free(i) | Op::FreeWithDevice(i) if !held.is_empty() => {
                let k = i % held.len();
                let h = held[k];
                let freed = if matches!(op, Op::Free(_)) {
                    lib.torch_free(h.ptr).map(|f| {
                        assert_eq!(
                            (f.device, f.size, f.stream),
                            (h.device, h.size, h.stream),
                            "the free gives back the block as torch had it"
                        );
                    })
                } else {
                    lib.free(h.ptr, h.size, h.device, h.stream)
                };
                match freed {
                    Ok(()) => {
                        held.swap_remove(k);
                        prop_assert!(
                            lib.torch_free(h.ptr).is_err(),
                            "a second free of {:#x}",
                            h.ptr
                        );
                    }
                    // Only a sleeping tag's block may not be freed.
                    Err(e) => prop_assert!(asleep.iter().any(|&a| a), "{}", e),
                }
            }
            Op::RecordStream(i, s) if !held.is_empty() => {
                let _ = lib.record_stream(held[i % held.len()].ptr, STREAMS[s]);
            }
            Op::PoolIncref(p) => {
                created[0] = true;
                pooled = true;
                lib.pool_create_or_incref(0, POOLS[p]).unwrap();
            }
            Op::PoolRelease(p) => {
                let _ = lib.pool_release(0, POOLS[p]);
            }
            Op::Sleep(t) => {
                let slept = lib.sleep(TAGS[t], SleepMode::Discard, SleepPages::KeepInPool);
                asleep[t] |= slept.is_ok();
            }
            Op::Wake(t) => {
                let woke = lib.wake(TAGS[t]);
                asleep[t] &= woke.is_err();
            }
            Op::EmptyCache => {
                let _ = lib.empty_cache();
            }
            Op::Fraction(q) => {
                let _ = lib.set_memory_fraction(f64::from(q) / 4.0, 0);
            }
            Op::ForgetStream(s) => {
                let _ = lib.forget_stream(STREAMS[s]);
            }
            Op::ResetPeak if created[0] => lib.reset_peak_stats(0).unwrap(),
            Op::ResetAccumulated if created[0] => lib.reset_accumulated_stats(0).unwrap(),
            _ => {}
        }
        for device in 0..2 {
            if created[device as usize] {
                check(&lib, device, (asleep.iter().any(|&a| a), pooled), op)?;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn counters_match_a_full_walk_after_every_operation(
        reclaim in any::<bool>(),
        ops in prop::collection::vec(op(), 1..160)
    ) {
        // With `reclaim:always` freed pages are unmapped at once: the
        // segments change at nearly every operation.
        let conf = if reclaim { "backend:host,capacity:1GiB,reclaim:always" } else { "backend:host,capacity:1GiB" };
        run(conf, ops)?;
    }
}

/// A long sequence of one kind of churn: many live blocks, frees among
/// them, the segments coming and going with `empty_cache`.
#[test]
fn counters_match_a_full_walk_over_long_churn() {
    let mut ops = Vec::new();
    for i in 0..1500usize {
        ops.push(Op::Malloc {
            device: (i % 5 == 0) as i32,
            size: [512, 4096, 70_000, 3 * MIB, 9 * MIB][i % 5] + i as u64,
            stream: i % 3,
            pool: None,
            tag: None,
        });
        if i % 3 == 0 {
            ops.push(Op::Free(i * 7919));
        }
        if i % 97 == 0 {
            ops.push(Op::EmptyCache);
        }
    }
    run("backend:host,capacity:1GiB", ops).unwrap();
}
