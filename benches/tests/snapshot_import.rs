//! Snapshot import: equality with the converted real trace, and typed errors on
//! malformed pickles.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;

use common::{dict, s};
use quilt_bench::snapshot_import::{import_snapshot, load_snapshot};
use quilt_bench::trace::{load_trace, Event, TraceError};
use serde_pickle::{SerOptions, Value};

fn traces_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces"))
}

#[test]
#[cfg_attr(
    not(has_shared_snapshot),
    ignore = "needs ../shared/traces/raw/opt_zo_fedlearn_finetune.pickle (absent when built)"
)]
fn real_snapshot_matches_converted_trace() {
    let pickle = traces_dir().join("raw/opt_zo_fedlearn_finetune.pickle");
    let converted = traces_dir().join("converted/opt_zo_fedlearn_finetune.trace");
    let imported = load_snapshot(&pickle).unwrap();
    let expected = load_trace(&converted).unwrap();
    assert_eq!(imported.name, "opt_zo_fedlearn_finetune");
    assert_eq!(imported.events.len(), expected.events.len());
    // Ids are assigned in order of allocation on both sides, so the sequences
    // must be equal as they stand.
    for (i, (a, b)) in imported.events.iter().zip(&expected.events).enumerate() {
        assert_eq!(a, b, "event {i} differs");
    }
    // stats.json says this trace has no pre-existing allocations.
    assert_eq!(imported.preexisting, 0);
}

fn entry(action: &str, addr: i64, size: i64, stream: i64) -> Value {
    dict(vec![
        ("action", Value::String(action.into())),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(stream)),
        ("time_us", Value::I64(0)),
    ])
}

fn segment(address: i64, total: i64, stream: i64, blocks: Vec<(i64, i64, &str)>) -> Value {
    dict(vec![
        ("device", Value::I64(0)),
        ("address", Value::I64(address)),
        ("total_size", Value::I64(total)),
        ("stream", Value::I64(stream)),
        (
            "blocks",
            Value::List(
                blocks
                    .into_iter()
                    .map(|(a, size, state)| {
                        dict(vec![
                            ("address", Value::I64(a)),
                            ("size", Value::I64(size)),
                            ("requested_size", Value::I64(size - 10)),
                            ("state", Value::String(state.into())),
                        ])
                    })
                    .collect(),
            ),
        ),
    ])
}

fn pickle(segments: Vec<Value>, entries: Vec<Value>) -> Vec<u8> {
    let top = dict(vec![
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(vec![Value::List(entries)])),
    ]);
    serde_pickle::value_to_vec(&top, SerOptions::new()).unwrap()
}

#[test]
fn preexisting_blocks_come_first_by_address() {
    let seg = 0x1000_0000;
    let bytes = pickle(
        vec![segment(
            seg,
            1 << 22,
            7,
            vec![
                (seg, 1 << 20, "active_allocated"), // before the window, never freed
                (seg + (1 << 20), 1 << 20, "inactive"), // freed in the window
                (seg + (2 << 20), 1 << 20, "active_allocated"), // allocated in the window
            ],
        )],
        vec![
            entry("free_requested", seg + (1 << 20), 500, 7),
            entry("free_completed", seg + (1 << 20), 500, 7),
            entry("alloc", seg + (2 << 20), 600, 7),
            entry("alloc", seg + (3 << 20), 700, 0),
            entry("free_completed", seg + (3 << 20), 700, 0),
        ],
    );
    let trace = import_snapshot(&bytes, "t", 0).unwrap();
    assert_eq!(trace.preexisting, 2);
    assert_eq!(
        trace.events,
        vec![
            // The never-freed block: its requested size, its segment's stream (7 -> 1).
            Event::Alloc {
                id: 0,
                size: (1 << 20) - 10,
                stream: 1
            },
            // The block freed in the window: the free's size.
            Event::Alloc {
                id: 1,
                size: 500,
                stream: 1
            },
            Event::Free { id: 1 },
            Event::Alloc {
                id: 2,
                size: 600,
                stream: 1
            },
            Event::Alloc {
                id: 3,
                size: 700,
                stream: 0
            },
            Event::Free { id: 3 },
        ]
    );
}

