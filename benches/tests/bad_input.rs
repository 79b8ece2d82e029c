//! Bad input, for every allocator the registry knows: each case returns a typed
//! error, leaves the invariants intact and the allocator usable (a normal
//! allocate and free succeed afterwards), and nothing leaks at drop.
//!
//! Also malformed trace files and snapshot pickles: errors that name the line
//! or entry, never a panic. (`benches/tests/snapshot_import.rs` and the unit
//! tests of `trace.rs` cover the basic cases; these are the rest: odd bytes,
//! odd numbers, every truncation and many byte flips, deep nesting.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{dict, s};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict, MAX_ALLOCATION};
use quilt_bench::allocators::{self, RegistryError, ALLOCATOR_NAMES};
use quilt_bench::replay::{replay_fresh, ReplayConfig, ReplayError};
use quilt_bench::snapshot_import::import_snapshot;
use quilt_bench::trace::{load_trace, parse_trace, Trace, TraceError};
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId, Vmm};
use serde_pickle::{SerOptions, Value};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The simulated device of these tests.
const CAPACITY: u64 = 8 * GIB;

/// Every allocator of the registry in this build, each on a fresh device.
fn allocators_on_sim() -> Vec<(Arc<SimVmm>, Box<dyn DeviceAllocator>)> {
    let mut out = Vec::new();
    for name in ALLOCATOR_NAMES {
        let sim = Arc::new(SimVmm::with_capacity(CAPACITY).unwrap());
        match allocators::build(name, sim.clone()) {
            Ok(a) => out.push((sim, a)),
            Err(RegistryError::Construct { source, .. }) => {
                panic!("building `{name}` on a clean device: {source}")
            }
            Err(other) => eprintln!("bad_input: {other}: skipped"),
        }
    }
    assert!(!out.is_empty());
    out
}

/// Invariants of the allocator and the driver, and the allocator still usable.
fn still_sound(alloc: &dyn DeviceAllocator, sim: &SimVmm, ctx: &str) {
    alloc
        .check_invariants()
        .unwrap_or_else(|v| panic!("{}: {ctx}: {v}", alloc.name()));
    sim.check_invariants()
        .unwrap_or_else(|v| panic!("{}: {ctx}: driver: {v}", alloc.name()));
    let a = alloc
        .allocate(3 * MIB + 100, StreamId(0))
        .unwrap_or_else(|e| panic!("{}: {ctx}: not usable afterwards: {e}", alloc.name()));
    alloc.free(a.ptr).unwrap();
    sim.complete_all();
    alloc.check_invariants().unwrap();
}

fn finish(alloc: Box<dyn DeviceAllocator>, sim: &SimVmm) {
    let name = alloc.name().to_string();
    sim.complete_all();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    drop(alloc);
    let leaks = sim.leak_report();
    assert!(leaks.is_empty(), "{name}: after drop: {leaks}");
}

fn is_unknown_or_double(e: &AllocError, ptr: DevicePtr) -> bool {
    matches!(e, AllocError::UnknownPointer { ptr: p } | AllocError::DoubleFree { ptr: p } if *p == ptr)
}

