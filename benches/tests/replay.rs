//! The replay engine, its metrics and the bisection, on hand-made traces whose
//! answers are derived by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use quilt_alloc::{
    AllocError, Allocation, AllocatorStats, DeviceAllocator, InvariantViolation, MemorySnapshot,
};
use quilt_bench::bisect::min_capacity_bytes;
use quilt_bench::live::trace_stats;
use quilt_bench::replay::{
    replay, replay_fresh, ReplayConfig, ReplayError, DEFAULT_GPU_LAG_OPS, DEFAULT_SYNC_COST_NS,
};
use quilt_bench::report::json::to_json;
use quilt_bench::report::rows::{CostModelParameters, Measurement, RunParameters, StreamCalls};
use quilt_bench::trace::{parse_trace, Trace};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, DevicePtr, EventId, StreamId, Vmm};

const MIB: u64 = 1 << 20;

fn trace(name: &str, text: &str, preexisting: usize) -> Trace {
    Trace {
        name: name.into(),
        events: parse_trace(text).unwrap(),
        preexisting,
    }
}

fn checked() -> ReplayConfig {
    ReplayConfig {
        check_every: Some(1),
        ..ReplayConfig::default()
    }
}

#[test]
fn ideal_bytes_by_hand() {
    // a0 3 MiB (large), a1 exactly 1 MiB (small: 1 MiB or less), a2 100 B (small,
    // 512 after rounding), a3 1 MiB + 1 B (large).
    //   large = 3145728 + 1048577 = 4194305 -> 3 pages = 6 MiB
    //   small = 1048576 + 512 = 1049088     -> 1 page  = 2 MiB      ideal 8 MiB
    // free a0, then a4 5 MiB (large):
    //   large = 1048577 + 5242880 = 6291457 -> 4 pages = 8 MiB
    //   small unchanged                     -> 2 MiB                ideal 10 MiB
    // Peak live = 1048577 + 5242880 + 1048576 + 100 = 7340133 (after a4).
    let t = trace(
        "ideal",
        "a 0 3145728 0\na 1 1048576 0\na 2 100 0\na 3 1048577 0\nf 0\na 4 5242880 0\n",
        0,
    );
    let s = trace_stats(&t);
    assert_eq!(s.ideal_bytes, 10 * MIB);
    assert_eq!(s.peak_live_bytes, 7_340_133);
    for allocator in ["classic", "expandable", "quilt"] {
        let r = replay_fresh(&t, allocator, 64 * MIB, &checked()).unwrap();
        assert!(r.completed, "{allocator}");
        assert_eq!(r.ideal_bytes, 10 * MIB, "{allocator}");
        assert_eq!(r.peak_live_bytes, 7_340_133, "{allocator}");
        assert_eq!(r.events, 6);
        assert!(
            r.peak_reserved_bytes >= r.ideal_bytes,
            "{allocator} beats the ideal"
        );
    }
}

#[test]
fn bisection_finds_the_exact_classic_threshold() {
    // One 30 MiB request: classic rounds it to 2 MiB (already a multiple) and,
    // above 10 MiB, gets a segment of exactly that size: it completes at 30 MiB
    // and not at 28 MiB.
    let t = trace("one-30mib", "a 0 31457280 0\n", 0);
    let cfg = ReplayConfig::default();
    assert!(
        replay_fresh(&t, "classic", 30 * MIB, &cfg)
            .unwrap()
            .completed
    );
    assert!(
        !replay_fresh(&t, "classic", 28 * MIB, &cfg)
            .unwrap()
            .completed
    );
    assert_eq!(
        min_capacity_bytes(&t, "classic", 30 * MIB, &cfg).unwrap(),
        Some(30 * MIB)
    );

    // A 3 MiB request gets a 20 MiB segment from classic: more than twice the
    // peak live bytes (6 MiB), so the search range holds no answer.
    let t = trace("one-3mib", "a 0 3145728 0\n", 0);
    assert_eq!(
        min_capacity_bytes(&t, "classic", 3 * MIB, &cfg).unwrap(),
        None
    );
    // A page-granular allocator needs 2 pages for it.
    assert_eq!(
        min_capacity_bytes(&t, "quilt", 3 * MIB, &cfg).unwrap(),
        Some(4 * MIB)
    );

    // 100 bytes: classic's small pool takes one 2 MiB segment.
    let t = trace("tiny", "a 0 100 0\n", 0);
    assert_eq!(
        min_capacity_bytes(&t, "classic", 100, &cfg).unwrap(),
        Some(2 * MIB)
    );
}

