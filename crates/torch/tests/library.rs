//! The library's behaviour through its safe core ([`Library`]), one library
//! per test (each with its own configuration), on the host and simulated
//! backends: allocation from many threads with real bytes, out of memory,
//! bad pointers, memory fractions, statistics, and snapshots in PyTorch's
//! layout that add up and that Quilt's own importer reads back.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::BTreeMap;
use std::sync::Arc;

use quilt_bench::snapshot_import::import_snapshot;
use quilt_bench::trace::Event;
use quilt_torch::library::Library;
use serde_pickle::{HashableValue, Value};

const MIB: u64 = 1 << 20;

fn field<'a>(v: &'a Value, k: &str) -> &'a Value {
    match v {
        Value::Dict(d) => d
            .get(&HashableValue::String(k.into()))
            .unwrap_or_else(|| panic!("no field {k}")),
        _ => panic!("not a dict"),
    }
}

fn int(v: &Value) -> u64 {
    match v {
        Value::I64(i) => *i as u64,
        other => panic!("not an int: {other:?}"),
    }
}

fn list(v: &Value) -> &Vec<Value> {
    match v {
        Value::List(l) => l,
        other => panic!("not a list: {other:?}"),
    }
}

fn text(v: &Value) -> &str {
    match v {
        Value::String(s) => s,
        other => panic!("not a string: {other:?}"),
    }
}

fn stats(lib: &Library) -> serde_json::Value {
    serde_json::from_str(&lib.stats_json(0).unwrap()).unwrap()
}

