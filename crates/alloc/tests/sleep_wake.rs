//! Sleep and wake on the host backend, with real bytes: a tag's blocks and
//! growable buffers are copied to the host (or discarded), their pages go
//! back to the pool and serve other allocations, and a wake puts every byte
//! back at every address; out of memory on wake leaves the tag asleep with
//! its copy intact; on the simulated device a sleep's synchronisations and
//! copies are counted and costed; a property test over random tags, sizes
//! and grow/shrink sequences checks the invariants after every operation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{quilt_exact as quilt, read, KIB, MIB};
use proptest::prelude::*;
use quilt_alloc::quilt::{GrowableBuffer, MapAhead, SleepMode};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::host::HostVmm;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, StreamId, Vmm};

const PAGE: u64 = 64 * KIB;

/// The host backend, `capacity` bytes in 64 KiB pages.
fn host(capacity: u64) -> Arc<HostVmm> {
    common::host(PAGE, capacity)
}

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i % 253) as u8))
        .collect()
}

fn is_tag_state(r: Result<impl std::fmt::Debug, AllocError>) -> bool {
    matches!(r, Err(AllocError::TagState { .. }))
}

#[test]
fn sleep_wake_offload_restores_every_byte_at_every_address() {
    let h = host(4 * MIB);
    let a = quilt(h.clone(), 4 * MIB);
    let s = StreamId::DEFAULT;
    let m1 = a.allocate_tagged(300 * KIB, s, "model").unwrap();
    let m2 = a.allocate_tagged(MIB, s, "model").unwrap();
    let kv = GrowableBuffer::new_tagged(a.clone(), 2 * MIB, s, "model").unwrap();
    kv.grow_to(700 * KIB).unwrap();
    let plain = a.allocate(200 * KIB, s).unwrap();
    let members = [
        (m1.ptr, m1.size, 1u8),
        (m2.ptr, m2.size, 2),
        (kv.ptr(), 700 * KIB, 3),
    ];
    for &(p, len, seed) in &members {
        h.write_bytes(p, &pattern(seed, len)).unwrap();
    }
    h.write_bytes(plain.ptr, &pattern(9, 200 * KIB)).unwrap();
    let free_before = a.pool_stats().free_pages;
    a.sleep("model", SleepMode::Offload).unwrap();
    a.check_invariants().unwrap();
    assert!(a.is_asleep("model").unwrap());
    assert_eq!(a.host_bytes(), m1.size + m2.size + 700 * KIB);
    let freed = a.pool_stats().free_pages - free_before;
    assert!(
        freed * PAGE >= m1.size + m2.size + 700 * KIB,
        "{freed} pages"
    );

    // Asleep: its members refuse everything but a free; the rest works.
    assert!(is_tag_state(a.allocate_tagged(KIB, s, "model")));
    assert!(is_tag_state(kv.grow_to(MIB)));
    assert!(is_tag_state(a.sleep("model", SleepMode::Discard)));
    assert!(is_tag_state(a.record_stream(m2.ptr, StreamId(4))));

    // Other memory in the pages it freed: only they can serve this at the limit.
    let other = a.allocate(4 * MIB - 4 * PAGE, s).unwrap();
    assert!(a.stats().reserved_bytes.current <= 4 * MIB);
    h.fill(other.ptr, other.size, 0xAB).unwrap();
    a.check_invariants().unwrap();
    a.free(other.ptr).unwrap();

    a.wake("model").unwrap();
    a.check_invariants().unwrap();
    assert!(!a.is_asleep("model").unwrap());
    assert_eq!(a.host_bytes(), 0);
    assert_eq!(kv.ptr(), members[2].0);
    assert_eq!(a.growable_info(kv.id()).unwrap().ptr, members[2].0);
    for &(p, len, seed) in &members {
        assert_eq!(read(&h, p, len), pattern(seed, len), "member at {p:#x}");
    }
    assert_eq!(read(&h, plain.ptr, 200 * KIB), pattern(9, 200 * KIB));
    let st = a.serving_stats();
    assert_eq!((st.sleeps, st.wakes), (1, 1));
    assert_eq!(st.bytes_offloaded, st.bytes_restored);
    // Awake again: its members work as any block.
    kv.grow_to(MIB).unwrap();
    a.free(m1.ptr).unwrap();
    a.free(m2.ptr).unwrap();
    a.free(plain.ptr).unwrap();
    kv.release().unwrap();
    a.check_invariants().unwrap();
    drop(a);
    assert!(h.leak_report().is_empty(), "{}", h.leak_report());
}