#[test]
fn oom_stops_the_replay_and_counts() {
    let t = trace("oom", "a 0 31457280 0\na 1 31457280 0\nf 0\n", 0);
    let r = replay_fresh(&t, "classic", 40 * MIB, &checked()).unwrap();
    assert!(!r.completed);
    assert_eq!(r.ooms, 1);
    assert_eq!(r.events, 1);
    assert!(r.oom_message.is_some());
}

#[test]
fn iterations_keep_the_prefix_and_reset_the_rest() {
    // Prefix: id 0 (kept) and id 1 (freed by the body). Body: allocates 2 and 3,
    // frees 1 and 2, leaves 3 live.
    let t = trace(
        "iter",
        "a 0 4194304 0\na 1 2097152 0\na 2 25165824 0\na 3 3000 0\nf 1\nf 2\n",
        2,
    );
    let cfg = ReplayConfig {
        iterations: 3,
        check_every: Some(1),
        time_ops: true,
        ..ReplayConfig::default()
    };
    for allocator in ["classic", "expandable", "quilt", "gmlake"] {
        let r = replay_fresh(&t, allocator, 256 * MIB, &cfg).unwrap();
        assert!(r.completed, "{allocator}");
        assert_eq!(r.events, 2 + 3 * 4, "{allocator}");
        // Every iteration starts from the same live set: peak live is one iteration's.
        assert_eq!(
            r.peak_live_bytes,
            4194304 + 2097152 + 25165824 + 3000,
            "{allocator}"
        );
        assert!(r.cpu_ns_per_op > 0);
        // Caching allocators make no driver call once the sizes repeat.
        if allocator == "classic" {
            assert_eq!(r.driver_after_first_iteration.vmm_calls(), 0);
        }
    }
    let one = replay_fresh(&t, "classic", 256 * MIB, &ReplayConfig::default()).unwrap();
    assert_eq!(one.driver_after_first_iteration.vmm_calls(), 0);
    assert!(one.driver.vmm_calls() > 0);
}

#[test]
fn inconsistent_traces_are_errors() {
    let t = Trace {
        name: "bad".into(),
        events: vec![quilt_bench::trace::Event::Free { id: 9 }],
        preexisting: 0,
    };
    match replay_fresh(&t, "classic", 64 * MIB, &ReplayConfig::default()) {
        Err(ReplayError::BadTrace { event: 0, .. }) => {}
        other => panic!("expected a bad-trace error, got {other:?}"),
    }
    assert!(matches!(
        replay_fresh(&t, "no-such", 64 * MIB, &ReplayConfig::default()),
        Err(ReplayError::Registry(_))
    ));
}

/// The parameters of a JSON report over `capacity` at the default replay.
fn parameters(capacity: u64, iterations: u32) -> RunParameters {
    let config = ReplayConfig {
        iterations,
        ..ReplayConfig::default()
    };
    RunParameters {
        version: quilt_bench::report::rows::version(),
        allocators: vec!["classic".into()],
        workloads: vec!["json".into()],
        capacity_bytes: capacity,
        iterations,
        seed: 42,
        bisection: false,
        cost_model: CostModelParameters::of(&config.sim_config(capacity)),
    }
}

