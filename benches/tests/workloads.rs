//! Built-in workload generators: deterministic for a seed, different across
//! seeds, valid traces of the advertised scale.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::HashSet;

use quilt_bench::live::trace_stats;
use quilt_bench::trace::{Event, Trace};
use quilt_bench::workloads::{find, WORKLOADS};

const GIB: u64 = 1 << 30;

/// Every free names a live id, ids are never reused, the pre-existing
/// prefix frees nothing, and the serving events (growable buffers, tags)
/// are consistent (the parser checks them).
fn assert_valid(trace: &Trace) {
    let mut live = HashSet::new();
    let mut seen = HashSet::new();
    for (i, e) in trace.events.iter().enumerate() {
        match *e {
            Event::Alloc { id, size, .. } | Event::AllocTagged { id, size, .. } => {
                assert!(size > 0, "{}: event {i} allocates 0 bytes", trace.name);
                assert!(seen.insert(id), "{}: id {id} reused", trace.name);
                live.insert(id);
            }
            Event::Free { id } => {
                assert!(i >= trace.preexisting, "{}: free in the prefix", trace.name);
                assert!(live.remove(&id), "{}: free of dead id {id}", trace.name);
            }
            _ => {}
        }
    }
    quilt_bench::trace::parse_trace(&quilt_bench::trace::to_text(&trace.events))
        .unwrap_or_else(|e| panic!("{}: {e}", trace.name));
}

#[test]
fn generators_are_deterministic_for_a_seed() {
    for w in WORKLOADS {
        let a = (w.generate)(7);
        let b = (w.generate)(7);
        assert_eq!(a, b, "{} differs for one seed", w.name);
        let c = (w.generate)(8);
        assert_ne!(a.events, c.events, "{} ignores its seed", w.name);
        assert_eq!(a.name, w.name);
    }
}

#[test]
fn generators_emit_valid_traces_of_the_advertised_scale() {
    for w in WORKLOADS {
        for seed in [1, 42] {
            let trace = (w.generate)(seed);
            assert_valid(&trace);
            let s = trace_stats(&trace);
            // Sized for an 80 GiB device and a 2-minute A/B on 2 cores.
            assert!(
                (5_000..=20_000).contains(&s.events),
                "{} seed {seed}: {} events",
                w.name,
                s.events
            );
            assert!(
                (10 * GIB..=70 * GIB).contains(&s.peak_live_bytes),
                "{} seed {seed}: peak live {} bytes",
                w.name,
                s.peak_live_bytes
            );
            assert!(s.ideal_bytes >= s.peak_live_bytes);
            assert!(s.distinct_sizes > 10, "{}: too few sizes", w.name);
        }
    }
}

#[test]
fn mixed_workload_uses_several_streams_and_others_keep_weights_live() {
    let mixed = (find("mixed-vision-language").unwrap().generate)(3);
    assert!(trace_stats(&mixed).streams >= 2);
    for name in ["train-varlen", "llm-serving", "mixed-vision-language"] {
        let t = (find(name).unwrap().generate)(3);
        assert!(t.preexisting > 100, "{name}: weights are not pre-existing");
    }
    assert!(find("no-such-workload").is_none());
}