#[test]
fn sleep_wake_a_member_freed_while_its_tag_sleeps_is_freed_at_the_wake() {
    for mode in [SleepMode::Offload, SleepMode::Discard] {
        let h = host(4 * MIB);
        let a = quilt(h.clone(), 4 * MIB);
        let s = StreamId::DEFAULT;
        let gone = a.allocate_tagged(MIB, s, "model").unwrap();
        let kept = a.allocate_tagged(300 * KIB, s, "model").unwrap();
        h.write_bytes(kept.ptr, &pattern(5, 300 * KIB)).unwrap();
        let allocated = a.stats().allocated_bytes.current;
        a.sleep("model", mode).unwrap();
        let copies_out = h.driver_stats().count(CallKind::MemcpyDtoH);

        // Accepted once (a second free is a double free); it still counts
        // as allocated while the tag sleeps.
        a.free(gone.ptr).unwrap();
        assert!(matches!(
            a.free(gone.ptr),
            Err(AllocError::DoubleFree { .. })
        ));
        assert_eq!(a.stats().allocated_bytes.current, allocated);
        a.check_invariants().unwrap();

        a.wake("model").unwrap();
        a.check_invariants().unwrap();
        // Freed at the wake, its contents not copied back; the other member
        // holds its bytes.
        assert_eq!(a.stats().allocated_bytes.current, allocated - gone.size);
        assert!(a.free(gone.ptr).is_err(), "freed at the wake");
        if mode == SleepMode::Offload {
            assert_eq!(read(&h, kept.ptr, 300 * KIB), pattern(5, 300 * KIB));
            assert_eq!(
                h.driver_stats().count(CallKind::MemcpyHtoD),
                1,
                "one member copied back"
            );
        }
        assert_eq!(h.driver_stats().count(CallKind::MemcpyDtoH), copies_out);
        // Its memory serves others; the tag sleeps and wakes again.
        let other = a.allocate_tagged(MIB, s, "model").unwrap();
        a.sleep("model", mode).unwrap();
        a.free(kept.ptr).unwrap();
        a.free(other.ptr).unwrap();
        a.wake("model").unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().allocated_bytes.current, 0);
        a.empty_cache().unwrap();
        drop(a);
        assert!(h.leak_report().is_empty(), "{}", h.leak_report());
    }
}

#[test]
fn sleep_wake_discard_maps_again_without_copies() {
    let h = host(2 * MIB);
    let a = quilt(h.clone(), 2 * MIB);
    let kv = a.allocate_tagged(MIB, StreamId(2), "kv").unwrap();
    h.fill(kv.ptr, kv.size, 7).unwrap();
    a.sleep("kv", SleepMode::Discard).unwrap();
    assert_eq!(a.host_bytes(), 0);
    a.check_invariants().unwrap();
    a.wake("kv").unwrap();
    a.check_invariants().unwrap();
    // Mapped and writable at the same address; nothing was copied.
    h.fill(kv.ptr, kv.size, 8).unwrap();
    assert!(h.check_filled(kv.ptr, kv.size, 8).unwrap());
    let d = h.driver_stats();
    assert_eq!(
        d.count(CallKind::MemcpyDtoH) + d.count(CallKind::MemcpyHtoD),
        0
    );
    assert!(is_tag_state(a.wake("kv")));
    assert!(is_tag_state(a.sleep("never-used", SleepMode::Discard)));
    a.free(kv.ptr).unwrap();
}