#[test]
fn json_has_exactly_the_listed_fields() {
    let t = trace("json", "a 0 3145728 0\na 1 100 1\nf 0\n", 0);
    let config = ReplayConfig {
        iterations: 2,
        ..ReplayConfig::default()
    };
    let r = replay_fresh(&t, "classic", 64 * MIB, &config).unwrap();
    let m = Measurement::new("json", "classic", 64 * MIB, 2, r, None);
    let text = to_json(&parameters(64 * MIB, 2), &[Ok(m)]).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut top: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    top.sort_unstable();
    assert_eq!(top, ["parameters", "rows"]);
    let p = &json["parameters"];
    assert!(p["version"]
        .as_str()
        .unwrap()
        .starts_with(env!("CARGO_PKG_VERSION")));
    assert_eq!(p["allocators"], serde_json::json!(["classic"]));
    assert_eq!(p["capacity_bytes"], 64 * MIB);
    assert_eq!(p["iterations"], 2);
    assert_eq!(p["seed"], 42);
    assert_eq!(p["cost_model"]["gpu_lag_ops"], 64);
    assert_eq!(p["cost_model"]["sync_us"], 100.0);
    assert_eq!(p["cost_model"]["create_us_per_granule"], 193.0);
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    let row = rows[0].as_object().unwrap();
    let mut keys: Vec<&str> = row.keys().map(|k| k.as_str()).collect();
    keys.sort_unstable();
    let mut want = vec![
        "workload",
        "allocator",
        "capacity_bytes",
        "completed",
        "ooms",
        "oom",
        "events",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "efficiency",
        "ideal_bytes",
        "min_capacity_bytes",
        "vmm_calls",
        "vmm_calls_after_first_iteration",
        "stream_calls",
        "stream_calls_after_first_iteration",
        "copied_bytes",
        "growth_copied_bytes",
        "grows",
        "grows_already_mapped",
        "modelled_driver_us",
        "cpu_ns_per_op",
        "event_records_per_op",
        "event_queries_per_op",
        "races",
        "first_race",
    ];
    want.sort_unstable();
    assert_eq!(keys, want);
    assert!(row["min_capacity_bytes"].is_null());
    // classic emulates growth: no count of native grows.
    assert!(row["grows"].is_null() && row["grows_already_mapped"].is_null());
    assert!(row["oom"].is_null());
    assert_eq!(
        (row["races"].as_u64(), row["first_race"].is_null()),
        (Some(0), true)
    );
    let calls = [
        "address_free",
        "create",
        "map",
        "release",
        "reserve",
        "set_access",
        "unmap",
    ];
    for field in ["vmm_calls", "vmm_calls_after_first_iteration"] {
        let mut k: Vec<&str> = row[field]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        k.sort_unstable();
        assert_eq!(k, calls, "{field}");
    }
    let stream = [
        "event_destroy",
        "event_query",
        "event_record",
        "is_capturing",
        "synchronize",
        "wait_event",
    ];
    for field in ["stream_calls", "stream_calls_after_first_iteration"] {
        let mut k: Vec<&str> = row[field]
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        k.sort_unstable();
        assert_eq!(k, stream, "{field}");
    }
    assert_eq!(row["workload"], "json");
    // Three events, twice.
    assert_eq!(row["events"], 6);
    assert_eq!(row["peak_live_bytes"], 3145728 + 100);
}

#[test]
fn one_iteration_has_no_after_first_figures_and_an_oom_row_its_report() {
    // 8 MiB, then 60 MiB on a 64 MiB device: the second cannot fit.
    let t = trace("json", "a 0 8388608 0\na 1 62914560 0\n", 0);
    let r = replay_fresh(&t, "classic", 64 * MIB, &ReplayConfig::default()).unwrap();
    assert!(!r.completed);
    let m = Measurement::new("json", "classic", 64 * MIB, 1, r, None);
    let text = to_json(&parameters(64 * MIB, 1), &[Ok(m)]).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let row = &json["rows"][0];
    assert!(row["vmm_calls_after_first_iteration"].is_null());
    assert!(row["stream_calls_after_first_iteration"].is_null());
    assert_eq!(row["completed"], false);
    let oom = &row["oom"];
    assert_eq!(oom["verdict"], "capacity");
    assert!(oom["message"].as_str().unwrap().contains("out of memory"));
    let report = &oom["report"];
    assert_eq!(report["requested"], 62914560);
    assert_eq!(report["needed"], 62914560);
    assert_eq!(report["capacity"], 64 * MIB);
    assert_eq!(report["allocated"], 8388608);
    assert_eq!(report["needed_unbacked"], 62914560);
    // The 8 MiB block took a 20 MiB segment (PyTorch's size for 1 to 10 MiB):
    // 44 MiB stay free on the device.
    assert_eq!(report["device_free"], 44 * MIB);
    // The report is the allocator's own `OomReport`, whole.
    assert_eq!(report["allocator"], "classic");
    assert_eq!(report["verdict"], "capacity");
    let back: quilt_alloc::OomReport = serde_json::from_value(report.clone()).unwrap();
    assert_eq!(back.requested, 62914560);
}