#[test]
fn frees_of_pointers_that_are_not_live_allocations() {
    for (sim, alloc) in allocators_on_sim() {
        let name = alloc.name().to_string();
        let small = alloc.allocate(1000, StreamId(0)).unwrap();
        let large = alloc.allocate(5 * MIB + 3, StreamId(1)).unwrap();
        let before = alloc.stats();
        let bad: Vec<(&str, DevicePtr)> = vec![
            ("null", 0),
            ("unknown", 0xdead_beef_0000),
            ("u64::MAX", u64::MAX),
            ("interior +1 (small)", small.ptr + 1),
            ("interior +512 (small)", small.ptr + 512),
            ("interior +1 (large)", large.ptr + 1),
            ("interior +512 (large)", large.ptr + 512),
            ("interior +2 MiB (large)", large.ptr + 2 * MIB),
            ("one past the end (large)", large.ptr + large.size),
            ("just before (large)", large.ptr - 512),
        ];
        for (what, ptr) in bad {
            let mapped = sim.mapped_bytes();
            // DoubleFree is right too where the address was once handed out
            // (the checks of `still_sound` allocate and free).
            match alloc.free(ptr) {
                Err(e) if is_unknown_or_double(&e, ptr) => {}
                other => panic!("{name}: free of {what} pointer {ptr:#x}: {other:?}"),
            }
            assert_eq!(
                alloc.stats().allocated_bytes.current,
                before.allocated_bytes.current,
                "{name}: {what}"
            );
            assert_eq!(
                alloc.stats().allocation.current,
                before.allocation.current,
                "{name}: {what}"
            );
            assert_eq!(sim.mapped_bytes(), mapped, "{name}: {what}");
            still_sound(alloc.as_ref(), &sim, what);
        }
        // Double free, right after the free and after other traffic.
        alloc.free(small.ptr).unwrap();
        match alloc.free(small.ptr) {
            Err(e) if is_unknown_or_double(&e, small.ptr) => {}
            other => panic!("{name}: double free: {other:?}"),
        }
        still_sound(alloc.as_ref(), &sim, "double free");
        alloc.free(large.ptr).unwrap();
        sim.complete_all();
        for _ in 0..3 {
            let a = alloc.allocate(7 * MIB, StreamId(2)).unwrap();
            alloc.free(a.ptr).unwrap();
        }
        match alloc.free(large.ptr) {
            // The address may have been handed out again and freed since:
            // either way it is not live now.
            Err(e) if is_unknown_or_double(&e, large.ptr) => {}
            other => panic!("{name}: late double free: {other:?}"),
        }
        still_sound(alloc.as_ref(), &sim, "late double free");
        assert_eq!(alloc.stats().allocation.current, 0, "{name}");
        finish(alloc, &sim);
    }
}

#[test]
fn zero_absurd_and_overflowing_sizes() {
    for (sim, alloc) in allocators_on_sim() {
        let name = alloc.name().to_string();
        let keep = alloc.allocate(10 * MIB, StreamId(0)).unwrap();
        let invalid = [
            0,
            u64::MAX,
            u64::MAX - 100,
            u64::MAX - 511,
            u64::MAX - (2 << 20),
            1 << 63,
            MAX_ALLOCATION + 1,
            MAX_ALLOCATION + 511,
        ];
        for size in invalid {
            for stream in [0, 1, u64::MAX] {
                match alloc.allocate(size, StreamId(stream)) {
                    Err(AllocError::InvalidSize { size: s, .. }) if s == size => {}
                    other => panic!("{name}: allocate({size:#x}) on stream {stream}: {other:?}"),
                }
            }
            still_sound(alloc.as_ref(), &sim, &format!("size {size:#x}"));
        }
        // Valid but larger than the device: out of memory with a report.
        for size in [
            CAPACITY + 1,
            CAPACITY * 2,
            MAX_ALLOCATION,
            MAX_ALLOCATION - 1,
        ] {
            let ooms = alloc.stats().num_ooms;
            match alloc.allocate(size, StreamId(0)) {
                Err(AllocError::OutOfMemory(report)) => {
                    assert_eq!(report.requested, size, "{name}");
                    assert!(
                        report.needed >= size,
                        "{name}: needed {} < {size}",
                        report.needed
                    );
                }
                other => panic!("{name}: allocate({size:#x}) on an 8 GiB device: {other:?}"),
            }
            assert_eq!(alloc.stats().num_ooms, ooms + 1, "{name}: OOM not counted");
            still_sound(alloc.as_ref(), &sim, &format!("oversized {size:#x}"));
        }
        assert!(
            sim.physical_in_use() <= CAPACITY,
            "{name}: more than the device"
        );
        alloc.free(keep.ptr).unwrap();
        finish(alloc, &sim);
    }
}

