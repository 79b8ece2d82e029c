//! Fuzz the PyTorch snapshot importer: any bytes give a trace or a typed
//! `TraceError::Snapshot`, never a panic; imported traces are consistent.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use quilt_alloc::MAX_ALLOCATION;
use quilt_bench::snapshot::import_snapshot;
use quilt_bench::trace::{Event, TraceError};

fuzz_target!(|data: &[u8]| {
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