#[test]
fn defaults_are_a_64_operation_lag_and_a_100_us_sync() {
    let cfg = ReplayConfig::default();
    assert_eq!((cfg.gpu_lag_ops, DEFAULT_GPU_LAG_OPS), (64, 64));
    assert_eq!((cfg.sync_cost_ns, DEFAULT_SYNC_COST_NS), (100_000, 100_000));
    let sim = ReplayConfig {
        gpu_lag_ops: 3,
        sync_cost_ns: 7,
        ..cfg
    }
    .sim_config(64 * MIB);
    assert_eq!(
        (sim.capacity, sim.gpu_lag_ops, sim.cost.sync_ns),
        (64 * MIB, 3, 7)
    );
}

#[test]
fn the_replay_advances_the_clock_once_per_allocator_operation() {
    // Prefix: id 0. Body: a1, f1, a2 (left live). Iteration 2 starts by freeing
    // id 2 (one more operation, not a trace event).
    let t = trace("clock", "a 0 3145728 0\na 1 100 1\nf 1\na 2 100 0\n", 1);
    let cfg = ReplayConfig {
        iterations: 2,
        ..ReplayConfig::default()
    };
    let sim = Arc::new(SimVmm::new(cfg.sim_config(64 * MIB)).unwrap());
    let alloc = quilt_bench::allocators::build("classic", sim.clone()).unwrap();
    let r = replay(&t, alloc.as_ref(), &sim, &cfg).unwrap();
    assert_eq!(r.events, 1 + 2 * 3);
    assert_eq!(sim.clock(), 1 + 3 + 1 + 3);
}

/// A wrapper around `classic` that shows what the replay's GPU lag does: on
/// every free it records an event on the freed block's stream (stamped with
/// the device's clock) and, with `sync`, synchronises that stream; on every
/// operation it queries every pending event and checks that it has completed
/// exactly when `lag` operations have passed since it was recorded, or its
/// stream was synchronised since.
struct Probe {
    inner: Box<dyn DeviceAllocator>,
    sim: Arc<SimVmm>,
    lag: u64,
    sync: bool,
    streams: Mutex<HashMap<DevicePtr, StreamId>>,
    /// `(event, stream, clock at record, synchronised since)`.
    pending: Mutex<Vec<(EventId, StreamId, u64, bool)>>,
    /// Queries made and queries that found the event complete.
    seen: Mutex<(u64, u64)>,
}

impl Probe {
    fn new(sim: &Arc<SimVmm>, lag: u64, sync: bool) -> Probe {
        Probe {
            inner: quilt_bench::allocators::build("classic", sim.clone()).unwrap(),
            sim: sim.clone(),
            lag,
            sync,
            streams: Mutex::default(),
            pending: Mutex::default(),
            seen: Mutex::default(),
        }
    }

    fn poll(&self) {
        let clock = self.sim.clock();
        let mut pending = self.pending.lock().unwrap();
        let mut seen = self.seen.lock().unwrap();
        pending.retain(|&(ev, _, at, synced)| {
            let done = self.sim.event_query(ev).unwrap();
            assert_eq!(
                done,
                synced || clock - at >= self.lag,
                "lag {}: recorded at {at}, queried at {clock}",
                self.lag
            );
            seen.0 += 1;
            if done {
                seen.1 += 1;
                self.sim.event_destroy(ev).unwrap();
            }
            !done
        });
    }
}

