//! The serving events (growable buffers, tagged allocations, sleep and wake)
//! in traces and replays: the `llm-serving-growable` workloads on every
//! allocator, Quilt natively and the baselines emulated (reallocation and
//! copy), the live-bytes accounting of the emulation, the text format's
//! round trip, and bad events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
use quilt_alloc::DeviceAllocator;
use quilt_bench::allocators::{self, ALLOCATOR_NAMES};
use quilt_bench::live::trace_stats;
use quilt_bench::replay::{replay, replay_fresh, replay_fresh_then, ReplayConfig, ReplayError};
use quilt_bench::report::rows::Measurement;
use quilt_bench::trace::{parse_trace, to_text, Event, Trace, TraceError};
use quilt_bench::workloads::find;
use quilt_vmm::sim::{CostModel, SimVmm};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn trace(text: &str, preexisting: usize) -> Trace {
    Trace {
        name: "handmade".into(),
        events: parse_trace(text).unwrap(),
        preexisting,
    }
}

fn checked(iterations: u32) -> ReplayConfig {
    ReplayConfig {
        iterations,
        check_every: Some(997),
        ..ReplayConfig::default()
    }
}

/// Every allocator completes both workloads at 80 GiB with its invariants
/// held; Quilt copies nothing for growth, every baseline (gmlake included:
/// GMLake has no growable buffers) copies, and the rows carry the copies.
#[test]
fn growable_workloads_replay_on_every_allocator_and_only_the_baselines_copy() {
    for (name, iterations) in [
        ("llm-serving-growable", 1),
        ("llm-serving-growable-switch", 2),
    ] {
        let t = (find(name).unwrap().generate)(42);
        let stats = trace_stats(&t);
        for allocator in ALLOCATOR_NAMES {
            let config = checked(iterations);
            let r = replay_fresh(&t, allocator, 80 * GIB, &config)
                .unwrap_or_else(|e| panic!("{name} / {allocator}: {e}"));
            assert!(r.completed, "{name} / {allocator}: {:?}", r.oom_message);
            assert_eq!(
                r.peak_live_bytes, stats.peak_live_bytes,
                "{name} / {allocator}"
            );
            let row = Measurement::new(name, allocator, 80 * GIB, iterations, r.clone(), None).row;
            assert_eq!(row.growth_copied_bytes, r.growth_copies.bytes);
            assert_eq!(
                row.copied_bytes,
                r.driver.copied_bytes + r.growth_copies.bytes
            );
            if allocator == "quilt" {
                assert_eq!(
                    r.growth_copies,
                    Default::default(),
                    "{name}: quilt copied for growth"
                );
            } else {
                assert!(
                    r.growth_copies.bytes > 0,
                    "{name} / {allocator}: no growth copy"
                );
                assert!(r.growth_copies.copies > 0);
                // Charged on top of the driver's time.
                assert!(row.modelled_driver_us * 1000.0 > r.driver.modelled_ns as f64);
            }
            if name.ends_with("switch") {
                // Weights went to the host and back, on every allocator.
                assert!(r.driver.copied_bytes > 10 * GIB, "{name} / {allocator}");
                assert!(r.driver_after_first_iteration.copied_bytes > 0);
            } else {
                assert_eq!(
                    r.driver.copied_bytes, 0,
                    "{name} / {allocator}: no sleep here"
                );
            }
        }
    }
}

/// Emulated growth on a baseline: the live bytes follow the buffer's
/// length, the copy moves the old length and is charged with the cost
/// model's copy figures; Quilt's growth copies nothing. Both agree with the
/// trace's own figures.
#[test]
fn growable_emulation_keeps_the_live_bytes_and_counts_each_copy() {
    let t = trace(
        &format!(
            "a 0 {} 0\nc 1 {} 0\ng 1 {}\ng 1 {}\ng 1 {}\ns 1 {}\nf 0\nr 1\n",
            3 * MIB,
            64 * MIB,
            10 * MIB,
            30 * MIB,
            30 * MIB, // equal to the length: nothing to do
            5 * MIB,
        ),
        0,
    );
    let stats = trace_stats(&t);
    assert_eq!(stats.peak_live_bytes, 33 * MIB);
    for allocator in ["quilt", "classic", "expandable", "gmlake", "offset"] {
        let (r, ()) = replay_fresh_then(&t, allocator, 8 * GIB, &checked(1), |a| {
            a.check_invariants().unwrap();
            // Nothing left live.
            assert_eq!(a.stats().allocated_bytes.current, 0, "{allocator}");
        })
        .unwrap();
        assert!(r.completed);
        assert_eq!(r.peak_live_bytes, 33 * MIB, "{allocator}");
        if allocator == "quilt" {
            assert_eq!(r.growth_copies.bytes, 0);
            // Two grows (the third asks for the length it has).
            assert_eq!(r.serving_stats.map(|s| s.grows), Some(2));
        } else {
            assert_eq!(r.serving_stats, None, "{allocator}");
            // 10 MiB into the 30 MiB block, then 5 MiB into the shrunk one.
            assert_eq!(r.growth_copies.copies, 2, "{allocator}");
            assert_eq!(r.growth_copies.bytes, 15 * MIB, "{allocator}");
            let cost = CostModel::default();
            let want =
                2 * cost.copy_ns + cost.copy_bytes_ns(10 * MIB) + cost.copy_bytes_ns(5 * MIB);
            assert_eq!(r.growth_copies.modelled_ns, want, "{allocator}");
        }
    }
}