#[test]
fn sleep_wake_out_of_memory_on_wake_leaves_the_tag_asleep_and_its_copy_intact() {
    let h = host(2 * MIB);
    let a = quilt(h.clone(), 2 * MIB);
    let w = a
        .allocate_tagged(MIB, StreamId::DEFAULT, "weights")
        .unwrap();
    let bytes = pattern(5, w.size);
    h.write_bytes(w.ptr, &bytes).unwrap();
    a.sleep("weights", SleepMode::Offload).unwrap();
    let filler = a.allocate(2 * MIB - PAGE, StreamId::DEFAULT).unwrap();
    h.fill(filler.ptr, filler.size, 0xFF).unwrap();
    let err = a.wake("weights").unwrap_err();
    assert_eq!(err.oom_report().unwrap().verdict, OomVerdict::Capacity);
    assert!(a.is_asleep("weights").unwrap());
    assert_eq!(a.host_bytes(), w.size);
    a.check_invariants().unwrap();
    assert!(h.check_filled(filler.ptr, filler.size, 0xFF).unwrap());
    a.free(filler.ptr).unwrap();
    a.wake("weights").unwrap();
    assert_eq!(read(&h, w.ptr, w.size), bytes);
    a.check_invariants().unwrap();
}

#[test]
fn sleep_wake_on_the_simulator_counts_syncs_and_costs_copies() {
    let sim = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
    let a = quilt(sim.clone(), 1 << 30);
    let (s1, s2) = (StreamId(1), StreamId(2));
    let w = a.allocate_tagged(100 * MIB, s1, "weights").unwrap();
    a.record_stream(w.ptr, s2).unwrap();
    let g = GrowableBuffer::new_tagged(a.clone(), 64 * MIB, s1, "weights").unwrap();
    g.grow_to(10 * MIB).unwrap();
    let before = sim.driver_stats();
    a.sleep("weights", SleepMode::Offload).unwrap();
    let d = sim.driver_stats().since(&before);
    // Both streams' work may still use the memory: each is synchronised.
    assert_eq!(d.count(CallKind::StreamSynchronize), 2);
    assert_eq!(a.serving_stats().sleep_syncs, 2);
    assert_eq!(d.count(CallKind::MemcpyDtoH), 2);
    assert_eq!(d.copied_bytes, 110 * MIB);
    let copy_ns = 110 * MIB * 1000 / sim.config().cost.copy_bytes_per_us;
    assert!(d.modelled_ns >= copy_ns, "{} < {copy_ns}", d.modelled_ns);
    assert_eq!(d.count(CallKind::Unmap), 55);
    a.check_invariants().unwrap();
    let before = sim.driver_stats();
    a.wake("weights").unwrap();
    let d = sim.driver_stats().since(&before);
    assert_eq!(
        (d.count(CallKind::MemcpyHtoD), d.copied_bytes),
        (2, 110 * MIB)
    );
    assert_eq!(d.count(CallKind::Map), 55);
    assert_eq!(d.count(CallKind::StreamSynchronize), 0);
    a.check_invariants().unwrap();
}

#[test]
fn sleep_wake_takes_done_cached_pages_before_the_pool_grows() {
    let sim = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
    let a = quilt(sim.clone(), 1 << 30);
    let (s1, s2) = (StreamId(1), StreamId(2));
    // Two streams, their work declared: an event recorded once the device
    // caught up completes at once.
    sim.queue_work(s2);
    let _other = a.allocate(MIB, s2).unwrap();
    sim.queue_work(s1);
    let w = a.allocate_tagged(20 * MIB, s1, "weights").unwrap();
    a.sleep("weights", SleepMode::Discard).unwrap();
    // The sleeping weights' pages serve a block that is freed again: they
    // stay cached in the shared arena, where the weights cannot use them.
    sim.queue_work(s1);
    let b = a.allocate(20 * MIB, s1).unwrap();
    sim.queue_work(s1);
    a.free(b.ptr).unwrap();
    let held = a.pool_stats().total_pages;
    sim.complete_all();
    let before = sim.driver_stats();
    a.wake("weights").unwrap();
    let d = sim.driver_stats().since(&before);
    // Their work is done: moved (10 unmaps), no page created.
    assert_eq!(a.pool_stats().total_pages, held);
    assert_eq!(d.count(CallKind::Create), 0, "{d:?}");
    assert_eq!(d.count(CallKind::Unmap), 10, "{d:?}");
    assert_eq!(d.count(CallKind::StreamSynchronize), 0);
    a.check_invariants().unwrap();
    a.free(w.ptr).unwrap();
    a.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        bytes: u64,
        tag: u8,
    },
    Free {
        which: usize,
    },
    Create {
        max_pages: u64,
        tag: u8,
    },
    Grow {
        which: usize,
        per_mille: u64,
    },
    Shrink {
        which: usize,
        per_mille: u64,
    },
    Release {
        which: usize,
    },
    Sleep {
        tag: u8,
        offload: bool,
        release: bool,
    },
    Wake {
        tag: u8,
    },
}