impl DeviceAllocator for Probe {
    fn name(&self) -> &str {
        "probe"
    }
    fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.poll();
        let a = self.inner.allocate(size, stream)?;
        self.streams.lock().unwrap().insert(a.ptr, stream);
        Ok(a)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.inner.free(ptr)?;
        let stream = self.streams.lock().unwrap().remove(&ptr).unwrap();
        let ev = self.sim.event_record(stream).unwrap();
        self.pending
            .lock()
            .unwrap()
            .push((ev, stream, self.sim.clock(), false));
        if self.sync {
            self.sim.stream_synchronize(stream).unwrap();
            for p in self.pending.lock().unwrap().iter_mut() {
                p.3 |= p.1 == stream;
            }
        }
        self.poll();
        Ok(())
    }
    fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        self.inner.record_stream(ptr, stream)
    }
    fn reset_peak_stats(&self) -> Result<(), AllocError> {
        self.inner.reset_peak_stats()
    }
    fn empty_cache(&self) -> Result<(), AllocError> {
        self.inner.empty_cache()
    }
    fn stats(&self) -> AllocatorStats {
        self.inner.stats()
    }
    fn snapshot(&self) -> MemorySnapshot {
        self.inner.snapshot()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner.check_invariants()
    }
    fn vmm(&self) -> &Arc<dyn Vmm> {
        self.inner.vmm()
    }
}

/// 40 allocate/free pairs over two streams, with up to three blocks live.
fn churn() -> Trace {
    let mut text = String::new();
    for i in 0..40u64 {
        text.push_str(&format!("a {i} {} {}\n", (i % 5 + 1) * 1000, i % 2));
        if i >= 2 {
            text.push_str(&format!("f {}\n", i - 2));
        }
    }
    text.push_str("f 38\nf 39\n");
    trace("churn", &text, 0)
}

fn replay_probe(
    lag: u64,
    sync: bool,
    sync_cost_ns: u64,
) -> (quilt_bench::replay::ReplayResult, (u64, u64)) {
    let cfg = ReplayConfig {
        iterations: 2,
        gpu_lag_ops: lag,
        sync_cost_ns,
        ..ReplayConfig::default()
    };
    let sim = Arc::new(SimVmm::new(cfg.sim_config(64 * MIB)).unwrap());
    let probe = Probe::new(&sim, lag, sync);
    let r = replay(&churn(), &probe, &sim, &cfg).unwrap();
    assert!(r.completed);
    for (ev, ..) in probe.pending.lock().unwrap().drain(..) {
        sim.event_destroy(ev).unwrap();
    }
    let seen = *probe.seen.lock().unwrap();
    (r, seen)
}

#[test]
fn events_complete_gpu_lag_ops_operations_after_they_are_recorded() {
    for lag in [0, 1, 2, 7, 64, 1000] {
        let (r, (queries, complete)) = replay_probe(lag, false, DEFAULT_SYNC_COST_NS);
        let frees = 2 * 40;
        assert_eq!(r.driver.count(CallKind::EventRecord), frees, "lag {lag}");
        assert_eq!(r.driver.count(CallKind::EventQuery), queries, "lag {lag}");
        match lag {
            // Complete as recorded: each event is queried once, in its own free.
            0 => assert_eq!((queries, complete), (frees, frees)),
            // Never complete within the replay: every query finds it pending.
            1000 => assert_eq!(complete, 0),
            _ => assert!(complete > 0 && queries > complete, "lag {lag}"),
        }
    }
}