#[test]
fn eight_threads_write_and_read_host_memory() {
    let lib = Arc::new(Library::new("backend:host,capacity:256MiB"));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let lib = lib.clone();
            std::thread::spawn(move || {
                let mut live: Vec<(u64, u64, u8)> = Vec::new();
                for i in 0..1500u64 {
                    let size = match i % 7 {
                        0 => 3 * MIB + i,
                        1 => 1 + i % 4096,
                        _ => 64 * 1024 + (i * 7919) % (512 * 1024),
                    };
                    let stream = i % 3;
                    let p = lib.malloc(size, 0, stream).unwrap();
                    let tag = (t * 31 + i) as u8;
                    let bytes = host_bytes(p, size);
                    bytes.fill(tag);
                    live.push((p, size, tag));
                    if live.len() > 6 {
                        let (p, size, tag) = live.remove((i as usize * 5) % live.len());
                        assert!(host_bytes(p, size).iter().all(|&b| b == tag));
                        lib.free(p, size, 0, stream).unwrap();
                    }
                }
                for (p, size, tag) in live {
                    assert!(host_bytes(p, size).iter().all(|&b| b == tag));
                    lib.free(p, size, 0, 0).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = stats(&lib);
    assert_eq!(s["allocated_bytes"]["current"], 0);
    assert!(s["allocation"]["peak"].as_u64().unwrap() > 8);
    assert!(s["reserved_bytes"]["current"].as_u64().unwrap() <= 256 * MIB);
    assert_eq!(s["backend"], "host");
}

/// The `size` bytes of the live host-backend block at `p` (the host
/// backend's pointers are real memory of this process, valid until freed).
fn host_bytes(p: u64, size: u64) -> &'static mut [u8] {
    // SAFETY: `p` is a live block of `size` bytes that the host backend
    // mapped read-write in this process; each test thread touches only its
    // own blocks, and frees a block only after its last use here.
    unsafe { std::slice::from_raw_parts_mut(p as usize as *mut u8, size as usize) }
}

#[test]
fn out_of_memory_is_an_error_with_its_verdict_and_the_library_goes_on() {
    let lib = Library::new("backend:sim,capacity:64MiB");
    let e = lib.malloc(100 * MIB, 0, 0).unwrap_err();
    assert!(
        e.contains("out of memory") && e.contains("verdict: capacity"),
        "{e}"
    );
    let p = lib.malloc(8 * MIB, 0, 0).unwrap();
    lib.free(p, 8 * MIB, 0, 0).unwrap();
    assert_eq!(stats(&lib)["num_ooms"], 1);
}

#[test]
fn bad_pointers_are_errors() {
    let lib = Library::new("backend:sim,capacity:64MiB");
    assert!(lib.free(0, 0, 0, 0).unwrap_err().contains("null"));
    assert!(lib
        .free(0x1234, 8, 0, 0)
        .unwrap_err()
        .contains("allocated nothing"));
    let p = lib.malloc(MIB, 0, 0).unwrap();
    assert!(lib.free(p + 512, MIB, 0, 0).is_err(), "interior pointer");
    lib.free(p, MIB, 0, 0).unwrap();
    assert!(lib.free(p, MIB, 0, 0).unwrap_err().contains("double free"));
    assert!(lib.record_stream(0x1234, 1).is_err());
    assert!(lib.malloc(MIB, -1, 0).is_err());
    assert!(lib.malloc(0, 0, 0).is_err());
}

#[test]
fn a_bad_configuration_refuses_every_allocation() {
    let lib = Library::new("backend:host,colour:blue");
    let e = lib.malloc(MIB, 0, 0).unwrap_err();
    assert!(
        e.contains("colour") && e.contains("backend, capacity"),
        "{e}"
    );
    assert!(lib.stats_json(0).is_err());
    assert!(lib.dump_snapshot("/tmp/never.pickle").is_err());
}

#[test]
fn memory_fraction_limits_a_device_before_and_after_its_creation() {
    let lib = Library::new("backend:sim,capacity:256MiB");
    lib.set_memory_fraction(0.25, 1).unwrap();
    assert!(lib
        .malloc(100 * MIB, 1, 0)
        .unwrap_err()
        .contains("out of memory"));
    let p = lib.malloc(40 * MIB, 0, 0).unwrap();
    // Below what live blocks hold: taken, as torch takes it; nothing more
    // is mapped meanwhile.
    lib.set_memory_fraction(0.01, 0).unwrap();
    assert_eq!(lib.memory_fraction(0).unwrap(), 0.01);
    assert!(lib
        .malloc(8 * MIB, 0, 0)
        .unwrap_err()
        .contains("out of memory"));
    lib.set_memory_fraction(0.5, 0).unwrap();
    assert!(lib.malloc(100 * MIB, 0, 0).is_err());
    lib.free(p, 40 * MIB, 0, 0).unwrap();
    assert!(lib.set_memory_fraction(1.5, 0).is_err());
    assert!(lib.set_memory_fraction(0.5, -2).is_err());
}

#[test]
fn a_memory_fraction_of_0_is_taken_as_torch_takes_it() {
    // torch's set_per_process_memory_fraction takes 0 to 1: at 0 nothing
    // more may be held, before or after the device is created.
    let lib = Library::new("backend:host,capacity:256MiB");
    lib.set_memory_fraction(0.0, 1).unwrap();
    assert_eq!(lib.memory_fraction(1).unwrap(), 0.0);
    let refused = lib.malloc(MIB, 1, 0).unwrap_err();
    assert!(refused.contains("out of memory"), "{refused}");
    let p = lib.malloc(4 * MIB, 0, 0).unwrap();
    // A live block holds memory: the fraction is taken all the same (torch
    // takes any fraction), nothing more is mapped, and the live block's
    // memory stays until it is freed.
    lib.set_memory_fraction(0.0, 0).unwrap();
    assert_eq!(lib.memory_fraction(0).unwrap(), 0.0);
    let held = stats(&lib)["capacity_bytes"].as_u64().unwrap();
    assert!(held >= 4 * MIB, "{held}");
    let refused = lib.malloc(8 * MIB, 0, 0).unwrap_err();
    assert!(refused.contains("out of memory"), "{refused}");
    lib.free(p, 4 * MIB, 0, 0).unwrap();
    // Freed and the cache emptied: the fraction takes hold whole.
    lib.empty_cache().unwrap();
    assert_eq!(lib.memory_fraction(0).unwrap(), 0.0);
    assert_eq!(stats(&lib)["capacity_bytes"].as_u64().unwrap(), 0);
    let refused = lib.malloc(MIB, 0, 0).unwrap_err();
    assert!(refused.contains("out of memory"), "{refused}");
    lib.set_memory_fraction(1.0, 0).unwrap();
    let p = lib.malloc(MIB, 0, 0).unwrap();
    lib.free(p, MIB, 0, 0).unwrap();
    for bad in [-0.5, 1.5, f64::NAN] {
        assert!(lib.set_memory_fraction(bad, 0).is_err(), "{bad}");
    }
}

#[test]
fn a_memory_fraction_raised_at_run_time_is_honoured() {
    // The arena's address space is sized from the device, not the limit
    // in force at the first request: after starting at 3 % of an 8 GiB
    // device, a fraction of 1.0 admits a 3 GiB block on the empty device.
    let lib = Library::new("backend:host,capacity:8GiB,memory_fraction:0.03");
    let small = lib.malloc(64 * MIB, 0, 0).unwrap();
    let refused = lib.malloc(3 << 30, 0, 0).unwrap_err();
    assert!(refused.contains("out of memory"), "{refused}");
    lib.free(small, 64 * MIB, 0, 0).unwrap();
    lib.set_memory_fraction(1.0, 0).unwrap();
    let big = lib.malloc(3 << 30, 0, 0).unwrap();
    lib.free(big, 3 << 30, 0, 0).unwrap();
    // Lowering below what is held returns the cache first: nothing live,
    // so it is honoured.
    lib.set_memory_fraction(0.03, 0).unwrap();
    assert!(lib.malloc(3 << 30, 0, 0).is_err());
}

#[test]
fn a_memory_limit_in_quilt_alloc_conf_is_honoured() {
    // `memory_limit` is a key of the library as of Quilt's configuration:
    // 2 GiB of an 8 GiB host device.
    let lib = Library::new("backend:host,capacity:8GiB,memory_limit:2GiB");
    assert_eq!(stats(&lib)["capacity_bytes"].as_u64().unwrap(), 2 << 30);
    let held = lib.malloc(1 << 30, 0, 0).unwrap();
    let refused = lib.malloc(3 << 29, 0, 0).unwrap_err();
    assert!(refused.contains("out of memory"), "{refused}");
    lib.free(held, 1 << 30, 0, 0).unwrap();
    assert!(lib.malloc(3 << 30, 0, 0).is_err(), "over the limit");
    // quilt_set_memory_fraction replaces it.
    lib.set_memory_fraction(1.0, 0).unwrap();
    let big = lib.malloc(3 << 30, 0, 0).unwrap();
    lib.free(big, 3 << 30, 0, 0).unwrap();
    // Both in the text: refused, and the library allocates nothing.
    let both = Library::new("backend:host,memory_limit:64MiB,memory_fraction:0.5");
    let e = both.malloc(MIB, 0, 0).unwrap_err();
    assert!(
        e.contains("QUILT_ALLOC_CONF=") && e.contains("give one"),
        "{e}"
    );
}

#[test]
fn snapshots_add_up_and_read_back_through_quilt_s_importer() {
    let lib = Library::new("backend:sim,capacity:1GiB");
    lib.record_history(true, 10_000);
    let mut live = Vec::new();
    for i in 0..40u64 {
        let size = (1 + i % 9) * 700 * 1024 + i;
        live.push((lib.malloc(size, 0, i % 2).unwrap(), size));
    }
    let mut kept: Vec<(u64, u64)> = Vec::new();
    for (i, (p, size)) in live.into_iter().enumerate() {
        if i % 3 == 0 {
            lib.free(p, size, 0, 0).unwrap();
        } else {
            kept.push((p, size));
        }
    }
    let reserved = stats(&lib)["reserved_bytes"]["current"].as_u64().unwrap();
    let bytes = lib.snapshot_pickle().unwrap();
    let v = serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap();
    let segments = list(field(&v, "segments"));
    let mut total = 0;
    let mut active: BTreeMap<u64, u64> = BTreeMap::new();
    for s in segments {
        let blocks = list(field(s, "blocks"));
        let sum: u64 = blocks.iter().map(|b| int(field(b, "size"))).sum();
        assert_eq!(sum, int(field(s, "total_size")), "blocks tile the segment");
        let allocated: u64 = blocks
            .iter()
            .filter(|b| text(field(b, "state")) == "active_allocated")
            .map(|b| int(field(b, "size")))
            .sum();
        assert_eq!(allocated, int(field(s, "allocated_size")));
        for b in blocks {
            if text(field(b, "state")) == "active_allocated" {
                active.insert(int(field(b, "address")), int(field(b, "requested_size")));
            }
        }
        total += int(field(s, "total_size"));
    }
    assert_eq!(total, reserved, "the segments add up to the reserved bytes");
    let expected: BTreeMap<u64, u64> = kept.iter().copied().collect();
    assert_eq!(active, expected, "every live block, at its address");
    let traces = list(&list(field(&v, "device_traces"))[0]);
    let allocs = traces
        .iter()
        .filter(|t| text(field(t, "action")) == "alloc")
        .count();
    assert_eq!(allocs, 40);
    // Quilt's own importer: replaying the snapshot's trace leaves the same
    // live sizes.
    let trace = import_snapshot(&bytes, "exported", 0).unwrap();
    let mut live_sizes: BTreeMap<u64, u64> = BTreeMap::new();
    for e in &trace.events {
        match *e {
            Event::Alloc { id, size, .. } => {
                live_sizes.insert(id, size);
            }
            Event::Free { id } => {
                live_sizes.remove(&id);
            }
            other => panic!("a snapshot gave a serving event: {other:?}"),
        }
    }
    let mut got: Vec<u64> = live_sizes.into_values().collect();
    let mut want: Vec<u64> = kept.iter().map(|k| k.1).collect();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want);
}

/// As torch's `MemPool` test of two threads: blocks outside the pool before
/// and after the pool's segment, a block of the pool freed. Each private
/// pool's segment is listed on its own with its pool and stream, apart from
/// the others (which never lie within it); released, it is no pool's.
#[test]
fn a_private_pools_segment_is_listed_apart_with_its_pool_id() {
    let lib = Library::new("backend:sim,capacity:256MiB");
    let pool = (0, 1);
    lib.pool_create_or_incref(0, pool).unwrap();
    let (before, _) = lib.torch_malloc(MIB, 0, 0, None, None).unwrap();
    let (pooled, _) = lib.torch_malloc(MIB, 0, 0, None, Some(pool)).unwrap();
    lib.torch_free(pooled).unwrap();
    let (after, _) = lib.torch_malloc(MIB, 0, 0, None, None).unwrap();

    let (segs, blocks) = lib.segments(None).unwrap();
    let of_pool: Vec<_> = segs.iter().filter(|s| s.owner_pool == [0, 1]).collect();
    assert_eq!(of_pool.len(), 1, "{segs:?}");
    let p = of_pool[0];
    assert_eq!((p.total_size, p.stream), (2 * MIB, 0));
    let p_blocks = &blocks[p.first_block as usize..(p.first_block + p.block_count) as usize];
    assert!(p_blocks.iter().all(|b| b.state == 2), "{p_blocks:?}");
    assert_eq!(p_blocks[0].address, pooled);
    let others: Vec<_> = segs.iter().filter(|s| s.owner_pool == [0, 0]).collect();
    assert_eq!(others.len() + 1, segs.len(), "no other pool: {segs:?}");
    let active: u64 = others
        .iter()
        .flat_map(|s| &blocks[s.first_block as usize..(s.first_block + s.block_count) as usize])
        .filter(|b| b.state == 0)
        .map(|b| b.size)
        .sum();
    assert_eq!(active, 2 * MIB);
    for ptr in [before, after] {
        assert!(!(p.address..p.address + p.total_size).contains(&ptr));
    }

    lib.pool_release(0, pool).unwrap();
    let (segs, _) = lib.segments(None).unwrap();
    assert!(segs.iter().all(|s| s.owner_pool == [0, 0]), "{segs:?}");
    lib.torch_free(before).unwrap();
    lib.torch_free(after).unwrap();
}