fn expect_snapshot_error(bytes: &[u8], needle: &str) {
    match import_snapshot(bytes, "bad", 0) {
        Err(TraceError::Snapshot(message)) => {
            assert!(
                message.contains(needle),
                "message `{message}` lacks `{needle}`"
            )
        }
        other => panic!("expected a snapshot error containing `{needle}`, got {other:?}"),
    }
}

#[test]
fn malformed_pickles_are_typed_errors() {
    let seg = 0x2000_0000;
    let good = pickle(
        vec![segment(seg, 1 << 21, 0, vec![])],
        vec![
            entry("alloc", seg, 100, 0),
            entry("free_completed", seg, 100, 0),
        ],
    );
    assert!(import_snapshot(&good, "good", 0).is_ok());

    // Truncated at every length: never a panic, always a typed error.
    for cut in [0, 1, 2, good.len() / 3, good.len() / 2, good.len() - 1] {
        match import_snapshot(&good[..cut], "cut", 0) {
            Err(TraceError::Snapshot(_)) => {}
            other => panic!("truncated at {cut}: {other:?}"),
        }
    }
    expect_snapshot_error(b"not a pickle at all", "pickle");

    // Wrong types.
    let top_list = serde_pickle::value_to_vec(&Value::List(vec![]), SerOptions::new()).unwrap();
    expect_snapshot_error(&top_list, "top-level");
    let mut bad_size = match entry("alloc", seg, 100, 0) {
        Value::Dict(d) => d,
        _ => unreachable!(),
    };
    bad_size.insert(s("size"), Value::String("big".into()));
    expect_snapshot_error(
        &pickle(vec![], vec![Value::Dict(bad_size)]),
        "device_traces[0][0] (alloc): field `size` should be an integer",
    );
    expect_snapshot_error(
        &pickle(vec![], vec![Value::I64(3)]),
        "device_traces[0][0]: expected a dict",
    );
    let no_traces = serde_pickle::value_to_vec(
        &dict(vec![("segments", Value::List(vec![]))]),
        SerOptions::new(),
    )
    .unwrap();
    expect_snapshot_error(&no_traces, "device_traces");

    // A free of an address no allocation and no segment knows.
    expect_snapshot_error(
        &pickle(vec![], vec![entry("free_completed", 0x9999_0000, 10, 0)]),
        "device_traces[0][0] (free_completed): free of unknown address 0x99990000",
    );
    // Two frees of one pre-existing address.
    expect_snapshot_error(
        &pickle(
            vec![segment(seg, 1 << 21, 0, vec![])],
            vec![
                entry("free_completed", seg, 10, 0),
                entry("free_completed", seg, 10, 0),
            ],
        ),
        "device_traces[0][1] (free_completed): second free",
    );
    // Absurd sizes.
    expect_snapshot_error(
        &pickle(vec![], vec![entry("alloc", seg, 0, 0)]),
        "device_traces[0][0] (alloc): absurd",
    );
    expect_snapshot_error(
        &pickle(vec![], vec![entry("alloc", seg, 1 << 50, 0)]),
        "device_traces[0][0] (alloc): absurd",
    );
    expect_snapshot_error(
        &pickle(vec![], vec![entry("alloc", seg, -5, 0)]),
        "negative",
    );
    // An alloc at a live address.
    expect_snapshot_error(
        &pickle(
            vec![],
            vec![entry("alloc", seg, 10, 0), entry("alloc", seg, 10, 0)],
        ),
        "device_traces[0][1] (alloc): alloc at 0x20000000, which is already live",
    );
    // A device that is not there.
    assert!(matches!(
        import_snapshot(&good, "good", 3),
        Err(TraceError::Snapshot(_))
    ));
}

#[test]
fn missing_file_is_an_io_error() {
    let missing = std::env::temp_dir().join("quilt-bench-no-such-snapshot.pickle");
    assert!(matches!(
        load_snapshot(&missing),
        Err(TraceError::Io { .. })
    ));
}
