//! What the CUDA driver demands of an allocator beyond the VMM calls
//! themselves (issue 22), on the simulated backend: no unmap while work
//! that may use the memory is not known complete (Quilt's drop, the caching
//! baseline's `cudaFree`); a forgotten stream is synchronised once and never
//! named to the driver again; under stream capture only the calls relaxed
//! capture mode permits, and blocks freed during a capture given to no
//! other stream until it ends; exhausted address space is not out of memory.
//!
//! A recording wrapper over the simulator logs every stream and event call
//! (with its stream) and every unmap, in order.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::{Arc, Mutex};

use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{
    DeviceCaps, DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId, Vmm,
    VmmError,
};

const MIB: u64 = 1 << 20;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

/// One call the allocator made, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Record(StreamId),
    Query,
    Wait {
        waiter: StreamId,
    },
    Sync(StreamId),
    DeviceSync,
    Unmap,
    Forget(StreamId),
    /// `cuStreamIsCapturing`: a question, legal under any capture.
    IsCapturing(StreamId),
}

impl Call {
    /// The stream the call hands to the driver, if any.
    fn stream(self) -> Option<StreamId> {
        match self {
            Call::Record(s)
            | Call::Wait { waiter: s }
            | Call::Sync(s)
            | Call::Forget(s)
            | Call::IsCapturing(s) => Some(s),
            _ => None,
        }
    }
}

/// The simulator, with every call of interest logged.
#[derive(Debug)]
struct Recorder {
    sim: Arc<SimVmm>,
    log: Mutex<Vec<Call>>,
    /// Streams of the events recorded, to name a wait's event's stream.
    event_streams: Mutex<Vec<(EventId, StreamId)>>,
}

impl Recorder {
    fn new(sim: Arc<SimVmm>) -> Arc<Recorder> {
        Arc::new(Recorder {
            sim,
            log: Mutex::new(Vec::new()),
            event_streams: Mutex::new(Vec::new()),
        })
    }
    fn push(&self, call: Call) {
        self.log.lock().unwrap().push(call);
    }
    fn calls(&self) -> Vec<Call> {
        self.log.lock().unwrap().clone()
    }
    fn clear(&self) {
        self.log.lock().unwrap().clear();
    }
}