/// Sleep and wake on a baseline: the tag's bytes go to the host and back
/// (counted by the device), are not live while asleep, and their memory
/// serves another allocation meanwhile; Quilt does the same natively.
#[test]
fn sleep_wake_emulation_copies_the_tagged_bytes_both_ways() {
    let size = 100 * MIB;
    let t = trace(
        &format!("t 0 {size} 0 7\nz 7\na 1 {size} 0\nf 1\nw 7\nf 0\n"),
        0,
    );
    assert_eq!(trace_stats(&t).peak_live_bytes, size);
    for allocator in ALLOCATOR_NAMES {
        // A device with room for the tag's bytes once, and some slack.
        let r = replay_fresh(&t, allocator, size + 40 * MIB, &checked(1))
            .unwrap_or_else(|e| panic!("{allocator}: {e}"));
        assert!(r.completed, "{allocator}: {:?}", r.oom_message);
        assert_eq!(r.peak_live_bytes, size, "{allocator}");
        assert_eq!(r.driver.copied_bytes, 2 * size, "{allocator}");
        assert_eq!(r.growth_copies.bytes, 0);
    }
}

/// A trace with every new event kind survives the text format, and so do
/// both generated workloads.
#[test]
fn growable_traces_round_trip_through_the_parser() {
    let text = "a 0 100 0\nt 1 4096 1 3\nc 2 1048576 0\ng 2 4096\ng 2 8192\ns 2 100\n\
                z 3\nw 3\nr 2\nf 1\nf 0\n";
    let events = parse_trace(text).unwrap();
    assert_eq!(to_text(&events), text);
    assert!(events.iter().any(|e| matches!(e, Event::Sleep { tag: 3 })));
    assert_eq!(events.iter().filter(|e| e.is_serving()).count(), 8);
    for name in ["llm-serving-growable", "llm-serving-growable-switch"] {
        let t = (find(name).unwrap().generate)(5);
        assert!(t.events.iter().any(|e| matches!(e, Event::Grow { .. })));
        assert_eq!(
            parse_trace(&to_text(&t.events)).unwrap(),
            t.events,
            "{name}"
        );
    }
}

