//! The replay's race finder (`races.rs`) on whole replays: every allocator
//! of the registry reuses memory across streams only after the work that
//! used it (by a wait or its completion), on the multi-stream workloads and
//! on generated loops; an allocator blind to streams is caught.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use proptest::prelude::*;
use quilt_alloc::{
    AllocError, Allocation, AllocatorStats, DeviceAllocator, InvariantViolation, MemorySnapshot,
};
use quilt_bench::allocators::build;
use quilt_bench::replay::{replay, replay_fresh, ReplayConfig};
use quilt_bench::trace::{parse_trace, Trace};
use quilt_bench::workloads::{find, DEFAULT_SEED};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId, Vmm};

const ALLOCATORS: [&str; 5] = ["quilt", "classic", "expandable", "gmlake", "offset"];

fn config(iterations: u32) -> ReplayConfig {
    ReplayConfig {
        iterations,
        ..ReplayConfig::default()
    }
}

#[test]
fn no_allocator_races_on_the_multi_stream_workloads() {
    for workload in [
        "offload-pipeline-4",
        "offload-pipeline-10",
        "mixed-vision-language",
    ] {
        let trace = (find(workload).unwrap().generate)(DEFAULT_SEED);
        for allocator in ALLOCATORS {
            let r = replay_fresh(&trace, allocator, 80 << 30, &config(2)).unwrap();
            assert!(r.completed, "{workload} / {allocator}");
            assert_eq!(r.races, 0, "{workload} / {allocator}: {:?}", r.first_race);
        }
    }
}

/// An allocator that forgets which stream asks: everything goes to the
/// default stream, so memory one stream freed is handed to another at
/// once, as a pool shared without events would.
struct StreamBlind(Box<dyn DeviceAllocator>);

impl DeviceAllocator for StreamBlind {
    fn name(&self) -> &str {
        "stream-blind"
    }
    fn allocate(&self, size: u64, _stream: StreamId) -> Result<Allocation, AllocError> {
        self.0.allocate(size, StreamId::DEFAULT)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.0.free(ptr)
    }
    fn record_stream(&self, _ptr: DevicePtr, _stream: StreamId) -> Result<(), AllocError> {
        Ok(())
    }
    fn empty_cache(&self) -> Result<(), AllocError> {
        self.0.empty_cache()
    }
    fn stats(&self) -> AllocatorStats {
        self.0.stats()
    }
    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.0.reset_peak_stats()
    }
    fn snapshot(&self) -> MemorySnapshot {
        self.0.snapshot()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.0.check_invariants()
    }
    fn vmm(&self) -> &Arc<dyn Vmm> {
        self.0.vmm()
    }
}

fn trace(text: &str) -> Trace {
    Trace {
        name: "t".into(),
        events: parse_trace(text).unwrap(),
        preexisting: 0,
    }
}

#[test]
fn an_allocator_blind_to_streams_is_caught_and_the_first_race_named() {
    // Stream 1 frees a block; stream 2 asks for as much at once.
    let t = trace("a 0 4194304 1\nf 0\na 1 4194304 2\nf 1\n");
    let sim = Arc::new(SimVmm::new(ReplayConfig::default().sim_config(1 << 30)).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let blind = StreamBlind(build("quilt", vmm).unwrap());
    let r = replay(&t, &blind, &sim, &ReplayConfig::default()).unwrap();
    assert_eq!(r.races, 1);
    let first = r.first_race.unwrap();
    assert!(
        first.starts_with("event 2: 4194304 bytes on stream 2 reuse memory that stream 1 used"),
        "{first}"
    );
    // Quilt itself waits for stream 1 there.
    let r = replay_fresh(&t, "quilt", 1 << 30, &ReplayConfig::default()).unwrap();
    assert_eq!(
        (
            r.races,
            r.driver.count(quilt_vmm::CallKind::StreamWaitEvent)
        ),
        (0, 1)
    );
    // Nothing is looked for unless asked.
    let quiet = ReplayConfig {
        find_races: false,
        ..ReplayConfig::default()
    };
    let sim = Arc::new(SimVmm::new(quiet.sim_config(1 << 30)).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let blind = StreamBlind(build("quilt", vmm).unwrap());
    let r = replay(&t, &blind, &sim, &quiet).unwrap();
    assert_eq!((r.races, r.first_race), (0, None));
}

#[test]
fn quilt_orders_a_block_on_the_rest_of_a_page_moved_under_pressure() {
    // 20 MiB, ten pages: stream 1 fills them and frees 0..4 and 6..8 MiB
    // (its work still queued); stream 2's 5 MiB fits no gap, so the three
    // cached pages are moved under it at the top (20..25 MiB, its last page
    // half used); stream 3's 1 MiB goes beside it, on the other half of
    // that page: memory stream 1's work used, at another address. Found on
    // `family-003` near its minimum capacity (`crates/alloc/tests/
    // moved_page_hazards.rs` has the same steps against the allocator).
    let t = trace(
        "a 0 4194304 1\na 1 2097152 1\na 2 2097152 1\na 3 12582912 1\nf 0\nf 2\n\
         a 4 5242880 2\na 5 1048576 3\nf 1\nf 3\nf 4\nf 5\n",
    );
    for allocator in ["quilt", "quilt:events=at_free"] {
        let r = replay_fresh(&t, allocator, 20 << 20, &config(1)).unwrap();
        assert!(r.completed, "{allocator}");
        assert_eq!(r.races, 0, "{allocator}: {:?}", r.first_race);
        // Stream 2 and stream 3 each wait for stream 1.
        let waits = r.driver.count(quilt_vmm::CallKind::StreamWaitEvent);
        assert_eq!(waits, 2, "{allocator}");
    }
}

/// A loop as pipelined inference runs it: blocks made on a side stream
/// (a copy), used on the compute stream (`record_stream`) and freed there,
/// beside activations made and freed on the compute stream, with sizes and
/// stream choices drawn.
fn pipeline_loop(steps: &[(u8, u8, bool)]) -> String {
    let mut text = String::new();
    let mut live: Vec<u64> = Vec::new();
    for (i, &(size_class, side, keep)) in steps.iter().enumerate() {
        let id = i as u64;
        let size = (u64::from(size_class) + 1) * 700_000;
        let stream = u64::from(side % 4);
        text.push_str(&format!("a {id} {size} {stream}\n"));
        if stream != 0 {
            text.push_str(&format!("u {id} 0\n"));
        }
        live.push(id);
        if !keep || live.len() > 6 {
            let gone = live.remove(0);
            text.push_str(&format!("f {gone}\n"));
        }
    }
    for id in live {
        text.push_str(&format!("f {id}\n"));
    }
    text
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn no_allocator_races_on_generated_pipeline_loops(
        steps in prop::collection::vec((0u8..40, any::<u8>(), any::<bool>()), 4..80),
        lag in 0u64..80,
    ) {
        let t = trace(&pipeline_loop(&steps));
        let cfg = ReplayConfig { iterations: 2, gpu_lag_ops: lag, ..ReplayConfig::default() };
        for allocator in ALLOCATORS {
            let r = replay_fresh(&t, allocator, 1 << 30, &cfg).unwrap();
            prop_assert!(r.completed, "{}", allocator);
            prop_assert_eq!(r.races, 0, "{}: {:?}", allocator, r.first_race);
        }
    }
}