#[test]
fn a_synchronisation_completes_at_once_and_costs_sync_cost_ns() {
    let (free, _) = replay_probe(64, true, 0);
    let (charged, (queries, complete)) = replay_probe(64, true, 250_000);
    assert_eq!(
        (queries, complete),
        (80, 80),
        "synchronised: complete at once"
    );
    let syncs = charged.driver.count(CallKind::StreamSynchronize);
    assert_eq!(syncs, 80);
    assert_eq!(
        charged.driver.modelled_ns - free.driver.modelled_ns,
        syncs * 250_000
    );
    // 80 allocations and frees, twice: 160 operations, an event record and
    // a query per free.
    assert_eq!(charged.ops, 160);
    let m = Measurement::new("churn", "probe", 64 * MIB, 2, charged.clone(), None);
    assert_eq!(
        (m.row.event_records_per_op, m.row.event_queries_per_op),
        (0.5, 0.5)
    );
    assert_eq!(
        m.row.stream_calls,
        StreamCalls {
            synchronize: 80,
            wait_event: 0,
            event_record: 80,
            event_query: 80,
            event_destroy: 80,
            is_capturing: 0,
        }
    );
    assert_eq!(
        m.row
            .stream_calls_after_first_iteration
            .map(|s| s.synchronize),
        Some(40)
    );
    assert_eq!(
        m.row.modelled_driver_us,
        charged.driver.modelled_ns as f64 / 1000.0
    );
}

/// A recorded series keeps every bucket's highest live bytes: its peak is
/// the replay's peak, however far apart the samples are.
#[test]
fn recorded_series_keep_the_peak() {
    let trace = (quilt_bench::workloads::find("mixed-vision-language")
        .unwrap()
        .generate)(quilt_bench::workloads::DEFAULT_SEED);
    let config = ReplayConfig {
        record_series: true,
        ..ReplayConfig::default()
    };
    let r = quilt_bench::replay::replay_fresh(&trace, "classic", 80 << 30, &config).unwrap();
    let peak = r.series.iter().map(|p| p.live_bytes).max().unwrap();
    assert_eq!(peak, r.peak_live_bytes);
    assert!(r.series.windows(2).all(|w| w[0].event < w[1].event));
    assert!(r.series.len() <= 3 * quilt_bench::replay::MAX_SERIES_POINTS + 3);
}

/// Where a free queues work: on the streams that used the block last. A
/// block made on stream 1 (its producer: a copy) and used on stream 0
/// (`record_stream`) was last used by stream 0's kernels, so the free queues
/// work there and leaves stream 1 idle; a block never used elsewhere queues
/// work on its own stream. Read after the replay, one operation after the
/// free, by recording an event on a stream (the lag is 64 operations).
#[test]
fn a_free_queues_work_on_the_streams_that_used_the_block_last() {
    // (used on stream 0, the streams then busy and idle).
    for (used_elsewhere, busy, idle) in [(true, vec![0], vec![1]), (false, vec![1], vec![])] {
        let mut text = String::from("a 0 4096 1\n");
        // 100 operations on stream 2: stream 1's copy is long done.
        for i in 1..=50u64 {
            text.push_str(&format!("a {i} 4096 2\nf {i}\n"));
        }
        if used_elsewhere {
            text.push_str("u 0 0\n");
        }
        text.push_str("f 0\n");
        let cfg = ReplayConfig {
            gpu_lag_ops: 64,
            ..ReplayConfig::default()
        };
        let sim = Arc::new(SimVmm::new(cfg.sim_config(64 * MIB)).unwrap());
        let alloc = quilt_bench::allocators::build("classic", sim.clone()).unwrap();
        let r = replay(&trace("uses", &text, 0), alloc.as_ref(), &sim, &cfg).unwrap();
        assert!(r.completed);
        let streams = busy
            .iter()
            .map(|&s| (s, true))
            .chain(idle.iter().map(|&s| (s, false)));
        for (stream, busy) in streams {
            let ev = sim.event_record(StreamId(stream)).unwrap();
            assert_eq!(
                sim.event_query(ev).unwrap(),
                !busy,
                "stream {stream}, block used elsewhere: {used_elsewhere}"
            );
            sim.event_destroy(ev).unwrap();
        }
    }
}