impl Vmm for Recorder {
    fn backend_name(&self) -> &'static str {
        "recorder"
    }
    fn granularity(&self) -> u64 {
        self.sim.granularity()
    }
    fn reserve(&self, size: u64, alignment: u64) -> quilt_vmm::Result<DevicePtr> {
        self.sim.reserve(size, alignment)
    }
    fn address_free(&self, ptr: DevicePtr, size: u64) -> quilt_vmm::Result<()> {
        self.sim.address_free(ptr, size)
    }
    fn create(&self, size: u64) -> quilt_vmm::Result<PhysHandle> {
        self.sim.create(size)
    }
    fn release(&self, handle: PhysHandle) -> quilt_vmm::Result<()> {
        self.sim.release(handle)
    }
    fn map(&self, ptr: DevicePtr, size: u64, h: PhysHandle, offset: u64) -> quilt_vmm::Result<()> {
        self.sim.map(ptr, size, h, offset)
    }
    fn unmap(&self, ptr: DevicePtr, size: u64) -> quilt_vmm::Result<()> {
        self.push(Call::Unmap);
        self.sim.unmap(ptr, size)
    }
    fn set_access(&self, ptr: DevicePtr, size: u64) -> quilt_vmm::Result<()> {
        self.sim.set_access(ptr, size)
    }
    fn mem_info(&self) -> quilt_vmm::Result<MemInfo> {
        self.sim.mem_info()
    }
    fn event_record(&self, stream: StreamId) -> quilt_vmm::Result<EventId> {
        self.push(Call::Record(stream));
        let e = self.sim.event_record(stream)?;
        self.event_streams.lock().unwrap().push((e, stream));
        Ok(e)
    }
    fn event_record_on(&self, event: EventId, stream: StreamId) -> quilt_vmm::Result<()> {
        self.push(Call::Record(stream));
        self.sim.event_record_on(event, stream)
    }
    fn event_query(&self, event: EventId) -> quilt_vmm::Result<bool> {
        self.push(Call::Query);
        self.sim.event_query(event)
    }
    fn event_destroy(&self, event: EventId) -> quilt_vmm::Result<()> {
        self.sim.event_destroy(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> quilt_vmm::Result<()> {
        self.push(Call::Wait { waiter: stream });
        self.sim.stream_wait_event(stream, event)
    }
    fn stream_synchronize(&self, stream: StreamId) -> quilt_vmm::Result<()> {
        self.push(Call::Sync(stream));
        self.sim.stream_synchronize(stream)
    }
    fn device_synchronize(&self) -> quilt_vmm::Result<()> {
        self.push(Call::DeviceSync);
        self.sim.device_synchronize()
    }
    fn stream_is_capturing(&self, stream: StreamId) -> quilt_vmm::Result<bool> {
        self.push(Call::IsCapturing(stream));
        self.sim.stream_is_capturing(stream)
    }
    fn forget_stream(&self, stream: StreamId) -> quilt_vmm::Result<()> {
        self.push(Call::Forget(stream));
        self.sim.forget_stream(stream)
    }
    fn driver_stats(&self) -> DriverStats {
        self.sim.driver_stats()
    }
    fn map_rule(&self) -> MapRule {
        self.sim.map_rule()
    }
    fn holds_bytes(&self) -> bool {
        false
    }
    fn caps(&self) -> DeviceCaps {
        self.sim.caps()
    }
}

fn sim(capacity: u64) -> Arc<SimVmm> {
    Arc::new(SimVmm::with_capacity(capacity).unwrap())
}

fn quilt(vmm: Arc<dyn Vmm>) -> QuiltAllocator {
    QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap()
}

/// The position of the first unmap in `calls`.
fn first_unmap(calls: &[Call]) -> usize {
    calls
        .iter()
        .position(|c| *c == Call::Unmap)
        .expect("something was unmapped")
}

// ---- no unmap under queued work ----

#[test]
fn quilt_drop_synchronises_every_stream_before_it_unmaps() {
    for streams in [vec![S1], vec![S1, S2]] {
        let sim = sim(1 << 30);
        let rec = Recorder::new(sim.clone());
        let alloc = quilt(rec.clone());
        let mut live = Vec::new();
        for &s in &streams {
            let freed = alloc.allocate(5 * MIB, s).unwrap();
            live.push(alloc.allocate(3 * MIB, s).unwrap());
            alloc.free(freed.ptr).unwrap(); // cached: its kernels may still run
        }
        let _ = live; // live blocks are given back at drop too
        rec.clear();
        drop(alloc);
        let calls = rec.calls();
        let unmap = first_unmap(&calls);
        for &s in &streams {
            assert!(
                calls[..unmap].contains(&Call::Sync(s)),
                "{streams:?}: {s:?} not synchronised before the first unmap: {calls:?}"
            );
        }
        assert!(sim.leak_report().is_empty(), "{}", sim.leak_report());
    }
}

#[test]
fn the_caching_baseline_synchronises_the_device_before_it_frees_a_segment() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = CachingAllocator::new(rec.clone(), CachingConfig::classic()).unwrap();
    // One stream: no event is pending, yet a kernel may still use the block.
    let a = alloc.allocate(20 * MIB, S1).unwrap();
    alloc.free(a.ptr).unwrap();
    rec.clear();
    let before = sim.driver_stats();
    alloc.empty_cache().unwrap();
    let calls = rec.calls();
    let unmap = first_unmap(&calls);
    assert!(
        calls[..unmap].contains(&Call::DeviceSync),
        "cudaFree synchronises the device first: {calls:?}"
    );
    // The simulator charges it as one synchronisation.
    let d = sim.driver_stats().since(&before);
    assert_eq!(d.count(quilt_vmm::CallKind::StreamSynchronize), 1);
    assert!(d.modelled_ns >= sim.config().cost.sync_ns);
}

// ---- forgetting a stream ----

