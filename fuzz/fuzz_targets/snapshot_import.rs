//! Fuzz the PyTorch snapshot importer: any bytes give a trace or a typed
//! `TraceError::Snapshot`, never a panic; imported traces are consistent.
//!
//! The importer decodes on its own thread and turns a panic of `serde-pickle`
//! into a typed error. libFuzzer's panic hook aborts at any panic, even one
//! that is caught, so this target puts the default hook back: a panic the
//! importer catches is then what it is, and one that escapes it is still
//! caught by `fuzz_target!` and reported as a crash.
#![no_main]

use std::collections::HashSet;
use std::sync::Once;

use libfuzzer_sys::fuzz_target;
use quilt_alloc::MAX_ALLOCATION;
use quilt_bench::snapshot::import_snapshot;
use quilt_bench::trace::{Event, TraceError};

static DEFAULT_HOOK: Once = Once::new();

fuzz_target!(|data: &[u8]| {
    DEFAULT_HOOK.call_once(|| {
        let _ = std::panic::take_hook();
    });
    match import_snapshot(data, "fuzz", 0) {
        Ok(trace) => {
            assert!(trace.preexisting <= trace.events.len());
            let mut live = HashSet::new();
            for (i, e) in trace.events.iter().enumerate() {
                match *e {
                    Event::Alloc { id, size, .. } => {
                        assert!(size > 0 && size <= MAX_ALLOCATION, "event {i}: size {size}");
                        assert!(live.insert(id), "event {i}: id {id} reused");
                    }
                    Event::Free { id } => {
                        assert!(i >= trace.preexisting, "a free among the pre-existing");
                        assert!(live.remove(&id), "event {i}: free of {id}, not live");
                    }
                }
            }
        }
        Err(TraceError::Snapshot(_)) => {}
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
});