/// The length a `Grow` op asks for: `per_mille` of the way from the length
/// to the maximum; past 1000 beyond the maximum, past 1050 below the length.
fn grow_target(len: u64, max: u64, per_mille: u64) -> u64 {
    match per_mille {
        0..=1000 => len + (max - len) * per_mille / 1000,
        1001..=1050 => max + per_mille,
        _ => len.saturating_sub(1),
    }
}

const TAGS: [&str; 2] = ["a", "b"];

fn tag_of(t: u8) -> Option<&'static str> {
    TAGS.get(t as usize).copied()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..(600 * KIB), 0u8..3).prop_map(|(bytes, tag)| Op::Alloc { bytes, tag }),
        2 => any::<usize>().prop_map(|which| Op::Free { which }),
        2 => (1u64..16, 0u8..3).prop_map(|(max_pages, tag)| Op::Create { max_pages, tag }),
        3 => (any::<usize>(), 0u64..1100).prop_map(|(which, per_mille)| Op::Grow { which, per_mille }),
        2 => (any::<usize>(), 0u64..=1000).prop_map(|(which, per_mille)| Op::Shrink { which, per_mille }),
        1 => any::<usize>().prop_map(|which| Op::Release { which }),
        2 => (0u8..2, any::<bool>(), any::<bool>()).prop_map(|(tag, offload, release)| Op::Sleep { tag, offload, release }),
        2 => (0u8..2).prop_map(|tag| Op::Wake { tag }),
    ]
}