#[test]
fn a_forgotten_stream_is_synchronised_once_and_never_named_again() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    // Two streams: frees on S1 leave hazards and events of S1.
    let keep = alloc.allocate(2 * MIB, S2).unwrap();
    let a = alloc.allocate(6 * MIB, S1).unwrap();
    let used_on_s1 = alloc.allocate(2 * MIB, S2).unwrap();
    alloc.record_stream(used_on_s1.ptr, S1).unwrap();
    let still_live_on_s1 = alloc.allocate(2 * MIB, S1).unwrap();
    alloc.free(a.ptr).unwrap();
    rec.clear();
    alloc.forget_stream(S1).unwrap();
    let calls = rec.calls();
    assert_eq!(
        calls.iter().filter(|c| **c == Call::Sync(S1)).count(),
        1,
        "synchronised once: {calls:?}"
    );
    assert_eq!(calls.last(), Some(&Call::Forget(S1)));
    rec.clear();
    // S1's freed memory is plain free memory now: S2 takes it without a wait.
    let b = alloc.allocate(6 * MIB, S2).unwrap();
    assert_eq!(b.ptr, a.ptr, "the forgotten stream's freed range is reused");
    // Blocks used on S1 are freed without a call on S1; so is everything after.
    alloc.free(used_on_s1.ptr).unwrap();
    alloc.free(still_live_on_s1.ptr).unwrap();
    alloc.free(b.ptr).unwrap();
    alloc.free(keep.ptr).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    drop(alloc);
    let after = rec.calls();
    assert!(
        after.iter().all(|c| c.stream() != Some(S1)),
        "S1 named after it was forgotten: {after:?}"
    );
    assert!(!after.contains(&Call::Wait { waiter: S2 }), "{after:?}");
    assert!(sim.leak_report().is_empty(), "{}", sim.leak_report());
}

#[test]
fn a_stream_forgotten_then_named_again_is_a_new_stream() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    let other = alloc.allocate(2 * MIB, S2).unwrap();
    let a = alloc.allocate(4 * MIB, S1).unwrap();
    alloc.free(a.ptr).unwrap();
    alloc.forget_stream(S1).unwrap();
    // The driver gave the same handle to a new stream.
    let b = alloc.allocate(4 * MIB, S1).unwrap();
    alloc.free(b.ptr).unwrap();
    alloc.free(other.ptr).unwrap();
    alloc.check_invariants().unwrap();
    assert!(matches!(
        alloc.forget_stream(StreamId::DEFAULT),
        Err(AllocError::StreamBusy { .. })
    ));
    alloc.forget_stream(S1).unwrap();
    alloc.forget_stream(StreamId(99)).unwrap(); // never seen: only the backend forgets it
    drop(alloc);
    assert!(sim.leak_report().is_empty(), "{}", sim.leak_report());
}

#[test]
fn the_caching_baselines_forget_a_stream_too() {
    for expandable in [false, true] {
        let sim = sim(1 << 30);
        let rec = Recorder::new(sim.clone());
        let alloc: Box<dyn DeviceAllocator> = if expandable {
            Box::new(CachingAllocator::new(rec.clone(), CachingConfig::expandable()).unwrap())
        } else {
            Box::new(CachingAllocator::new(rec.clone(), CachingConfig::classic()).unwrap())
        };
        // A block of S1 used on S2 (its free waits for an event of S2), a
        // live one used on S2, and S1's own blocks cached in its segments.
        let a = alloc.allocate(6 * MIB, S1).unwrap();
        let live = alloc.allocate(2 * MIB, S1).unwrap();
        alloc.record_stream(a.ptr, S2).unwrap();
        alloc.record_stream(live.ptr, S2).unwrap();
        alloc.free(a.ptr).unwrap();
        rec.clear();
        alloc.forget_stream(S2).unwrap();
        let calls = rec.calls();
        assert_eq!(
            calls.iter().filter(|c| **c == Call::Sync(S2)).count(),
            1,
            "expandable {expandable}: {calls:?}"
        );
        alloc.forget_stream(S1).unwrap();
        rec.clear();
        alloc.free(live.ptr).unwrap();
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        assert_eq!(alloc.stats().reserved_bytes.current, 0);
        drop(alloc);
        let after = rec.calls();
        assert!(
            after
                .iter()
                .all(|c| c.stream() != Some(S1) && c.stream() != Some(S2)),
            "expandable {expandable}: a forgotten stream named: {after:?}"
        );
        assert!(sim.leak_report().is_empty(), "{}", sim.leak_report());
    }
    // The offset baseline cannot forget a stream, and says so.
    let sim = sim(1 << 30);
    let offset = OffsetAllocator::new(sim, OffsetConfig::default()).unwrap();
    assert!(matches!(
        offset.forget_stream(S1),
        Err(AllocError::StreamBusy { .. })
    ));
}

// ---- stream capture ----

/// Checks that the simulator refused nothing and left `s`'s capture valid.
fn end_capture_cleanly(sim: &SimVmm, s: StreamId) {
    assert_eq!(
        sim.capture_violations(),
        0,
        "a call forbidden under capture"
    );
    sim.end_capture(s).expect("the capture was not invalidated");
}