#[test]
fn odd_streams_and_sizes_at_boundaries() {
    for (sim, alloc) in allocators_on_sim() {
        let name = alloc.name().to_string();
        let mut live = Vec::new();
        for (size, stream) in [
            (1, u64::MAX),
            (511, 0),
            (512, 0),
            (513, 0),
            (MIB - 1, 7),
            (MIB, 7),
            (MIB + 1, 7),
            (2 * MIB - 1, 3),
            (2 * MIB, 3),
            (2 * MIB + 1, 3),
            (20 * MIB + 1, 1 << 40),
        ] {
            let a = alloc
                .allocate(size, StreamId(stream))
                .unwrap_or_else(|e| panic!("{name}: allocate({size}) on {stream}: {e}"));
            assert!(a.size >= size && a.ptr != 0, "{name}: {a:?} for {size}");
            live.push((a.ptr, a.size));
            alloc.check_invariants().unwrap();
        }
        // No two live allocations overlap.
        live.sort();
        for w in live.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "{name}: {:#x}+{} overlaps {:#x}",
                w[0].0,
                w[0].1,
                w[1].0
            );
        }
        for (p, _) in live {
            alloc.free(p).unwrap();
        }
        still_sound(alloc.as_ref(), &sim, "boundaries");
        finish(alloc, &sim);
    }
}

#[test]
fn record_stream_on_pointers_that_are_not_live() {
    for (sim, alloc) in allocators_on_sim() {
        let name = alloc.name().to_string();
        let a = alloc.allocate(4 * MIB, StreamId(0)).unwrap();
        for ptr in [0, 0xdead_0000, a.ptr + 512, a.ptr + 1] {
            match alloc.record_stream(ptr, StreamId(1)) {
                Err(AllocError::UnknownPointer { ptr: p }) if p == ptr => {}
                other => panic!("{name}: record_stream({ptr:#x}): {other:?}"),
            }
        }
        // On its own stream and twice on another: fine.
        alloc.record_stream(a.ptr, StreamId(0)).unwrap();
        alloc.record_stream(a.ptr, StreamId(1)).unwrap();
        alloc.record_stream(a.ptr, StreamId(1)).unwrap();
        alloc.free(a.ptr).unwrap();
        // Freed, and still waiting on stream 1's work: not live either way.
        match alloc.record_stream(a.ptr, StreamId(2)) {
            Err(e) if is_unknown_or_double(&e, a.ptr) => {}
            other => panic!("{name}: record_stream on a freed (pending) pointer: {other:?}"),
        }
        match alloc.free(a.ptr) {
            Err(e) if is_unknown_or_double(&e, a.ptr) => {}
            other => panic!("{name}: double free of a pending block: {other:?}"),
        }
        alloc.check_invariants().unwrap();
        sim.complete_all();
        match alloc.record_stream(a.ptr, StreamId(2)) {
            Err(e) if is_unknown_or_double(&e, a.ptr) => {}
            other => panic!("{name}: record_stream on a freed pointer: {other:?}"),
        }
        still_sound(alloc.as_ref(), &sim, "record_stream");
        finish(alloc, &sim);
    }
}

#[test]
fn empty_cache_at_any_time_is_harmless() {
    for (sim, alloc) in allocators_on_sim() {
        alloc.empty_cache().unwrap();
        let a = alloc.allocate(30 * MIB, StreamId(0)).unwrap();
        let b = alloc.allocate(100, StreamId(1)).unwrap();
        alloc.record_stream(a.ptr, StreamId(1)).unwrap();
        alloc.free(a.ptr).unwrap();
        // Pending on stream 1: must not be released under the pending free.
        alloc.empty_cache().unwrap();
        alloc.empty_cache().unwrap();
        still_sound(alloc.as_ref(), &sim, "empty_cache with a pending free");
        alloc.free(b.ptr).unwrap();
        finish(alloc, &sim);
    }
}

