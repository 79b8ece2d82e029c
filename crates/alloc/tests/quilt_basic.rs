//! Quilt on the simulated backend: packing, caching, streams, bad input, drop,
//! threads, and what issue 8 demands of the core: one driver handle per page,
//! mapped whole at offset 0; no page under a live block ever unmapped; no
//! stream synchronisation without memory pressure, and then only of the
//! streams that freed on the pages reclaimed; no storm of cross-stream waits
//! or event queries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use quilt_alloc::quilt::{
    ArenaLayout, ArenaSharing, EventTiming, MemoryLimit, PageSize, Placement, PoolConfig,
    QuiltAllocator, QuiltConfig, ReclaimPolicy, SmallBlocks,
};
use quilt_alloc::snapshot::BlockState;
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::sim::{Fault, SimVmm};
use quilt_vmm::{CallKind, DevicePtr, DriverStats, EventId, MemInfo, PhysHandle, StreamId, Vmm};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

fn setup(capacity: u64) -> (Arc<SimVmm>, QuiltAllocator) {
    setup_with(capacity, QuiltConfig::default())
}

fn setup_with(capacity: u64, config: QuiltConfig) -> (Arc<SimVmm>, QuiltAllocator) {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, config).unwrap();
    (sim, a)
}

/// What the spy saw: the size of every handle created, every map that was
/// not one whole handle at offset 0, every unmap that was not one page, and
/// the stream of every synchronisation, in order.
#[derive(Debug, Default)]
struct SpyLog {
    handle_size: HashMap<PhysHandle, u64>,
    bad_maps: Vec<String>,
    bad_unmaps: Vec<String>,
    maps: u64,
    unmaps: u64,
    syncs: Vec<StreamId>,
}

/// A [`Vmm`] that passes every call to a [`SimVmm`] and watches the calls the
/// simulator (until its strict ledger lands) does not refuse.
#[derive(Debug)]
struct Spy {
    sim: Arc<SimVmm>,
    page: u64,
    log: Mutex<SpyLog>,
}

impl Spy {
    fn log(&self) -> std::sync::MutexGuard<'_, SpyLog> {
        self.log.lock().unwrap()
    }

    /// Panics unless every map was one whole page-sized handle at offset 0,
    /// every unmap one page, and the simulator's mapped bytes are exactly the
    /// pages mapped and not unmapped.
    fn assert_one_handle_per_mapping(&self) {
        let l = self.log();
        assert!(
            l.bad_maps.is_empty(),
            "maps not of one whole handle: {:?}",
            l.bad_maps
        );
        assert!(
            l.bad_unmaps.is_empty(),
            "unmaps not of one page: {:?}",
            l.bad_unmaps
        );
        assert!(
            l.handle_size.values().all(|&s| s == self.page),
            "a handle is not one page"
        );
        assert_eq!(self.sim.mapped_bytes(), (l.maps - l.unmaps) * self.page);
    }
}