#[test]
fn no_event_is_recorded_on_or_queried_for_a_capturing_stream() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    let _two_streams = alloc.allocate(MIB, S2).unwrap();
    let warm = alloc.allocate(4 * MIB, S1).unwrap();
    alloc.free(warm.ptr).unwrap();
    sim.begin_capture(S1).unwrap();
    rec.clear();
    let mut blocks = Vec::new();
    for i in 0..20u64 {
        blocks.push(alloc.allocate((1 + i % 5) * MIB, S1).unwrap());
        if i % 3 == 2 {
            alloc.free(blocks.remove(0).ptr).unwrap();
        }
    }
    for b in blocks {
        alloc.free(b.ptr).unwrap();
    }
    let calls = rec.calls();
    assert!(
        !calls.contains(&Call::Record(S1)),
        "an event recorded on the capturing stream: {calls:?}"
    );
    assert!(!calls.contains(&Call::Sync(S1)), "{calls:?}");
    end_capture_cleanly(&sim, S1);
    alloc.check_invariants().unwrap();
}

/// Whether two blocks share a byte.
fn overlap(a: quilt_alloc::Allocation, b: quilt_alloc::Allocation) -> bool {
    a.ptr < b.ptr + b.size && b.ptr < a.ptr + a.size
}

/// A block freed while its stream captures a graph: the free makes no
/// driver call (with events at frees, only the question whether the stream
/// captures: it records no event there); the capturing stream may place a block there in the capture
/// (stream order, which the graph keeps); no other stream gets the range
/// until the capture ends (its work runs only when the graph is launched,
/// so nothing could order another stream after it), and none is made to
/// wait for, or synchronise, the capturing stream.
#[test]
fn a_block_freed_in_a_capture_goes_to_no_other_stream_until_it_ends() {
    // Two streams known before the capture, and a second stream seen for
    // the first time during it (hazards built from the pages then).
    for second_known_before in [true, false] {
        let sim = sim(1 << 30);
        let rec = Recorder::new(sim.clone());
        let alloc = quilt(rec.clone());
        let other = if second_known_before {
            Some(alloc.allocate(MIB, S2).unwrap())
        } else {
            None
        };
        let a = alloc.allocate(8 * MIB, S1).unwrap();
        sim.begin_capture(S1).unwrap();
        rec.clear();
        alloc.free(a.ptr).unwrap();
        assert!(
            rec.calls().iter().all(|&c| c == Call::IsCapturing(S1)),
            "the free made a call: {:?}",
            rec.calls()
        );
        assert!(matches!(
            alloc.free(a.ptr),
            Err(AllocError::DoubleFree { .. })
        ));
        assert!(matches!(
            alloc.record_stream(a.ptr, S2),
            Err(AllocError::UnknownPointer { .. })
        ));
        let elsewhere = alloc.allocate(8 * MIB, S2).unwrap();
        assert!(
            !overlap(elsewhere, a),
            "{elsewhere:?} on another stream overlaps {a:?}, freed in the capture \
             (second stream known before: {second_known_before})"
        );
        let calls = rec.calls();
        assert!(
            !calls
                .iter()
                .any(|&c| c.stream() == Some(S1) && c != Call::IsCapturing(S1)),
            "a call on the capturing stream: {calls:?}"
        );
        assert!(!calls.contains(&Call::DeviceSync), "{calls:?}");
        alloc.check_invariants().unwrap();
        // In the capture, the capturing stream itself may take the range back.
        let during = alloc.allocate(8 * MIB, S1).unwrap();
        alloc.free(during.ptr).unwrap();
        alloc.check_invariants().unwrap();
        end_capture_cleanly(&sim, S1);
        alloc.free(elsewhere.ptr).unwrap();
        if let Some(o) = other {
            alloc.free(o.ptr).unwrap();
        }
        alloc.check_invariants().unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.stats().reserved_bytes.current, 0);
    }
}