/// A live member the model tracks: its bytes are its seed's pattern while
/// `valid` (after a discard they are undefined until written again).
#[derive(Clone, Debug)]
struct Member {
    len: u64,
    seed: u8,
    tag: Option<u8>,
    valid: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random tagged and untagged blocks and growable buffers, grown and
    /// shrunk, slept (offload or discard) and woken, on real bytes under a
    /// 6 MiB limit: invariants after every operation, every byte of every
    /// offloaded member back after its wake, untouched memory never changed,
    /// members of a sleeping tag refused (but a free, done at its wake).
    #[test]
    fn sleep_wake_random_tags_keep_bytes_and_invariants(ops in proptest::collection::vec(op(), 1..60), tier in any::<bool>()) {
        let h = host(8 * MIB);
        let a = quilt(h.clone(), 6 * MIB);
        if tier {
            // Tag "a" may be sent to the host whenever a request runs out of memory.
            a.set_offload_tier(quilt_alloc::quilt::OffloadTier::OffloadableTags).unwrap();
            a.set_offloadable("a", true).unwrap();
        }
        let s = StreamId::DEFAULT;
        let mut blocks: BTreeMap<u64, Member> = BTreeMap::new();
        let mut bufs: Vec<(quilt_alloc::quilt::GrowableId, u64, Member)> = Vec::new(); // id, ptr, member
        let mut asleep = [false; 2];
        let mut seed = 0u8;
        for op in ops {
            seed = seed.wrapping_add(1);
            match op {
                Op::Alloc { bytes, tag } => {
                    let r = match tag_of(tag) {
                        Some(name) => a.allocate_tagged(bytes, s, name),
                        None => a.allocate(bytes, s),
                    };
                    match r {
                        Ok(b) => {
                            prop_assert!(tag_of(tag).is_none() || !asleep[tag as usize]);
                            h.write_bytes(b.ptr, &pattern(seed, bytes)).unwrap();
                            let m = Member { len: bytes, seed, tag: tag_of(tag).map(|_| tag), valid: true };
                            blocks.insert(b.ptr, m);
                        }
                        Err(AllocError::TagState { .. }) => prop_assert!(asleep[tag as usize]),
                        Err(AllocError::OutOfMemory(r)) => prop_assert_eq!(r.verdict, OomVerdict::Capacity),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Free { which } if !blocks.is_empty() => {
                    let p = *blocks.keys().nth(which % blocks.len()).unwrap();
                    // A sleeping tag's member too: freed at its wake.
                    match a.free(p) {
                        Ok(()) => { blocks.remove(&p); }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Create { max_pages, tag } => {
                    let r = match tag_of(tag) {
                        Some(name) => a.create_growable_tagged(max_pages * PAGE, s, name),
                        None => a.create_growable(max_pages * PAGE, s),
                    };
                    match r {
                        Ok(id) => {
                            let ptr = a.growable_info(id).unwrap().ptr;
                            bufs.push((id, ptr, Member { len: 0, seed, tag: tag_of(tag).map(|_| tag), valid: true }));
                        }
                        Err(AllocError::TagState { .. }) => prop_assert!(asleep[tag as usize]),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Grow { which, per_mille } if !bufs.is_empty() => {
                    let i = which % bufs.len();
                    let (id, ptr, m) = bufs[i].clone();
                    let max = a.growable_info(id).unwrap().max_len;
                    let bytes = grow_target(m.len, max, per_mille);
                    match a.grow_to(id, bytes) {
                        Ok(()) => {
                            // The new part gets this buffer's pattern at its offsets.
                            if bytes > m.len {
                                let full = pattern(m.seed, bytes);
                                h.write_bytes(ptr + m.len, &full[m.len as usize..]).unwrap();
                            }
                            bufs[i].2.len = bytes;
                        }
                        Err(AllocError::TagState { .. }) => prop_assert!(m.tag.is_some_and(|t| asleep[t as usize])),
                        Err(AllocError::InvalidResize { .. }) => prop_assert!(bytes < m.len || bytes > max),
                        Err(AllocError::OutOfMemory(r)) => prop_assert_eq!(r.verdict, OomVerdict::Capacity),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Shrink { which, per_mille } if !bufs.is_empty() => {
                    let i = which % bufs.len();
                    let (id, _, m) = bufs[i].clone();
                    let to = m.len * per_mille / 1000;
                    match a.shrink_to(id, to) {
                        Ok(()) => bufs[i].2.len = to,
                        Err(AllocError::TagState { .. }) => prop_assert!(m.tag.is_some_and(|t| asleep[t as usize])),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Release { which } if !bufs.is_empty() => {
                    let i = which % bufs.len();
                    let (id, _, m) = bufs[i].clone();
                    match a.release_growable(id) {
                        Ok(()) => { bufs.swap_remove(i); }
                        Err(AllocError::TagState { .. }) => prop_assert!(m.tag.is_some_and(|t| asleep[t as usize])),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Sleep { tag, offload, release } => {
                    let name = TAGS[tag as usize];
                    let mode = if offload { SleepMode::Offload } else { SleepMode::Discard };
                    let pages = if release {
                        quilt_alloc::quilt::SleepPages::ReleaseToDevice
                    } else {
                        quilt_alloc::quilt::SleepPages::KeepInPool
                    };
                    match a.sleep_with(name, mode, pages) {
                        Ok(()) => {
                            prop_assert!(!asleep[tag as usize]);
                            asleep[tag as usize] = true;
                            if !offload {
                                for m in blocks.values_mut().chain(bufs.iter_mut().map(|b| &mut b.2)) {
                                    if m.tag == Some(tag) { m.valid = false; }
                                }
                            }
                        }
                        Err(AllocError::TagState { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Wake { tag } => match a.wake(TAGS[tag as usize]) {
                    Ok(()) => {
                        prop_assert!(asleep[tag as usize]);
                        asleep[tag as usize] = false;
                    }
                    Err(AllocError::TagState { .. }) => prop_assert!(!asleep[tag as usize]),
                    Err(AllocError::OutOfMemory(r)) => {
                        prop_assert_eq!(r.verdict, OomVerdict::Capacity);
                        prop_assert!(a.is_asleep(TAGS[tag as usize]).unwrap());
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                _ => {}
            }
            a.check_invariants().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(a.stats().reserved_bytes.current <= 6 * MIB);
            // The offload tier may have put tag "a" to sleep (offload: its bytes kept).
            for (t, name) in TAGS.iter().enumerate() {
                let now = a.is_asleep(name).unwrap_or(false);
                prop_assert!(!now || asleep[t] || (tier && t == 0), "tag {} fell asleep", name);
                asleep[t] = now;
            }
            // Every awake, valid member holds its bytes.
            for (&p, m) in &blocks {
                if m.valid && !m.tag.is_some_and(|t| asleep[t as usize]) {
                    prop_assert_eq!(read(&h, p, m.len), pattern(m.seed, m.len), "block {:#x}", p);
                }
            }
            for (_, p, m) in &bufs {
                if m.valid && m.len > 0 && !m.tag.is_some_and(|t| asleep[t as usize]) {
                    prop_assert_eq!(read(&h, *p, m.len), pattern(m.seed, m.len), "buffer {:#x}", p);
                }
            }
        }
    }
}

/// One scripted serving sequence (growable buffer and tagged block, growth,
/// shrink, sleep, reuse of the freed pages, wake, growth, release) on a
/// simulated device with `fault` armed: every operation either succeeds or
/// fails leaving the allocator consistent (invariants after each), a failed
/// growth leaves its buffer's length as it was, a failed wake leaves the tag
/// asleep; at the end, faults cleared, everything is woken and released and
/// nothing leaks. Returns the VMM calls the run made.
fn faulted_run(fault: Option<quilt_vmm::sim::Fault>) -> u64 {
    let sim = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let a = quilt(sim.clone(), 64 * MIB);
    a.set_map_ahead(MapAhead {
        pages: 1,
        below_per_mille: 1000,
        mode: quilt_alloc::quilt::AheadMode::Inline,
    })
    .unwrap();
    let (s1, s2) = (StreamId(1), StreamId(2));
    if let Some(f) = fault {
        sim.inject(f);
    }
    let check = |what: &str| {
        a.check_invariants()
            .unwrap_or_else(|e| panic!("after {what}: {e}"));
    };
    let buf = a.create_growable_tagged(32 * MIB, s1, "t").ok();
    check("create");
    let w = a.allocate_tagged(6 * MIB, s2, "t").ok();
    check("allocate_tagged");
    let grow = |bytes: u64, what: &str| {
        if let Some(id) = buf {
            let before = a.growable_info(id).unwrap().len;
            if a.grow_to(id, bytes).is_err() {
                assert_eq!(a.growable_info(id).unwrap().len, before, "{what}");
            }
            check(what);
        }
    };
    grow(10 * MIB, "grow");
    if let Ok(b) = a.allocate(8 * MIB, s1) {
        check("allocate");
        let _ = a.free(b.ptr);
    }
    check("free");
    if let Some(id) = buf {
        let _ = a.shrink_to(id, 3 * MIB);
    }
    check("shrink");
    let _ = a.sleep("t", SleepMode::Offload);
    check("sleep");
    if let Ok(b) = a.allocate(40 * MIB, s2) {
        check("allocate while asleep");
        let _ = a.free(b.ptr);
    }
    let asleep = a.is_asleep("t").unwrap();
    if a.wake("t").is_err() {
        assert_eq!(
            a.is_asleep("t").unwrap(),
            asleep,
            "a failed wake changed the tag"
        );
    }
    check("wake");
    grow(20 * MIB, "grow after wake");
    if let Some(id) = buf {
        let _ = a.release_growable(id);
    }
    check("release");
    sim.clear_faults();
    let calls = sim.driver_stats().vmm_calls();
    if a.is_asleep("t").unwrap_or(false) {
        a.wake("t").unwrap();
    }
    if let Some(id) = buf {
        if a.growable_info(id).is_ok() {
            a.release_growable(id).unwrap();
        }
    }
    if let Some(w) = w {
        a.free(w.ptr).unwrap();
    }
    check("cleanup");
    a.empty_cache().unwrap();
    check("empty_cache");
    drop(a);
    assert!(sim.leak_report().is_empty(), "{}", sim.leak_report());
    calls
}

#[test]
fn sleep_wake_and_growable_survive_a_driver_fault_at_every_call() {
    use quilt_vmm::sim::Fault;
    let calls = faulted_run(None);
    assert!(calls > 20, "{calls}");
    for k in 1..=calls + 1 {
        faulted_run(Some(Fault::nth_overall(k)));
    }
    for kind in [
        CallKind::MemcpyDtoH,
        CallKind::MemcpyHtoD,
        CallKind::StreamSynchronize,
        CallKind::EventRecord,
        CallKind::StreamWaitEvent,
    ] {
        for n in 1..=3 {
            faulted_run(Some(Fault::nth(kind, n)));
        }
    }
}

#[test]
fn sleep_wake_offload_tier_sends_offloadable_tags_to_the_host_on_out_of_memory() {
    use quilt_alloc::quilt::OffloadTier;
    let h = host(4 * MIB);
    let a = quilt(h.clone(), 4 * MIB);
    let s = StreamId::DEFAULT;
    let cold = a.allocate_tagged(2 * MIB, s, "cold").unwrap();
    let hot = a.allocate_tagged(MIB, s, "hot").unwrap();
    h.write_bytes(cold.ptr, &pattern(1, cold.size)).unwrap();
    h.write_bytes(hot.ptr, &pattern(2, hot.size)).unwrap();
    a.set_offloadable("cold", true).unwrap();
    // Off by default: out of memory.
    assert!(a.allocate(2 * MIB + 512 * KIB, s).is_err());
    a.set_offload_tier(OffloadTier::OffloadableTags).unwrap();
    // More than offloading could free: nothing is put to sleep.
    assert!(a.allocate(4 * MIB - PAGE, s).is_err());
    assert!(!a.is_asleep("cold").unwrap());
    // Fits once "cold" is on the host; "hot" is not offloadable.
    let big = a.allocate(2 * MIB + 512 * KIB, s).unwrap();
    assert!(a.is_asleep("cold").unwrap() && !a.is_asleep("hot").unwrap());
    let st = a.serving_stats();
    assert_eq!((st.tier_offloads, st.tier_rescues), (1, 1));
    assert_eq!(read(&h, hot.ptr, hot.size), pattern(2, hot.size));
    a.check_invariants().unwrap();
    // Waking needs the memory back: the block goes first.
    assert!(a.wake("cold").is_err());
    assert!(a.is_asleep("cold").unwrap());
    a.free(big.ptr).unwrap();
    a.wake("cold").unwrap();
    assert_eq!(read(&h, cold.ptr, cold.size), pattern(1, cold.size));
    a.check_invariants().unwrap();
}

/// On the CUDA backend (over the CUDA double; on a GPU with
/// `QUILT_CUDA_TESTS=real`): a tagged block and a growable buffer keep every
/// byte through growth (same address) and through sleep, reuse of their
/// pages by another block, and wake.
#[cfg(feature = "cuda")]
#[test]
fn sleep_wake_on_cuda_keeps_every_byte() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let cuda: Arc<dyn Vmm> = Arc::new(quilt_vmm::cuda::CudaVmm::new(0).unwrap());
    let a = quilt(cuda.clone(), 1 << 30);
    let s = StreamId::DEFAULT;
    let get = |p: u64, len: u64| {
        let mut out = vec![0u8; len as usize];
        cuda.copy_to_host(p, &mut out).unwrap();
        out
    };
    let w = a.allocate_tagged(64 * MIB, s, "weights").unwrap();
    cuda.copy_from_host(w.ptr, &pattern(1, w.size)).unwrap();
    let kv = GrowableBuffer::new_tagged(a.clone(), 256 * MIB, s, "weights").unwrap();
    kv.grow_to(10 * MIB).unwrap();
    cuda.copy_from_host(kv.ptr(), &pattern(2, 10 * MIB))
        .unwrap();
    kv.grow_to(30 * MIB).unwrap();
    assert_eq!(get(kv.ptr(), 10 * MIB), pattern(2, 10 * MIB));
    cuda.copy_from_host(kv.ptr(), &pattern(3, 30 * MIB))
        .unwrap();
    a.sleep("weights", SleepMode::Offload).unwrap();
    let other = a
        .allocate(1024 * MIB - 4 * cuda.granularity(), StreamId::DEFAULT)
        .unwrap();
    cuda.copy_from_host(other.ptr, &vec![0xFF; 8 * MIB as usize])
        .unwrap();
    a.free(other.ptr).unwrap();
    a.wake("weights").unwrap();
    assert_eq!(get(w.ptr, w.size), pattern(1, w.size));
    assert_eq!(get(kv.ptr(), 30 * MIB), pattern(3, 30 * MIB));
    a.check_invariants().unwrap();
    a.free(w.ptr).unwrap();
    kv.release().unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn sleep_wake_on_the_simulator_costs_large_copies_without_host_memory() {
    const GIB: u64 = 1 << 30;
    let sim = Arc::new(SimVmm::with_capacity(80 * GIB).unwrap());
    let a = quilt(sim.clone(), 80 * GIB);
    // 40 GiB of weights: kept on the host on a real device; the simulated
    // one holds no bytes, so its copies are costed through a scratch buffer
    // and nothing is kept (this test would exhaust a small machine otherwise).
    let w = a
        .allocate_tagged(40 * GIB, StreamId::DEFAULT, "big")
        .unwrap();
    let before = sim.driver_stats();
    a.sleep("big", SleepMode::Offload).unwrap();
    let d = sim.driver_stats().since(&before);
    assert_eq!(
        (d.count(CallKind::MemcpyDtoH), d.copied_bytes),
        (40, 40 * GIB)
    );
    assert_eq!(a.host_bytes(), 40 * GIB);
    let other = a.allocate(70 * GIB, StreamId::DEFAULT).unwrap();
    a.free(other.ptr).unwrap();
    a.wake("big").unwrap();
    assert_eq!(sim.driver_stats().since(&before).copied_bytes, 80 * GIB);
    a.check_invariants().unwrap();
    a.free(w.ptr).unwrap();
}

#[test]
fn sleep_wake_releasing_pages_to_the_device_and_creating_them_again() {
    use quilt_alloc::quilt::SleepPages;
    let h = host(4 * MIB);
    let a = quilt(h.clone(), 4 * MIB);
    let w = a.allocate_tagged(2 * MIB, StreamId::DEFAULT, "w").unwrap();
    let keep = a.allocate(MIB, StreamId::DEFAULT).unwrap();
    h.write_bytes(w.ptr, &pattern(4, w.size)).unwrap();
    h.fill(keep.ptr, keep.size, 0x11).unwrap();
    let reserved = a.stats().reserved_bytes.current;
    let before = h.driver_stats();
    a.sleep_with("w", SleepMode::Offload, SleepPages::ReleaseToDevice)
        .unwrap();
    // Its 32 pages of 64 KiB are gone from the device, not only unmapped.
    let d = h.driver_stats().since(&before);
    assert_eq!(d.count(CallKind::Release), 32);
    assert_eq!(a.stats().reserved_bytes.current, reserved - 2 * MIB);
    assert!(h.check_filled(keep.ptr, keep.size, 0x11).unwrap());
    a.check_invariants().unwrap();
    a.wake("w").unwrap();
    assert_eq!(h.driver_stats().since(&before).count(CallKind::Create), 32);
    assert_eq!(read(&h, w.ptr, w.size), pattern(4, w.size));
    a.check_invariants().unwrap();
    a.free(w.ptr).unwrap();
    a.free(keep.ptr).unwrap();
}