/// Bad serving events: the parser names the line; a replay of an
/// inconsistent trace (built without the parser) names the event and
/// leaves the allocator consistent.
#[test]
fn bad_growable_events_give_typed_errors_naming_the_line() {
    for (text, want_line, want) in [
        ("c 0 100 0\ng 1 50\n", 2, "not a live growable"),
        ("c 0 100 0\ng 0 50\ng 0 200\n", 3, "beyond its maximum"),
        ("a 0 10 0\ng 0 5\n", 2, "not a live growable"),
        ("c 0 100 0\nr 0\ng 0 5\n", 3, "not a live growable"),
        ("t 0 10 0 1\nw 1\n", 2, "is awake"),
    ] {
        match parse_trace(text) {
            Err(TraceError::Parse { line, message, .. }) => {
                assert_eq!(line, want_line, "{text:?}");
                assert!(message.contains(want), "{text:?}: {message}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    let bad = [
        vec![Event::Grow { id: 9, bytes: 10 }],
        vec![
            Event::CreateGrowable {
                id: 0,
                max: 4 * MIB,
                stream: 0,
            },
            Event::Grow {
                id: 0,
                bytes: 8 * MIB,
            },
        ],
        vec![Event::Sleep { tag: 1 }],
    ];
    for events in bad {
        let n = events.len() - 1;
        let t = Trace {
            name: "bad".into(),
            events,
            preexisting: 0,
        };
        for allocator in ["quilt", "classic"] {
            match replay_fresh(&t, allocator, GIB, &ReplayConfig::default()) {
                Err(ReplayError::BadTrace { event, .. }) => assert_eq!(event, n),
                other => panic!("{allocator}: {other:?}"),
            }
        }
    }
}

/// A growth the device cannot back ends the replay as an out-of-memory,
/// with the allocator's report, on Quilt and on an emulating baseline.
#[test]
fn growable_growth_past_the_device_is_an_out_of_memory() {
    let t = trace(
        &format!("c 0 {} 0\ng 0 {}\ng 0 {}\n", 4 * GIB, 100 * MIB, 3 * GIB),
        0,
    );
    for allocator in ["quilt", "classic"] {
        let r = replay_fresh(&t, allocator, GIB, &checked(1)).unwrap();
        assert!(!r.completed, "{allocator}");
        assert_eq!((r.ooms, r.events), (1, 2), "{allocator}");
        assert!(r.oom_message.is_some());
    }
}

/// `replay` on an allocator handed in emulates the serving events, whatever
/// the allocator, and iterations start from the same tag states.
#[test]
fn growable_replay_of_a_given_allocator_emulates_and_iterates() {
    let t = trace(
        &format!(
            "t 0 {} 0 1\nt 1 {} 0 2\nz 2\nc 2 {} 0\ng 2 {}\nz 1\nw 2\nr 2\n",
            20 * MIB,
            30 * MIB,
            GIB,
            50 * MIB
        ),
        3,
    );
    let sim = SimVmm::new(ReplayConfig::default().sim_config(GIB)).unwrap();
    let sim = Arc::new(sim);
    let alloc = CachingAllocator::new(sim.clone(), CachingConfig::classic()).unwrap();
    let r = replay(&t, &alloc, &sim, &checked(3)).unwrap();
    assert!(r.completed);
    assert_eq!(
        r.growth_copies.bytes, 0,
        "one grow from length 0 copies nothing"
    );
    // Each iteration: 20 MiB out (z 1), 30 MiB in (w 2); between iterations
    // tag 2 sleeps again (30 MiB out) and tag 1 wakes (20 MiB in).
    assert_eq!(
        r.driver.copied_bytes,
        30 * MIB + 3 * 50 * MIB + 2 * 50 * MIB
    );
    alloc.check_invariants().unwrap();
}

/// The serving policies are keys of `--allocator quilt:KEY=VALUE`.
#[test]
fn growable_policies_are_allocator_spec_keys() {
    for spec in [
        "quilt:map_ahead_mode=inline",
        "quilt:map_ahead_pages=2,map_ahead_permille=500",
        "quilt:recycle_buffers=8",
        "quilt:offload_tier=offloadable_tags",
    ] {
        allocators::check_name(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    }
    let e = allocators::check_name("quilt:map_ahead_mode=sometimes")
        .unwrap_err()
        .to_string();
    assert!(e.contains("inline"), "{e}");
}

/// One generated step of a serving trace; indices pick among what is live.
#[derive(Clone, Debug)]
enum Step {
    Create { max_pages: u64, stream: u64 },
    Grow { pick: usize, share: u64 },
    Shrink { pick: usize, share: u64 },
    Release { pick: usize },
    Alloc { kib: u64, tag: Option<u64> },
    Free { pick: usize },
    Sleep { tag: u64 },
    Wake { tag: u64 },
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (1u64..=32, 0u64..2).prop_map(|(max_pages, stream)| Step::Create { max_pages, stream }),
        (any::<usize>(), 1u64..=100).prop_map(|(pick, share)| Step::Grow { pick, share }),
        (any::<usize>(), 0u64..=100).prop_map(|(pick, share)| Step::Shrink { pick, share }),
        any::<usize>().prop_map(|pick| Step::Release { pick }),
        (1u64..=40_000, proptest::option::of(0u64..3))
            .prop_map(|(kib, tag)| Step::Alloc { kib, tag }),
        any::<usize>().prop_map(|pick| Step::Free { pick }),
        (0u64..3).prop_map(|tag| Step::Sleep { tag }),
        (0u64..3).prop_map(|tag| Step::Wake { tag }),
    ]
}

/// What a generated trace should measure on an emulating baseline.
#[derive(Default, Debug)]
struct Expected {
    peak_live: u64,
    growth_copy_bytes: u64,
    growth_copies: u64,
    host_copy_bytes: u64,
}

/// The valid trace the steps make (invalid picks are skipped), and an
/// independent account of its live bytes and copies.
fn build(steps: &[Step]) -> (Trace, Expected) {
    use std::collections::BTreeMap;
    let mut events = Vec::new();
    let mut next = 0u64;
    let mut growables: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut allocs: BTreeMap<u64, (u64, Option<u64>)> = BTreeMap::new();
    let mut asleep: BTreeMap<u64, bool> = BTreeMap::new();
    let mut x = Expected::default();
    let live = |g: &BTreeMap<u64, (u64, u64)>,
                a: &BTreeMap<u64, (u64, Option<u64>)>,
                s: &BTreeMap<u64, bool>| {
        g.values().map(|v| v.0).sum::<u64>()
            + a.values()
                .filter(|(_, t)| !t.is_some_and(|t| s.get(&t) == Some(&true)))
                .map(|v| v.0)
                .sum::<u64>()
    };
    let nth = |keys: Vec<u64>, pick: usize| (!keys.is_empty()).then(|| keys[pick % keys.len()]);
    for s in steps {
        match *s {
            Step::Create { max_pages, stream } => {
                let max = max_pages * 2 * MIB;
                events.push(Event::CreateGrowable {
                    id: next,
                    max,
                    stream,
                });
                growables.insert(next, (0, max));
                next += 1;
            }
            Step::Grow { pick, share } | Step::Shrink { pick, share } => {
                let grow = matches!(s, Step::Grow { .. });
                let Some(id) = nth(growables.keys().copied().collect(), pick) else {
                    continue;
                };
                let (len, max) = growables[&id];
                let bytes = if grow {
                    len + (max - len) * share / 100
                } else {
                    len * share / 100
                };
                if bytes == len {
                    continue;
                }
                if len > 0 && bytes > 0 {
                    x.growth_copies += 1;
                    x.growth_copy_bytes += len.min(bytes);
                }
                events.push(if grow {
                    Event::Grow { id, bytes }
                } else {
                    Event::Shrink { id, bytes }
                });
                growables.insert(id, (bytes, max));
            }
            Step::Release { pick } => {
                if let Some(id) = nth(growables.keys().copied().collect(), pick) {
                    events.push(Event::ReleaseGrowable { id });
                    growables.remove(&id);
                }
            }
            Step::Alloc { kib, tag } => {
                if tag.is_some_and(|t| asleep.get(&t) == Some(&true)) {
                    continue;
                }
                let size = kib * 1024;
                events.push(match tag {
                    Some(tag) => {
                        asleep.insert(tag, false);
                        Event::AllocTagged {
                            id: next,
                            size,
                            stream: 0,
                            tag,
                        }
                    }
                    None => Event::Alloc {
                        id: next,
                        size,
                        stream: 0,
                    },
                });
                allocs.insert(next, (size, tag));
                next += 1;
            }
            Step::Free { pick } => {
                let free: Vec<u64> = allocs
                    .iter()
                    .filter(|(_, (_, t))| !t.is_some_and(|t| asleep.get(&t) == Some(&true)))
                    .map(|(&id, _)| id)
                    .collect();
                if let Some(id) = nth(free, pick) {
                    events.push(Event::Free { id });
                    allocs.remove(&id);
                }
            }
            Step::Sleep { tag } | Step::Wake { tag } => {
                let sleep = matches!(s, Step::Sleep { .. });
                if asleep.get(&tag) != Some(&!sleep) {
                    continue;
                }
                x.host_copy_bytes += allocs
                    .values()
                    .filter(|(_, t)| *t == Some(tag))
                    .map(|v| v.0)
                    .sum::<u64>();
                events.push(if sleep {
                    Event::Sleep { tag }
                } else {
                    Event::Wake { tag }
                });
                asleep.insert(tag, sleep);
            }
        }
        x.peak_live = x.peak_live.max(live(&growables, &allocs, &asleep));
    }
    let t = Trace {
        name: "generated".into(),
        events,
        preexisting: 0,
    };
    (t, x)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Over generated serving traces, with the invariants checked after
    /// every event: each allocator replays them; the live bytes are the
    /// trace's own; Quilt copies nothing for growth; an emulating baseline
    /// copies exactly the old contents at each resize and each tagged byte
    /// at each sleep and wake; the text format round-trips.
    #[test]
    fn growable_generated_traces_replay_with_exact_accounting(
        steps in proptest::collection::vec(step(), 1..60)
    ) {
        let (t, x) = build(&steps);
        proptest::prop_assert_eq!(parse_trace(&to_text(&t.events)).unwrap(), t.events.clone());
        proptest::prop_assert_eq!(trace_stats(&t).peak_live_bytes, x.peak_live);
        let config = ReplayConfig {
            check_every: Some(1),
            ..ReplayConfig::default()
        };
        for allocator in ALLOCATOR_NAMES {
            let r = replay_fresh(&t, allocator, 8 * GIB, &config)
                .unwrap_or_else(|e| panic!("{allocator}: {e}"));
            proptest::prop_assert!(r.completed, "{}: {:?}", allocator, r.oom_message);
            proptest::prop_assert_eq!(r.peak_live_bytes, x.peak_live, "{}", allocator);
            if allocator == "quilt" {
                proptest::prop_assert_eq!(r.growth_copies.bytes, 0);
                proptest::prop_assert!(r.driver.copied_bytes >= x.host_copy_bytes);
            } else {
                proptest::prop_assert_eq!(r.growth_copies.bytes, x.growth_copy_bytes, "{}", allocator);
                proptest::prop_assert_eq!(r.growth_copies.copies, x.growth_copies, "{}", allocator);
                proptest::prop_assert_eq!(r.driver.copied_bytes, x.host_copy_bytes, "{}", allocator);
            }
        }
    }
}
