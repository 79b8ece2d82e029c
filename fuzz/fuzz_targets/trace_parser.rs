//! Fuzz the text trace parser: any bytes give events or an error naming a line,
//! never a panic; accepted traces are consistent.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use quilt_bench::trace::{parse_trace, Event, TraceError};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_trace(text) {
        Ok(events) => {
            let mut seen = HashSet::new();
            let mut live = HashSet::new();
            for e in events {
                match e {
                    Event::Alloc { id, size, .. } => {
                        assert!(size > 0, "accepted a zero size");
                        assert!(seen.insert(id), "accepted a reused id {id}");
                        live.insert(id);
                    }
                    Event::Free { id } => assert!(live.remove(&id), "accepted a free of {id}"),
                }
            }
        }
        Err(TraceError::Parse {
            line, text: shown, ..
        }) => {
            assert!(
                line >= 1 && line <= text.lines().count(),
                "line {line} out of range"
            );
            assert!(shown.chars().count() <= 80);
        }
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
});