#[test]
fn a_capturing_stream_is_never_synchronised_nor_made_to_wait() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    // S2 frees a range S1 will want: reusing it orders S1 after S2's work.
    let a = alloc.allocate(8 * MIB, S2).unwrap();
    let _s1 = alloc.allocate(MIB, S1).unwrap();
    alloc.free(a.ptr).unwrap();
    sim.begin_capture(S1).unwrap();
    rec.clear();
    let b = alloc.allocate(8 * MIB, S1).unwrap();
    let calls = rec.calls();
    assert!(!calls.contains(&Call::Wait { waiter: S1 }), "{calls:?}");
    assert!(!calls.contains(&Call::Sync(S1)), "{calls:?}");
    // Emptying the cache must not synchronise the capturing stream either.
    let c = alloc.allocate(4 * MIB, S1).unwrap();
    alloc.free(c.ptr).unwrap();
    let _ = alloc.empty_cache(); // may refuse what needs S1 synchronised
    assert!(!rec.calls().contains(&Call::Sync(S1)), "{:?}", rec.calls());
    end_capture_cleanly(&sim, S1);
    alloc.free(b.ptr).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_capturing_stream_cannot_be_forgotten_and_the_drop_does_not_synchronise_it() {
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    let a = alloc.allocate(2 * MIB, S1).unwrap();
    alloc.free(a.ptr).unwrap();
    sim.begin_capture(S1).unwrap();
    assert!(matches!(
        alloc.forget_stream(S1),
        Err(AllocError::StreamBusy { .. })
    ));
    rec.clear();
    drop(alloc);
    assert!(!rec.calls().contains(&Call::Sync(S1)), "{:?}", rec.calls());
    end_capture_cleanly(&sim, S1);
}

// ---- address space ----

#[test]
fn exhausted_address_space_is_not_out_of_memory() {
    let sim = Arc::new(
        SimVmm::new(SimConfig {
            capacity: 1 << 30,
            va_limit: 512 * MIB,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let alloc = quilt(sim.clone());
    let err = alloc.allocate(4 * MIB, S1).unwrap_err();
    match &err {
        AllocError::AddressSpaceExhausted { source, .. } => {
            assert!(matches!(source, VmmError::AddressSpaceExhausted { .. }))
        }
        other => panic!("expected AddressSpaceExhausted, got {other}"),
    }
    assert!(err.oom_report().is_none());
    assert!(alloc.last_oom().is_none());
    assert_eq!(alloc.stats().num_ooms, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_free_held_for_a_recorded_stream_asks_nothing_of_a_capturing_stream() {
    // A block of S1 recorded on S2, freed while S2's work runs, is held
    // (see `held.rs`). While S1 captures, its allocations do not poll the
    // held free (as PyTorch skips `process_events` during a capture), make
    // no call the capture forbids and do not reuse it; after the capture,
    // with S2 done, the held block serves S1 again.
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    let x = alloc.allocate(8 * MIB, S1).unwrap();
    alloc.record_stream(x.ptr, S2).unwrap();
    alloc.free(x.ptr).unwrap();
    alloc.check_invariants().unwrap();
    sim.begin_capture(S1).unwrap();
    rec.clear();
    let y = alloc.allocate(8 * MIB, S1).unwrap();
    assert!(!overlap(x, y), "{y:?} reuses the held {x:?}");
    let calls = rec.calls();
    assert!(!calls.contains(&Call::Record(S1)), "{calls:?}");
    alloc.free(y.ptr).unwrap();
    end_capture_cleanly(&sim, S1);
    alloc.check_invariants().unwrap();
    sim.complete_all();
    let z = alloc.allocate(8 * MIB, S1).unwrap();
    assert_eq!(z.ptr, x.ptr, "released once S2's work is done");
    alloc.free(z.ptr).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().num_stream_waits, 0);
}

#[test]
fn a_recorded_block_freed_during_its_streams_capture_is_not_held() {
    // Freed while its own stream captures, the block is not held (its
    // hazard already keeps other streams off it until the capture ends) and
    // the free records nothing on the capturing stream.
    let sim = sim(1 << 30);
    let rec = Recorder::new(sim.clone());
    let alloc = quilt(rec.clone());
    let x = alloc.allocate(8 * MIB, S1).unwrap();
    alloc.record_stream(x.ptr, S2).unwrap();
    sim.begin_capture(S1).unwrap();
    rec.clear();
    alloc.free(x.ptr).unwrap();
    let calls = rec.calls();
    assert!(!calls.contains(&Call::Record(S1)), "{calls:?}");
    assert!(!calls.contains(&Call::Query), "{calls:?}");
    let snapshot = alloc.snapshot();
    let pending = snapshot
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .any(|b| b.state == quilt_alloc::BlockState::PendingFree);
    assert!(!pending, "held though freed under capture");
    end_capture_cleanly(&sim, S1);
    alloc.check_invariants().unwrap();
}