/// Dropping an allocator with live blocks, pending frees and cached memory
/// releases every driver resource (simulated and host backends).
#[test]
fn drop_with_live_blocks_releases_everything() {
    for (sim, alloc) in allocators_on_sim() {
        let name = alloc.name().to_string();
        for (i, size) in [100, 5000, 3 * MIB, 30 * MIB, 700 * MIB]
            .into_iter()
            .enumerate()
        {
            let a = alloc.allocate(size, StreamId(i as u64 % 3)).unwrap();
            if i == 2 {
                alloc.record_stream(a.ptr, StreamId(9)).unwrap();
                alloc.free(a.ptr).unwrap(); // pending on stream 9, never completed
            }
        }
        let cached = alloc.allocate(64 * MIB, StreamId(0)).unwrap();
        alloc.free(cached.ptr).unwrap();
        alloc.check_invariants().unwrap();
        drop(alloc);
        let leaks = sim.leak_report();
        assert!(
            leaks.is_empty(),
            "{name}: dropped with live blocks: {leaks}"
        );
    }
    for name in ALLOCATOR_NAMES {
        let host = Arc::new(
            HostVmm::new(HostConfig {
                capacity: 256 * MIB,
                ..HostConfig::default()
            })
            .unwrap(),
        );
        let alloc = match allocators::build(name, host.clone() as Arc<dyn Vmm>) {
            Ok(a) => a,
            Err(RegistryError::Construct { source, .. }) => panic!("{name} on host: {source}"),
            Err(other) => {
                eprintln!("bad_input: {other}: skipped");
                continue;
            }
        };
        let a = alloc.allocate(5 * MIB, StreamId(0)).unwrap();
        host.fill(a.ptr, a.size, 0x5a).unwrap();
        let _b = alloc.allocate(1000, StreamId(1)).unwrap();
        drop(alloc);
        let leaks = host.leak_report();
        assert!(
            leaks.is_empty(),
            "{name} on host: dropped with live blocks: {leaks}"
        );
    }
}

// ------------------------------------------------------------- malformed traces

fn parse_error(text: &str) -> (usize, String) {
    match parse_trace(text) {
        Err(TraceError::Parse { line, message, .. }) => (line, message),
        other => panic!("{text:?}: expected a parse error, got {other:?}"),
    }
}

#[test]
fn malformed_trace_lines_name_their_line() {
    let cases: &[(&str, usize, &str)] = &[
        ("a 0 1 0\na 1 2 3 4\n", 2, "4 fields"),
        ("a 0 1 0\nf\n", 2, "2 fields"),
        ("a 0 1 0\nf 0 0\n", 2, "2 fields"),
        ("a -1 5 0\n", 1, "bad id"),
        ("a 0 5 -1\n", 1, "bad stream"),
        ("a 0 5 18446744073709551616\n", 1, "bad stream"),
        ("a 0 1e9 0\n", 1, "bad size"),
        ("a 0 0x10 0\n", 1, "bad size"),
        ("a 0 +5 0\nf 0\nf x\n", 3, "bad id"),
        ("\n\n   \na 0 5 0\nA 1 5 0\n", 5, "unknown event"),
        ("a 0 5 0\r\nf 1\r\n", 2, "not live"),
        ("f 18446744073709551615\n", 1, "not live"),
        ("ä ö ü\n", 1, "unknown event"),
        ("a\u{0} 0 1 0\n", 1, "unknown event"),
    ];
    for &(text, want_line, want) in cases {
        let (line, message) = parse_error(text);
        assert_eq!(line, want_line, "{text:?}: {message}");
        assert!(
            message.contains(want),
            "{text:?}: `{message}` lacks `{want}`"
        );
    }
    // A long line of multi-byte characters is cut on a character boundary.
    let long = format!("{}\n", "é".repeat(500));
    match parse_trace(&long) {
        Err(TraceError::Parse { text, .. }) => assert_eq!(text.chars().count(), 80),
        other => panic!("{other:?}"),
    }
    // The line number is right deep into a file.
    let mut text = String::new();
    for i in 0..10_000 {
        text.push_str(&format!("a {i} 512 0\n"));
    }
    text.push_str("f 10000\n");
    assert_eq!(parse_error(&text).0, 10_001);
    // Tabs and extra spaces are whitespace; "+5" is a number as Rust reads it.
    assert_eq!(parse_trace("a\t0  5\t 0\n").unwrap().len(), 1);
}