impl Vmm for Spy {
    fn backend_name(&self) -> &'static str {
        "spy"
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
        let h = self.sim.create(size)?;
        self.log().handle_size.insert(h, size);
        Ok(h)
    }
    fn release(&self, handle: PhysHandle) -> quilt_vmm::Result<()> {
        self.sim.release(handle)
    }
    fn map(
        &self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> quilt_vmm::Result<()> {
        self.sim.map(ptr, size, handle, offset)?;
        let mut l = self.log();
        l.maps += 1;
        let whole = l.handle_size.get(&handle).copied();
        if offset != 0 || whole != Some(size) {
            l.bad_maps.push(format!(
                "map {ptr:#x} size {size} of {handle:?} (size {whole:?}) at offset {offset}"
            ));
        }
        Ok(())
    }
    fn unmap(&self, ptr: DevicePtr, size: u64) -> quilt_vmm::Result<()> {
        self.sim.unmap(ptr, size)?;
        let mut l = self.log();
        l.unmaps += 1;
        if size != self.page {
            l.bad_unmaps.push(format!("unmap {ptr:#x} size {size}"));
        }
        Ok(())
    }
    fn set_access(&self, ptr: DevicePtr, size: u64) -> quilt_vmm::Result<()> {
        self.sim.set_access(ptr, size)
    }
    fn mem_info(&self) -> quilt_vmm::Result<MemInfo> {
        self.sim.mem_info()
    }
    fn event_record(&self, stream: StreamId) -> quilt_vmm::Result<EventId> {
        self.sim.event_record(stream)
    }
    fn event_record_on(&self, event: EventId, stream: StreamId) -> quilt_vmm::Result<()> {
        self.sim.event_record_on(event, stream)
    }
    fn event_query(&self, event: EventId) -> quilt_vmm::Result<bool> {
        self.sim.event_query(event)
    }
    fn event_destroy(&self, event: EventId) -> quilt_vmm::Result<()> {
        self.sim.event_destroy(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventId) -> quilt_vmm::Result<()> {
        self.sim.stream_wait_event(stream, event)
    }
    fn stream_synchronize(&self, stream: StreamId) -> quilt_vmm::Result<()> {
        self.sim.stream_synchronize(stream)?;
        self.log().syncs.push(stream);
        Ok(())
    }
    fn driver_stats(&self) -> DriverStats {
        self.sim.driver_stats()
    }
}

/// An allocator over a spy over a simulated device of `capacity` bytes.
fn spy_setup(capacity: u64, config: QuiltConfig) -> (Arc<SimVmm>, Arc<Spy>, QuiltAllocator) {
    let sim = Arc::new(SimVmm::with_capacity(capacity).unwrap());
    let page = config.pool.page_size.resolve(sim.granularity()).unwrap();
    let spy = Arc::new(Spy {
        sim: sim.clone(),
        page,
        log: Mutex::new(SpyLog::default()),
    });
    let v: Arc<dyn Vmm> = spy.clone();
    let a = QuiltAllocator::new(v, config).unwrap();
    (sim, spy, a)
}

fn syncs(sim: &SimVmm) -> u64 {
    sim.driver_stats().count(CallKind::StreamSynchronize)
}

fn per_stream() -> QuiltConfig {
    let mut config = QuiltConfig::default();
    config.layout.sharing = ArenaSharing::PerStream;
    config
}

fn ok(a: &QuiltAllocator) {
    a.check_invariants().unwrap();
}

#[test]
fn neighbours_share_boundary_pages() {
    let (sim, a) = setup(1 << 30);
    let size = 2 * MIB + MIB / 4; // 2.25 MiB
    let mut ptrs = Vec::new();
    for _ in 0..16 {
        let al = a.allocate(size, S0).unwrap();
        assert_eq!(al.size, size);
        ptrs.push(al.ptr);
        ok(&a);
    }
    for w in ptrs.windows(2) {
        assert_eq!(w[1] - w[0], size, "blocks are VA neighbours");
    }
    // 16 x 2.25 MiB = 36 MiB = 18 pages, not 16 x 4 MiB.
    assert_eq!(a.touched_bytes(), 36 * MIB);
    let st = a.stats();
    assert_eq!(st.allocated_bytes.current, 16 * size);
    for p in ptrs {
        a.free(p).unwrap();
        ok(&a);
    }
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn freed_blocks_are_reused_without_driver_calls() {
    let (_sim, a) = setup(1 << 30);
    let sizes = [3 * MIB + 512, 700 * 1024, 17 * MIB, 4096, 2 * MIB];
    let mut ptrs: Vec<u64> = sizes
        .iter()
        .map(|&s| a.allocate(s, S0).unwrap().ptr)
        .collect();
    for p in ptrs.drain(..) {
        a.free(p).unwrap();
    }
    let before = a.vmm().driver_stats().vmm_calls();
    for _ in 0..3 {
        let ps: Vec<u64> = sizes
            .iter()
            .map(|&s| a.allocate(s, S0).unwrap().ptr)
            .collect();
        for p in ps.into_iter().rev() {
            a.free(p).unwrap();
            ok(&a);
        }
    }
    assert_eq!(a.vmm().driver_stats().vmm_calls(), before);
}

#[test]
fn small_requests_pack_inside_pages() {
    let (_sim, a) = setup(1 << 30);
    let mut ptrs = Vec::new();
    for i in 0..1000u64 {
        ptrs.push(a.allocate(1 + (i % 8) * 512, S0).unwrap());
    }
    let used: u64 = ptrs.iter().map(|p| p.size).sum();
    assert!(a.touched_bytes() <= used.div_ceil(2 * MIB) * 2 * MIB);
    ok(&a);
}

#[test]
fn bad_input_is_a_typed_error() {
    let (sim, a) = setup(256 * MIB);
    assert!(matches!(
        a.allocate(0, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.allocate(u64::MAX, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.allocate(u64::MAX - 10, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    let e = a.allocate(512 * MIB, S0).unwrap_err();
    let r = e.oom_report().unwrap();
    assert_eq!(r.verdict, OomVerdict::Capacity);
    ok(&a);
    assert!(matches!(a.free(0), Err(AllocError::UnknownPointer { .. })));
    assert!(matches!(
        a.free(0xdead_beef),
        Err(AllocError::UnknownPointer { .. })
    ));
    let x = a.allocate(5 * MIB, S0).unwrap();
    assert!(matches!(
        a.free(x.ptr + 512),
        Err(AllocError::UnknownPointer { .. })
    ));
    a.free(x.ptr).unwrap();
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    assert!(a.record_stream(x.ptr, S1).is_err());
    ok(&a);
    let y = a.allocate(5 * MIB, S0).unwrap();
    a.free(y.ptr).unwrap();
    ok(&a);
    assert_eq!(a.stats().num_ooms, 1);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn drop_with_live_blocks_releases_everything() {
    let (sim, a) = setup(256 * MIB);
    for i in 0..20 {
        a.allocate(MIB * (i + 1) / 2 + 100, StreamId(i % 3))
            .unwrap();
    }
    let x = a.allocate(3 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty(), "{:?}", sim.leak_report());
}

/// The state the snapshot gives the block at `ptr`, if any.
fn block_state(a: &QuiltAllocator, ptr: u64) -> Option<BlockState> {
    a.snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.address == ptr)
        .map(|b| b.state)
}

#[test]
fn record_stream_free_is_held_while_the_recorded_stream_runs() {
    // As PyTorch: a block recorded on another stream whose work may still
    // run is not reused; its own stream gets fresh memory, and no stream
    // is chained to another.
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    ok(&a);
    a.free(x.ptr).unwrap();
    ok(&a);
    assert_eq!(block_state(&a, x.ptr), Some(BlockState::PendingFree));
    assert_eq!(a.stats().allocation.current, 0, "no longer allocated");
    assert_eq!(a.stats().active.current, 1, "still active, as in PyTorch");
    let y = a.allocate(4 * MIB, S0).unwrap();
    ok(&a);
    assert_ne!(y.ptr, x.ptr, "fresh memory while stream 1 may use x");
    assert_eq!(a.stats().num_stream_waits, 0, "no stream waits for another");
    assert_eq!(sim.driver_stats().count(CallKind::StreamWaitEvent), 0);
    assert_eq!(a.stats().active.current, 2);
    // A free of the held block is a double free.
    assert!(matches!(a.free(x.ptr), Err(AllocError::DoubleFree { .. })));
    // Stream 1's work done: the next allocation frees x for good, and its
    // own stream reuses it without a wait.
    sim.complete_stream(S1);
    let z = a.allocate(4 * MIB, S0).unwrap();
    ok(&a);
    assert_eq!(z.ptr, x.ptr, "reused once the recorded work is done");
    assert_eq!(a.stats().num_stream_waits, 0);
    assert_eq!(a.stats().num_recorded_frees_forced, 0);
    assert_eq!(a.stats().active.current, 2);
    a.free(y.ptr).unwrap();
    a.free(z.ptr).unwrap();
    ok(&a);
    assert_eq!(syncs(&sim), 0);
}

#[test]
fn record_stream_held_free_once_released_serves_other_streams_as_any_free() {
    // Released (the recorded stream done), the range carries its own
    // stream's work only: another stream reuses it behind a wait for the
    // owner alone, as for any block freed on another stream.
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    sim.complete_stream(S1);
    let y = a.allocate(4 * MIB, S2).unwrap();
    ok(&a);
    assert_eq!(y.ptr, x.ptr);
    assert_eq!(a.stats().num_stream_waits, 1, "stream 2 waits for 0 only");
    a.free(y.ptr).unwrap();
    ok(&a);
    assert_eq!(syncs(&sim), 0);
}

#[test]
fn record_stream_held_free_is_reused_behind_a_wait_under_pressure() {
    // Only when memory runs out does a held block serve behind a wait for
    // the recorded stream: counted, and as a retry, not an out-of-memory.
    let (sim, a) = setup(16 * MIB);
    let x = a.allocate(12 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    let y = a.allocate(12 * MIB, S0).unwrap();
    ok(&a);
    assert_eq!(y.ptr, x.ptr, "the held block's memory, under pressure");
    let st = a.stats();
    assert_eq!(st.num_recorded_frees_forced, 1);
    assert_eq!(st.num_stream_waits, 1, "stream 0 waits for stream 1");
    assert_eq!(sim.driver_stats().count(CallKind::StreamWaitEvent), 1);
    assert_eq!(st.num_ooms, 0);
    assert_eq!(st.num_alloc_retries, 1);
    assert!(a.last_oom().is_none(), "{:?}", a.last_oom());
    a.free(y.ptr).unwrap();
    ok(&a);
    // Nothing held and still too big: out of memory, as before.
    let x = a.allocate(12 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    assert!(matches!(
        a.allocate(32 * MIB, S0),
        Err(AllocError::OutOfMemory(_))
    ));
    ok(&a);
    assert_eq!(a.stats().num_ooms, 1);
    assert_eq!(a.stats().num_recorded_frees_forced, 2);
    assert_eq!(syncs(&sim), 0);
}

#[test]
fn empty_cache_completes_held_frees() {
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.free(x.ptr).unwrap();
    assert_eq!(a.stats().active.current, 1);
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(a.stats().active.current, 0);
    assert_eq!(a.stats().reserved_bytes.current, 0, "every page released");
    assert_eq!(block_state(&a, x.ptr), None);
    assert!(syncs(&sim) >= 1, "stream 1 synchronised");
}

#[test]
fn record_stream_reuse_needs_no_wait_once_the_event_completed() {
    // The work is declared: the events recorded on demand once the device
    // caught up complete at once.
    for stream in [S0, S1, S2] {
        let (sim, a) = setup(256 * MIB);
        sim.queue_work(S0);
        let x = a.allocate(4 * MIB, S0).unwrap();
        a.record_stream(x.ptr, S1).unwrap();
        sim.queue_work(S0);
        sim.queue_work(S1);
        a.free(x.ptr).unwrap();
        ok(&a);
        sim.complete_all();
        let y = a.allocate(4 * MIB, stream).unwrap();
        ok(&a);
        assert_eq!(y.ptr, x.ptr);
        assert_eq!(a.stats().num_stream_waits, 0, "{stream:?}");
        assert_eq!(sim.driver_stats().count(CallKind::StreamWaitEvent), 0);
        a.free(y.ptr).unwrap();
        ok(&a);
        assert_eq!(syncs(&sim), 0);
    }
}

#[test]
fn shared_arena_reuses_another_streams_block_after_a_wait() {
    let (sim, a) = setup(256 * MIB);
    let x = a.allocate(40 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let calls = sim.driver_stats().vmm_calls();
    let y = a.allocate(40 * MIB, S1).unwrap();
    assert_eq!(y.ptr, x.ptr, "the block freed on stream 0 serves stream 1");
    assert_eq!(sim.driver_stats().vmm_calls(), calls, "no VMM call");
    assert_eq!(
        a.stats().num_stream_waits,
        1,
        "stream 1 waited for stream 0"
    );
    // Reuse on the freeing stream itself needs no wait.
    a.free(y.ptr).unwrap();
    let z = a.allocate(40 * MIB, S1).unwrap();
    assert_eq!(a.stats().num_stream_waits, 1);
    a.free(z.ptr).unwrap();
    ok(&a);
}

#[test]
fn cached_pages_move_to_another_stream_under_pressure() {
    let (sim, spy, a) = spy_setup(64 * MIB, per_stream());
    let x = a.allocate(60 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    // Stream 1's arena needs the pages cached in stream 0's, whose work may
    // still use them: their handles move to stream 1's arena, stream 1 waits
    // for stream 0's work, and their old mappings stay (retired) until that
    // work is known complete. No synchronisation.
    let y = a.allocate(40 * MIB, S1).unwrap();
    ok(&a);
    let st = a.stats();
    assert_eq!(st.num_stream_waits, 1, "stream 1 waits for stream 0 once");
    assert!(spy.log().syncs.is_empty(), "no sync");
    assert!(st.reserved_bytes.current <= 64 * MIB);
    spy.assert_one_handle_per_mapping();
    // Once stream 0's work is done, the next growth path unmaps the retired
    // mappings without a sync.
    sim.complete_all();
    let z = a.allocate(20 * MIB, S0).unwrap();
    ok(&a);
    assert!(spy.log().syncs.is_empty(), "still no sync");
    a.free(z.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(syncs(&sim) <= 2);
    spy.assert_one_handle_per_mapping();
}

#[test]
fn retired_pages_are_unmapped_once_their_work_is_done() {
    // One stream, a 64 MiB device: a 40 MiB block freed while its work is
    // still queued, then a 60 MiB request that only fits by taking those
    // pages: they move under the new block at once (the same stream orders
    // the reuse), their old mappings wait for the work to finish.
    let (sim, spy, a) = spy_setup(64 * MIB, QuiltConfig::default());
    let keep = a.allocate(2 * MIB, S0).unwrap();
    let x = a.allocate(40 * MIB, S0).unwrap();
    let y = a.allocate(10 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    ok(&a);
    let big = a.allocate(50 * MIB, S0).unwrap();
    ok(&a);
    assert!(spy.log().syncs.is_empty(), "no sync: the pages moved");
    assert_eq!(a.stats().num_stream_waits, 0, "one stream: no wait");
    let mapped = sim.mapped_bytes();
    assert!(
        mapped > a.stats().reserved_bytes.current,
        "the old mappings are still there ({mapped} bytes mapped)"
    );
    // The device catches up; the next request that needs new pages unmaps
    // them first (a driver call follows anyway), without a sync, even one
    // that then fails for want of memory.
    sim.complete_all();
    let e = a.allocate(16 * MIB, S0).unwrap_err();
    assert!(e.oom_report().is_some(), "{e}");
    ok(&a);
    assert_eq!(sim.mapped_bytes(), a.stats().reserved_bytes.current);
    assert!(spy.log().syncs.is_empty());
    spy.assert_one_handle_per_mapping();
    for p in [y.ptr, big.ptr, keep.ptr] {
        a.free(p).unwrap();
    }
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn scattered_pages_serve_a_large_request() {
    // 64 MiB device: fill it with 2 MiB blocks, free every other one, then ask
    // for 32 MiB: only scattered pages are left, and they suffice.
    let (_sim, a) = setup(64 * MIB);
    let ptrs: Vec<u64> = (0..32)
        .map(|_| a.allocate(2 * MIB, S0).unwrap().ptr)
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    ok(&a);
    let big = a.allocate(32 * MIB, S0).unwrap();
    ok(&a);
    assert!(a.allocate(2 * MIB + 1, S0).is_err());
    a.free(big.ptr).unwrap();
    ok(&a);
}

#[test]
fn driver_failures_leave_state_consistent() {
    for kind in [
        CallKind::Create,
        CallKind::Map,
        CallKind::SetAccess,
        CallKind::Reserve,
    ] {
        let (sim, a) = setup(64 * MIB);
        let keep = a.allocate(3 * MIB, S0).unwrap();
        sim.inject(Fault::nth(kind, 1));
        let r = a.allocate(20 * MIB, S1);
        ok(&a);
        if let Ok(x) = r {
            a.free(x.ptr).unwrap();
        }
        let x = a.allocate(20 * MIB, S1).unwrap();
        a.free(x.ptr).unwrap();
        a.free(keep.ptr).unwrap();
        ok(&a);
        drop(a);
        assert!(sim.leak_report().is_empty(), "{kind:?}");
    }
    // A failing unmap during reclaim (per-stream arenas: stream 1 must take
    // stream 0's cached pages, whose work is complete, so they are unmapped).
    // Work is declared, so that the event recorded on demand once the
    // device caught up completes at once.
    let (sim, a) = setup_with(32 * MIB, per_stream());
    sim.queue_work(S1);
    let w = a.allocate(512, S1).unwrap();
    a.free(w.ptr).unwrap();
    sim.queue_work(S0);
    let x = a.allocate(28 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    sim.complete_all();
    sim.inject(Fault::nth(CallKind::Unmap, 1));
    assert!(a.allocate(20 * MIB, S1).is_err());
    ok(&a);
    let y = a.allocate(20 * MIB, S1).unwrap();
    a.free(y.ptr).unwrap();
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn memory_limit_is_honoured() {
    let sim = Arc::new(SimVmm::with_capacity(1 << 30).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(
        v,
        QuiltConfig::default().with_limit(MemoryLimit::Bytes(64 * MIB)),
    )
    .unwrap();
    let x = a.allocate(60 * MIB, S0).unwrap();
    let e = a.allocate(8 * MIB, S0).unwrap_err();
    assert_eq!(e.oom_report().unwrap().verdict, OomVerdict::Capacity);
    assert!(a.stats().reserved_bytes.peak <= 64 * MIB);
    a.free(x.ptr).unwrap();
    ok(&a);
}

#[test]
fn eight_threads_on_eight_streams() {
    let (sim, a) = setup(2 << 30);
    let a = Arc::new(a);
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut live = Vec::new();
                let mut x = t * 7919 + 1;
                for i in 0..400u64 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if live.len() > 20 || (i % 3 == 2 && !live.is_empty()) {
                        let idx = (x >> 33) as usize % live.len();
                        let p: u64 = live.swap_remove(idx);
                        a.free(p).unwrap();
                    } else {
                        let size = 1 + (x >> 40) % (12 * MIB);
                        if let Ok(al) = a.allocate(size, StreamId(t)) {
                            live.push(al.ptr);
                        }
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().allocation.current, 0);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn allocator_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<QuiltAllocator>();
}

#[test]
fn gmlake_preset_is_a_configuration() {
    let sim = Arc::new(SimVmm::with_capacity(2 << 30).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, QuiltConfig::gmlake()).unwrap();
    assert_eq!(a.name(), "gmlake");
    let before = sim.driver_stats();
    let x = a.allocate(10 * MIB, S0).unwrap();
    let d = sim.driver_stats().since(&before);
    // One 2 MiB handle per page, mapped and access-set one by one.
    assert_eq!(d.count(CallKind::Create), 5);
    assert_eq!(d.count(CallKind::Map), 5);
    assert_eq!(d.count(CallKind::SetAccess), 5);
    // Below the stitch threshold, fresh blocks start on a page: no boundary sharing.
    let y = a.allocate(3 * MIB, S0).unwrap();
    let z = a.allocate(3 * MIB, S0).unwrap();
    assert_eq!(y.ptr % (2 * MIB), 0);
    assert_eq!(z.ptr - y.ptr, 4 * MIB);
    ok(&a);
    // A cached block is reused without driver calls.
    a.free(x.ptr).unwrap();
    let calls = sim.driver_stats().vmm_calls();
    let x2 = a.allocate(10 * MIB, S0).unwrap();
    assert_eq!(x2.ptr, x.ptr);
    assert_eq!(sim.driver_stats().vmm_calls(), calls);
    // At or above the threshold, requests are stitched from pages anywhere.
    let big = a.allocate(600 * MIB, S0).unwrap();
    ok(&a);
    for p in [x2.ptr, y.ptr, z.ptr, big.ptr] {
        a.free(p).unwrap();
    }
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn gmlake_preset_survives_pressure() {
    let sim = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let v: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(v, QuiltConfig::gmlake()).unwrap();
    let ptrs: Vec<u64> = (0..16)
        .map(|_| a.allocate(3 * MIB, S0).unwrap().ptr)
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
    }
    ok(&a);
    // 8 x 4 MiB of pages are cached: a fresh 30 MiB block needs 15 of them.
    let big = a.allocate(30 * MIB, S1).unwrap();
    ok(&a);
    a.free(big.ptr).unwrap();
    for p in ptrs.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
    }
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------
// Issue 8: what the core must be true to on a GPU.
// ---------------------------------------------------------------------------

/// A small deterministic generator (xorshift64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Addresses inside `ptr .. ptr + len` one granule apart, plus the last byte:
/// every page of the block is sampled whatever the page size.
fn sample_addrs(ptr: u64, len: u64, granule: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..len.div_ceil(granule))
        .map(|i| ptr + i * granule)
        .collect();
    v.push(ptr + len - 1);
    v
}

/// Live blocks of a pressure run: pointer -> (size, the translation of each
/// sampled address).
type LiveMap = BTreeMap<u64, (u64, Vec<(u64, (PhysHandle, u64))>)>;

/// What a pressure run leaves to assert on.
struct PressureRun {
    sim: Arc<SimVmm>,
    spy: Arc<Spy>,
    a: QuiltAllocator,
    ooms: u64,
    peak_live: u64,
}

/// A random workload at a tight capacity on three streams (allocations of 1
/// byte to 12 MiB, frees, record_stream, the device catching up now and then,
/// an `empty_cache` every 700 operations). After every operation: the
/// invariants; every live block's bytes still translate to the very handle
/// and offset they had when it was allocated (no page under a live block is
/// ever unmapped or remapped); and every out-of-memory is a capacity verdict
/// with fewer untouched pages (free, cached or creatable) than the request
/// could need.
fn pressure_run(capacity: u64, config: QuiltConfig, seed: u64, ops: u64) -> PressureRun {
    let (sim, spy, a) = spy_setup(capacity, config);
    let granule = sim.granularity();
    let page = a.pool_stats().page_size;
    let cap_pages = a.pool_stats().limit_pages;
    let mut rng = Rng(seed);
    let mut live: LiveMap = BTreeMap::new();
    let (mut live_bytes, mut peak_live, mut ooms) = (0u64, 0u64, 0u64);
    for i in 0..ops {
        let r = rng.below(100);
        if (r < 40 || live_bytes > capacity * 3 / 4) && !live.is_empty() {
            let k = rng.below(live.len() as u64) as usize;
            let p = *live.keys().nth(k).unwrap();
            let (size, _) = live.remove(&p).unwrap();
            a.free(p).unwrap();
            live_bytes -= size;
        } else if r < 45 && !live.is_empty() {
            let k = rng.below(live.len() as u64) as usize;
            let p = *live.keys().nth(k).unwrap();
            a.record_stream(p, StreamId(rng.below(3))).unwrap();
        } else if r < 50 {
            sim.complete_stream(StreamId(rng.below(3)));
        } else {
            let size = match rng.below(4) {
                0 => 1 + rng.below(64 * KIB),
                1 => 1 + rng.below(MIB),
                _ => 1 + rng.below(12 * MIB),
            };
            match a.allocate(size, StreamId(rng.below(3))) {
                Ok(al) => {
                    let tr = sample_addrs(al.ptr, al.size, granule)
                        .into_iter()
                        .map(|x| (x, sim.translate(x).expect("a new block is mapped")))
                        .collect();
                    live.insert(al.ptr, (al.size, tr));
                    live_bytes += al.size;
                    peak_live = peak_live.max(live_bytes);
                }
                Err(e) => {
                    let rep = e.oom_report().unwrap_or_else(|| panic!("op {i}: {e}"));
                    ooms += 1;
                    if matches!(config.placement, Placement::GmlakeLimits { .. }) {
                        // GMLake serves smaller requests only from a cached
                        // block or fresh address space: no promise there.
                        continue;
                    }
                    assert_eq!(rep.verdict, OomVerdict::Capacity, "op {i}: {rep}");
                    // The central promise: at most ceil(size / page) + 1 new
                    // pages could be needed; the request failed, so fewer than
                    // that were free, cached or creatable.
                    let untouched = cap_pages - a.touched_bytes() / page;
                    assert!(
                        untouched < size.div_ceil(page) + 1,
                        "op {i}: {size} bytes refused with {untouched} pages untouched"
                    );
                }
            }
        }
        if i % 700 == 699 {
            a.empty_cache().unwrap();
        }
        a.check_invariants()
            .unwrap_or_else(|e| panic!("op {i}: {e}"));
        for (&p, (_, tr)) in &live {
            for &(x, want) in tr {
                assert_eq!(
                    sim.translate(x),
                    Some(want),
                    "op {i}: byte {x:#x} of live block {p:#x} was unmapped or remapped"
                );
            }
        }
    }
    for &p in live.keys() {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
    PressureRun {
        sim,
        spy,
        a,
        ooms,
        peak_live,
    }
}

fn pressure_configs() -> Vec<(&'static str, QuiltConfig)> {
    let mut big_page = QuiltConfig::default();
    big_page.pool.page_size = PageSize::Bytes(8 * MIB);
    let always = QuiltConfig {
        reclaim: ReclaimPolicy::Always,
        ..QuiltConfig::default()
    };
    let idle = QuiltConfig {
        reclaim: ReclaimPolicy::IdleFor(20),
        ..QuiltConfig::default()
    };
    vec![
        ("default", QuiltConfig::default()),
        ("gmlake", QuiltConfig::gmlake()),
        ("8 MiB pages", big_page),
        (
            "per-stream, small arena",
            QuiltConfig {
                layout: ArenaLayout {
                    sharing: ArenaSharing::PerStream,
                    small: SmallBlocks::PYTORCH,
                    ..QuiltConfig::default().layout
                },
                ..QuiltConfig::default()
            },
        ),
        ("reclaim always", always),
        ("reclaim idle 20", idle),
    ]
}

#[test]
fn every_page_is_one_handle_mapped_whole_at_offset_zero() {
    for (name, config) in pressure_configs() {
        let run = pressure_run(96 * MIB, config, 0x9e37_79b9_7f4a_7c15, 2500);
        let page = run.a.pool_stats().page_size;
        let st = run.a.stats();
        let d = run.sim.driver_stats();
        assert!(
            d.count(CallKind::Create) * page >= st.reserved_bytes.peak,
            "{name}: {} creates of {page} for a peak of {}",
            d.count(CallKind::Create),
            st.reserved_bytes.peak
        );
        assert_eq!(d.created_bytes, d.count(CallKind::Create) * page, "{name}");
        assert!(
            d.count(CallKind::Unmap) > 0,
            "{name}: the run never reclaimed"
        );
        assert_eq!(run.spy.log().maps, d.count(CallKind::Map), "{name}");
        run.spy.assert_one_handle_per_mapping();
        assert!(run.peak_live > 0);
        eprintln!(
            "{name}: {} OOMs, {} creates, {} maps, {} unmaps, {} syncs, {} waits",
            run.ooms,
            d.count(CallKind::Create),
            d.count(CallKind::Map),
            d.count(CallKind::Unmap),
            d.count(CallKind::StreamSynchronize),
            st.num_stream_waits
        );
        let sim = run.sim.clone();
        drop(run);
        assert!(
            sim.leak_report().is_empty(),
            "{name}: {:?}",
            sim.leak_report()
        );
    }
}

#[test]
fn live_blocks_stay_mapped_under_pressure() {
    // pressure_run checks every live block's translation after every operation.
    for seed in [1u64, 0xdead_beef, 0x2545_f491_4f6c_dd1d] {
        let run = pressure_run(48 * MIB, QuiltConfig::default(), seed, 2000);
        assert!(run.ooms > 0, "seed {seed:#x}: the capacity never ran out");
        assert!(run.sim.driver_stats().count(CallKind::Unmap) > 0);
        run.spy.assert_one_handle_per_mapping();
    }
}

#[test]
fn growth_creates_one_handle_per_page_and_maps_each_once() {
    // 10 MiB on a fresh allocator: five handles of 2 MiB, five maps, and as
    // many maps again only for pages that were unmapped in between.
    for (name, config) in pressure_configs() {
        let (sim, spy, a) = spy_setup(1 << 30, config);
        let page = a.pool_stats().page_size;
        let x = a.allocate(10 * MIB, S0).unwrap();
        ok(&a);
        let d = sim.driver_stats();
        let pages = (10 * MIB).div_ceil(page);
        assert!(d.count(CallKind::Create) >= pages, "{name}");
        assert_eq!(d.count(CallKind::Map), pages, "{name}: one map per page");
        a.free(x.ptr).unwrap();
        let y = a.allocate(10 * MIB, S0).unwrap();
        ok(&a);
        assert_eq!(
            sim.driver_stats().count(CallKind::Map),
            pages,
            "{name}: cached"
        );
        a.free(y.ptr).unwrap();
        a.empty_cache().unwrap();
        ok(&a);
        assert_eq!(sim.driver_stats().count(CallKind::Unmap), pages, "{name}");
        assert_eq!(sim.mapped_bytes(), 0);
        spy.assert_one_handle_per_mapping();
    }
}

#[test]
fn one_free_then_a_thousand_pairs_on_another_stream_wait_at_most_once() {
    // With stream 2 known before the free, and without.
    for register_first in [true, false] {
        let (sim, a) = setup(1 << 30);
        if register_first {
            let w = a.allocate(MIB, S2).unwrap();
            a.free(w.ptr).unwrap();
            ok(&a);
        }
        let x = a.allocate(3 * MIB, S1).unwrap();
        a.free(x.ptr).unwrap();
        ok(&a);
        let before = sim.driver_stats();
        let waits_before = a.stats().num_stream_waits;
        let sizes = [3 * MIB, MIB, 2 * MIB + 512 * KIB, 700 * KIB, 4 * MIB];
        for i in 0..1000 {
            let size = sizes[i % sizes.len()];
            let y = a.allocate(size, S2).unwrap();
            ok(&a);
            assert!(
                y.ptr < x.ptr + x.size && x.ptr < y.ptr + y.size,
                "pair {i}: the block does not cover the freed bytes"
            );
            a.free(y.ptr).unwrap();
            ok(&a);
        }
        let d = sim.driver_stats().since(&before);
        let ops = 2000;
        let waits = a.stats().num_stream_waits - waits_before;
        assert!(waits <= 1, "{waits} waits");
        assert_eq!(d.count(CallKind::StreamWaitEvent), waits);
        assert!(
            d.count(CallKind::EventQuery) <= 2 * ops,
            "{} event queries for {ops} operations",
            d.count(CallKind::EventQuery)
        );
        assert!(d.count(CallKind::EventRecord) <= ops);
        assert_eq!(d.count(CallKind::StreamSynchronize), 0);
        assert_eq!(d.vmm_calls(), 0, "{d:?}");
    }
}

#[test]
fn a_hundred_pending_frees_cost_no_query_storm() {
    let (sim, a) = setup(1 << 30);
    let ptrs: Vec<u64> = (0..100)
        .map(|i| a.allocate(64 * KIB + i * 4 * KIB, S1).unwrap().ptr)
        .collect();
    // Stream 2 exists before the frees, so each free leaves a hazard.
    let w = a.allocate(MIB, S2).unwrap();
    for p in ptrs {
        a.free(p).unwrap();
        ok(&a);
    }
    let before = sim.driver_stats();
    for i in 0..1000u64 {
        let y = a.allocate(32 * KIB + (i % 7) * 48 * KIB, S2).unwrap();
        ok(&a);
        a.free(y.ptr).unwrap();
        ok(&a);
    }
    a.free(w.ptr).unwrap();
    let d = sim.driver_stats().since(&before);
    let ops = 2001;
    assert!(
        d.count(CallKind::EventQuery) <= 2 * ops,
        "{} event queries for {ops} operations",
        d.count(CallKind::EventQuery)
    );
    assert!(
        a.stats().num_stream_waits <= 2,
        "{} waits for one stream's frees",
        a.stats().num_stream_waits
    );
    assert_eq!(d.count(CallKind::StreamSynchronize), 0);
}

/// The device never catches up: every event stays running. Stream 2 holds
/// a block; stream 1 allocates and frees 200 blocks, then 1,800 more, by
/// which time it runs solo (its frees leave no hazard; reuse on the
/// freeing stream needs no event). Then stream 2 places over stream 1's
/// latest free: it learns that the work is running (a query) and waits for
/// it once; and again, the wait covering it.
///
/// `events` decides the event records: by default (`OnDemand`) no free
/// records one, and the decision records one, on demand; with `AtFree`
/// each free records one while two streams exist, solo run included (the
/// hazards built when the run ends carry its frees' ticks), and the
/// decision records none.
fn churn_then_reuse_on_the_other_stream(events: EventTiming) {
    let (sim, a) = setup_with(
        1 << 30,
        QuiltConfig {
            events,
            ..QuiltConfig::default()
        },
    );
    let at_free = events == EventTiming::AtFree;
    let w = a.allocate(MIB, S2).unwrap();
    let churn = |n: u64| {
        for i in 0..n {
            let x = a.allocate(64 * KIB + (i % 5) * 4 * KIB, S1).unwrap();
            ok(&a);
            a.free(x.ptr).unwrap();
            ok(&a);
        }
    };
    let start = sim.driver_stats();
    churn(200);
    let d = sim.driver_stats().since(&start);
    let records = if at_free { 200 } else { 0 };
    assert_eq!(d.count(CallKind::EventRecord), records, "{d:?}");
    let before = sim.driver_stats();
    churn(1800);
    let d = sim.driver_stats().since(&before);
    let records = if at_free { 1800 } else { 0 };
    assert_eq!(d.count(CallKind::EventRecord), records, "{d:?}");
    if !at_free {
        assert_eq!(d.count(CallKind::EventQuery), 0, "{d:?}");
    }
    let queries = d.count(CallKind::EventQuery);
    let y = a.allocate(64 * KIB, S2).unwrap();
    ok(&a);
    let d = sim.driver_stats().since(&before);
    // On demand: one event recorded for the decision.
    let records = if at_free { 1800 } else { 1 };
    assert_eq!(d.count(CallKind::EventRecord), records, "{d:?}");
    assert!(d.count(CallKind::EventQuery) > queries, "{d:?}");
    assert_eq!(d.count(CallKind::StreamWaitEvent), 1, "{d:?}");
    let z = a.allocate(64 * KIB, S2).unwrap();
    ok(&a);
    let d = sim.driver_stats().since(&before);
    assert_eq!(d.count(CallKind::EventRecord), records, "{d:?}");
    assert_eq!(d.count(CallKind::StreamWaitEvent), 1, "{d:?}");
    a.free(z.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.free(w.ptr).unwrap();
    ok(&a);
    assert_eq!(sim.driver_stats().count(CallKind::StreamSynchronize), 0);
}

#[test]
fn frees_record_no_event_and_a_decision_records_one_on_demand() {
    churn_then_reuse_on_the_other_stream(EventTiming::OnDemand);
}

#[test]
fn at_free_every_free_records_an_event_once_two_streams_exist() {
    churn_then_reuse_on_the_other_stream(EventTiming::AtFree);
}

/// What a churn run measured.
struct Churn {
    ops: u64,
    calls: DriverStats,
    waits: u64,
    max_queries: u64,
}

impl Churn {
    fn per_op(&self, kind: CallKind) -> f64 {
        self.calls.count(kind) as f64 / self.ops as f64
    }

    fn waits_per_op(&self) -> f64 {
        self.waits as f64 / self.ops as f64
    }
}

/// 64 streams, round robin: each allocates a size from a cycle, then frees
/// its oldest block while it holds more than `hold`; the device catches up
/// (`complete_all`) every 64 operations, as a GPU running that far behind.
fn sixty_four_streams(config: QuiltConfig, rounds: u64, hold: usize) -> Churn {
    let (sim, a) = setup_with(4 << 30, config);
    let sizes = [
        512 * KIB,
        3 * MIB,
        700 * KIB,
        MIB + 4 * KIB,
        5 * MIB + 512,
        64 * KIB,
        2 * MIB,
        9 * MIB,
    ];
    let mut live: Vec<VecDeque<u64>> = vec![VecDeque::new(); 64];
    let mut ops = 0u64;
    let mut max_queries = 0;
    let before = sim.driver_stats();
    let mut step = |ops: &mut u64, f: &mut dyn FnMut()| {
        let q = sim.driver_stats().count(CallKind::EventQuery);
        f();
        max_queries = max_queries.max(sim.driver_stats().count(CallKind::EventQuery) - q);
        *ops += 1;
        if ops.is_multiple_of(64) {
            sim.complete_all();
        }
    };
    for round in 0..rounds {
        for s in 0..64u64 {
            let size = sizes[((round * 3 + s) % sizes.len() as u64) as usize];
            let q = &mut live[s as usize];
            step(&mut ops, &mut || {
                q.push_back(a.allocate(size, StreamId(s)).unwrap().ptr)
            });
            if q.len() > hold {
                let p = q.pop_front().unwrap();
                step(&mut ops, &mut || a.free(p).unwrap());
            }
            if round % 10 == 0 {
                ok(&a);
            }
        }
    }
    ok(&a);
    let calls = sim.driver_stats().since(&before);
    assert_eq!(
        calls.count(CallKind::StreamSynchronize),
        0,
        "no pressure, no sync"
    );
    assert_eq!(
        calls.count(CallKind::StreamWaitEvent),
        a.stats().num_stream_waits
    );
    Churn {
        ops,
        calls,
        waits: a.stats().num_stream_waits,
        max_queries,
    }
}

#[test]
fn sixty_four_streams_of_churn_query_few_events() {
    for hold in [0, 1, 3] {
        let c = sixty_four_streams(QuiltConfig::default(), 100, hold);
        let (q, r) = (
            c.per_op(CallKind::EventQuery),
            c.per_op(CallKind::EventRecord),
        );
        eprintln!(
            "shared, hold {hold}: {} ops, {:.4} waits/op, {q:.3} queries/op (at most {} in one), {r:.3} records/op",
            c.ops,
            c.waits_per_op(),
            c.max_queries
        );
        // Events recorded on demand (none at a free) cost this adversarial
        // churn more queries than events recorded at every free did (2.48
        // against 1.75 per operation at hold 1: an event recorded when a
        // stream reaches for another's frees completes later, so the frees
        // stay pending, and are polled, longer); real multi-stream
        // workloads record 10 to 15 times fewer events in exchange.
        assert!(q <= 3.0, "hold {hold}: {q} event queries per operation");
        assert!(r <= 2.0, "hold {hold}: {r} event records per operation");
        // Never one query per pending event: at most one per stream.
        assert!(
            c.max_queries <= 64,
            "hold {hold}: {} queries in one operation",
            c.max_queries
        );
    }
}

/// Adversarial churn: 64 streams reusing each other's frees within the GPU's
/// lag. Quilt's policy prefers a wait to new pages, so waits happen here, but
/// never a storm: fewer than one per operation (the core before issue 8 made
/// 19.5), never on completed work (checked by the spy above). The 0.05 goal of
/// issue 8 holds on the harness workloads, not in this synthetic worst case
/// (see docs/benchmarks.md).
#[test]
fn sixty_four_streams_of_churn_wait_less_than_once_per_operation() {
    for hold in [0, 1, 3] {
        let c = sixty_four_streams(QuiltConfig::default(), 100, hold);
        assert!(
            c.waits_per_op() < 1.0,
            "hold {hold}: {} waits per operation",
            c.waits_per_op()
        );
    }
}

#[test]
fn sixty_four_streams_on_per_stream_arenas_never_wait() {
    for hold in [0, 3] {
        let c = sixty_four_streams(per_stream(), 100, hold);
        eprintln!(
            "per-stream, hold {hold}: {:.3} queries/op (at most {} in one)",
            c.per_op(CallKind::EventQuery),
            c.max_queries
        );
        assert_eq!(c.waits, 0, "hold {hold}");
        assert!(
            c.max_queries <= 2 * 64,
            "hold {hold}: {} queries in one op",
            c.max_queries
        );
    }
}

#[test]
fn sixty_four_streams_on_per_stream_arenas_query_few_events() {
    let c = sixty_four_streams(per_stream(), 100, 3);
    let q = c.per_op(CallKind::EventQuery);
    assert!(q <= 2.0, "{q} event queries per operation");
}

/// A training-like loop on four streams at ample capacity: the same sizes
/// every iteration, blocks freed in an order that differs from their
/// allocation, some `record_stream`, events never completed by the device.
fn looped_multi_stream(a: &QuiltAllocator, iterations: u64) {
    let sizes = [
        40 * MIB,
        3 * MIB + 512,
        700 * KIB,
        17 * MIB,
        4 * KIB,
        2 * MIB,
        9 * MIB + 100,
        300 * KIB,
        25 * MIB,
        MIB,
    ];
    for it in 0..iterations {
        let mut live = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let s = StreamId(i as u64 % 4);
            let al = a.allocate(size, s).unwrap();
            ok(a);
            if i % 3 == 0 {
                a.record_stream(al.ptr, StreamId((i as u64 + 1) % 4))
                    .unwrap();
            }
            live.push(al.ptr);
            if i % 4 == 3 {
                a.free(live.remove(1)).unwrap();
                ok(a);
            }
        }
        let n = live.len();
        for k in 0..n {
            a.free(live[(k * 3 + it as usize) % n]).unwrap_or(());
        }
        ok(a);
    }
}

#[test]
fn no_stream_sync_without_memory_pressure() {
    let mut configs = pressure_configs();
    configs.push((
        "reclaim when full",
        QuiltConfig {
            reclaim: ReclaimPolicy::WhenFull,
            ..QuiltConfig::default()
        },
    ));
    configs.push((
        "cached above 0",
        QuiltConfig {
            reclaim: ReclaimPolicy::CachedAbove(0),
            ..QuiltConfig::default()
        },
    ));
    for (name, config) in configs {
        let (sim, a) = setup_with(4 << 30, config);
        looped_multi_stream(&a, 6);
        assert_eq!(a.stats().allocation.current, 0, "{name}");
        assert_eq!(syncs(&sim), 0, "{name}: synchronised without pressure");
    }
}

/// Stream B holds blocks on pages 0 and 21 and has a pending free on page 0;
/// stream A's 40 MiB block covered pages 1..=20 and was freed (as `parts`
/// blocks, freed one after another). Then B asks for 44 MiB, which fits only
/// past page 21: 22 new pages on a 32-page device, so cached pages must be
/// reclaimed. Returns the spy's syncs.
fn reclaim_after_frees_on_a(parts: u64, complete_before: bool) -> Vec<StreamId> {
    let (a_s, b_s) = (StreamId(7), StreamId(9));
    let (sim, spy, a) = spy_setup(64 * MIB, QuiltConfig::default());
    let b = a.allocate(MIB, b_s).unwrap();
    let e = a.allocate(MIB, b_s).unwrap();
    let xs: Vec<u64> = (0..parts)
        .map(|_| a.allocate(40 * MIB / parts, a_s).unwrap().ptr)
        .collect();
    let d = a.allocate(2 * MIB, b_s).unwrap();
    ok(&a);
    assert_eq!(d.ptr - b.ptr, 42 * MIB, "the layout this test relies on");
    a.free(e.ptr).unwrap();
    for x in xs {
        a.free(x).unwrap();
        ok(&a);
    }
    if complete_before {
        sim.complete_all();
    }
    assert_eq!(a.cached_bytes(), 40 * MIB);
    assert_eq!(syncs(&sim), 0);
    let big = a.allocate(44 * MIB, b_s).unwrap();
    ok(&a);
    assert!(a.stats().reserved_bytes.current <= 64 * MIB);
    spy.assert_one_handle_per_mapping();
    let out = spy.log().syncs.clone();
    for p in [b.ptr, d.ptr, big.ptr] {
        a.free(p).unwrap();
    }
    ok(&a);
    out
}

#[test]
fn pressure_syncs_only_the_stream_that_freed_the_reclaimed_pages() {
    let a_s = StreamId(7);
    for parts in [1, 2, 5] {
        let syncs = reclaim_after_frees_on_a(parts, false);
        assert!(
            syncs.iter().all(|&s| s == a_s),
            "{parts} frees: synchronised {syncs:?}, only stream 7 freed on those pages"
        );
        assert!(syncs.len() <= 1, "{parts} frees: {syncs:?}");
    }
}

#[test]
fn pressure_makes_no_sync_when_the_freeing_work_completed() {
    let syncs = reclaim_after_frees_on_a(1, true);
    assert!(
        syncs.is_empty(),
        "synchronised {syncs:?} for completed work"
    );
}

#[test]
fn pressure_makes_no_sync_when_several_frees_completed() {
    for parts in [2, 5] {
        let syncs = reclaim_after_frees_on_a(parts, true);
        assert!(
            syncs.is_empty(),
            "{parts} frees: synchronised {syncs:?} for completed work"
        );
    }
    // The smallest case: two frees on one stream, the device catches up,
    // then empty_cache (the work declared: the event empty_cache records
    // on demand, after the catch-up, completes at once).
    let (sim, spy, a) = spy_setup(1 << 30, QuiltConfig::default());
    sim.queue_work(S0);
    let x = a.allocate(4 * MIB, S0).unwrap();
    let y = a.allocate(4 * MIB, S0).unwrap();
    sim.queue_work(S1);
    let z = a.allocate(4 * MIB, S1).unwrap();
    sim.queue_work(S0);
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    sim.complete_all();
    a.empty_cache().unwrap();
    ok(&a);
    let syncs = spy.log().syncs.clone();
    assert!(
        syncs.is_empty(),
        "synchronised {syncs:?} for completed work"
    );
    a.free(z.ptr).unwrap();
}

#[test]
fn empty_cache_syncs_only_streams_whose_frees_may_be_running() {
    let (sim, spy, a) = spy_setup(1 << 30, QuiltConfig::default());
    // The program's work is declared on both streams (an event then
    // completes once the work queued before it has): frees record nothing,
    // and the event empty_cache records on demand on stream 1, caught up,
    // completes at once.
    sim.queue_work(S0);
    let x = a.allocate(8 * MIB, S0).unwrap();
    sim.queue_work(S1);
    let y = a.allocate(8 * MIB, S1).unwrap();
    sim.queue_work(S0);
    a.free(x.ptr).unwrap();
    sim.queue_work(S1);
    a.free(y.ptr).unwrap();
    ok(&a);
    sim.complete_stream(S1);
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(spy.log().syncs, vec![S0]);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    // Everything complete: no sync at all.
    let x = a.allocate(8 * MIB, S0).unwrap();
    let y = a.allocate(8 * MIB, S1).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    sim.complete_all();
    a.empty_cache().unwrap();
    ok(&a);
    assert_eq!(spy.log().syncs, vec![S0]);
    spy.assert_one_handle_per_mapping();
}

#[test]
fn oom_only_when_too_few_pages_are_free_or_reclaimable() {
    // 32 pages. Live blocks hold 16 pages (every other one); the 16 others
    // are cached, with frees pending on two streams. A request of 16 pages
    // (32 MiB, page aligned) is served; one page more is refused as capacity.
    let (sim, a) = setup(64 * MIB);
    let ptrs: Vec<u64> = (0..32)
        .map(|i| a.allocate(2 * MIB, StreamId(i % 2)).unwrap().ptr)
        .collect();
    for p in ptrs.iter().step_by(2) {
        a.free(*p).unwrap();
        ok(&a);
    }
    let e = a.allocate(34 * MIB, S0).unwrap_err();
    assert_eq!(e.oom_report().unwrap().verdict, OomVerdict::Capacity);
    ok(&a);
    let big = a.allocate(32 * MIB, S0).unwrap();
    ok(&a);
    assert!(matches!(a.allocate(1, S1), Err(AllocError::OutOfMemory(_))));
    a.free(big.ptr).unwrap();
    for p in ptrs.iter().skip(1).step_by(2) {
        a.free(*p).unwrap();
    }
    ok(&a);
    drop(a);
    assert!(sim.leak_report().is_empty());
}

#[test]
fn configurations_that_break_a_promise_are_refused() {
    let sim: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let base = QuiltConfig::default();
    for (config, expect) in [
        (
            QuiltConfig {
                placement: Placement::BestFit { candidates: 0 },
                ..base
            },
            "candidates",
        ),
        (
            QuiltConfig {
                placement: Placement::GmlakeLimits {
                    frag_limit: 0,
                    reuse_limit: 4,
                },
                ..base
            },
            "frag_limit",
        ),
        (
            QuiltConfig {
                layout: ArenaLayout {
                    va_factor: 1,
                    ..base.layout
                },
                ..base
            },
            "va_factor",
        ),
        (
            QuiltConfig {
                layout: ArenaLayout {
                    small: SmallBlocks::Separate { up_to: 0 },
                    ..base.layout
                },
                ..base
            },
            "up_to",
        ),
        (base.named(""), "name"),
        (
            QuiltConfig {
                reclaim: ReclaimPolicy::CachedAbove(1001),
                ..base
            },
            "CachedAbove",
        ),
    ] {
        match QuiltAllocator::new(sim.clone(), config) {
            Err(AllocError::InvalidConfig { reason }) => {
                assert!(reason.contains(expect), "{reason}")
            }
            other => panic!("{expect}: {other:?}"),
        }
    }
    // A page size that is not a multiple of the granularity is a
    // configuration error too, not a driver failure.
    let odd = QuiltConfig {
        pool: PoolConfig {
            page_size: PageSize::Bytes(3 * MIB),
            ..base.pool
        },
        ..base
    };
    assert!(matches!(
        QuiltAllocator::new(sim.clone(), odd),
        Err(AllocError::InvalidConfig { .. })
    ));
    assert!(QuiltAllocator::new(sim.clone(), QuiltConfig::gmlake()).is_ok());
}

#[test]
fn each_configuration_reports_its_own_name_whatever_its_placement() {
    let sim: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(64 * MIB).unwrap());
    let limited = Placement::GmlakeLimits {
        frag_limit: 32 * MIB,
        reuse_limit: 0,
    };
    for (config, name) in [
        (QuiltConfig::default(), "quilt"),
        (QuiltConfig::gmlake(), "gmlake"),
        // Quilt with GMLake's limits is still Quilt, and GMLake stitching
        // every request still GMLake: the name is never derived from a knob.
        (
            QuiltConfig {
                placement: limited,
                ..QuiltConfig::default()
            },
            "quilt",
        ),
        (
            QuiltConfig {
                placement: Placement::BestFit { candidates: 1 },
                ..QuiltConfig::gmlake()
            },
            "gmlake",
        ),
        (QuiltConfig::gmlake().named("gmlake-32mib"), "gmlake-32mib"),
    ] {
        let a = QuiltAllocator::new(sim.clone(), config).unwrap();
        assert_eq!(a.name(), name);
        assert_eq!(a.snapshot().allocator, name);
        let err = a.allocate(100 * MIB, StreamId::DEFAULT).unwrap_err();
        assert_eq!(err.oom_report().unwrap().allocator, name);
        ok(&a);
    }
}

/// Allocate and free on two streams in turn, the device completing work two
/// operations after it was queued.
fn churn_two_streams(sim: &SimVmm, a: &QuiltAllocator, ops: u64) {
    for i in 0..ops {
        let s = if i % 2 == 0 { S0 } else { S1 };
        let x = a.allocate(MIB + (i % 7) * 64 * KIB, s).unwrap();
        a.free(x.ptr).unwrap();
        sim.advance(1);
        ok(a);
    }
}

#[test]
fn completed_progress_events_are_recorded_again_not_destroyed() {
    let (sim, a) = setup(1 << 30);
    sim.set_gpu_lag_ops(2);
    churn_two_streams(&sim, &a, 400);
    let st = sim.driver_stats();
    assert!(st.count(CallKind::EventRecord) >= 200, "{st:?}");
    assert_eq!(st.count(CallKind::EventDestroy), 0, "reused, not destroyed");
    // The pending events of two streams and the spares: a handful.
    let live = sim.leak_report().events;
    assert!(live <= 16, "{live} live events");
    drop(a);
    assert!(sim.leak_report().is_empty(), "{:?}", sim.leak_report());
}

#[test]
fn a_failed_record_of_a_spare_event_falls_back_to_a_new_one() {
    let (sim, a) = setup(1 << 30);
    sim.set_gpu_lag_ops(2);
    churn_two_streams(&sim, &a, 50);
    let before = sim.driver_stats();
    // The next records are of spares: the first fails (its event is
    // destroyed, a new one recorded), the third too.
    sim.inject(Fault::nth(CallKind::EventRecord, 1));
    sim.inject(Fault::nth(CallKind::EventRecord, 3));
    churn_two_streams(&sim, &a, 50);
    let d = sim.driver_stats().since(&before);
    assert_eq!(d.failed[CallKind::EventRecord.index()], 2, "{d:?}");
    assert!(d.count(CallKind::EventDestroy) >= 1, "{d:?}");
    drop(a);
    assert!(sim.leak_report().is_empty(), "{:?}", sim.leak_report());
}

/// `reset_peak_stats` sets every peak to its current value, on Quilt and on
/// the caching baseline, and the peaks climb again from there.
#[test]
fn resetting_the_peaks_starts_them_from_now() {
    use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
    let allocators: Vec<Box<dyn DeviceAllocator>> = vec![
        Box::new(
            QuiltAllocator::new(
                Arc::new(SimVmm::with_capacity(1 << 30).unwrap()),
                QuiltConfig::default(),
            )
            .unwrap(),
        ),
        Box::new(
            CachingAllocator::new(
                Arc::new(SimVmm::with_capacity(1 << 30).unwrap()),
                CachingConfig::classic(),
            )
            .unwrap(),
        ),
    ];
    for a in allocators {
        let big = a.allocate(64 << 20, StreamId::DEFAULT).unwrap();
        let small = a.allocate(1 << 20, StreamId::DEFAULT).unwrap();
        a.free(big.ptr).unwrap();
        let before = a.stats();
        assert!(before.allocated_bytes.peak >= 65 << 20, "{}", a.name());
        a.reset_peak_stats().unwrap();
        let after = a.stats();
        assert_eq!(
            after.allocated_bytes.peak,
            after.allocated_bytes.current,
            "{}",
            a.name()
        );
        assert_eq!(after.allocation.peak, 1, "{}", a.name());
        assert!(after.allocated_bytes.peak < before.allocated_bytes.peak);
        let again = a.allocate(2 << 20, StreamId::DEFAULT).unwrap();
        assert!(a.stats().allocated_bytes.peak >= after.allocated_bytes.current + (2 << 20));
        a.free(again.ptr).unwrap();
        a.free(small.ptr).unwrap();
        a.check_invariants().unwrap();
    }
}