#[test]
fn unreadable_trace_files_are_errors() {
    let dir = std::env::temp_dir().join(format!("quilt-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let binary = dir.join("binary.trace");
    std::fs::write(&binary, [0x61, 0x20, 0xff, 0xfe, 0x00, 0x0a]).unwrap();
    assert!(matches!(load_trace(&binary), Err(TraceError::Io { .. })));
    let empty = dir.join("empty.trace");
    std::fs::write(&empty, "").unwrap();
    assert!(load_trace(&empty).unwrap().events.is_empty());
    assert!(
        matches!(load_trace(&dir), Err(TraceError::Io { .. })),
        "a directory"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A trace that parses but asks for absurd sizes: the replay stops with the
/// allocator's typed error naming the event, for every allocator.
#[test]
fn absurd_sizes_in_a_trace_stop_the_replay_with_the_event() {
    for size in [u64::MAX, MAX_ALLOCATION + 1] {
        let trace = Trace {
            name: "absurd".into(),
            events: parse_trace(&format!("a 0 100 0\nf 0\na 1 {size} 0\n")).unwrap(),
            preexisting: 0,
        };
        for name in ALLOCATOR_NAMES {
            match replay_fresh(&trace, name, CAPACITY, &ReplayConfig::default()) {
                Err(ReplayError::Allocator { event, source, .. }) => {
                    assert_eq!(event, 2, "{name}");
                    assert!(
                        matches!(source, AllocError::InvalidSize { .. }),
                        "{name}: {source}"
                    );
                }
                Err(ReplayError::Registry(e)) => eprintln!("bad_input: {e}: skipped"),
                other => panic!("{name}: size {size:#x}: {other:?}"),
            }
        }
    }
    // Larger than the device but valid: an OOM ends the replay, not an error.
    let trace = Trace {
        name: "too big".into(),
        events: parse_trace(&format!("a 0 {} 0\n", CAPACITY * 4)).unwrap(),
        preexisting: 0,
    };
    for name in ALLOCATOR_NAMES {
        match replay_fresh(&trace, name, CAPACITY, &ReplayConfig::default()) {
            Ok(r) => assert!(!r.completed && r.ooms == 1, "{name}: {r:?}"),
            Err(ReplayError::Registry(e)) => eprintln!("bad_input: {e}: skipped"),
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

// ------------------------------------------------------- malformed snapshots

fn entry(action: &str, addr: i64, size: i64) -> Value {
    dict(vec![
        ("action", Value::String(action.into())),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(0)),
    ])
}

fn to_pickle(top: &Value) -> Vec<u8> {
    serde_pickle::value_to_vec(top, SerOptions::new()).unwrap()
}

fn snapshot_error(bytes: &[u8]) -> String {
    match import_snapshot(bytes, "bad", 0) {
        Err(TraceError::Snapshot(m)) => m,
        other => panic!("expected a snapshot error, got {other:?}"),
    }
}

const SEG: i64 = 0x4000_0000;

fn good_snapshot() -> Value {
    let block = |addr: i64, state: &str| {
        dict(vec![
            ("address", Value::I64(addr)),
            ("size", Value::I64(4096)),
            ("requested_size", Value::I64(4000)),
            ("state", Value::String(state.into())),
        ])
    };
    dict(vec![
        (
            "segments",
            Value::List(vec![dict(vec![
                ("device", Value::I64(0)),
                ("address", Value::I64(SEG)),
                ("total_size", Value::I64(2 << 20)),
                ("stream", Value::I64(0)),
                (
                    "blocks",
                    Value::List(vec![
                        block(SEG, "active_allocated"),
                        block(SEG + 4096, "inactive"),
                    ]),
                ),
            ])]),
        ),
        (
            "device_traces",
            Value::List(vec![Value::List(vec![
                entry("alloc", SEG + 8192, 100),
                entry("free_requested", SEG + 8192, 100),
                entry("free_completed", SEG + 8192, 100),
                entry("alloc", SEG + 8192, 200),
            ])]),
        ),
    ])
}

#[test]
fn malformed_segments_name_the_segment_or_block() {
    let good = to_pickle(&good_snapshot());
    let t = import_snapshot(&good, "good", 0).unwrap();
    assert_eq!(t.preexisting, 1);
    assert_eq!(t.events.len(), 4);

    let with_segments = |segments: Value| {
        let mut top = good_snapshot();
        if let Value::Dict(d) = &mut top {
            d.insert(s("segments"), segments);
        }
        to_pickle(&top)
    };
    let seg = |fields: Vec<(&str, Value)>| {
        let mut base = vec![
            ("device", Value::I64(0)),
            ("address", Value::I64(SEG)),
            ("total_size", Value::I64(2 << 20)),
        ];
        for (k, v) in fields {
            base.retain(|(bk, _)| *bk != k);
            base.push((k, v));
        }
        Value::List(vec![dict(base)])
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (with_segments(Value::I64(3)), "segments: expected a list"),
        (
            with_segments(Value::List(vec![Value::None])),
            "segments[0]: expected a dict",
        ),
        (
            with_segments(seg(vec![("address", Value::String("x".into()))])),
            "segments[0]: field `address` should be an integer",
        ),
        (
            with_segments(seg(vec![("address", Value::I64(-1))])),
            "segments[0]: field `address` is negative",
        ),
        (
            with_segments(seg(vec![("blocks", Value::Dict(BTreeMap::new()))])),
            "segments[0].blocks: expected a list",
        ),
        (
            with_segments(seg(vec![("blocks", Value::List(vec![Value::F64(1.0)]))])),
            "segments[0].blocks[0]: expected a dict",
        ),
        (
            with_segments(seg(vec![(
                "blocks",
                Value::List(vec![dict(vec![("state", Value::I64(1))])]),
            )])),
            "segments[0].blocks[0]: field `state` should be a string",
        ),
        (
            with_segments(seg(vec![(
                "blocks",
                Value::List(vec![dict(vec![
                    ("state", Value::String("active_allocated".into())),
                    ("address", Value::I64(SEG)),
                    ("size", Value::I64(0)),
                ])]),
            )])),
            "segments[0].blocks[0]: absurd",
        ),
        (
            with_segments(seg(vec![(
                "blocks",
                Value::List(vec![dict(vec![
                    ("state", Value::String("active_allocated".into())),
                    ("address", Value::I64(SEG)),
                ])]),
            )])),
            "segments[0].blocks[0]: missing field `size`",
        ),
        (
            with_segments(seg(vec![("total_size", Value::Bool(true))])),
            "segments[0]: field `total_size` should be an integer",
        ),
    ];
    for (bytes, want) in cases {
        match import_snapshot(&bytes, "bad", 0) {
            Err(TraceError::Snapshot(m)) => assert!(m.contains(want), "`{m}` lacks `{want}`"),
            other => panic!("expected an error with `{want}`, got {other:?}"),
        }
    }
}

#[test]
fn malformed_trace_entries_name_the_entry() {
    let with_entries = |entries: Vec<Value>| {
        to_pickle(&dict(vec![
            ("segments", Value::List(vec![])),
            ("device_traces", Value::List(vec![Value::List(entries)])),
        ]))
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            with_entries(vec![dict(vec![("addr", Value::I64(1))])]),
            "device_traces[0][0]: missing field `action`",
        ),
        (
            with_entries(vec![dict(vec![(
                "action",
                Value::Bytes(b"alloc".to_vec()),
            )])]),
            "device_traces[0][0]: field `action` should be a string",
        ),
        (
            with_entries(vec![dict(vec![
                ("action", Value::String("alloc".into())),
                ("addr", Value::List(vec![])),
                ("size", Value::I64(4)),
            ])]),
            "device_traces[0][0] (alloc): field `addr` should be an integer",
        ),
        (
            with_entries(vec![dict(vec![
                ("action", Value::String("alloc".into())),
                ("addr", Value::I64(64)),
                ("size", Value::I64(4)),
                ("stream", Value::F64(0.5)),
            ])]),
            "device_traces[0][0] (alloc): field `stream` should be an integer",
        ),
        (
            with_entries(vec![
                entry("alloc", 64, 4),
                entry("segment_alloc", 0, i64::MAX),
                entry("free_completed", 1 << 40, 4),
                entry("free_completed", 1 << 40, 4),
            ]),
            "device_traces[0][3] (free_completed): second free",
        ),
        (
            with_entries(vec![entry("alloc", 64, 4), entry("free_completed", 128, 4)]),
            "device_traces[0][1] (free_completed): free of unknown address 0x80",
        ),
        (
            with_entries(vec![entry("alloc", 64, i64::MAX)]),
            "device_traces[0][0] (alloc): absurd",
        ),
    ];
    for (bytes, want) in cases {
        let m = snapshot_error(&bytes);
        assert!(m.contains(want), "`{m}` lacks `{want}`");
    }
    // Unknown actions are ignored, whatever their fields.
    let ok = with_entries(vec![
        dict(vec![
            ("action", Value::String("oom".into())),
            ("addr", Value::None),
        ]),
        entry("alloc", 64, 4),
    ]);
    assert_eq!(import_snapshot(&ok, "ok", 0).unwrap().events.len(), 1);
    // device_traces that is not a list of lists.
    for traces in [
        Value::Dict(BTreeMap::new()),
        Value::List(vec![Value::I64(0)]),
        Value::List(vec![Value::String("x".into())]),
    ] {
        let bytes = to_pickle(&dict(vec![("device_traces", traces)]));
        let m = snapshot_error(&bytes);
        assert!(m.contains("device_traces"), "{m}");
    }
}

/// Every truncation and a byte flip at every position of a small valid pickle:
/// an error or a trace, never a panic; the traces that come out are
/// consistent (every free names a live id).
#[test]
fn truncated_and_flipped_pickles_never_panic() {
    let good = to_pickle(&good_snapshot());
    let mut errors = 0;
    let mut ok = 0;
    let mut check = |bytes: &[u8]| match import_snapshot(bytes, "mutant", 0) {
        Ok(t) => {
            ok += 1;
            let mut live = std::collections::HashSet::new();
            for e in &t.events {
                match *e {
                    quilt_bench::trace::Event::Alloc { id, size, .. } => {
                        assert!(size > 0 && size <= MAX_ALLOCATION);
                        assert!(live.insert(id), "id {id} reused");
                    }
                    quilt_bench::trace::Event::Free { id } => {
                        assert!(live.remove(&id), "free of {id}, not live")
                    }
                    other => panic!("a snapshot gave a serving event: {other:?}"),
                }
            }
        }
        Err(TraceError::Snapshot(_)) => errors += 1,
        Err(e) => panic!("unexpected error kind: {e:?}"),
    };
    for cut in 0..good.len() {
        check(&good[..cut]);
    }
    for i in 0..good.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut m = good.clone();
            m[i] ^= flip;
            check(&m);
        }
    }
    eprintln!("bad_input: pickle mutants: {ok} imported, {errors} typed errors");
    assert!(errors > 0);
}

/// A pickle of lists nested `depth` deep (EMPTY_LIST x depth, APPEND x depth-1).
fn nested_lists_pickle(depth: usize) -> Vec<u8> {
    let mut bytes = vec![0x80, 0x02];
    bytes.extend(std::iter::repeat_n(b']', depth));
    bytes.extend(std::iter::repeat_n(b'a', depth - 1));
    bytes.push(b'.');
    bytes
}

#[test]
fn moderately_nested_pickles_are_typed_errors() {
    let m = snapshot_error(&nested_lists_pickle(1000));
    assert!(m.contains("top-level"), "{m}");
}

/// A pickle whose frozenset holds a NaN among other items (found by
/// `fuzz/snapshot_import`, bug B1, fixed in `3184bab`): `serde-pickle` 1.2
/// collects the set into a
/// `BTreeSet<HashableValue>`, sorting with an order that NaN breaks, and
/// Rust's sort panics on such an order ("user-provided comparison function
/// does not correctly implement a total order"). The importer must turn that into a
/// typed error, not a panic.
#[test]
fn a_set_of_nans_in_a_pickle_is_a_typed_error() {
    // 60 bytes, minimised by libFuzzer: MARK, a string, small ints, bytes, a
    // NaN (BINFLOAT ff ff ff 94 ...), MEMOIZE, FROZENSET, STOP.
    let bytes: [u8; 60] = [
        0x28, 0x8c, 0x08, 0x71, 0x73, 0x01, 0x00, 0x03, 0x00, 0x00, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b,
        0x4b, 0x4b, 0x4b, 0x43, 0x47, 0xff, 0xff, 0xff, 0x94, 0x94, 0x94, 0x94, 0x94, 0x4b, 0x4b,
        0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x43, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b,
        0x4b, 0x4b, 0x4b, 0x4b, 0x43, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x4b, 0x94, 0x91, 0x2e,
    ];
    let outcome = std::panic::catch_unwind(|| import_snapshot(&bytes, "nan-set", 0));
    match outcome {
        Ok(Err(TraceError::Snapshot(_))) => {}
        Ok(other) => panic!("expected a snapshot error, got {other:?}"),
        Err(_) => panic!("import_snapshot panicked on a pickle holding a set of NaNs"),
    }
}

/// Lists nested 20 000 deep (a 40 KB pickle; `DEPTH=n` to change it).
/// `serde-pickle` recurses once per level: before `3184bab` the importer
/// overflowed a test thread's 2 MiB stack at 2000 levels and aborted the
/// process (bug B3 of docs/reliability.md); it now decodes on a thread with a
/// large stack.
#[test]
fn deeply_nested_pickles_do_not_overflow_the_stack() {
    let depth = std::env::var("DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(20_000);
    let m = snapshot_error(&nested_lists_pickle(depth));
    assert!(m.contains("top-level"), "{m}");
}

/// The out-of-memory report of `alloc.allocate(size)`, which must fail so.
fn oom_report(alloc: &dyn DeviceAllocator, size: u64) -> quilt_alloc::OomReport {
    match alloc.allocate(size, StreamId(0)) {
        Err(e @ AllocError::OutOfMemory(_)) => {
            // The allocator names itself once, at the start.
            let text = e.to_string();
            assert!(
                text.starts_with(&format!("{}: out of memory", alloc.name())),
                "{text}"
            );
            assert_eq!(text.matches(alloc.name()).count(), 1, "{text}");
            e.oom_report().unwrap().clone()
        }
        other => panic!("{}: allocate({size}): {other:?}", alloc.name()),
    }
}

#[test]
fn oom_reports_give_the_figures_their_fields_document() {
    const DEVICE: u64 = 64 * MIB;
    for name in ALLOCATOR_NAMES {
        let sim = Arc::new(SimVmm::with_capacity(DEVICE).unwrap());
        let alloc = allocators::build(name, sim.clone()).unwrap();
        let alloc = alloc.as_ref();
        // Larger than the empty device: the whole device is still free.
        let r = oom_report(alloc, 100 * MIB);
        assert_eq!(r.verdict, OomVerdict::Capacity, "{name}: {r}");
        assert_eq!(r.requested, 100 * MIB, "{name}: {r}");
        assert_eq!(r.needed, 100 * MIB, "{name}: {r}");
        assert_eq!(r.needed_unbacked, 100 * MIB, "{name}: {r}");
        assert_eq!(r.capacity, DEVICE, "{name}: {r}");
        assert_eq!(r.device_free, DEVICE, "{name}: {r}");
        assert_eq!(
            (r.reserved, r.allocated, r.reclaimable),
            (0, 0, 0),
            "{name}: {r}"
        );
        // An odd size: the request rounded, as the allocator rounds it.
        let odd = 65 * MIB + 1;
        let r = oom_report(alloc, odd);
        assert_eq!(r.requested, odd, "{name}: {r}");
        assert!(
            r.needed >= odd && r.needed.is_multiple_of(512),
            "{name}: {r}"
        );
        assert!(
            r.needed_unbacked >= r.needed.min(r.needed_unbacked),
            "{name}: {r}"
        );
        if name == "quilt" || name == "gmlake" {
            // Whole 2 MiB pages: 65 MiB + 512 B takes 33 of them.
            assert_eq!(r.needed, 66 * MIB, "{name}: {r}");
            assert_eq!(r.needed_unbacked, 66 * MIB, "{name}: {r}");
        }
        // 40 MiB live, then 30 MiB: 24 MiB free on the device, nothing cached.
        let live = alloc.allocate(40 * MIB, StreamId(0)).unwrap();
        let r = oom_report(alloc, 30 * MIB);
        assert_eq!(r.verdict, OomVerdict::Capacity, "{name}: {r}");
        assert_eq!(r.needed, 30 * MIB, "{name}: {r}");
        assert_eq!(r.needed_unbacked, 30 * MIB, "{name}: {r}");
        assert_eq!(r.allocated, 40 * MIB, "{name}: {r}");
        assert_eq!(r.device_free, DEVICE - r.reserved, "{name}: {r}");
        assert!(
            r.reclaimable + r.device_free < r.needed_unbacked,
            "{name}: {r}"
        );
        alloc.free(live.ptr).unwrap();
        alloc.check_invariants().unwrap();
        sim.check_invariants().unwrap();
    }
}
